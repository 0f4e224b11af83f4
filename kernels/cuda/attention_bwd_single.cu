/*
 * attention_bwd_single.cu: the v2 backward in one pass with fp32-atomic dq, the default for
 * bf16 at hd 64/128 off Hopper and, on sm_90a, for sequences shorter than the warp-specialized
 * wgmma backward's threshold (attention_sm90_bwd.cu, which replaces the middle launch below and
 * shares the other two); set_deterministic_attention(true) or LOOM_DETERMINISTIC=1 runs
 * attention_bwd.cu instead. Read attention_bwd.cu first: this is its dk/dv pass plus the dq
 * contribution of every tile pair, so that S and dP are computed once.
 *
 * Three launches:
 *   attn_bwd_prep     delta = dout . out (fp32) and dq_acc = 0, HD / 8 threads per row; with a
 *                     BwdOrder plan one block more, which builds the warp-specialized backward's
 *                     block order (attention_tiles.cuh, build_bwd_order)
 *   attn_bwd_v2_atomic_dq  one block per key tile (16 NW keys of one kv head) walks the query
 *                     tiles that see it (the group's query heads in order), keeps dK and dV in
 *                     registers; per tile pair dS^T is stored transposed into shared memory as
 *                     bf16 (stmatrix .trans), a barrier, dQ_tile = dS K split over the warps
 *                     (WM along the rows, NW / WM along the columns) and added with
 *                     red.global.add.v2.f32 into dq_acc [Nq, H, hd] fp32 (workspace, +=).
 *   attn_bwd_finish   dq = bf16(scale dq_acc) (=), and the rows of dk, dv outside every key
 *                     sequence = 0.
 *   The order of the fp32 additions into dq_acc changes from run to run: dq differs in the
 *   last bits between runs (dk, dv do not).
 *   A dense batch at hd 64 with sequences of at most 64 tokens (one key tile: the MIM encoder's
 *   49 kept patches) has every dq row in one block: the block stores bf16 dq itself
 *   (STORE_DQ), prep computes delta alone and finish does not run (no fp32 workspace pass, dq
 *   bitwise reproducible there). By default that form runs as attn_bwd_one_tile: the same
 *   work per (sequence, kv head) pair on persistent blocks that load the next pair's tiles while
 *   computing this one (same bits; LOOM_ATTN_BWD_ONE=0 keeps one block a pair). fwd+bwd B256
 *   H12 T49 0.126 -> 0.114 ms, B128 0.068 -> 0.062 (H200, 2026-12-02; docs/kernels/attention.md
 *   "Persistent blocks for sequences of one key tile", with delta computed in the block, lost).
 * Launch: hd 128: 8 warps = 128 keys per block, query tiles of 64 (255 registers, no spill,
 *   145 KB shared memory, 1 block per SM); hd 64: 4 warps = 64 keys, query tiles of 64
 *   (225 registers, 2 blocks per SM). Blocks go by chunks of (kv head, sequence) pairs
 *   holding ~32 MB of Q, dO and dq_acc (H200 L2: 50 MB), key tile 0 of every pair of the
 *   chunk first (causal: longest first).
 * Bytes / FLOPs: 5 tile GEMMs per tile pair (2.5x the forward), plus fp32 reductions of
 *   BRQ x hd x 4 bytes per tile pair, i.e. 4 / (10 BC) bytes per FLOP: 1.1 GB at 128 keys per
 *   block on the hd 128 shape (343 GFLOP), into an L2-resident dq_acc; zeroing and converting
 *   dq_acc moves 0.34 GB more. The atomics cost ~0.3 ms of the 1.7 ms backward at hd 128.
 * Versions: fwd+bwd 0.494 | 2.124 | 0.398 ms on the SPEC shapes (H200; two passes: 0.573 |
 *   2.632 | 0.552; PyTorch FLASH_ATTENTION 0.512 | 2.243 | 0.516). The tilings, block orders
 *   and forms measured and not kept (among them a wgmma single pass, slower than this one; the
 *   warp-specialized attention_sm90_bwd.cu is faster from 128 tokens): docs/kernels/attention.md.
 * Test: tests/cuda/test_cuda_kernels_b.cpp ("attention forward/backward bf16 ...", single-pass runs);
 *   tests/cuda/test_cuda_attention_one_tile.cpp (attn_bwd_one_tile bit for bit the one-block-a-pair form).
 */
