// colsum.cuh: column sums of a row-major [R, C], out[c] (= or +=) sum over r of in[r, c], for
// linear_backward's bias gradient (matmul.cu) and reduce_sum_to over leading dims (memory.cu: a
// position table's or a broadcast vector's gradient). Deterministic, no atomics: the rows are
// cut into splits (their count depends on R only), block (32, 8) of split y sums its rows of 32
// columns into a partial row [y, C] in fp32 (the 8 row groups added in a fixed order), then one
// thread per column adds the splits in order. Measured forms (16-byte loads, more splits, the
// finish folded into the last block) are in matmul.cu's header.
//
// v2 (wide, the default): 16-byte loads, a thread summing VEC = 16 / sizeof(T) adjacent
// columns, a block (32, 8) covering 32 x VEC columns with 8 row groups; eight rows' loads issued
// before their adds (the adds in row order, as in v1's loop), and splits enough for ~512 blocks:
// ~8x the bytes in flight of v1, whose 2-byte loads, four at a time, left ~2 MB in flight on
// the GPU. The splits' partials are finished by blocks (32, 32) that add every 32nd split and
// then the 32 sums, in a fixed order. Used when C % VEC == 0 and the input is 16-byte aligned;
// LOOM_COLSUM=1 keeps v1 and LOOM_FINISH_GROUPS=8 the finishes' 8 row groups (A/B).
#pragma once
#include <algorithm>
#include <cstdlib>

#include "kernels/cuda/common.cuh"

namespace loom::cuda {
namespace colsum {

// partial[split, c] = sum over this split's rows of x[r, c]; block 32 x 8.
template <class DT>
__global__ void partial_rows(float* __restrict__ partial, const DT* __restrict__ x, int64_t R, int64_t C,
                             int64_t rows_per_split) {
  pdl_entry();
  __shared__ float red[8][33];
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  const int64_t r0 = blockIdx.y * rows_per_split, r1 = min(R, r0 + rows_per_split);
  float acc = 0.f;
  if (c < C)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) acc += to_float(x[r * C + c]);
  red[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float s = 0.f;
    for (int i = 0; i < 8; i++) s += red[i][threadIdx.x];
    partial[int64_t(blockIdx.y) * C + c] = s;
  }
}

// out[c] = (out[c] +) the splits' partials added in order
template <class DT>
__global__ void finish(DT* __restrict__ out, const float* __restrict__ partial, int splits, int64_t C,
                       bool accumulate) {
  pdl_entry();
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float s = 0.f;
  for (int i = 0; i < splits; i++) s += partial[int64_t(i) * C + c];
  out[c] = from_float<DT>(accumulate ? to_float(out[c]) + s : s);
}

// v2: partial[split, c] for VEC columns per thread, 16-byte loads, U rows' loads before their adds.
template <class DT, int U>
__global__ void partial_rows_wide(float* __restrict__ partial, const DT* __restrict__ x, int64_t R, int64_t C,
                                  int64_t rows_per_split) {
  pdl_entry();
  constexpr int VEC = 16 / int(sizeof(DT));
  __shared__ float red[8][32 * VEC + 1];
  const int64_t c0 = (int64_t(blockIdx.x) * 32 + threadIdx.x) * VEC;
  const int64_t r0 = blockIdx.y * rows_per_split, r1 = min(R, r0 + rows_per_split);
  float acc[VEC];
#pragma unroll
  for (int i = 0; i < VEC; i++) acc[i] = 0.f;
  if (c0 < C) {
    const DT* col = x + c0;
    int64_t r = r0 + threadIdx.y;
    for (; r + 8 * (U - 1) < r1; r += 8 * U) {
      uint4 v[U];
#pragma unroll
      for (int j = 0; j < U; j++) v[j] = __ldg(reinterpret_cast<const uint4*>(col + (r + 8 * j) * C));
#pragma unroll
      for (int j = 0; j < U; j++) {
        const DT* e = reinterpret_cast<const DT*>(&v[j]);
#pragma unroll
        for (int i = 0; i < VEC; i++) acc[i] += to_float(e[i]);
      }
    }
    for (; r < r1; r += 8) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(col + r * C));
      const DT* e = reinterpret_cast<const DT*>(&v);
#pragma unroll
      for (int i = 0; i < VEC; i++) acc[i] += to_float(e[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < VEC; i++) red[threadIdx.y][threadIdx.x * VEC + i] = acc[i];
  __syncthreads();
  // 256 threads write the block's 32 * VEC columns: thread (x, y) columns y * 32 + x, + 256, ...
  const int tid = threadIdx.y * 32 + threadIdx.x;
  for (int j = tid; j < 32 * VEC; j += 256) {
    const int64_t c = int64_t(blockIdx.x) * 32 * VEC + j;
    if (c < C) {
      float s = 0.f;
      for (int g = 0; g < 8; g++) s += red[g][j];
      partial[int64_t(blockIdx.y) * C + c] = s;
    }
  }
}

// v2's finish, shared with norms_backward.cu (the norm weight and bias gradients' partial rows):
// out[c] = (out[c] +) sum over g < Y of (sum of p[g + Y k, c] over k), g in order, and the same
// for out2 / p2 where both are given; block 32 x Y (Y = finish_groups()), so that a thread adds
// rows / Y partials (one thread per column over 256 splits would be a chain of 64 round trips
// of 4 loads; with Y = 8 the norm's finish over 264-396 partial rows took 5-11 us, Nsight
// Compute, H200, 2026-12-02). out may be null (only out2 wanted).
template <class DT>
__global__ void finish_rows(DT* __restrict__ out, DT* __restrict__ out2, const float* __restrict__ p,
                            const float* __restrict__ p2, int rows, int64_t C, bool accumulate) {
  pdl_entry();
  __shared__ float red[2][32][33];
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.f, s2 = 0.f;
  if (c < C)
    for (int i = threadIdx.y; i < rows; i += blockDim.y) {
      s += p[int64_t(i) * C + c];
      if (p2) s2 += p2[int64_t(i) * C + c];
    }
  red[0][threadIdx.y][threadIdx.x] = s;
  red[1][threadIdx.y][threadIdx.x] = s2;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    s = s2 = 0.f;
    for (int g = 0; g < int(blockDim.y); g++) {
      s += red[0][g][threadIdx.x];
      s2 += red[1][g][threadIdx.x];
    }
    if (out) out[c] = from_float<DT>(accumulate ? to_float(out[c]) + s : s);
    if (out2 && p2) out2[c] = from_float<DT>(accumulate ? to_float(out2[c]) + s2 : s2);
  }
}

// The row groups of finish_rows: 32, or 8 (its form before 2026-12-02) with
// LOOM_FINISH_GROUPS=8; read once.
inline int finish_groups() {
  static const int y = [] {
    const char* e = std::getenv("LOOM_FINISH_GROUPS");
    return e && e[0] == '8' && e[1] == 0 ? 8 : 32;
  }();
  return y;
}

// finish_rows's launch: out[C] (and out2) from rows x C partials p (and p2)
template <class DT>
inline void launch_finish_rows(DT* out, DT* out2, const float* p, const float* p2, int rows, int64_t C,
                               bool accumulate, Stream s) {
  launch_kernel(finish_rows<DT>, unsigned((C + 31) / 32), dim3(32, finish_groups()), 0, s, out, out2, p, p2, rows, C,
                accumulate);
  LAUNCH_CHECK();
}

// LOOM_COLSUM=1: v1 everywhere (read once)
inline bool wide_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("LOOM_COLSUM");
    return !(e && e[0] == '1' && e[1] == 0);
  }();
  return on;
}

}  // namespace colsum

