// bench_kernels_a.cpp: timings of the part-A CUDA kernels on the shapes of
// reference/torch_ref.py `bench --workload kernels`, printed as JSON lines
//   {"impl":"loom","kernel":"layernorm_fwd","ms":..,"gb_per_s":..,"shape":"16384x768 bf16"}
// Bytes are counted as the reference counts them (norms: 4 M D; AdamW: 7 * 4 * n); GEMM
// reports TFLOP/s. Each number is the median of 20 event-timed runs after 5 warm-ups; norm
// inputs rotate over 4 buffer sets so that the 50 MB L2 does not serve repeated runs.
// Inputs are random (a seeded 1M-element block tiled over each buffer), never zeros.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>
#include <vector>

#include "bench/bench_timing.h"
#include "kernels/kernels.h"

namespace cu = loom::cuda;
using loom::bf16;

namespace {

template <class T> T* random_buffer(size_t n, uint64_t seed, float lo = -1.f, float hi = 1.f) {
  const size_t block = std::min<size_t>(n, 1 << 20);
  std::vector<T> h(block);
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  for (auto& x : h) x = T(d(g));
  T* p = static_cast<T*>(cu::device_malloc(n * sizeof(T)));
  for (size_t off = 0; off < n; off += block)
    cu::memcpy_h2d(p + off, h.data(), std::min(block, n - off) * sizeof(T), cu::default_stream());
  return p;
}

using loom::bench::median_ms;  // bench_timing.h

void emit(const char* kernel, double ms, const char* shape, double bytes, double flops) {
  std::printf("{\"impl\":\"loom\",\"kernel\":\"%s\",\"ms\":%.4f", kernel, ms);
  if (bytes > 0) std::printf(",\"gb_per_s\":%.1f", bytes / ms / 1e6);
  if (flops > 0) std::printf(",\"tflops\":%.1f", flops / ms / 1e9);
  std::printf(",\"shape\":\"%s\"}\n", shape);
  std::fflush(stdout);
}

}  // namespace

