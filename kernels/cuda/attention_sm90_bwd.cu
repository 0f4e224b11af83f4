/*
 * attention_sm90_bwd.cu: the flash-attention backward on Hopper, warp-specialized like the
 * forward of attention_sm90_ws.cu (read that first: TMA producer, mbarrier rings, the wgmma
 * layouts). Same contract and math as the single pass of attention_bwd_single.cu, whose first
 * and last launches it shares (attn_bwd_prep: delta, dq_acc = 0; attn_bwd_finish: dq from
 * dq_acc, dk / dv rows outside every sequence); this file is the middle launch:
 *   dV_j += P^T dO,  dK_j += dS^T Q (scaled at the store),  dq_acc += dS K (fp32 reductions).
 *
 * Block: 3 warpgroups, 128 keys of one kv head and one sequence (BC), query tiles of 64 (BR)
 * of every query head of the group in turn, only those that see the keys (causal).
 *   warpgroup 0, the producer (40 registers: at 24 it spilled): K and V of the block once (TMA,
 *     or cp.async with zero-filled rows for the sequence's last, partial tile), then for each
 *     query tile Q and dO into a ring of STAGES buffers (TMA; the partial last tile through
 *     cp.async, zero-filled, so that a row past the sequence adds 0, not 0 x garbage, to dK
 *     and dV) and the tile's lse * log2(e) and delta into small arrays beside them. "full" mbarriers (128
 *     arrivals, the leader's with the TMA bytes) and "empty" ones (256: every consumer thread).
 *   warpgroups 1 and 2, the consumers (232 registers), 64 keys each, the transposed products
 *     so that every product keeps keys as its 64 rows (FlashAttention-3's choice):
 *       S^T = K_c Q^T, dP^T = V_c dO^T        wgmma from shared memory, two groups in flight
 *       P^T = exp2(S^T scale log2e - lse2)    after the first group; the mask here
 *       dS^T = P^T (dP^T - delta)             after the second
 *       dS^T (bf16) into shared memory, then (hd 128) the two consumers meet at a named barrier
 *       dQ[:, c HD/2 ..] = dS K[:, c HD/2 ..] wgmma with A = dS^T read transposed and B = K
 *                                             read transposed: each consumer half the columns
 *                                             over all 128 keys, one group, added by TMA (below);
 *                                             at hd 64 (OWN, below) all columns over its own keys
 *       dV += P^T dO, dK += dS^T Q            P^T, dS^T as A from registers (the accumulator
 *                                             layout is wgmma's A layout), a second group
 *     dQ goes out (shared memory, TMA) while dV and dK are computed; the stage is freed after.
 *     hd 64: the next tile's S^T and dP^T are issued with these three products, so that the
 *     tensor cores stay busy through the dQ store (PIPE in the code), and the two consumers
 *     take turns issuing them (below).
 *     dS^T has two buffers: a consumer writes buffer i & 1 only after passing tile i - 1's
 *     barrier, which the other passes only after its dQ product of tile i - 2 is done.
 * Registers (hd 128): dK, dV 64 + 64, S^T, dP^T 32 + 32, P^T / dS^T fragments 16 + 16, dQ 32.
 * Shared memory: K, V 2 x 128 x HD, Q, dO 2 x STAGES x 64 x HD, dS^T 2 x 128 x 64 (bf16), the
 *   dQ staging 64 x HD fp32 (twice that with OWN): hd 128, 2 stages: 192 KB; hd 64, 3 stages,
 *   OWN: 144 KB.
 *
 * dQ: each warp's 16 x HD/2 (OWN: HD) fp32 rows go to shared memory (boxes of 32 columns,
 *   128-byte swizzle) and its lane 0 hands them to the TMA unit as a reduction into dq_acc
 *   (cp.reduce.async.bulk.tensor ... add): the warp goes on while the unit adds. Rows past
 *   the sequence hold exact zeros (their dS^T columns are 0), so adding the whole box is safe.
 *
 * OWN (hd 64): each consumer computes dQ over its own 64 keys for all HD columns and adds it
 *   itself, so there is no meeting between the consumers, for twice the reduction traffic, and
 *   they take turns on the tensor cores as in the forward (one's batch of products beside the
 *   other's dQ store and elementwise work); faster at every hd 64 shape measured but the
 *   196-token one (version 7; the shared-dQ numbers: docs/kernels/attention.md).
 *
 * Block order: a batch of unequal sequences (not dense) takes its blocks from the order that
 *   attn_bwd_prep's last block builds (BwdOrder, attention_tiles.cuh): the (sequence, key tile)
 *   items by descending rounds, the kv heads of an item side by side, so that the longest blocks
 *   start in the first wave (block_tile's chunked order, kept for dense batches and
 *   LOOM_ATTN_BWD_ORDER=0, left a packed batch's last chunk of long blocks alone at the end:
 *   docs/kernels/attention.md, "The backward's blocks longest first"). One dependent load a block.
 *
 * When it runs: bf16, hd 64 / 128 on sm_90a, not deterministic, when the longest sequence has
 *   at least 128 tokens (512 for causal hd 64): bwd_ws_min_seqlen below has the sweep; shorter
 *   sequences keep the mma.sync single pass, whose 64-key blocks waste less on them.
 *
 * Versions: 1 dQ by per-thread red.global.add, 2 dQ through shared memory and TMA reductions,
 *   3 three Q / dO buffers at hd 64, 4 OWN, 5 dQ's product first in one stage, 6 PIPE, 7 masked
 *   and unmasked scores in two loops, OWN with turns, dQ reduced per warp. Fwd+bwd ms on the SPEC
 *   shapes (H100, B8 H12 T1024 D64 | B8 H16 T2048 D128 causal | B4 H9 T2048 D64 causal): the
 *   single pass 0.491 | 2.053 | 0.382, version 7 0.325-0.329 | 1.243-1.245 | 0.251-0.254, cuDNN
 *   0.275 | 1.177 | 0.261. Every version's table and the forms not kept: docs/kernels/attention.md,
 *   "The warp-specialized backward's versions". No spills in either instance (hd 64, hd 128).
 *
 * Joined rows (hd 64; attention_backward_qkv through attn::bwd_qkv_joined): with rope.stride
 *   set, dK and dV go into the rows of a joined q|k|v gradient; ROPE (rope.pos set): dK rotated
 *   by -angle in its store (the pairs (i, i + 32) sit in one thread), each value rounded to bf16
 *   first, as rope_qkv_join reads it: the same values (docs/kernels/attention.md).
 *
 * Test: tests/cuda/test_cuda_kernels_b.cpp ("attention ...": the default sections run it on
 *   the cases of 128 tokens and more, LOOM_ATTN_BWD_WS_MIN=0 on every bf16 hd 64 / 128 case;
 *   "attention_backward_qkv ...": the ROPE form against the two calls).
 */
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "kernels/cuda/rope.cuh"
#include "kernels/cuda/wgmma.cuh"
#include "kernels/cuda/attention_sm90_bwd_timing.cuh"

