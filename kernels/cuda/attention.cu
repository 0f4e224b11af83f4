/*
 * attention.cu: flash attention over packed variable-length sequences (varlen), grouped-query
 * heads, optional bottom-right aligned causal mask; the entry points, the choice of kernel,
 * and the small launches around the kernels. Never materializes a T x T matrix.
 *
 * Read the attention kernels in this order (each file opens with its own notes):
 *   1. kernels/cpu/attention.cpp      the specification: 64-row tiles, online softmax, in loops
 *   2. attention_v1.cu                v1_warp_per_row: the reference ported line by line
 *   3. attention_tiles.cuh            tile primitives: cp.async, swizzle, ldmatrix, mma.sync
 *   4. attention_fwd.cu               v2_mma_tiles forward (FlashAttention-2 on mma.sync)
 *   5. attention_bwd.cu               v2 backward, two passes (dq; dk, dv): deterministic
 *   6. attention_bwd_single.cu        v2 backward, one pass with fp32-atomic dq: the default
 *   7. attention_sm90.cu              the Hopper forward: the same tiles on wgmma (lock-step)
 *      wgmma.cuh                      its primitives: descriptors, wgmma, mbarriers, TMA
 *   8. attention_sm90_ws.cu           the Hopper forward warp-specialized: TMA producer,
 *                                     consumers taking turns on the tensor cores (the default)
 *   9. attention_sm90_bwd.cu          the Hopper backward warp-specialized: TMA producer, two
 *                                     consumers of 64 keys, dQ added by TMA reductions
 *  10. attention_cudnn.cu             a second backend: cuDNN's fused attention, chosen per shape
 *      attention_cudnn_graph.cu       its SDPA graph, built with cuDNN's backend descriptor API
 * How each version came to be (dated measurements, commits): docs/kernels/attention.md.
 *
 * Shape legend: Nq / Nk query / key rows (sequences packed back to back), H query heads,
 * KV key/value heads (head h reads kv head h / (H/KV)), hd head dim, Lq / Lk the query / key
 * count of one sequence, shift = Lk - Lq (causal: query t sees keys j <= t + shift).
 *   q, out, dout, dq [Nq, H, hd] T     k, v, dk, dv [Nk, KV, hd] T     lse, delta [Nq, H] fp32
 *   cu_q, cu_k [nseq + 1] int32 on the device
 *
 * Forward (per sequence, head, query t; s_j = scale q_t . k_j over the visible keys):
 *   lse_t = log sum_j exp(s_j)       (saved for the backward; +inf for a row that sees nothing)
 *   out_t = sum_j exp(s_j - lse_t) v_j                                          (=)
 *   computed tile by tile with the online softmax: running max m and sum l per row; each new
 *   tile rescales the accumulator by exp(m_old - m_new). Scores live in the log2 domain
 *   (scale * log2(e) folded into one multiply) so every exponential is one exp2.
 * Backward (p recomputed from lse; out and lse are all the forward saves):
 *   delta_t = dout_t . out_t                           (workspace, [Nq, H] after dq_acc)
 *   dp_j = dout_t . v_j,  ds_j = p_j (dp_j - delta_t)
 *   dq_t = scale sum_j ds_j k_j                        (=)
 *   dk_j = scale sum_{h in group, t} ds_j q_t          (=)
 *   dv_j = sum_{h in group, t} p_j dout_t              (=)
 * Rows outside every sequence: out = dq = 0, lse = +inf; key rows outside: dk = dv = 0.
 * Workspace (backward): dq_acc [Nq, H, hd] fp32, then delta [Nq, H] fp32.
 *
 * Which kernel runs (forward_loom / backward_loom below):
 *   forward   bf16, hd 64/128 on sm_90a       attention_sm90_ws.cu (wgmma, warp-specialized) when
 *                                             the longest sequence has >= 768 (hd 64) / 256 (hd 128) tokens, else
 *                                             attention_sm90.cu (LOOM_ATTN_SM90=1: always the
 *                                             latter, =0: v2; LOOM_ATTN_WS_MIN: the threshold)
 *             bf16, hd 16/32/64/128           attention_fwd.cu  (v2, any sm_80+)
 *             f32, or another hd              attention_v1.cu
 *   backward  bf16, hd 64/128 on sm_90a       attention_sm90_bwd.cu (wgmma, warp-specialized) when
 *                                             the longest sequence has >= 128 tokens (512 for causal
 *                                             hd 64; LOOM_ATTN_BWD_WS_MIN: the threshold), else
 *             bf16, hd 64/128                 attention_bwd_single.cu; both unless
 *                                             set_deterministic_attention(true) / LOOM_DETERMINISTIC=1
 *             bf16, hd 16/32/64/128           attention_bwd.cu (two passes, bitwise reproducible)
 *             f32, or another hd              attention_v1.cu
 *   attention_forward / attention_backward first ask attention_cudnn.cu (train.attention =
 *   cudnn, or auto's choice for the shape) and run our kernels otherwise. A dense batch (every
 *   sequence max_seqlen long: a ViT's images) of more than 8 sequences, not a multiple of 8,
 *   goes there as two calls when cuDNN may take it, the largest multiple of 8 and the rest
 *   (split_dense below): cuDNN plans a dense batch for its exact sequence count, and a VLM
 *   tower's image count changes from step to step.
 *
 * Versions (H200, bf16, bench/bench_attention.cpp, medians of 20; the three SPEC shapes
 * B8 H12 T1024 D64 | B8 H16 T2048 D128 causal | B4 H9 T2048 D64 causal):
 *   v1_warp_per_row   one warp per query row, one key at a time: no reuse between rows.
 *                     The readable port and the fallback for f32 and odd head dims; not timed.
 *   v2_mma_tiles      FlashAttention-2 tiles on mma.sync: forward 213 | 226 | 145 TFLOP/s.
 *   sm90 forward      wgmma from shared memory: forward 246 | 320 | 185 TFLOP/s
 *                     (PyTorch 2.11 SDPA FLASH_ATTENTION, same run: 234 | 254 | 138).
 *   sm90 warp-specialized forward (H100, 2026-11-23): 306 | 462 | 253 TFLOP/s, 0.084 |
 *                     0.298 | 0.076 ms, against the lock-step kernel's 0.100 | 0.427 | 0.104
 *                     and cuDNN's 0.065 | 0.262 | 0.067 in the same call (0.78 | 0.88 | 0.88x);
 *                     its header has the steps and what each gained.
 *   backward, single pass: fwd+bwd 0.494 | 2.124 | 0.398 ms
 *                     (FLASH_ATTENTION, same run: 0.512 | 2.243 | 0.516);
 *   sm90 warp-specialized backward (H100, 2026-11-24): fwd+bwd 0.361 | 1.377 | 0.294 ms against
 *                     the single pass's 0.491 | 2.053 | 0.382, cuDNN's 0.275 | 1.177 | 0.261
 *                     (0.76 | 0.85 | 0.89x) and PyTorch CUDNN_ATTENTION's 0.546 | 1.449 | 0.671;
 *   backward, two passes (deterministic): fwd+bwd 0.573 | 2.632 | 0.552 ms.
 * Measured alternatives that lost (fwd+bwd ms or forward TFLOP/s on the same shapes; details
 * and dates in docs/kernels/attention.md):
 *   forward, 1 m-tile per warp: 154 | 172 | 120 TFLOP/s against 212 | 191 | 145 (2 m-tiles).
 *   hd 128 forward with Q held in registers (32-key tiles, 72-byte spill): 191 against 226.
 *   dk/dv with 2 m-tiles per warp at hd 64: +3% full, but -8% causal fwd+bwd.
 *   single pass, hd 64, 8 warps x 16 keys: 0.522-0.532 | - | 0.428 against 0.512-0.515 | - | 0.421.
 *   single pass, hd 128, query tiles of 32: 2.45 (4 warps), 2.52 (8 warps) against 2.20.
 *   single pass, blocks pair-major: 0.530 | 2.255 | 0.487; key-tile-major over all pairs:
 *     0.550 | 2.366 | 0.429 (atomics miss in L2); kept (chunks of ~32 MB) 0.51 | 2.15 | 0.42.
 *   single pass, red.v4 after a lane shuffle: 2.26 against 2.22 at hd 128.
 *   single pass on wgmma at hd 64: 0.571 | - | 0.514 (1 warpgroup) against 0.496 | - | 0.401.
 *   delta, zeroing and dq conversion as 6 launches instead of 3: 0.514 | 2.150 | 0.418.
 *   whole (sequence, head) per block for bidirectional hd 64 up to 224 tokens (mma.sync, keys
 *     padded to 16, plain softmax; backward without atomics, S and dP recomputed for dq): slower
 *     than the 64-tile kernels except the 49-token forward (H100, 2026-11-24, ms fwd | fwd+bwd:
 *     B128 H12 T196 0.133 | 0.671 against 0.130 | 0.634; T49 0.025 | 0.115 against 0.034 | 0.107);
 *     not kept (docs/kernels/attention.md).
 *
 * Napkin math: forward 4 B H T^2 hd FLOP (x 0.5 causal), reads Q, K, V once per query tile
 *   (K/V re-read from L2 by every query tile of a head) and writes out + lse. B8 H16 T2048
 *   hd128 causal: 137 GFLOP -> ~0.2 ms at 650 TFLOP/s of mma.sync; bytes 4 x 67 MB = 0.27 GB
 *   -> 0.08 ms. Compute-bound: the gap to the mma peak is the figure of merit.
 *   Backward: 2.5x the forward FLOP in the single pass (5 tile GEMMs against 2), 3.5x in the
 *   two passes (7: S and dP are recomputed for dq).
 *
 * Reference: kernels/cpu/attention.cpp. Tests: tests/cuda/test_cuda_kernels_b.cpp
 *   ("attention ..."), tests/cuda/test_cuda_attention_cudnn.cpp, tests/test_ops_gradcheck.cpp.
 *   Bench: bench/bench_attention.cpp. On a CUDA machine:
 *   bash tools/gpu-kernels.sh tests/cuda/test_cuda_kernels_b.cpp
 */
