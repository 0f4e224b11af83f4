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
 *   epilogue 8: epilogue 3 in five stages instead of four (LOOM_GEMM90_SWF=5): gu's gate and up
 *               halves are stored first, then h, kept in registers, overwrites the gate half once
 *               its store has read it; a 32 KB output tile
 *   epilogue 13: epilogue 3 in six stages (the default; LOOM_GEMM90_SWF=4 selects epilogue 3):
 *               gate, up and h through one 16 KB box, each once the store before has read it
 *   epilogue 4: the SwiGLU's gradient behind the down projection's input gradient: acc = dh =
 *               dout wd (wd [C2, I] read along its rows: B MN-major), dgu = swiglu'(dh, gu),
 *               h again for wd's gradient; 64-column tiles, gate and up TMA-loaded during the
 *               main loop
 *   epilogue 7: epilogue 4 in tiles of 64 rows x 128 columns (I % 128 == 0): one m64n128k16 per
 *               K step instead of two m64n64k16, a quarter less shared-memory traffic per FLOP
 *               in the main loop, the same epilogue size; LOOM_GEMM90_SWB=0 keeps epilogue 4
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
 *     tile of the block, in order, into a ring of 4-6 stages of 32 KB (Smem; 128-byte swizzle; rows past
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
 *   the other consumer's main loop is not hidden: the SwiGLU epilogue with expf and an IEEE
 *   divide took ~40 us more than the product alone (139.4 against 99.0), with the fast sigmoid
 *   (common.cuh) ~20 us.
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
 *   loops are slow by themselves (first read as shared-memory traffic, two m64n64 products per K
 *   step reading 32 KB a stage; epilogue 7 below reads 24 and stays ~3x its ideal, so a 64-row
 *   warpgroup tile is slow as such), and epilogue 4's epilogue is latency bound (one warp per
 *   scheduler).
 *   Epilogue 7 (H200, 2026-11-28, bench/RESULTS.md "seventh"): 0.1107 / 0.1104 ms against
 *   epilogue 4's 0.1205 / 0.1210 (16384 x 576 -> 1536), main loop 6750, epilogue 6603 cycles a
 *   tile; fixed-batch VLM 49.69 / 49.86 against 50.22 / 49.87 ms. Its main loop is slow by
 *   itself: 7510 cycles with the epilogue's arithmetic left out, 6796 reading a K-major copy of wd
 *   (a K-major epilogue with a transpose, 0.1148 ms with it: dropped), no faster with two
 *   accumulator chains (dropped).
 *   The ring's depth (H200, 2026-11-28, bench/RESULTS.md "eighth"): a consumer holds two stages
 *   (the one its products read, the one whose products are in flight), and at K 576 a 128-row
 *   main loop waits on how far the rest run ahead: 13516 cycles with three stages, 7331 with six
 *   (tried for the SwiGLU backward in 128 x 128 tiles; each form lost in its epilogue, so
 *   epilogue 7 stays; a 64-row main loop does not move with a sixth stage). Epilogue 8 gives the
 *   SwiGLU forward its fifth stage: 0.1064-0.1106 ms against epilogue 3's 0.1162-0.1205, main loop
 *   7504 against 8413 cycles; epilogue 13 its sixth (H200, 2026-11-29, "ninth"): 0.1025-0.1072
 *   against 0.1067-0.1105, main loop 6609 cycles. The plain, GELU, residual and DGELU forms with
 *   six stages and a 16 KB tile beat cuBLASLt alone at K <= 768 by 3-13% and made no step faster
 *   (measured and not kept; branch wip/deep-ring).
 *
 * Files: this one holds the kernel, its launch and the entry points; gemm_sm90_tiles.cuh the tile
 * constants, the shared-memory layout (Smem) and the epilogues' tile functions.
 *
 * Test: tests/cuda/test_cuda_gemm_sm90.cpp against the CPU reference;
 * bench: bench/bench_gemm_shapes.cpp ("impl":"sm90" rows beside cuBLASLt's on the SPEC shapes).
 */
#include "kernels/cuda/gemm_sm90.h"

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <initializer_list>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gemm_sm90_tiles.cuh"
#include "kernels/cuda/rope.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace loom::cuda::gemm90 {
namespace {

#ifdef LOOM_GEMM90_TIMING
// A timing build (-DLOOM_GEMM90_TIMING): each consumer's thread 0 sums the SM clock cycles of the
// phases of its tiles, and run() prints the means per tile after each launch (it synchronizes):
// [0] waiting for its turn, [1] main loop (first stage wait to the last wgmma's completion),
// [2] waiting for the epilogue's inputs (EPI 4; EPI 2 and 5 count that wait in [3]), [3] the
// epilogue, [4] tiles; the producer's [5] waits on empty stages, [6] its loop.
__device__ unsigned long long g_timing[7];
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
        const int m0 = (tile / tiles_n) * tile_rows(EPI), n0 = (tile % tiles_n) * tile_col_step(EPI);
        for (int kt = 0; kt < KT; kt++, pos++) {
          const int s = pos % STAGES;
          GEMM90_T(const long long w0 = clock64();)
          if (pos >= STAGES) mbar_wait(&empty[s], ((pos / STAGES) - 1) & 1);
          GEMM90_T(pw += clock64() - w0;)
          unsigned char* st = base + s * Sm::stage;
          mbar_expect_tx(&full[s], Sm::stage);
          tma_load_3d(st, &ta, kt * BK, 0, m0, &full[s]);
          if (swiglu_boxes(EPI) > 0) {  // 64 gate rows and the 64 up rows `half` further
            tma_load_3d(st + Sm::a_bytes, &tb, kt * BK, 0, n0, &full[s]);
            tma_load_3d(st + Sm::a_bytes + 64 * BK * 2, &tb, kt * BK, 0, half + n0, &full[s]);
          } else if (EPI == 4) {  // B MN-major: 64 K rows x 64 columns of the [K, half] weight
            tma_load_3d(st + Sm::a_bytes, &tb, n0, 0, kt * BK, &full[s]);
          } else if (EPI == 5 || EPI == 7) {  // B MN-major, two such boxes: the tile's 128 columns
            tma_load_3d(st + Sm::a_bytes, &tb, n0, 0, kt * BK, &full[s]);
            tma_load_3d(st + Sm::a_bytes + 64 * BK * 2, &tb, n0 + 64, 0, kt * BK, &full[s]);
          } else {
            tma_load_3d(st + Sm::a_bytes, &tb, kt * BK, 0, n0, &full[s]);
          }
        }
      }
      GEMM90_T(atomicAdd(&g_timing[5], (unsigned long long)pw);
               atomicAdd(&g_timing[6], (unsigned long long)(clock64() - p0));)
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
  GEMM90_T(long long tsum[5] = {0, 0, 0, 0, 0}; long long ta0 = 0, ta1 = 0;)
  for (int j = c, i = 0;; j += 2, i++) {
    const int tile = blockIdx.x + j * gridDim.x;
    if (tile >= tiles) break;
    GEMM90_T(ta0 = clock64();)
    if (c == 1) mbar_wait(&turn[1], i & 1);
    else if (i > 0) mbar_wait(&turn[0], (i - 1) & 1);
    GEMM90_T(ta1 = clock64(); tsum[0] += ta1 - ta0; tsum[4]++;)
    const int m0 = (tile / tiles_n) * tile_rows(EPI), n0 = (tile % tiles_n) * tile_col_step(EPI);
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
    if (EPI == 7 && wg_tid == 0) {  // gate and up of the tile's 128 hidden units, 64 x 64 boxes
      bulk_wait_read<0>();
      mbar_expect_tx(&rbar[c], 4 * 64 * 64 * 2);
      tma_load_3d(sOut, &tres, n0, 0, m0, &rbar[c]);
      tma_load_3d(sOut + 64 * 64, &tres, n0 + 64, 0, m0, &rbar[c]);
      tma_load_3d(sOut + 2 * 64 * 64, &tres, half + n0, 0, m0, &rbar[c]);
      tma_load_3d(sOut + 3 * 64 * 64, &tres, half + n0 + 64, 0, m0, &rbar[c]);
    }
    constexpr int TBN = EPI == 4 ? 64 : BN;  // the tile's columns
    constexpr int MH = EPI == 7 ? 1 : 2;     // its 64-row halves
    float d[MH][TBN / 8][4];
#pragma unroll
    for (int h = 0; h < MH; h++)
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
        if constexpr (EPI == 4 || EPI == 5 || EPI == 7) {  // B MN-major: a k-step is 16 rows of 128
          // bytes, the 64-column halves (EPI 5, 7) 8 KB apart
          const uint64_t db = sdesc(sb + k * 16 * 64, 64 * BK * 2);
          wgmma_ss<1>(d[0], sdesc(sa + k * 16, 16), db, 1);
          if constexpr (MH == 2) wgmma_ss<1>(d[MH - 1], sdesc(sa + 64 * BK + k * 16, 16), db, 1);
        } else {
          const uint64_t db = sdesc(sb + k * 16, 16);
          wgmma_ss<0>(d[0], sdesc(sa + k * 16, 16), db, 1);
          wgmma_ss<0>(d[MH - 1], sdesc(sa + 64 * BK + k * 16, 16), db, 1);
        }
      }
      wg_commit();
      wg_wait<1>();
      if (prev >= 0 && lane == 0) mbar_arrive(&empty[prev]);
      prev = s;
    }
    if (lane == 0) mbar_arrive(&turn[1 - c]);
    wg_wait<0>();
