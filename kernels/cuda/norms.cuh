// norms.cuh: what norms.cu (the forward kernels) and norms_backward.cu share: a row's 16-byte
// vector loads and stores, the sum over the threads that own a row, and the choice of vector
// width and threads per row. The kernels' notes are norms.cu's header.
#pragma once
#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace loom::cuda::norm_rows {

constexpr int kChunks = 4;  // vectors per thread

template <class DT, int VEC>
__device__ __forceinline__ void load_vec(float (&f)[VEC], const DT* p) {
  Pack<DT, VEC> k = *reinterpret_cast<const Pack<DT, VEC>*>(p);
#pragma unroll
  for (int i = 0; i < VEC; i++) f[i] = to_float(k.v[i]);
}
template <class DT, int VEC>
__device__ __forceinline__ void store_vec(DT* p, const float (&f)[VEC]) {
  Pack<DT, VEC> k;
#pragma unroll
  for (int i = 0; i < VEC; i++) k.v[i] = from_float<DT>(f[i]);
  *reinterpret_cast<Pack<DT, VEC>*>(p) = k;
}

// Sum over the TPR threads that own a row. For TPR == 32 a warp shuffle; otherwise the whole
// block (blockDim == TPR), through shared memory; every thread gets the same value.
template <int TPR>
__device__ __forceinline__ float2 group_sum2(float2 v, float2* sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v.x += __shfl_xor_sync(0xffffffffu, v.x, o);
    v.y += __shfl_xor_sync(0xffffffffu, v.y, o);
  }
  if constexpr (TPR > 32) {
    __syncthreads();  // sh may still be read by the previous reduction
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    v = make_float2(0.f, 0.f);
#pragma unroll 4
    for (int i = 0; i < TPR / 32; i++) { v.x += sh[i].x; v.y += sh[i].y; }
  }
  return v;
}

template <class T> constexpr int kVec = 16 / int(sizeof(T));

// Which vector width and group size a row of C elements gets; tpr == 0 means the generic path.
template <class T>
void pick(int C, bool vec_ok, int* vec, int* tpr) {
  *vec = vec_ok && C % kVec<T> == 0 ? kVec<T> : 1;
  *tpr = 0;
  for (int t : {32, 128, 1024})
    if (int64_t(t) * kChunks * *vec >= C) { *tpr = t; break; }
}

}  // namespace loom::cuda::norm_rows
