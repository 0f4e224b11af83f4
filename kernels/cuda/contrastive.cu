/*
 * contrastive.cu: the latent-MIM losses, batched over B with no per-sample host loop and no
 * host synchronization: patch discrimination and symmetric InfoNCE.
 *
 * Shape legend: B batch, M masked patches per sample (predictions = targets per sample),
 * D feature dim, tau temperature. In the workloads M <= ~150 and D <= 768.
 *
 * Patch discrimination (per sample b; rp, rt = 1 / max(||row||, 1e-12), F.normalize):
 *   raw[m,n]   = pred[m] . target[n]                       (batched GEMM, fp32 out)
 *   x[m,n]     = raw[m,n] rp[m] rt[n] / tau                 (the logits)
 *   loss       = mean over b, m of (lse_m(x) - x[m,m])
 *   g[m,n]     = (softmax_n(x[m]) - [m == n]) / (B M)       (d loss / d x)
 *   W[m,n]     = g[m,n] rt[n] / tau                         (d loss / d (pred_hat . target))
 *   dpred[m]   = rp (G - p_hat (p_hat . G)),  G = sum_n W[m,n] target[n]
 *              = sum_n (rp W[m,n]) target[n] - s_m pred[m],  s_m = rp^3 sum_n W[m,n] raw[m,n]
 *   The projection coefficient s_m comes from the raw dot products already in hand, so the
 *   backward is one elementwise pass (dpred = -s pred) and one batched GEMM with beta = 1.
 *   (Rows with ||pred|| < 1e-12 take the unprojected gradient, as F.normalize's clamp does.)
 * InfoNCE (a, b already normalized):
 *   L = a b^T / tau [B,B];  loss = (mean_i (rlse_i - L_ii) + mean_j (clse_j - L_jj)) / 2
 *   G[i,j] = (exp(L_ij - rlse_i) + exp(L_ij - clse_j) - 2 [i == j]) / (2 B tau)
 *   da = G b,  db = G^T a
 *
 * Pointers:
 *   pred, dpred, target [B, M, D] T      loss [1] A =      dpred, da, db =
 *   a, da, b, db [B, D] T
 *   patch workspace [B M M + 2 B M] A: raw / W' [B, M, M], rp -> s [B, M], rt -> row loss [B, M]
 *   (v2's padded raw and target copy come from device_malloc, freed stream-ordered)
 *   infonce workspace [B B + 4 B] A:   L / G [B, B], rlse [B], clse [B], (2B unused)
 *
 * bf16: W' (or G) is written as bf16 into the first half of its own fp32 row (leading dim 2M),
 *   by the warp that owns the row, a tile read into registers before a __syncwarp and then
 *   written, so the backward GEMM runs on bf16 tensor cores (fp32 accumulation) with no extra
 *   buffer. Everything else is fp32.
 *
 * Napkin math (MIM: B 128, M 147, D 768): two batched GEMMs of 2 B M^2 D = 4.2 GFLOP each
 *   (~10 us each at tensor-core rates, in practice a few tens of us for these thin shapes);
 *   the row kernel touches B M^2 fp32 = 11 MB twice. Deterministic: fixed-order reductions.
 *
 * Launch shape: row norms one warp per row; patch rows one block (8 warps) per sample, warp
 *   per row; InfoNCE one warp per row / column; loss sums one 1024-thread block.
 * Tried and dropped (H100, 2026-11-27): raw with its rows padded to a multiple of 4 floats, to
 *   move cuBLAS off the align1 kernels it picks at M 147 (cutlass_75 ..._align1, 136 + 116 us a
 *   MIM step in a CUPTI trace): the same kernels and times (bench_losses 0.3858 against 0.3827
 *   ms); the odd M itself decides the alignment (raw's columns, W''s inner dimension): v2 pads
 *   the problem, not only the rows.
 * Versions: v1 cuBLAS batched GEMMs + warp-per-row kernels. Measured on H200, bf16
 *   (bench/bench_losses.cpp): patch_disc B128 M147 D768 forward+backward 0.38 ms; InfoNCE
 *   B128 D768 0.039 ms.
 *   v2 (2026-11-28) the padded layout: M not a multiple of 8 -> each sample's target rows
 *   copied with zero rows up to Mp = M rounded up to 8, raw [B, M, Mp] (Mp floats a row), W'
 *   zero past M. Every product's contiguous dimension (raw's and W''s Mp, D) is then a
 *   multiple of 8 and cuBLAS leaves its align1 kernels; pred and dpred keep M rows (their M is
 *   the strided dimension). The zero rows give raw 0 and add 0 to dpred: the same math.
 *   H100, same binary, LOOM_PATCH_PAD=0 | default: patch_disc B128 M147 D768 forward+backward
 *   0.4034 / 0.4046 | 0.2382 / 0.2378 ms; bench_mim 25.16 / 25.20 | 25.07 / 25.12 ms,
 *   contrastive 46.99 / 46.94 | 46.70 / 46.57 (steps 6-30), peak +63 MB (the padded copy and
 *   raw, transient at the loss). LOOM_PATCH_PAD=0 keeps M (read at every call).
 *
 * Reference: kernels/cpu/contrastive.cpp. Test: tests/cuda/test_cuda_losses.cpp
 *   ("patch_disc_loss", "infonce_loss"); bash tools/gpu-kernels.sh tests/cuda/test_cuda_losses.cpp
 */