#pragma unroll
    for (int h = 0; h < MH; h++) fence_regs(d[h]);
    if (lane == 0) mbar_arrive(&empty[prev]);
    GEMM90_T(const long long tb1 = clock64(); tsum[1] += tb1 - ta1;)

    if constexpr (EPI == 4) {
      mbar_wait(&rbar[c], i & 1);
      GEMM90_T(const long long tc1 = clock64(); tsum[2] += tc1 - tb1;)
      swiglu_bwd_tile(sOut, d, &tout, &tpre, has_pre, n0, half, m0, wg_tid, 1 + c);
      GEMM90_T(tsum[3] += clock64() - tc1;)
    } else if constexpr (EPI == 7) {
      mbar_wait(&rbar[c], i & 1);
      GEMM90_T(const long long tc1 = clock64(); tsum[2] += tc1 - tb1;)
      swiglu_bwd_tile_n128(sOut, d[0], &tout, &tpre, has_pre, n0, half, m0, wg_tid, 1 + c);
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
      } else if constexpr (swiglu_boxes(EPI) > 0) {
        swiglu_tile<swiglu_boxes(EPI)>(sOut, d, &tout, &tpre, n0, half, m0, wg_tid, 1 + c);
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
  const unsigned long long zero[7] = {};
  CUDA_CHECK(cudaMemcpyToSymbolAsync(g_timing, zero, sizeof zero, 0, cudaMemcpyHostToDevice, s));
#endif
  launch_kernel(gemm_sm90_kernel<EPI>, grid, kThreads, smem, s, ta, tb, tout, tpre, tres, bias, has_pre, tiles_m,
                tiles_n, N, K, half, ra);
  LAUNCH_CHECK();
#ifdef LOOM_GEMM90_TIMING
  unsigned long long t[7];
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
  const char* e = std::getenv("LOOM_GEMM90_SWF");
  if (e && e[0] == '4')  // EPI 3: four stages, gu and h in three boxes of the output tile
    run<3>(ta, tb, tgu, th, tgu, nullptr, false, ceil_div(N, BM), I / 64, 2 * I, C, I, s);
  else if (e && e[0] == '5')  // EPI 8: five stages, h written over gu's gate box once its store has read it
    run<8>(ta, tb, tgu, th, tgu, nullptr, false, ceil_div(N, BM), I / 64, 2 * I, C, I, s);
  else  // EPI 13: six stages, gate, up and h through one box
    run<13>(ta, tb, tgu, th, tgu, nullptr, false, ceil_div(N, BM), I / 64, 2 * I, C, I, s);
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
  const CUtensorMap tb = attn::make_map_3d(wd, false, C2, 1, I, 64, BK);
  const char* e = std::getenv("LOOM_GEMM90_SWB");
  if (I % 128 == 0 && !(e && e[0] == '0')) {  // EPI 7: 64-row x 128-column tiles, 64 x 64 boxes
    const CUtensorMap ta = attn::make_map_3d(dout, false, N, 1, C2, BK, 64);
    const CUtensorMap tdgu = attn::make_map_3d(dgu, false, N, 1, 2 * I, 64, 64);
    const CUtensorMap th = prod ? attn::make_map_3d(prod, false, N, 1, I, 64, 64) : tdgu;
    const CUtensorMap tgu = attn::make_map_3d(gu, false, N, 1, 2 * I, 64, 64);
    run<7>(ta, tb, tdgu, th, tgu, nullptr, prod != nullptr, ceil_div(N, 64), I / 128, 2 * I, C2, I, s);
    return;
  }
  const CUtensorMap ta = attn::make_map_3d(dout, false, N, 1, C2, BK, BM);
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
