/*
 * attention.cu: flash attention over packed variable-length sequences (varlen), grouped-query
 * heads, optional bottom-right aligned causal mask. Never materializes a T x T matrix.
 *
 * Shape legend: Nq / Nk query / key rows (sequences packed back to back), H query heads,
 * KV key/value heads (head h reads kv head h / (H/KV)), hd head dim, Lq / Lk the query / key
 * count of one sequence, shift = Lk - Lq (causal: query t sees keys j <= t + shift).
 *   q, out, dout, dq [Nq, H, hd] T     k, v, dk, dv [Nk, KV, hd] T     lse, delta [Nq, H] fp32
 *   cu_q, cu_k [nseq + 1] int32 on the device
 *
 * Forward (per sequence, head, query t; s_j = scale q_t . k_j over the visible keys):
 *   lse_t = log sum_j exp(s_j)       (saved; +inf for a row that sees nothing)
 *   out_t = sum_j exp(s_j - lse_t) v_j                                          (=)
 *   computed tile by tile with the online softmax: running max m and sum l per row; each new
 *   tile rescales the accumulator by exp(m_old - m_new). Scores live in the log2 domain
 *   (scale * log2(e) folded into one multiply) so every exponential is one exp2.
 * Backward (p recomputed from lse, nothing else saved):
 *   delta_t = dout_t . out_t                           (workspace, [Nq, H] after dq_acc)
 *   dp_j = dout_t . v_j,  ds_j = p_j (dp_j - delta_t)
 *   dq_t = scale sum_j ds_j k_j                        (=)
 *   dk_j = scale sum_{h in group, t} ds_j q_t          (=)
 *   dv_j = sum_{h in group, t} p_j dout_t              (=)
 *   Two schedules, chosen at run time (set_deterministic_attention(), LOOM_DETERMINISTIC=1):
 *   - single pass (the default; bf16, hd 64/128): one block per key tile walks the query
 *     tiles that see it (the group's query heads in order), keeps dK and dV in registers and
 *     adds each tile pair's dQ contribution with fp32 atomics into dq_acc [Nq, H, hd] fp32
 *     (workspace, zeroed first; dq = bf16(scale dq_acc) at the end). 5 tile GEMMs per tile
 *     pair. The order of the fp32 additions into dq_acc changes from run to run: dq differs in
 *     the last bits between runs (dk, dv do not).
 *   - deterministic: one pass over query tiles for dq and one over key tiles for dk, dv; each
 *     output row is written by exactly one block, bitwise reproducible; the price is
 *     recomputing S and dP in the dq pass (7 tile GEMMs per tile pair). hd 16/32 always run it.
 * Rows outside every sequence: out = dq = 0, lse = +inf; key rows outside: dk = dv = 0.
 *
 * Versions:
 *   v1_warp_per_row (float, and bf16 with a head dim v2 lacks): one warp per query row (per
 *     key row in dk/dv), the head dim split over lanes, one key at a time with a warp
 *     reduction per dot product. A line-by-line port of the reference, readable, slow
 *     (no data reuse between rows: every warp streams K and V itself).
 *   v2_mma_tiles (bf16, hd 16/32/64/128): FlashAttention-2 structure. A block owns 16 * NW * MT
 *     query rows (forward, dq) or key rows (dk/dv), one warp per 16 MT rows; K/V (or Q/dout)
 *     tiles are staged in XOR-swizzled shared memory by cp.async, double-buffered so the next
 *     tile loads while this one is computed; ldmatrix feeds mma.sync m16n8k16 (bf16 in, fp32
 *     accumulate); the score tile never leaves registers (the C fragment of S is re-packed as
 *     the A fragment of P for P V). Causal: tiles above the diagonal are skipped, the mask is
 *     applied only on tiles that cross it or the sequence end; the longest query tiles are
 *     scheduled first.
 *   Tiles: forward 4 warps x 2 m-tiles = 128 queries x 64-key tiles for hd 64/128 (hd 128
 *   re-reads the Q fragments from shared memory at every k-step: O and S fill the registers;
 *   holding Q too forced 32-key tiles and a 72-byte spill), 4 warps x 1 m-tile for hd 16/32.
 *   dq: 4 warps x 2 m-tiles = 128 queries x 32-key tiles at hd 64 (Q, dO, S, dP, dQ in
 *   registers), 64 queries x 64 keys (32 at hd 128) elsewhere. dk/dv: 128 keys per block
 *   (64 at hd 128), one m-tile per warp.
 *   Single pass: the dk/dv block (one m-tile of 16 keys per warp, S^T and dP^T in registers)
 *   plus, per tile pair, dS^T stored transposed into shared memory as bf16 (stmatrix .trans),
 *   a barrier, dQ_tile = dS K split over the warps (a 32 x 32 block each) and
 *   red.global.add.v2.f32 of the result. hd 128: 8 warps = 128 keys per block, query tiles
 *   of 64 (255 registers, no spill, 145 KB shared memory, 1 block per SM); hd 64: 4 warps =
 *   64 keys, query tiles of 64 (225 registers, 2 blocks per SM). Blocks go by chunks of
 *   (kv head, sequence) pairs holding ~32 MB of Q, dO and dq_acc, key tile 0 of every pair
 *   of the chunk first (causal: longest first).
 *   Measured on H200, bf16, median of 20 (bench/bench_attention.cpp; PyTorch 2.11 SDPA
 *   FLASH_ATTENTION in the same session in brackets), TFLOP/s forward | forward+backward:
 *                                   B8 H12 T1024 D64   B8 H16 T2048 D128 c   B4 H9 T2048 D64 c
 *     v2, 1 m-tile per warp          154 | 136          172 | 159             120 | 112
 *     v2, 2 m-tiles fwd (earlier)    212 | 146          191 | 163             145 | 117
 *     PyTorch FLASH_ATTENTION       (218 | 168)        (271 | 213)           (161 | 142)
 *   Second session (runs of the same binaries interleaved; spread between repeats ~1%):
 *     v2 as above                    211 | 146          192 | 164             143 | 118
 *     + hd128 fwd Q from smem, 64-key tiles; dq 2 m-tiles at hd 64
 *                                    211 | 156          226 | 172             145 | 120
 *     same + dk/dv 2 m-tiles at hd 64 (4 warps x 32 keys, query tiles of 32, 255 registers)
 *                                    211 | 154          224 | 171             145 | 109
 *     PyTorch FLASH_ATTENTION       (215 | 140)        (266 | 214)           (153 | 143)
 *   (PyTorch's first-shape fwd+bwd read 168-178 in other sessions: compare with care.)
 *   The kept version again in a third session: 213 | 152, 226 | 171, 145 | 117.
 *   One m-tile per warp reads 512 B of shared memory per 2 mma (smem-bound at ~half the mma
 *   rate); two m-tiles halve that: +38% in the forward at hd 64; in the dq pass +4-6% fwd+bwd
 *   on the full hd 64 case, nothing measurable on the causal one; hd 128 forward +17%. Two m-tiles in dk/dv helped the full hd 64 case (+3%) but lost 8% causal (fewer,
 *   fatter warps per block finish the diagonal tiles later): not kept. Still short of the
 *   target at hd 128 (0.85x forward) and in the causal backward (0.81-0.84x): next steps are
 *   wgmma (sm_90a) for the hd 128 forward, and in dk/dv a layout where 8 warps share 2 m-tiles
 *   of keys and split the query tile (reuse without the 128-register accumulators per warp).
 *   Single-pass backward, H200, ms over 3 runs of the bench (TFLOP/s in brackets; the forward
 *   is the sm90 wgmma kernel):
 *     shape                 forward      fwd+bwd, single pass   fwd+bwd, deterministic
 *     B8 H12 T1024 D64      0.106 (243)  0.514-0.516 (175)      0.574-0.575 (157)
 *     B8 H16 T2048 D128 c   0.431 (319)  2.150-2.158 (224)      2.625-2.645 (182)
 *     B4 H9 T2048 D64 c     0.105 (182)  0.413-0.418 (162)      0.548-0.554 (123)
 *     PyTorch FLASH_ATTENTION fwd+bwd in an earlier session: 0.610, 2.250, 0.530.
 *   The backward alone (fwd+bwd - fwd): 0.41, 1.72, 0.31 ms single pass against 0.47, 2.21,
 *   0.44 deterministic (-12%, -22%, -30%); 2.19 ms at hd 128 causal before the single pass.
 *   Measured alternatives (earlier runs of the same session, chunks of ~24 MB; fwd+bwd ms for
 *   the three shapes):
 *     hd 64 with 8 warps x 16 keys per block: 0.522-0.532, 0.428-0.429 (kept: 0.512-0.515,
 *       0.421-0.423); hd 128 with query tiles of 32: 8 warps 2.52, 4 warps 2.45 (kept 2.20-2.22;
 *       2.15 with the ~32 MB chunks split evenly; 16 pairs per chunk, an uneven split at hd 64
 *       causal (16 + 16 + 4 pairs): 0.480 against 0.423).
 *     Block order (hd 64 then with 8 warps) pair-major, every key tile of one kv head, then the
 *       next: 0.530, 2.255, 0.487: the long causal blocks of the last heads start late and run
 *       alone at the end.
 *       Key-tile-major over all pairs (longest first globally): 0.550, 2.366, 0.429: the Q, dO
 *       and dq_acc rows of every head are in flight at once and the atomics miss in L2.
 *     The atomics are the main cost: with the reductions left out (a probe, dq wrong) hd 128
 *       ran 1.91 ms, without the dQ product at all 1.79 ms (kept: 2.22 in that run). Tried
 *       without gain: red.v4 after a lane shuffle (2.26); the partial staged in shared memory
 *       and added 512 contiguous bytes per warp at the next tile pair's start (2.21; spread
 *       over the next S / dP products instead: spills, 2.32).
 *   Then (same day, H200, one call each): the delta computation and the dq_acc zeroing fused
 *     into one launch (attn_bwd_prep: 16-byte loads, HD/8 threads per row), and the dq
 *     conversion and the zeroing of dk/dv rows outside every sequence into another
 *     (attn_bwd_finish): 6 launches -> 3. fwd+bwd 0.514 / 2.150 / 0.418 -> 0.493 / 2.118 /
 *     0.399 ms. Alternative hd 64 tilings in that call, none better (0.497-0.504 and
 *     0.406-0.413 ms): 8 warps x 16 keys with the dQ split 2 x 4 or 4 x 2, 4 warps with query
 *     tiles of 32 (167 registers, 3 blocks per SM).
 *   A wgmma single pass at hd 64 was written and passed every test, and was slower, so it is
 *     not kept: per query tile of 64 and warpgroup of 64 keys, S^T and dP^T by wgmma from
 *     shared memory, dV and dK with P^T / dS^T from registers, dS^T staged in shared memory
 *     and read as a transposed A for dQ = dS K, the same fp32 reductions. 2 warpgroups x 64
 *     keys (230 registers, 1 block per SM): 0.635 / 0.576 ms fwd+bwd on the two hd 64 shapes;
 *     1 warpgroup (2 blocks per SM): 0.571 / 0.514; this mma.sync single pass in the same
 *     call: 0.496 / 0.401. Every product there is waited for before its result is used (the
 *     exponentials, the reductions), with at most 2 warpgroups per SM to hide it; it would
 *     need the next tile's S^T / dP^T in flight during this tile's elementwise work (a second
 *     set of accumulators: 64 more registers) to pay.
 * Napkin math: forward 4 B H T^2 hd FLOP (x 0.5 causal), reads Q, K, V once per query tile
 *   (K/V re-read from L2 by every query tile of a head) and writes out + lse. B8 H16 T2048
 *   hd128 causal: 137 GFLOP -> ~0.2 ms at 650 TFLOP/s of mma.sync; bytes 4 x 67 MB = 0.27 GB
 *   -> 0.08 ms. Compute-bound: the gap to the mma peak is the figure of merit.
 *   Single-pass backward: 2.5x the forward FLOP (5 tile GEMMs against 2), and fp32 atomics of
 *   BRQ x hd x 4 bytes per tile pair, i.e. 4 / (10 BC) bytes per FLOP: 1.1 GB at 128 keys per
 *   block on the hd 128 shape (343 GFLOP), into an L2-resident dq_acc; plus zeroing and
 *   converting dq_acc (0.34 GB moved there). The atomics cost ~0.3 ms of the 1.7 ms (above).
 *
 * Backends: attention_forward / attention_backward first ask attention_cudnn.cu (train.attention
 *   = cudnn, or auto's choice for the shape) and run forward_loom / backward_loom otherwise.
 * Reference: kernels/cpu/attention.cpp. Test: tests/cuda/test_cuda_kernels_b.cpp
 *   ("attention ..."); bench: bench/bench_attention.cpp. On the GPU machine:
 *   bash tools/gpu-kernels.sh tests/cuda/test_cuda_kernels_b.cpp
 */
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <type_traits>

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

