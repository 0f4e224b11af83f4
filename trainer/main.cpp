// main.cpp: the `train` executable.
//   ./train CONFIG [--section.key=value ...]     train (a bare name is looked up in configs/)
//   ./train check FIXTURE [--device cpu|cuda]    fixture check against PyTorch / HF goldens
//   ./train tokenize --tokenizer tokenizer.json  text on stdin -> ids (JSON) on stdout
//   ./train chat CHECKPOINT --image IMG          ask a trained VLM about an image
//   ./train eval RUN_OR_CHECKPOINT [--k=v ...]   the run's evaluation again, from a checkpoint
//   ./train export RUN_OR_CHECKPOINT --hf DIR    a VLM as HF folders (LlamaForCausalLM + SigLIP)
#include <malloc.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

#include "data/tokenizer.h"
#include "trainer/check.h"
#include "trainer/eval.h"
#include "trainer/export.h"
#include "trainer/trainer.h"

static void usage() {
  std::fprintf(stderr,
               "usage:\n"
               "  ./train CONFIG [--section.key=value ...]     train (configs/CONFIG when a bare name)\n"
               "  ./train check FIXTURE [--device cpu|cuda] [--train.attention=auto|loom|cudnn]\n"
               "                                               compare with PyTorch/HF goldens\n"
               "  ./train tokenize --tokenizer FILE [--decode] [--add-special-tokens]\n"
               "                                               text <-> token ids on stdin/stdout\n"
               "  ./train chat CHECKPOINT --image IMG [--prompt TEXT] [--temperature T] [--top_k K]\n"
               "               [--top_p P] [--seed S] [--max_new_tokens N]   greedy unless T > 0\n"
               "  ./train eval RUN_OR_CHECKPOINT [--section.key=value ...]\n"
               "                                               the run's end-of-training evaluation from its newest\n"
               "                                               (or the given) checkpoint, without training\n"
               "  ./train export RUN_OR_CHECKPOINT --hf DIR    a VLM run as Hugging Face folders: DIR (LlamaForCausalLM,\n"
               "                                               tokenizer, chat template), DIR/vision (SiglipVisionModel)\n");
}

// The host heap. A CPU step allocates and frees the same few hundred activation buffers every
// step, many of them 0.1-4 MB. glibc's malloc serves a block above its mmap threshold (128 KiB
// at first, raised as such blocks are freed) with a fresh mmap, and gives the top of its heap
// back to the kernel once more than its trim threshold is free there; either way the next step
// touches new pages, and the kernel zeroes each one on its first touch. Here blocks up to
// 32 MiB (glibc's largest mmap threshold) stay in the heap and 1 GiB may stay free at its top.
// Measured (2026-11-26, 2-core KVM guest, same losses bit for bit): 300 vlm_sft.cfg steps 2.3M
// -> 0.2M minor faults and 6.8-7.1 -> 1.4-1.5 s of system time; wall time within this machine's
// noise (300 steps 38.3-40.8 -> 35.7-37.5 s in alternated pairs, but the whole default run
// 3500 steps took 406 s without and 405 s with it). vit_mim.cfg 100 steps 0.7M -> 0.2M faults.
// The memory stays the process's, which a training process reuses every step anyway. A user's
// own malloc settings (GLIBC_TUNABLES with glibc.malloc.*, MALLOC_MMAP_THRESHOLD_,
// MALLOC_TRIM_THRESHOLD_) win.
static void set_malloc_policy() {
#ifdef __GLIBC__
  const char* tun = std::getenv("GLIBC_TUNABLES");
  if ((tun && std::strstr(tun, "glibc.malloc.")) || std::getenv("MALLOC_MMAP_THRESHOLD_") ||
      std::getenv("MALLOC_TRIM_THRESHOLD_"))
    return;
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
#endif
}

int main(int argc, char** argv) {
  set_malloc_policy();
  if (argc < 2 || !std::strcmp(argv[1], "-h") || !std::strcmp(argv[1], "--help")) {
    usage();
    return argc < 2 ? 2 : 0;
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // logs appear line by line when piped to a file
  std::string cmd = argv[1];
  try {
    if (cmd == "check") return loom::check_command(argc - 2, argv + 2);
    if (cmd == "tokenize") return loom::tokenize_command(argc - 2, argv + 2);
    if (cmd == "chat") return loom::chat_command(argc - 2, argv + 2);
    if (cmd == "eval") return loom::eval_command(argc - 2, argv + 2);
    if (cmd == "export") return loom::export_command(argc - 2, argv + 2);
    return loom::train_command(argc - 1, argv + 1);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
