/*
 * attention_v1.cu: v1_warp_per_row, the attention of kernels/cpu/attention.cpp ported line by
 * line: the first CUDA step of the attention course (attention.cu lists the order; the math,
 * shapes and `=` outputs are in its header).
 *
 *   forward   one warp per (query row, head): the head dim is split over the lanes (lane l
 *             owns dims l, l + 32, ...: DPL = ceil(hd / 32) elements per lane), keys are
 *             visited one at a time, each score a warp reduction, the online softmax kept in
 *             every lane's registers. Writes out and lse of every row (+inf / 0 outside).
 *   backward  dq: one warp per (query row, head), the same key loop with p recomputed from
 *             lse; dk, dv: one warp per (key row, kv head), walking the group's query heads
 *             and the queries that see the key. delta comes from attn_delta (attention.cu).
 * Launch: blocks of 4 warps (128 threads); grid (ceil(rows / 4), heads).
 * Bytes: every warp streams the keys and values of its sequence itself (no reuse between
 *   rows): ~2 Lk hd elements read per query row, against ~2 Lk hd / 128 for a 128-row tile of
 *   v2. Readable and slow; it runs for f32 (check runs, gradient fixtures on the GPU) and for
 *   head dims v2 has no tile for. Not timed.
 * Versions: this is the only one in the file (v2 is attention_fwd.cu / attention_bwd*.cu).
 * Test: tests/cuda/test_cuda_kernels_b.cpp ("attention forward/backward f32 (v1) ...").
 */
#include <cstdint>

#include "kernels/cuda/attention_tiles.cuh"

namespace loom::cuda {
namespace {

using namespace attn;

// The sequence that owns `row` (cu[i] <= row < cu[i+1]), or -1. Empty sequences are skipped
// because the search returns the last i with cu[i] <= row.
__device__ __forceinline__ int find_seq(const int32_t* cu, int nseq, int64_t row) {
  if (nseq <= 0 || row < cu[0] || row >= cu[nseq]) return -1;
  int lo = 0, hi = nseq;  // invariant: cu[lo] <= row < cu[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (cu[mid] <= row) lo = mid; else hi = mid;
  }
  return lo;
}

// =========================================================================== v1_warp_per_row
// DPL = head-dim elements per lane (hd <= 32 DPL). Lane `l` owns dims l, l + 32, ...
template <class T, int DPL>
__global__ void attn_fwd_v1(T* __restrict__ out, float* __restrict__ lse, const T* __restrict__ q,
                            const T* __restrict__ k, const T* __restrict__ v,
                            const int32_t* __restrict__ cu_q, const int32_t* __restrict__ cu_k,
                            int nseq, int64_t Nq, int H, int KV, int hd, bool causal, float scale_log2) {
  pdl_entry();
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int h = blockIdx.y, lane = threadIdx.x % 32, g = h / (H / KV);
  if (row >= Nq) return;
  const int i = find_seq(cu_q, nseq, row);
  T* o = out + (row * H + h) * hd;
  int n = 0, Lq = 0, Lk = 0;
  if (i >= 0) {
    Lq = cu_q[i + 1] - cu_q[i];
    Lk = cu_k[i + 1] - cu_k[i];
    const int t = int(row - cu_q[i]);
    n = causal ? max(0, min(Lk, t + Lk - Lq + 1)) : Lk;  // visible keys 0..n-1
  }
  float qd[DPL], acc[DPL];
#pragma unroll
  for (int e = 0; e < DPL; e++) {
    const int d = lane + 32 * e;
    qd[e] = d < hd ? to_float(q[(row * H + h) * hd + d]) * scale_log2 : 0.f;
    acc[e] = 0.f;
  }
  float m = -INFINITY, l = 0.f;  // running max (log2 domain) and sum
  for (int j = 0; j < n; j++) {
    const int64_t kr = ((int64_t(cu_k[i]) + j) * KV + g) * hd;
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < DPL; e++) {
      const int d = lane + 32 * e;
      if (d < hd) s += qd[e] * to_float(k[kr + d]);
    }
    s = warp_sum(s);
    const float m_new = fmaxf(m, s);
    const float corr = exp2f(m - m_new), p = exp2f(s - m_new);
    l = l * corr + p;
#pragma unroll
    for (int e = 0; e < DPL; e++) {
      const int d = lane + 32 * e;
      acc[e] = acc[e] * corr + (d < hd ? p * to_float(v[kr + d]) : 0.f);
    }
    m = m_new;
  }
  const float inv = n > 0 ? 1.f / l : 0.f;
#pragma unroll
  for (int e = 0; e < DPL; e++) {
    const int d = lane + 32 * e;
    if (d < hd) o[d] = from_float<T>(acc[e] * inv);
  }
  if (lane == 0) lse[row * H + h] = n > 0 ? (m + log2f(l)) * kLn2 : INFINITY;
}

