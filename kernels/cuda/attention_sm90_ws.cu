/*
 * attention_sm90_ws.cu: the flash-attention forward on Hopper with warp specialization: a
 * producer warpgroup loads, NC consumer warpgroups compute, and the consumers take turns on
 * the tensor cores so that one's softmax runs while another's products do. Same contract,
 * masks and results as attn_fwd_sm90 (attention_sm90.cu: read it first, it has the wgmma
 * layouts and descriptors; the online softmax tile, the epilogue and the rows outside every
 * sequence are wgmma.cuh's, shared by both).
 *
 * What attention_sm90.cu leaves on the table: every warpgroup of its block loads the next K/V
 * tile and then meets the others at a block-wide barrier, so all of them issue their products
 * at the same moment and then all of them compute exp2 at the same moment: the tensor cores
 * idle during the softmax (at hd 128 a 64 x 128 tile is ~1k cycles of products and as many of
 * softmax instructions), and a third of its instructions are the loads' address arithmetic.
 *
 * Block: NC + 1 warpgroups, 64 NC query rows of one head and one sequence, BC-key tiles.
 *   warpgroup 0, the producer: gives registers back (setmaxnreg) and has one thread hand whole
 *     tiles to the TMA unit: Q once (a 64-row box per consumer, each with its own barrier: the
 *     first consumer's before K_0, the others' after tile 0), then K and V into rings of
 *     STAGES buffers, each tile as
 *     HD / 64 boxes of [BC rows][64 columns] that land in the 128-byte swizzle wgmma reads
 *     (tensor maps over [rows, heads, HD], built on the host per call). Each buffer has a "full"
 *     mbarrier (its phase completes when the TMA bytes have arrived: expect_tx) and an "empty"
 *     one the consumers arrive on when their products no longer read it; K and V have separate
 *     rings, since K is free after S and V only after P V. The sequence's last, partial tile
 *     goes through cp.async with zero-filled rows instead (a masked key's V row must be 0: P is
 *     0 there, but 0 x inf in a neighbour's row would be NaN), and the producer warpgroup
 *     arrives for it after its own wait.
 *   the consumers: raise their registers, 64 query rows each. Slot k of a consumer issues, as
 *     one batch, S_k = Q K_k^T and O += P_{k-1} V_{k-1} (P of the previous tile kept in
 *     registers as wgmma's A operand), waits for S_k, frees K_k, runs the masked online
 *     softmax, waits for P V, frees V_{k-1}, rescales O (skipped by a warp whose 16 row maxima
 *     all stayed) and packs P_k. n key tiles: n + 1 slots, the first only S, the last only P V.
 *   Turns: before issuing a batch a consumer waits at its named barrier; after issuing it
 *     arrives at the next consumer's. The last consumer starts by arriving at consumer 0's, so
 *     the batches go round 0, 1, .., NC - 1, 0, ... and each softmax overlaps the other
 *     consumers' products (FlashAttention-3's "ping-pong" schedule). Each consumer waits its
 *     turn n + 1 times; the last skips its final arrival, so every sync has its arrive.
 *   Causal: a consumer's tiles wholly above its diagonal are a suffix of the block's tiles; it
 *     still waits for them, takes its turns and frees them (no products), which keeps the
 *     barrier phases of all consumers and the producer in step.
 * Configurations: hd 128: NC 2, BC 128, 3 buffers (Q 32 KB + K 96 KB + V 96 KB), consumers
 *   at 224 registers (O 64 + S 64 + P 32 + state); hd 64: NC 3, BC 128, 4 buffers, consumers
 *   at 160 (a softmax as long as at hd 128 against half the products: a third consumer hides
 *   more of it), or NC 4, BC 64, 6 buffers, consumers at 112, for dense bidirectional batches
 *   whose 256-row blocks take fewer waves (item 9 below).
 *
 * Block order (attention_tiles.cuh's fwd_tile): causal, the last (longest) query tile of every
 *   head in a chunk of heads first, then the next-to-last ones, ...; bidirectional, each head's
 *   tiles side by side. Same call, H100, 2026-11-24, against each head's tiles side by side:
 *   B4 H9 T2048 hd 64 causal 0.081 -> 0.068 ms, B8 H12 T1024 hd 64 causal 0.073 -> 0.067,
 *   B2 H32 T4096 hd 64 causal 0.360 -> 0.339, B4 H16 T4096 hd 128 causal 0.505 -> 0.493, the
 *   SPEC hd 128 causal shape unchanged (0.305-0.308); bidirectional B8 H12 T1024 hd 128 lost
 *   in the chunked order (0.114 -> 0.120: the running blocks spread over every head's K / V).
 *
 * Versions (H100 SXM, bf16, forward ms on the three SPEC shapes B8 H12 T1024 D64 full |
 * B8 H16 T2048 D128 causal | B4 H9 T2048 D64 causal; every row beside attention_sm90.cu
 * (lock-step) and cuDNN's fused attention in the same call, bench/bench_attention.cpp, 2026-11-23):
 *   lock-step (attention_sm90.cu)                          0.108 | 0.429 | 0.108
 *   1. producer warpgroup with cp.async, 2 consumers,
 *      ping-pong, exp2f                                    0.156 | 0.521 | 0.145
 *      (no faster without the turns; ncu: 28% more instructions than lock-step, a third of
 *      them the producer's address arithmetic, with two consumer warps per scheduler to hide
 *      latency instead of three)
 *   2. TMA producer (one thread)                            0.143 | 0.452 | 0.135
 *      without the turns                                    0.148 | 0.484 | 0.139
 *      more buffers (3 at hd 128, 5 at hd 64)               no change: not load-bound
 *   3. ex2.approx.ftz instead of exp2f (its compare and
 *      two multiplies per score were 198 of 765 consumer
 *      instructions per tile); O's rescale skipped by warps
 *      whose maxima stayed                                  0.097 | 0.331 | 0.089
 *      (lock-step with ex2.approx.ftz: 0.101 | 0.427 | 0.107)
 *   4. descriptors built once in uniform registers,
 *      advanced by byte offsets / 16 (they were 158 of the
 *      remaining ~570 instructions per tile)                0.091 | 0.303 | 0.085
 *   5. three consumers at hd 64 (192 rows, 160 registers)   0.084 | 0.298 | 0.076
 *      cuDNN, same call                                     0.065 | 0.262 | 0.067
 *      three consumers at hd 128 with 64-key tiles          -     | 0.296 | -     (kept 2 x 128)
 *      three consumers at hd 64 with 64-key tiles           0.094 | -     | 0.085
 *   Split mode for blocks with at most 64 rows in their sequence (all consumers on the same
 *   rows, key tiles dealt round, (O, m, l) merged through shared memory at the end), with the
 *   partial blocks ordered last: correct on every test case, no faster (B8 H12 T1024 hd 64
 *   0.0885-0.0905 ms against 0.086-0.088 without, H100, 2026-11-24), so a block with one
 *   working consumer does not take a whole block's time after all; not kept.
 *   Persistent blocks (measured 2026-11-24, not kept): one block per SM taking query tiles in the
 *   block order above from a global counter (the producer's leader took the next with atomicAdd
 *   and handed it to the block through two mbarrier-guarded slots; the last block to finish reset
 *   the counter for the next launch), Q loaded per consumer as a 64-row box once that consumer's
 *   last S of the previous tile was done, so that the next tile's Q, K and V loaded during the last
 *   one's final products and epilogue; O staged in a region of each consumer's own (hd 128 with 2
 *   K / V buffers to make room). Same call, H100, forward ms, this kernel | persistent | the
 *   persistent code with a block per tile:
 *     B8 H12 T1024 hd 64              0.086-0.089 | 0.087-0.089 | 0.095
 *     B8 H16 T2048 hd 128 causal      0.309-0.311 | 0.297       | 0.336
 *     B4 H9 T2048 hd 64 causal        0.066-0.069 | 0.069       | 0.075
 *     B8 H12 T1024 hd 128             0.114-0.117 | 0.114-0.116 | 0.125
 *     B2 H32 T4096 hd 64 causal       0.334-0.336 | 0.351       | 0.375
 *     B4 H16 T4096 hd 128 causal      0.495       | 0.508-0.518 | 0.541
 *   and bench_vlm_sft unchanged (69.5 / 69.9 against 69.8 / 69.4 ms). Persistence gained 5-12%
 *   over the same code with a block per tile, but that code was 8-12% slower per block than this
 *   kernel (ncu, B2 H32 T4096 hd 64 causal, block per tile: 10% more cycles for 4% more
 *   instructions); reading the tile's numbers from lane 0 so that the descriptors went back to
 *   uniform registers (165 -> 73 register-to-uniform moves) changed nothing measurable, and where
 *   the rest of the per-block cost lies was not found. One hazard of that design: the producer's
 *   other lanes waited on the "empty" barriers too while its leader spun on a Q barrier, fell two
 *   ring cycles behind, and an mbarrier tells a phase only by its parity: a test case of three
 *   sequences (300, 129, 1 tokens) on three blocks hung until only the leader waited.
 *   6. the softmax overlapping its own warpgroup's P V (2026-11-24). The source always waited
 *      for S, ran the softmax, then waited for P V, but in the SASS the P V wait (an instruction
 *      without register operands) sat before the exponentials in every form tried: the mask in
 *      its own copy of the slot, S's first k-step write-only, the exp2s into separate
 *      registers, a wait predicated on the row sums or inside an opaque one-trip loop (both
 *      made ptxas serialize the products), a second wgmma.fence, the K-buffer arrival moved,
 *      no fence on S, no shuffles, every exp2 on the FMA pipe (a degree-4 polynomial; 1.4-1.5x
 *      slower). The cause: ptxas's scheduler puts the wait into the first stall after the issue
 *      (after the first row maxima, or after the first shuffle with the branches out of the
 *      slot, as in FlashAttention-3's order: O rescaled before the issue, the mask in its own
 *      copy); it does keep a shared-memory store ahead of the wait, so a store of the row sums
 *      (which depend on every exp2) pins the whole softmax before it (order_before_wait,
 *      wgmma.cuh; ~485 instructions between the two waits instead of 24-60). Same call, H100,
 *      forward ms, without | with, three rounds:
 *        B8 H12 T1024 hd 64            0.088-0.090 | 0.087-0.090
 *        B8 H16 T2048 hd 128 causal    0.307-0.309 | 0.303-0.306
 *        B4 H9 T2048 hd 64 causal      0.067-0.069 | 0.067-0.069
 *        B8 H12 T1024 hd 128           0.115-0.116 | 0.113-0.115
 *        B4 H16 T4096 hd 128 causal    0.494-0.497 | 0.484-0.486
 *        B2 H32 T4096 hd 64 causal     0.336-0.337 | 0.335-0.338
 *      1-2% at hd 128, nothing at hd 64 (the third consumer already covers that softmax); with
 *      it, two consumers at hd 64 are still slower than three (0.091-0.093 and 0.076-0.078 on
 *      the first and third rows). The FlashAttention-3 order without the store measured the same
 *      at hd 64 and 0-2% slower at hd 128 than this kernel's (another call) and is not used.
 *   Producer: only its leader waits on the "empty" barriers (the "full" barriers count its
 *     arrival alone, so another producer thread's lag behind the ring would have no bound, and
 *     a parity wait two phases late never returns); the other threads meet it at the producer's
 *     named barrier before a partial tile. Same speed as each thread waiting (same call), and
 *     ptxas no longer spills in the hd 64 instance (16 bytes before).
 *   7. Where a block's time goes (2026-11-25): clock64 stamps per block (B8 H12 T1024 hd 64,
 *      576 blocks, H100), median cycles: start -> Q's load issued 2.3k, -> Q in shared memory
 *      2.1k more (0.8k-4.2k), -> K_0 in 1.8k more, first S 0.46k, the 8 slots 21.1k (2.6k each
 *      for three consumers: 60% of the tensor cores' peak; hd 128 causal runs 2.6k per slot of
 *      two consumers, 78%), epilogue 2.0k, 0.36k between one block's end and the next's start on
 *      an SM; 48 SMs ran 5 blocks and 84 ran 4 (kernel 82 us, mean busy time per SM 71 us). So
 *      a block spends ~8k of its ~30k cycles outside its slots. Kept from it: the prologue
 *      prefetches the tensor maps, inits the barriers before the sequence bounds arrive and
 *      loads every bound in one round trip (SeqBounds, wgmma.cuh; the block's first loads waited
 *      for cu_q[0] and cu_q[nseq] before): start -> Q issued 2.0k; forward ms, three rounds,
 *      same call, before | after: B8 H12 T1024 hd 64 0.0860-0.0888 | 0.0848-0.0857, the other
 *      SPEC and MIM shapes within noise.
 *      Measured and not kept, same day: a persistent form of this kernel (grid of one block per
 *      SM, block b taking tiles b, 2G - 1 - b, 2G + b, ... in alternating rounds; two Q buffers,
 *      the next tile's Q and K / V loaded during this tile's last slots, the tile's numbers
 *      handed to the consumers next to its Q buffer; hd 128 with 2 K / V buffers to make room),
 *      correct on every test case with 3 blocks taking all tiles. Forward ms, same call, this
 *      kernel | persistent | its code with a block per tile:
 *        B8 H12 T768 hd 64             0.053-0.055 | 0.047-0.048 | 0.053-0.055
 *        B8 H12 T1024 hd 64            0.087-0.090 | 0.088-0.091 | 0.090-0.091
 *        B8 H12 T2048 hd 64            0.237-0.242 | 0.242-0.245 | 0.251-0.255
 *        B8 H12 T1024 hd 128           0.114-0.116 | 0.108-0.110 | 0.119-0.123
 *        B4 H9 T2048 hd 64 causal      0.067-0.069 | 0.066-0.067 | 0.069-0.071
 *        B2 H32 T4096 hd 64 causal     0.333-0.336 | 0.371-0.372 | 0.358-0.361
 *        B8 H16 T2048 hd 128 causal    0.304-0.307 | 0.351-0.352 | 0.315-0.322
 *        B4 H16 T4096 hd 128 causal    0.483-0.486 | 0.618-0.621 | 0.516-0.522
 *      The same code with a block per tile was 1-5% slower than this kernel at hd 64 (its
 *      slots, not its prologue; their SASS is as long, 493 against 485 instructions between the
 *      two waits; the cause was not found) and 4-7% at hd 128 (with 2 K / V buffers), which
 *      ate what persistence saved on the SPEC hd 64 shape; the static rounds left the long
 *      causal rows unbalanced (the dynamic scheduler of the first persistent try did better
 *      there, 0.297 ms at hd 128 causal).
 *   8. Dense batches without loads (2026-11-25): a batch with one cu_seqlens and Nq = Nk = nseq x
 *      max_seqlen has every sequence max_seqlen long (kernels.inc; the CPU reference checks it),
 *      so the host passes dense = max_seqlen (attention_tiles.cuh, dense_seqlen) and a block
 *      takes its bounds from its sequence index (seq_bounds, wgmma.cuh): its Q and K loads wait
 *      for no round trip to memory. Also in the lock-step forward (hd 64) and the wgmma
 *      backward. Same call, H100, ms, three rounds, LOOM_ATTN_DENSE=0 | default:
 *        shape                         forward                 | forward + backward
 *        B8 H12 T1024 hd 64            0.0831-0.0851 | 0.0827-0.0843 | 0.3239-0.3300 | 0.3234-0.3257
 *        B8 H16 T2048 hd 128 causal    0.2947-0.2984 | 0.2952-0.2969 | 1.2309-1.2436 | 1.2304-1.2423
 *        B4 H9 T2048 hd 64 causal      0.0648-0.0660 | 0.0631-0.0659 | 0.2521-0.2548 | 0.2500-0.2542
 *        B8 H12 T1024 hd 128           0.1116-0.1135 | 0.1098-0.1128 | 0.4838-0.4901 | 0.4809-0.4854
 *        B2 H32 T4096 hd 64 causal     0.3237-0.3285 | 0.3230-0.3339 | 1.3875-1.3991 | 1.3868-1.3960
 *        B128 H12 T196 hd 64           0.1297-0.1312 | 0.1276-0.1308 | 0.5529-0.5583 | 0.5470-0.5527
 *        B128 H12 T49 hd 64            0.0324-0.0342 | 0.0325-0.0334 | 0.1054-0.1080 | 0.1062-0.1078
 *      0-1.5% (a load's round trip is ~1% of a block here); bench_mim.cfg 27.3-27.8 ms either
 *      way, the fixed-batch VLM step 64.5-64.9. ptxas no longer spills in the backward (4 bytes
 *      in each instance before); the lock-step hd 128 instance keeps the loads (68 bytes of
 *      spills with both paths in it).
 *   9. Whole waves at hd 64, and Q per consumer (2026-11-26, H200, same calls). Every block of a
 *      dense bidirectional batch does the same work at one block per SM, so such a kernel lasts
 *      ceil(blocks / 132) block times: B8 H12 T1024 in 192-row blocks is 6 query tiles per head
 *      (the sixth with 64 rows), 576 blocks, 5 waves (ncu: 4.36 waves, 78 us), while 256-row
 *      blocks (four consumers, which only fit with 64-key tiles: 112 registers each, 96 at
 *      launch for 640 threads) make it 384 blocks in 3 waves (2.91; 70 us, 22% more
 *      instructions, issue slots 54% busy against 40%). Forward ms, three rounds, three
 *      consumers x 128 keys | four x 64:
 *        B8 H12 T1024 hd 64            0.0815-0.0836 | 0.0738-0.0760
 *        B16 H12 T1024                 0.1474-0.1490 | 0.1386-0.1434 (the choice below)
 *        B8 H16 T1024                  0.1049-0.1059 | 0.0952-0.0989 (the choice below)
 *        B4 H12 T1024                  0.0503-0.0516 | 0.0500-0.0521
 *        B8 H12 T768                   0.0463-0.0474 | 0.0577-0.0584
 *        B8 H12 T1536                  0.1393-0.1403 | 0.1581-0.1587
 *        B8 H12 T2048                  0.2278-0.2284 | 0.2389-0.2394
 *        B4 H9 T2048 causal            0.0619-0.0625 | 0.0621-0.0627
 *        B2 H32 T4096 causal           0.3219-0.3224 | 0.3237-0.3256
 *      (two consumers x 128 keys: 0.0866-0.0880 at T1024, slower everywhere; 4 or 8 buffers
 *      instead of 6 for the four consumers: the same). So per row the four-consumer blocks are
 *      slower and win only where they save a wave: fwd_sm90_ws takes them for dense
 *      bidirectional batches when ceil(blocks / SMs) x 1.4 (a 256-row block's time over a
 *      192-row one's, from the T1536 / T2048 rows) is below the three-consumer waves, and keeps
 *      three for causal and ragged batches. Then Q as one 64-row box per consumer with its
 *      own barrier, the first consumer's box before K_0 and the others after tile 0's K and V
 *      (one box and one barrier before): forward ms, three rounds, one box | per consumer: B8
 *      H12 T1024 hd 64 0.0749-0.0772 | 0.0734-0.0758, B8 H16 T2048 hd 128 causal 0.2878-0.2922 |
 *      0.2844-0.2907, B4 H9 T2048 hd 64 causal 0.0632-0.0651 | 0.0618-0.0633, the others
 *      (T768, T2048, hd 128 T1024 and T4096 causal) within 1%.
 *
 * When it runs: on sm_90a for batches whose longest sequence has at least 768 tokens at hd 64
 *   or 256 at hd 128 (attention_sm90.cu's fwd_sm90 decides; its comment has the sweep). Short sequences leave most of its 128 / 192-row
 *   blocks idle: with it on every shape bench_mim.cfg (ViT-B, sequences of 49 and 196 tokens)
 *   took 30.6 ms/step against 29.6-29.8 with the lock-step kernel (H100, same call), while the
 *   packed VLM step (LM rows up to 2048) was the same either way (74.4-74.8 ms).
 *
 * Test: tests/cuda/test_cuda_kernels_b.cpp ("attention ...": LOOM_ATTN_WS_MIN=0 runs this
 *   kernel on every case, with LOOM_ATTN_WS64=4 its four-consumer hd 64 form on every case,
 *   LOOM_ATTN_SM90=1 the lock-step one, =0 the mma.sync v2);
 *   three cases there have sequences long enough to wrap the buffer rings several times.
 */