#include <atomic>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "kernels/cuda/attention_tiles.cuh"

namespace loom::cuda {
namespace {

using namespace attn;

// =========================================================================== common pieces
// delta[r, h] = dout[r, h, :] . out[r, h, :] in fp32; one warp per (row, head).
template <class T>
__global__ void attn_delta(float* __restrict__ delta, const T* __restrict__ dout,
                           const T* __restrict__ out, int64_t rows, int hd) {
  pdl_entry();
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
  pdl_entry();
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (r >= rows || (r >= cu[0] && r < cu[nseq])) return;
  for (int i = threadIdx.x % 32; i < width; i += 32) x[r * width + i] = from_float<T>(0.f);
  if (stat)
    for (int i = threadIdx.x % 32; i < nstat; i += 32) stat[r * nstat + i] = INFINITY;
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
        fwd_sm90(o, lse, qq, kk, vv, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV, hd, causal, scale_log2, s);
        return;
      }
      fwd_v2(o, lse, qq, kk, vv, cu_q, cu_k, nseq, max_seqlen, H, KV, hd, causal, scale_log2, s);
    }
    launch_kernel(zero_outside<dev_t<T>>, ceil_div(Nq, 8), 256, 0, s, dptr(out), lse, cu_q, nseq, Nq, H * hd, H);
    LAUNCH_CHECK();
    return;
  }
  // v1 writes every row itself (rows outside every sequence included)
  fwd_v1(out, lse, q, k, v, cu_q, cu_k, nseq, Nq, H, KV, hd, causal, scale_log2, s);
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
    bwd_v2_atomic(a, b, c, dq_acc, delta, o, oo, qq, kk, vv, lse, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV, hd,
                  causal, sc, s);
    return;
  }
  if (Nq > 0) {
    launch_kernel(attn_delta<dev_t<T>>, ceil_div(Nq * H, 8), 256, 0, s, delta, dptr(dout), dptr(out), Nq * H, hd);
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
      bwd_v2(a, b, c, o, qq, kk, vv, lse, delta, cu_q, cu_k, nseq, max_seqlen, H, KV, hd, causal, sc, s);
    }
    if (Nq > 0) {
      launch_kernel(zero_outside<dev_t<T>>, ceil_div(Nq, 8), 256, 0, s, dptr(dq), nullptr, cu_q, nseq, Nq, H * hd, 0);
      LAUNCH_CHECK();
    }
    if (Nk > 0) {
      launch_kernel(zero_outside<dev_t<T>>, ceil_div(Nk, 8), 256, 0, s, dptr(dk), nullptr, cu_k, nseq, Nk, KV * hd, 0);
      LAUNCH_CHECK();
      launch_kernel(zero_outside<dev_t<T>>, ceil_div(Nk, 8), 256, 0, s, dptr(dv), nullptr, cu_k, nseq, Nk, KV * hd, 0);
      LAUNCH_CHECK();
    }
    return;
  }
  const float sc = float(scale);
  bwd_v1(dq, dk, dv, dout, q, k, v, lse, delta, cu_q, cu_k, nseq, Nq, Nk, H, KV, hd, causal, sc, s);
}

}  // namespace

