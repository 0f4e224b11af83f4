/*
 * cross_entropy.cu: mean cross-entropy over the rows whose target is >= 0, and the fused
 * linear + cross-entropy that never materializes the [N, V] logits.
 *
 * Shape legend: N rows (tokens), V vocab, D model dim, c rows of one chunk.
 *
 * Math (per valid row r with target y_r; count = number of rows with y >= 0):
 *   lse_r      = log sum_j exp(x_rj)                 (fp32, max-subtracted, one online pass)
 *   loss       = sum_r (lse_r - x_{r,y_r}) / count    (0 when count == 0)
 *   dx_rj      = dloss * (exp(x_rj - lse_r) - [j == y_r]) / count     (ignored rows: 0)
 * Fused linear + CE (dloss = *grad_scale, 1 when null; the autograd op scales afterwards):
 *   for each chunk of c rows:   logits[c,V] = h_c W^T           (GEMM into the workspace, in X)
 *                               dlogits     = softmax - onehot, / count   (in place, in X)
 *                               dh_c [c,D]  = dlogits W          (GEMM, =)
 *                               dW   [V,D] += dlogits^T h_c      (GEMM; the first chunk =)
 *   X, the type of the logits: fp32 for f32, T itself for bf16 and f16 (as the reference's
 *   autocast head, whose bf16 logits go up to fp32 only inside the loss).
 * Pointers:
 *   logits, dlogits [N, V] T      targets [N] int32 (< 0 ignored; >= V makes the loss NaN:
 *   the device cannot throw and a host check would need a sync)
 *   loss [1] A =                  lse [N] A = (saved for backward)     dloss [1] A (device)
 *   h, dh [N, D] T                W, dW [V, D] T                  workspace [chunk, V] X
 *
 * Device-side counting: the number of valid rows is counted by a one-block kernel into a
 *   small buffer from the caching allocator (device_malloc, no cudaMalloc after warm-up);
 *   the loss is a per-row array summed by one block in a fixed order: deterministic, no
 *   atomics, no host synchronization anywhere.
 *
 * 16-bit T in the fused op: the logits GEMM writes T (fp32 accumulation, one rounding at the
 *   store), the row kernel reads them into fp32 registers and writes the dlogits over them in
 *   T, and the two backward GEMMs run on the 16-bit tensor cores with fp32 accumulation
 *   (cublasGemmEx, CUBLAS_COMPUTE_32F). Until 2026-11-27 the logits were fp32 and the dlogits
 *   were packed into the first half of each fp32 row; T logits halve the GEMM's store and
 *   the row kernel's reads and the workspace. dW accumulates across chunks in its own type
 *   (bf16: one rounding per chunk). f32 stays f32 end to end (no TF32), so the f32 tests are
 *   tight.
 * Napkin math (N 16384, V 49152, D 576, bf16, H100/H200):
 *   GEMMs 6 N V D = 2.78 TFLOP  -> ~4.2 ms at ~660 TFLOP/s.
 *   Row kernel: reads the bf16 logits once (1.6 GB; the row stays in registers, below) and
 *   writes 1.6 GB of bf16 dlogits = 3.2 GB -> ~1.0 ms at 3.3 TB/s (H100); with fp32 logits it
 *   was 4.8 GB. The two-pass kernel reads them twice.
 *   Memory: workspace chunk x V x sizeof(X) = 403 MB at chunk 4096 in bf16 (PyTorch's
 *   materialized path holds ~9 GB).
 * Launch shape: one 512-thread block per row holding the row in registers (up to 96 values
 *   per thread in 16-byte vectors: V <= 49152, V a multiple of the vector), else one
 *   256-thread block per row in two passes;
 *   counting / loss reduction: one 1024-thread block.
 *
 * Versions: v1 two-pass row kernel; v2 register-resident row kernel (lce_rows_reg), the
 *   default where the row fits; v3 16-bit logits in their own type (2026-11-27; fixed-batch
 *   SPEC VLM step 59.0 -> 58.2 ms on an H100, same call, the tree before beside it); v4 the
 *   ragged last chunk after full ones padded to 256 rows (2026-11-27, H200, three rounds in
 *   two calls, the tree before beside it: SPEC VLM step with a new batch per step, steps
 *   31-60, median 55.08 / 55.33 / 56.18 -> 54.92 / 54.93 / 54.90 ms, p90 58.50 / 58.27 /
 *   59.50 -> 57.13 / 56.57 / 57.30; fixed batch 52.22 -> 52.71 median, 52.86 -> 52.92 mean).
 *   Measured on H100 (bench_losses, same call, 2026-11-24, N 16384 V 49152 D 576 bf16, fp32
 *   logits): fused op 8.21 -> 6.56 ms at chunk 2048 (7.92 -> 6.45 at 4096); in the
 *   SPEC VLM step (CUPTI trace) the row kernels went from 3.28 to 1.71 ms a step.
 *   Measured on H200 (bench/bench_losses.cpp, N 16384 V 49152 D 576 bf16, fp32 logits, median of 20):
 *     chunk 4096: 7.09 ms (392 TFLOP/s), peak extra memory 0.82 GB (dh, dW, workspace)
 *     chunk 2048: 7.26 ms, 0.45 GB (2% slower for 45% less memory: the LM's default from
 *     2026-11-23, because the workspace lives at the activations' peak, until the bf16 logits
 *     of 2026-11-27 made 4096 rows as small; nn/lm.h loss_chunk)
 *     PyTorch materialized linear + cross_entropy, same run: 13.92 ms, 9.1 GB
 *   bf16 dlogits for the backward GEMMs (chosen): the fp32 alternative would need fp32 copies
 *   of W and h for cuBLAS (no mixed f32 x bf16 GEMM) and run at the fp32 SIMT rate.
 * Reference: kernels/cpu/cross_entropy.cpp. Test: tests/cuda/test_cuda_losses.cpp
 *   ("cross_entropy", "fused_linear_cross_entropy"); on a CUDA machine:
 *   bash tools/gpu-kernels.sh tests/cuda/test_cuda_losses.cpp
 */
