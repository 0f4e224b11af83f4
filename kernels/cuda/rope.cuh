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

}  // namespace loom::cuda