namespace loom::cuda::attn {
namespace {

template <int HD, int STAGES>
struct BwdSmem {
  static constexpr bool OWN = HD == 64;  // each consumer its own dQ (header)
  static constexpr int BC = 128, BR = 64;
  static_assert(BC == kBwdWsBC && BR == kBwdWsBR, "the block order (attention_tiles.cuh) counts these tiles");
  static constexpr int kv_elems = BC * HD, q_elems = BR * HD, ds_elems = BC * BR;
  static constexpr int dq_floats = BR * HD * (OWN ? 2 : 1);  // 2 consumers x 64 rows x (HD or HD / 2)
  // K, V | Q [STAGES], dO [STAGES] | dS^T [2] | dQ staging (fp32) | lse2 [STAGES][BR],
  // delta [STAGES][BR] | barriers
  static constexpr int bytes = (2 * kv_elems + 2 * STAGES * q_elems + 2 * ds_elems) * 2 + dq_floats * 4 +
                               2 * STAGES * BR * 4 + (1 + 2 * STAGES) * 8 + 1024;
};

template <int HD, int STAGES, bool ROPE>
__global__ void __launch_bounds__(384, 1)
attn_bwd_sm90_ws(bf* __restrict__ dk, bf* __restrict__ dv, float* __restrict__ dq_acc, const bf* __restrict__ dout,
                 const bf* __restrict__ q, const bf* __restrict__ k, const bf* __restrict__ v,
                 const float* __restrict__ lse, const float* __restrict__ delta,
                 const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_do,
                 const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                 const __grid_constant__ CUtensorMap tm_dq, const int32_t* __restrict__ cu_q,
                 const int32_t* __restrict__ cu_k, int dense, int nseq, int H, int KV, int n_kt, int chunk,
                 bool causal, float scale, float scale_log2, const QkvRope rope, const int32_t* __restrict__ order) {
  pdl_entry();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = BwdSmem<HD, STAGES>;
  constexpr bool OWN = L::OWN;
  constexpr int DQN = OWN ? HD : HD / 2;  // dQ columns per consumer
  constexpr int BC = L::BC, BR = L::BR;
  extern __shared__ unsigned char smem_raw[];
  bf* sK = reinterpret_cast<bf*>(smem_align1024(smem_raw));
  bf* sV = sK + L::kv_elems;
  bf* sQ = sV + L::kv_elems;          // [STAGES][BR * HD]
  bf* sO = sQ + STAGES * L::q_elems;  // [STAGES][BR * HD] dout
  bf* sS = sO + STAGES * L::q_elems;  // [2][BC * BR] dS^T, keys x queries
  float* sDQ = reinterpret_cast<float*>(sS + 2 * L::ds_elems);  // [2 consumers][DQN / 32][BR][32]
  float* sL = sDQ + L::dq_floats;                                // [STAGES][BR] lse * log2(e)
  float* sD = sL + STAGES * BR;                                  // [STAGES][BR] delta
  uint64_t* bar_kv = reinterpret_cast<uint64_t*>(sD + STAGES * BR);
  uint64_t* full = bar_kv + 1;      // [STAGES]
  uint64_t* empty = full + STAGES;  // [STAGES]

  // block -> (key tile, kv head, sequence): the planned order (items longest first, the kv heads
  // of an item side by side; BwdOrder, attention_tiles.cuh) or block_tile's, the first (longest,
  // causal) key tile of every pair in a chunk first
  BlockTile bt;
  if (order) {
    const int item = order[blockIdx.x / KV];
    bt = {item % n_kt, (item / n_kt) * KV + int(blockIdx.x % KV)};
  } else {
    bt = block_tile(int(blockIdx.x), n_kt, KV * nseq, chunk);
  }
  const int kt = bt.tile, seq = bt.pair / KV, kvh = bt.pair % KV, group = H / KV;
  const SeqBounds sb = seq_bounds(cu_q, cu_k, seq, nseq, dense);  // (wgmma.cuh)
  const int q0 = sb.q0, Lq = sb.Lq, k0 = sb.k0, Lk = sb.Lk;
  const int ks = kt * BC;
  if (ks >= Lk) return;
  ATTNB_T(const long long c_entry = clock64(); const unsigned long long g_entry = gtimer();
          long long tw_full = 0, tw_turn = 0, n_mask = 0;)
  const int nk = min(BC, Lk - ks), shift = Lk - Lq;
  const int64_t qstride = int64_t(H) * HD, kvstride = int64_t(KV) * HD;
  const int64_t koff = (int64_t(k0) + ks) * kvstride + kvh * HD;
  const QueryTiles qts = bwd_query_tiles(ks, Lq, Lk, causal);  // (attention_tiles.cuh)
  const int t_min = qts.t_min, n_qt = qts.n_qt;
  const int n_it = group * n_qt;  // (query head, query tile) iterations

  if (threadIdx.x == 0) {
    mbar_init(bar_kv, 1);
    for (int s = 0; s < STAGES; s++) {
      mbar_init(&full[s], 128);
      mbar_init(&empty[s], 256);
    }
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;

  if (wg == 0) {  // ---------------------------------------------------------------- producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    const int tid = threadIdx.x;
    const bool leader = tid == 0;
    if (nk == BC) {
      if (leader) {
        mbar_expect_tx(bar_kv, 2 * BC * HD * 2);
#pragma unroll
        for (int half = 0; half < HD / 64; half++) {
          tma_load_3d(sK + half * BC * 64, &tm_k, half * 64, kvh, k0 + ks, bar_kv);
          tma_load_3d(sV + half * BC * 64, &tm_v, half * 64, kvh, k0 + ks, bar_kv);
        }
      }
    } else {  // the sequence's last key tile: rows past it zero-filled
      load_tile_sw128<HD, BC, 128>(sK, k + koff, kvstride, nk);
      load_tile_sw128<HD, BC, 128>(sV, v + koff, kvstride, nk);
      cp_async_commit();
      cp_async_wait<0>();
      fence_smem_async();
      named_sync(15, 128);
      if (leader) mbar_arrive(bar_kv);
    }
    ATTNB_T(long long p_empty = 0, p_partial = 0, p_ld = 0;)
    for (int it = 0; it < n_it; it++) {
      const int st = it % STAGES;
      ATTNB_T(const long long pe0 = clock64();)
      if (it >= STAGES) mbar_wait(&empty[st], ((it / STAGES) - 1) & 1);
      ATTNB_T(const long long pe1 = clock64(); p_empty += pe1 - pe0;)
      const int h = kvh * group + it / n_qt, qt = t_min + (it % n_qt) * BR, nq = min(BR, Lq - qt);
      const int i = tid & 63;
      const int64_t at = (int64_t(q0) + qt + i) * H + h;
      if (tid < 64) sL[st * BR + i] = i < nq ? lse[at] * kLog2e : 0.f;
      else sD[st * BR + i] = i < nq ? delta[at] : 0.f;
      ATTNB_T(const long long pl1 = clock64(); p_ld += pl1 - pe1;)
      if (nq == BR) {
        if (leader) {  // its arrival carries the TMA bytes
          mbar_expect_tx(&full[st], 2 * BR * HD * 2);
#pragma unroll
          for (int half = 0; half < HD / 64; half++) {
            tma_load_3d(sQ + st * L::q_elems + half * BR * 64, &tm_q, half * 64, h, q0 + qt, &full[st]);
            tma_load_3d(sO + st * L::q_elems + half * BR * 64, &tm_do, half * 64, h, q0 + qt, &full[st]);
          }
        } else {
          mbar_arrive(&full[st]);
        }
      } else {  // the last query tile: rows past the sequence zero-filled
        const int64_t qoff = (int64_t(q0) + qt) * qstride + h * HD;
        load_tile_sw128<HD, BR, 128>(sQ + st * L::q_elems, q + qoff, qstride, nq);
        load_tile_sw128<HD, BR, 128>(sO + st * L::q_elems, dout + qoff, qstride, nq);
        cp_async_commit();
        cp_async_wait<0>();
        fence_smem_async();
        mbar_arrive(&full[st]);
        ATTNB_T(p_partial += clock64() - pl1;)
      }
    }
    ATTNB_T(if (tid == 0) {
      atomicAdd(&g_bwd_timing[9], (unsigned long long)p_empty);
      atomicAdd(&g_bwd_timing[10], (unsigned long long)p_partial);
      atomicAdd(&g_bwd_timing[11], (unsigned long long)p_ld);
    })
    return;
  }

  // ------------------------------------------------------------------------------ consumers
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int c = __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0) - 1;  // uniform (see the forward)
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int kr = 64 * c + 16 * warp + g;  // this thread's key rows in the block: kr (c0, c1), kr + 8
  const int klast = ks + 64 * c + 63;     // the consumer's last key in the sequence
  float dka[HD / 8][4] = {}, dva[HD / 8][4] = {};
  const bool elected = lane == 0;  // issues this warp's dQ reductions
  float* sq = sDQ + c * BR * DQN;

  // Descriptors (wgmma.cuh): K-major operands advance 32 bytes per k-step inside a 64-column
  // half and a half's size after four; MN-major ones 16 rows (2048 bytes) per k-step.
  const uint64_t kA = sdesc(sK + c * 64 * 64, 0), vA = sdesc(sV + c * 64 * 64, 0);  // A: rows 64c..
  const uint64_t qB = sdesc(sQ, 0), oB = sdesc(sO, 0);                // B, K-major (S^T, dP^T)
  const uint64_t qT = sdesc(sQ, BR * 128), oT = sdesc(sO, BR * 128);  // B, MN-major (dK, dV)
  const uint64_t dsA = sdesc(sS + (OWN ? c * 64 * 64 : 0), BC * 128);  // A, MN-major (dQ)
  const uint64_t kT = sdesc(sK + (OWN ? c * 64 * 64 : HD == 128 ? c * BC * 64 : c * 32), BC * 128);  // B, MN-major
  constexpr uint64_t kQStage = uint64_t(L::q_elems) * 2 / 16, kDsBuf = uint64_t(L::ds_elems) * 2 / 16;
  constexpr uint64_t kRows16 = 16 * 128 / 16;

  // PIPE (hd 64, where each consumer has its own dQ): tile it + 1's S^T and dP^T are issued
  // with tile it's products, under the same fence, so that the tensor cores compute them while
  // this consumer stores dQ and waits for dV, dK; its elementwise work follows at once. (ptxas
  // serializes every wgmma when a group issued under a later fence is in flight while the code
  // reads an earlier group's accumulators, and when accumulators in flight across the loop's
  // back edge are then written by other instructions: hence one fence for all five products,
  // and the loop rotated so that S^T, dP^T are issued and consumed in the same iteration.)
  // And turns, as in the forward: a consumer issues its batch of products only in its turn
  // (it waits at named barrier 4 + c) and hands the turn over after issuing, so that one's
  // batch runs on the tensor cores while the other stores its dQ and computes its next P^T and
  // dS^T. Each consumer issues n_it + 1 batches; consumer 1 starts by handing the first turn to
  // consumer 0 and skips its last hand-over, so that every wait has its arrival.
  constexpr bool PIPE = OWN;
  auto my_turn = [&] {
    ATTNB_T(const long long w0 = clock64();)
    if constexpr (PIPE) named_sync(4 + c, 256);
    ATTNB_T(tw_turn += clock64() - w0;)
  };
  auto hand_over = [&](bool last) {
    if constexpr (PIPE)
      if (!(last && c == 1)) named_arrive(5 - c, 256);
  };
  if (PIPE && c == 1 && n_it > 0) named_arrive(4, 256);
  // S^T = K_c Q^T and dP^T = V_c dO^T of tile it (two groups; the caller fences)
  auto issue_s_dp = [&](int it, float (&s)[8][4], float (&dp)[8][4]) {
    const int st = it % STAGES;
    const uint64_t qs = qB + st * kQStage, os = oB + st * kQStage;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++)
      wgmma_ss<0>(s, kA + ((kk / 4) * BC * 128 + (kk % 4) * 32) / 16, qs + ((kk / 4) * BR * 128 + (kk % 4) * 32) / 16,
                  kk > 0);
    wg_commit();
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++)
      wgmma_ss<0>(dp, vA + ((kk / 4) * BC * 128 + (kk % 4) * 32) / 16, os + ((kk / 4) * BR * 128 + (kk % 4) * 32) / 16,
                  kk > 0);
    wg_commit();
  };
  // P^T, dS^T of tile it from S^T, dP^T in flight (the last two groups): A fragments pa, da,
  // dS^T into shared memory, both consumers' halves there when it returns
  auto elementwise = [&](int it, float (&s)[8][4], float (&dp)[8][4], uint32_t (&pa)[4][4], uint32_t (&da)[4][4]) {
    const int st = it % STAGES, buf = it & 1;
    const int qt = t_min + (it % n_qt) * BR, nq = min(BR, Lq - qt);
    const float* cL = sL + st * BR;
    const float* cD = sD + st * BR;
    const bool need_mask = klast >= Lk || nq < BR || (causal && klast > qt + shift);
    ATTNB_T(n_mask += need_mask;)
    wg_wait<1>();
    fence_regs(s);
    // two loops, not one with the test inside: the compiler turned that one into selects
    // evaluated for every score (98 of 580 instructions per tile on the unmasked path)
    if (need_mask) {
#pragma unroll
      for (int n = 0; n < 8; n++) {  // columns 8n + 2t, + 1: queries of the tile
        const float2 l2 = *reinterpret_cast<const float2*>(cL + 8 * n + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int key = ks + kr + 8 * (e >> 1), col = 8 * n + 2 * t + (e & 1);
          const float p = exp2_ftz(fmaf(s[n][e], scale_log2, -((e & 1) ? l2.y : l2.x)));
          s[n][e] = key >= Lk || col >= nq || (causal && key > qt + col + shift) ? 0.f : p;
        }
      }
    } else {
#pragma unroll
      for (int n = 0; n < 8; n++) {
        const float2 l2 = *reinterpret_cast<const float2*>(cL + 8 * n + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; e++) s[n][e] = exp2_ftz(fmaf(s[n][e], scale_log2, -((e & 1) ? l2.y : l2.x)));
      }
    }
    wg_wait<0>();
    fence_regs(dp);
#pragma unroll
    for (int n = 0; n < 8; n++) {
      const float2 d2 = *reinterpret_cast<const float2*>(cD + 8 * n + 2 * t);
#pragma unroll
      for (int e = 0; e < 4; e++) dp[n][e] = s[n][e] * (dp[n][e] - ((e & 1) ? d2.y : d2.x));
    }
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
      c_to_a(pa[kk], s, kk);
      c_to_a(da[kk], dp, kk);
    }
    // dS^T into sS[buf], row = key, 16-byte chunk n = queries 8n..8n+7: da[kk] holds the pairs
    // (row kr, n = 2kk), (kr + 8, 2kk), (kr, 2kk + 1), (kr + 8, 2kk + 1)
    bf* ds = sS + buf * L::ds_elems;
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
#pragma unroll
      for (int j = 0; j < 4; j++)
        *reinterpret_cast<uint32_t*>(ds + sw128<BC>(kr + 8 * (j & 1), 2 * kk + (j >> 1)) + 2 * t) = da[kk][j];
    fence_smem_async();  // these generic-proxy writes, before the other consumer's wgmma reads them
    if (!OWN) named_sync(1, 256);  // both consumers' halves of dS^T are in sS[buf]
  };
  // dQ, dV, dK of tile it under one fence (with NEXT, tile it + 1's S^T, dP^T too, and its
  // elementwise work after this tile's dQ store)
  auto products = [&](int it, uint32_t (&pa)[4][4], uint32_t (&da)[4][4], auto next_c) {
    constexpr bool NEXT = decltype(next_c)::value;
    const int st = it % STAGES, buf = it & 1;
    const int h = kvh * group + it / n_qt, qt = t_min + (it % n_qt) * BR;
    ATTNB_T(const long long wf0 = clock64();)
    if constexpr (NEXT) mbar_wait(&full[(it + 1) % STAGES], ((it + 1) / STAGES) & 1);
    ATTNB_T(tw_full += clock64() - wf0;)
    float dq[DQN / 8][4];  // dQ rows = the tile's queries, columns c HD/2 .. + HD/2 (OWN: all, my keys)
    float s[8][4], dp[8][4];
    // dQ first, then dV and dK: dQ goes out while they run
    my_turn();
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < (OWN ? 4 : BC / 16); kk++)
      wgmma_ss<1, 1>(dq, dsA + buf * kDsBuf + kk * kRows16, kT + kk * kRows16, kk > 0);
    wg_commit();
