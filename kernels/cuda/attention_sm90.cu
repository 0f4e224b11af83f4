/*
 * attention_sm90.cu: the flash-attention forward on Hopper tensor cores (wgmma, sm_90a).
 * Same contract, masks and results as attn_fwd_v2 in attention_fwd.cu (read attention.cu first:
 * the math, shapes, causal bottom-right alignment and rows outside every sequence are the
 * same); this file only changes how the two tile products are issued.
 *
 * Why a second kernel: mma.sync (v2) gives each warp a 16 x 8 product and needs every operand
 * fragment in the warp's registers; at head dim 128 the O accumulator of 2 m-tiles alone is
 * 128 registers per thread, so v2 re-reads Q from shared memory at every k-step and still
 * tops out at ~230 TFLOP/s. wgmma is issued by a warpgroup (4 warps, 128 threads) for a
 * 64-row tile and reads its B operand (and here A for Q K^T) straight from shared memory: the
 * 64 x HD O accumulator is spread over 128 threads (HD/2 registers each), and no fragment of
 * K or V passes through registers.
 *
 * Block: NWG warpgroups x 64 query rows = BR rows of one head, one sequence; BC-key tiles.
 *   Q [BR][HD], K and V [2][BC][HD] (double-buffered by cp.async as in v2) in shared memory in
 *   the 128-byte swizzle wgmma reads: a tile is stored as HD/64 column halves [rows][64], each
 *   row 128 bytes, the 16-byte chunk c of row r at chunk c ^ (r % 8); tiles 1024-byte aligned.
 * Per key tile, per warpgroup (rows wr.. wr+63):
 *   S = Q K^T       HD/16 wgmma m64nBCk16, A = Q and B = K from shared memory (both K-major)
 *   mask, online softmax on the S accumulators (the thread layout of a wgmma accumulator is
 *                   mma.sync's C layout per warp, so the v2 softmax code carries over)
 *   P -> bf16       repacked in registers as the A operand (the C -> A trick of v2)
 *   O += P V        BC/16 wgmma m64nHDk16, A = P from registers, B = V from shared memory
 *                   read transposed (MN-major descriptor: V stays [keys][HD] as loaded)
 *   Each group is committed and waited for before its result is used; the two warpgroups of a
 *   block (and the warps of other blocks) overlap one's softmax with the other's products.
 *   Causal: a warpgroup skips key tiles that lie wholly above its own diagonal.
 *   Rows outside every sequence are zeroed by a strided share of every block (no second launch).
 * Shared-memory descriptors: start address >> 4, leading byte offset (MN-major B: the
 *   distance between the 64-column halves, BC * 128 bytes; unused for K-major), stride byte
 *   offset 1024 (8 rows of 128 bytes), swizzle mode 128 B. A k-step of 16 along a K-major
 *   row moves the start address by 32 bytes inside the swizzle atom.
 * Needs sm_90a (the build passes -gencode arch=compute_90a,code=sm_90a for CUDA_ARCH=90 and
 *   defines LOOM_SM90A); elsewhere the kernel body is empty and attention.cu runs v2.
 *
 * Versions (H200, bf16, TFLOP/s forward, bench/bench_attention.cpp, one call; the SPEC shapes
 * B8 H12 T1024 D64 full | B8 H16 T2048 D128 causal | B4 H9 T2048 D64 causal):
 *   v2 (attention_fwd.cu, mma.sync), same call           212 | 226 | 146
 *   sm90 v1: S and P V each issued and waited for, block-wide barrier per key tile
 *     2 warpgroups x 64-key tiles                     237 | 250 | 166
 *     3 warpgroups x 128-key tiles                    222 | 321 | 179
 *     2 warpgroups x 64 keys, 2 blocks per SM         233 | 290 | 166
 *     2 warpgroups x 128-key tiles                    216 | 284 | 165
 *   PyTorch 2.11 FLASH_ATTENTION (earlier call)      224 | 277 | 145
 *   Kept: 3 x 128 except hd 64 full and hd 64 causal with short sequences (2 x 64; fwd_sm90),
 *   1 x 64 (one warpgroup a block) for sequences of at most 64 tokens at hd 64, and whole
 *   sequences for 65-256 tokens at hd 64 (below).
 *   Its exp2s use ex2.approx.ftz since 2026-11-23
 *   (hd 64 full 0.108 -> 0.101 ms on an H100, the others unchanged: this kernel waits at its
 *   block-wide barrier more than it computes).
 *   The producer warp with mbarriers, the softmax of one warpgroup overlapping another's
 *   products, and TMA loads are attention_sm90_ws.cu, the default forward on sm_90a since
 *   2026-11-23 (1.2-1.4x this kernel); this one runs with LOOM_ATTN_SM90=1, and stays as the
 *   plainer of the two wgmma forwards and the one tested beside it.
 *
 * Whole sequences (attn_fwd_whole, 2026-11-29): for 65-256 rows at hd 64 one block of two
 *   warpgroups per sequence and head, Q, K and V of the sequence loaded once and kept, each
 *   warpgroup taking two 64-row query tiles over the four 64-key tiles. At 196 tokens the 2 x 64
 *   blocks (two a sequence and head, each loading every K and V tile) fill shared memory with
 *   246 MB a B128 H12 call for 154 MB of tensors, and each waits on its next K / V tile (a
 *   double buffer) before the tile's products. H200, same call, forward ms, 2 x 64 | whole | cuDNN:
 *     B128 H12 T196 (MIM target)     0.1292 | 0.1092 | 0.1077
 *     B128 H6 T196 (MIM predictor)   0.0704 | 0.0614 | 0.0617
 *     B50 H12 T196 (VLM tower)       0.0604 | 0.0526 | 0.0590
 *     B64 H12 T256                   0.0700 | 0.0589 | 0.0556
 *     B32 H9 T256 causal             0.0318 | 0.0292 | 0.0345
 *   Tried first in that call, slower than 2 x 64 at B128 H12 T196 (0.129 ms): every key in one
 *   tile, S as two m64n128 products and no double buffer (1 x 256 keys: 0.164, 252 registers;
 *   2 x 256: 0.187), and 128-key tiles (1 x 128: 0.134; 2 x 128: 0.175). The larger tiles load
 *   K and V for fewer query rows each, so the fill traffic grows. Equal to cuDNN at the MIM
 *   shapes. Measured and not kept (the next call): S of key tile j + 1 issued beside P V of
 *   tile j (the last tile peeled off so that no branch stands between the two issues; 125
 *   registers): 0.1085 against 0.1086 ms at B128 H12 T196, 0.0602 against 0.0582 at B64 H12
 *   T256. With it loom's kernels for every shape (`train.attention = loom`) run bench_mim in
 *   22.49 / 22.48 ms against 23.10 with cuDNN's for every shape (same call; before it, loom's
 *   23.14 / 23.07 against auto's 22.74 in one call). `train.attention = auto` steps do not move
 *   (bench_mim 22.52 / 22.58 ms against 22.42 / 22.54, contrastive 42.70 / 42.85 against
 *   42.67 / 42.73, same call).
 *   The short last key tile (2026-12-02): a sequence's last key tile with at most 16 / 32 keys
 *   runs as m64n16 / m64n32 products for S and one / two k-steps of P V (fwd_key_tile's NS), so
 *   a 196-token query tile computes 208 key columns instead of 256; the keys it leaves out lie
 *   past the sequence, where the whole tile's mask zeroed their probabilities.
 *   LOOM_ATTN_SHORT_TILE=0 computes every tile whole. H200, one call, two rounds, forward ms,
 *   whole tiles | short | cuDNN: B256 H12 T196 (contrastive target) 0.209 / 0.211 | 0.186 / 0.186
 *   | 0.188-0.194; B128 H12 T196 0.110 / 0.111 | 0.098 / 0.098 | 0.103; B256 H6 T196 0.109 /
 *   0.108 | 0.098 / 0.099 | 0.101; B50 H12 T196 0.053 / 0.053 | 0.048 / 0.048 | 0.055; B64 H12
 *   T90 0.028 / 0.030 | 0.027 / 0.026 | 0.034-0.038. `train.attention = auto` now takes this
 *   kernel over cuDNN's for the MIM forwards (cuDNN's backward stays faster there: 0.58 against
 *   0.72 ms at B256 H12). Steps (bench/ab.sh, one binary, two rounds, whole | short): bench_mim
 *   22.65 / 22.59 | 22.49 / 22.57 ms, contrastive 42.73 / 42.79 | 43.03 / 42.72, the reference's
 *   VLM batch 48.54 / 48.54 | 48.25 / 48.36: 5-20 us a call, within the steps' noise.
 *   The last query rows and the last key tiles (2026-12-03): a last query tile of at most 16
 *   rows (196 tokens: 4) runs on mma.sync, each of the warpgroup's four warps against one key
 *   tile, the partial softmaxes merged in shared memory (tail_key_tile, tail_merge;
 *   LOOM_ATTN_TAIL=0 computes the whole 64-row tile), and the last two key tiles go as one of 80
 *   keys when the last holds at most 16 (fwd_key_tile with NS = BC + 16: one m64n80 product for
 *   S and five k-steps of P V, so a query tile takes three rounds at 196 tokens, not four;
 *   LOOM_ATTN_JOIN_LAST=0 keeps them apart). H200, one call, forward ms, both off | tail | tail
 *   + join: B128 H12 T196 0.102 | 0.097 | 0.094 (192 tokens: 0.081), B256 H12 0.193 | 0.182 |
 *   0.175, B128 H6 0.057 | 0.054 | 0.052-0.055, B40 H12 0.040 | 0.037 | 0.036; the contrastive
 *   step -0.27 and -0.38 ms (bench/ab.sh), the MIM and VLM steps within their noise.
 *
 * Test: tests/cuda/test_cuda_kernels_b.cpp ("attention ...", every bf16 case with hd 64/128
 *   runs this kernel on an H100/H200, and the v2 kernel with LOOM_ATTN_SM90=0).
 */