template <class T, int DPL>
__global__ void attn_bwd_dq_v1(T* __restrict__ dq, const T* __restrict__ dout, const T* __restrict__ q,
                               const T* __restrict__ k, const T* __restrict__ v,
                               const float* __restrict__ lse, const float* __restrict__ delta,
                               const int32_t* __restrict__ cu_q, const int32_t* __restrict__ cu_k,
                               int nseq, int64_t Nq, int H, int KV, int hd, bool causal, float scale) {
  pdl_entry();
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int h = blockIdx.y, lane = threadIdx.x % 32, g = h / (H / KV);
  if (row >= Nq) return;
  const int i = find_seq(cu_q, nseq, row);
  int n = 0;
  if (i >= 0) {
    const int Lq = cu_q[i + 1] - cu_q[i], Lk = cu_k[i + 1] - cu_k[i], t = int(row - cu_q[i]);
    n = causal ? max(0, min(Lk, t + Lk - Lq + 1)) : Lk;
  }
  const int64_t qr = (row * H + h) * hd;
  float qd[DPL], dod[DPL], acc[DPL];
#pragma unroll
  for (int e = 0; e < DPL; e++) {
    const int d = lane + 32 * e;
    qd[e] = d < hd ? to_float(q[qr + d]) * scale * kLog2e : 0.f;
    dod[e] = d < hd ? to_float(dout[qr + d]) : 0.f;
    acc[e] = 0.f;
  }
  const float lse2 = n > 0 ? lse[row * H + h] * kLog2e : 0.f;
  const float dl = n > 0 ? delta[row * H + h] : 0.f;
  for (int j = 0; j < n; j++) {
    const int64_t kr = ((int64_t(cu_k[i]) + j) * KV + g) * hd;
    float s = 0.f, dp = 0.f;
#pragma unroll
    for (int e = 0; e < DPL; e++) {
      const int d = lane + 32 * e;
      if (d < hd) {
        s += qd[e] * to_float(k[kr + d]);
        dp += dod[e] * to_float(v[kr + d]);
      }
    }
    s = warp_sum(s);
    dp = warp_sum(dp);
    const float ds = exp2f(s - lse2) * (dp - dl);  // p (dp - delta)
#pragma unroll
    for (int e = 0; e < DPL; e++) {
      const int d = lane + 32 * e;
      if (d < hd) acc[e] += ds * to_float(k[kr + d]);
    }
  }
#pragma unroll
  for (int e = 0; e < DPL; e++) {
    const int d = lane + 32 * e;
    if (d < hd) dq[qr + d] = from_float<T>(acc[e] * scale);
  }
}

