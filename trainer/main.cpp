// main.cpp: the `train` executable.
//   ./train CONFIG [--section.key=value ...]     train (a bare name is looked up in configs/)
//   ./train check FIXTURE [--device cpu|cuda]    fixture check against PyTorch / HF goldens
//   ./train tokenize --tokenizer tokenizer.json  text on stdin -> ids (JSON) on stdout
//   ./train chat CHECKPOINT --image IMG          ask a trained VLM about an image
//   ./train eval RUN_OR_CHECKPOINT [--k=v ...]   the run's evaluation again, from a checkpoint
//   ./train export RUN_OR_CHECKPOINT --hf DIR    a VLM as HF folders (LlamaForCausalLM + SigLIP)
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
               "  ./train tokenize --tokenizer FILE [--decode] text <-> token ids on stdin/stdout\n"
               "  ./train chat CHECKPOINT --image IMG [--prompt TEXT] [--temperature T]\n"
               "  ./train eval RUN_OR_CHECKPOINT [--section.key=value ...]\n"
               "                                               the run's end-of-training evaluation from its newest\n"
               "                                               (or the given) checkpoint, without training\n"
               "  ./train export RUN_OR_CHECKPOINT --hf DIR    a VLM run as Hugging Face folders: DIR (LlamaForCausalLM,\n"
               "                                               tokenizer, chat template), DIR/vision (SiglipVisionModel)\n");
}

// OpenMP's idle threads. libgomp lets a thread that has finished its share of a parallel loop
// spin up to 300000 times before it sleeps, so between two parallel kernels the second core
// stays busy while the main thread runs the serial work (autograd bookkeeping, small ops). On
// a 2-core virtual machine that spinning slowed the main thread: a vlm_sft.cfg CPU step took
// 0.18 s with libgomp's default and 0.12-0.14 s with 20000 spins (2026-11-23, 2-core KVM guest,
// 150 steps, GOMP_SPINCOUNT 1000 / 5000 / 20000 / 100000 / passive; 20000 the fastest, passive
// the slowest). libgomp reads its spin count once, when it loads, before main; so `train`
// starts itself again with GOMP_SPINCOUNT in the environment. A user's own OMP_WAIT_POLICY
// or GOMP_SPINCOUNT is kept as it is.
static void set_openmp_spin(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") || std::getenv("GOMP_SPINCOUNT")) return;
  ::setenv("GOMP_SPINCOUNT", "20000", 1);
  ::execv("/proc/self/exe", argv);  // returns only if it failed: go on with libgomp's default
}

int main(int argc, char** argv) {
  set_openmp_spin(argv);
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