#include <cstdint>
#include <cstdlib>

#include "kernels/cuda/wgmma.cuh"

namespace loom::cuda::attn {
namespace {

// ------------------------------------------------------------------------ one key tile
// One key tile for a warpgroup's 64 query rows, the body both forwards share: S = Q K^T (sQw:
// the warpgroup's first row of a BR-row sw128 Q tile; cK, cV: the BC-row K and V tiles of keys
// kb..; wrow: the warpgroup's first row in the sequence), the online softmax with the masks, O
// and l rescaled, O += P V. Each product group is committed and waited for before its result is used.
// NS: the tile's keys that are computed, the first NS of the BC-row tiles (NS < BC: a short
// last tile, m64nNS products for S and NS / 16 k-steps of P V; the keys NS.. of it must lie
// past Lk, where the full tile's mask would have zeroed their probabilities). NS = BC + 16: a
// tile and the first 16 keys of the next one, stored right after it (the whole-sequence
// forward's K and V tiles lie back to back), as one m64n80 product and five k-steps.
template <int HD, int BR, int BC, int NS = BC>
__device__ __forceinline__ void fwd_key_tile(float (&o)[HD / 8][4], float (&mrow)[2], float (&lrow)[2],
                                             const bf* sQw, const bf* cK, const bf* cV, int kb, int Lk, bool causal,
                                             int wrow, int shift, float scale_log2) {
  static_assert(NS % 16 == 0 && (NS <= BC || NS == BC + 16), "NS: 16, 32, .. BC keys, or BC + 16 (two tiles)");
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  float s[NS / 8][4];
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < HD / 16; kk++)  // S = Q K^T
    wgmma_ss<0>(s, sdesc(sQw + (kk / 4) * BR * 64 + (kk % 4) * 16, 0), sdesc(cK + (kk / 4) * BC * 64 + (kk % 4) * 16, 0),
                kk > 0);
  wg_commit();
  wg_wait<0>();
  fence_regs(s);
  const bool need_mask = kb + NS > Lk || (causal && kb + NS - 1 > wrow + shift);
  const int row0 = wrow + warp * 16 + g;  // rows row0 (c0, c1) and row0 + 8 (c2, c3)
  float corr[2], sum[2];
  online_softmax_tile<NS>(s, need_mask, kb, Lk, causal, row0, shift, t, scale_log2, mrow, corr, sum);
#pragma unroll
  for (int r = 0; r < 2; r++) {
    lrow[r] = lrow[r] * corr[r] + sum[r];
#pragma unroll
    for (int dt = 0; dt < HD / 8; dt++) {
      o[dt][2 * r] *= corr[r];
      o[dt][2 * r + 1] *= corr[r];
    }
  }
  uint32_t pa[NS / 16][4];
#pragma unroll
  for (int kk = 0; kk < NS / 16; kk++) c_to_a(pa[kk], s, kk);
  fence_regs(o);
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < NS / 16; kk++)  // O += P V, V read transposed (MN-major)
    wgmma_rs<1>(o, pa[kk], sdesc(cV + kk * 16 * 64, BC * 128));
  wg_commit();
  wg_wait<0>();
  fence_regs(o);
}

