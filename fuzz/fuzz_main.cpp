// fuzz_main.cpp: libFuzzer's entry point for one target, chosen at build time
// (-DLOOM_FUZZ_TARGET=safetensors builds fuzz_safetensors; see CMakeLists.txt, make fuzz).
#include "fuzz/targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return loom::fuzz::LOOM_FUZZ_TARGET(data, size);
}