#include <cstdint>
#include <cstdio>
#include <cmath>
#include <cstdlib>

#include "kernels/cuda/wgmma.cuh"

namespace loom::cuda::attn {
namespace {

// Registers per thread after setmaxnreg, by consumer count: the block's 64K registers split
// between 128 producer threads and NC x 128 consumer threads.
template <int NC> struct WsRegs;
template <> struct WsRegs<2> { static constexpr int producer = 56, consumer = 224; };  // 7168 + 57344
template <> struct WsRegs<3> { static constexpr int producer = 24, consumer = 160; };  // 3072 + 61440
// 640 threads start at 96 registers (61440): the producer's 72 x 128 freed go to the consumers
template <> struct WsRegs<4> { static constexpr int producer = 24, consumer = 112; };  // 3072 + 57344

template <int HD, int BC, int STAGES, int NC>
struct WsSmem {
  static constexpr int BR = 64 * NC;
  static constexpr int q_elems = BR * HD, kv_elems = BC * HD;
  // + the barriers, a word per consumer thread (order_before_wait) and the 1024-byte alignment
  static constexpr int bytes = (q_elems + 2 * STAGES * kv_elems) * 2 + (NC + 4 * STAGES) * 8 + 128 * NC * 4 + 1024;
};

template <int HD, int BC, int STAGES, int NC>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
attn_fwd_sm90_ws(bf* __restrict__ out, float* __restrict__ lse, const bf* __restrict__ q,
                 const bf* __restrict__ k, const bf* __restrict__ v, const __grid_constant__ CUtensorMap tm_q,
                 const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                 const int32_t* __restrict__ cu_q, const int32_t* __restrict__ cu_k, int dense, int64_t Nq, int H,
                 int KV, int chunk, bool causal, float scale_log2) {
  pdl_entry();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BR = 64 * NC, NT = 128 * (NC + 1);
  extern __shared__ unsigned char smem_raw[];
  using L = WsSmem<HD, BC, STAGES, NC>;
  // rounded as an integer, so the staging stores of the epilogue are generic: with
  // smem_align1024 (wgmma.cuh; shared stores) this kernel measured 1-2% slower at hd 128 (B8
  // H12 T1024 bidirectional 0.117 vs 0.115 ms, three rounds, H100, 2026-11-24) and ptxas spilled
  // 40 bytes instead of 16 at hd 64; its main loop has no shared-memory loads or stores of its own
  bf* sQ = reinterpret_cast<bf*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  bf* sK = sQ + L::q_elems;              // [STAGES][BC * HD]
  bf* sV = sK + STAGES * L::kv_elems;    // [STAGES][BC * HD]
  uint64_t* bar_q = reinterpret_cast<uint64_t*>(sV + STAGES * L::kv_elems);  // [NC]: each consumer's Q rows
  uint64_t* full_k = bar_q + NC;         // [STAGES]
  uint64_t* full_v = full_k + STAGES;    // [STAGES]
  uint64_t* empty_k = full_v + STAGES;   // [STAGES]
  uint64_t* empty_v = empty_k + STAGES;  // [STAGES]
  float* sink = reinterpret_cast<float*>(empty_v + STAGES);  // [NC * 128]: order_before_wait

  // The prologue is every block's critical path (B8 H12 T1024 hd 64: ~6k of a block's ~30k
  // cycles from its start to its first S): the tensor maps' prefetch and the barriers' init
  // go first, the sequence bounds in one round trip, then Q's and K's loads.
  if (threadIdx.x == 0) {
    prefetch_tensormap(&tm_q);
    prefetch_tensormap(&tm_k);
    prefetch_tensormap(&tm_v);
    for (int c = 0; c < NC; c++) mbar_init(&bar_q[c], 1);
    for (int s = 0; s < STAGES; s++) {
      mbar_init(&full_k[s], 1);
      mbar_init(&full_v[s], 1);
      mbar_init(&empty_k[s], 128 * NC);
      mbar_init(&empty_v[s], 128 * NC);
    }
  }
  const FwdTile ft = fwd_tile(BR, H, int(gridDim.z), chunk, causal);  // long tiles first
  const int seq = ft.seq, h = ft.h, kvh = h / (H / KV), qs = ft.qs;
  const SeqBounds sb = seq_bounds(cu_q, cu_k, seq, int(gridDim.z), dense);
  const int q0 = sb.q0, Lq = sb.Lq, k0 = sb.k0, Lk = sb.Lk;
  zero_rows_outside<HD, NT>(out, lse, sb.lo, sb.hi, Nq, H);  // (wgmma.cuh)
  if (qs >= Lq) return;
  const int nq = min(BR, Lq - qs), shift = Lk - Lq;
  const int64_t qstride = int64_t(H) * HD, kvstride = int64_t(KV) * HD;
  const int kend = causal ? min(Lk, qs + nq + shift) : Lk;  // keys the block's last row sees
  const int ntiles = kend > 0 ? (kend + BC - 1) / BC : 0;
  __syncthreads();  // the barriers' init
  const int wg = threadIdx.x / 128;

  if (wg == 0) {  // ---------------------------------------------------------------- producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WsRegs<NC>::producer));
    const bool leader = threadIdx.x == 0;
    constexpr uint32_t kTileBytes = BC * HD * 2;
    // Q as one 64-row box per consumer, each with its own barrier: consumer 0 (the first to take
    // its turn) waits for its own 8 or 16 KB and K_0, not for the whole block's Q; the other
    // consumers' rows follow tile 0's K and V. Rows past the sequence load its neighbours' rows
    // (never stored) or zeros.
    auto load_q = [&](int c) {
      mbar_expect_tx(&bar_q[c], 64 * HD * 2);
#pragma unroll
      for (int half = 0; half < HD / 64; half++)
        tma_load_3d(sQ + half * BR * 64 + c * 64 * 64, &tm_q, half * 64, h, q0 + qs + c * 64, &bar_q[c]);
    };
    if (leader) load_q(0);
    // Only the leader waits for the consumers to free a buffer: the "full" barriers count its
    // arrival alone, so nothing would bound how far behind the ring another producer thread
    // could fall, and a parity wait that comes two phases late never returns. The other threads
    // meet the leader at the producer's named barrier before the partial tile instead.
    // prev(j): the phase in which every consumer freed tile j - STAGES's buffer.
    auto prev = [](int j) { return uint32_t((j / STAGES) - 1) & 1; };
    // every tile but the sequence's last lies wholly inside it
    const bool last_partial = ntiles > 0 && Lk - (ntiles - 1) * BC < BC;
    const int nwhole = ntiles - (last_partial ? 1 : 0);
    if (leader) {  // whole tiles: one thread hands each to the TMA unit, K then V
      for (int j = 0; j < nwhole; j++) {
        const int st = j % STAGES;
#pragma unroll
        for (int which = 0; which < 2; which++) {
          uint64_t* full = which == 0 ? &full_k[st] : &full_v[st];
          if (j >= STAGES) mbar_wait(which == 0 ? &empty_k[st] : &empty_v[st], prev(j));
          mbar_expect_tx(full, kTileBytes);
          bf* dst = (which == 0 ? sK : sV) + st * L::kv_elems;
#pragma unroll
          for (int half = 0; half < HD / 64; half++)
            tma_load_3d(dst + half * BC * 64, which == 0 ? &tm_k : &tm_v, half * 64, kvh, k0 + j * BC, full);
        }
        if (j == 0)
          for (int c = 1; c < NC; c++) load_q(c);
      }
      if (nwhole == 0)
        for (int c = 1; c < NC; c++) load_q(c);
    }
    if (last_partial) {  // the sequence's last, partial tile: zero-filled rows (a masked key's V
                         // row must be 0, not a neighbour's value that could be inf) by cp.async
      const int j = ntiles - 1, st = j % STAGES, kb = j * BC, nvalid = Lk - kb;
#pragma unroll
      for (int which = 0; which < 2; which++) {
        if (leader && j >= STAGES) mbar_wait(which == 0 ? &empty_k[st] : &empty_v[st], prev(j));
        named_sync(15, 128);  // the producer warpgroup's own barrier: the buffer is free
        const bf* src = (which == 0 ? k : v) + (int64_t(k0) + kb) * kvstride + kvh * HD;
        load_tile_sw128<HD, BC, 128>((which == 0 ? sK : sV) + st * L::kv_elems, src, kvstride, nvalid);
        cp_async_commit();
        cp_async_wait<0>();
        fence_smem_async();  // these generic-proxy writes, before wgmma reads them
        named_sync(15, 128);
        if (leader) mbar_arrive(which == 0 ? &full_k[st] : &full_v[st]);
      }
    }
    return;
  }

  // ------------------------------------------------------------------------------ consumers
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WsRegs<NC>::consumer));
  // consumer index and its first row in the block's tile; read from lane 0 so that the compiler
  // knows it is the same in the whole warp and keeps what derives from it (the shared-memory
  // descriptors below) in uniform registers instead of converting them for every wgmma
  const int c = __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0) - 1, wr = c * 64;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int row0 = qs + wr + warp * 16 + g;  // this thread's rows: row0 (c0, c1), row0 + 8 (c2, c3)
  const int wlast = min(qs + wr + 63, Lq - 1);
  // tiles this consumer computes: a prefix of the block's (the rest lie above its diagonal)
  int nmine = 0;
  if (qs + wr < Lq) nmine = !causal ? ntiles : wlast + shift < 0 ? 0 : min(ntiles, (wlast + shift) / BC + 1);
  // turns go round the consumers 0, 1, .., NC - 1, 0, ...: each waits at its own barrier and
  // hands over at the next one's; the last starts by handing the first turn to consumer 0
  const int my_bar = 1 + c, other_bar = 1 + (c + 1) % NC;
  if (c == NC - 1 && ntiles > 0) named_arrive(1, 256);

  float o[HD / 8][4] = {};
  float s[BC / 8][4];
  uint32_t pa[BC / 16][4];
  float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.f, 0.f};
  float corr[2], sum[2];

  // The pieces of a slot. Every branch below that issues products also waits for them: the
  // compiler serializes wgmma whose groups stay in flight across divergent code.
  // Descriptors: built once; a descriptor's low 14 bits are the address / 16, so moving the
  // start by B bytes (within shared memory, no carry out of the field) adds B / 16.
  const uint64_t qd0 = sdesc(sQ + wr * 64, 0), kd0 = sdesc(sK, 0), vd0 = sdesc(sV, BC * 128);
  constexpr uint64_t kStage = uint64_t(L::kv_elems) * 2 / 16;
  auto issue_s = [&](int st) {  // S = Q K^T of the tile in buffer st
    const uint64_t kd = kd0 + st * kStage;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++)  // k-step kk: column half kk / 4, 32 bytes per step inside it
      wgmma_ss<0>(s, qd0 + ((kk / 4) * BR * 128 + (kk % 4) * 32) / 16, kd + ((kk / 4) * BC * 128 + (kk % 4) * 32) / 16,
                  kk > 0);
    wg_commit();
  };
  auto issue_pv = [&](int st) {  // O += P V, P of the previous tile, V read transposed
    const uint64_t vd = vd0 + st * kStage;
#pragma unroll
    for (int kk = 0; kk < BC / 16; kk++) wgmma_rs<1>(o, pa[kk], vd + kk * 16 * 128 / 16);  // 16 key rows
    wg_commit();
  };
  // the masked online softmax of wgmma.cuh; O's rescale by corr waits in rescale_pack until
  // the products that add to O are done
  auto softmax = [&](int kslot) {
    const int kb = kslot * BC;
    const bool need_mask = kb + BC > Lk || (causal && kb + BC - 1 > qs + wr + shift);
    online_softmax_tile<BC>(s, need_mask, kb, Lk, causal, row0, shift, t, scale_log2, mrow, corr, sum);
  };
  auto rescale_pack = [&] {
    lrow[0] = lrow[0] * corr[0] + sum[0];
    lrow[1] = lrow[1] * corr[1] + sum[1];
    // once a row's maximum settles its corr is exactly 1: a warp whose 16 rows all kept their
    // maximum skips the HD / 4 multiplies (most key tiles of a long row)
    if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
      for (int r = 0; r < 2; r++)
#pragma unroll
        for (int dt = 0; dt < HD / 8; dt++) {
          o[dt][2 * r] *= corr[r];
          o[dt][2 * r + 1] *= corr[r];
        }
    }