#include <cstdlib>
#include <string>
#include <type_traits>

#include "kernels/cuda/common.cuh"

namespace loom::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <class T> constexpr cudaDataType cuda_type();
template <> constexpr cudaDataType cuda_type<float>() { return CUDA_R_32F; }
template <> constexpr cudaDataType cuda_type<bf16>() { return CUDA_R_16BF; }
template <> constexpr cudaDataType cuda_type<f16>() { return CUDA_R_16F; }

// Row-major batched C[M,N] = alpha op(A) op(B) + beta C, leading dims and batch strides in
// elements, fp32 accumulation (cuBLAS is column-major: computes C^T = op(B)^T op(A)^T).
void gemm_rm_batched(cudaStream_t s, int M, int N, int K, const void* A, cudaDataType ta,
                     int64_t lda, int64_t sA, bool transA, const void* B, cudaDataType tb,
                     int64_t ldb, int64_t sB, bool transB, void* C, cudaDataType tc, int64_t ldc,
                     int64_t sC, float alpha, float beta, int batch) {
  cublasHandle_t h = cublas_handle();
  CUBLAS_CHECK(cublasSetStream(h, s));
  CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      h, transB ? CUBLAS_OP_T : CUBLAS_OP_N, transA ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha,
      B, tb, int(ldb), sB, A, ta, int(lda), sA, &beta, C, tc, int(ldc), sC, batch,
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
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
  return sh[0];
}

// Warp-wide log-sum-exp of n values produced by f(j) (fp32), max-subtracted.
template <class F>
__device__ float warp_lse(int n, F f) {
  const int lane = threadIdx.x % 32;
  float m = -INFINITY;
  for (int j = lane; j < n; j += 32) m = fmaxf(m, f(j));
  m = warp_max(m);
  float s = 0.f;
  for (int j = lane; j < n; j += 32) s += exp2f((f(j) - m) * kLog2e);
  s = warp_sum(s);
  return m + log2f(s) * kLn2;
}

// Writes y_j = g(j) (j < n) for a row of fp32 storage `row` owned by one warp, as TOut:
// fp32 in place, bf16 packed into the row's first half (tile read, __syncwarp, tile write).
// g may read row[j] itself: every read of a tile happens before its writes, and a tile's bf16
// writes cover only fp32 slots of this or earlier tiles.
template <class TOut, class G>
__device__ void warp_write_row(float* row, int n, G g) {
  constexpr int kItems = 4;
  const int lane = threadIdx.x % 32;
  TOut* out = reinterpret_cast<TOut*>(row);
  for (int base = 0; base < n; base += 32 * kItems) {
    float y[kItems];
#pragma unroll
    for (int i = 0; i < kItems; i++) {
      const int j = base + lane + 32 * i;
      y[i] = j < n ? g(j) : 0.f;
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < kItems; i++) {
      const int j = base + lane + 32 * i;
      if (j < n) out[j] = from_float<TOut>(y[i]);
    }
    __syncwarp();
  }
}

// rnorm[r] = 1 / max(||x_r||, 1e-12), one warp per row of [rows, D].
template <class T>
__global__ void row_rnorm(float* __restrict__ rnorm, const T* __restrict__ x, int64_t rows, int D) {
  pdl_entry();
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (r >= rows) return;
  const T* xr = x + r * D;
  float ss = 0.f;
  for (int d = threadIdx.x % 32; d < D; d += 32) {
    const float v = to_float(xr[d]);
    ss += v * v;
  }
  ss = warp_sum(ss);
  if (threadIdx.x % 32 == 0) rnorm[r] = 1.f / fmaxf(sqrtf(ss), 1e-12f);
}