// ------------------------------------------------------------------------ a short last query tile
// The last query tile of a sequence when it holds at most 16 rows (196 tokens = 3 x 64 + 4): a
// wgmma tile computes 64 rows, 60 of them for nothing, so instead each warp of the warpgroup
// takes one key tile (warp w: keys w BC..) for the tile's first 16 rows with mma.sync (m16n8k16,
// whose accumulators have the layout of one warp's part of a wgmma accumulator, so
// online_softmax_tile and c_to_a serve both) and the four partial softmaxes are merged through
// shared memory (tail_merge). This function: one warp's S = Q K^T over its tile (Q rows wr..
// wr + 15 of the BR-row sw128 tile sQ; cK, cV: the BC-row sw128 K and V tiles of keys kb..), the
// masks and the softmax from scratch (o must be zero, mrow -inf, lrow 0), O = P V. NS: the
// tile's keys that are computed, as in fwd_key_tile.
template <int HD, int BR, int BC, int NS = BC>
__device__ __forceinline__ void tail_key_tile(float (&o)[HD / 8][4], float (&mrow)[2], float (&lrow)[2],
                                              const bf* sQ, const bf* cK, const bf* cV, int wr, int kb, int Lk,
                                              bool causal, int shift, float scale_log2) {
  static_assert(HD == 64 && NS % 16 == 0 && NS <= BC, "one 64-column half; NS: 16, 32, .. BC keys");
  const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  float s[NS / 8][4] = {};
#pragma unroll
  for (int kk = 0; kk < HD / 16; kk++) {  // S = Q K^T: A from the Q rows, B from the key rows
    uint32_t a[4];
    ldsm_x4(a, sQ + sw128<BR>(wr + (lane & 7) + ((lane >> 3) & 1) * 8, kk * 2 + (lane >> 4)));
#pragma unroll
    for (int np = 0; np < NS / 16; np++) {
      uint32_t b[4];
      ldsm_x4(b, cK + sw128<BC>(np * 16 + (lane & 7) + (lane >> 4) * 8, kk * 2 + ((lane >> 3) & 1)));
      mma_bf16(s[2 * np], a, b[0], b[1]);
      mma_bf16(s[2 * np + 1], a, b[2], b[3]);
    }
  }
  const bool need_mask = kb + NS > Lk || (causal && kb + NS - 1 > wr + shift);
  float corr[2];
  online_softmax_tile<NS>(s, need_mask, kb, Lk, causal, wr + g, shift, t, scale_log2, mrow, corr, lrow);
#pragma unroll
  for (int kk = 0; kk < NS / 16; kk++) {  // O = P V, V's key rows read transposed
    uint32_t pa[4];
    c_to_a(pa, s, kk);
#pragma unroll
    for (int dp = 0; dp < HD / 16; dp++) {
      uint32_t b[4];
      ldsm_x4_t(b, cV + sw128<BC>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, dp * 2 + (lane >> 4)));
      mma_bf16(o[2 * dp], pa, b[0], b[1]);
      mma_bf16(o[2 * dp + 1], pa, b[2], b[3]);
    }
  }
}