#pragma unroll
    for (int kk = 0; kk < BC / 16; kk++) c_to_a(pa[kk], s, kk);
  };

  mbar_wait(&bar_q[c], 0);
  // st, ph: buffer and phase parity of tile kslot (kslot % STAGES, (kslot / STAGES) & 1);
  // pst, pph: those of tile kslot - 1
  int st = 0, pst = STAGES - 1;
  uint32_t ph = 0, pph = 1;
  for (int kslot = 0; kslot <= ntiles && ntiles > 0; kslot++) {
    if (kslot < ntiles) mbar_wait(&full_k[st], ph);
    if (kslot >= 1) mbar_wait(&full_v[pst], pph);
    const bool hand_over = !(c == NC - 1 && kslot == ntiles);

    named_sync(my_bar, 256);  // my turn on the tensor cores
    if (kslot >= 1 && kslot < nmine) {  // the steady state: S of this tile, P V of the last
      wg_fence();
      issue_s(st);
      issue_pv(pst);
      if (hand_over) named_arrive(other_bar, 256);
      wg_wait<1>();  // S (the older group) is done, P V may still run
      fence_regs(s);
      mbar_arrive(&empty_k[st]);
      softmax(kslot);
      // P V stays in flight during the softmax only because of this store (wgmma.cuh)
      order_before_wait(sink + threadIdx.x - 128, sum[0] + sum[1]);
      wg_wait<0>();
      fence_regs(o);
      fence_regs(pa);  // the products read pa until here
      rescale_pack();
    } else if (kslot == 0 && nmine > 0) {  // the first tile: S only
      wg_fence();
      issue_s(st);
      if (hand_over) named_arrive(other_bar, 256);
      wg_wait<0>();
      fence_regs(s);
      mbar_arrive(&empty_k[st]);
      softmax(kslot);
      rescale_pack();
    } else if (kslot == nmine && nmine > 0) {  // after this consumer's last tile: P V only
      wg_fence();
      issue_pv(pst);
      if (hand_over) named_arrive(other_bar, 256);
      wg_wait<0>();
      fence_regs(o);
      fence_regs(pa);
      if (kslot < ntiles) mbar_arrive(&empty_k[st]);
    } else {  // a tile above this consumer's diagonal: only the turn and the release
      if (hand_over) named_arrive(other_bar, 256);
      if (kslot < ntiles) mbar_arrive(&empty_k[st]);
    }
    if (kslot >= 1) mbar_arrive(&empty_v[pst]);  // V of tile kslot - 1 is free for the producer
    pst = st;
    pph = ph;
    if (++st == STAGES) st = 0, ph ^= 1;
  }

  // epilogue: O / l, lse (wgmma.cuh)
  store_out_rows<HD, BR>(out + (int64_t(q0) + qs) * qstride + h * HD, lse + int64_t(q0) * H + h, sQ, o, mrow, lrow,
                         wr, qs, nq, Lq, qstride, H);
