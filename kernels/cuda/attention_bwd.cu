/*
 * attention_bwd.cu: v2_mma_tiles backward in two passes, the deterministic schedule (bf16,
 * hd 16/32/64/128). Every output row is written by exactly one block: bitwise reproducible.
 * The math and shapes are in attention.cu's header; read attention_fwd.cu first.
 *
 *   pass 1, dq (attn_bwd_dq_v2): a block owns 16 NW MT query rows of one head and walks the
 *     key tiles that it sees. Per tile: S = Q K^T, P = exp2(S - lse), dP = dO V^T,
 *     dS = P (dP - delta), dQ += dS K; dq = scale dQ at the end (=).
 *   pass 2, dk and dv (attn_bwd_dkdv_v2): a block owns 16 NW key rows of one kv head (one warp
 *     per 16 keys, its dK and dV rows in its registers) and walks the group's query heads and
 *     the query tiles that see its keys, double-buffering Q, dO, lse and delta. Per tile, the
 *     transposed products: S^T = K Q^T, P^T, dV += P^T dO, dP^T = V dO^T,
 *     dS^T = P^T (dP^T - delta), dK += dS^T Q; dk = scale dK, dv = dV at the end (=).
 *     The per-tile pieces (load_q_dout_tile, dkdv_p_ds, dkdv_accumulate) are shared with the
 *     single pass (attention_tiles.cuh).
 *   delta (attn_delta) runs before, the zeroing of rows outside every sequence after
 *   (attention.cu).
 * Launch: dq: 4 warps x 2 m-tiles = 128 queries x 32-key tiles at hd 64 (Q, dO, S, dP, dQ in
 *   registers), 64 queries x 64 keys (32 at hd 128) elsewhere; grid (ceil(max_seqlen / BR), H,
 *   nseq). dk/dv: 128 keys per block (8 warps; 64 keys, 4 warps at hd 128), query tiles of 64
 *   (32 at hd 128); grid (ceil(max_seqlen / BC), KV, nseq).
 * FLOPs: 7 tile GEMMs per (query tile, key tile) pair: S and dP are computed in both passes,
 *   3.5x the forward. That is its price against the single pass (5 GEMMs, fp32 atomics).
 * Versions: fwd+bwd 0.573 | 2.632 | 0.552 ms on the SPEC shapes (H200, bench/bench_attention.cpp,
 *   "attention_fwd_bwd_deterministic"); the single pass: 0.494 | 2.124 | 0.398. Lost: dk/dv
 *   with 2 m-tiles per warp at hd 64 (4 warps x 32 keys, 255 registers): +3% on the full
 *   shape, -8% causal (fewer, fatter warps finish the diagonal tiles later). History:
 *   docs/kernels/attention.md.
 * Test: tests/cuda/test_cuda_kernels_b.cpp ("attention forward/backward bf16 ...", deterministic runs).
 */
#include "kernels/cuda/attention_tiles.cuh"

namespace loom::cuda {
namespace {

using namespace attn;

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
  pdl_entry();
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
  pdl_entry();
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

// =========================================================================== launcher
template <int HD>
void bwd_v2_hd(bf* dq, bf* dk, bf* dv, const bf* dout, const bf* q, const bf* k, const bf* v,
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
    launch_kernel(attn_bwd_dq_v2<HD, NW, MT, BC>, grid, NW * 32, smem, s, dq, dout, q, k, v, lse, delta, cu_q, cu_k, H,
                  KV, causal, scale, scale_log2);
    LAUNCH_CHECK();
  }
  {  // dk, dv: 128 keys per block (64 at hd 128), query tiles of 64 (32 at hd 128)
    constexpr int NW = HD <= 64 ? 8 : 4, BC = 16 * NW, BRQ = HD <= 64 ? 64 : 32;
    const int smem = (2 * BC + 4 * BRQ) * HD * int(sizeof(bf)) + 4 * BRQ * int(sizeof(float));
    static bool once = (set_smem(attn_bwd_dkdv_v2<HD, NW, BRQ>, smem), true);
    (void)once;
    dim3 grid(ceil_div(max_seqlen, BC), KV, nseq);
    launch_kernel(attn_bwd_dkdv_v2<HD, NW, BRQ>, grid, NW * 32, smem, s, dk, dv, dout, q, k, v, lse, delta, cu_q, cu_k,
                  H, KV, causal, scale, scale_log2);
    LAUNCH_CHECK();
  }
}

}  // namespace

namespace attn {

void bwd_v2(bf* dq, bf* dk, bf* dv, const bf* dout, const bf* q, const bf* k, const bf* v,
            const float* lse, const float* delta, const int32_t* cu_q, const int32_t* cu_k, int nseq,
            int max_seqlen, int H, int KV, int hd, bool causal, float scale, cudaStream_t s) {
  switch (hd) {
    case 16: bwd_v2_hd<16>(dq, dk, dv, dout, q, k, v, lse, delta, cu_q, cu_k, nseq, max_seqlen, H, KV, causal, scale, s); break;
    case 32: bwd_v2_hd<32>(dq, dk, dv, dout, q, k, v, lse, delta, cu_q, cu_k, nseq, max_seqlen, H, KV, causal, scale, s); break;
    case 64: bwd_v2_hd<64>(dq, dk, dv, dout, q, k, v, lse, delta, cu_q, cu_k, nseq, max_seqlen, H, KV, causal, scale, s); break;
    default: bwd_v2_hd<128>(dq, dk, dv, dout, q, k, v, lse, delta, cu_q, cu_k, nseq, max_seqlen, H, KV, causal, scale, s); break;
  }
}

}  // namespace attn
}  // namespace loom::cuda