// The merge of tail_key_tile's four partial softmaxes, one per warp of the warpgroup over the
// same 16 rows: warps 1-3 leave their O (fp32), their per-thread row sums and their maxima in
// `scratch` (kTailScratchFloats floats), the warpgroup meets at named barrier 1 (a block has one
// tail tile, so one barrier serves either warpgroup; an immediate id, so that ptxas does not
// reserve all 16 barriers for a register operand), and warp 0 rescales every part to the common
// maximum M (each by exp2(m_w - M)) and adds them into its own o and lrow, mrow = M. Afterwards warp 0 holds the tile's rows as fwd_key_tile leaves a warp's.
// floats a row of a partial O: 64 + 8, so that the 8 rows one store touches spread over the banks
constexpr int kTailStride = 72;
constexpr int kTailScratchFloats = 3 * 16 * kTailStride + 3 * 16 * 4 + 3 * 16;
template <int HD>
__device__ __forceinline__ void tail_merge(float (&o)[HD / 8][4], float (&mrow)[2], float (&lrow)[2],
                                           float* scratch) {
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  float* sO = scratch;                        // [3][16][kTailStride]
  float* sL = sO + 3 * 16 * kTailStride;      // [3][16][4]: the quad's four partial row sums
  float* sM = sL + 3 * 16 * 4;                // [3][16]
  if (warp > 0) {
    const int w = warp - 1;
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const int row = g + 8 * r;
#pragma unroll
      for (int dt = 0; dt < HD / 8; dt++)
        *reinterpret_cast<float2*>(sO + (w * 16 + row) * kTailStride + dt * 8 + 2 * t) =
            make_float2(o[dt][2 * r], o[dt][2 * r + 1]);
      sL[(w * 16 + row) * 4 + t] = lrow[r];
      if (t == 0) sM[w * 16 + row] = mrow[r];
    }
  }
  asm volatile("bar.sync 1, 128;\n" ::: "memory");
  if (warp > 0) return;
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int row = g + 8 * r;
    float m = mrow[r];
#pragma unroll
    for (int w = 0; w < 3; w++) m = fmaxf(m, sM[w * 16 + row]);
    const float m_use = m == -INFINITY ? 0.f : m;  // a row no warp saw a key for stays empty
    const float f0 = exp2_ftz(mrow[r] - m_use);
    float l = lrow[r] * f0;
#pragma unroll
    for (int dt = 0; dt < HD / 8; dt++) {
      o[dt][2 * r] *= f0;
      o[dt][2 * r + 1] *= f0;
    }
#pragma unroll
    for (int w = 0; w < 3; w++) {
      const float f = exp2_ftz(sM[w * 16 + row] - m_use);
      l = fmaf(sL[(w * 16 + row) * 4 + t], f, l);
#pragma unroll
      for (int dt = 0; dt < HD / 8; dt++) {
        const float2 p = *reinterpret_cast<const float2*>(sO + (w * 16 + row) * kTailStride + dt * 8 + 2 * t);
        o[dt][2 * r] = fmaf(p.x, f, o[dt][2 * r]);
        o[dt][2 * r + 1] = fmaf(p.y, f, o[dt][2 * r + 1]);
      }
    }
    mrow[r] = m;
    lrow[r] = l;
  }
}