#pragma unroll
    for (int kk = 0; kk < 4; kk++) wgmma_rs<1>(dva, pa[kk], oT + st * kQStage + kk * kRows16);
#pragma unroll
    for (int kk = 0; kk < 4; kk++) wgmma_rs<1>(dka, da[kk], qT + st * kQStage + kk * kRows16);
    wg_commit();
    if constexpr (NEXT) issue_s_dp(it + 1, s, dp);
    hand_over(!NEXT);
    wg_wait<NEXT ? 3 : 1>();
    fence_regs(dq);
    // dQ through shared memory: boxes of 32 columns x 16 rows (each warp its own rows), 128-byte
    // swizzle (16-byte chunk j of row r at chunk j ^ (r & 7)), added to dq_acc by the TMA unit
    // while the warp goes on; its lane 0 waits until its previous reduction has read them.
    // Per warp, not per warpgroup: the four warps' dQ products finish at different times, and
    // a warpgroup barrier here made every warp wait for the last one (ncu, B8 H12 T1024 hd 64:
    // 8% of the consumers' stall samples at that barrier, 5% at the one after the stores).
    if (elected) bulk_wait_read<0>();
    __syncwarp();
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const int row = 16 * warp + g + 8 * r;
#pragma unroll
      for (int n = 0; n < DQN / 8; n++) {
        const int j = 2 * (n % 4) + (t >> 1);
        *reinterpret_cast<float2*>(sq + (n / 4) * BR * 32 + row * 32 + ((j ^ (row & 7)) * 4) + 2 * (t & 1)) =
            make_float2(dq[n][2 * r], dq[n][2 * r + 1]);
      }
    }
    fence_smem_async();
    __syncwarp();
    if (elected) {
#pragma unroll
      for (int b = 0; b < DQN / 32; b++)
        tma_reduce_add_3d(&tm_dq, (OWN ? 0 : c * (HD / 2)) + 32 * b, h, q0 + qt + 16 * warp,
                          sq + b * BR * 32 + 16 * warp * 32);
      bulk_commit();
    }
    wg_wait<NEXT ? 2 : 0>();  // dV, dK done: Q and dO of this stage are free
    fence_regs(dva);
    fence_regs(dka);
    fence_regs(pa);
    fence_regs(da);
    mbar_arrive(&empty[st]);
    if constexpr (NEXT) elementwise(it + 1, s, dp, pa, da);
  };

  mbar_wait(bar_kv, 0);
  ATTNB_T(const long long c_kv = clock64(); long long c_first = c_kv;)
  fence_regs(dka);  // their zeros set here, not sunk into the loop past a wgmma in flight
  fence_regs(dva);
  if constexpr (PIPE) {
    if (n_it > 0) {
      uint32_t pa[4][4], da[4][4];
      {
        float s[8][4], dp[8][4];
        mbar_wait(&full[0], 0);
        ATTNB_T(c_first = clock64();)
        my_turn();
        wg_fence();
        issue_s_dp(0, s, dp);
        hand_over(false);
        elementwise(0, s, dp, pa, da);
      }
      for (int it = 0; it + 1 < n_it; it++) products(it, pa, da, std::true_type{});
      products(n_it - 1, pa, da, std::false_type{});
    }
  } else {
    for (int it = 0; it < n_it; it++) {
      float s[8][4], dp[8][4];
      uint32_t pa[4][4], da[4][4];
      mbar_wait(&full[it % STAGES], (it / STAGES) & 1);
      wg_fence();
      issue_s_dp(it, s, dp);
      elementwise(it, s, dp, pa, da);
      products(it, pa, da, std::false_type{});
    }
  }

  ATTNB_T(const long long c_loop = clock64();)
  if (elected) bulk_wait<0>();  // the last reductions are done before the block ends
  // dK (scaled) and dV: this thread's rows kr, kr + 8 that lie in the sequence; into the joined
  // rows when rope.stride is set. ROPE (hd 64): dK rounded to bf16 first (what the store alone would keep) and
  // its pairs (i, i + 32), columns 8n + 2t (+ 1) and 8(n + 4) + 2t (+ 1) of this thread, rotated
  // by -angle with rotate_pair: bit for bit rope_qkv_join of the dK this kernel stores without it.
  const int64_t ostride = rope.stride ? rope.stride : kvstride;
  const int64_t ooff = (int64_t(k0) + ks) * ostride + kvh * HD;
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int key = kr + 8 * r;
    if (key < nk) {
      bf* pk = dk + ooff + int64_t(key) * ostride + 2 * t;
      bf* pv = dv + ooff + int64_t(key) * ostride + 2 * t;
      if constexpr (ROPE) {
        static_assert(!ROPE || HD == 64, "the joined q|k|v gradient is for head dim 64");
        const int32_t p = rope.pos[k0 + ks + key];
        float y[8][2];
#pragma unroll
        for (int n = 0; n < 4; n++)
#pragma unroll
          for (int e = 0; e < 2; e++) {
            const float2 a = rope_lookup(rope.table, rope.table_rows, p, 8 * n + 2 * t + e, rope.log_theta);
            const float x0 = __bfloat162float(__float2bfloat16_rn(dka[n][2 * r + e] * scale));
            const float x1 = __bfloat162float(__float2bfloat16_rn(dka[n + 4][2 * r + e] * scale));
            rotate_pair(y[n][e], y[n + 4][e], x0, x1, a.x, -a.y);
          }
#pragma unroll
        for (int n = 0; n < 8; n++) *reinterpret_cast<uint32_t*>(pk + 8 * n) = pack_bf16(y[n][0], y[n][1]);
      } else {
#pragma unroll
        for (int n = 0; n < HD / 8; n++)
          *reinterpret_cast<uint32_t*>(pk + 8 * n) = pack_bf16(dka[n][2 * r] * scale, dka[n][2 * r + 1] * scale);
      }
#pragma unroll
      for (int n = 0; n < HD / 8; n++)
        *reinterpret_cast<uint32_t*>(pv + 8 * n) = pack_bf16(dva[n][2 * r], dva[n][2 * r + 1]);
    }
  }
  ATTNB_T(if (threadIdx.x == 128) {
    const long long c_end = clock64();
    const unsigned long long g_end = gtimer();
    atomicAdd(&g_bwd_timing[0], 1ull);
    atomicAdd(&g_bwd_timing[1], (unsigned long long)n_it);
    atomicAdd(&g_bwd_timing[2], (unsigned long long)n_mask);
    atomicAdd(&g_bwd_timing[3], (unsigned long long)(c_kv - c_entry));
    atomicAdd(&g_bwd_timing[4], (unsigned long long)(c_first - c_kv));
    atomicAdd(&g_bwd_timing[5], (unsigned long long)(c_loop - c_first));
    atomicAdd(&g_bwd_timing[6], (unsigned long long)(c_end - c_loop));
    atomicAdd(&g_bwd_timing[7], (unsigned long long)tw_full);
    atomicAdd(&g_bwd_timing[8], (unsigned long long)tw_turn);
    atomicAdd(&g_bwd_timing[12], g_end - g_entry);
    atomicMin(&g_bwd_timing[13], g_entry);
    atomicMax(&g_bwd_timing[14], g_end);
  })