#include <algorithm>
#include <cstdlib>

#include "kernels/cuda/attention_tiles.cuh"
#include "kernels/cuda/rope.cuh"
#include "kernels/cuda/rope_table.h"

namespace loom::cuda {
namespace {

using namespace attn;

// =========================================================================== v2 backward, single pass
// The steps of a tile pair after dkdv_p_ds, shared by the single pass's two kernels below.
// P^T and dS^T of the warp's 16 keys as A fragments, dS^T stored into sS, dV += P^T dO, dK += dS^T Q.
template <int HD, int BRQ, int BC>
__device__ __forceinline__ void ds_store_dkdv(bf* sS, const float (&st)[BRQ / 8][4], const float (&dpt)[BRQ / 8][4],
                                              float (&dva)[HD / 8][4], float (&dka)[HD / 8][4], const bf* cQ,
                                              const bf* cO, int warp, int lane) {
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
}
// dqa += dS K, the warp's QM x QN block of dQ_tile (rows wm QM.., columns wn QN..; dqa zeroed by the
// caller), once all of dS is in sS; the scale is applied at the store.
template <int HD, int BC, int QM, int QN>
__device__ __forceinline__ void dq_tile(float (&dqa)[QM / 16][QN / 8][4], const bf* sS, const bf* sK, int wm, int wn,
                                        int lane) {
#pragma unroll
  for (int kk = 0; kk < BC / 16; kk++) {
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
}
// The warp's dQ block out, the rows below nq (off: its first row and column, rows qstride apart).
// Each lane adds pairs of columns (a warp's reduction: 8 rows x 32 bytes) into dq_acc; query rows
// past the sequence are skipped (they belong to the next sequence or to no row at all). STORE (a
// dense batch of one key tile a sequence: this block is the only one that sees these rows): the
// pairs are scaled, rounded and stored to dq as attn_bwd_finish would, same bits.
template <int QM, int QN, bool STORE>
__device__ __forceinline__ void dq_out(const float (&dqa)[QM / 16][QN / 8][4], bf* dq, float* dq_acc, int64_t off,
                                       int64_t qstride, int nq, int wm, int lane, float scale) {
  const int g = lane >> 2;
#pragma unroll
  for (int mt = 0; mt < QM / 16; mt++)
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const int row = wm * QM + mt * 16 + g + 8 * r;
      if (row < nq) {
#pragma unroll
        for (int nt = 0; nt < QN / 8; nt++) {
          const float a = dqa[mt][nt][2 * r], b = dqa[mt][nt][2 * r + 1];
          if constexpr (STORE)
            *reinterpret_cast<uint32_t*>(dq + off + row * qstride + nt * 8) = pack_bf16(a * scale, b * scale);
          else
            red_add_f32x2(dq_acc + off + row * qstride + nt * 8, a, b);
        }
      }
    }
}

// attn_bwd_dkdv_v2's block and loop (16 NW keys of one kv head; the group's query heads and
// the query tiles that see the keys), plus the dQ contribution of every tile pair, so that S
// and dP are computed once: dS is staged in shared memory as bf16 (queries x keys), then all
// warps split dQ_tile = dS K (BRQ x HD; WM warps along the rows, NW / WM along the columns)
// and add it with fp32 vector reductions into dq_acc (zeroed before, converted to bf16 after).
// 5 tile GEMMs per tile pair instead of 7. The order in which blocks add into a dq_acc row
// changes from run to run: dq is not bitwise reproducible (fp32 rounding only).
template <int HD, int NW, int BRQ, int WM, bool STORE_DQ>
__global__ void __launch_bounds__(NW * 32)
attn_bwd_v2_atomic_dq(bf* __restrict__ dk, bf* __restrict__ dv, float* __restrict__ dq_acc,
                      const bf* __restrict__ dout, const bf* __restrict__ q, const bf* __restrict__ k,
                      const bf* __restrict__ v, const float* __restrict__ lse,
                      const float* __restrict__ delta, const int32_t* __restrict__ cu_q,
                      const int32_t* __restrict__ cu_k, int nseq, int H, int KV, int n_kt,
                      int chunk, bool causal, float scale, float scale_log2, bf* __restrict__ dq) {
  pdl_entry();
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
  // block -> (key tile kt, kv head, sequence) in attention_tiles.cuh's order: inside a chunk
  // of (kv head, sequence) pairs key tile 0 of every pair first, then tile 1, ... Causal: the
  // first key tiles see the most queries, so the long blocks start first and the short ones
  // fill the tail; the chunk keeps the Q, dO and dq_acc rows that the running blocks share
  // in L2.
  const BlockTile bt = block_tile(int(blockIdx.x), n_kt, KV * nseq, chunk);
  const int kt = bt.tile, seq = bt.pair / KV, kvh = bt.pair % KV, group = H / KV;
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
    ds_store_dkdv<HD, BRQ, BC>(sS, st, dpt, dva, dka, cQ, cO, warp, lane);
    __syncthreads();  // all of dS is in sS
    float dqa[QM / 16][QN / 8][4] = {};
    dq_tile<HD, BC, QM, QN>(dqa, sS, sK, wm, wn, lane);
    dq_out<QM, QN, STORE_DQ>(dqa, dq, dq_acc, ((int64_t(q0) + qt) * H + h) * HD + wn * QN + 2 * t, qstride,
                             min(BRQ, Lq - qt), wm, lane, scale);
  }
  cp_async_wait<0>();
  __syncthreads();  // K/V landed (no query tile ran) or every warp is done reading sK
  store_rows<HD>(sK, warp * 16, dka, scale, dk + koff, kvstride, nk, lane);
  store_rows<HD>(sV, warp * 16, dva, 1.f, dv + koff, kvstride, nk, lane);
}

// The single pass's first launch (replaces attn_delta and a memset): for every (row, head) r
// of [Nq * H, HD], delta[r] = dout[r, :] . out[r, :] in fp32 and dq_acc[r, :] = 0 (dq_acc
// null: the block kernel stores dq itself, nothing to zero). HD / 8
// threads per row, 16-byte loads; the row's threads are adjacent lanes (HD / 8 divides 32).
template <int HD>
__global__ void attn_bwd_prep(float* __restrict__ delta, float* __restrict__ dq_acc, const bf* __restrict__ dout,
                              const bf* __restrict__ out, int64_t rows, const BwdOrder ord) {
  pdl_entry();
  if (ord.order && blockIdx.x == gridDim.x - 1) {  // one block more: the backward's block order
    build_bwd_order(ord);
    return;
  }
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
    if (dq_acc) {
      float4* z = reinterpret_cast<float4*>(dq_acc + r * HD + c * 8);
      z[0] = make_float4(0.f, 0.f, 0.f, 0.f);
      z[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
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
  pdl_entry();
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

// =========================================================================== one key tile, persistent
// A dense batch at hd 64 whose sequences of L <= 64 tokens fit one 64-key tile (the MIM encoder's
// 49 kept patches): the same work per (sequence, kv head) pair as attn_bwd_v2_atomic_dq's STORE_DQ
// form (4 warps x 16 keys, the group's query heads in order, dq stored by the block), the same
// operations in the same order, so the same bits. What differs is that a block is resident for
// several pairs (pairs b, b + grid, ...; the grid is what fits on the multiprocessors at once)
// and loads the next tile (K and V when the pair changes, Q and dO always, each into the other of
// two buffers) while it computes this one; in attn_bwd_v2_atomic_dq every block of this shape
// has one tile, so its loads and its products never overlap (2 blocks of 4 warps per
// multiprocessor, 225 registers). lse and delta of the next tile go to registers before the
// products and into shared memory after them, so that no thread waits on those loads either.
template <int HD, int BRQ>
__global__ void __launch_bounds__(128)
attn_bwd_one_tile(bf* __restrict__ dq, bf* __restrict__ dk, bf* __restrict__ dv, const bf* __restrict__ dout,
                  const bf* __restrict__ q, const bf* __restrict__ k, const bf* __restrict__ v,
                  const float* __restrict__ lse, const float* __restrict__ delta, int L, int pairs, int H, int KV,
                  bool causal, float scale, float scale_log2, int64_t dq_ld, int64_t dkv_ld) {
  pdl_entry();
  constexpr int NW = 4, BC = 64, NT = NW * 32, WM = 2;
  constexpr int WN = NW / WM, QM = BRQ / WM, QN = HD / WN;
  static_assert(QM % 16 == 0 && QN % 16 == 0 && BRQ <= NT, "dQ warp blocks are whole 16x16 tiles");
  extern __shared__ __align__(128) unsigned char smem[];
  bf* sK = reinterpret_cast<bf*>(smem);  // [2][BC][HD], later the dk staging
  bf* sV = sK + 2 * BC * HD;             // [2][BC][HD], later the dv staging
  bf* sQ = sV + 2 * BC * HD;             // [2][BRQ][HD]
  bf* sO = sQ + 2 * BRQ * HD;            // [2][BRQ][HD] dout
  bf* sS = sO + 2 * BRQ * HD;            // [BRQ][BC] dS, queries x keys
  float* sL = reinterpret_cast<float*>(sS + BRQ * BC);  // [2][BRQ] lse * log2(e)
  float* sD = sL + 2 * BRQ;                             // [2][BRQ] delta
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int group = H / KV, grid = int(gridDim.x);
  const int np = int(blockIdx.x) < pairs ? (pairs - int(blockIdx.x) + grid - 1) / grid : 0;
  const int n = np * group;  // this block's tiles: pair i = j / group, its head j % group
  if (n == 0) return;
  const int64_t qstride = int64_t(H) * HD, kvstride = int64_t(KV) * HD;
  auto pair_of = [&](int j) { return int(blockIdx.x) + (j / group) * grid; };
  auto kv_off = [&](int pair) { return int64_t(pair / KV) * L * kvstride + (pair % KV) * HD; };
  auto head_of = [&](int j) { return (pair_of(j) % KV) * group + j % group; };
  auto q_off = [&](int j) { return int64_t(pair_of(j) / KV) * L * qstride + head_of(j) * HD; };
  // the outputs' rows: dq_ld and dkv_ld apart (qstride and kvstride, or a joined q|k|v gradient's
  // row width)
  auto dq_off = [&](int j) { return int64_t(pair_of(j) / KV) * L * dq_ld + head_of(j) * HD; };
  auto dkv_off = [&](int pair) { return int64_t(pair / KV) * L * dkv_ld + (pair % KV) * HD; };
  // tile j's loads: K and V when it starts a pair, Q and dO (cp.async, zero-filled past L)
  auto load_async = [&](int j) {
    if (j % group == 0) {
      const int kb = (j / group) & 1;
      load_tile<HD, BC, NT>(sK + kb * BC * HD, k + kv_off(pair_of(j)), kvstride, L);
      load_tile<HD, BC, NT>(sV + kb * BC * HD, v + kv_off(pair_of(j)), kvstride, L);
    }
    load_tile<HD, BRQ, NT>(sQ + (j & 1) * BRQ * HD, q + q_off(j), qstride, L);
    load_tile<HD, BRQ, NT>(sO + (j & 1) * BRQ * HD, dout + q_off(j), qstride, L);
  };
  // its lse * log2(e) and delta (+inf / 0 past L): thread r < BRQ holds row r
  float nl = INFINITY, nd = 0.f;
  auto load_rows = [&](int j) {
    const int r = int(threadIdx.x);
    if (r < L) {
      const int64_t st = (int64_t(pair_of(j) / KV) * L + r) * H + head_of(j);
      nl = lse[st] * kLog2e;
      nd = delta[st];
    } else {
      nl = INFINITY;
      nd = 0.f;
    }
  };
  auto stage_rows = [&](int buf) {
    if (threadIdx.x < BRQ) {
      sL[buf * BRQ + threadIdx.x] = nl;
      sD[buf * BRQ + threadIdx.x] = nd;
    }
  };
  load_async(0);
  cp_async_commit();
  load_rows(0);
  stage_rows(0);

  float dka[HD / 8][4] = {}, dva[HD / 8][4] = {};
  const int key0 = warp * 16 + g;            // this thread's keys: key0 (c0, c1) and key0 + 8
  const int wm = warp / WN, wn = warp % WN;  // the warp's dQ block: rows wm QM.., columns wn QN..
  const bool need_mask = L < BC || causal;
  for (int j = 0; j < n; j++) {
    // Tile j (and its pair's K and V) landed, its lse and delta are stored, and every warp is done
    // with tile j - 1: the buffers refilled below (Q, dO of tile j + 1; K, V of the next pair) were
    // last read there (or by the pair before this one, dk / dv staging included).
    cp_async_wait<0>();
    __syncthreads();
    if (j + 1 < n) {
      load_async(j + 1);
      load_rows(j + 1);
    }
    cp_async_commit();
    const int buf = j & 1, kb = (j / group) & 1;
    const bf* cK = sK + kb * BC * HD;
    const bf* cV = sV + kb * BC * HD;
    const bf* cQ = sQ + buf * BRQ * HD;
    const bf* cO = sO + buf * BRQ * HD;
    float st[BRQ / 8][4], dpt[BRQ / 8][4];
    dkdv_p_ds<HD, BRQ>(st, dpt, cK, cV, cQ, cO, sL + buf * BRQ, sD + buf * BRQ, warp, lane, key0, L, need_mask, causal,
                       0, 0, scale_log2);
    ds_store_dkdv<HD, BRQ, BC>(sS, st, dpt, dva, dka, cQ, cO, warp, lane);
    __syncthreads();  // all of dS is in sS
    float dqa[QM / 16][QN / 8][4] = {};
    dq_tile<HD, BC, QM, QN>(dqa, sS, cK, wm, wn, lane);
    dq_out<QM, QN, true>(dqa, dq, nullptr, dq_off(j) + wn * QN + 2 * t, dq_ld, L, wm, lane, scale);
    if (j + 1 < n) stage_rows((j + 1) & 1);  // buffer (j + 1) & 1 was last read in tile j - 1
    if (j % group == group - 1) {  // the pair's last head: dk and dv out through its K / V buffers
      __syncthreads();             // every warp is done reading cK (dQ above)
      const int64_t koff = dkv_off(pair_of(j));
      store_rows<HD>(sK + kb * BC * HD, warp * 16, dka, scale, dk + koff, dkv_ld, L, lane);
      store_rows<HD>(sV + kb * BC * HD, warp * 16, dva, 1.f, dv + koff, dkv_ld, L, lane);
#pragma unroll
      for (int i = 0; i < HD / 8; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) dka[i][e] = dva[i][e] = 0.f;
    }
  }
}

// The finish of the joined q|k|v gradient (bwd_qkv_joined, hd 64): dq = bf16(scale dq_acc) into the
// q part of dqkv's rows, W = (H + 2 KV) 64 apart, with pos rotated by -angle. A thread takes pairs i .. i + 3
// and i + 32 .. i + 35 of one (row, head): 16-byte loads of dq_acc, 8-byte stores. Each value is
// rounded to bf16 before the rotation, as rope_qkv_join reads the dq the plain finish stores, and
// rotated with the same rotate_pair and angles: the same bits. Then, as attn_bwd_finish, the k
// and v parts of the rows outside every sequence set to 0.
__global__ void attn_bwd_finish_qkv(bf* __restrict__ dqkv, const float* __restrict__ acc, int64_t N, int H, int KV,
                                    float scale, const int32_t* __restrict__ pos, const float2* __restrict__ table,
                                    int table_rows, double log_theta, const int32_t* __restrict__ cu, int nseq) {
  pdl_entry();
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, W = int64_t(H + 2 * KV) * 64;
  if (t < N * H * 8) {
    const int64_t rh = t / 8, n = rh / H;
    const int h = int(rh - n * H), i = int(t % 8) * 4;
    const float4 a = *reinterpret_cast<const float4*>(acc + rh * 64 + i);
    const float4 b = *reinterpret_cast<const float4*>(acc + rh * 64 + i + 32);
    const float x0[4] = {a.x, a.y, a.z, a.w}, x1[4] = {b.x, b.y, b.z, b.w};
    float y0[4], y1[4];
    if (pos) {
      const int32_t p = pos[n];
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const float2 c = rope_lookup(table, table_rows, p, i + j, log_theta);
        rotate_pair(y0[j], y1[j], __bfloat162float(__float2bfloat16_rn(x0[j] * scale)),
                    __bfloat162float(__float2bfloat16_rn(x1[j] * scale)), c.x, -c.y);
      }
    } else {  // no rotation: attn_bwd_finish's values
#pragma unroll
      for (int j = 0; j < 4; j++) {
        y0[j] = x0[j] * scale;
        y1[j] = x1[j] * scale;
      }
    }
    bf* row = dqkv + n * W + h * 64 + i;
    *reinterpret_cast<uint2*>(row) = make_uint2(pack_bf16(y0[0], y0[1]), pack_bf16(y0[2], y0[3]));
    *reinterpret_cast<uint2*>(row + 32) = make_uint2(pack_bf16(y1[0], y1[1]), pack_bf16(y1[2], y1[3]));
  }
  const int64_t lo = cu[0], hi = cu[nseq], cpr = int64_t(KV) * 64 * 2 / 8, m = (lo + N - hi) * cpr;
  for (int64_t j = t; j < m; j += int64_t(gridDim.x) * blockDim.x) {
    const int64_t rr = j / cpr, row = rr < lo ? rr : hi + (rr - lo);
    *reinterpret_cast<uint4*>(dqkv + row * W + int64_t(H) * 64 + (j % cpr) * 8) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// =========================================================================== launchers
// attn_bwd_one_tile on as many blocks as fit on the multiprocessors at once (2 a multiprocessor at
// 231 registers), at most one a pair.
// dq_ld, dkv_ld: the row strides of dq and of dk, dv (0: H 64 and KV 64, rows as q's and k's).
void bwd_one_tile_launch(bf* dq, bf* dk, bf* dv, const bf* dout, const bf* q, const bf* k, const bf* v, const float* lse,
                         const float* delta, int nseq, int L, int H, int KV, bool causal, float scale, cudaStream_t s,
                         int64_t dq_ld = 0, int64_t dkv_ld = 0) {
  constexpr int HD = 64, BRQ = 64, BC = 64;
  const int smem = (4 * BC + 4 * BRQ) * HD * int(sizeof(bf)) + BRQ * BC * int(sizeof(bf)) + 4 * BRQ * int(sizeof(float));
  static const int per_sm = [&] {
    set_smem(attn_bwd_one_tile<HD, BRQ>, smem);
    int b = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, attn_bwd_one_tile<HD, BRQ>, 128, smem));
    return std::max(1, b);
  }();
  const int pairs = nseq * KV, grid = std::min(pairs, per_sm * sm_count());
  launch_kernel(attn_bwd_one_tile<HD, BRQ>, grid, 128, smem, s, dq, dk, dv, dout, q, k, v, lse, delta, L, pairs, H, KV,
                causal, scale, scale * kLog2e, dq_ld ? dq_ld : int64_t(H) * HD, dkv_ld ? dkv_ld : int64_t(KV) * HD);
  LAUNCH_CHECK();
}

template <int HD, int NW, int BRQ, int WM, bool STORE_DQ = false>
void bwd_atomic_launch(bf* dk, bf* dv, float* dq_acc, const bf* dout, const bf* q, const bf* k,
                       const bf* v, const float* lse, const float* delta, const int32_t* cu_q,
                       const int32_t* cu_k, int nseq, int max_seqlen, int H, int KV, bool causal,
                       float scale, bf* dq, cudaStream_t s) {
  constexpr int BC = 16 * NW;
  const int smem = (2 * BC + 4 * BRQ) * HD * int(sizeof(bf)) + BRQ * BC * int(sizeof(bf)) +
                   4 * BRQ * int(sizeof(float));
  static bool once = (set_smem(attn_bwd_v2_atomic_dq<HD, NW, BRQ, WM, STORE_DQ>, smem), true);
  (void)once;
  // chunks of (kv head, sequence) pairs whose Q, dO (bf16) and dq_acc (fp32) rows share L2
  const int n_kt = ceil_div(max_seqlen, BC), pairs = KV * nseq;
  const int chunk = chunk_pairs(pairs, double(H / KV) * std::max(max_seqlen, 1) * HD * 8.0);
  launch_kernel(attn_bwd_v2_atomic_dq<HD, NW, BRQ, WM, STORE_DQ>, pairs * n_kt, NW * 32, smem, s, dk, dv, dq_acc, dout, q, k, v,
                lse, delta, cu_q, cu_k, nseq, H, KV, n_kt, chunk, causal, scale, scale * kLog2e, dq);
  LAUNCH_CHECK();
}

// Single pass (hd 64 / 128), three launches: prep (delta, dq_acc = 0), the block kernel
// (dk, dv, dq_acc +=), finish (dq from dq_acc; dk, dv rows outside every sequence = 0). Rows of
// dq outside every sequence are never added to: dq = 0 there.
// A dense batch at hd 64 whose sequences fit one key tile (the MIM encoder's 49 kept
// patches) has one block per (sequence, kv head) and every dq row in one of them: the block kernel
// stores dq itself and prep only computes delta, two launches and no fp32 workspace pass.
template <int HD>
void bwd_v2_atomic_hd(bf* dq, bf* dk, bf* dv, float* dq_acc, float* delta, const bf* dout, const bf* out,
                   const bf* q, const bf* k, const bf* v, const float* lse, const int32_t* cu_q,
                   const int32_t* cu_k, int nseq, int max_seqlen, int64_t Nq, int64_t Nk, int H, int KV,
                   bool causal, float scale, cudaStream_t s) {
  const int64_t rows = Nq * H, n = rows * HD;
  const bool ws = nseq > 0 && max_seqlen > 0 && bwd_sm90_ws_available(HD, causal, max_seqlen, Nq, Nk, q, k, v, dout, dq_acc);
  // hd 64 only (64 keys a block); the hd 128 instance with the stores spilled 8 bytes
  const bool direct = HD == 64 && !ws && nseq > 0 && max_seqlen > 0 && max_seqlen <= 64 &&
                      dense_seqlen(cu_q, cu_k, nseq, max_seqlen, Nq, Nk) > 0;
  // and there the persistent form, attn_bwd_one_tile; LOOM_ATTN_BWD_ONE=0 keeps one block a pair
  // (read at every call: tests and benchmarks switch it)
  const char* one = std::getenv("LOOM_ATTN_BWD_ONE");
  const bool one_tile = !(one && one[0] == '0');
  const BwdOrder ord = ws && rows > 0 ? bwd_sm90_order(cu_q, cu_k, nseq, max_seqlen, Nq, Nk, causal) : BwdOrder();
  if (rows > 0) {
    launch_kernel(attn_bwd_prep<HD>, ceil_div(rows * (HD / 8), 256) + (ord.order ? 1 : 0), 256, 0, s, delta,
                  direct ? nullptr : dq_acc, dout, out, rows, ord);
    LAUNCH_CHECK();
  }
  if (ws) {
    bwd_sm90_ws(dk, dv, dq_acc, dout, q, k, v, lse, delta, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV, HD, causal,
                scale, s, QkvRope(), ord.order);
    if (ord.order) device_free(ord.order);  // stream-ordered reuse
  } else if (nseq > 0 && max_seqlen > 0) {
    // hd 128: 8 warps x 16 keys, query tiles of 64 (255 registers, no spill; 1 block per SM).
    // hd 64: 4 warps x 16 keys, query tiles of 64 (225 registers; 2 blocks per SM).
    if constexpr (HD == 128)
      bwd_atomic_launch<HD, 8, 64, 2>(dk, dv, dq_acc, dout, q, k, v, lse, delta, cu_q, cu_k, nseq, max_seqlen, H, KV,
                                      causal, scale, nullptr, s);
    else if (direct && one_tile)
      bwd_one_tile_launch(dq, dk, dv, dout, q, k, v, lse, delta, nseq, max_seqlen, H, KV, causal, scale, s);
    else if (direct)
      bwd_atomic_launch<HD, 4, 64, 2, true>(dk, dv, dq_acc, dout, q, k, v, lse, delta, cu_q, cu_k, nseq, max_seqlen, H,
                                            KV, causal, scale, dq, s);
    else
      bwd_atomic_launch<HD, 4, 64, 2>(dk, dv, dq_acc, dout, q, k, v, lse, delta, cu_q, cu_k, nseq, max_seqlen, H, KV,
                                      causal, scale, nullptr, s);
  }
  if (direct) return;  // dq stored; a dense batch has no rows outside its sequences
  if (n > 0 || Nk > 0) {
    launch_kernel(attn_bwd_finish, std::max(1, ceil_div(n / 4, 256)), 256, 0, s, dq, dq_acc, n, scale, dk, dv, cu_k,
                  nseq, Nk, KV * HD);
    LAUNCH_CHECK();
  }
}

}  // namespace

namespace attn {

// The one-tile form takes a joined gradient when the batch is dense, of at most 64 tokens a
// sequence, without RoPE (a ViT's 49 kept patches) and LOOM_ATTN_BWD_ONE is not 0.
static bool joined_one_tile(int hd, bool causal, int nseq, int max_seqlen, int64_t N, const int32_t* cu,
                            const int32_t* pos, const void* q, const void* k, const void* v, const void* dout,
                            const void* dq_acc) {
  const char* one = std::getenv("LOOM_ATTN_BWD_ONE");  // read at every call: tests switch it
  return hd == 64 && !pos && !(one && one[0] == '0') && max_seqlen <= 64 &&
         dense_seqlen(cu, cu, nseq, max_seqlen, N, N) > 0 &&
         !bwd_sm90_ws_available(64, causal, max_seqlen, N, N, q, k, v, dout, dq_acc);
}

bool bwd_qkv_joined_available(int hd, bool causal, int nseq, int max_seqlen, int64_t N, const int32_t* cu,
                              const int32_t* pos, const void* q, const void* k, const void* v, const void* dout,
                              const void* dq_acc, const void* dqkv) {
  if (hd != 64 || nseq <= 0 || max_seqlen <= 0 || N <= 0 || (reinterpret_cast<uintptr_t>(dqkv) & 15) != 0) return false;
  return bwd_sm90_ws_available(64, causal, max_seqlen, N, N, q, k, v, dout, dq_acc) ||
         joined_one_tile(hd, causal, nseq, max_seqlen, N, cu, pos, q, k, v, dout, dq_acc);
}

void bwd_qkv_joined(bf* dqkv, float* dq_acc, float* delta, const bf* dout, const bf* out, const bf* q, const bf* k,
                    const bf* v, const float* lse, const int32_t* cu, const int32_t* pos, int nseq, int max_seqlen,
                    int64_t N, int H, int KV, bool causal, float scale, double theta, cudaStream_t s) {
  const int64_t rows = N * H, W = int64_t(H + 2 * KV) * 64;
  if (rows <= 0) return;
  if (!bwd_qkv_joined_available(64, causal, nseq, max_seqlen, N, cu, pos, q, k, v, dout, dq_acc, dqkv))
    throw std::runtime_error("bwd_qkv_joined: no joined form for this call (attention_backward_qkv checks it)");
  bf* dk = dqkv + int64_t(H) * 64;
  bf* dv = dqkv + int64_t(H + KV) * 64;
  if (joined_one_tile(64, causal, nseq, max_seqlen, N, cu, pos, q, k, v, dout, dq_acc)) {
    // delta alone (no dq_acc), then every output row stored by the block that owns it
    launch_kernel(attn_bwd_prep<64>, ceil_div(rows * 8, 256), 256, 0, s, delta, nullptr, dout, out, rows, BwdOrder());
    LAUNCH_CHECK();
    bwd_one_tile_launch(dqkv, dk, dv, dout, q, k, v, lse, delta, nseq, max_seqlen, H, KV, causal, scale, s, W, W);
    return;
  }
  const BwdOrder ord = bwd_sm90_order(cu, cu, nseq, max_seqlen, N, N, causal);
  launch_kernel(attn_bwd_prep<64>, ceil_div(rows * 8, 256) + (ord.order ? 1 : 0), 256, 0, s, delta, dq_acc, dout, out,
                rows, ord);
  LAUNCH_CHECK();
  QkvRope rope;
  rope.stride = W;
  if (pos) {
    rope.pos = pos;
    rope.table = rope_table(64, theta, N, &rope.table_rows, s);
    rope.log_theta = std::log(theta);
  }
  bwd_sm90_ws(dk, dv, dq_acc, dout, q, k, v, lse, delta, cu, cu, nseq, max_seqlen, N, N, H, KV, 64, causal, scale, s,
              rope, ord.order);
  if (ord.order) device_free(ord.order);  // stream-ordered reuse
  launch_kernel(attn_bwd_finish_qkv, std::max<int64_t>(1, ceil_div(rows * 8, 256)), 256, 0, s, dqkv, dq_acc, N, H, KV,
                scale, pos, rope.table, rope.table_rows, rope.log_theta, cu, nseq);
  LAUNCH_CHECK();
}

void bwd_v2_atomic(bf* dq, bf* dk, bf* dv, float* dq_acc, float* delta, const bf* dout, const bf* out,
                   const bf* q, const bf* k, const bf* v, const float* lse, const int32_t* cu_q,
                   const int32_t* cu_k, int nseq, int max_seqlen, int64_t Nq, int64_t Nk, int H, int KV,
                   int hd, bool causal, float scale, cudaStream_t s) {
  if (hd == 64)
    bwd_v2_atomic_hd<64>(dq, dk, dv, dq_acc, delta, dout, out, q, k, v, lse, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV,
                          causal, scale, s);
  else
    bwd_v2_atomic_hd<128>(dq, dk, dv, dq_acc, delta, dout, out, q, k, v, lse, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H,
                           KV, causal, scale, s);
}

}  // namespace attn
}  // namespace loom::cuda
