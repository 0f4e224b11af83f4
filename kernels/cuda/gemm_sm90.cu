/*
 * gemm_sm90.cu: products of our own on Hopper (sm_90a): out = epilogue(A B^T) with TMA loads,
 * wgmma, and the epilogue (bias, GELU with its pre-activation, the residual, DGELU, the SwiGLU
 * and its gradient) on the accumulators. Reference: kernels/cpu/matmul.cpp (linear_forward,
 * linear_gelu_forward, linear_forward_add, linear_dgelu_backward, linear_swiglu_forward /
 * _backward); matmul.cu runs the same contracts through cuBLASLt (and the SwiGLU kernels),
 * which stay the path for every call this file does not take (matmul.cu says which it takes).
 *
 * Math (row-major, bf16 in and out, fp32 accumulation):
 *   acc[N,O] = inp[N,I] weight[O,I]^T                 (inp and weight both K-major: wgmma's "TN")
 *   epilogue 0: out = acc + bias                        (bias nullable)
 *   epilogue 1: pre = acc + bias (nullable: not written), out = gelu(acc + bias)
 *               gelu: the tanh approximation (activations.cu), tanh.approx.f32 on the SFU
 *   epilogue 2: out = resid + acc + bias, rounded once (linear_forward_add; out may be resid)
 *   epilogue 3: the SwiGLU of a joined gate | up product: gu = acc, h = silu(gate) up
 *   epilogue 4: the SwiGLU's gradient behind the down projection's input gradient: acc = dh =
 *               dout wd (wd [C2, I] read along its rows: B MN-major), dgu = swiglu'(dh, gu),
 *               h again for wd's gradient; 64-column tiles, gate and up TMA-loaded during the
 *               main loop
 *   epilogue 5: dpre = acc * gelu'(pre), acc = dout W with W [O, I] read along its rows (B
 *               MN-major): linear_dgelu_backward's product, pre TMA-loaded into the output tile
 *   epilogue 6: a Llama layer's joined q | k | v product (head dim 64): acc rounded to bf16, q's
 *               and k's heads rotated by RoPE (rope_qkv_split's rounding, angles from
 *               rope_table.h's table), each 64-column half stored to q, k or v: linear_qkv_rope
 *
 * Why: cuBLASLt's GELU epilogue made fc1 ~1.5x as long as a product of the same FLOPs without
 * one (docs/kernels/products.md), and every pass a product's epilogue can take over (bias, GELU,
 * the residual add; later the norms and the gradients' epilogues) is a pass over memory less.
 * Here the epilogue of one tile runs while the tensor cores work on the next.
 *
 * Structure: a persistent grid (one block per multiprocessor, at most one per tile), block b
 * taking tiles b, b + grid, ... of 128 x 128 outputs (column tiles fastest, so the blocks running
 * together share inp's rows in L2). 384 threads:
 *   warpgroup 2, one thread (the producer; setmaxnreg gives its registers to the consumers):
 *     TMA-loads the K tiles (64 columns) of inp's 128 rows and of weight's 128 rows of every
 *     tile of the block, in order, into a ring of 5 stages of 32 KB (128-byte swizzle; rows past
 *     N or O and columns past I come in as zeros), each stage's `full` mbarrier counting bytes.
 *   warpgroups 0 and 1, the consumers, "ping-pong": warpgroup c takes the block's tiles c, c + 2,
 *     ...; per stage eight wgmma m64n128k16 (two 64-row halves x four 16-column K steps, shared
 *     descriptors stepping 32 bytes along K), one commit group, at most one in flight, the stage
 *     before handed back (`empty`, one arrival per warp). Their main loops take turns (`turn`),
 *     so while one consumer runs its epilogue the other keeps the tensor cores busy.
 *   epilogue: bias (+ GELU, + the residual) on the fp32 accumulators, bf16 pairs into the
 *     consumer's own 32 KB tile in shared memory (the sw128 layout), one TMA store of the tile
 *     (rows and columns past the tensor are dropped by the store). The residual tile is
 *     TMA-loaded into that same shared tile while the main loop runs.
 * Wgmma needs whole, aligned warpgroups (warps 4c to 4c + 3), so the producer comes last; with
 * it first and one warp wide (288 threads) the consumers' warpgroups straddled warps 1-4 and
 * 5-8 and the kernel died with an illegal instruction. Without the turns a consumer could wait
 * on a stage more than one ring ahead of the producer, where an mbarrier's phase parity no
 * longer tells the phases apart (it hung on K 768 with 294 tiles).
 *
 * Contract: I % 8 == 0 and O % 8 == 0 (TMA row pitches are multiples of 16 bytes), inp, weight,
 * out, pre and resid 16-byte aligned, bias 4-byte aligned; any N. `supported` says whether a
 * call qualifies (also: built with sm_90a code, running on a compute-capability 9.0 device).
 *
 * Where it is used: linear_swiglu_forward and linear_swiglu_backward (matmul.cu: the LM's joined
 * gate | up with its SwiGLU, and its gradient; by default on Hopper), linear_qkv_rope (the LM's
 * joined q | k | v with RoPE; by default on Hopper, LOOM_GEMM90_QKV=0 turns it off); linear_forward /
 * linear_forward_add / linear_gelu_forward / linear_dgelu_backward only with
 * LOOM_GEMM90=1 (matmul.cu's header has the A/B that kept them on cuBLASLt).
 *
 * Measured (H200, 2026-11-27, bench_gemm_shapes, bf16, median of 20, us; cuBLASLt | this):
 *   MIM forward products summed over a step 10.18 | 9.87 ms; enc.fc1 (6272 x 768 -> 3072, GELU +
 *   pre) 69.0-70.8 | 60.4-62.0, target.fc1 (25088 rows, GELU) 208-211 | 206-207, target.qkv
 *   139.5 | 138.8 (~640 TFLOP/s, K 768), the K 3072 products behind: enc.fc2 (294 tiles on 132
 *   blocks, the last round a fifth full) 49.0-50.2 | 57.2-58.3; the LM's gate | up 95.5-103.8 |
 *   97.5-99.1, with its SwiGLU 132.3 (two passes) | 118.0 (this epilogue).
 *   In the steps (kernel traces, LOOM_PDL=0): the VLM's 30 gate | up products with their SwiGLU
 *   3.75 -> 3.46 ms a step; its 30 dh products with the SwiGLU's gradient 1.39 + 2.22 -> 3.63 ms
 *   (no gain: with 64-column tiles the main loop is ~2 us and the epilogue's 80 KB of loads and
 *   stores per tile are not hidden; fixed-batch VLM medians 52.89 / 52.86 -> 52.70 / 52.59 ms);
 *   the MIM step's 16 DGELU products 1.38 (cuBLASLt's xmma DGELU kernel) -> 1.53 ms, so DGELU
 *   stays on cuBLASLt; the MIM step with every forward product of inner size <= 1024 here
 *   15.00 -> 15.13 ms of products, so those stay on cuBLASLt.
 *   The q | k | v epilogue (H200, 2026-11-27, the LM's 16384 x 576 -> 960, two runs): 0.0415 /
 *   0.0432 ms against cuBLASLt's product + rope_qkv_split 0.0593 / 0.0633 (this kernel's plain
 *   product 0.0385 / 0.0402, cuBLASLt's 0.0406 / 0.0448); fixed-batch VLM step 51.47 / 51.20 ms
 *   against 51.82 / 51.74 with LOOM_GEMM90_QKV=0 (same call). Its first form, with the angle
 *   lookups inside the element loop and the double fallback inlined at each of them, ran 0.0870
 *   ms against 0.0667 (H100): the epilogue's code grew past what the instruction cache holds;
 *   the angles are now looked up once per row half (16-byte loads, the positions loaded before
 *   the main loop) and the fallback is a call.
 *   What bounds it (Nsight Compute, H200, 2026-11-28, bench/RESULTS.md "sixth"): not bandwidth.
 *   The tensor pipe is busy 29.8% of epilogue 4's time (SwiGLU backward), 61.1% of epilogue 3's,
 *   69.1% of epilogue 1's on the target's fc1 (cuBLASLt's 192 x 192 kernel with a cluster of two:
 *   66.1%), with L2 at 48 / 48 / 60% of its peak (cuBLASLt 29%) and DRAM at 36 / 22 / 15%: the
 *   time is lost in the consumers' own sequence, not in moving bytes. (An earlier estimate here,
 *   ~9 TB/s from L2, was wrong.) Measured and dropped for epilogue 4 the same day: dout's rows
 *   resident in shared memory with wd streamed (0.1689 against 0.1194 ms: the ring left holds
 *   32 KB), the next tile's gate / up prefetched into L2 (no change), and the outputs stored
 *   from registers (16-byte stores after a quad transpose; 0.1163 against 0.1173 ms, steps
 *   unchanged): neither its loads nor its stores are what it waits on. An epilogue longer than
 *   the other consumer's main loop is not hidden: the SwiGLU epilogue with expf and an IEEE divide took ~40 us more than
 *   the product alone (139.4 against 99.0), with the fast sigmoid (common.cuh) ~20 us.
 *   Tried and dropped (H200, 2026-11-28): 256 x 128 tiles with both consumers on one tile (rows
 *   128c .. 128c + 127 each, a stage of 256 inp rows and 128 weight rows, 48 KB, three stages),
 *   which reads a quarter less from L2 per FLOP than two ping-pong tiles but runs both epilogues
 *   at once. Correct on the forward tests (bias, GELU with and without pre, residual, in place),
 *   alone (bench_gemm_shapes, us, cuBLASLt | ping-pong | 256 rows): target.fc1 (GELU, no pre)
 *   208.4 | 204.4 | 196.8, target.qkv 142.0 | 140.0 | 137.9, vit.fc1 114.2 | 102.3 | 102.1,
 *   pred.fc1 93.5 | 74.6 | 77.4, but the K-3072 products lost (target.fc2 160.0 | 162.1 | 185.0,
 *   enc.fc2 50.0 | 57.4 | 76.3). In the steps (same call against a build without it, medians of
 *   steps 6-30 / 31-60): every forward on it (LOOM_GEMM90=2 then) bench_mim 22.70 -> 23.88 ms,
 *   contrastive 42.34 -> 43.48, VLM 51.45 -> 52.76; only the GELU forwards (256 rows without a
 *   pre-activation, else ping-pong) bench_mim 22.83 / 22.96 -> 22.79 / 22.89, contrastive 42.84
 *   -> 42.97, VLM 52.21 -> 52.40: the wins alone do not survive the step, as with LOOM_GEMM90=1.
 *   Why (H200, 2026-11-28, kernel traces of the MIM step, LOOM_PDL=0, per step, cuBLASLt |
 *   LOOM_GEMM90=1): the products run in the step as they do alone, nothing is lost to the step:
 *   the GELU forwards 3.458 | 3.399 ms (the wins), the residual forwards 3.625 | 3.959 (half at
 *   K 3072, where this kernel is slower alone too), DGELU 1.389 | 1.593; GPU busy 22.65 | 23.22.
 *
 *   Where a consumer's time goes (H200, 2026-11-28, -DLOOM_GEMM90_TIMING, cycles per tile): main
 *   loop 7550 against an ideal 2304 and epilogue 7248 for epilogue 4 (K 576, 64-column tiles);
 *   main loop 8400 / 4608 and epilogue 3305 for epilogue 3; 27412 / 24576 and 2361 for a plain
 *   K-3072 product. The producer waits on a free stage about half its time, so the K-576 main
 *   loops are slow by themselves (shared-memory traffic: two m64n64 products per K step read 32 KB
 *   a stage), and epilogue 4's epilogue is latency bound (one warp per scheduler).
 *
 * Test: tests/cuda/test_cuda_gemm_sm90.cpp against the CPU reference;
 * bench: bench/bench_gemm_shapes.cpp ("impl":"sm90" rows beside cuBLASLt's on the SPEC shapes).
 */