// =========================================================================== common pieces
// delta[r, h] = dout[r, h, :] . out[r, h, :] in fp32; one warp per (row, head).
template <class T>
__global__ void attn_delta(float* __restrict__ delta, const T* __restrict__ dout,
                           const T* __restrict__ out, int64_t rows, int hd) {
  const int64_t w = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (w >= rows) return;
  const T* a = dout + w * hd;
  const T* b = out + w * hd;
  float s = 0.f;
  for (int d = threadIdx.x % 32; d < hd; d += 32) s += to_float(a[d]) * to_float(b[d]);
  s = warp_sum(s);
  if (threadIdx.x % 32 == 0) delta[w] = s;
}

// Rows of x [rows, width] before cu[0] or from cu[nseq] on belong to no sequence: x = 0 and,
// when stat is given, stat[row, 0..nstat) = +inf. One warp per row.
template <class T>
__global__ void zero_outside(T* __restrict__ x, float* __restrict__ stat, const int32_t* __restrict__ cu,
                             int nseq, int64_t rows, int width, int nstat) {
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (r >= rows || (r >= cu[0] && r < cu[nseq])) return;
  for (int i = threadIdx.x % 32; i < width; i += 32) x[r * width + i] = from_float<T>(0.f);
  if (stat)
    for (int i = threadIdx.x % 32; i < nstat; i += 32) stat[r * nstat + i] = INFINITY;
}

// =========================================================================== v1_warp_per_row
// DPL = head-dim elements per lane (hd <= 32 DPL). Lane `l` owns dims l, l + 32, ...
template <class T, int DPL>
__global__ void attn_fwd_v1(T* __restrict__ out, float* __restrict__ lse, const T* __restrict__ q,
                            const T* __restrict__ k, const T* __restrict__ v,
                            const int32_t* __restrict__ cu_q, const int32_t* __restrict__ cu_k,
                            int nseq, int64_t Nq, int H, int KV, int hd, bool causal, float scale_log2) {
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

// =========================================================================== v2 forward
// Block: NW warps x MT m-tiles x 16 rows = BR query rows of one head. A warp owns 16 MT rows,
// so each K / V fragment it reads from shared memory feeds MT mma instructions (MT = 1 reads
// 512 B of shared memory per 2 mma, which caps mma.sync at ~half its rate). QREG: the warp's
// Q fragments stay in registers for the whole key loop; otherwise they are re-read from sQ at
// every k-step (hd 128: frees 64 registers for 64-key tiles without spills).
template <int HD, int NW, int MT, int BC, bool QREG>
__global__ void __launch_bounds__(NW * 32)
attn_fwd_v2(bf* __restrict__ out, float* __restrict__ lse, const bf* __restrict__ q,
            const bf* __restrict__ k, const bf* __restrict__ v, const int32_t* __restrict__ cu_q,
            const int32_t* __restrict__ cu_k, int H, int KV, bool causal, float scale_log2) {
  constexpr int BR = 16 * NW * MT, NT = NW * 32;
  extern __shared__ __align__(128) unsigned char smem[];
  bf* sQ = reinterpret_cast<bf*>(smem);  // [BR][HD], later the output staging
  bf* sK = sQ + BR * HD;                 // [2][BC][HD]
  bf* sV = sK + 2 * BC * HD;             // [2][BC][HD]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int seq = blockIdx.z, h = blockIdx.y, kvh = h / (H / KV);
  const int q0 = cu_q[seq], Lq = cu_q[seq + 1] - q0, k0 = cu_k[seq], Lk = cu_k[seq + 1] - k0;
  const int qs = (gridDim.x - 1 - blockIdx.x) * BR;  // longest (causal) tiles start first
  if (qs >= Lq) return;
  const int nq = min(BR, Lq - qs), shift = Lk - Lq;
  const int64_t qstride = int64_t(H) * HD, kvstride = int64_t(KV) * HD;
  const bf* qbase = q + (int64_t(q0) + qs) * qstride + h * HD;
  const bf* kbase = k + int64_t(k0) * kvstride + kvh * HD;
  const bf* vbase = v + int64_t(k0) * kvstride + kvh * HD;
  const int kend = causal ? min(Lk, qs + nq + shift) : Lk;  // keys the last row sees
  const int ntiles = kend > 0 ? (kend + BC - 1) / BC : 0;
  const int wrow = warp * 16 * MT;  // the warp's first row in the tile

  load_tile<HD, BR, NT>(sQ, qbase, qstride, nq);
  cp_async_commit();
  if (ntiles > 0) {
    load_tile<HD, BC, NT>(sK, kbase, kvstride, min(BC, Lk));
    load_tile<HD, BC, NT>(sV, vbase, kvstride, min(BC, Lk));
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  uint32_t qf[MT][HD / 16][4];  // !QREG: each entry lives only through its k-step
  if (QREG) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
      for (int kk = 0; kk < HD / 16; kk++) frag_a<HD>(qf[mt][kk], sQ, wrow + mt * 16, kk * 16, lane);
  }

  float o[MT][HD / 8][4] = {};
  float mrow[MT][2], lrow[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; mt++) mrow[mt][0] = mrow[mt][1] = -INFINITY, lrow[mt][0] = lrow[mt][1] = 0.f;
  for (int j = 0; j < ntiles; j++) {
    if (j + 1 < ntiles) {  // prefetch the next K/V tile into the other buffer
      const int kb = (j + 1) * BC, buf = (j + 1) & 1;
      load_tile<HD, BC, NT>(sK + buf * BC * HD, kbase + kb * kvstride, kvstride, min(BC, Lk - kb));
      load_tile<HD, BC, NT>(sV + buf * BC * HD, vbase + kb * kvstride, kvstride, min(BC, Lk - kb));
    }
    cp_async_commit();
    cp_async_wait<1>();  // all but the prefetch just issued: tile j has landed
    __syncthreads();
    const bf* cK = sK + (j & 1) * BC * HD;
    const bf* cV = sV + (j & 1) * BC * HD;

    float s[MT][BC / 8][4] = {};  // S = Q K^T for this warp's rows x BC keys
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
      if (!QREG) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++) frag_a<HD>(qf[mt][kk], sQ, wrow + mt * 16, kk * 16, lane);
      }
#pragma unroll
      for (int np = 0; np < BC / 16; np++) {
        uint32_t b[4];
        frag_b_rows_n<HD>(b, cK, np * 16, kk * 16, lane);
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          mma_bf16(s[mt][2 * np], qf[mt][kk], b[0], b[1]);
          mma_bf16(s[mt][2 * np + 1], qf[mt][kk], b[2], b[3]);
        }
      }
    }
    const int kb = j * BC;
    const bool need_mask = kb + BC > Lk || (causal && kb + BC - 1 > qs + shift);
    uint32_t pa[MT][BC / 16][4];  // P as A fragments
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
      const int row0 = qs + wrow + mt * 16 + g;  // rows row0 (c0, c1) and row0 + 8 (c2, c3)
      if (need_mask) {
#pragma unroll
        for (int nt = 0; nt < BC / 8; nt++)
#pragma unroll
          for (int e = 0; e < 4; e++) {
            const int col = kb + nt * 8 + 2 * t + (e & 1), row = row0 + (e >> 1) * 8;
            if (col >= Lk || (causal && col > row + shift)) s[mt][nt][e] = -INFINITY;
          }
      }
      // online softmax on raw scores; exp2(s * scale_log2 - m * scale_log2) is one FMA + EX2.
      // The quad of 4 lanes t = 0..3 shares a row.