int main() {
  if (!cu::available()) {
    std::fprintf(stderr, "no CUDA device\n");
    return 4;
  }
  cudaStream_t s = cu::default_stream();
  {
    const int64_t M = 16384;
    const int D = 768, Dr = 576, sets = 4;
    std::vector<bf16*> x, out, dout, dx;
    for (int i = 0; i < sets; i++) {
      x.push_back(random_buffer<bf16>(M * D, 1 + i));
      dout.push_back(random_buffer<bf16>(M * D, 11 + i));
      out.push_back(random_buffer<bf16>(M * D, 21 + i));
      dx.push_back(random_buffer<bf16>(M * D, 31 + i));
    }
    bf16* w = random_buffer<bf16>(D, 40, 0.5f, 1.5f);
    bf16* b = random_buffer<bf16>(D, 41);
    bf16* dw = random_buffer<bf16>(D, 42);
    bf16* db = random_buffer<bf16>(D, 43);
    float* mean = random_buffer<float>(M, 44);
    float* rstd = random_buffer<float>(M, 45, 0.5f, 2.f);
    double ms = median_ms([&](int i) { cu::layernorm_forward(out[i % sets], mean, rstd, x[i % sets], w, b, M, D, 1e-6, s); });
    emit("layernorm_fwd", ms, "16384x768 bf16", 4.0 * M * D, 0);
    ms = median_ms([&](int i) { cu::rmsnorm_forward(out[i % sets], rstd, x[i % sets], w, M, Dr, 1e-5, s); });
    emit("rmsnorm_fwd", ms, "16384x576 bf16", 4.0 * M * Dr, 0);
    // The rows above rotate 4 buffer sets so that every call reads from DRAM (the L2 holds
    // 50-60 MB: one set would stay resident). torch_ref.py times its norms on one buffer,
    // called again and again; the same method here, for the side-by-side ratio:
    ms = median_ms([&](int) { cu::layernorm_forward(out[0], mean, rstd, x[0], w, b, M, D, 1e-6, s); });
    emit("layernorm_fwd", ms, "16384x768 bf16, one buffer (torch_ref's method)", 4.0 * M * D, 0);
    ms = median_ms([&](int) { cu::rmsnorm_forward(out[0], rstd, x[0], w, M, Dr, 1e-5, s); });
    emit("rmsnorm_fwd", ms, "16384x576 bf16, one buffer (torch_ref's method)", 4.0 * M * Dr, 0);
    ms = median_ms([&](int i) {
      cudaMemcpyAsync(out[i % sets], x[i % sets], size_t(M) * Dr * sizeof(bf16), cudaMemcpyDeviceToDevice, s);
    });
    emit("copy_d2d", ms, "16384x576 bf16 (the bytes of rmsnorm_fwd; 4 buffer sets)", 4.0 * M * Dr, 0);
    ms = median_ms([&](int i) {
      cu::layernorm_backward(dx[i % sets], static_cast<const bf16*>(nullptr), dw, db, dout[i % sets], x[i % sets], w, mean, rstd, M, D, s);
    });
    emit("layernorm_bwd", ms, "16384x768 bf16", 6.0 * M * D, 0);  // dout, x read; dinp written
    // the LM's norm backward: dresid read too (the residual stream's gradient)
    ms = median_ms([&](int i) {
      cu::rmsnorm_backward(dx[i % sets], out[i % sets], dw, dout[i % sets], x[i % sets], w, rstd, M, Dr, s);
    });
    emit("rmsnorm_bwd", ms, "16384x576 bf16, + dresid", 8.0 * M * Dr, 0);  // dout, x, dresid read; dinp written
    ms = median_ms([&](int i) { cu::gelu_forward(dx[i % sets], x[i % sets], M * D, s); });
    emit("gelu_fwd", ms, "16384x768 bf16", 4.0 * M * D, 0);
    for (int i = 0; i < sets; i++) {
      cu::device_free(x[i]); cu::device_free(out[i]); cu::device_free(dout[i]); cu::device_free(dx[i]);
    }
  }
  {
    const int n = 8192;
    bf16* A = random_buffer<bf16>(size_t(n) * n, 50);
    bf16* B = random_buffer<bf16>(size_t(n) * n, 51);
    bf16* C = random_buffer<bf16>(size_t(n) * n, 52);
    double ms = median_ms([&](int) { cu::gemm(C, A, B, n, n, n, false, false, 1.0, 0.0, 1, 0, 0, 0, s); });
    emit("gemm_bf16", ms, "8192^3", 0, 2.0 * n * n * n);
    cu::device_free(A); cu::device_free(B); cu::device_free(C);
  }
  {
    // SmolLM2-135M-sized parameters, the same list as the reference, stored flat (one group)
    int64_t nparam = 49152LL * 576 + 30LL * (576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536);
    float* p = random_buffer<float>(nparam, 60);
    float* m = random_buffer<float>(nparam, 61, -0.01f, 0.01f);
    float* v = random_buffer<float>(nparam, 62, 0.f, 1e-4f);
    float* g = random_buffer<float>(nparam, 63);
    loom::AdamWHyper h;
    h.lr = 1e-4f; h.weight_decay = 0.01f;
    char shape[64];
    std::snprintf(shape, sizeof shape, "%.1fM fp32 params", nparam / 1e6);
    double ms = median_ms([&](int i) {
      h.step = 1 + i;
      cu::adamw_update(p, (float*)nullptr, m, v, g, nullptr, nparam, h, s);
    });
    emit("adamw", ms, shape, 7.0 * 4 * nparam, 0);
    cu::device_free(g);
    bf16* gb = random_buffer<bf16>(nparam, 64);
    bf16* copy = random_buffer<bf16>(nparam, 65);
    ms = median_ms([&](int i) {
      h.step = 1 + i;
      cu::adamw_update(p, copy, m, v, gb, nullptr, nparam, h, s);
    });
    std::snprintf(shape, sizeof shape, "%.1fM fp32 params, bf16 grad+copy", nparam / 1e6);
    emit("adamw_bf16_copy", ms, shape, 28.0 * nparam, 0);
    float* nsq = random_buffer<float>(1, 66);
    ms = median_ms([&](int) { cu::grad_norm_squared(nsq, gb, nparam, s); });
    std::snprintf(shape, sizeof shape, "%.1fM bf16", nparam / 1e6);
    emit("grad_norm_squared", ms, shape, 2.0 * nparam, 0);
  }
  cu::synchronize();
  return 0;
}
