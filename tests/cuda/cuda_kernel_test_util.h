// cuda_kernel_test_util.h: what the CUDA kernel tests (tests/cuda/test_cuda_<family>.cpp)
// share: seeded random inputs, device buffers poisoned with NaN (ints: -7777) on creation, the
// tolerance of a type, and the exit with code 4 (ctest: skipped) when no GPU is present.
//
// Each test runs a CUDA kernel against its loom::cpu reference, forward and backward, in f32
// bf16 and f16. 16-bit runs take inputs rounded to their type and compare with the f32
// reference on those same rounded inputs.
#pragma once
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <random>
#include <type_traits>
#include <vector>

#include "kernels/kernels.h"
#include "tests/tolerances.h"

namespace {

using loom::bf16;
using loom::f16;
using loom::Layout;
namespace cu = loom::cuda;
namespace cpu = loom::cpu;
namespace tol = loom::tol;

inline void need_gpu() {
  if (!cu::available()) {
    std::fprintf(stderr, "no CUDA device: skipping\n");
    std::exit(4);
  }
}
loom::Stream S() { return cu::default_stream(); }

template <class T> tol::Tol tol_of(bool gemm = false) {
  if constexpr (std::is_same_v<T, bf16>) return tol::kCudaBF16;
  else if constexpr (std::is_same_v<T, f16>) return tol::kCudaF16;
  else return gemm ? tol::kCudaF32Gemm : tol::kCudaF32;
}

inline std::vector<float> rnd(size_t n, uint64_t seed, float lo = -1.f, float hi = 1.f) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}
std::vector<int32_t> rnd_int(size_t n, uint64_t seed, int lo, int hi) {  // [lo, hi)
  std::mt19937_64 g(seed);
  std::uniform_int_distribution<int> d(lo, hi - 1);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

template <class T> T to_t(float x) { return T(x); }
template <class T> float to_f(T x) { return float(x); }

// the values a T buffer holds after storing `v`
template <class T> std::vector<float> rounded(std::vector<float> v) {
  for (auto& x : v) x = to_f(to_t<T>(x));
  return v;
}

// A device buffer of n T, poisoned with NaN (ints: -7777) on creation.
template <class T> struct DBuf {
  T* p = nullptr;
  size_t n = 0;
  explicit DBuf(size_t n_) : n(n_) {
    p = static_cast<T*>(cu::device_malloc(std::max<size_t>(1, n) * sizeof(T)));
    poison();
  }
  explicit DBuf(const std::vector<float>& h) : DBuf(h.size()) { put(h); }
  ~DBuf() { cu::device_free(p); }
  DBuf(const DBuf&) = delete;
  void put(const std::vector<float>& h) {
    std::vector<T> t(n);
    for (size_t i = 0; i < n; i++) t[i] = to_t<T>(h[i]);
    cu::memcpy_h2d(p, t.data(), n * sizeof(T), S());
  }
  void poison() {
    std::vector<T> t(n, to_t<T>(std::is_integral_v<T> ? -7777.f : NAN));
    cu::memcpy_h2d(p, t.data(), n * sizeof(T), S());
  }
  std::vector<float> get() const {
    std::vector<T> t(n);
    cu::memcpy_d2h(t.data(), p, n * sizeof(T), S());
    std::vector<float> f(n);
    for (size_t i = 0; i < n; i++) f[i] = to_f(t[i]);
    return f;
  }
};
struct IBuf {  // int32 index array on the device
  int32_t* p;
  explicit IBuf(const std::vector<int32_t>& h) {
    p = static_cast<int32_t*>(cu::device_malloc(std::max<size_t>(1, h.size()) * 4));
    cu::memcpy_h2d(p, h.data(), h.size() * 4, S());
  }
  ~IBuf() { cu::device_free(p); }
};

inline Layout make_layout(std::vector<int64_t> shape, std::vector<int64_t> stride = {}) {
  Layout l;
  l.ndim = int(shape.size());
  int64_t s = 1;
  for (int d = l.ndim - 1; d >= 0; d--) {
    l.shape[d] = shape[d];
    l.stride[d] = stride.empty() ? s : stride[d];
    s *= shape[d];
  }
  return l;
}

#define CHECK_CLOSE(got, ref, t, what) LOOM_CHECK_CLOSE(tol::compare(got, ref, t, what))

}  // namespace