#endif
}

}  // namespace

// (declared in wgmma.cuh; the backward uses them too)
CUtensorMap make_map_3d(const void* base, bool f32, int64_t rows, int heads, int hd, int box_cols, int box_rows) {
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
    if (!fn || q != cudaDriverEntryPointSuccess)
      fail("CUDA driver", "cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)", "symbol not found", __FILE__,
           __LINE__);
    return reinterpret_cast<Encode>(fn);
  }();
  CUtensorMap m;
  const cuuint64_t es = f32 ? 4 : 2;
  const cuuint64_t dims[3] = {cuuint64_t(hd), cuuint64_t(heads), cuuint64_t(rows)};
  const cuuint64_t strides[2] = {cuuint64_t(hd) * es, cuuint64_t(heads) * hd * es};  // bytes, dims 1 and 2
  const cuuint32_t box[3] = {cuuint32_t(box_cols), 1, cuuint32_t(box_rows)}, step[3] = {1, 1, 1};
  const CUresult r = encode(&m, f32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3,
                            const_cast<void*>(base), dims, strides, box, step, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    char msg[128];
    std::snprintf(msg, sizeof msg, "error %d for a [%lld, %d, %d] %s tensor", int(r), (long long)rows, heads, hd,
                  f32 ? "fp32" : "bf16");
    fail("CUDA driver", "cuTensorMapEncodeTiled", msg, __FILE__, __LINE__);
  }
  return m;
}
CUtensorMap make_map(const bf* base, int64_t rows, int heads, int hd, int box_rows) {
  return make_map_3d(base, false, rows, heads, hd, 64, box_rows);
}

