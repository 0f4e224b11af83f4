// rope.cuh: the two device functions every rotary-embedding kernel shares (rope.cu's kernels and
// gemm_sm90.cu's q|k|v epilogue), so that all of them round a rotation the same way and agree
// bit for bit. rope.cu's header has the math and the precision notes; rope_table.h the table of
// angles a product's epilogue looks up instead of forming them in double.
#pragma once
#include "kernels/cuda/common.cuh"

namespace loom::cuda {

// cos and sin of pair i at position pos, formed in double (rope.cu, Precision); sin negated in
// the backward (the rotation by -angle).
template <bool BACKWARD>
__device__ __forceinline__ void rope_cos_sin(float& cs, float& sn, int32_t pos, int i, int hd, double log_theta) {
  double sd, cd;
  sincos(double(pos) * exp(-log_theta * (2.0 * i) / hd), &sd, &cd);
  cs = float(cd);
  sn = BACKWARD ? -float(sd) : float(sd);
}

// The rotation of one pair, rounded the same way in every kernel: one multiply, then one fused
// multiply-add (explicit intrinsics, so the compiler cannot contract the two products
// differently from one kernel to the next).
__device__ __forceinline__ void rotate_pair(float& y0, float& y1, float x0, float x1, float cs, float sn) {
  y0 = __fmaf_rn(x0, cs, __fmul_rn(-x1, sn));
  y1 = __fmaf_rn(x1, cs, __fmul_rn(x0, sn));
}

// (cos, sin) of pair i at position p for head dim 64, forward sign, in double: the fallback of
// the kernels that look angles up in rope_table.h's table (gemm_sm90.cu's q|k|v epilogue, the
// attention backward's joined q|k|v gradient) for positions past it. A call, not inlined, so
// that their code stays short (32 inlined copies of the double sincos ran the product's
// epilogue several times slower, table hits or not).
static __device__ __noinline__ float2 rope_angle(int32_t p, int i, double log_theta) {
  float cs, sn;
  rope_cos_sin<false>(cs, sn, p, i, 64, log_theta);
  return make_float2(cs, sn);
}

// The table's entry where it has one, else the formula.
static __device__ __forceinline__ float2 rope_lookup(const float2* table, int table_rows, int32_t p, int i,
                                                     double log_theta) {
  return p >= 0 && p < table_rows ? table[int64_t(p) * 32 + i] : rope_angle(p, i, log_theta);
}

}  // namespace loom::cuda