// One block per sample b, one warp per row m: logits, row loss, W' = rp W (as TOut, in place)
// and s_m (over rp in place); then the row losses over rt (once every warp is done with rt).
// Rows of raw are ld floats apart (ld >= M: the padded layout, below); W' gets ld values a row,
// those past M zero.
template <class TOut>
__global__ void patch_rows(float* __restrict__ raw, float* __restrict__ rp, float* __restrict__ rt,
                           int B, int M, int ld, float inv_tau) {
  pdl_entry();
  extern __shared__ float row_loss[];  // [M]
  const int b = blockIdx.x, warp = threadIdx.x / 32, nw = blockDim.x / 32, lane = threadIdx.x % 32;
  const float* rtb = rt + int64_t(b) * M;
  const float inv_bm = 1.f / (float(B) * float(M));
  for (int m = warp; m < M; m += nw) {
    float* x = raw + (int64_t(b) * M + m) * ld;  // raw dot products of row m
    const float rpm = rp[int64_t(b) * M + m];
    auto logit = [&](int n) { return x[n] * rpm * rtb[n] * inv_tau; };
    const float lse = warp_lse(M, logit);
    const float loss_m = lse - logit(m);
    // c = sum_n W[m,n] raw[m,n] (before x is overwritten)
    float c = 0.f;
    for (int n = lane; n < M; n += 32) {
      const float g = (exp2f((logit(n) - lse) * kLog2e) - (n == m ? 1.f : 0.f)) * inv_bm;
      c += g * rtb[n] * inv_tau * x[n];
    }
    c = warp_sum(c);
    warp_write_row<TOut>(x, ld, [&](int n) {
      if (n >= M) return 0.f;
      const float g = (exp2f((logit(n) - lse) * kLog2e) - (n == m ? 1.f : 0.f)) * inv_bm;
      return rpm * g * rtb[n] * inv_tau;
    });
    if (lane == 0) {
      // s_m = rp^3 c; a clamped norm (||pred|| < 1e-12) takes no projection, as F.normalize
      rp[int64_t(b) * M + m] = rpm >= 1e12f ? 0.f : rpm * rpm * rpm * c;
      row_loss[m] = loss_m;
    }
  }
  __syncthreads();  // every warp has finished reading rt[b, :]
  for (int m = threadIdx.x; m < M; m += blockDim.x) rt[int64_t(b) * M + m] = row_loss[m];
}

// dst [B, Mp, D] = src [B, M, D] with zero rows M..Mp-1 in each sample; U the unit of copy
// (16 bytes where D allows it), D in units of U
template <class U>
__global__ void pad_sample_rows(U* __restrict__ dst, const U* __restrict__ src, int M, int Mp, int64_t D, int64_t n) {
  pdl_entry();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t d = i % D, r = (i / D) % Mp, b = i / (D * Mp);
    if (r < M) {
      dst[i] = src[(b * M + r) * D + d];
    } else if constexpr (std::is_same<U, uint4>::value) {
      dst[i] = make_uint4(0u, 0u, 0u, 0u);
    } else {
      dst[i] = from_float<U>(0.f);
    }
  }
}

// out[r, :] = -s[r] * x[r, :]  over [rows, D], VEC elements a thread (D a multiple of VEC, the
// pointers aligned to VEC elements): one row division per VEC elements (VEC 1 took 138 us for
// the contrastive step's [37632, 768] in bf16, H200, 2026-11-28)
template <class T, int VEC>
__global__ void scale_rows_neg(T* __restrict__ out, const T* __restrict__ x, const float* __restrict__ s,
                               int64_t rows, int D) {
  pdl_entry();
  const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (i >= rows * D) return;
  const float f = -s[i / D];
  Pack<T, VEC> v = *reinterpret_cast<const Pack<T, VEC>*>(x + i);
#pragma unroll
  for (int e = 0; e < VEC; e++) v.v[e] = from_float<T>(f * to_float(v.v[e]));
  *reinterpret_cast<Pack<T, VEC>*>(out + i) = v;
}

// loss = scale * sum of v[0..n), one block, fixed order
__global__ void sum_scaled(float* __restrict__ loss, const float* __restrict__ v, int64_t n, float scale) {
  pdl_entry();
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += v[i];
  s = block_sum(s);
  if (threadIdx.x == 0) *loss = s * scale;
}