// The dense split (header): the sequences of the first call when a dense batch goes to the
// cuDNN backend as two calls, else 0. cuDNN's dense plans then exist for multiples of 8 and for
// 1..7 sequences only (a few plans, each built and, under auto, timed once) instead of one per
// image count met. The two calls read and write disjoint rows; a backward's workspace serves
// both in turn (each needs less than the whole call's).
// Only where cuDNN may take the call: bf16 under auto or cudnn, f32 under cudnn (auto keeps f32
// and f16 on our kernels, and cudnn refuses f16 with its own error).
namespace {
constexpr int kDenseGroup = 8;
template <class T>
int split_dense(const int32_t* cu_q, const int32_t* cu_k, int nseq, int max_seqlen, int64_t Nq, int64_t Nk) {
  const AttentionBackend be = attention_backend();
  const bool cudnn_may = be == AttentionBackend::Cudnn || (be == AttentionBackend::Auto && std::is_same<T, bf16>::value);
  if (!cudnn_may || std::is_same<T, f16>::value || nseq <= kDenseGroup || nseq % kDenseGroup == 0 ||
      side_scope_active() || !attn::dense_batch(cu_q, cu_k, nseq, max_seqlen, Nq, Nk))
    return 0;
  return nseq - nseq % kDenseGroup;
}
}  // namespace