namespace {

template <int HD, int BC, int STAGES, int NC>
void launch_ws(bf* out, float* lse, const bf* q, const bf* k, const bf* v, const int32_t* cu_q,
               const int32_t* cu_k, int nseq, int max_seqlen, int64_t Nq, int64_t Nk, int H, int KV, bool causal,
               float scale_log2, cudaStream_t s) {
  constexpr int smem = WsSmem<HD, BC, STAGES, NC>::bytes;
  static const bool once = [] {
    CUDA_CHECK(cudaFuncSetAttribute(attn_fwd_sm90_ws<HD, BC, STAGES, NC>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    smem));
    return true;
  }();
  (void)once;
  const CUtensorMap tq = make_map(q, Nq, H, HD, 64), tk = make_map(k, Nk, KV, HD, BC), tv = make_map(v, Nk, KV, HD, BC);
  dim3 grid(ceil_div(max_seqlen, 64 * NC), H, nseq);
  launch_kernel(attn_fwd_sm90_ws<HD, BC, STAGES, NC>, grid, 128 * (NC + 1), smem, s, out, lse, q, k, v, tq, tk, tv,
                cu_q, cu_k, dense_seqlen(cu_q, cu_k, nseq, max_seqlen, Nq, Nk), Nq, H, KV,
                fwd_chunk_pairs(H, KV, nseq, max_seqlen, HD, causal), causal, scale_log2);
  LAUNCH_CHECK();
}

// hd 64: three consumers with 128-key tiles (192-row blocks), or four with 64-key tiles (256-row
// blocks). Per row the four-consumer blocks are slower (their 64-key slots: same call, H200,
// 2026-11-26, forward ms three | four consumers: B8 H12 T1536 0.140 | 0.158, T2048 0.228 | 0.239),
// but a dense bidirectional batch gives every block of the grid the same work at one block per
// SM, so the kernel lasts whole waves of blocks, and at T1024 the 192-row tiles leave 64 rows
// over per head: 576 blocks on 132 SMs take 5 waves, the 384 blocks of 256 rows 3 (B8 H12 T1024
// 0.082 -> 0.074 ms). So: the four-consumer blocks where ceil(blocks / SMs) x their time (1.4x a
// 192-row block's, from the rows above) comes out shorter; causal and ragged batches (blocks of
// unequal work) keep three. LOOM_ATTN_WS64=3 or 4 forces one (the tests run both).
bool ws64_four_consumers(int nseq, int max_seqlen, int H, bool dense, bool causal) {
  if (const char* e = std::getenv("LOOM_ATTN_WS64")) {  // read at every call: tests switch it
    if (e[0] == '3' && e[1] == 0) return false;
    if (e[0] == '4' && e[1] == 0) return true;
  }
  if (causal || !dense) return false;
  const double sms = sm_count(), pairs = double(nseq) * H;
  const double waves3 = std::ceil(pairs * ceil_div(max_seqlen, 192) / sms);
  const double waves4 = std::ceil(pairs * ceil_div(max_seqlen, 256) / sms);
  return waves4 * 1.4 < waves3;
}

}  // namespace