#endif
}

template <int HD, int STAGES, bool ROPE>
void launch_bwd(bf* dk, bf* dv, float* dq_acc, const bf* dout, const bf* q, const bf* k, const bf* v,
                const float* lse, const float* delta, const int32_t* cu_q, const int32_t* cu_k, int nseq,
                int max_seqlen, int64_t Nq, int64_t Nk, int H, int KV, bool causal, float scale, const QkvRope& rope,
                const int32_t* order, cudaStream_t s) {
  constexpr int smem = BwdSmem<HD, STAGES>::bytes, BC = BwdSmem<HD, STAGES>::BC;
  static const bool once = [] {
    CUDA_CHECK(cudaFuncSetAttribute(attn_bwd_sm90_ws<HD, STAGES, ROPE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    smem));
    return true;
  }();
  (void)once;
  const CUtensorMap tq = make_map(q, Nq, H, HD, 64), tdo = make_map(dout, Nq, H, HD, 64);
  const CUtensorMap tk = make_map(k, Nk, KV, HD, BC), tv = make_map(v, Nk, KV, HD, BC);
  const CUtensorMap tdq = make_map_3d(dq_acc, true, Nq, H, HD, 32, 16);  // a warp's 16 rows
  // chunks of (kv head, sequence) pairs whose Q, dO (bf16) and dq_acc (fp32) rows share L2
  const int n_kt = ceil_div(max_seqlen, BC), pairs = KV * nseq;
  const int chunk = chunk_pairs(pairs, double(H / KV) * std::max(max_seqlen, 1) * HD * 8.0);
  bwd_timing_reset(s);
  launch_kernel(attn_bwd_sm90_ws<HD, STAGES, ROPE>, pairs * n_kt, 384, smem, s, dk, dv, dq_acc, dout, q, k, v, lse,
                delta, tq, tdo, tk, tv, tdq, cu_q, cu_k, dense_seqlen(cu_q, cu_k, nseq, max_seqlen, Nq, Nk), nseq, H,
                KV, n_kt, chunk, causal, scale, scale * kLog2e, rope, order);
  LAUNCH_CHECK();
  bwd_timing_report(HD, pairs * n_kt, s);
}

}  // namespace