template <class T>
void attention_forward(T* out, acc_t<T>* lse, const T* q, const T* k, const T* v,
                       const int32_t* cu_q, const int32_t* cu_k, int nseq, int max_seqlen,
                       int64_t Nq, int64_t Nk, int H, int KV, int hd, bool causal, double scale,
                       Stream s) {
  check_args("attention_forward", nseq, max_seqlen, H, KV, hd);
  if (const int a = split_dense<T>(cu_q, cu_k, nseq, max_seqlen, Nq, Nk)) {
    const int64_t r = int64_t(a) * max_seqlen, b = nseq - a;  // cu's first b + 1 entries: 0, S, .. b S
    attention_forward(out, lse, q, k, v, cu_q, cu_q, a, max_seqlen, r, r, H, KV, hd, causal, scale, s);
    attention_forward(out + r * H * hd, lse + r * H, q + r * H * hd, k + r * KV * hd, v + r * KV * hd, cu_q, cu_q,
                      int(b), max_seqlen, Nq - r, Nq - r, H, KV, hd, causal, scale, s);
    return;
  }
  auto ours = [&] { forward_loom(out, lse, q, k, v, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV, hd, causal, scale, s); };
  // a side scope (allocator.cu) runs ours: cuDNN's plans keep per-plan state and one workspace
  if (!side_scope_active() && cudnn_attention_forward(out, lse, q, k, v, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H,
                                                      KV, hd, causal, scale, s, ours))
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
  if (const int a = split_dense<T>(cu_q, cu_k, nseq, max_seqlen, Nq, Nk)) {
    const int64_t r = int64_t(a) * max_seqlen, b = nseq - a;
    attention_backward(dq, dk, dv, dout, q, k, v, out, lse, workspace, cu_q, cu_q, a, max_seqlen, r, r, H, KV, hd,
                       causal, scale, s);
    const int64_t oq = r * H * hd, ok = r * KV * hd;
    attention_backward(dq + oq, dk + ok, dv + ok, dout + oq, q + oq, k + ok, v + ok, out + oq, lse + r * H, workspace,
                       cu_q, cu_q, int(b), max_seqlen, Nq - r, Nq - r, H, KV, hd, causal, scale, s);
    return;
  }
  auto ours = [&] {
    backward_loom(dq, dk, dv, dout, q, k, v, out, lse, workspace, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV, hd,
                  causal, scale, s);
  };
  if (!side_scope_active() && cudnn_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, workspace, cu_q, cu_k,
                                                       nseq, max_seqlen, Nq, Nk, H, KV, hd, causal, scale, s, ours))
    return;
  ours();
}