// ------------------------------------------------------------------------ the kernel
template <int HD, int NWG, int BC>
__global__ void __launch_bounds__(NWG * 128, 1)
attn_fwd_sm90(bf* __restrict__ out, float* __restrict__ lse, const bf* __restrict__ q,
              const bf* __restrict__ k, const bf* __restrict__ v, const int32_t* __restrict__ cu_q,
              const int32_t* __restrict__ cu_k, int dense, int64_t Nq, int H, int KV, bool causal,
              float scale_log2) {
  pdl_entry();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BR = 64 * NWG, NT = NWG * 128;
  extern __shared__ unsigned char smem_raw[];
  bf* sQ = reinterpret_cast<bf*>(smem_align1024(smem_raw));
  bf* sK = sQ + BR * HD;      // [2][BC * HD]
  bf* sV = sK + 2 * BC * HD;  // [2][BC * HD]
  const int wg = threadIdx.x / 128;
  const int seq = blockIdx.z, h = blockIdx.y, kvh = h / (H / KV);
  // dense batches take their bounds from seq (wgmma.cuh) at hd 64; the hd 128 instance keeps the
  // loads (with the other path in it ptxas spilled 68 bytes there)
  const SeqBounds sb = seq_bounds(cu_q, cu_k, seq, int(gridDim.z), HD == 64 ? dense : 0);
  const int q0 = sb.q0, Lq = sb.Lq, k0 = sb.k0, Lk = sb.Lk;
  zero_rows_outside<HD, NT>(out, lse, sb.lo, sb.hi, Nq, H);
  const int qs = (gridDim.x - 1 - blockIdx.x) * BR;  // longest (causal) tiles start first
  if (qs >= Lq) return;
  const int nq = min(BR, Lq - qs), shift = Lk - Lq;
  const int64_t qstride = int64_t(H) * HD, kvstride = int64_t(KV) * HD;
  const bf* kbase = k + int64_t(k0) * kvstride + kvh * HD;
  const bf* vbase = v + int64_t(k0) * kvstride + kvh * HD;
  const int kend = causal ? min(Lk, qs + nq + shift) : Lk;  // keys the block's last row sees
  const int ntiles = kend > 0 ? (kend + BC - 1) / BC : 0;
  const int wr = wg * 64;                          // the warpgroup's first row in the tile
  const int wlast = min(qs + wr + 63, Lq - 1);     // its last valid row (sequence position)

  load_tile_sw128<HD, BR, NT>(sQ, q + (int64_t(q0) + qs) * qstride + h * HD, qstride, nq);
  if (ntiles > 0) {
    load_tile_sw128<HD, BC, NT>(sK, kbase, kvstride, min(BC, Lk));
    load_tile_sw128<HD, BC, NT>(sV, vbase, kvstride, min(BC, Lk));
  }
  cp_async_commit();

  float o[HD / 8][4] = {};
  float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.f, 0.f};
  for (int j = 0; j < ntiles; j++) {
    if (j + 1 < ntiles) {  // prefetch the next K/V tile into the other buffer
      const int kb = (j + 1) * BC, buf = (j + 1) & 1;
      load_tile_sw128<HD, BC, NT>(sK + buf * BC * HD, kbase + kb * kvstride, kvstride, min(BC, Lk - kb));
      load_tile_sw128<HD, BC, NT>(sV + buf * BC * HD, vbase + kb * kvstride, kvstride, min(BC, Lk - kb));
    }
    cp_async_commit();
    cp_async_wait<1>();  // tile j (and Q) have landed
    fence_smem_async();
    __syncthreads();
    const int kb = j * BC;
    // a tile wholly above this warpgroup's diagonal (or past its rows) adds nothing to it
    const bool skip = qs + wr >= Lq || (causal && kb > wlast + shift);
    if (!skip) {
      fwd_key_tile<HD, BR, BC>(o, mrow, lrow, sQ + wr * 64, sK + (j & 1) * BC * HD, sV + (j & 1) * BC * HD, kb, Lk,
                               causal, qs + wr, shift, scale_log2);
    }
    __syncthreads();  // everyone is done with buffer j&1 before it is refilled
  }
  cp_async_wait<0>();
  // a block whose rows see no key (causal, more queries than keys) never met the loop's barrier:
  // every thread's part of Q must land before a warpgroup stages its rows of out in sQ (other
  // threads' cp.async into those rows would otherwise overwrite the zeros)
  if (ntiles == 0) __syncthreads();

  // epilogue: O / l, lse (wgmma.cuh)
  store_out_rows<HD, BR>(out + (int64_t(q0) + qs) * qstride + h * HD, lse + int64_t(q0) * H + h, sQ, o, mrow, lrow,
                         wr, qs, nq, Lq, qstride, H);
#endif
}