#include "kernels/cuda/gemm_sm90.h"

#include <algorithm>
#include <cstdio>
#include <initializer_list>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/rope.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace loom::cuda::gemm90 {
namespace {

using attn::bf;
constexpr int BM = 128, BN = 128, BK = 64;
constexpr int kThreads = 384;  // two consumer warpgroups, then the producer's warpgroup
// registers per thread after setmaxnreg: 128 x 40 + 256 x 232 = 64512 of the 65536

// Shared memory of a block: the ring of stages, each consumer's output tiles, the mbarriers.
// EPI 3 (SwiGLU forward): the 128 x 128 gu tile and a 128 x 64 h tile (one stage fewer);
// EPI 4 (SwiGLU backward, 64-column tiles): the gate, up and h tiles of 128 x 64.
template <int EPI>
struct Smem {
  static constexpr int stages = EPI == 3 ? 4 : 5;
  static constexpr int a_bytes = BM * BK * 2, b_bytes = (EPI == 4 ? 64 : BN) * BK * 2, stage = a_bytes + b_bytes;
  static constexpr int epi = EPI == 4 ? 3 * BM * 64 * 2 : BM * BN * 2 + (EPI == 3 ? BM * 64 * 2 : 0);
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

// The SwiGLU epilogue (EPI 3): the tile's 64 gate columns (accumulators n < 8) and the 64 up
// columns of the same hidden units (n >= 8) go out to gu rounded to bf16 (the backward reads
// them), and h = silu(gate) up from those bf16 values, computed as swiglu_forward_joined does
// (common.cuh's swiglu_f, activations.cu's SwigluF), so h is bit for bit
// what that kernel would make of gu. One pass writes both into shared memory (sOut: gu's two
// 64-column halves, sH: h's 64 columns), then three TMA stores.
__device__ __forceinline__ void swiglu_tile(bf* sOut, const float (&d)[2][BN / 8][4], const CUtensorMap* tgu,
                                            const CUtensorMap* th, int n0, int half, int m0, int wg_tid, int bar) {
  using namespace attn;
  const int w = wg_tid / 32, lane = wg_tid % 32, g = lane >> 2, t = lane & 3;
  bf* sH = sOut + BM * BN;
  if (wg_tid == 0) bulk_wait_read<0>();  // the last tile's stores have read both
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
        *reinterpret_cast<__nv_bfloat162*>(sOut + sw128<BM>(row, n) + 2 * t) = gb;
        *reinterpret_cast<__nv_bfloat162*>(sOut + sw128<BM>(row, n + 8) + 2 * t) = ub;
        const float g0 = __low2float(gb), g1 = __high2float(gb), u0 = __low2float(ub), u1 = __high2float(ub);
        const float h0 = swiglu_f(g0, u0), h1 = swiglu_f(g1, u1);
        *reinterpret_cast<uint32_t*>(sH + sw128<BM>(row, n) + 2 * t) = pack_bf16(h0, h1);
      }
  fence_smem_async();
  named_sync(bar, 128);
  if (wg_tid == 0) {
    tma_store_3d(tgu, n0, 0, m0, sOut);
    tma_store_3d(tgu, half + n0, 0, m0, sOut + BM * 64);
    tma_store_3d(th, n0, 0, m0, sH);
    bulk_commit();
  }
}

// The SwiGLU backward epilogue (EPI 4): the accumulators are dh (the down projection's input
// gradient) for 64 hidden units; gate and up for them were TMA-loaded into sG and sU during the
// main loop. From dh rounded to bf16 (the value the two-pass path stores) and those bf16 inputs,
// common.cuh's swiglu_b / swiglu_f give dgate, dup and (prod) h, each bit for bit what
// swiglu_backward_joined computes; dgate and dup overwrite gate and up in place (each thread
// reads and writes the same elements), then three TMA stores.
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
        const __nv_bfloat162 d2 = __floats2bfloat162_rn(d[hh][n][2 * r], d[hh][n][2 * r + 1]);
        const float gv[2] = {__low2float(g2), __high2float(g2)}, uv[2] = {__low2float(u2), __high2float(u2)};
        const float dv[2] = {__low2float(d2), __high2float(d2)};
        float dg[2], du[2];
        swiglu_b(dg[0], du[0], dv[0], gv[0], uv[0]);
        swiglu_b(dg[1], du[1], dv[1], gv[1], uv[1]);
        *reinterpret_cast<uint32_t*>(sG + pos) = pack_bf16(dg[0], dg[1]);
        *reinterpret_cast<uint32_t*>(sU + pos) = pack_bf16(du[0], du[1]);
        if (prod) *reinterpret_cast<uint32_t*>(sH + pos) = pack_bf16(swiglu_f(gv[0], uv[0]), swiglu_f(gv[1], uv[1]));
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

#ifdef LOOM_GEMM90_TIMING
// A timing build (-DLOOM_GEMM90_TIMING): each consumer's thread 0 sums the SM clock cycles of the
// phases of its tiles, and run() prints the means per tile after each launch (it synchronizes):
// [0] waiting for its turn, [1] main loop (first stage wait to the last wgmma's completion),
// [2] waiting for the epilogue's inputs, [3] the epilogue, [4] tiles; the producer's [5] waits on
// empty stages, [6] its loop.
__device__ unsigned long long g_timing[8];
#define GEMM90_T(...) __VA_ARGS__
#else
#define GEMM90_T(...)
#endif

template <int EPI>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_sm90_kernel(const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb,
                     const __grid_constant__ CUtensorMap tout, const __grid_constant__ CUtensorMap tpre,
                     const __grid_constant__ CUtensorMap tres, const bf* bias, bool has_pre, int tiles_m, int tiles_n,
                     int N, int K, int half, const RopeArgs ra) {
  pdl_entry();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace attn;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* base = smem_align1024(smem_raw);
  using Sm = Smem<EPI>;
  constexpr int STAGES = Sm::stages;
  bf* sEpi = reinterpret_cast<bf*>(base + STAGES * Sm::stage);
  uint64_t* full = reinterpret_cast<uint64_t*>(base + STAGES * Sm::stage + 2 * Sm::epi);
  uint64_t* empty = full + STAGES;
  uint64_t* turn = empty + STAGES;  // turn[c]: the other consumer has issued its main loop
  uint64_t* rbar = turn + 2;        // rbar[c]: consumer c's residual tile has landed (EPI 2)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int KT = (K + BK - 1) / BK, tiles = tiles_m * tiles_n;
  if (threadIdx.x == 0) {
    prefetch_tensormap(&ta);
    prefetch_tensormap(&tb);
    prefetch_tensormap(&tout);
    for (int s = 0; s < STAGES; s++) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 4);  // one arrival per warp of the consumer that read the stage
    }
    mbar_init(&turn[0], 4);
    mbar_init(&turn[1], 4);
    mbar_init(&rbar[0], 1);
    mbar_init(&rbar[1], 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  // Tile j of this block is tile blockIdx.x + j gridDim.x of the grid (column tiles fastest);
  // its K tiles are positions j KT .. j KT + KT - 1 of the block's ring of stages.
  if (warp >= 8) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (warp == 8 && lane == 0) {
      GEMM90_T(long long pw = 0; const long long p0 = clock64();)
      int pos = 0;
      for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int m0 = (tile / tiles_n) * BM, n0 = (tile % tiles_n) * (EPI == 3 || EPI == 4 ? 64 : BN);
        for (int kt = 0; kt < KT; kt++, pos++) {
          const int s = pos % STAGES;
          GEMM90_T(const long long w0 = clock64();)
          if (pos >= STAGES) mbar_wait(&empty[s], ((pos / STAGES) - 1) & 1);
          GEMM90_T(pw += clock64() - w0;)
          unsigned char* st = base + s * Sm::stage;
          mbar_expect_tx(&full[s], Sm::stage);
          tma_load_3d(st, &ta, kt * BK, 0, m0, &full[s]);
          if (EPI == 3) {  // 64 gate rows and the 64 up rows `half` further
            tma_load_3d(st + Sm::a_bytes, &tb, kt * BK, 0, n0, &full[s]);
            tma_load_3d(st + Sm::a_bytes + 64 * BK * 2, &tb, kt * BK, 0, half + n0, &full[s]);
          } else if (EPI == 4) {  // B MN-major: 64 K rows x 64 columns of the [K, half] weight
            tma_load_3d(st + Sm::a_bytes, &tb, n0, 0, kt * BK, &full[s]);
          } else if (EPI == 5) {  // B MN-major, two such boxes: the tile's 128 columns
            tma_load_3d(st + Sm::a_bytes, &tb, n0, 0, kt * BK, &full[s]);
            tma_load_3d(st + Sm::a_bytes + 64 * BK * 2, &tb, n0 + 64, 0, kt * BK, &full[s]);
          } else {
            tma_load_3d(st + Sm::a_bytes, &tb, kt * BK, 0, n0, &full[s]);
          }
        }
      }
      GEMM90_T(atomicAdd(&g_timing[5], (unsigned long long)pw); atomicAdd(&g_timing[6], (unsigned long long)(clock64() - p0));)
    }
    return;
  }

  // consumers: warpgroup c takes the block's tiles c, c + 2, ...; their K tiles alternate in
  // the ring, so one's main loop runs while the other stores its tile. The main loops take
  // turns: consumer 1's i-th tile starts once consumer 0 has issued its i-th (turn[1], phase i),
  // consumer 0's i-th once consumer 1 has issued its (i-1)-th (turn[0], phase i - 1): so each
  // waits on stages at most one ring ahead of the producer (the header says why that matters).
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int c = warp / 4, wg_tid = threadIdx.x % 128, t = lane & 3;
  bf* sOut = sEpi + c * (Sm::epi / 2);
  GEMM90_T(long long tsum[5] = {0, 0, 0, 0, 0}; long long ta0 = clock64(), ta1 = 0;)
  for (int j = c, i = 0;; j += 2, i++) {
    const int tile = blockIdx.x + j * gridDim.x;
    if (tile >= tiles) break;
    GEMM90_T(ta0 = clock64();)
    if (c == 1) mbar_wait(&turn[1], i & 1);
    else if (i > 0) mbar_wait(&turn[0], (i - 1) & 1);
    GEMM90_T(ta1 = clock64(); tsum[0] += ta1 - ta0; tsum[4]++;)
    const int m0 = (tile / tiles_n) * BM, n0 = (tile % tiles_n) * (EPI == 3 || EPI == 4 ? 64 : BN);
    int32_t prow[2][2] = {{0, 0}, {0, 0}};  // EPI 6: the positions of this thread's rows (`half`: the rows)
    if constexpr (EPI == 6) {
#pragma unroll
      for (int h = 0; h < 2; h++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
          const int m = m0 + h * 64 + (warp % 4) * 16 + (lane >> 2) + 8 * r;
          if (m < half) prow[h][r] = __ldg(ra.pos + m);
        }
    }
    if ((EPI == 2 || EPI == 4 || EPI == 5) && wg_tid == 0) {  // the epilogue's inputs, behind the last
      // store's read. EPI 2: the residual into the output tile; EPI 4: gate and up (of gu) into
      // sG, sU; EPI 5: GELU's pre-activation into the output tile
      bulk_wait_read<0>();
      mbar_expect_tx(&rbar[c], BM * 128 * 2);
      tma_load_3d(sOut, &tres, n0, 0, m0, &rbar[c]);
      tma_load_3d(sOut + BM * 64, &tres, EPI == 4 ? half + n0 : n0 + 64, 0, m0, &rbar[c]);
    }
    constexpr int TBN = EPI == 4 ? 64 : BN;  // the tile's columns
    float d[2][TBN / 8][4];
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
      for (int i = 0; i < TBN / 8; i++) d[h][i][0] = d[h][i][1] = d[h][i][2] = d[h][i][3] = 0.f;
    int prev = -1;
    for (int kt = 0; kt < KT; kt++) {
      const int pos = j * KT + kt, s = pos % STAGES;
      mbar_wait(&full[s], (pos / STAGES) & 1);
      const bf* sa = reinterpret_cast<const bf*>(base + s * Sm::stage);
      const bf* sb = reinterpret_cast<const bf*>(base + s * Sm::stage + Sm::a_bytes);
      wg_fence();
#pragma unroll
      for (int k = 0; k < BK / 16; k++) {
        if constexpr (EPI == 4 || EPI == 5) {  // B MN-major: a k-step is 16 rows of 128 bytes, the
          // 64-column halves (EPI 5) 8 KB apart
          const uint64_t db = sdesc(sb + k * 16 * 64, 64 * BK * 2);
          wgmma_ss<1>(d[0], sdesc(sa + k * 16, 16), db, 1);
          wgmma_ss<1>(d[1], sdesc(sa + 64 * BK + k * 16, 16), db, 1);
        } else {
          const uint64_t db = sdesc(sb + k * 16, 16);
          wgmma_ss<0>(d[0], sdesc(sa + k * 16, 16), db, 1);
          wgmma_ss<0>(d[1], sdesc(sa + 64 * BK + k * 16, 16), db, 1);
        }
      }
      wg_commit();
      wg_wait<1>();
      if (prev >= 0 && lane == 0) mbar_arrive(&empty[prev]);
      prev = s;
    }
    if (lane == 0) mbar_arrive(&turn[1 - c]);
    wg_wait<0>();
    fence_regs(d[0]);
    fence_regs(d[1]);
    if (lane == 0) mbar_arrive(&empty[prev]);
    GEMM90_T(const long long tb1 = clock64(); tsum[1] += tb1 - ta1;)

    if constexpr (EPI == 4) {
      mbar_wait(&rbar[c], i & 1);
      GEMM90_T(const long long tc1 = clock64(); tsum[2] += tc1 - tb1;)
      swiglu_bwd_tile(sOut, d, &tout, &tpre, has_pre, n0, half, m0, wg_tid, 1 + c);
      GEMM90_T(tsum[3] += clock64() - tc1;)
    } else {
      GEMM90_T(const long long tc1 = clock64();)
      float bias2[BN / 8][2];
#pragma unroll
      for (int n = 0; n < BN / 8; n++) {
        const int col = n0 + n * 8 + 2 * t;
        bias2[n][0] = bias2[n][1] = 0.f;
        if (bias && col < N) {
          const __nv_bfloat162 bb = *reinterpret_cast<const __nv_bfloat162*>(bias + col);
          bias2[n][0] = __bfloat162float(bb.x);
          bias2[n][1] = __bfloat162float(bb.y);
        }
      }
      const auto id = [](float x) { return x; };
      if constexpr (EPI == 1) {
        if (has_pre) store_tile<0>(sOut, d, bias2, id, &tpre, n0, m0, wg_tid, 1 + c);
        store_tile<0>(sOut, d, bias2, [](float x) { return gelu_tanh(x); }, &tout, n0, m0, wg_tid, 1 + c);
      } else if constexpr (EPI == 3) {
        swiglu_tile(sOut, d, &tout, &tpre, n0, half, m0, wg_tid, 1 + c);
      } else if constexpr (EPI == 2) {
        mbar_wait(&rbar[c], i & 1);
        store_tile<1>(sOut, d, bias2, id, &tout, n0, m0, wg_tid, 1 + c);
      } else if constexpr (EPI == 5) {
        mbar_wait(&rbar[c], i & 1);
        store_tile<2>(sOut, d, bias2, id, &tout, n0, m0, wg_tid, 1 + c);
      } else if constexpr (EPI == 6) {  // the kernel's N: the joined width
        rope_tile(sOut, d, prow, &tout, &tpre, &tres, ra, n0, m0, N, wg_tid, 1 + c);
      } else {
        store_tile<0>(sOut, d, bias2, id, &tout, n0, m0, wg_tid, 1 + c);
      }
      GEMM90_T(tsum[3] += clock64() - tc1;)
    }
  }
  if (wg_tid == 0) bulk_wait<0>();
  GEMM90_T(if (wg_tid == 0) for (int q = 0; q < 5; q++) atomicAdd(&g_timing[q], (unsigned long long)tsum[q]);)
