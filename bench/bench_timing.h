// bench_timing.h: how the kernel benchmarks time a call (bench_kernels_a, bench_attention,
// bench_losses, bench_gemm_shapes). CUDA builds only.
//
// median_ms(f, warmup, iters): f(i) for i < warmup, untimed (first-call costs: plans, caches,
// lazy module loads), a synchronize, then `iters` runs each between two events on the default
// stream; the median of their milliseconds. The events time the GPU's work for the call, not
// the host's launch; the median drops the run that met a clock change or another process. f
// takes the run's index, so that a benchmark can rotate over several input buffers and keep
// them out of the 50 MB L2 (bench_kernels_a's norms).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "kernels/kernels.h"

namespace loom::bench {

inline double median_ms(const std::function<void(int)>& f, int warmup = 5, int iters = 20) {
  for (int i = 0; i < warmup; i++) f(i);
  cuda::synchronize();
  cudaStream_t s = cuda::default_stream();
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<double> ms;
  for (int i = 0; i < iters; i++) {
    cudaEventRecord(a, s);
    f(i);
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace loom::bench