// ------------------------------------------------------------------------ whole sequences
// attn_fwd_whole: one block per (sequence, head) for sequences of at most KT * BC keys and
// NWG * QT * 64 query rows (the ViTs' 196 tokens: 256 each). The block loads Q, K and V of the
// whole sequence once (K and V tile by tile, one cp.async group each, so the first query tile
// starts on key tile 0 while the rest land) and keeps them: warpgroup w takes the query tiles
// w, w + NWG, ..., each over every key tile (fwd_key_tile, as attn_fwd_sm90). Why: at 196 tokens attn_fwd_sm90's 128-row blocks each load every K and V tile, and that
// shared-memory fill traffic (B128 H12: 246 MB for 154 MB of tensors), not the products, bounds
// them; here every byte is loaded once. Two blocks a multiprocessor (96 KB of shared memory and at
// most 128 registers a thread each), so one block's loads run beside the other's products.
template <int HD, int NWG, int QT, int BC, int KT>
__global__ void __launch_bounds__(NWG * 128, 2)
attn_fwd_whole(bf* __restrict__ out, float* __restrict__ lse, const bf* __restrict__ q,
               const bf* __restrict__ k, const bf* __restrict__ v, const int32_t* __restrict__ cu_q,
               const int32_t* __restrict__ cu_k, int dense, int64_t Nq, int H, int KV, bool causal,
               float scale_log2, int short_tile, int tail) {
  pdl_entry();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(HD == 64 && KT <= 4, "one 64-column half; cp.async groups waited for by count <= 3; "
                                     "a tail warp per key tile");
  constexpr int BR = 64 * NWG * QT, NT = NWG * 128;
  extern __shared__ unsigned char smem_raw[];
  bf* sQ = reinterpret_cast<bf*>(smem_align1024(smem_raw));
  bf* sK = sQ + BR * HD;        // [KT][BC * HD]
  bf* sV = sK + KT * BC * HD;   // [KT][BC * HD]
  float* sTail = reinterpret_cast<float*>(sV + KT * BC * HD);  // tail_merge's scratch
  const int wg = threadIdx.x / 128;
  const int seq = blockIdx.z, h = blockIdx.y, kvh = h / (H / KV);
  const SeqBounds sb = seq_bounds(cu_q, cu_k, seq, int(gridDim.z), dense);
  const int q0 = sb.q0, Lq = sb.Lq, k0 = sb.k0, Lk = sb.Lk;
  zero_rows_outside<HD, NT>(out, lse, sb.lo, sb.hi, Nq, H);
  if (Lq <= 0) return;
  const int shift = Lk - Lq;
  const int64_t qstride = int64_t(H) * HD, kvstride = int64_t(KV) * HD;
  const bf* kbase = k + int64_t(k0) * kvstride + kvh * HD;
  const bf* vbase = v + int64_t(k0) * kvstride + kvh * HD;
  const int ntiles = Lk > 0 ? (Lk + BC - 1) / BC : 0;

  load_tile_sw128<HD, BR, NT>(sQ, q + int64_t(q0) * qstride + h * HD, qstride, Lq);
  for (int j = 0; j < ntiles; j++) {  // group j: key tile j (group 0 with Q)
    load_tile_sw128<HD, BC, NT>(sK + j * BC * HD, kbase + int64_t(j) * BC * kvstride, kvstride, min(BC, Lk - j * BC));
    load_tile_sw128<HD, BC, NT>(sV + j * BC * HD, vbase + int64_t(j) * BC * kvstride, kvstride, min(BC, Lk - j * BC));
    cp_async_commit();
  }
  if (ntiles == 0) {  // no keys (every row's out 0, lse +inf): Q must land before sQ stages out
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
  }

  // the first pass over the query tiles waits for key tile j (every thread of the block is there)
  auto wait_tile = [&](int j) {
    const int later = ntiles - 1 - j;
    if (later >= 3) cp_async_wait<3>();
    else if (later == 2) cp_async_wait<2>();
    else if (later == 1) cp_async_wait<1>();
    else cp_async_wait<0>();
    fence_smem_async();
    __syncthreads();
  };
#pragma unroll 1
  for (int qt = 0; qt < QT; qt++) {
    const int wr = (qt * NWG + wg) * 64;          // the warpgroup's first row in the sequence
    const int wlast = min(wr + 63, Lq - 1);
    float o[HD / 8][4] = {};
    float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.f, 0.f};
    if (tail && wr < Lq && Lq - wr <= 16) {  // the sequence's last query tile, at most 16 rows
      if (qt == 0)  // the block's barriers of the first pass, all of them before any tile is read
        for (int j = 0; j < ntiles; j++) wait_tile(j);
      const int j = (threadIdx.x / 32) % 4, kb = j * BC;  // this warp's key tile
      if (j < ntiles && !(causal && kb > wlast + shift)) {
        const bf *cK = sK + j * BC * HD, *cV = sV + j * BC * HD;
        const int rem = Lk - kb;
        if (short_tile && rem <= 16)
          tail_key_tile<HD, BR, BC, 16>(o, mrow, lrow, sQ, cK, cV, wr, kb, Lk, causal, shift, scale_log2);
        else if (short_tile && rem <= 32)
          tail_key_tile<HD, BR, BC, 32>(o, mrow, lrow, sQ, cK, cV, wr, kb, Lk, causal, shift, scale_log2);
        else
          tail_key_tile<HD, BR, BC>(o, mrow, lrow, sQ, cK, cV, wr, kb, Lk, causal, shift, scale_log2);
      }
      tail_merge<HD>(o, mrow, lrow, sTail);
      if ((threadIdx.x / 32) % 4 == 0)  // warp 0 holds the rows; it stages them in its own rows of sQ,
                                        // which every warp's products are done with (the barrier)
        store_out_rows<HD, BR>(out + int64_t(q0) * qstride + h * HD, lse + int64_t(q0) * H + h, sQ, o, mrow,
                               lrow, wr, 0, Lq, Lq, qstride, H);
      continue;
    }
#pragma unroll 1
    for (int j = 0; j < ntiles; j++) {
      if (qt == 0) wait_tile(j);
      const int kb = j * BC, jt = j;
      const int rem = Lk - kb;  // keys from this tile on (< BC only in the last one)
      // the last two key tiles as one of BC + 16 keys when the last holds at most 16 (196 tokens:
      // keys 128-195 as one m64n80 product, not 64 and then 16 in a second round of products,
      // softmax and rescaling)
      const bool join = short_tile == 2 && BC == 64 && j == ntiles - 2 && rem <= BC + 16;
      if (join) {
        if (qt == 0) wait_tile(j + 1);
        j++;  // the next tile is this one's
      }
      if (wr >= Lq || (causal && kb > wlast + shift)) continue;
      const bf *cK = sK + jt * BC * HD, *cV = sV + jt * BC * HD;
      if (join)
        fwd_key_tile<HD, BR, BC, BC + 16>(o, mrow, lrow, sQ + wr * 64, cK, cV, kb, Lk, causal, wr, shift, scale_log2);
      else if (short_tile && rem <= 16)
        fwd_key_tile<HD, BR, BC, 16>(o, mrow, lrow, sQ + wr * 64, cK, cV, kb, Lk, causal, wr, shift, scale_log2);
      else if (short_tile && rem <= 32)
        fwd_key_tile<HD, BR, BC, 32>(o, mrow, lrow, sQ + wr * 64, cK, cV, kb, Lk, causal, wr, shift, scale_log2);
      else
        fwd_key_tile<HD, BR, BC>(o, mrow, lrow, sQ + wr * 64, cK, cV, kb, Lk, causal, wr, shift, scale_log2);
    }
    if (wr < Lq)  // O / l and lse through the warpgroup's own (finished) rows of sQ
      store_out_rows<HD, BR>(out + int64_t(q0) * qstride + h * HD, lse + int64_t(q0) * H + h, sQ, o, mrow, lrow,
                             wr, 0, Lq, Lq, qstride, H);
  }
  cp_async_wait<0>();
