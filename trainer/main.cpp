// main.cpp: the `train` executable.
//   ./train CONFIG [--section.key=value ...]     train (a bare name is looked up in configs/)
//   ./train check FIXTURE [--device cpu|cuda]    fixture check against PyTorch / HF goldens
//   ./train tokenize --tokenizer tokenizer.json  text on stdin -> ids (JSON) on stdout
//   ./train chat CHECKPOINT --image IMG          ask a trained VLM about an image
//   ./train eval RUN_OR_CHECKPOINT [--k=v ...]   the run's evaluation again, from a checkpoint
//   ./train export RUN_OR_CHECKPOINT --hf DIR    a VLM as HF folders (LlamaForCausalLM + SigLIP)
#include <cstdio>
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

int main(int argc, char** argv) {
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