// The shortest longest-sequence (max_seqlen) for which this backward runs instead of the
// mma.sync single pass. Swept on an H100 (2026-11-24, one call, fwd+bwd ms this / mma.sync):
// hd 64 bidirectional B128 H12 T49 0.158 / 0.108, B64 H12 T64 0.089 / 0.068, T128 0.134 /
// 0.146, B128 H12 T196 0.580 / 0.635, B32 H12 T256 0.166 / 0.189, B8 H12 T1024 0.357 / 0.492;
// hd 64 causal B32 H9 T256 0.133 / 0.128, B16 H9 T512 0.151 / 0.161, B4 H9 T2048 0.295 / 0.383;
// hd 128 causal B32 H16 T128 0.172 / 0.177, T256 0.334 / 0.364. A 128-key block over a
// sequence of 49 or 64 keys leaves most of its second consumer idle.
static int bwd_ws_min_seqlen(int hd, bool causal) { return hd == 128 ? 128 : causal ? 512 : 128; }

bool bwd_sm90_ws_available(int hd, bool causal, int max_seqlen, int64_t Nq, int64_t Nk, const void* q, const void* k,
                           const void* v, const void* dout, const void* dq_acc) {
  if (!fwd_sm90_available(hd) || Nq <= 0 || Nk <= 0) return false;
  const char* m = std::getenv("LOOM_ATTN_BWD_WS_MIN");  // read at every call: tests switch it
  const int ws_min = m ? std::atoi(m) : bwd_ws_min_seqlen(hd, causal);
  if (max_seqlen < ws_min) return false;
  const uintptr_t a = reinterpret_cast<uintptr_t>(q) | reinterpret_cast<uintptr_t>(k) |
                      reinterpret_cast<uintptr_t>(v) | reinterpret_cast<uintptr_t>(dout) |
                      reinterpret_cast<uintptr_t>(dq_acc);
  return (a & 15) == 0;  // TMA (loads and the dQ reduction): 16-byte aligned bases
}

