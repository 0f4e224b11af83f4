/*
 * attention_fwd.cu: v2_mma_tiles forward, FlashAttention-2 on mma.sync (bf16 in, fp32
 * accumulate; hd 16/32/64/128; any sm_80+). The math, shapes and `=` outputs are in
 * attention.cu's header; the tile primitives (cp.async, swizzle, ldmatrix, mma, the C -> A
 * repack) in attention_tiles.cuh. Read attention_v1.cu first: this is the same loop over keys,
 * done 16 x 64 at a time by tensor cores.
 *
 * Block: NW = 4 warps x MT m-tiles x 16 rows = BR query rows of one head and one sequence;
 *   grid (ceil(max_seqlen / BR), H, nseq), the longest query tiles (causal) scheduled first.
 *   K / V tiles of BC = 64 keys are staged in XOR-swizzled shared memory by cp.async,
 *   double-buffered so the next tile loads while this one is computed; ldmatrix feeds
 *   mma.sync m16n8k16; the score tile never leaves registers (the C fragment of S is re-packed
 *   as the A fragment of P for P V). Causal: tiles above the diagonal are skipped, the mask is
 *   applied only on tiles that cross it or the sequence end.
 *   hd 64/128: MT = 2 (128 queries per block); hd 16/32: MT = 1 (64). hd 128 re-reads the Q
 *   fragments from shared memory at every k-step (QREG = false): O and S fill the registers.
 * Shared memory: (BR + 4 BC) hd bf16 (Q, two K and two V buffers): 48 KB at hd 64, 96 KB at 128.
 * Bytes / FLOPs: see attention.cu (compute-bound: 4 H T^2 hd FLOP per sequence).
 * Versions: v2 as above: forward 213 | 226 | 145 TFLOP/s on the SPEC shapes (H200, bench/
 *   bench_attention.cpp; on Hopper the sm90 forward of attention_sm90.cu runs instead, 246 |
 *   320 | 185). Lost: 1 m-tile per warp, 154 | 172 | 120 (each K / V fragment read from shared
 *   memory feeds one mma: 512 B of shared memory per 2 mma caps mma.sync at ~half its rate);
 *   hd 128 with Q in registers and 32-key tiles, 191 at the hd 128 shape (72-byte spill).
 *   History: docs/kernels/attention.md.
 * Test: tests/cuda/test_cuda_kernels_b.cpp ("attention forward/backward bf16 ...", LOOM_ATTN_SM90=0 for
 *   this kernel on Hopper).
 */
#include "kernels/cuda/attention_tiles.cuh"

namespace loom::cuda {
namespace {

using namespace attn;

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
  pdl_entry();
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

// =========================================================================== launcher
template <int HD>
void fwd_v2_hd(bf* out, float* lse, const bf* q, const bf* k, const bf* v, const int32_t* cu_q,
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
  launch_kernel(attn_fwd_v2<HD, NW, MT, BC, QREG>, grid, NW * 32, smem, s, out, lse, q, k, v, cu_q, cu_k, H, KV, causal,
                scale_log2);
  LAUNCH_CHECK();
}

}  // namespace

namespace attn {

void fwd_v2(bf* out, float* lse, const bf* q, const bf* k, const bf* v, const int32_t* cu_q,
            const int32_t* cu_k, int nseq, int max_seqlen, int H, int KV, int hd, bool causal,
            float scale_log2, cudaStream_t s) {
  switch (hd) {
    case 16: fwd_v2_hd<16>(out, lse, q, k, v, cu_q, cu_k, nseq, max_seqlen, H, KV, causal, scale_log2, s); break;
    case 32: fwd_v2_hd<32>(out, lse, q, k, v, cu_q, cu_k, nseq, max_seqlen, H, KV, causal, scale_log2, s); break;
    case 64: fwd_v2_hd<64>(out, lse, q, k, v, cu_q, cu_k, nseq, max_seqlen, H, KV, causal, scale_log2, s); break;
    default: fwd_v2_hd<128>(out, lse, q, k, v, cu_q, cu_k, nseq, max_seqlen, H, KV, causal, scale_log2, s); break;
  }
}

}  // namespace attn
}  // namespace loom::cuda
