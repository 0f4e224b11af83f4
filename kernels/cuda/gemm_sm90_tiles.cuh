// gemm_sm90_tiles.cuh: the tile geometry, shared-memory layout and epilogues of gemm_sm90.cu
// (whose header describes the kernel, its epilogues by number and their measurements). Each
// epilogue takes a consumer warpgroup's fp32 accumulators (wgmma's layout: thread (g = lane / 4,
// t = lane % 4) of warp w holds rows 16w + g and + 8, columns 8n + 2t and + 1), writes bf16 into
// the consumer's sw128 output tile in shared memory, and one thread issues its TMA stores.
// Included by gemm_sm90.cu only.
#pragma once

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/rope.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace loom::cuda::gemm90 {
namespace {

using attn::bf;
constexpr int BM = 128, BN = 128, BK = 64;
constexpr int kThreads = 384;  // two consumer warpgroups, then the producer's warpgroup
// registers per thread after setmaxnreg: 128 x 40 + 256 x 232 = 64512 of the 65536

// The SwiGLU forward's output boxes (128 x 64, 16 KB each) per consumer: EPI 3, 8, 13 hold three,
// two or one of its three outputs at a time (swiglu_tile); 0 for the other epilogues.
__host__ __device__ constexpr int swiglu_boxes(int epi) { return epi == 3 ? 3 : epi == 8 ? 2 : epi == 13 ? 1 : 0; }

// The output tile's first row and column steps: 64-row tiles for EPI 7; for the SwiGLU forms (3,
// 8, 13; 4) a tile's 64 hidden units, whose gate and up columns lie `half` apart.
__host__ __device__ constexpr int tile_rows(int epi) { return epi == 7 ? 64 : BM; }
__host__ __device__ constexpr int tile_col_step(int epi) { return swiglu_boxes(epi) || epi == 4 ? 64 : BN; }

// Shared memory of a block: the ring of stages, each consumer's output tiles, the mbarriers.
// The SwiGLU forward: each box fewer for the two consumers frees 32 KB, one more stage of the
// ring (three boxes: four stages; two: five; one: six).
// EPI 4 (SwiGLU backward, 64-column tiles): the gate, up and h tiles of 128 x 64.
template <int EPI>
struct Smem {
  static constexpr int stages = swiglu_boxes(EPI) ? 7 - swiglu_boxes(EPI) : 5;
  static constexpr int a_bytes = (EPI == 7 ? 64 : BM) * BK * 2, b_bytes = (EPI == 4 ? 64 : BN) * BK * 2,
                       stage = a_bytes + b_bytes;
  static constexpr int epi = swiglu_boxes(EPI)        ? swiglu_boxes(EPI) * BM * 64 * 2
                             : EPI == 4 || EPI == 7 ? 3 * BM * 64 * 2
                                                    : BM * BN * 2;
  static constexpr int bytes = 1024 /* alignment */ + stages * stage + 2 * epi + (2 * stages + 4) * 8;
};

__device__ __forceinline__ float gelu_tanh(float x) {
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  float t;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(t) : "f"(u));
  return 0.5f * x * (1.f + t);
}

// A consumer's 128 x 128 fp32 accumulators (two m64 halves) as bf16 into its sw128 output tile
// (two 64-column halves of 128 rows, the TMA store's box layout), then one thread stores the
// tile. Bank-conflict free: the 8 rows a warp writes per column block land in 8 different
// 16-byte chunks. MODE 1: the tile holds the residual (TMA-loaded during the main loop), and each
// thread adds the values at the places it then overwrites; MODE 2: it holds GELU's
// pre-activation, and each thread multiplies by its derivative there.
template <int MODE, class F>
__device__ __forceinline__ void store_tile(bf* sOut, const float (&d)[2][BN / 8][4], const float (&bias2)[BN / 8][2],
                                           F act, const CUtensorMap* map, int n0, int m0, int wg_tid, int bar,
                                           int n1 = -1) {
  using namespace attn;
  const int w = wg_tid / 32, lane = wg_tid % 32, g = lane >> 2, t = lane & 3;
  if (MODE == 0) {  // otherwise the load that filled the tile came after the last store had read it
    if (wg_tid == 0) bulk_wait_read<0>();  // the last store from this tile has read it
    named_sync(bar, 128);
  }
#pragma unroll
  for (int h = 0; h < 2; h++)
#pragma unroll
    for (int n = 0; n < BN / 8; n++)
#pragma unroll
      for (int r = 0; r < 2; r++) {
        const int row = h * 64 + w * 16 + g + 8 * r;
        uint32_t* p = reinterpret_cast<uint32_t*>(sOut + sw128<BM>(row, n) + 2 * t);
        float v0 = act(d[h][n][2 * r] + bias2[n][0]), v1 = act(d[h][n][2 * r + 1] + bias2[n][1]);
        if (MODE == 1) {  // + the residual
          const __nv_bfloat162 rr = *reinterpret_cast<const __nv_bfloat162*>(p);
          v0 += __bfloat162float(rr.x);
          v1 += __bfloat162float(rr.y);
        } else if (MODE == 2) {  // x gelu'(the pre-activation)
          const __nv_bfloat162 pp = *reinterpret_cast<const __nv_bfloat162*>(p);
          v0 *= gelu_df(__bfloat162float(pp.x));
          v1 *= gelu_df(__bfloat162float(pp.y));
        }
        *p = pack_bf16(v0, v1);
      }
  fence_smem_async();
  named_sync(bar, 128);
  if (wg_tid == 0) {
    tma_store_3d(map, n0, 0, m0, sOut);
    tma_store_3d(map, n1 < 0 ? n0 + 64 : n1, 0, m0, sOut + BM * 64);
    bulk_commit();
  }
}

// The SwiGLU epilogue (EPI 3, 8, 13): the tile's 64 gate columns (accumulators n < 8) and the 64
// up columns of the same hidden units (n >= 8) go out to gu rounded to bf16 (the backward reads
// them), and h = silu(gate) up from those bf16 values, computed as swiglu_forward_joined does
// (common.cuh's swiglu_f, activations.cu's SwigluF), so h is bit for bit what that kernel would
// make of gu. Three 64-column outputs, in order: gate (gu at n0), up (gu at half + n0), h (at n0).
// The consumer's output tile holds BOXES of them (128 x 64 each): output o goes to box o % BOXES
// in round o / BOXES, once the store that last used that box has read it. Each store is its own
// bulk group, in output order, so before a round the groups committed after the last store it
// waits on may stay in flight. h is formed in the first round and kept in registers until its
// round. The fewer boxes, the more ring stages fit beside them (Smem), and at K 576 the main loop
// runs at the ring's depth (the file header):
//   EPI 3,  BOXES 3 (48 KB): one round, four stages;
//   EPI 8,  BOXES 2 (32 KB): gate and up, then h over the gate box (the up store may still be
//           reading: bulk_wait_read<1>), five stages;
//   EPI 13, BOXES 1 (16 KB): gate, up, h through one box, six stages.
// The bits are the same in all three.
template <int BOXES>
__device__ __forceinline__ void swiglu_tile(bf* sOut, const float (&d)[2][BN / 8][4], const CUtensorMap* tgu,
                                            const CUtensorMap* th, int n0, int half, int m0, int wg_tid, int bar) {
  using namespace attn;
  static_assert(BOXES >= 1 && BOXES <= 3, "the tile holds one to three of the three outputs");
  const int w = wg_tid / 32, lane = wg_tid % 32, g = lane >> 2, t = lane & 3;
  constexpr int rounds = (3 + BOXES - 1) / BOXES;
  uint32_t hp[2][8][2];  // h, from the first round until its own
#pragma unroll
  for (int rd = 0; rd < rounds; rd++) {
    const int first = rd * BOXES, last = first + BOXES < 3 ? first + BOXES : 3;  // outputs [first, last)
    // The store of output last - 1 - BOXES (round 0: the last tile's stores) must have read its
    // box; the groups committed after it may still run (0, or 1 for epilogue 8's h round).
    const int in_flight = first + BOXES - last;
    if (wg_tid == 0) {
      if (in_flight == 1) bulk_wait_read<1>();
      else bulk_wait_read<0>();
    }
    named_sync(bar, 128);
#pragma unroll
    for (int hh = 0; hh < 2; hh++)
#pragma unroll
      for (int n = 0; n < 8; n++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
          const int row = hh * 64 + w * 16 + g + 8 * r;
          const __nv_bfloat162 gb = __floats2bfloat162_rn(d[hh][n][2 * r], d[hh][n][2 * r + 1]);
          const __nv_bfloat162 ub = __floats2bfloat162_rn(d[hh][n + 8][2 * r], d[hh][n + 8][2 * r + 1]);
          if (rd == 0) {
            const float g0 = __low2float(gb), g1 = __high2float(gb), u0 = __low2float(ub), u1 = __high2float(ub);
            hp[hh][n][r] = pack_bf16(swiglu_f(g0, u0), swiglu_f(g1, u1));
          }
#pragma unroll
          for (int o = first; o < last; o++) {
            uint32_t* p = reinterpret_cast<uint32_t*>(sOut + (o % BOXES) * BM * 64 + sw128<BM>(row, n) + 2 * t);
            if (o == 0) *reinterpret_cast<__nv_bfloat162*>(p) = gb;
            else if (o == 1) *reinterpret_cast<__nv_bfloat162*>(p) = ub;
            else *p = hp[hh][n][r];
          }
        }
    fence_smem_async();
    named_sync(bar, 128);
    if (wg_tid == 0) {
#pragma unroll
      for (int o = first; o < last; o++) {
        bf* box = sOut + (o % BOXES) * BM * 64;
        if (o == 2) tma_store_3d(th, n0, 0, m0, box);
        else tma_store_3d(tgu, (o == 0 ? 0 : half) + n0, 0, m0, box);
        bulk_commit();
      }
    }
  }
}

// One element pair of the SwiGLU backward epilogues (EPI 4, 7): dh (d0, d1) rounded to bf16 (the
// value the two-pass path stores) with that pair's bf16 gate and up give, through common.cuh's
// swiglu_b / swiglu_f, dgate and dup written over gate and up at `pos` and (prod) h into sH,
// each bit for bit what swiglu_backward_joined computes.
__device__ __forceinline__ void swiglu_bwd_pair(bf* sG, bf* sU, bf* sH, int pos, __nv_bfloat162 g2,
                                                __nv_bfloat162 u2, float d0, float d1, bool prod) {
  using namespace attn;
  const __nv_bfloat162 d2 = __floats2bfloat162_rn(d0, d1);
  const float gv[2] = {__low2float(g2), __high2float(g2)}, uv[2] = {__low2float(u2), __high2float(u2)};
  const float dv[2] = {__low2float(d2), __high2float(d2)};
  float dg[2], du[2];
  swiglu_b(dg[0], du[0], dv[0], gv[0], uv[0]);
  swiglu_b(dg[1], du[1], dv[1], gv[1], uv[1]);
  *reinterpret_cast<uint32_t*>(sG + pos) = pack_bf16(dg[0], dg[1]);
  *reinterpret_cast<uint32_t*>(sU + pos) = pack_bf16(du[0], du[1]);
  if (prod) *reinterpret_cast<uint32_t*>(sH + pos) = pack_bf16(swiglu_f(gv[0], uv[0]), swiglu_f(gv[1], uv[1]));
}

// The SwiGLU backward epilogue (EPI 4): the accumulators are dh (the down projection's input
// gradient) for 64 hidden units; gate and up for them were TMA-loaded into sG and sU during the
// main loop. swiglu_bwd_pair per element pair: dgate and dup overwrite gate and up in place (each
// thread reads and writes the same elements), then three TMA stores.
__device__ __forceinline__ void swiglu_bwd_tile(bf* sG, const float (&d)[2][8][4], const CUtensorMap* tdgu,
                                                const CUtensorMap* th, bool prod, int n0, int half, int m0,
                                                int wg_tid, int bar) {
  using namespace attn;
  const int w = wg_tid / 32, lane = wg_tid % 32, g = lane >> 2, t = lane & 3;
  bf* sU = sG + BM * 64;
  bf* sH = sU + BM * 64;
#pragma unroll
  for (int hh = 0; hh < 2; hh++)
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
      for (int r = 0; r < 2; r++) {
        const int pos = sw128<BM>(hh * 64 + w * 16 + g + 8 * r, n) + 2 * t;
        const __nv_bfloat162 g2 = *reinterpret_cast<const __nv_bfloat162*>(sG + pos);
        const __nv_bfloat162 u2 = *reinterpret_cast<const __nv_bfloat162*>(sU + pos);
        swiglu_bwd_pair(sG, sU, sH, pos, g2, u2, d[hh][n][2 * r], d[hh][n][2 * r + 1], prod);
      }
  fence_smem_async();
  named_sync(bar, 128);
  if (wg_tid == 0) {
    tma_store_3d(tdgu, n0, 0, m0, sG);
    tma_store_3d(tdgu, half + n0, 0, m0, sU);
    if (prod) tma_store_3d(th, n0, 0, m0, sH);
    bulk_commit();
  }
}

// The SwiGLU backward epilogue in 64-row x 128-column tiles (EPI 7): the accumulators are dh of
// one m64n128 product (rows 16w + g + 8r, columns 8n + 2t), gate and up for its 128 hidden units
// were TMA-loaded as two 64-column halves each (sG, sU: 64-row sw128 tiles); swiglu_bwd_pair per
// element pair, dgate and dup in place, h into sH, then six TMA stores of 64 x 64 boxes.
__device__ __forceinline__ void swiglu_bwd_tile_n128(bf* sG, const float (&d)[16][4], const CUtensorMap* tdgu,
                                                     const CUtensorMap* th, bool prod, int n0, int half, int m0,
                                                     int wg_tid, int bar) {
  using namespace attn;
  const int w = wg_tid / 32, lane = wg_tid % 32, g = lane >> 2, t = lane & 3;
  bf* sU = sG + 2 * 64 * 64;
  bf* sH = sU + 2 * 64 * 64;
  // Loads first, then the arithmetic and the stores, in two passes of 64 columns: written in
  // place, the stores could alias the next elements' loads, which the compiler would then keep
  // behind them, one shared-memory round trip per element pair.
#pragma unroll
  for (int c8 = 0; c8 < 2; c8++) {
    __nv_bfloat162 g2[8][2], u2[8][2];
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
      for (int r = 0; r < 2; r++) {
        const int pos = sw128<64>(w * 16 + g + 8 * r, c8 * 8 + n) + 2 * t;
        g2[n][r] = *reinterpret_cast<const __nv_bfloat162*>(sG + pos);
        u2[n][r] = *reinterpret_cast<const __nv_bfloat162*>(sU + pos);
      }
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
      for (int r = 0; r < 2; r++) {
        const int pos = sw128<64>(w * 16 + g + 8 * r, c8 * 8 + n) + 2 * t;
        swiglu_bwd_pair(sG, sU, sH, pos, g2[n][r], u2[n][r], d[c8 * 8 + n][2 * r], d[c8 * 8 + n][2 * r + 1], prod);
      }
  }
  fence_smem_async();
  named_sync(bar, 128);
  if (wg_tid == 0) {
    tma_store_3d(tdgu, n0, 0, m0, sG);
    tma_store_3d(tdgu, n0 + 64, 0, m0, sG + 64 * 64);
    tma_store_3d(tdgu, half + n0, 0, m0, sU);
    tma_store_3d(tdgu, half + n0 + 64, 0, m0, sU + 64 * 64);
    if (prod) {
      tma_store_3d(th, n0, 0, m0, sH);
      tma_store_3d(th, n0 + 64, 0, m0, sH + 64 * 64);
    }
    bulk_commit();
  }
}

// What the q|k|v epilogue (EPI 6) needs beyond the maps: the joined row's q and k widths (the
// columns from qw + kw on are v's), the rows' positions, the cos / sin table (rope_table) with
// its row count, and log(theta) for positions past the table.
struct RopeArgs {
  const int32_t* pos = nullptr;
  const float2* table = nullptr;
  int table_rows = 0, qw = 0, kw = 0;
  double log_theta = 0;
};

// The angles of positions past the table: rope.cuh's rope_angle (a call, not inlined).

// The q|k|v epilogue (EPI 6) of a joined q | k | v product with head dim 64: each 64-column half
// of the tile is one head of q, k or v (qw and kw are multiples of 64). Every accumulator is
// rounded to bf16 first (the value the product alone would store), and q's and k's pairs (i,
// i + 32), which sit in the same thread (columns 8n + 2t and 8(n + 4) + 2t), are then rotated
// with rope.cuh's rotate_pair and the table's cos / sin: bit for bit what rope_qkv_split makes
// of the stored product. A thread's rows' positions (prow, loaded before the main loop) and
// their 8 angles per row, the same for both heads of the tile, are looked up once per 64-row
// half. Each half of the tile goes to q, k or v with its own map (tq, tk, tv: [N, width] views,
// 64-column boxes); a half past the last column is not stored.
__device__ __forceinline__ void rope_tile(bf* sOut, const float (&d)[2][BN / 8][4], const int32_t (&prow)[2][2],
                                          const CUtensorMap* tq, const CUtensorMap* tk, const CUtensorMap* tv,
                                          const RopeArgs& ra, int n0, int m0, int W, int wg_tid, int bar) {
  using namespace attn;
  const int w = wg_tid / 32, lane = wg_tid % 32, g = lane >> 2, t = lane & 3;
  const bool rot[2] = {n0 < ra.qw + ra.kw, n0 + 64 < ra.qw + ra.kw};
  if (wg_tid == 0) bulk_wait_read<0>();  // the last store from this tile has read it
  named_sync(bar, 128);
#pragma unroll
  for (int h = 0; h < 2; h++) {
    float2 cs[2][8];  // [r][j]: pair i = (j / 2) * 8 + 2t + j % 2 of row h * 64 + w * 16 + g + 8r
    if (rot[0]) {
#pragma unroll
      for (int r = 0; r < 2; r++) {
        const int32_t p = prow[h][r];
        if (p >= 0 && p < ra.table_rows) {
          const float4* row = reinterpret_cast<const float4*>(ra.table + int64_t(p) * 32 + 2 * t);
#pragma unroll
          for (int q4 = 0; q4 < 4; q4++) {  // i = q4 * 8 + 2t and the next: 16 bytes
            const float4 c = __ldg(row + q4 * 4);
            cs[r][2 * q4] = make_float2(c.x, c.y);
            cs[r][2 * q4 + 1] = make_float2(c.z, c.w);
          }
        } else {
#pragma unroll
          for (int j = 0; j < 8; j++) cs[r][j] = rope_angle(p, (j / 2) * 8 + 2 * t + j % 2, ra.log_theta);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const int row = h * 64 + w * 16 + g + 8 * r;
#pragma unroll
      for (int hh = 0; hh < 2; hh++)
#pragma unroll
        for (int n4 = 0; n4 < 4; n4++) {
          const int n = hh * 8 + n4;
          float y0[2], y1[2];
#pragma unroll
          for (int e = 0; e < 2; e++) {
            const float x0 = __bfloat162float(__float2bfloat16_rn(d[h][n][2 * r + e]));
            const float x1 = __bfloat162float(__float2bfloat16_rn(d[h][n + 4][2 * r + e]));
            y0[e] = x0;
            y1[e] = x1;
            if (rot[hh]) rotate_pair(y0[e], y1[e], x0, x1, cs[r][2 * n4 + e].x, cs[r][2 * n4 + e].y);
          }
          *reinterpret_cast<uint32_t*>(sOut + sw128<BM>(row, n) + 2 * t) = pack_bf16(y0[0], y0[1]);
          *reinterpret_cast<uint32_t*>(sOut + sw128<BM>(row, n + 4) + 2 * t) = pack_bf16(y1[0], y1[1]);
        }
    }
  }
  fence_smem_async();
  named_sync(bar, 128);
  if (wg_tid == 0) {
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
      const int col = n0 + hh * 64;
      if (col >= W) break;
      const CUtensorMap* map = col < ra.qw ? tq : col < ra.qw + ra.kw ? tk : tv;
      const int c0 = col < ra.qw ? col : col < ra.qw + ra.kw ? col - ra.qw : col - ra.qw - ra.kw;
      tma_store_3d(map, c0, 0, m0, sOut + hh * BM * 64);
    }
    bulk_commit();
  }
}

}  // namespace
}  // namespace loom::cuda::gemm90
