// vec_test_util.h: the host-vector helpers of the attention and loss tests
// (test_cuda_kernels_b.cpp, test_cuda_attention_cudnn.cpp, test_cuda_losses.cpp), on top of
// cuda_kernel_test_util.h (need_gpu, tol_of, the namespaces): a device array of T that uploads
// from and downloads to std::vector<T> (DBuf speaks float), normal random data, device-type
// copies and the values a 16-bit device sees.
#pragma once
#include <cmath>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "tests/cuda/cuda_kernel_test_util.h"

namespace {

// A device array that uploads from / downloads to host vectors.
template <class T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t n_) : n(n_) { p = static_cast<T*>(cu::device_malloc(sizeof(T) * (n ? n : 1))); }
  explicit Dev(const std::vector<T>& h) : Dev(h.size()) { up(h); }
  ~Dev() { cu::device_free(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  void up(const std::vector<T>& h) {
    if (n) cu::memcpy_h2d(p, h.data(), sizeof(T) * n, cu::default_stream());
  }
  std::vector<T> down() const {
    std::vector<T> h(n);
    if (n) cu::memcpy_d2h(h.data(), p, sizeof(T) * n, cu::default_stream());
    return h;
  }
  void poison() { up(std::vector<T>(n, T(std::numeric_limits<float>::quiet_NaN()))); }
};

std::vector<float> randn(size_t n, std::mt19937& rng, float sd = 1.f) {
  std::normal_distribution<float> d(0.f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Device-type copy of f32 data, and the f32 values the device actually sees (bf16-rounded).
template <class T>
std::vector<T> to_t(const std::vector<float>& v) {
  std::vector<T> r(v.size());
  for (size_t i = 0; i < v.size(); i++) r[i] = T(v[i]);
  return r;
}
template <class T>
std::vector<float> seen(const std::vector<float>& v) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); i++) r[i] = float(T(v[i]));
  return r;
}
template <class T>
std::vector<float> to_f(const std::vector<T>& v) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); i++) r[i] = float(v[i]);
  return r;
}
// +inf on both sides is a match (rows that see nothing); map it to a large finite value.
std::vector<float> inf_to_big(std::vector<float> v) {
  for (auto& x : v)
    if (std::isinf(x) && x > 0) x = 1e30f;
  return v;
}

template <class T> tol::Tol out_tol() { return tol_of<T>(); }
template <class T> tol::Tol gemm_tol() { return tol_of<T>(true); }
template <class T> const char* tname() {
  return std::is_same<T, float>::value ? "f32" : std::is_same<T, f16>::value ? "f16" : "bf16";
}

}  // namespace