// InfoNCE: warp w < B: lse of row w; warp B + j: lse of column j.
__global__ void infonce_lse(float* __restrict__ rlse, float* __restrict__ clse,
                            const float* __restrict__ L, int B) {
  pdl_entry();
  const int w = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (w >= 2 * B) return;
  if (w < B) {
    const float l = warp_lse(B, [&](int j) { return L[int64_t(w) * B + j]; });
    if (threadIdx.x % 32 == 0) rlse[w] = l;
  } else {
    const int j = w - B;
    const float l = warp_lse(B, [&](int i) { return L[int64_t(i) * B + j]; });
    if (threadIdx.x % 32 == 0) clse[j] = l;
  }
}

__global__ void infonce_loss_sum(float* __restrict__ loss, const float* __restrict__ L,
                                 const float* __restrict__ rlse, const float* __restrict__ clse, int B) {
  pdl_entry();
  float s = 0.f;
  for (int i = threadIdx.x; i < B; i += blockDim.x) {
    const float d = L[int64_t(i) * B + i];
    s += (rlse[i] - d) + (clse[i] - d);
  }
  s = block_sum(s);
  if (threadIdx.x == 0) *loss = s / (2.f * B);
}

// G[i,j] (in place, as TOut) = (p_row + p_col - 2 delta) / (2 B tau); one warp per row i.
template <class TOut>
__global__ void infonce_grad(float* __restrict__ L, const float* __restrict__ rlse,
                             const float* __restrict__ clse, int B, float inv_tau) {
  pdl_entry();
  const int i = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (i >= B) return;
  float* row = L + int64_t(i) * B;
  const float ri = rlse[i], k = 0.5f / B * inv_tau;
  warp_write_row<TOut>(row, B, [&](int j) {
    const float l = row[j];
    return k * (exp2f((l - ri) * kLog2e) + exp2f((l - clse[j]) * kLog2e) - (i == j ? 2.f : 0.f));
  });
}

}  // namespace

template <class T>
void patch_disc_loss(acc_t<T>* loss, T* dpred, const T* pred, const T* target, int B, int M, int D,
                     double tau, acc_t<T>* workspace, Stream s) {
  if (B <= 0 || M <= 0 || D <= 0)
    throw std::invalid_argument("patch_disc_loss: expected B, M, D > 0, got B=" + std::to_string(B) +
                                " M=" + std::to_string(M) + " D=" + std::to_string(D));
  constexpr cudaDataType tT = cuda_type<T>();
  const int64_t BM = int64_t(B) * M;
  float* raw = workspace;        // [B, M, M]
  float* rp = raw + BM * M;      // [B, M]
  float* rt = rp + BM;           // [B, M]
  // Padded layout (header): M not a multiple of 8 (the MIM's 147) -> target's samples padded with
  // zero rows to Mp, raw [B, M, Mp]; LOOM_PATCH_PAD=0 keeps M (read at every call: A/B, tests).
  const char* pad_env = std::getenv("LOOM_PATCH_PAD");
  const int Mp = (pad_env && pad_env[0] == '0') ? M : (M + 7) / 8 * 8;
  const T* tgt = target;
  T* tpad = nullptr;
  if (Mp != M) {
    raw = static_cast<float*>(device_malloc(sizeof(float) * size_t(BM) * Mp));
    tpad = static_cast<T*>(device_malloc(sizeof(T) * size_t(B) * Mp * D));
    const int64_t n = int64_t(B) * Mp * D;
    if ((int64_t(D) * sizeof(T)) % 16 == 0 && aligned(target, 16)) {
      const int64_t du = int64_t(D) * sizeof(T) / 16;
      launch_kernel(pad_sample_rows<uint4>, std::min<int64_t>(ceil_div(n * sizeof(T) / 16, 256), 8192), 256, 0, s,
                    reinterpret_cast<uint4*>(tpad), reinterpret_cast<const uint4*>(target), M, Mp, du,
                    n * int64_t(sizeof(T)) / 16);
    } else {
      launch_kernel(pad_sample_rows<dev_t<T>>, std::min<int64_t>(ceil_div(n, 256), 8192), 256, 0, s, dptr(tpad),
                    dptr(target), M, Mp, int64_t(D), n);
    }
    LAUNCH_CHECK();
    tgt = tpad;
  }
  // rp over pred rows and rt over target rows (two launches: the inputs are separate arrays)
  launch_kernel(row_rnorm<dev_t<T>>, ceil_div(BM, 8), 256, 0, s, rp, dptr(pred), BM, D);
  LAUNCH_CHECK();
  launch_kernel(row_rnorm<dev_t<T>>, ceil_div(BM, 8), 256, 0, s, rt, dptr(target), BM, D);
  LAUNCH_CHECK();
  // raw[b] = pred[b] target[b]^T (columns M..Mp-1: the zero rows' 0)
  gemm_rm_batched(s, M, Mp, D, pred, tT, D, int64_t(M) * D, false, tgt, tT, D, int64_t(Mp) * D, true, raw, CUDA_R_32F,
                  Mp, int64_t(M) * Mp, 1.f, 0.f, B);
  launch_kernel(patch_rows<dev_t<T>>, B, 256, sizeof(float) * M, s, raw, rp, rt, B, M, Mp, float(1.0 / tau));
  LAUNCH_CHECK();
  launch_kernel(sum_scaled, 1, 1024, 0, s, loss, rt, BM, 1.f / float(BM));
  LAUNCH_CHECK();
  // dpred = -s pred, then dpred[b] += W'[b] target[b]
  constexpr int V = 16 / int(sizeof(T));
  if (D % V == 0 && aligned(dpred, 16) && aligned(pred, 16))
    launch_kernel(scale_rows_neg<dev_t<T>, V>, ceil_div(BM * D / V, 256), 256, 0, s, dptr(dpred), dptr(pred), rp, BM, D);
  else
    launch_kernel(scale_rows_neg<dev_t<T>, 1>, ceil_div(BM * D, 256), 256, 0, s, dptr(dpred), dptr(pred), rp, BM, D);
  LAUNCH_CHECK();
  const int64_t ldw = sizeof(T) == 4 ? Mp : 2 * int64_t(Mp);  // bf16 W' packed in fp32 rows
  gemm_rm_batched(s, M, D, Mp, raw, tT, ldw, ldw * M, false, tgt, tT, D, int64_t(Mp) * D, false, dpred, tT, D,
                  int64_t(M) * D, 1.f, 1.f, B);
  if (Mp != M) {  // stream-ordered reuse
    device_free(raw);
    device_free(tpad);
  }
}