BwdOrder bwd_sm90_order(const int32_t* cu_q, const int32_t* cu_k, int nseq, int max_seqlen, int64_t Nq, int64_t Nk,
                        bool causal) {
  BwdOrder o;
  const char* e = std::getenv("LOOM_ATTN_BWD_ORDER");  // read at every call: tests switch it
  if (e && e[0] == '0' && e[1] == 0) return o;
  const int n_kt = ceil_div(max_seqlen, kBwdWsBC), nbuckets = ceil_div(max_seqlen, kBwdWsBR) + 1;
  if (nseq <= 1 || max_seqlen <= 0 || dense_seqlen(cu_q, cu_k, nseq, max_seqlen, Nq, Nk) > 0 ||
      nbuckets > kBwdOrderMaxBuckets || int64_t(nseq) * n_kt > kBwdOrderMaxItems)
    return o;
  o.order = static_cast<int32_t*>(device_malloc(sizeof(int32_t) * size_t(nseq) * n_kt));
  o.cu_q = cu_q;
  o.cu_k = cu_k;
  o.nseq = nseq;
  o.n_kt = n_kt;
  o.nbuckets = nbuckets;
  o.causal = causal;
  return o;
}

void bwd_sm90_ws(bf* dk, bf* dv, float* dq_acc, const bf* dout, const bf* q, const bf* k, const bf* v,
                 const float* lse, const float* delta, const int32_t* cu_q, const int32_t* cu_k, int nseq,
                 int max_seqlen, int64_t Nq, int64_t Nk, int H, int KV, int hd, bool causal, float scale,
                 cudaStream_t s, const QkvRope& rope, const int32_t* order) {
  // hd 128: 2 buffers of Q / dO (160 KB of shared memory with the dQ staging: 192 KB);
  // hd 64: 3 (0.3565 against 0.3612 ms fwd+bwd at B8 H12 T1024, H100)
  if (rope.pos && hd != 64) throw std::runtime_error("bwd_sm90_ws: the joined q|k|v gradient needs head dim 64");
  if (hd == 128)
    launch_bwd<128, 2, false>(dk, dv, dq_acc, dout, q, k, v, lse, delta, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV,
                              causal, scale, rope, order, s);
  else if (rope.pos)
    launch_bwd<64, 3, true>(dk, dv, dq_acc, dout, q, k, v, lse, delta, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV,
                            causal, scale, rope, order, s);
  else
    launch_bwd<64, 3, false>(dk, dv, dq_acc, dout, q, k, v, lse, delta, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV,
                             causal, scale, rope, order, s);
}

}  // namespace loom::cuda::attn
