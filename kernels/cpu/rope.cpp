// rope.cpp: the CPU reference of rotary position embedding (rotate-half convention).
//
// Shape legend: N tokens, H heads, hd head dim (even), half = hd / 2.
//   inp/out/dout/dinp [N, H, hd] token-major, pos [N] (positions restart in each document).
// For frequency i < half:
//   inv_freq[i] = 1 / theta^(2i / hd),  angle = pos * inv_freq[i]
//   out[i]        = x[i] cos(angle) - x[i+half] sin(angle)
//   out[i+half]   = x[i+half] cos(angle) + x[i] sin(angle)
// The backward is the transpose of that rotation, i.e. the rotation by -angle:
//   dinp[i]       = dout[i] cos + dout[i+half] sin
//   dinp[i+half]  = dout[i+half] cos - dout[i] sin                        (=)
// Nothing is saved: the angles are recomputed from pos.
//
// Precision follows the reference (rope_cos_sin in torch_ref.py): inv_freq, the angle and
// cos/sin are computed in A = acc_t<T> (float for float activations, double for double), so
// an f32 run and the f32 reference round the angle the same way. At pos ~ 1e4 the float angle
// carries an absolute error of ~1e-3 rad; that is the reference's behaviour, not ours to fix.
// Each (token, frequency) angle is computed once and applied to all H heads. out may alias
// inp: both halves of a pair are read before either is written.
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "kernels/kernels.h"

namespace loom::cpu {
namespace {

constexpr int64_t kParallelMin = 32768;

template <class A> std::vector<A> inverse_frequencies(int hd, double theta) {
  if (hd <= 0 || hd % 2 != 0)
    throw std::invalid_argument("rope: expected an even head dim hd, got " + std::to_string(hd));
  std::vector<A> inv_freq(hd / 2);
  for (int i = 0; i < hd / 2; i++)
    inv_freq[i] = A(1) / std::pow(A(theta), A(2 * i) / A(hd));
  return inv_freq;
}

// sign = +1 rotates by +angle (forward), -1 by -angle (backward).
template <class T>
void rotate(T* out, int64_t ldo, const T* inp, int64_t ldi, const int32_t* pos, int64_t N, int H, int hd,
            double theta, int sign) {
  using A = acc_t<T>;
  const std::vector<A> inv_freq = inverse_frequencies<A>(hd, theta);
  const int half = hd / 2;
  parallel_for(N, [&](int64_t n) {
    for (int i = 0; i < half; i++) {
      const A angle = A(pos[n]) * inv_freq[i];
      const A cos_a = std::cos(angle), sin_a = A(sign) * std::sin(angle);
      for (int h = 0; h < H; h++) {
        const T* x = inp + n * ldi + h * hd;
        T* y = out + n * ldo + h * hd;
        const A x1 = A(x[i]), x2 = A(x[i + half]);
        y[i] = T(x1 * cos_a - x2 * sin_a);
        y[i + half] = T(x2 * cos_a + x1 * sin_a);
      }
    }
  }, N * H * hd > kParallelMin);
}

}  // namespace

template <class T>
void rope_forward(T* out, const T* inp, const int32_t* pos, int64_t N, int H, int hd, double theta,
                  Stream) {
  rotate(out, int64_t(H) * hd, inp, int64_t(H) * hd, pos, N, H, hd, theta, +1);
}

template <class T>
void rope_backward(T* dinp, const T* dout, const int32_t* pos, int64_t N, int H, int hd,
                   double theta, Stream) {
  rotate(dinp, int64_t(H) * hd, dout, int64_t(H) * hd, pos, N, H, hd, theta, -1);
}

// The joined rows of a q|k|v product, split: q and k rotated, v copied (and back).
template <class T>
void rope_qkv_split(T* q, T* k, T* v, const T* qkv, const int32_t* pos, int64_t N, int H, int KV, int hd,
                    double theta, Stream) {
  const int64_t W = int64_t(H + 2 * KV) * hd, qw = int64_t(H) * hd, kw = int64_t(KV) * hd;
  rotate(q, qw, qkv, W, pos, N, H, hd, theta, +1);
  rotate(k, kw, qkv + qw, W, pos, N, KV, hd, theta, +1);
  for (int64_t n = 0; n < N; n++)
    for (int64_t j = 0; j < kw; j++) v[n * kw + j] = qkv[n * W + qw + kw + j];
}

template <class T>
void rope_qkv_join(T* dqkv, const T* dq, const T* dk, const T* dv, const int32_t* pos, int64_t N, int H, int KV,
                   int hd, double theta, Stream) {
  const int64_t W = int64_t(H + 2 * KV) * hd, qw = int64_t(H) * hd, kw = int64_t(KV) * hd;
  rotate(dqkv, W, dq, qw, pos, N, H, hd, theta, -1);
  rotate(dqkv + qw, W, dk, kw, pos, N, KV, hd, theta, -1);
  for (int64_t n = 0; n < N; n++)
    for (int64_t j = 0; j < kw; j++) dqkv[n * W + qw + kw + j] = dv[n * kw + j];
}

// The product into a scratch of joined rows, then the split (the specification of the fused
// CUDA path: kernels.inc)
template <class T>
void linear_qkv_rope(T* q, T* k, T* v, const T* inp, const T* w, const int32_t* pos, int64_t N, int C, int H, int KV,
                     int hd, double theta, Stream s) {
  const int W = (H + 2 * KV) * hd;
  std::vector<T> qkv(size_t(N) * W);
  linear_forward(qkv.data(), inp, w, (const T*)nullptr, N, C, W, s);
  rope_qkv_split(q, k, v, qkv.data(), pos, N, H, KV, hd, theta, s);
}

#define LOOM_ROPE(T)                                                                            \
  template void rope_forward<T>(T*, const T*, const int32_t*, int64_t, int, int, double, Stream); \
  template void rope_backward<T>(T*, const T*, const int32_t*, int64_t, int, int, double, Stream); \
  template void rope_qkv_split<T>(T*, T*, T*, const T*, const int32_t*, int64_t, int, int, int, double, Stream); \
  template void rope_qkv_join<T>(T*, const T*, const T*, const T*, const int32_t*, int64_t, int, int, int, double, Stream); \
  template void linear_qkv_rope<T>(T*, T*, T*, const T*, const T*, const int32_t*, int64_t, int, int, int, int, double, \
                                   Stream);
LOOM_ROPE(float)
LOOM_ROPE(double)
#undef LOOM_ROPE

}  // namespace loom::cpu