#endif
}

void launch_whole(bf* out, float* lse, const bf* q, const bf* k, const bf* v, const int32_t* cu_q,
                  const int32_t* cu_k, int nseq, int max_seqlen, int64_t Nq, int64_t Nk, int H, int KV,
                  bool causal, float scale_log2, cudaStream_t s) {
  constexpr int NWG = 2, QT = 2, BC = 64, KT = 4, BR = 64 * NWG * QT;
  // + the tail's merge scratch (14.8 KB: two blocks, 223 KB, still fit a multiprocessor) + 1024:
  // alignment slack
  const int smem = (BR + 2 * KT * BC) * 64 * int(sizeof(bf)) + kTailScratchFloats * int(sizeof(float)) + 1024;
  static const bool once = [smem] {
    CUDA_CHECK(cudaFuncSetAttribute(attn_fwd_whole<64, NWG, QT, BC, KT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    smem));
    return true;
  }();
  (void)once;
  // the last key tile as m64n16 / m64n32 products when it holds at most 16 / 32 keys (196 tokens:
  // 4 keys, so 208 key columns a query tile instead of 256); LOOM_ATTN_SHORT_TILE=0 computes every
  // tile whole (read at every call: tests and benchmarks switch it)
  const char* e = std::getenv("LOOM_ATTN_SHORT_TILE");
  // 2: also the last two key tiles as one of 80 keys when the last holds at most 16 (196 tokens);
  // LOOM_ATTN_JOIN_LAST=0 keeps them apart (1)
  const char* ej = std::getenv("LOOM_ATTN_JOIN_LAST");
  const int short_tile = (e && e[0] == '0') ? 0 : (ej && ej[0] == '0') ? 1 : 2;
  // a last query tile of at most 16 rows on mma.sync, a warp a key tile (tail_key_tile);
  // LOOM_ATTN_TAIL=0 computes it as a whole wgmma tile (read at every call, as above)
  const char* et = std::getenv("LOOM_ATTN_TAIL");
  const int tail = !(et && et[0] == '0');
  dim3 grid(1, H, nseq);
  launch_kernel(attn_fwd_whole<64, NWG, QT, BC, KT>, grid, NWG * 128, smem, s, out, lse, q, k, v, cu_q, cu_k,
                dense_seqlen(cu_q, cu_k, nseq, max_seqlen, Nq, Nk), Nq, H, KV, causal, scale_log2, short_tile,
                tail);
  LAUNCH_CHECK();
}