#endif
}

// What every entry point asks of its shapes and pointers: rows that fit the kernel's int
// coordinates, TMA row pitches that are multiples of 16 bytes (`cols` % 8 == 0 for each operand's
// row length), 16-byte aligned bases (null pointers pass).
bool shapes_ok(int64_t N, std::initializer_list<int> cols, std::initializer_list<const void*> ptrs) {
  if (!available() || N <= 0 || N >= (int64_t(1) << 31)) return false;
  for (int c : cols)
    if (c <= 0 || c % 8 != 0) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) & 15) return false;
  return true;
}

// One launch of epilogue EPI: its shared memory allowed once per process, one block per
// multiprocessor at most, tiles_m x tiles_n tiles.
template <int EPI>
void run(const CUtensorMap& ta, const CUtensorMap& tb, const CUtensorMap& tout, const CUtensorMap& tpre,
         const CUtensorMap& tres, const bf* bias, bool has_pre, int tiles_m, int tiles_n, int N, int K, int half,
         cudaStream_t s, const RopeArgs& ra = RopeArgs()) {
  constexpr int smem = Smem<EPI>::bytes;
  static const bool once = [] {
    CUDA_CHECK(cudaFuncSetAttribute(gemm_sm90_kernel<EPI>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return true;
  }();
  (void)once;
  const int grid = std::min(tiles_m * tiles_n, sm_count());
#ifdef LOOM_GEMM90_TIMING
  const unsigned long long zero[8] = {};
  CUDA_CHECK(cudaMemcpyToSymbolAsync(g_timing, zero, sizeof zero, 0, cudaMemcpyHostToDevice, s));
#endif
  launch_kernel(gemm_sm90_kernel<EPI>, grid, kThreads, smem, s, ta, tb, tout, tpre, tres, bias, has_pre, tiles_m,
                tiles_n, N, K, half, ra);
  LAUNCH_CHECK();
#ifdef LOOM_GEMM90_TIMING
  unsigned long long t[8];
  CUDA_CHECK(cudaMemcpyFromSymbolAsync(t, g_timing, sizeof t, 0, cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  const double n = t[4] ? double(t[4]) : 1.0;
  std::fprintf(stderr,
               "gemm90 timing: epilogue %d, %dx%d tiles, K %d: cycles per consumer tile: turn %.0f, main loop %.0f, "
               "input wait %.0f, epilogue %.0f; producer per block: empty waits %.0f of %.0f\n",
               EPI, tiles_m, tiles_n, K, t[0] / n, t[1] / n, t[2] / n, t[3] / n, double(t[5]) / grid,
               double(t[6]) / grid);
#endif
}

}  // namespace

bool available() {
#if LOOM_SM90A
  return device_is_sm90();
#else
  return false;
#endif
}

bool supported(const void* out, const void* pre, const void* resid, const void* inp, const void* weight,
               const void* bias, int64_t N, int I, int O) {
  return shapes_ok(N, {I, O}, {inp, weight, out, pre, resid}) && (reinterpret_cast<uintptr_t>(bias) & 3) == 0;
}

void linear_forward(bf* out, bf* pre, const bf* inp, const bf* weight, const bf* bias, const bf* resid, int64_t N,
                    int I, int O, bool gelu, cudaStream_t s) {
  // [rows, 1, cols] views: loads in boxes of 64 columns x 128 rows, stores of 64 x 128
  const CUtensorMap ta = attn::make_map_3d(inp, false, N, 1, I, BK, BM);
  const CUtensorMap tb = attn::make_map_3d(weight, false, O, 1, I, BK, BN);
  const CUtensorMap tout = attn::make_map_3d(out, false, N, 1, O, 64, BM);
  const CUtensorMap tpre = pre ? attn::make_map_3d(pre, false, N, 1, O, 64, BM) : tout;
  const CUtensorMap tres = resid ? attn::make_map_3d(resid, false, N, 1, O, 64, BM) : tout;
  const int tiles_m = ceil_div(N, BM), tiles_n = ceil_div(O, BN);
  if (gelu) run<1>(ta, tb, tout, tpre, tres, bias, pre != nullptr, tiles_m, tiles_n, O, I, 0, s);
  else if (resid) run<2>(ta, tb, tout, tpre, tres, bias, false, tiles_m, tiles_n, O, I, 0, s);
  else run<0>(ta, tb, tout, tpre, tres, bias, false, tiles_m, tiles_n, O, I, 0, s);
}

bool swiglu_supported(const void* gu, const void* h, const void* inp, const void* wgu, int64_t N, int C, int I) {
  return shapes_ok(N, {C, I}, {gu, h, inp, wgu}) && I % 64 == 0;
}

void linear_swiglu_forward(bf* gu, bf* h, const bf* inp, const bf* wgu, int64_t N, int C, int I, cudaStream_t s) {
  // B in boxes of 64 rows (a tile's gate rows, then its up rows I further); gu out in 64-column
  // boxes (its gate half, then its up half), h in one
  const CUtensorMap ta = attn::make_map_3d(inp, false, N, 1, C, BK, BM);
  const CUtensorMap tb = attn::make_map_3d(wgu, false, 2 * int64_t(I), 1, C, BK, 64);
  const CUtensorMap tgu = attn::make_map_3d(gu, false, N, 1, 2 * I, 64, BM);
  const CUtensorMap th = attn::make_map_3d(h, false, N, 1, I, 64, BM);
  run<3>(ta, tb, tgu, th, tgu, nullptr, false, ceil_div(N, BM), I / 64, 2 * I, C, I, s);
}

bool dgelu_supported(const void* dpre, const void* dout, const void* weight, const void* pre, int64_t N, int I,
                     int O) {
  return shapes_ok(N, {I, O}, {dpre, dout, weight, pre});
}

void linear_dgelu(bf* dpre, const bf* dout, const bf* weight, const bf* pre, int64_t N, int I, int O, cudaStream_t s) {
  // A: dout [N, O]; B: weight [O, I] read along its rows (MN-major) in boxes of 64 columns x 64
  // K rows; pre in and dpre out in 64-column boxes of 128 rows
  const CUtensorMap ta = attn::make_map_3d(dout, false, N, 1, O, BK, BM);
  const CUtensorMap tb = attn::make_map_3d(weight, false, O, 1, I, 64, BK);
  const CUtensorMap tout = attn::make_map_3d(dpre, false, N, 1, I, 64, BM);
  const CUtensorMap tpre = attn::make_map_3d(pre, false, N, 1, I, 64, BM);
  run<5>(ta, tb, tout, tout, tpre, nullptr, false, ceil_div(N, BM), ceil_div(I, BN), I, O, 0, s);
}

bool swiglu_bwd_supported(const void* dgu, const void* prod, const void* dout, const void* wd, const void* gu,
                          int64_t N, int C2, int I) {
  return shapes_ok(N, {C2, I}, {dgu, prod, dout, wd, gu}) && I % 64 == 0;
}

void linear_swiglu_backward(bf* dgu, bf* prod, const bf* dout, const bf* wd, const bf* gu, int64_t N, int C2, int I,
                            cudaStream_t s) {
  // A: dout's rows; B: the down projection's weight [C2, I] read along its rows (MN-major), in
  // boxes of 64 columns x 64 K rows; gu in (gate and up tiles) and dgu out in 64-column boxes
  const CUtensorMap ta = attn::make_map_3d(dout, false, N, 1, C2, BK, BM);
  const CUtensorMap tb = attn::make_map_3d(wd, false, C2, 1, I, 64, BK);
  const CUtensorMap tdgu = attn::make_map_3d(dgu, false, N, 1, 2 * I, 64, BM);
  const CUtensorMap th = prod ? attn::make_map_3d(prod, false, N, 1, I, 64, BM) : tdgu;
  const CUtensorMap tgu = attn::make_map_3d(gu, false, N, 1, 2 * I, 64, BM);
  run<4>(ta, tb, tdgu, th, tgu, nullptr, prod != nullptr, ceil_div(N, BM), I / 64, 2 * I, C2, I, s);
}

bool qkv_rope_supported(const void* q, const void* k, const void* v, const void* inp, const void* w, int64_t N,
                        int C, int H, int KV, int hd) {
  return hd == 64 && H > 0 && KV > 0 && shapes_ok(N, {C, H * hd, KV * hd}, {q, k, v, inp, w});
}

void linear_qkv_rope(bf* q, bf* k, bf* v, const bf* inp, const bf* w, const int32_t* pos, const float2* table,
                     int table_rows, int64_t N, int C, int H, int KV, int hd, double theta, cudaStream_t s) {
  // A: inp [N, C]; B: the joined weight [W, C]; q, k, v out in 64-column boxes of 128 rows
  const int qw = H * hd, kw = KV * hd, W = qw + 2 * kw;
  const CUtensorMap ta = attn::make_map_3d(inp, false, N, 1, C, BK, BM);
  const CUtensorMap tb = attn::make_map_3d(w, false, W, 1, C, BK, BN);
  const CUtensorMap tq = attn::make_map_3d(q, false, N, 1, qw, 64, BM);
  const CUtensorMap tk = attn::make_map_3d(k, false, N, 1, kw, 64, BM);
  const CUtensorMap tv = attn::make_map_3d(v, false, N, 1, kw, 64, BM);
  RopeArgs ra;
  ra.pos = pos;
  ra.table = table;
  ra.table_rows = table ? table_rows : 0;
  ra.qw = qw;
  ra.kw = kw;
  ra.log_theta = std::log(theta);
  run<6>(ta, tb, tq, tk, tv, nullptr, false, ceil_div(N, BM), ceil_div(W, BN), W, C, int(N), s, ra);
}

}  // namespace loom::cuda::gemm90