bool fwd_sm90_ws_supported(const void* q, const void* k, const void* v) {
  // TMA needs 16-byte aligned base addresses (row strides are multiples of 128 bytes here)
  return ((reinterpret_cast<uintptr_t>(q) | reinterpret_cast<uintptr_t>(k) | reinterpret_cast<uintptr_t>(v)) & 15) == 0;
}

void fwd_sm90_ws(bf* out, float* lse, const bf* q, const bf* k, const bf* v, const int32_t* cu_q,
                 const int32_t* cu_k, int nseq, int max_seqlen, int64_t Nq, int64_t Nk, int H, int KV, int hd,
                 bool causal, float scale_log2, cudaStream_t s) {
  // hd 128: two consumers, 128-key tiles, 3 buffers; hd 64: three consumers (its softmax is
  // as long as at hd 128 against half the products, and a third warpgroup hides more of it),
  // 4 buffers, or four consumers with 64-key tiles and 6 buffers where their whole waves are
  // shorter (ws64_four_consumers). The header's table has the alternatives measured.
  if (hd == 128) {
    launch_ws<128, 128, 3, 2>(out, lse, q, k, v, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV, causal, scale_log2, s);
    return;
  }
  if (ws64_four_consumers(nseq, max_seqlen, H, dense_batch(cu_q, cu_k, nseq, max_seqlen, Nq, Nk), causal))
    launch_ws<64, 64, 6, 4>(out, lse, q, k, v, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV, causal, scale_log2, s);
  else
    launch_ws<64, 128, 4, 3>(out, lse, q, k, v, cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV, causal, scale_log2, s);
}

}  // namespace loom::cuda::attn