template <int HD, int NWG, int BC>
void launch(bf* out, float* lse, const bf* q, const bf* k, const bf* v, const int32_t* cu_q,
            const int32_t* cu_k, int nseq, int max_seqlen, int64_t Nq, int64_t Nk, int H, int KV, bool causal,
            float scale_log2, cudaStream_t s) {
  constexpr int BR = 64 * NWG;
  const int smem = (BR + 4 * BC) * HD * int(sizeof(bf)) + 1024;  // + 1024: alignment slack
  static const bool once = [smem] {
    CUDA_CHECK(cudaFuncSetAttribute(attn_fwd_sm90<HD, NWG, BC>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return true;
  }();
  (void)once;
  dim3 grid(ceil_div(max_seqlen, BR), H, nseq);
  launch_kernel(attn_fwd_sm90<HD, NWG, BC>, grid, NWG * 128, smem, s, out, lse, q, k, v, cu_q, cu_k,
                dense_seqlen(cu_q, cu_k, nseq, max_seqlen, Nq, Nk), Nq, H, KV, causal, scale_log2);
  LAUNCH_CHECK();
}

}  // namespace

// The shortest longest-sequence (max_seqlen) for which the warp-specialized forward runs, by
// head dim. Swept on an H100 (2026-11-24, one call, forward ms warp-specialized / lock-step):
// hd 64 B8 H12 T256 0.0216 / 0.0178, T512 0.0383 / 0.0366, T768 0.0530 / 0.0708, T1024
// 0.0882 / 0.1024; hd 128 causal B8 H16 T256 0.0250 / 0.0279, T512 0.0520 / 0.0560, T1024
// 0.1121 / 0.1501; MIM shapes B128 H12 hd 64 T196 0.1803 / 0.1322, T49 0.0732 / 0.0390.
constexpr int kWsMinSeqlenHd64 = 768;
constexpr int kWsMinSeqlenHd128 = 256;

bool fwd_sm90_available(int hd) {
#if LOOM_SM90A
  const char* e = std::getenv("LOOM_ATTN_SM90");  // read at every call: tests switch it
  if (e && e[0] == '0') return false;
  return device_is_sm90() && (hd == 64 || hd == 128);
#else
  (void)hd;
  return false;
#endif
}

void fwd_sm90(bf* out, float* lse, const bf* q, const bf* k, const bf* v, const int32_t* cu_q,
              const int32_t* cu_k, int nseq, int max_seqlen, int64_t Nq, int64_t Nk, int H, int KV, int hd,
              bool causal, float scale_log2, cudaStream_t s) {
  // The warp-specialized kernel (attention_sm90_ws.cu) unless LOOM_ATTN_SM90=1 asks for this
  // one: 3 warpgroups x 128-key tiles, except at hd 64: 1 x 64 for sequences of at most 64
  // rows, 2 x 64 for causal batches of short sequences and without the causal mask (below; the
  // header's version table has the configurations measured).
  const char* e = std::getenv("LOOM_ATTN_SM90");  // read at every call: tests switch it
  // Short sequences stay here: a warp-specialized block holds 128 or 192 query rows and a
  // producer, which a sequence of 49 or 196 tokens (the MIM encoder and predictor) mostly
  // leaves idle; measured: bench_mim.cfg 30.6 ms/step with it, 29.6-29.8 with this kernel.
  const char* m = std::getenv("LOOM_ATTN_WS_MIN");
  // Causal hd 64 batches of short sequences (fewer than 512 query rows a sequence on average:
  // the packed VLM batch, whose longest segment alone would send it to the warp-specialized
  // kernel) run 2 warpgroups x 64-key tiles here: a 64-key tile wastes less of a short
  // segment's diagonal than a 128-key one (0.74 of the computed scores used against 0.64 on
  // SPEC's packed batch), and this kernel's smaller blocks start and finish sooner. Measured
  // (H200, 2026-11-27, LOOM_BENCH_ATTN_PACKED=8,2048,9,3,64,1, forward ms): warp-specialized
  // 3 x 128 0.0801, 4 x 64 0.0744; lock-step 3 x 128 0.0846, 2 x 64 0.0734. With this rule
  // (H200, 2026-11-27, one call, rule | LOOM_ATTN_WS_MIN=768): packed batch forward 0.0764 |
  // 0.0794 ms; dense B32 H9 T256 causal 0.0300 | 0.0398 (lock-step 3 x 128 before); the
  // fixed-batch VLM step 52.69 / 52.50 | 52.69 / 52.64 ms (medians, two rounds: within noise).
  // Setting LOOM_ATTN_WS_MIN or LOOM_ATTN_SM90=1 turns this rule off.
  // Sequences of at most 64 rows (the MIM encoder's 49 kept patches) fill one warpgroup's
  // 64 rows: a block of one warpgroup (1 x 64) instead of two, the second of which would have no
  // rows, so that twice as many working warpgroups fit on a multiprocessor (MIM step, H200,
  // 2026-11-28: 0.317 -> 0.208 ms of forwards; up to 256 rows it was slower: 0.0574 -> 0.0590 ms
  // at B50 H12 T196). The same two switches turn this rule off.
  if (!m && !(e && e[0] == '1' && e[1] == 0) && hd == 64 && max_seqlen <= 64) {
    launch<64, 1, 64>(out, lse, q, k, v, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV, causal, scale_log2, s);
    return;
  }
  // Sequences of 65-256 rows at hd 64 (the ViTs' 196 tokens): one block per sequence and head,
  // Q, K and V loaded once (attn_fwd_whole above). LOOM_ATTN_WHOLE=0 turns this rule off, as do
  // the two switches above.
  const char* w = std::getenv("LOOM_ATTN_WHOLE");
  if (!m && !(e && e[0] == '1' && e[1] == 0) && !(w && w[0] == '0') && hd == 64 && max_seqlen > 64 &&
      max_seqlen <= 256) {
    launch_whole(out, lse, q, k, v, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV, causal, scale_log2, s);
    return;
  }
  if (!m && !(e && e[0] == '1' && e[1] == 0) && causal && hd == 64 && Nq < int64_t(512) * nseq) {
    launch<64, 2, 64>(out, lse, q, k, v, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV, causal, scale_log2, s);
    return;
  }
  const int ws_min = m ? std::atoi(m) : hd == 128 ? kWsMinSeqlenHd128 : kWsMinSeqlenHd64;
  if (!(e && e[0] == '1' && e[1] == 0) && max_seqlen >= ws_min && Nk > 0 && fwd_sm90_ws_supported(q, k, v)) {
    fwd_sm90_ws(out, lse, q, k, v, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV, hd, causal, scale_log2, s);
    return;
  }
  if (hd == 128)
    launch<128, 3, 128>(out, lse, q, k, v, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV, causal, scale_log2, s);
  else if (causal)
    launch<64, 3, 128>(out, lse, q, k, v, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV, causal, scale_log2, s);
  else
    launch<64, 2, 64>(out, lse, q, k, v, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV, causal, scale_log2, s);
}

}  // namespace loom::cuda::attn