#pragma unroll
      for (int r = 0; r < 2; r++) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < BC / 8; nt++) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(mrow[mt][r], mx * scale_log2);  // log2 domain
        const float m_use = m_new == -INFINITY ? 0.f : m_new;     // a fully masked row so far
        const float corr = exp2f(mrow[mt][r] - m_use);
        mrow[mt][r] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < BC / 8; nt++) {
          s[mt][nt][2 * r] = exp2f(fmaf(s[mt][nt][2 * r], scale_log2, -m_use));
          s[mt][nt][2 * r + 1] = exp2f(fmaf(s[mt][nt][2 * r + 1], scale_log2, -m_use));
          sum += s[mt][nt][2 * r] + s[mt][nt][2 * r + 1];
        }
        lrow[mt][r] = lrow[mt][r] * corr + sum;  // this lane's partial sum; the quad adds up at the end
#pragma unroll
        for (int dt = 0; dt < HD / 8; dt++) {
          o[mt][dt][2 * r] *= corr;
          o[mt][dt][2 * r + 1] *= corr;
        }
      }
#pragma unroll
      for (int kk = 0; kk < BC / 16; kk++) c_to_a(pa[mt][kk], s[mt], kk);
    }
    // O += P V
#pragma unroll
    for (int kk = 0; kk < BC / 16; kk++) {
#pragma unroll
      for (int dp = 0; dp < HD / 16; dp++) {
        uint32_t b[4];
        frag_b_rows_k<HD>(b, cV, kk * 16, dp * 16, lane);
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          mma_bf16(o[mt][2 * dp], pa[mt][kk], b[0], b[1]);
          mma_bf16(o[mt][2 * dp + 1], pa[mt][kk], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // everyone is done with buffer j&1 before it is refilled
  }
#pragma unroll
  for (int mt = 0; mt < MT; mt++) {
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
      float l = lrow[mt][r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      inv[r] = l > 0.f ? 1.f / l : 0.f;
      const int row = qs + wrow + mt * 16 + g + 8 * r;
      if (t == 0 && row < Lq)
        lse[(int64_t(q0) + row) * H + h] = l > 0.f ? (mrow[mt][r] + log2f(l)) * kLn2 : INFINITY;
    }
#pragma unroll
    for (int dt = 0; dt < HD / 8; dt++) {
      o[mt][dt][0] *= inv[0]; o[mt][dt][1] *= inv[0];
      o[mt][dt][2] *= inv[1]; o[mt][dt][3] *= inv[1];
    }
    // each warp stages only its own rows of sQ (which only it has read)
    store_rows<HD>(sQ, wrow + mt * 16, o[mt], 1.f, out + (int64_t(q0) + qs) * qstride + h * HD, qstride,
                   nq, lane);
  }
}

// =========================================================================== v2 backward: dq
// Block: 16 NW MT query rows of one head, one warp per 16 MT rows (each K / V fragment read
// from shared memory feeds MT mma pairs, as in the forward); loops over key tiles. Per tile:
// S = Q K^T, P = exp2(S - lse), dP = dO V^T, dS = P (dP - delta), dQ += dS K.
template <int HD, int NW, int MT, int BC>
__global__ void __launch_bounds__(NW * 32)
attn_bwd_dq_v2(bf* __restrict__ dq, const bf* __restrict__ dout, const bf* __restrict__ q,
               const bf* __restrict__ k, const bf* __restrict__ v, const float* __restrict__ lse,
               const float* __restrict__ delta, const int32_t* __restrict__ cu_q,
               const int32_t* __restrict__ cu_k, int H, int KV, bool causal, float scale,
               float scale_log2) {
  constexpr int BR = 16 * NW * MT, NT = NW * 32;
  extern __shared__ __align__(128) unsigned char smem[];
  bf* sQ = reinterpret_cast<bf*>(smem);  // [BR][HD], later the dq staging
  bf* sO = sQ + BR * HD;                 // [BR][HD] dout
  bf* sK = sO + BR * HD;                 // [2][BC][HD]
  bf* sV = sK + 2 * BC * HD;             // [2][BC][HD]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int seq = blockIdx.z, h = blockIdx.y, kvh = h / (H / KV);
  const int q0 = cu_q[seq], Lq = cu_q[seq + 1] - q0, k0 = cu_k[seq], Lk = cu_k[seq + 1] - k0;
  const int qs = (gridDim.x - 1 - blockIdx.x) * BR;
  if (qs >= Lq) return;
  const int nq = min(BR, Lq - qs), shift = Lk - Lq;
  const int64_t qstride = int64_t(H) * HD, kvstride = int64_t(KV) * HD;
  const int64_t qoff = (int64_t(q0) + qs) * qstride + h * HD;
  const bf* kbase = k + int64_t(k0) * kvstride + kvh * HD;
  const bf* vbase = v + int64_t(k0) * kvstride + kvh * HD;
  const int kend = causal ? min(Lk, qs + nq + shift) : Lk;
  const int ntiles = kend > 0 ? (kend + BC - 1) / BC : 0;
  const int wrow = warp * 16 * MT;  // the warp's first row in the tile

  load_tile<HD, BR, NT>(sQ, q + qoff, qstride, nq);
  load_tile<HD, BR, NT>(sO, dout + qoff, qstride, nq);
  cp_async_commit();
  if (ntiles > 0) {
    load_tile<HD, BC, NT>(sK, kbase, kvstride, min(BC, Lk));
    load_tile<HD, BC, NT>(sV, vbase, kvstride, min(BC, Lk));
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  uint32_t qf[MT][HD / 16][4], of[MT][HD / 16][4];
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
      frag_a<HD>(qf[mt][kk], sQ, wrow + mt * 16, kk * 16, lane);
      frag_a<HD>(of[mt][kk], sO, wrow + mt * 16, kk * 16, lane);
    }
  float lse2[MT][2], dl[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const int row = qs + wrow + mt * 16 + g + 8 * r;
      const bool ok = row < Lq;
      lse2[mt][r] = ok ? lse[(int64_t(q0) + row) * H + h] * kLog2e : INFINITY;  // +inf: p = 0
      dl[mt][r] = ok ? delta[(int64_t(q0) + row) * H + h] : 0.f;
    }
  float acc[MT][HD / 8][4] = {};
  for (int j = 0; j < ntiles; j++) {
    if (j + 1 < ntiles) {
      const int kb = (j + 1) * BC, buf = (j + 1) & 1;
      load_tile<HD, BC, NT>(sK + buf * BC * HD, kbase + kb * kvstride, kvstride, min(BC, Lk - kb));
      load_tile<HD, BC, NT>(sV + buf * BC * HD, vbase + kb * kvstride, kvstride, min(BC, Lk - kb));
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const bf* cK = sK + (j & 1) * BC * HD;
    const bf* cV = sV + (j & 1) * BC * HD;
    float s[MT][BC / 8][4] = {}, dp[MT][BC / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
#pragma unroll
      for (int np = 0; np < BC / 16; np++) {
        uint32_t b[4];
        frag_b_rows_n<HD>(b, cK, np * 16, kk * 16, lane);
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          mma_bf16(s[mt][2 * np], qf[mt][kk], b[0], b[1]);
          mma_bf16(s[mt][2 * np + 1], qf[mt][kk], b[2], b[3]);
        }
        frag_b_rows_n<HD>(b, cV, np * 16, kk * 16, lane);
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          mma_bf16(dp[mt][2 * np], of[mt][kk], b[0], b[1]);
          mma_bf16(dp[mt][2 * np + 1], of[mt][kk], b[2], b[3]);
        }
      }
    }
    const int kb = j * BC;
    const bool need_mask = kb + BC > Lk || (causal && kb + BC - 1 > qs + wrow + shift);
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
      const int row0 = qs + wrow + mt * 16 + g;
#pragma unroll
      for (int nt = 0; nt < BC / 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int r = e >> 1;
          float p = exp2f(s[mt][nt][e] * scale_log2 - lse2[mt][r]);
          if (need_mask) {
            const int col = kb + nt * 8 + 2 * t + (e & 1), row = row0 + 8 * r;
            if (col >= Lk || (causal && col > row + shift)) p = 0.f;
          }
          s[mt][nt][e] = p * (dp[mt][nt][e] - dl[mt][r]);  // dS
        }
    }
#pragma unroll
    for (int kk = 0; kk < BC / 16; kk++) {  // dQ += dS K
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; mt++) c_to_a(a[mt], s[mt], kk);
#pragma unroll
      for (int dd = 0; dd < HD / 16; dd++) {
        uint32_t b[4];
        frag_b_rows_k<HD>(b, cK, kk * 16, dd * 16, lane);
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          mma_bf16(acc[mt][2 * dd], a[mt], b[0], b[1]);
          mma_bf16(acc[mt][2 * dd + 1], a[mt], b[2], b[3]);
        }
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int mt = 0; mt < MT; mt++)  // each warp stages only its own rows of sQ
    store_rows<HD>(sQ, wrow + mt * 16, acc[mt], scale, dq + qoff, qstride, nq, lane);
}

