// colsum.cuh: column sums of a row-major [R, C], out[c] (= or +=) sum over r of in[r, c], for
// linear_backward's bias gradient (matmul.cu) and reduce_sum_to over leading dims (memory.cu: a
// position table's or a broadcast vector's gradient). Deterministic, no atomics: the rows are
// cut into splits (their count depends on R only), block (32, 8) of split y sums its rows of 32
// columns into a partial row [y, C] in fp32 (the 8 row groups added in a fixed order), then one
// thread per column adds the splits in order. Measured forms (16-byte loads, more splits, the
// finish folded into the last block) are in matmul.cu's header.
#pragma once
#include <algorithm>

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

}  // namespace colsum

// out[C] (= or +=, `accumulate`) the column sums of in[R, C] (T the host type); R, C > 0.
template <class T>
inline void column_sums(T* out, const T* in, int64_t R, int64_t C, bool accumulate, Stream s) {
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