// attention_backward_qkv (kernels.inc). A dense batch the cuDNN backend may take runs as the
// two parts attention_backward splits it into (split_dense), each as below. The joined rows
// straight from loom's backward (attn::bwd_qkv_joined) where it runs: bf16, hd 64, the loom
// backend (train.attention = loom, or `auto`'s choice for the bucket), not deterministic, and either the
// warp-specialized backward (dk, dv stored into the rows, with pos dk rotated in that store; dq by
// the finish, rotated with pos) or, without pos, a dense batch of at most 64 tokens a sequence (the
// one-tile backward storing dq, dk, dv into the rows). Else attention_backward into a scratch dq |
// dk | dv, then rope_qkv_join (with pos) or three strided copies (without). LOOM_ATTN_QKV_JOIN=0
// forces the latter (the same dk, dv bits; dq within the atomic backward's run-to-run spread,
// bit for bit in the one-tile form). Where cuDNN runs a dense call without pos, its plan with
// strided gradients writes the rows (attn::cudnn_attention_backward_rows).
template <class T>
void attention_backward_qkv(T* dqkv, const T* dout, const T* q, const T* k, const T* v, const T* out,
                            const acc_t<T>* lse, acc_t<T>* workspace, const int32_t* cu, const int32_t* pos,
                            int nseq, int max_seqlen, int64_t N, int H, int KV, int hd, bool causal,
                            double scale, double theta, Stream s) {
  check_args("attention_backward_qkv", nseq, max_seqlen, H, KV, hd);
  if (N <= 0) return;
  // a dense batch cuDNN may take: the parts attention_backward would split it into (the same
  // buckets, so each part's auto choice is the one its probe made), each with its rows
  if (const int a = split_dense<T>(cu, cu, nseq, max_seqlen, N, N)) {
    const int64_t r = int64_t(a) * max_seqlen, W = int64_t(H + 2 * KV) * hd, oq = r * H * hd, ok = r * KV * hd;
    attention_backward_qkv(dqkv, dout, q, k, v, out, lse, workspace, cu, pos, a, max_seqlen, r, H, KV, hd, causal,
                           scale, theta, s);
    attention_backward_qkv(dqkv + r * W, dout + oq, q + oq, k + ok, v + ok, out + oq, lse + r * H, workspace, cu,
                           pos ? pos + r : nullptr, nseq - a, max_seqlen, N - r, H, KV, hd, causal, scale, theta, s);
    return;
  }
  if constexpr (std::is_same<T, bf16>::value) {
    const char* e = std::getenv("LOOM_ATTN_QKV_JOIN");  // read at every call: tests switch it
    float* dq_acc = workspace;
    float* delta = workspace + N * H * hd;
    // loom's kernels run the call: the loom backend, a side scope, or auto's choice for its bucket
    const AttentionBackend be = attention_backend();
    const bool on_loom = side_scope_active() || be == AttentionBackend::Loom ||
                         (be == AttentionBackend::Auto &&
                          attn::cudnn_auto_choice(true, nseq, max_seqlen, N, N, H, KV, hd, causal,
                                                  attn::dense_batch(cu, cu, nseq, max_seqlen, N, N)) == 0);
    if (!(e && e[0] == '0') && !deterministic_attention() && on_loom &&
        attn::bwd_qkv_joined_available(hd, causal, nseq, max_seqlen, N, cu, pos, q, k, v, dout, dq_acc, dqkv)) {
      attn::bwd_qkv_joined(reinterpret_cast<bf*>(dqkv), dq_acc, delta, reinterpret_cast<const bf*>(dout),
                           reinterpret_cast<const bf*>(out), reinterpret_cast<const bf*>(q),
                           reinterpret_cast<const bf*>(k), reinterpret_cast<const bf*>(v), lse, cu, pos, nseq,
                           max_seqlen, N, H, KV, causal, float(scale), theta, s);
      return;
    }
    // without RoPE where cuDNN runs the call (auto's choice for the 196-token ViT batches): its
    // dense plan with strided gradients writes the rows
    if (!pos && !(e && e[0] == '0') && !side_scope_active() &&
        attn::cudnn_attention_backward_rows(reinterpret_cast<bf*>(dqkv), reinterpret_cast<const bf*>(dout),
                                            reinterpret_cast<const bf*>(q), reinterpret_cast<const bf*>(k),
                                            reinterpret_cast<const bf*>(v), reinterpret_cast<const bf*>(out), lse,
                                            workspace, cu, nseq, max_seqlen, N, H, KV, hd, causal, scale, s))
      return;
  }
  const int64_t nq = N * H * hd, nk = N * KV * hd, W = int64_t(H + 2 * KV) * hd;
  T* scratch = static_cast<T*>(device_malloc(sizeof(T) * size_t(nq + 2 * nk)));
  attention_backward(scratch, scratch + nq, scratch + nq + nk, dout, q, k, v, out, lse, workspace, cu, cu, nseq,
                     max_seqlen, N, N, H, KV, hd, causal, scale, s);
  if (pos) {
    rope_qkv_join(dqkv, scratch, scratch + nq, scratch + nq + nk, pos, N, H, KV, hd, theta, s);
  } else {
    const size_t e = sizeof(T), rw = size_t(W) * e;
    CUDA_CHECK(cudaMemcpy2DAsync(dqkv, rw, scratch, size_t(H) * hd * e, size_t(H) * hd * e, size_t(N),
                                 cudaMemcpyDeviceToDevice, s));
    CUDA_CHECK(cudaMemcpy2DAsync(dqkv + int64_t(H) * hd, rw, scratch + nq, size_t(KV) * hd * e, size_t(KV) * hd * e,
                                 size_t(N), cudaMemcpyDeviceToDevice, s));
    CUDA_CHECK(cudaMemcpy2DAsync(dqkv + int64_t(H + KV) * hd, rw, scratch + nq + nk, size_t(KV) * hd * e,
                                 size_t(KV) * hd * e, size_t(N), cudaMemcpyDeviceToDevice, s));
  }
  device_free(scratch);  // stream-ordered reuse
}