// =========================================================================== v2 backward: shared pieces
// Pieces of a key-tile block's work per query tile, used by attn_bwd_dkdv_v2 and the single
// pass. A warp owns 16 keys (rows warp*16.. of sK / sV); cQ, cO, cL, cD are the current
// query tile's Q, dO, lse * log2(e) and delta in shared memory.

// Q, dO (rows qt.. of query head h, nq of them valid) into buffer buf; lse and delta beside them
// (+inf / 0 past nq, so that p = 0 there).
template <int HD, int BRQ, int NT>
__device__ __forceinline__ void load_q_dout_tile(bf* sQ, bf* sO, float* sL, float* sD, int buf, const bf* q,
                                                 const bf* dout, const float* lse, const float* delta,
                                                 int q0, int qt, int h, int H, int Lq) {
  const int nq = min(BRQ, Lq - qt);
  const int64_t qstride = int64_t(H) * HD, off = (int64_t(q0) + qt) * qstride + h * HD;
  load_tile<HD, BRQ, NT>(sQ + buf * BRQ * HD, q + off, qstride, nq);
  load_tile<HD, BRQ, NT>(sO + buf * BRQ * HD, dout + off, qstride, nq);
  for (int i = threadIdx.x; i < BRQ; i += NT) {
    const bool ok = i < nq;
    const int64_t st = (int64_t(q0) + qt + i) * H + h;
    sL[buf * BRQ + i] = ok ? lse[st] * kLog2e : INFINITY;
    sD[buf * BRQ + i] = ok ? delta[st] : 0.f;
  }
}

// st = P^T and dpt = dS^T (the warp's 16 keys x BRQ queries, C layout): S^T = K Q^T and
// dP^T = V dO^T by mma, then p = exp2(s scale log2(e) - lse), masked past Lk and above the
// causal diagonal (query tile starting at qt), dS^T = p (dP^T - delta).
template <int HD, int BRQ>
__device__ __forceinline__ void dkdv_p_ds(float (&st)[BRQ / 8][4], float (&dpt)[BRQ / 8][4], const bf* sK,
                                          const bf* sV, const bf* cQ, const bf* cO, const float* cL,
                                          const float* cD, int warp, int lane, int key0, int Lk, bool need_mask,
                                          bool causal, int qt, int shift, float scale_log2) {
  const int t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < BRQ / 8; nt++)
#pragma unroll
    for (int e = 0; e < 4; e++) st[nt][e] = dpt[nt][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < HD / 16; kk++) {
    uint32_t ka[4], va[4];
    frag_a<HD>(ka, sK, warp * 16, kk * 16, lane);
    frag_a<HD>(va, sV, warp * 16, kk * 16, lane);
#pragma unroll
    for (int np = 0; np < BRQ / 16; np++) {
      uint32_t b[4];
      frag_b_rows_n<HD>(b, cQ, np * 16, kk * 16, lane);  // S^T = K Q^T
      mma_bf16(st[2 * np], ka, b[0], b[1]);
      mma_bf16(st[2 * np + 1], ka, b[2], b[3]);
      frag_b_rows_n<HD>(b, cO, np * 16, kk * 16, lane);  // dP^T = V dO^T
      mma_bf16(dpt[2 * np], va, b[0], b[1]);
      mma_bf16(dpt[2 * np + 1], va, b[2], b[3]);
    }
  }
#pragma unroll
  for (int nt = 0; nt < BRQ / 8; nt++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int qc = nt * 8 + 2 * t + (e & 1);  // query column inside the tile
      float p = exp2f(st[nt][e] * scale_log2 - cL[qc]);  // rows past Lq have lse +inf: p = 0
      if (need_mask) {
        const int key = key0 + 8 * (e >> 1);
        if (key >= Lk || (causal && key > qt + qc + shift)) p = 0.f;
      }
      st[nt][e] = p;
      dpt[nt][e] = p * (dpt[nt][e] - cD[qc]);  // dS^T
    }
}

// dV += P^T dO and dK += dS^T Q for queries 16 kk..16 kk+15 (pa, da: A fragments of P^T, dS^T).
template <int HD>
__device__ __forceinline__ void dkdv_accumulate(float (&dva)[HD / 8][4], float (&dka)[HD / 8][4],
                                                const uint32_t (&pa)[4], const uint32_t (&da)[4], const bf* cQ,
                                                const bf* cO, int kk, int lane) {
#pragma unroll
  for (int dd = 0; dd < HD / 16; dd++) {
    uint32_t b[4];
    frag_b_rows_k<HD>(b, cO, kk * 16, dd * 16, lane);  // dV += P^T dO
    mma_bf16(dva[2 * dd], pa, b[0], b[1]);
    mma_bf16(dva[2 * dd + 1], pa, b[2], b[3]);
    frag_b_rows_k<HD>(b, cQ, kk * 16, dd * 16, lane);  // dK += dS^T Q
    mma_bf16(dka[2 * dd], da, b[0], b[1]);
    mma_bf16(dka[2 * dd + 1], da, b[2], b[3]);
  }
}

