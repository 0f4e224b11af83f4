// vec_exp.h: exp for the CPU kernels' f32 loops, written so that a loop calling it vectorizes.
//
// std::exp is a call into the C library, and a loop with a call in it runs one element at a
// time. exp_acc<float> is a handful of multiplies and adds with no call and no branch, so GCC
// turns a loop of them into AVX2 / AVX-512 code (files that use it are built with
// -fvect-cost-model=dynamic, CMakeLists.txt: -O2 alone vectorizes only loops whose trip count
// the compiler can see; and with -fno-trapping-math, without which GCC 12 turns the selects
// below into blends only with AVX-512's masks: on an AVX2-only CPU the loops stayed scalar). exp_acc<double> is std::exp: the f64 gradient checks keep the C
// library's exp.
//
// The method (as in Cephes' expf and most vector math libraries):
//   x = n ln2 + r, n = round(x / ln2), |r| <= ln2 / 2     (ln2 in two parts: r is exact to ~1e-10)
//   exp(r) = 1 + r + r^2/2! + ... + r^7/7!                 (Taylor, Horner form; the first term
//                                                           left out is r^8/8! <= 5e-9 relative)
//   exp(x) = exp(r) * 2^n                                  (2^n built in the exponent bits)
// Accuracy, in a sweep of every 7th float from -87.33 to 88.72 against double exp: 0.94 ulp at
// worst where the compiler fuses the Horner steps into FMAs (-march=native on a CPU with FMA,
// the default build), 1.22 ulp with separate multiplies and adds (a portable or sanitizer build).
// test_cpu_activations checks fresh random points against 1.25 ulp. Ends: exp(x) = 0 below ln(FLT_MIN) = -87.34 (std::exp gives
// denormals down to -103.97: values under 1.2e-38, which no kernel here tells from 0),
// +inf above ln(FLT_MAX) = 88.72, NaN stays NaN (the trainer's non-finite check relies on it).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace loom::cpu {

inline float exp_f32(float x) {
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round(x / ln2): 1.5 * 2^23 trick
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;  // ln2 = hi + lo
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  // 2^n for n in [-126, 127] from the exponent bits; n = 128 (x in [88.38, 88.72]) as 2^127 * 2.
  // The comparisons are written so that a NaN n lands on -126: converting NaN to an integer is
  // undefined behaviour (the result is replaced by NaN below).
  const float nc = n > -126.f ? (n < 127.f ? n : 127.f) : -126.f;
  const uint32_t bits = uint32_t(int32_t(nc) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  float y = p * two_n * (n > 127.f ? 2.f : 1.f);
  y = x < -87.33654f ? 0.f : y;
  y = x > 88.72283f ? INFINITY : y;
  return x != x ? x : y;
}

template <class A> inline A exp_acc(A x) { return std::exp(x); }
template <> inline float exp_acc<float>(float x) { return exp_f32(x); }

}  // namespace loom::cpu