#include <cmath>
#include <string>
#include <type_traits>

#include "kernels/cuda/common.cuh"

namespace loom::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kRowThreads = 256;

// Running (max, sum of exp(x - max)) of a set of values; two sets combine exactly.
struct MaxSum {
  float m, s;
};
__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f};
  return {m, a.s * exp2f((a.m - m) * kLog2e) + b.s * exp2f((b.m - m) * kLog2e)};
}
__device__ __forceinline__ MaxSum add_value(MaxSum a, float x) {
  if (x > a.m) return {x, a.s * exp2f((a.m - x) * kLog2e) + 1.f};
  return {a.m, a.s + exp2f((x - a.m) * kLog2e)};
}

// Block-wide combine; every thread gets the result. blockDim.x a multiple of 32, <= 1024.
__device__ MaxSum block_maxsum(MaxSum v) {
  __shared__ MaxSum sh[32];
  for (int o = 16; o > 0; o >>= 1)
    v = combine(v, MaxSum{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < nw ? sh[lane] : MaxSum{-INFINITY, 0.f};
    for (int o = 16; o > 0; o >>= 1)
      v = combine(v, MaxSum{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
    if (lane == 0) sh[0] = v;
  }
  __syncthreads();
  v = sh[0];
  __syncthreads();  // sh may be reused by the caller's next reduction
  return v;
}

__device__ float block_sum(float v) {
  __shared__ float sh[32];
  v = warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < nw ? sh[lane] : 0.f;
    v = warp_sum(v);
    if (lane == 0) sh[0] = v;
  }
  __syncthreads();
  v = sh[0];
  __syncthreads();
  return v;
}

// lse[r] = log sum_j exp(logits[r, j]); one block per row.
template <class T>
__global__ void ce_lse_rows(float* __restrict__ lse, const T* __restrict__ logits, int V) {
  pdl_entry();
  const T* x = logits + int64_t(blockIdx.x) * V;
  MaxSum ms{-INFINITY, 0.f};
  for (int j = threadIdx.x; j < V; j += blockDim.x) ms = add_value(ms, to_float(x[j]));
  ms = block_maxsum(ms);
  if (threadIdx.x == 0) lse[blockIdx.x] = ms.m + log2f(ms.s) * kLn2;
}

// One block: loss = sum over valid rows of (lse - x[target]) / count, fixed summation order.
template <class T>
__global__ void ce_mean_loss(float* __restrict__ loss, const float* __restrict__ lse,
                             const T* __restrict__ logits, const int32_t* __restrict__ targets,
                             int64_t N, int V) {
  pdl_entry();
  float sum = 0.f, cnt = 0.f;
  for (int64_t r = threadIdx.x; r < N; r += blockDim.x) {
    const int t = targets[r];
    if (t < 0) continue;
    cnt += 1.f;
    sum += t < V ? lse[r] - to_float(logits[r * V + t]) : NAN;
  }
  sum = block_sum(sum);
  cnt = block_sum(cnt);
  if (threadIdx.x == 0) *loss = cnt > 0.f ? sum / cnt : 0.f;
}

// One block: count[0] = number of rows with target >= 0 (exact in fp32 up to 2^24 rows).
__global__ void count_valid(float* __restrict__ count, const int32_t* __restrict__ targets, int64_t N) {
  pdl_entry();
  float c = 0.f;
  for (int64_t r = threadIdx.x; r < N; r += blockDim.x) c += targets[r] >= 0 ? 1.f : 0.f;
  c = block_sum(c);
  if (threadIdx.x == 0) *count = c;
}

// dlogits = dloss * (softmax - onehot) / count; one block per row.
template <class T>
__global__ void ce_backward_rows(T* __restrict__ dlogits, const float* __restrict__ dloss,
                                 const T* __restrict__ logits, const float* __restrict__ lse,
                                 const int32_t* __restrict__ targets,
                                 const float* __restrict__ count, int V) {
  pdl_entry();
  const int64_t r = blockIdx.x;
  const int t = targets[r];
  const float cnt = *count;
  const float scale = (t >= 0 && cnt > 0.f) ? *dloss / cnt : 0.f;  // ignored row: all zero
  const float l = lse[r];
  const T* x = logits + r * V;
  T* dx = dlogits + r * V;
  for (int j = threadIdx.x; j < V; j += blockDim.x) {
    const float p = exp2f((to_float(x[j]) - l) * kLog2e);
    dx[j] = from_float<T>(scale * (p - (j == t ? 1.f : 0.f)));
  }
}

// The fused op's row kernel, on one chunk row of logits in the workspace (X = float for f32,
// the 16-bit T itself for bf16 / f16): lse, the row's loss term, then dlogits = (softmax -
// onehot) / count written over the row in place, element for element in the same type.
template <class X>
__global__ void lce_rows(X* __restrict__ ws, float* __restrict__ row_loss, const int32_t* __restrict__ targets,
                         const float* __restrict__ count, const float* __restrict__ grad_scale, int V) {
  pdl_entry();
  X* x = ws + int64_t(blockIdx.x) * V;
  const int t = targets[blockIdx.x];
  MaxSum ms{-INFINITY, 0.f};
  for (int j = threadIdx.x; j < V; j += blockDim.x) ms = add_value(ms, to_float(x[j]));
  ms = block_maxsum(ms);
  const float lse = ms.m + log2f(ms.s) * kLn2;
  if (threadIdx.x == 0) row_loss[blockIdx.x] = t < 0 ? 0.f : (t < V ? lse - to_float(x[t]) : NAN);
  __syncthreads();  // x[t] is read before any thread overwrites it
  const float cnt = *count;
  const float scale = (t >= 0 && cnt > 0.f) ? (grad_scale ? *grad_scale : 1.f) / cnt : 0.f;
  const float lse2 = lse * kLog2e;
  for (int j = threadIdx.x; j < V; j += blockDim.x)  // each thread rewrites only what it read
    x[j] = from_float<X>(scale * (exp2f(to_float(x[j]) * kLog2e - lse2) - (j == t ? 1.f : 0.f)));
}

// The same row kernel with the whole row held in registers: one 512-thread block per row, each
// thread loading kLoads 16-byte vectors (E = 16 / sizeof(X) values each; V <= 512 kLoads E,
// V % E == 0) before anything is written, so the logits are read from DRAM once instead of
// twice (the two-pass kernel above reads them for the max/sum and again for the gradient; a
// 96-196 KB row does not stay in L2 between the passes). Each thread reduces its registers to
// (max, sum of exp(x - max)), which block_maxsum combines exactly across the block; its
// barriers separate every read of the row from the first write. The gradient goes back over
// the same vectors in place.
constexpr int kRegThreads = 512;
template <class X, int kLoads>
__global__ void __launch_bounds__(kRegThreads, 1)
lce_rows_reg(X* __restrict__ ws, float* __restrict__ row_loss, const int32_t* __restrict__ targets,
             const float* __restrict__ count, const float* __restrict__ grad_scale, int V) {
  pdl_entry();
  constexpr int E = 16 / int(sizeof(X));
  X* x = ws + int64_t(blockIdx.x) * V;
  const int t = targets[blockIdx.x];
  const int nv = V / E;  // vectors in the row
  float v[kLoads][E];
#pragma unroll
  for (int i = 0; i < kLoads; i++) {
    const int q = i * kRegThreads + threadIdx.x;
    if (q < nv) {
      const uint4 raw = reinterpret_cast<const uint4*>(x)[q];
      const X* e = reinterpret_cast<const X*>(&raw);
#pragma unroll
      for (int k = 0; k < E; k++) v[i][k] = to_float(e[k]);
    } else {
#pragma unroll
      for (int k = 0; k < E; k++) v[i][k] = -INFINITY;
    }
  }
  const float xt = (threadIdx.x == 0 && t >= 0 && t < V) ? to_float(x[t]) : 0.f;
  MaxSum ms{-INFINITY, 0.f};  // this thread's values: max, then the sum of exp(x - max)
#pragma unroll
  for (int i = 0; i < kLoads; i++)
#pragma unroll
    for (int k = 0; k < E; k++) ms.m = fmaxf(ms.m, v[i][k]);
  if (ms.m > -INFINITY) {
    const float m2 = ms.m * kLog2e;
#pragma unroll
    for (int i = 0; i < kLoads; i++)
#pragma unroll
      for (int k = 0; k < E; k++) ms.s += exp2f(v[i][k] * kLog2e - m2);
  }
  ms = block_maxsum(ms);  // its barriers: every read of the row above precedes any write below
  const float lse = ms.m + log2f(ms.s) * kLn2;
  if (threadIdx.x == 0) row_loss[blockIdx.x] = t < 0 ? 0.f : (t < V ? lse - xt : NAN);
  const float cnt = *count;
  const float scale = (t >= 0 && cnt > 0.f) ? (grad_scale ? *grad_scale : 1.f) / cnt : 0.f;
  const float lse2 = lse * kLog2e;
#pragma unroll
  for (int i = 0; i < kLoads; i++) {
    const int q = i * kRegThreads + threadIdx.x;
    if (q >= nv) continue;
    uint4 raw;
    X* o = reinterpret_cast<X*>(&raw);
#pragma unroll
    for (int k = 0; k < E; k++)
      o[k] = from_float<X>(scale * (exp2f(v[i][k] * kLog2e - lse2) - (E * q + k == t ? 1.f : 0.f)));
    reinterpret_cast<uint4*>(x)[q] = raw;
  }
}

// Launch the row kernel for c rows: the register-resident one where the row fits (V % E == 0,
// V <= 512 * 96 = 49152, SmolLM2's vocabulary exactly), the two-pass one otherwise.
template <class X>
void launch_lce_rows(X* ws, float* row_loss, const int32_t* targets, const float* count, const float* grad_scale,
                     int c, int V, cudaStream_t s) {
  constexpr int E = 16 / int(sizeof(X));
  const int nload = (V / E + kRegThreads - 1) / kRegThreads;  // vectors per thread
  if (V % E == 0 && nload * E <= 96 && aligned(ws, 16)) {
#define LOOM_LCE_REG(K)                                                                              \
  if (nload * E <= K * 4) {                                                                          \
    launch_kernel(lce_rows_reg<X, K * 4 / E>, c, kRegThreads, 0, s, ws, row_loss, targets, count, grad_scale, V); \
    return;                                                                                          \
  }
    LOOM_LCE_REG(2) LOOM_LCE_REG(4) LOOM_LCE_REG(8) LOOM_LCE_REG(12) LOOM_LCE_REG(16) LOOM_LCE_REG(24)
#undef LOOM_LCE_REG
  }
  launch_kernel(lce_rows<X>, c, kRowThreads, 0, s, ws, row_loss, targets, count, grad_scale, V);
}

__global__ void scaled_sum(float* __restrict__ loss, const float* __restrict__ row_loss,
                           const float* __restrict__ count, int64_t N) {
  pdl_entry();
  float s = 0.f;
  for (int64_t r = threadIdx.x; r < N; r += blockDim.x) s += row_loss[r];
  s = block_sum(s);
  if (threadIdx.x == 0) *loss = *count > 0.f ? s / *count : 0.f;
}

template <class T> constexpr cudaDataType cuda_type();
template <> constexpr cudaDataType cuda_type<float>() { return CUDA_R_32F; }
template <> constexpr cudaDataType cuda_type<bf16>() { return CUDA_R_16BF; }
template <> constexpr cudaDataType cuda_type<f16>() { return CUDA_R_16F; }

// Row-major C[M,N] = alpha op(A) op(B) + beta C with leading dims in elements (row strides),
// fp32 accumulation. cuBLAS is column-major: a row-major X is the column-major X^T, so this
// computes C^T = op(B)^T op(A)^T.
void gemm_rm(cudaStream_t s, int M, int N, int K, const void* A, cudaDataType ta, int64_t lda,
             bool transA, const void* B, cudaDataType tb, int64_t ldb, bool transB, void* C,
             cudaDataType tc, int64_t ldc, float alpha, float beta) {
  cublasHandle_t h = cublas_handle();
  CUBLAS_CHECK(cublasSetStream(h, s));
  CUBLAS_CHECK(cublasGemmEx(h, transB ? CUBLAS_OP_T : CUBLAS_OP_N, transA ? CUBLAS_OP_T : CUBLAS_OP_N,
                            N, M, K, &alpha, B, tb, int(ldb), A, ta, int(lda), &beta, C, tc,
                            int(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void check_rows(const char* op, int64_t N, int V) {
  if (N < 0 || V <= 0)
    throw std::invalid_argument(std::string(op) + ": expected N >= 0 and V > 0, got N=" +
                                std::to_string(N) + " V=" + std::to_string(V));
  if (N >= (int64_t(1) << 31))
    throw std::invalid_argument(std::string(op) + ": N=" + std::to_string(N) + " exceeds the grid");
}

}  // namespace

template <class T>
void cross_entropy_forward(acc_t<T>* loss, acc_t<T>* lse, const T* logits, const int32_t* targets,
                           int64_t N, int V, Stream s) {
  check_rows("cross_entropy_forward", N, V);
  if (N > 0) {
    launch_kernel(ce_lse_rows<dev_t<T>>, unsigned(N), kRowThreads, 0, s, lse, dptr(logits), V);
    LAUNCH_CHECK();
  }
  launch_kernel(ce_mean_loss<dev_t<T>>, 1, 1024, 0, s, loss, lse, dptr(logits), targets, N, V);
  LAUNCH_CHECK();
}

template <class T>
void cross_entropy_backward(T* dlogits, const acc_t<T>* dloss, const T* logits, const acc_t<T>* lse,
                            const int32_t* targets, int64_t N, int V, Stream s) {
  check_rows("cross_entropy_backward", N, V);
  if (N == 0) return;
  float* count = static_cast<float*>(device_malloc(sizeof(float)));
  launch_kernel(count_valid, 1, 1024, 0, s, count, targets, N);
  LAUNCH_CHECK();
  launch_kernel(ce_backward_rows<dev_t<T>>, unsigned(N), kRowThreads, 0, s, dptr(dlogits), dloss, dptr(logits), lse,
                targets, count, V);
  LAUNCH_CHECK();
  device_free(count);  // stream-ordered reuse (see allocator.cu)
}

template <class T>
void fused_linear_cross_entropy(acc_t<T>* loss, T* dh, T* dW, const T* h, const T* W,
                                const int32_t* targets, int64_t N, int V, int D, int64_t chunk,
                                acc_t<T>* workspace, const acc_t<T>* grad_scale, Stream s) {
  check_rows("fused_linear_cross_entropy", N, V);
  if (D <= 0 || chunk <= 0)
    throw std::invalid_argument("fused_linear_cross_entropy: expected D > 0 and chunk > 0, got D=" +
                                std::to_string(D) + " chunk=" + std::to_string(chunk));
  constexpr cudaDataType tT = cuda_type<T>();
  // Several chunks and a last one of fewer rows (tail): the tail is padded to a multiple of
  // kLceRowStep rows (zero rows of h, target -1: row loss 0, dlogits 0, so dW gets nothing from
  // them; dh written to scratch and its first rows copied out). A packed batch's row count
  // changes every step; unpadded, each new tail was a new shape of the three products, and
  // cuBLASLt picks a kernel per shape: in the SPEC VLM step with a new batch per step the GPU
  // stood idle 2-5 ms before the tail's dh product in ~1 step of 4 (steps 31-60, 2026-11-27,
  // H200; the host in no runtime call but cudaGetDevice, no heuristic run). A batch of one
  // chunk is left as it is: padded too, vlm_sft.cfg's launch-bound steps took 1.5 ms against
  // 1.2 in one A/B (the extra copies and memsets of each step; that config's steps spread
  // 1.3-1.7 ms between runs).
  constexpr int64_t kLceRowStep = 256;
  const int64_t full = N / chunk * chunk, tail = N - full;
  const int64_t tail_pad = (tail + kLceRowStep - 1) / kLceRowStep * kLceRowStep;
  const bool pad = full > 0 && tail > 0 && tail_pad != tail && tail_pad <= chunk;
  const int64_t extra = pad ? tail_pad - tail : 0;
  // scratch: count[1], then row_loss[N + extra] (aligned to 16 B)
  float* scratch = static_cast<float*>(device_malloc(sizeof(float) * (4 + N + extra)));
  float* count = scratch;
  float* row_loss = scratch + 4;
  launch_kernel(count_valid, 1, 1024, 0, s, count, targets, N);
  LAUNCH_CHECK();
  if (N == 0) {  // dW = 0 and loss = 0 (the sum over no rows)
    CUDA_CHECK(cudaMemsetAsync(dW, 0, sizeof(T) * size_t(V) * D, s));
  }
  T *h_pad = nullptr, *dh_pad = nullptr;
  int32_t* t_pad = nullptr;
  if (pad) {
    const size_t row = sizeof(T) * size_t(D);
    h_pad = static_cast<T*>(device_malloc(row * size_t(tail_pad)));
    dh_pad = static_cast<T*>(device_malloc(row * size_t(tail_pad)));
    t_pad = static_cast<int32_t*>(device_malloc(sizeof(int32_t) * size_t(tail_pad)));
    CUDA_CHECK(cudaMemcpyAsync(h_pad, h + full * D, row * size_t(tail), cudaMemcpyDeviceToDevice, s));
    CUDA_CHECK(cudaMemsetAsync(h_pad + tail * D, 0, row * size_t(extra), s));
    CUDA_CHECK(cudaMemcpyAsync(t_pad, targets + full, sizeof(int32_t) * size_t(tail), cudaMemcpyDeviceToDevice, s));
    CUDA_CHECK(cudaMemsetAsync(t_pad + tail, 0xff, sizeof(int32_t) * size_t(extra), s));  // -1: ignored
  }
  // logits and then dlogits in place, [c, V] of X: fp32 for f32, T itself for bf16 / f16
  using X = std::conditional_t<sizeof(T) == 2, dev_t<T>, float>;
  constexpr cudaDataType tX = sizeof(T) == 2 ? tT : CUDA_R_32F;
  X* ws = reinterpret_cast<X*>(workspace);
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const bool last = pad && r0 == full;
    const int c = int(last ? tail_pad : std::min<int64_t>(chunk, N - r0));
    const T* hc = last ? h_pad : h + r0 * D;
    T* dhc = last ? dh_pad : dh + r0 * D;
    // logits[c,V] = h_c[c,D] W[V,D]^T
    gemm_rm(s, c, V, D, hc, tT, D, false, W, tT, D, true, ws, tX, V, 1.f, 0.f);
    launch_lce_rows<X>(ws, row_loss + r0, last ? t_pad : targets + r0, count, grad_scale, c, V, s);
    LAUNCH_CHECK();
    // dh_c[c,D] = dlogits[c,V] W[V,D]
    gemm_rm(s, c, D, V, ws, tT, V, false, W, tT, D, false, dhc, tT, D, 1.f, 0.f);
    // dW[V,D] (+)= dlogits^T[V,c] h_c[c,D]; the first chunk overwrites (beta 0 never reads dW)
    gemm_rm(s, V, D, c, ws, tT, V, true, hc, tT, D, false, dW, tT, D, 1.f, r0 == 0 ? 0.f : 1.f);
  }
  launch_kernel(scaled_sum, 1, 1024, 0, s, loss, row_loss, count, N);
  LAUNCH_CHECK();
  if (pad) {
    CUDA_CHECK(cudaMemcpyAsync(dh + full * D, dh_pad, sizeof(T) * size_t(D) * size_t(tail), cudaMemcpyDeviceToDevice,
                               s));
    device_free(h_pad);  // stream-ordered reuse
    device_free(dh_pad);
    device_free(t_pad);
  }
  device_free(scratch);
}

template void cross_entropy_forward<float>(float*, float*, const float*, const int32_t*, int64_t, int, Stream);
template void cross_entropy_forward<bf16>(float*, float*, const bf16*, const int32_t*, int64_t, int, Stream);
template void cross_entropy_forward<f16>(float*, float*, const f16*, const int32_t*, int64_t, int, Stream);
template void cross_entropy_backward<float>(float*, const float*, const float*, const float*, const int32_t*, int64_t, int, Stream);
template void cross_entropy_backward<bf16>(bf16*, const float*, const bf16*, const float*, const int32_t*, int64_t, int, Stream);
template void cross_entropy_backward<f16>(f16*, const float*, const f16*, const float*, const int32_t*, int64_t, int, Stream);
template void fused_linear_cross_entropy<float>(float*, float*, float*, const float*, const float*, const int32_t*, int64_t, int, int, int64_t, float*, const float*, Stream);
template void fused_linear_cross_entropy<bf16>(float*, bf16*, bf16*, const bf16*, const bf16*, const int32_t*, int64_t, int, int, int64_t, float*, const float*, Stream);
template void fused_linear_cross_entropy<f16>(float*, f16*, f16*, const f16*, const f16*, const int32_t*, int64_t, int, int, int64_t, float*, const float*, Stream);

}  // namespace loom::cuda