// =========================================================================== v2 backward: dk, dv
// Block: 16 NW key rows of one kv head, one warp per 16 keys (its dK, dV rows live in its
// registers). Walks the group's query heads and the query tiles (BRQ rows) that see the
// block's keys, double-buffering Q, dO, lse and delta. Per tile, transposed products:
// S^T = K Q^T, P^T, dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q.
template <int HD, int NW, int BRQ>
__global__ void __launch_bounds__(NW * 32)
attn_bwd_dkdv_v2(bf* __restrict__ dk, bf* __restrict__ dv, const bf* __restrict__ dout,
                 const bf* __restrict__ q, const bf* __restrict__ k, const bf* __restrict__ v,
                 const float* __restrict__ lse, const float* __restrict__ delta,
                 const int32_t* __restrict__ cu_q, const int32_t* __restrict__ cu_k, int H, int KV,
                 bool causal, float scale, float scale_log2) {
  constexpr int BC = 16 * NW, NT = NW * 32;
  extern __shared__ __align__(128) unsigned char smem[];
  bf* sK = reinterpret_cast<bf*>(smem);  // [BC][HD], later the dk staging
  bf* sV = sK + BC * HD;                 // [BC][HD], later the dv staging
  bf* sQ = sV + BC * HD;                 // [2][BRQ][HD]
  bf* sO = sQ + 2 * BRQ * HD;            // [2][BRQ][HD] dout
  float* sL = reinterpret_cast<float*>(sO + 2 * BRQ * HD);  // [2][BRQ] lse * log2(e)
  float* sD = sL + 2 * BRQ;                                 // [2][BRQ] delta
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2;
  const int seq = blockIdx.z, kvh = blockIdx.y, group = H / KV;
  const int q0 = cu_q[seq], Lq = cu_q[seq + 1] - q0, k0 = cu_k[seq], Lk = cu_k[seq + 1] - k0;
  const int ks = blockIdx.x * BC;  // causal: the first key tiles see the most queries; start them first
  if (ks >= Lk) return;
  const int nk = min(BC, Lk - ks), shift = Lk - Lq;
  const int64_t kvstride = int64_t(KV) * HD;
  const int64_t koff = (int64_t(k0) + ks) * kvstride + kvh * HD;
  const int t_min = causal ? max(0, ks - shift) : 0;  // the first query that sees key ks
  const int n_qt = t_min < Lq ? (Lq - t_min + BRQ - 1) / BRQ : 0;
  const int n_it = group * n_qt;

  auto load_q_tile = [&](int it, int buf) {
    load_q_dout_tile<HD, BRQ, NT>(sQ, sO, sL, sD, buf, q, dout, lse, delta, q0, t_min + (it % n_qt) * BRQ,
                                  kvh * group + it / n_qt, H, Lq);
  };
  load_tile<HD, BC, NT>(sK, k + koff, kvstride, nk);
  load_tile<HD, BC, NT>(sV, v + koff, kvstride, nk);
  if (n_it > 0) load_q_tile(0, 0);
  cp_async_commit();

  float dka[HD / 8][4] = {}, dva[HD / 8][4] = {};
  const int key0 = ks + warp * 16 + g;  // this thread's keys: key0 (c0, c1) and key0 + 8
  for (int it = 0; it < n_it; it++) {
    if (it + 1 < n_it) load_q_tile(it + 1, (it + 1) & 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const int buf = it & 1, qt = t_min + (it % n_qt) * BRQ;
    const bf* cQ = sQ + buf * BRQ * HD;
    const bf* cO = sO + buf * BRQ * HD;
    const float* cL = sL + buf * BRQ;
    const float* cD = sD + buf * BRQ;
    float st[BRQ / 8][4], dpt[BRQ / 8][4];
    const bool need_mask = ks + BC > Lk || (causal && ks + BC - 1 > qt + shift);
    dkdv_p_ds<HD, BRQ>(st, dpt, sK, sV, cQ, cO, cL, cD, warp, lane, key0, Lk, need_mask, causal, qt, shift,
                       scale_log2);
#pragma unroll
    for (int kk = 0; kk < BRQ / 16; kk++) {
      uint32_t pa[4], da[4];
      c_to_a(pa, st, kk);
      c_to_a(da, dpt, kk);
      dkdv_accumulate<HD>(dva, dka, pa, da, cQ, cO, kk, lane);
    }
    __syncthreads();
  }
  cp_async_wait<0>();
  __syncthreads();  // the K/V tiles (when no query tile ran) have landed before restaging
  store_rows<HD>(sK, warp * 16, dka, scale, dk + koff, kvstride, nk, lane);
  store_rows<HD>(sV, warp * 16, dva, 1.f, dv + koff, kvstride, nk, lane);
}

// =========================================================================== v2 backward, single pass
// attn_bwd_dkdv_v2's block and loop (16 NW keys of one kv head; the group's query heads and
// the query tiles that see the keys), plus the dQ contribution of every tile pair, so that S
// and dP are computed once: dS is staged in shared memory as bf16 (queries x keys), then all
// warps split dQ_tile = dS K (BRQ x HD; WM warps along the rows, NW / WM along the columns)
// and add it with fp32 vector reductions into dq_acc (zeroed before, converted to bf16 after).
// 5 tile GEMMs per tile pair instead of 7. The order in which blocks add into a dq_acc row
// changes from run to run: dq is not bitwise reproducible (fp32 rounding only).
template <int HD, int NW, int BRQ, int WM>
__global__ void __launch_bounds__(NW * 32)
attn_bwd_v2_atomic_dq(bf* __restrict__ dk, bf* __restrict__ dv, float* __restrict__ dq_acc,
                      const bf* __restrict__ dout, const bf* __restrict__ q, const bf* __restrict__ k,
                      const bf* __restrict__ v, const float* __restrict__ lse,
                      const float* __restrict__ delta, const int32_t* __restrict__ cu_q,
                      const int32_t* __restrict__ cu_k, int nseq, int H, int KV, int n_kt,
                      int chunk_pairs, bool causal, float scale, float scale_log2) {
  constexpr int BC = 16 * NW, NT = NW * 32;
  constexpr int WN = NW / WM, QM = BRQ / WM, QN = HD / WN;  // a warp's block of dQ: QM x QN
  static_assert(NW % WM == 0 && QM % 16 == 0 && QN % 16 == 0, "dQ warp blocks are whole 16x16 tiles");
  extern __shared__ __align__(128) unsigned char smem[];
  bf* sK = reinterpret_cast<bf*>(smem);  // [BC][HD], later the dk staging
  bf* sV = sK + BC * HD;                 // [BC][HD], later the dv staging
  bf* sQ = sV + BC * HD;                 // [2][BRQ][HD]
  bf* sO = sQ + 2 * BRQ * HD;            // [2][BRQ][HD] dout
  bf* sS = sO + 2 * BRQ * HD;            // [BRQ][BC] dS of the current tile pair, queries x keys
  float* sL = reinterpret_cast<float*>(sS + BRQ * BC);  // [2][BRQ] lse * log2(e)
  float* sD = sL + 2 * BRQ;                             // [2][BRQ] delta
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  // block -> (key tile kt, kv head, sequence). The (kv head, sequence) pairs go in chunks of
  // chunk_pairs; inside a chunk key tile 0 of every pair first, then tile 1, ... Causal: the
  // first key tiles see the most queries, so the long blocks start first and the short ones
  // fill the tail; the chunk keeps the Q, dO and dq_acc rows that the running blocks share
  // in L2 (see bwd_v2_atomic).
  const int pairs = KV * nseq, per_chunk = chunk_pairs * n_kt;
  const int chunk = int(blockIdx.x) / per_chunk, within = int(blockIdx.x) % per_chunk;
  const int pc = min(chunk_pairs, pairs - chunk * chunk_pairs);
  const int kt = within / pc, pair = chunk * chunk_pairs + within % pc;
  const int seq = pair / KV, kvh = pair % KV, group = H / KV;
  const int q0 = cu_q[seq], Lq = cu_q[seq + 1] - q0, k0 = cu_k[seq], Lk = cu_k[seq + 1] - k0;
  const int ks = kt * BC;
  if (ks >= Lk) return;
  const int nk = min(BC, Lk - ks), shift = Lk - Lq;
  const int64_t qstride = int64_t(H) * HD, kvstride = int64_t(KV) * HD;
  const int64_t koff = (int64_t(k0) + ks) * kvstride + kvh * HD;
  const int t_min = causal ? max(0, ks - shift) : 0;  // the first query that sees key ks
  const int n_qt = t_min < Lq ? (Lq - t_min + BRQ - 1) / BRQ : 0;
  const int n_it = group * n_qt;
  auto qtile = [&](int it) { return t_min + (it % n_qt) * BRQ; };  // iteration -> first query

  auto load_q_tile = [&](int it, int buf) {
    load_q_dout_tile<HD, BRQ, NT>(sQ, sO, sL, sD, buf, q, dout, lse, delta, q0, qtile(it), kvh * group + it / n_qt,
                                  H, Lq);
  };
  load_tile<HD, BC, NT>(sK, k + koff, kvstride, nk);
  load_tile<HD, BC, NT>(sV, v + koff, kvstride, nk);
  if (n_it > 0) load_q_tile(0, 0);
  cp_async_commit();

  float dka[HD / 8][4] = {}, dva[HD / 8][4] = {};
  const int key0 = ks + warp * 16 + g;  // this thread's keys: key0 (c0, c1) and key0 + 8
  const int wm = warp / WN, wn = warp % WN;  // the warp's dQ block: rows wm QM.., columns wn QN..
  for (int it = 0; it < n_it; it++) {
    // Two barriers per tile pair, none at the end of the loop: the buffer refilled here was
    // last read before the previous pair's dQ barrier, which every warp has passed; the barrier
    // below says tile `it` landed and every warp is done with the previous dQ product (sS).
    if (it + 1 < n_it) load_q_tile(it + 1, (it + 1) & 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const int buf = it & 1, h = kvh * group + it / n_qt, qt = qtile(it);
    const bf* cQ = sQ + buf * BRQ * HD;
    const bf* cO = sO + buf * BRQ * HD;
    const float* cL = sL + buf * BRQ;
    const float* cD = sD + buf * BRQ;
    float st[BRQ / 8][4], dpt[BRQ / 8][4];
    const bool need_mask = ks + BC > Lk || (causal && ks + BC - 1 > qt + shift);
    dkdv_p_ds<HD, BRQ>(st, dpt, sK, sV, cQ, cO, cL, cD, warp, lane, key0, Lk, need_mask, causal, qt, shift,
                       scale_log2);
#pragma unroll
    for (int kk = 0; kk < BRQ / 16; kk++) {
      uint32_t pa[4], da[4];
      c_to_a(pa, st, kk);
      c_to_a(da, dpt, kk);
      // da is dS^T (this warp's 16 keys x queries 16 kk..) as four 8x8 matrices: keys 0-7 and
      // 8-15 of queries 16 kk.., then of 16 kk + 8..; stored transposed into sS, each lands as
      // 8 query rows x 8 keys (one 16-byte chunk per row)
      const int m = lane >> 3;
      stsm_x4_t(sS + swz<BC>(kk * 16 + (m >> 1) * 8 + (lane & 7), 2 * warp + (m & 1)), da, lane);
      dkdv_accumulate<HD>(dva, dka, pa, da, cQ, cO, kk, lane);
    }
    __syncthreads();  // all of dS is in sS
    float dqa[QM / 16][QN / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < BC / 16; kk++) {  // dQ_tile = dS K (scale applied at the conversion)
      uint32_t a[QM / 16][4];
#pragma unroll
      for (int mt = 0; mt < QM / 16; mt++) frag_a<BC>(a[mt], sS, wm * QM + mt * 16, kk * 16, lane);
#pragma unroll
      for (int dd = 0; dd < QN / 16; dd++) {
        uint32_t b[4];
        frag_b_rows_k<HD>(b, sK, kk * 16, wn * QN + dd * 16, lane);
#pragma unroll
        for (int mt = 0; mt < QM / 16; mt++) {
          mma_bf16(dqa[mt][2 * dd], a[mt], b[0], b[1]);
          mma_bf16(dqa[mt][2 * dd + 1], a[mt], b[2], b[3]);
        }
      }
    }
    // Each lane adds pairs of columns (a warp's reduction: 8 rows x 32 bytes). Query rows past
    // the sequence are skipped (they belong to the next sequence or to no row at all).
    const int nq = min(BRQ, Lq - qt);
    float* dst = dq_acc + ((int64_t(q0) + qt) * H + h) * HD + wn * QN + 2 * t;
#pragma unroll
    for (int mt = 0; mt < QM / 16; mt++)
#pragma unroll
      for (int r = 0; r < 2; r++) {
        const int row = wm * QM + mt * 16 + g + 8 * r;
        if (row < nq) {
#pragma unroll
          for (int nt = 0; nt < QN / 8; nt++)
            red_add_f32x2(dst + row * qstride + nt * 8, dqa[mt][nt][2 * r], dqa[mt][nt][2 * r + 1]);
        }
      }
  }
  cp_async_wait<0>();
  __syncthreads();  // K/V landed (no query tile ran) or every warp is done reading sK
  store_rows<HD>(sK, warp * 16, dka, scale, dk + koff, kvstride, nk, lane);
  store_rows<HD>(sV, warp * 16, dva, 1.f, dv + koff, kvstride, nk, lane);
}

// The single pass's first launch (replaces attn_delta and a memset): for every (row, head) r
// of [Nq * H, HD], delta[r] = dout[r, :] . out[r, :] in fp32 and dq_acc[r, :] = 0. HD / 8
// threads per row, 16-byte loads; the row's threads are adjacent lanes (HD / 8 divides 32).
template <int HD>
__global__ void attn_bwd_prep(float* __restrict__ delta, float* __restrict__ dq_acc, const bf* __restrict__ dout,
                              const bf* __restrict__ out, int64_t rows) {
  constexpr int TPR = HD / 8;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, r = i / TPR;
  const int c = int(i % TPR);
  float s = 0.f;
  if (r < rows) {
    const uint4 a = *reinterpret_cast<const uint4*>(dout + r * HD + c * 8);
    const uint4 b = *reinterpret_cast<const uint4*>(out + r * HD + c * 8);
    const bf* pa = reinterpret_cast<const bf*>(&a);
    const bf* pb = reinterpret_cast<const bf*>(&b);
#pragma unroll
    for (int j = 0; j < 8; j++) s += __bfloat162float(pa[j]) * __bfloat162float(pb[j]);
    float4* z = reinterpret_cast<float4*>(dq_acc + r * HD + c * 8);
    z[0] = make_float4(0.f, 0.f, 0.f, 0.f);
    z[1] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
#pragma unroll
  for (int o = TPR / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (r < rows && c == 0) delta[r] = s;
}

// The single pass's last launch: dq = bf16(scale dq_acc) (4 elements per thread), and the rows
// of dk and dv outside every key sequence, [0, cu_k[0]) and [cu_k[nseq], Nk), set to 0 (grid
// stride, 8 elements per thread): no separate zeroing launches.
__global__ void attn_bwd_finish(bf* __restrict__ dq, const float* __restrict__ acc, int64_t n, float scale,
                                bf* __restrict__ dk, bf* __restrict__ dv, const int32_t* __restrict__ cu_k,
                                int nseq, int64_t Nk, int kv_width) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, i = t * 4;
  if (i < n) {
    const float4 a = *reinterpret_cast<const float4*>(acc + i);
    uint2 o;
    o.x = pack_bf16(a.x * scale, a.y * scale);
    o.y = pack_bf16(a.z * scale, a.w * scale);
    *reinterpret_cast<uint2*>(dq + i) = o;
  }
  const int64_t lo = cu_k[0], hi = cu_k[nseq], cpr = kv_width / 8, m = (lo + Nk - hi) * cpr;
  for (int64_t j = t; j < m; j += int64_t(gridDim.x) * blockDim.x) {
    const int64_t rr = j / cpr, row = rr < lo ? rr : hi + (rr - lo), off = row * kv_width + (j % cpr) * 8;
    *reinterpret_cast<uint4*>(dk + off) = make_uint4(0u, 0u, 0u, 0u);
    *reinterpret_cast<uint4*>(dv + off) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// =========================================================================== launchers
void check_args(const char* op, int nseq, int max_seqlen, int H, int KV, int hd) {
  if (H <= 0 || KV <= 0 || H % KV != 0)
    throw std::invalid_argument(std::string(op) + ": expected H % KV == 0 with H, KV > 0, got H=" +
                                std::to_string(H) + " KV=" + std::to_string(KV));
  if (hd <= 0 || hd > 128)
    throw std::invalid_argument(std::string(op) + ": expected 0 < hd <= 128, got hd=" + std::to_string(hd));
  if (nseq < 0 || nseq > 65535 || max_seqlen < 0)
    throw std::invalid_argument(std::string(op) + ": expected 0 <= nseq <= 65535 and max_seqlen >= 0, got nseq=" +
                                std::to_string(nseq) + " max_seqlen=" + std::to_string(max_seqlen));
}

bool v2_supports(int hd) { return hd == 16 || hd == 32 || hd == 64 || hd == 128; }

template <class K>
void set_smem(K kernel, int bytes) {
  if (bytes > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

template <int HD>
void fwd_v2(bf* out, float* lse, const bf* q, const bf* k, const bf* v, const int32_t* cu_q,
            const int32_t* cu_k, int nseq, int max_seqlen, int H, int KV, bool causal, float scale_log2,
            cudaStream_t s) {
  // 4 warps x 2 m-tiles = 128 query rows for hd >= 64, 64-key tiles; at hd 128 the Q
  // fragments are re-read from shared memory at every k-step so that O and a 64-key S fit in
  // registers (8 bytes of spill instead of 72 with Q held and 32-key tiles). 64 rows for the
  // small head dims of tiny models.
  constexpr int NW = 4, MT = HD >= 64 ? 2 : 1, BR = 16 * NW * MT, BC = 64;
  constexpr bool QREG = HD <= 64;
  const int smem = (BR + 4 * BC) * HD * int(sizeof(bf));
  static bool once = (set_smem(attn_fwd_v2<HD, NW, MT, BC, QREG>, smem), true);
  (void)once;
  dim3 grid(ceil_div(max_seqlen, BR), H, nseq);
  attn_fwd_v2<HD, NW, MT, BC, QREG><<<grid, NW * 32, smem, s>>>(out, lse, q, k, v, cu_q, cu_k, H, KV, causal, scale_log2);
  LAUNCH_CHECK();
}

template <int HD>
void bwd_v2(bf* dq, bf* dk, bf* dv, const bf* dout, const bf* q, const bf* k, const bf* v,
            const float* lse, const float* delta, const int32_t* cu_q, const int32_t* cu_k, int nseq,
            int max_seqlen, int H, int KV, bool causal, float scale, cudaStream_t s) {
  const float scale_log2 = scale * kLog2e;
  {  // dq: 4 warps x 2 m-tiles = 128 query rows at hd 64 (32-key tiles: Q, dO, S, dP and dQ
     // stay in registers), 1 m-tile (64 rows) elsewhere (hd 128: 32-key tiles)
    constexpr int NW = 4, MT = HD == 64 ? 2 : 1, BR = 16 * NW * MT, BC = HD < 64 ? 64 : 32;
    const int smem = (2 * BR + 4 * BC) * HD * int(sizeof(bf));
    static bool once = (set_smem(attn_bwd_dq_v2<HD, NW, MT, BC>, smem), true);
    (void)once;
    dim3 grid(ceil_div(max_seqlen, BR), H, nseq);
    attn_bwd_dq_v2<HD, NW, MT, BC><<<grid, NW * 32, smem, s>>>(dq, dout, q, k, v, lse, delta, cu_q,
                                                               cu_k, H, KV, causal, scale, scale_log2);
    LAUNCH_CHECK();
  }
  {  // dk, dv: 128 keys per block (64 at hd 128), query tiles of 64 (32 at hd 128)
    constexpr int NW = HD <= 64 ? 8 : 4, BC = 16 * NW, BRQ = HD <= 64 ? 64 : 32;
    const int smem = (2 * BC + 4 * BRQ) * HD * int(sizeof(bf)) + 4 * BRQ * int(sizeof(float));
    static bool once = (set_smem(attn_bwd_dkdv_v2<HD, NW, BRQ>, smem), true);
    (void)once;
    dim3 grid(ceil_div(max_seqlen, BC), KV, nseq);
    attn_bwd_dkdv_v2<HD, NW, BRQ><<<grid, NW * 32, smem, s>>>(dk, dv, dout, q, k, v, lse, delta, cu_q,
                                                             cu_k, H, KV, causal, scale, scale_log2);
    LAUNCH_CHECK();
  }
}

template <int HD, int NW, int BRQ, int WM>
void bwd_atomic_launch(bf* dk, bf* dv, float* dq_acc, const bf* dout, const bf* q, const bf* k,
                       const bf* v, const float* lse, const float* delta, const int32_t* cu_q,
                       const int32_t* cu_k, int nseq, int max_seqlen, int H, int KV, bool causal,
                       float scale, cudaStream_t s) {
  constexpr int BC = 16 * NW;
  const int smem = (2 * BC + 4 * BRQ) * HD * int(sizeof(bf)) + BRQ * BC * int(sizeof(bf)) +
                   4 * BRQ * int(sizeof(float));
  static bool once = (set_smem(attn_bwd_v2_atomic_dq<HD, NW, BRQ, WM>, smem), true);
  (void)once;
  // Chunks of (kv head, sequence) pairs whose Q, dO (bf16) and dq_acc (fp32) rows take about
  // 32 MB (H200 L2: 50 MB), split evenly so that the last chunk is not a small tail.
  const int n_kt = ceil_div(max_seqlen, BC), pairs = KV * nseq;
  const double pair_bytes = double(H / KV) * std::max(max_seqlen, 1) * HD * 8.0;
  const int fit = std::max(1, int(32.0 * 1024 * 1024 / pair_bytes));
  const int chunk_pairs = ceil_div(pairs, ceil_div(pairs, fit));
  attn_bwd_v2_atomic_dq<HD, NW, BRQ, WM><<<pairs * n_kt, NW * 32, smem, s>>>(
      dk, dv, dq_acc, dout, q, k, v, lse, delta, cu_q, cu_k, nseq, H, KV, n_kt, chunk_pairs,
      causal, scale, scale * kLog2e);
  LAUNCH_CHECK();
}

// Single pass (hd 64 / 128), three launches: prep (delta, dq_acc = 0), the block kernel
// (dk, dv, dq_acc +=), finish (dq from dq_acc; dk, dv rows outside every sequence = 0). Rows of
// dq outside every sequence are never added to: dq = 0 there.
template <int HD>
void bwd_v2_atomic(bf* dq, bf* dk, bf* dv, float* dq_acc, float* delta, const bf* dout, const bf* out,
                   const bf* q, const bf* k, const bf* v, const float* lse, const int32_t* cu_q,
                   const int32_t* cu_k, int nseq, int max_seqlen, int64_t Nq, int64_t Nk, int H, int KV,
                   bool causal, float scale, cudaStream_t s) {
  const int64_t rows = Nq * H, n = rows * HD;
  if (rows > 0) {
    attn_bwd_prep<HD><<<ceil_div(rows * (HD / 8), 256), 256, 0, s>>>(delta, dq_acc, dout, out, rows);
    LAUNCH_CHECK();
  }
  if (nseq > 0 && max_seqlen > 0) {
    // hd 128: 8 warps x 16 keys, query tiles of 64 (255 registers, no spill; 1 block per SM).
    // hd 64: 4 warps x 16 keys, query tiles of 64 (225 registers; 2 blocks per SM).
    if constexpr (HD == 128)
      bwd_atomic_launch<HD, 8, 64, 2>(dk, dv, dq_acc, dout, q, k, v, lse, delta, cu_q, cu_k, nseq, max_seqlen, H, KV, causal, scale, s);
    else
      bwd_atomic_launch<HD, 4, 64, 2>(dk, dv, dq_acc, dout, q, k, v, lse, delta, cu_q, cu_k, nseq, max_seqlen, H, KV, causal, scale, s);
  }
  if (n > 0 || Nk > 0) {
    attn_bwd_finish<<<std::max(1, ceil_div(n / 4, 256)), 256, 0, s>>>(dq, dq_acc, n, scale, dk, dv, cu_k, nseq, Nk,
                                                                      KV * HD);
    LAUNCH_CHECK();
  }
}

template <class T, int DPL>
void fwd_v1(T* out, float* lse, const T* q, const T* k, const T* v, const int32_t* cu_q,
            const int32_t* cu_k, int nseq, int64_t Nq, int H, int KV, int hd, bool causal,
            float scale_log2, cudaStream_t s) {
  dim3 grid(ceil_div(Nq, 4), H);
  attn_fwd_v1<dev_t<T>, DPL><<<grid, 128, 0, s>>>(dptr(out), lse, dptr(q), dptr(k), dptr(v), cu_q,
                                                  cu_k, nseq, Nq, H, KV, hd, causal, scale_log2);
  LAUNCH_CHECK();
}

template <class T, int DPL>
void bwd_v1(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v, const float* lse,
            const float* delta, const int32_t* cu_q, const int32_t* cu_k, int nseq, int64_t Nq,
            int64_t Nk, int H, int KV, int hd, bool causal, float scale, cudaStream_t s) {
  attn_bwd_dq_v1<dev_t<T>, DPL><<<dim3(ceil_div(Nq, 4), H), 128, 0, s>>>(
      dptr(dq), dptr(dout), dptr(q), dptr(k), dptr(v), lse, delta, cu_q, cu_k, nseq, Nq, H, KV, hd,
      causal, scale);
  LAUNCH_CHECK();
  attn_bwd_dkdv_v1<dev_t<T>, DPL><<<dim3(ceil_div(Nk, 4), KV), 128, 0, s>>>(
      dptr(dk), dptr(dv), dptr(dout), dptr(q), dptr(k), dptr(v), lse, delta, cu_q, cu_k, nseq, Nk,
      H, KV, hd, causal, scale);
  LAUNCH_CHECK();
}

std::atomic<bool>& deterministic_flag() {  // LOOM_DETERMINISTIC=1 sets it at first use
  static std::atomic<bool> on{[] {
    const char* e = std::getenv("LOOM_DETERMINISTIC");
    return e != nullptr && std::string(e) == "1";
  }()};
  return on;
}

}  // namespace

void set_deterministic_attention(bool on) { deterministic_flag() = on; }
bool deterministic_attention() { return deterministic_flag(); }

namespace {
// Our kernels (the cuDNN backend and the train.attention choice: attention_cudnn.cu)
template <class T>
void forward_loom(T* out, acc_t<T>* lse, const T* q, const T* k, const T* v,
                  const int32_t* cu_q, const int32_t* cu_k, int nseq, int max_seqlen,
                  int64_t Nq, int64_t Nk, int H, int KV, int hd, bool causal, double scale,
                  Stream s) {
  (void)Nk;
  if (Nq == 0) return;
  const float scale_log2 = float(scale) * kLog2e;
  if (std::is_same<T, bf16>::value && v2_supports(hd)) {
    if (nseq > 0 && max_seqlen > 0) {
      auto o = reinterpret_cast<bf*>(out);
      auto qq = reinterpret_cast<const bf*>(q);
      auto kk = reinterpret_cast<const bf*>(k);
      auto vv = reinterpret_cast<const bf*>(v);
      if (fwd_sm90_available(hd) && nseq < 65535) {  // writes the rows outside every sequence itself
        fwd_sm90(o, lse, qq, kk, vv, cu_q, cu_k, nseq, max_seqlen, Nq, H, KV, hd, causal, scale_log2, s);
        return;
      }
      switch (hd) {
        case 16: fwd_v2<16>(o, lse, qq, kk, vv, cu_q, cu_k, nseq, max_seqlen, H, KV, causal, scale_log2, s); break;
        case 32: fwd_v2<32>(o, lse, qq, kk, vv, cu_q, cu_k, nseq, max_seqlen, H, KV, causal, scale_log2, s); break;
        case 64: fwd_v2<64>(o, lse, qq, kk, vv, cu_q, cu_k, nseq, max_seqlen, H, KV, causal, scale_log2, s); break;
        default: fwd_v2<128>(o, lse, qq, kk, vv, cu_q, cu_k, nseq, max_seqlen, H, KV, causal, scale_log2, s); break;
      }
    }
    zero_outside<<<ceil_div(Nq, 8), 256, 0, s>>>(dptr(out), lse, cu_q, nseq, Nq, H * hd, H);
    LAUNCH_CHECK();
    return;
  }
  // v1 writes every row itself (rows outside every sequence included)
  if (hd <= 32) fwd_v1<T, 1>(out, lse, q, k, v, cu_q, cu_k, nseq, Nq, H, KV, hd, causal, scale_log2, s);
  else if (hd <= 64) fwd_v1<T, 2>(out, lse, q, k, v, cu_q, cu_k, nseq, Nq, H, KV, hd, causal, scale_log2, s);
  else fwd_v1<T, 4>(out, lse, q, k, v, cu_q, cu_k, nseq, Nq, H, KV, hd, causal, scale_log2, s);
}

template <class T>
void backward_loom(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                   const T* out, const acc_t<T>* lse, acc_t<T>* workspace,
                   const int32_t* cu_q, const int32_t* cu_k, int nseq, int max_seqlen,
                   int64_t Nq, int64_t Nk, int H, int KV, int hd, bool causal, double scale,
                   Stream s) {
  // workspace: dq_acc [Nq, H, hd] first (its float2 alignment then does not depend on Nq H),
  // delta [Nq, H] after it
  float* dq_acc = workspace;
  float* delta = workspace + Nq * H * hd;
  if (std::is_same<T, bf16>::value && !deterministic_attention() && (hd == 64 || hd == 128)) {
    // the single pass: writes every row of dq, dk and dv itself
    auto a = reinterpret_cast<bf*>(dq);
    auto b = reinterpret_cast<bf*>(dk);
    auto c = reinterpret_cast<bf*>(dv);
    auto o = reinterpret_cast<const bf*>(dout);
    auto oo = reinterpret_cast<const bf*>(out);
    auto qq = reinterpret_cast<const bf*>(q);
    auto kk = reinterpret_cast<const bf*>(k);
    auto vv = reinterpret_cast<const bf*>(v);
    const float sc = float(scale);
    if (hd == 64)
      bwd_v2_atomic<64>(a, b, c, dq_acc, delta, o, oo, qq, kk, vv, lse, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV,
                        causal, sc, s);
    else
      bwd_v2_atomic<128>(a, b, c, dq_acc, delta, o, oo, qq, kk, vv, lse, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H,
                         KV, causal, sc, s);
    return;
  }
  if (Nq > 0) {
    attn_delta<<<ceil_div(Nq * H, 8), 256, 0, s>>>(delta, dptr(dout), dptr(out), Nq * H, hd);
    LAUNCH_CHECK();
  }
  if (std::is_same<T, bf16>::value && v2_supports(hd)) {
    auto a = reinterpret_cast<bf*>(dq);
    auto b = reinterpret_cast<bf*>(dk);
    auto c = reinterpret_cast<bf*>(dv);
    auto o = reinterpret_cast<const bf*>(dout);
    auto qq = reinterpret_cast<const bf*>(q);
    auto kk = reinterpret_cast<const bf*>(k);
    auto vv = reinterpret_cast<const bf*>(v);
    const float sc = float(scale);
    if (nseq > 0 && max_seqlen > 0) {  // the two passes (deterministic; hd 16/32 always)
      switch (hd) {
        case 16: bwd_v2<16>(a, b, c, o, qq, kk, vv, lse, delta, cu_q, cu_k, nseq, max_seqlen, H, KV, causal, sc, s); break;
        case 32: bwd_v2<32>(a, b, c, o, qq, kk, vv, lse, delta, cu_q, cu_k, nseq, max_seqlen, H, KV, causal, sc, s); break;
        case 64: bwd_v2<64>(a, b, c, o, qq, kk, vv, lse, delta, cu_q, cu_k, nseq, max_seqlen, H, KV, causal, sc, s); break;
        default: bwd_v2<128>(a, b, c, o, qq, kk, vv, lse, delta, cu_q, cu_k, nseq, max_seqlen, H, KV, causal, sc, s); break;
      }
    }
    if (Nq > 0) {
      zero_outside<<<ceil_div(Nq, 8), 256, 0, s>>>(dptr(dq), nullptr, cu_q, nseq, Nq, H * hd, 0);
      LAUNCH_CHECK();
    }
    if (Nk > 0) {
      zero_outside<<<ceil_div(Nk, 8), 256, 0, s>>>(dptr(dk), nullptr, cu_k, nseq, Nk, KV * hd, 0);
      LAUNCH_CHECK();
      zero_outside<<<ceil_div(Nk, 8), 256, 0, s>>>(dptr(dv), nullptr, cu_k, nseq, Nk, KV * hd, 0);
      LAUNCH_CHECK();
    }
    return;
  }
  const float sc = float(scale);
  if (hd <= 32) bwd_v1<T, 1>(dq, dk, dv, dout, q, k, v, lse, delta, cu_q, cu_k, nseq, Nq, Nk, H, KV, hd, causal, sc, s);
  else if (hd <= 64) bwd_v1<T, 2>(dq, dk, dv, dout, q, k, v, lse, delta, cu_q, cu_k, nseq, Nq, Nk, H, KV, hd, causal, sc, s);
  else bwd_v1<T, 4>(dq, dk, dv, dout, q, k, v, lse, delta, cu_q, cu_k, nseq, Nq, Nk, H, KV, hd, causal, sc, s);
}

}  // namespace

template <class T>
void attention_forward(T* out, acc_t<T>* lse, const T* q, const T* k, const T* v,
                       const int32_t* cu_q, const int32_t* cu_k, int nseq, int max_seqlen,
                       int64_t Nq, int64_t Nk, int H, int KV, int hd, bool causal, double scale,
                       Stream s) {
  check_args("attention_forward", nseq, max_seqlen, H, KV, hd);
  auto ours = [&] { forward_loom(out, lse, q, k, v, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV, hd, causal, scale, s); };
  if (cudnn_attention_forward(out, lse, q, k, v, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV, hd, causal, scale, s,
                              ours))
    return;
  ours();
}

template <class T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                        const T* out, const acc_t<T>* lse, acc_t<T>* workspace,
                        const int32_t* cu_q, const int32_t* cu_k, int nseq, int max_seqlen,
                        int64_t Nq, int64_t Nk, int H, int KV, int hd, bool causal, double scale,
                        Stream s) {
  check_args("attention_backward", nseq, max_seqlen, H, KV, hd);
  auto ours = [&] {
    backward_loom(dq, dk, dv, dout, q, k, v, out, lse, workspace, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV, hd,
                  causal, scale, s);
  };
  if (cudnn_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, workspace, cu_q, cu_k, nseq, max_seqlen, Nq, Nk,
                               H, KV, hd, causal, scale, s, ours))
    return;
  ours();
}

template void attention_forward<float>(float*, float*, const float*, const float*, const float*, const int32_t*,
                                       const int32_t*, int, int, int64_t, int64_t, int, int, int, bool, double, Stream);
template void attention_forward<bf16>(bf16*, float*, const bf16*, const bf16*, const bf16*, const int32_t*,
                                      const int32_t*, int, int, int64_t, int64_t, int, int, int, bool, double, Stream);
template void attention_backward<float>(float*, float*, float*, const float*, const float*, const float*,
                                        const float*, const float*, const float*, float*, const int32_t*,
                                        const int32_t*, int, int, int64_t, int64_t, int, int, int, bool, double, Stream);
template void attention_backward<bf16>(bf16*, bf16*, bf16*, const bf16*, const bf16*, const bf16*, const bf16*,
                                       const bf16*, const float*, float*, const int32_t*, const int32_t*, int, int,
                                       int64_t, int64_t, int, int, int, bool, double, Stream);

}  // namespace loom::cuda