// out[C] (= or +=, `accumulate`) the column sums of in[R, C] (T the host type); R, C > 0.
template <class T>
inline void column_sums(T* out, const T* in, int64_t R, int64_t C, bool accumulate, Stream s) {
  using DT = dev_t<T>;
  constexpr int VEC = 16 / int(sizeof(DT));
  if (colsum::wide_enabled() && C % VEC == 0 && aligned(in, 16)) {
    const int64_t col_blocks = (C + 32 * VEC - 1) / (32 * VEC);
    // ~512 blocks, at least 64 rows (8 per row group) a split
    const int splits = int(std::max<int64_t>(1, std::min<int64_t>((512 + col_blocks - 1) / col_blocks, R / 64)));
    const int64_t rows = (R + splits - 1) / splits;
    float* partial = static_cast<float*>(device_malloc(sizeof(float) * size_t(splits) * size_t(C)));
    launch_kernel(colsum::partial_rows_wide<DT, 8>, dim3(unsigned(col_blocks), unsigned(splits)), dim3(32, 8), 0, s,
                  partial, dptr(in), R, C, rows);
    LAUNCH_CHECK();
    colsum::launch_finish_rows<DT>(dptr(out), nullptr, partial, nullptr, splits, C, accumulate, s);
    device_free(partial);  // stream-ordered reuse
    return;
  }
  const int splits = int(std::min<int64_t>(64, std::max<int64_t>(1, (R + 255) / 256)));
  const int64_t rows = (R + splits - 1) / splits;
  float* partial = static_cast<float*>(device_malloc(sizeof(float) * size_t(splits) * size_t(C)));
  launch_kernel(colsum::partial_rows<dev_t<T>>, dim3(unsigned((C + 31) / 32), unsigned(splits)), dim3(32, 8), 0, s,
                partial, dptr(in), R, C, rows);
  LAUNCH_CHECK();
  launch_kernel(colsum::finish<dev_t<T>>, unsigned((C + 255) / 256), 256, 0, s, dptr(out), partial, splits, C,
                accumulate);
  LAUNCH_CHECK();
  device_free(partial);  // stream-ordered reuse
}

}  // namespace loom::cuda