// One warp per key row of kv head g: walks the group's query heads and the queries that see it.
template <class T, int DPL>
__global__ void attn_bwd_dkdv_v1(T* __restrict__ dk, T* __restrict__ dv, const T* __restrict__ dout,
                                 const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                 const float* __restrict__ lse, const float* __restrict__ delta,
                                 const int32_t* __restrict__ cu_q, const int32_t* __restrict__ cu_k,
                                 int nseq, int64_t Nk, int H, int KV, int hd, bool causal, float scale) {
  pdl_entry();
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int g = blockIdx.y, lane = threadIdx.x % 32, group = H / KV;
  if (row >= Nk) return;
  const int i = find_seq(cu_k, nseq, row);
  const int64_t kr = (row * KV + g) * hd;
  float kd[DPL], vd[DPL], dka[DPL], dva[DPL];
#pragma unroll
  for (int e = 0; e < DPL; e++) {
    const int d = lane + 32 * e;
    kd[e] = d < hd ? to_float(k[kr + d]) * scale * kLog2e : 0.f;
    vd[e] = d < hd ? to_float(v[kr + d]) : 0.f;
    dka[e] = dva[e] = 0.f;
  }
  if (i >= 0) {
    const int q0 = cu_q[i], Lq = cu_q[i + 1] - q0, Lk = cu_k[i + 1] - cu_k[i];
    const int j = int(row - cu_k[i]);
    const int t0 = causal ? max(0, j - (Lk - Lq)) : 0;  // first query that sees key j
    for (int h = g * group; h < (g + 1) * group; h++) {
      for (int t = t0; t < Lq; t++) {
        const int64_t qr = ((int64_t(q0) + t) * H + h) * hd;
        float s = 0.f, dp = 0.f;
#pragma unroll
        for (int e = 0; e < DPL; e++) {
          const int d = lane + 32 * e;
          if (d < hd) {
            s += kd[e] * to_float(q[qr + d]);
            dp += vd[e] * to_float(dout[qr + d]);
          }
        }
        s = warp_sum(s);
        dp = warp_sum(dp);
        const int64_t st = (int64_t(q0) + t) * H + h;
        const float p = exp2f(s - lse[st] * kLog2e);
        const float ds = p * (dp - delta[st]);
#pragma unroll
        for (int e = 0; e < DPL; e++) {
          const int d = lane + 32 * e;
          if (d < hd) {
            dva[e] += p * to_float(dout[qr + d]);
            dka[e] += ds * to_float(q[qr + d]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int e = 0; e < DPL; e++) {
    const int d = lane + 32 * e;
    if (d < hd) {
      dk[kr + d] = from_float<T>(dka[e] * scale);
      dv[kr + d] = from_float<T>(dva[e]);
    }
  }
}

template <class T, int DPL>
void fwd_v1_dpl(T* out, float* lse, const T* q, const T* k, const T* v, const int32_t* cu_q,
            const int32_t* cu_k, int nseq, int64_t Nq, int H, int KV, int hd, bool causal,
            float scale_log2, cudaStream_t s) {
  dim3 grid(ceil_div(Nq, 4), H);
  launch_kernel(attn_fwd_v1<dev_t<T>, DPL>, grid, 128, 0, s, dptr(out), lse, dptr(q), dptr(k), dptr(v), cu_q, cu_k,
                nseq, Nq, H, KV, hd, causal, scale_log2);
  LAUNCH_CHECK();
}

template <class T, int DPL>
void bwd_v1_dpl(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v, const float* lse,
            const float* delta, const int32_t* cu_q, const int32_t* cu_k, int nseq, int64_t Nq,
            int64_t Nk, int H, int KV, int hd, bool causal, float scale, cudaStream_t s) {
  launch_kernel(attn_bwd_dq_v1<dev_t<T>, DPL>, dim3(ceil_div(Nq, 4), H), 128, 0, s, dptr(dq), dptr(dout), dptr(q),
                dptr(k), dptr(v), lse, delta, cu_q, cu_k, nseq, Nq, H, KV, hd, causal, scale);
  LAUNCH_CHECK();
  launch_kernel(attn_bwd_dkdv_v1<dev_t<T>, DPL>, dim3(ceil_div(Nk, 4), KV), 128, 0, s, dptr(dk), dptr(dv), dptr(dout),
                dptr(q), dptr(k), dptr(v), lse, delta, cu_q, cu_k, nseq, Nk, H, KV, hd, causal, scale);
  LAUNCH_CHECK();
}

}  // namespace

namespace attn {

template <class T>
void fwd_v1(T* out, float* lse, const T* q, const T* k, const T* v, const int32_t* cu_q,
            const int32_t* cu_k, int nseq, int64_t Nq, int H, int KV, int hd, bool causal,
            float scale_log2, cudaStream_t s) {
  if (hd <= 32) fwd_v1_dpl<T, 1>(out, lse, q, k, v, cu_q, cu_k, nseq, Nq, H, KV, hd, causal, scale_log2, s);
  else if (hd <= 64) fwd_v1_dpl<T, 2>(out, lse, q, k, v, cu_q, cu_k, nseq, Nq, H, KV, hd, causal, scale_log2, s);
  else fwd_v1_dpl<T, 4>(out, lse, q, k, v, cu_q, cu_k, nseq, Nq, H, KV, hd, causal, scale_log2, s);
}

template <class T>
void bwd_v1(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v, const float* lse,
            const float* delta, const int32_t* cu_q, const int32_t* cu_k, int nseq, int64_t Nq,
            int64_t Nk, int H, int KV, int hd, bool causal, float scale, cudaStream_t s) {
  if (hd <= 32) bwd_v1_dpl<T, 1>(dq, dk, dv, dout, q, k, v, lse, delta, cu_q, cu_k, nseq, Nq, Nk, H, KV, hd, causal, scale, s);
  else if (hd <= 64) bwd_v1_dpl<T, 2>(dq, dk, dv, dout, q, k, v, lse, delta, cu_q, cu_k, nseq, Nq, Nk, H, KV, hd, causal, scale, s);
  else bwd_v1_dpl<T, 4>(dq, dk, dv, dout, q, k, v, lse, delta, cu_q, cu_k, nseq, Nq, Nk, H, KV, hd, causal, scale, s);
}

template void fwd_v1<float>(float*, float*, const float*, const float*, const float*, const int32_t*,
                            const int32_t*, int, int64_t, int, int, int, bool, float, cudaStream_t);
template void fwd_v1<bf16>(bf16*, float*, const bf16*, const bf16*, const bf16*, const int32_t*,
                           const int32_t*, int, int64_t, int, int, int, bool, float, cudaStream_t);
template void fwd_v1<f16>(f16*, float*, const f16*, const f16*, const f16*, const int32_t*,
                           const int32_t*, int, int64_t, int, int, int, bool, float, cudaStream_t);
template void bwd_v1<float>(float*, float*, float*, const float*, const float*, const float*, const float*,
                            const float*, const float*, const int32_t*, const int32_t*, int, int64_t, int64_t,
                            int, int, int, bool, float, cudaStream_t);
template void bwd_v1<bf16>(bf16*, bf16*, bf16*, const bf16*, const bf16*, const bf16*, const bf16*,
                           const float*, const float*, const int32_t*, const int32_t*, int, int64_t, int64_t,
                           int, int, int, bool, float, cudaStream_t);
template void bwd_v1<f16>(f16*, f16*, f16*, const f16*, const f16*, const f16*, const f16*,
                           const float*, const float*, const int32_t*, const int32_t*, int, int64_t, int64_t,
                           int, int, int, bool, float, cudaStream_t);

}  // namespace attn
}  // namespace loom::cuda
