// In a CPU-only build (make CUDA=0) the GPU tests cannot be linked; each is replaced by this
// program, which says so and exits with ctest's skip code, so the test shows as skipped.
#include <cstdio>
int main() {
  std::printf("GPU test skipped: this is a CPU-only build (make CUDA=0)\n");
  return 4;
}