template <class T>
void infonce_loss(acc_t<T>* loss, T* da, T* db, const T* a, const T* b, int B, int D, double tau,
                  acc_t<T>* workspace, Stream s) {
  if (B <= 0 || D <= 0)
    throw std::invalid_argument("infonce_loss: expected B, D > 0, got B=" + std::to_string(B) +
                                " D=" + std::to_string(D));
  constexpr cudaDataType tT = cuda_type<T>();
  float* L = workspace;          // [B, B]
  float* rlse = L + int64_t(B) * B;
  float* clse = rlse + B;
  const float inv_tau = float(1.0 / tau);
  gemm_rm_batched(s, B, B, D, a, tT, D, 0, false, b, tT, D, 0, true, L, CUDA_R_32F, B, 0, inv_tau,
                  0.f, 1);
  launch_kernel(infonce_lse, ceil_div(2 * B, 8), 256, 0, s, rlse, clse, L, B);
  LAUNCH_CHECK();
  launch_kernel(infonce_loss_sum, 1, 1024, 0, s, loss, L, rlse, clse, B);
  LAUNCH_CHECK();
  launch_kernel(infonce_grad<dev_t<T>>, ceil_div(B, 8), 256, 0, s, L, rlse, clse, B, inv_tau);
  LAUNCH_CHECK();
  const int64_t ldg = sizeof(T) == 4 ? B : 2 * int64_t(B);
  // da = G b ; db = G^T a
  gemm_rm_batched(s, B, D, B, L, tT, ldg, 0, false, b, tT, D, 0, false, da, tT, D, 0, 1.f, 0.f, 1);
  gemm_rm_batched(s, B, D, B, L, tT, ldg, 0, true, a, tT, D, 0, false, db, tT, D, 0, 1.f, 0.f, 1);
}

template void patch_disc_loss<float>(float*, float*, const float*, const float*, int, int, int, double, float*, Stream);
template void patch_disc_loss<bf16>(float*, bf16*, const bf16*, const bf16*, int, int, int, double, float*, Stream);
template void patch_disc_loss<f16>(float*, f16*, const f16*, const f16*, int, int, int, double, float*, Stream);
template void infonce_loss<float>(float*, float*, float*, const float*, const float*, int, int, double, float*, Stream);
template void infonce_loss<bf16>(float*, bf16*, bf16*, const bf16*, const bf16*, int, int, double, float*, Stream);
template void infonce_loss<f16>(float*, f16*, f16*, const f16*, const f16*, int, int, double, float*, Stream);

}  // namespace loom::cuda