template void attention_forward<float>(float*, float*, const float*, const float*, const float*, const int32_t*,
                                       const int32_t*, int, int, int64_t, int64_t, int, int, int, bool, double, Stream);
template void attention_forward<bf16>(bf16*, float*, const bf16*, const bf16*, const bf16*, const int32_t*,
                                      const int32_t*, int, int, int64_t, int64_t, int, int, int, bool, double, Stream);
template void attention_forward<f16>(f16*, float*, const f16*, const f16*, const f16*, const int32_t*,
                                      const int32_t*, int, int, int64_t, int64_t, int, int, int, bool, double, Stream);
template void attention_backward<float>(float*, float*, float*, const float*, const float*, const float*,
                                        const float*, const float*, const float*, float*, const int32_t*,
                                        const int32_t*, int, int, int64_t, int64_t, int, int, int, bool, double, Stream);
template void attention_backward<bf16>(bf16*, bf16*, bf16*, const bf16*, const bf16*, const bf16*, const bf16*,
                                       const bf16*, const float*, float*, const int32_t*, const int32_t*, int, int,
                                       int64_t, int64_t, int, int, int, bool, double, Stream);
template void attention_backward<f16>(f16*, f16*, f16*, const f16*, const f16*, const f16*, const f16*,
                                       const f16*, const float*, float*, const int32_t*, const int32_t*, int, int,
                                       int64_t, int64_t, int, int, int, bool, double, Stream);

#define LOOM_QKV(T)                                                                                             \
  template void attention_backward_qkv<T>(T*, const T*, const T*, const T*, const T*, const T*, const acc_t<T>*,    \
                                          acc_t<T>*, const int32_t*, const int32_t*, int, int, int64_t, int, int, \
                                          int, bool, double, double, Stream);
LOOM_QKV(float)
LOOM_QKV(bf16)
LOOM_QKV(f16)
#undef LOOM_QKV

}  // namespace loom::cuda
