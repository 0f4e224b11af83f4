/*
 * matmul.cu: GEMM, linear forward and linear backward through cuBLASLt.
 * Reference: kernels/cpu/matmul.cpp.
 *
 * Math (row-major, T = float or bf16, accumulation always fp32):
 *   gemm     C[b] = alpha op(A[b]) op(B[b]) + beta C[b]     op(A) [M,K], op(B) [K,N], C [M,N]
 *            beta == 0 never reads C (cuBLAS does not touch C then; the test poisons C with NaN)
 *   linear_forward   out[N,O] = inp[N,I] W[O,I]^T + bias[O]                      (=)
 *   linear_forward_add  out = resid + inp W^T + bias: cuBLASLt with beta = 1 and C = resid
 *                    (D = out; the sum rounded once; in place when out == resid), the
 *                    residual add of a block carried by its product. H200, 2026-11-27, same
 *                    call against linear_forward + add_layernorm: MIM step 24.50 -> 24.21 ms,
 *                    VLM 54.40 -> 54.12 (bench/RESULTS.md).
 *   linear_backward  dinp[N,I] = dout[N,O] W[O,I]                               (=)
 *                    dW[O,I]  += dout^T inp                                     (+=, beta 1)
 *                    dbias[O] += sum_rows dout                                  (+=)
 *   linear_forward_batched  out[b] = inp W_b^T + bias_b, W_b / bias_b / out[b] one after another
 *                    (parts of one weight: a ViT's q, k, v): one strided-batched GEMM whose input
 *                    has batch stride 0 and whose bias epilogue steps by O per item
 *                    (CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE)
 * cuBLASLt is column-major: a row-major X[r,c] is the column-major X^T. So C = op(A) op(B)
 *   is computed as C^T = op(B)^T op(A)^T: Lt's "A" is our B, its "B" is our A, m = N, n = M.
 * Precision: bf16 inputs use CUBLAS_COMPUTE_32F (tensor cores, fp32 accumulate). fp32 inputs
 *   also use CUBLAS_COMPUTE_32F, which is true fp32 (no TF32; TF32 is the separate
 *   _FAST_TF32 compute type), so the f32 path stays exact enough for the f32 fixtures.
 * Epilogues: linear_forward adds the bias in cuBLASLt's BIAS epilogue (one pass over out
 *   instead of two). linear_gelu_forward uses GELU_AUX_BIAS: out = gelu(acc + bias) and the
 *   pre-activation written beside it (aux) for the backward (GELU_BIAS, out alone, when no backward
 *   follows: pre null; the aux store made fc1 1.5-1.7x as long as a product of the same FLOPs
 *   without an epilogue, H100 2026-11-27); linear_dgelu_backward uses DGELU:
 *   dpre = (dout W) * gelu'(aux) in the GEMM's epilogue, then the bias column sum (+=). cuBLASLt's
 *   GELU is the tanh approximation, the one the CPU reference uses (tests/cuda compare them). dbias is a column-sum kernel, not cuBLASLt's
 *   BGRADB / DGELU_BGRAD epilogues. Both were measured in the SPEC MIM step (H100, 2026-11-24,
 *   CUPTI trace, scratch vector + add since they write = where the contract is +=): cuBLASLt
 *   ran each as the GEMM plus a separate reduction kernel, not inside the GEMM's tiles.
 *   BGRADB: 83 reductions 0.78 ms + adds 0.14 against the column sums' 1.13 ms, for a second
 *   bf16 rounding of dbias; DGELU_BGRAD: the fused DGELU GEMM (16 calls, 1.41 ms) became a
 *   plain GEMM (0.8 ms) plus an epilogue kernel of 3.05 ms. Together +2.1 ms a step: dropped.
 * Tried and dropped (H100, 2026-11-24): timing cuBLASLt's first 8 candidate algorithms on the
 *   first call of each shape bucket and keeping the fastest (as max-autotune does). Over the SPEC
 *   MIM step's 28 shapes the chosen algorithms summed 1377 us against the heuristic's 1427 (one
 *   call each; 11 shapes changed), but the steps, same call, two rounds: bench_mim 28.3 / 28.6 ms
 *   tuned against 28.5 / 28.6, contrastive 56.0 / 55.8 against 56.1 / 56.4, bench_vlm_sft 72.5 /
 *   72.0 against 71.9 / 72.0 (and its p90 up to 3x while new buckets were timed in the steps):
 *   within noise, for losses that would then differ from run to run.
 * Tried and dropped (H100, 2026-11-27): the column sums and their finish in one launch, the last
 *   block of each column group (an atomic counter per group, set back to 0 by that block, one
 *   counter array per stream) adding the splits in the same order: the same bits, but bench_mim
 *   26.02 / 26.01 ms against 25.98 / 26.01 and contrastive 51.21 against 51.28 (same call); the
 *   last block's loads and serial adds took as long as the second launch they replaced.
 * Tried and dropped (H200, 2026-11-26): column sums with 16-byte loads (8 bf16 per thread, a
 *   block over 256 columns) and up to 256 row splits (~512 blocks) instead of 2-byte loads and
 *   <= 64 splits. Correct (test_cuda_matmul with O 776 and 4100 rows), but the steps did not
 *   move (same call, two rounds, before | after: bench_mim 25.33 / 25.45 | 25.38 / 25.40 ms,
 *   contrastive 50.29 / 50.45 | 50.50 / 50.23, fixed-batch VLM 58.63 / 58.43 | 58.29 / 58.56).
 * Kept since (H200, 2026-12-02): colsum.cuh's v2, 16-byte loads with eight rows' loads issued
 *   before their adds and ~512 blocks, finished by 32 x 32 blocks (each thread adding every
 *   32nd split: the one-thread-per-column finish over 256 splits took 6-7 us, Nsight Compute),
 *   with the norm backward's finish the same kernel (colsum.cuh's finish_rows). Alone (Nsight
 *   Compute, caches flushed): the predictor's fc1 bias, 50176 x 1536, 47.0 us = 3.33 TB/s.
 *   Steps, one binary, same call, LOOM_COLSUM=1 LOOM_FINISH_GROUPS=8 | the new forms, medians
 *   of steps 6-30: the reference's VLM batch 48.20 / 48.18 | 47.67 / 47.71 ms, bench_mim 22.55
 *   | 22.33, contrastive 42.47 / 42.74 | 42.59 / 42.37. The wide sums alone with the old 32 x 8
 *   finishes (the call before): 48.74 / 48.53 | 48.87 / 48.71, 22.74 / 22.98 | 22.68 / 22.63,
 *   43.17 / 43.36 | 43.21 / 43.19, so the finishes are the likely part that moved.
 *   test_cuda_matmul's N 4100 O 776 case runs v2's splits and 8-row steps.
 * Tried and dropped (H200, 2026-12-01): DGELU apart, as compiled PyTorch runs it: the plain
 *   product (cuBLASLt's nvjet kernel), then one pass for the GELU's gradient and the bias's column
 *   sums together (16-byte loads and stores, the column sums' split order, so the bits of
 *   gelu_backward + the column sums). MIM step trace (LOOM_PDL=0, per step): the xmma DGELU
 *   kernel's 16 calls 1.389 ms and the column sums' 0.342 of them gone, the plain products +0.780
 *   (16 x 49 us) and the fused pass +0.957 (16 x 60 us, ~2.3 TB/s): GPU busy 22.59 against 22.53
 *   ms; steps, two rounds, one binary, against the DGELU epilogue: bench_mim 22.85 / 22.85 against
 *   22.65 / 22.64, contrastive 43.07 / 43.04 against 43.15 / 42.98, the reference's VLM batch
 *   49.49 / 49.95 against 49.47 / 49.66. The epilogue stays.
 * Measured (H100, 2026-12-06): the DGELU product with the weight transposed beforehand (cuBLASLt's
 *   "TN", as the forwards run) is no faster than as stored ("NN"), over the heuristic's first 8
 *   candidates of the five SPEC shapes; the DGELU epilogue costs 1.35-1.45x the plain product at
 *   K 768 and 1.9-2.2x at the predictor's K 384 in every layout. gemm_sm90's epilogue 5 was slower
 *   on all five shapes (bench_gemm_shapes' dgelu rows; bench/RESULTS.md "DGELU layouts").
 * Measured (H200, 2026-12-06; bench/RESULTS.md "SM-count target"): LOOM_SIDE_SMS, cuBLASLt's
 *   SM_COUNT_TARGET for the side stream's products (sm_target_of below; off by default): at 120 of
 *   132 SMs the contrastive MIM step 39.98 -> 39.63 ms (three rounds in two calls), the VLM step
 *   within noise (+0.07 ms), at 108 the VLM step +0.18 ms (one round). On another H200
 *   (2026-12-07) MIM -0.11 and contrastive -0.10 ms, both within the spread of the rounds.
 * Measured (H100, 2026-12-07; bench/RESULTS.md "candidates"): the heuristic's first 5 algorithms
 *   for every product of the MIM steps, each run back to back at the power limit
 *   (bench_gemm_shapes LOOM_BENCH_GEMM_RANKS, LOOM_BENCH_SUSTAIN_MS). The first is within a few
 *   percent of the best on nearly every product; taking the others where they beat it by 3% in
 *   sustained time (LOOM_GEMM_PICK below, bench/gemm_pick_h100.txt): bench_mim -0.10 to -0.16 ms
 *   (~0.6%), contrastive -0.17 (0.4%). Ranked by energy per call instead, nothing (-0.09 ms,
 *   noise): NVML's counter moves every ~100 ms, so 0.5 s windows read energy to +-20%. Not on by
 *   default: a table names ranks of one cuBLASLt version's order on one GPU.
 * Plans: matmul descriptors, layouts and the heuristic's algorithm are cached per shape,
 *   transposes, strides, epilogue and pointer alignment (the heuristic is ~10 us to ~3 ms of
 *   host time, far more than a small GEMM). A new shape first tries the algorithm of its
 *   bucket (sizes rounded up to 1/8 of their power of two; cublasLtMatmulAlgoCheck), so
 *   row counts that change every step do not run the heuristic every step. LOOM_GEMM_LOG=1
 *   prints each heuristic run with its host time (stderr).
 *   Measured (H100, 2026-11-25, bench_vlm_sft.cfg with a new batch per step, 60 steps): the
 *   vision tower's 12 products meet a new bucket when the image count does, 0.2 ms of heuristic
 *   each (~2 ms a round; rounds in steps 3, 4, 7, 11, 12, 13, 15, 26, 29, none after), and the
 *   steps that met one took up to 5-16 ms longer than their FLOPs say (more than the
 *   heuristic's 2 ms; the first launches of the chosen algorithms' kernels are the likely rest,
 *   not measured apart): p90 / median 1.06-1.17 over steps 6-30, 1.02-1.04 over 31-60. Tried and dropped: the algorithm of the same product with another M or K
 *   (within 1.25x, the other equal) before the bucket: 48 heuristic runs instead of 144 and the
 *   spikes of steps 2, 5, 30 gone, but steps 31-60 0.35-0.85 ms slower on average (the borrowed
 *   algorithms fit the new shapes less well), a loss in any run longer than its first steps.
 * Napkin: gemm_bf16 8192^3 = 1.1 TFLOP; at ~700 TFLOP/s dense bf16 that is ~1.6 ms.
 *   Column sum: N*O*sizeof(T) read once.
 * Launch shape (column sum, colsum.cuh, shared with reduce_sum_to): grid (ceil(O/32), R
 *   row-splits), block 32x8; partial sums [R, O] in fp32, then one thread per column adds the R
 *   partials in order to dbias: deterministic, no atomics.
 * Versions: v1 cuBLASLt + BIAS epilogue. Measured (H200, bench/bench_kernels_a.cpp):
 *   gemm_bf16 8192^3 1.37-1.38 ms = 798-803 TFLOP/s (PyTorch a @ b: 1.396 ms, 788 TFLOP/s).
 * Test: tests/cuda/test_cuda_matmul.cpp [matmul]:
 *   bash tools/gpu-kernels.sh tests/cuda/test_cuda_matmul.cpp
 */
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels/cuda/colsum.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gemm_sm90.h"
#include "kernels/cuda/rope_table.h"
#include "kernels/gemm_pick.h"

namespace loom::cuda {

namespace {

struct PlanKey {
  int dtype, M, N, K, ta, tb, batch, epilogue, align_a, align_b, align_c, align_bias, align_aux, sm_target;
  int candidate;  // -1: the heuristic's first algorithm (or the bucket's); r >= 0: its r-th
  int64_t sa, sb, sc;
  bool operator==(const PlanKey& o) const { return std::memcmp(this, &o, sizeof(PlanKey)) == 0; }
};
struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const {
    const unsigned char* p = reinterpret_cast<const unsigned char*>(&k);
    size_t h = 1469598103934665603ull;  // FNV-1a over the bytes
    for (size_t i = 0; i < sizeof(PlanKey); i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
  }
};
struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool ok = false;
};

int alignment(const void* p) {
  uintptr_t u = reinterpret_cast<uintptr_t>(p);
  int a = 256;
  while (a > 1 && (u % a)) a >>= 1;
  return a;
}

cublasLtMatrixLayout_t make_layout(cudaDataType_t t, int rows, int cols, int ld, int batch, int64_t stride) {
  cublasLtMatrixLayout_t l;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, t, rows, cols, ld));
  if (batch > 1) {
    CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof(batch)));
    CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
  }
  return l;
}

// Which of the heuristic's algorithms a product takes, beyond its first: gemm_set_candidate's
// rank for every new plan (bench_gemm_shapes' LOOM_BENCH_GEMM_RANKS), or LOOM_GEMM_PICK's table
// for named shapes. A rank the heuristic does not reach counts in g_candidate_missing and leaves
// the plan without an algorithm (the caller's fallback, as for a shape cuBLASLt cannot run).
int g_candidate = -1;
long g_candidate_missing = 0;
std::string g_last_algo;  // the last candidate plan's algorithm, in words (candidate mode only)

// LOOM_GEMM_PICK=file (kernels/gemm_pick.h): a plan of the sizes a line names takes the
// heuristic's rank-th algorithm instead of its first. Read at the first plan; a bad table stops
// the run there with its file and line.
int pick_of(const PlanKey& k) {
  static const std::vector<GemmPick> table = [] {
    const char* path = std::getenv("LOOM_GEMM_PICK");
    if (!path || !*path) return std::vector<GemmPick>{};
    std::vector<GemmPick> t = load_gemm_picks(path);
    std::fprintf(stderr, "loom: LOOM_GEMM_PICK %s: %zu products take another cuBLASLt algorithm\n", path, t.size());
    return t;
  }();
  return find_gemm_pick(table, k.M, k.N, k.K, k.ta, k.tb, k.epilogue, k.batch);
}

std::string describe(const cublasLtMatmulAlgo_t& a) {
  int id = 0, tile = 0, stages = 0, splitk = 0, swizzle = 0, custom = 0, cluster = 0;
  size_t got = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &got);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &got);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), &got);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk), &got);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swizzle, sizeof(swizzle), &got);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom, sizeof(custom), &got);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster), &got);
  char buf[160];
  std::snprintf(buf, sizeof buf, "id %d tile %d stages %d splitk %d swizzle %d custom %d cluster %d", id, tile, stages,
                splitk, swizzle, custom, cluster);
  return buf;
}

// Build (or fetch) the plan for row-major C[M,N] = op(A) op(B), see the file comment.
Plan& get_plan(const PlanKey& k) {
  static std::mutex mu;
  static std::unordered_map<PlanKey, Plan, PlanKeyHash> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(k);
  if (it != cache.end()) return it->second;
  Plan p;
  cudaDataType_t t = k.dtype == 0 ? CUDA_R_32F : k.dtype == 1 ? CUDA_R_16BF : CUDA_R_16F;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t opA = k.tb ? CUBLAS_OP_T : CUBLAS_OP_N;  // Lt's A is our B
  cublasOperation_t opB = k.ta ? CUBLAS_OP_T : CUBLAS_OP_N;  // Lt's B is our A
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &opA, sizeof(opA)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &opB, sizeof(opB)));
  cublasLtEpilogue_t epi = cublasLtEpilogue_t(k.epilogue);
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
  if (k.sm_target > 0) {  // the SMs the heuristic plans for (sm_target_of below)
    const int32_t sms = k.sm_target;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sms, sizeof(sms)));
  }
  // our B, stored row-major [K,N] (or [N,K] when transposed) = column-major [N,K] ([K,N])
  p.a = k.tb ? make_layout(t, k.K, k.N, k.K, k.batch, k.sb) : make_layout(t, k.N, k.K, k.N, k.batch, k.sb);
  // our A, stored row-major [M,K] (or [K,M]) = column-major [K,M] ([M,K])
  p.b = k.ta ? make_layout(t, k.M, k.K, k.M, k.batch, k.sa) : make_layout(t, k.K, k.M, k.K, k.batch, k.sa);
  p.c = make_layout(t, k.N, k.M, k.N, k.batch, k.sc);

  size_t ws = 0;
  cublaslt_workspace(&ws);
  cublasLtMatmulPreference_t pref;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  uint32_t al[4] = {uint32_t(k.align_b), uint32_t(k.align_a), uint32_t(k.align_c), uint32_t(k.align_c)};
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al[0], 4));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al[1], 4));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al[2], 4));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al[3], 4));
  if (k.epilogue == CUBLASLT_EPILOGUE_BIAS || k.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS ||
      k.epilogue == CUBLASLT_EPILOGUE_GELU_BIAS) {
    // The bias pointer is set per call; the heuristic only needs to know its type.
    cudaDataType_t bt = t;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
    if (k.batch > 1) {  // a bias per batch item, one after another (linear_forward_batched)
      int64_t bs = k.N;
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, &bs, sizeof(bs)));
    }
  }
  if (k.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || k.epilogue == CUBLASLT_EPILOGUE_DGELU) {
    // the GELU input ("aux"): laid out like the output, row-major [M, N] = column-major ld N
    int64_t ld = k.N;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld)));
  }
  // The heuristic costs 1-3 ms of host time for some shapes: a batch whose row count changes
  // every step (a VLM batch's image count) would pay it in every step. So the algorithm found
  // for a shape is offered first to the shapes of its bucket (each size rounded up to 1/8 of
  // its power of two), checked with cublasLtMatmulAlgoCheck (microseconds), and the heuristic
  // runs only when the bucket has none or it does not fit.
  static std::unordered_map<PlanKey, cublasLtMatmulAlgo_t, PlanKeyHash> by_bucket;
  PlanKey bk = k;
  auto bucket = [](int v) {
    if (v <= 256) return v;
    int p2 = 1 << (31 - __builtin_clz(unsigned(v)));
    int step = p2 / 8;
    return (v + step - 1) / step * step;
  };
  bk.M = bucket(k.M), bk.N = bucket(k.N), bk.K = bucket(k.K);
  bk.sa = bk.sb = bk.sc = 0;
  const int rank = k.candidate >= 0 ? k.candidate : pick_of(k);
  if (rank >= 0 && k.candidate < 0)
    std::fprintf(stderr, "loom: LOOM_GEMM_PICK: M=%d N=%d K=%d ta=%d tb=%d epilogue=%d batch=%d takes rank %d\n", k.M,
                 k.N, k.K, k.ta, k.tb, k.epilogue, k.batch, rank);
  if (rank >= 0) {  // the heuristic's rank-th algorithm; not offered to the bucket
    std::vector<cublasLtMatmulHeuristicResult_t> res(size_t(rank) + 1);
    int count = 0;
    if (cublasLtMatmulAlgoGetHeuristic(cublaslt_handle(), p.op, p.a, p.b, p.c, p.c, pref, rank + 1, res.data(),
                                       &count) == CUBLAS_STATUS_SUCCESS &&
        count > rank) {
      p.algo = res[size_t(rank)].algo;
      p.ok = true;
    } else if (k.candidate >= 0) {
      g_candidate_missing++;  // the bench skips this rank
    } else {  // a table made elsewhere: this product runs the heuristic's first, as without it
      std::fprintf(stderr, "loom: LOOM_GEMM_PICK: the heuristic offers %d algorithms here, not rank %d; taking its first\n",
                   count, rank);
    }
    if (p.ok || k.candidate >= 0) {
      cublasLtMatmulPreferenceDestroy(pref);
      return cache.emplace(k, p).first->second;
    }
  }
  auto bit = rank >= 0 ? by_bucket.end() : by_bucket.find(bk);
  if (bit != by_bucket.end()) {
    cublasLtMatmulHeuristicResult_t chk{};
    if (cublasLtMatmulAlgoCheck(cublaslt_handle(), p.op, p.a, p.b, p.c, p.c, &bit->second, &chk) ==
            CUBLAS_STATUS_SUCCESS &&
        chk.workspaceSize <= ws) {
      p.algo = bit->second;
      p.ok = true;
    }
  }
  if (!p.ok) {
    cublasLtMatmulHeuristicResult_t res{};
    int count = 0;
    const auto t0 = std::chrono::steady_clock::now();
    cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(cublaslt_handle(), p.op, p.a, p.b, p.c, p.c, pref, 1, &res, &count);
    if (const char* e = std::getenv("LOOM_GEMM_LOG"); e && e[0] == '1')  // each heuristic run, its host time
      std::fprintf(stderr, "loom: cuBLASLt heuristic M=%d N=%d K=%d ta=%d tb=%d batch=%d epilogue=%d: %.2f ms\n", k.M,
                   k.N, k.K, k.ta, k.tb, k.batch, k.epilogue,
                   std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    if (st == CUBLAS_STATUS_SUCCESS && count > 0) {
      p.algo = res.algo;
      p.ok = true;
      by_bucket[bk] = res.algo;
    }
  }
  cublasLtMatmulPreferenceDestroy(pref);
  return cache.emplace(k, p).first->second;
}

// How many SMs a product plans for: 0 (the device's count) unless LOOM_SIDE_SMS / LOOM_MAIN_SMS
// set one for the products of the side stream (weight gradients, the MIM target's forward) or
// of the main stream (a measurement switch: cuBLASLt's SM_COUNT_TARGET sizes its persistent grids
// for fewer SMs, leaving the rest to the other stream's kernels).
int sm_target_of(bool side) {
  auto read = [](const char* name) {
    const char* e = std::getenv(name);
    const int v = e ? std::max(0, std::atoi(e)) : 0;
    return v >= sm_count() ? 0 : v;
  };
  static const int main_sms = read("LOOM_MAIN_SMS"), side_sms = read("LOOM_SIDE_SMS");
  return side ? side_sms : main_sms;
}

// Returns false (and does nothing) when cuBLASLt has no algorithm for this plan. `epilogue`:
// CUBLASLT_EPILOGUE_DEFAULT / BIAS (bias given) / GELU_AUX_BIAS (bias and aux = the GELU input
// written) / GELU_BIAS (bias, no aux) / DGELU (aux = the GELU input read).
// `cin`: the C read when beta != 0, when it is not the output itself (linear_forward_add's
// residual; same layout as the output, D = C_out).
template <class T>
bool lt_matmul(T* C, const T* A, const T* B, const T* bias, int M, int N, int K, bool ta, bool tb,
               float alpha, float beta, int batch, int64_t sa, int64_t sb, int64_t sc, Stream s,
               cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT, const void* aux = nullptr,
               const T* cin = nullptr) {
  if (!cin) cin = C;
  PlanKey k;
  std::memset(&k, 0, sizeof k);  // padding bytes take part in the hash and compare
  k.dtype = std::is_same_v<T, float> ? 0 : std::is_same_v<T, bf16> ? 1 : 2;
  k.M = M; k.N = N; k.K = K; k.ta = ta; k.tb = tb; k.batch = batch;
  k.sa = batch > 1 ? sa : 0; k.sb = batch > 1 ? sb : 0; k.sc = batch > 1 ? sc : 0;
  if (epilogue == CUBLASLT_EPILOGUE_DEFAULT && bias) epilogue = CUBLASLT_EPILOGUE_BIAS;
  k.epilogue = epilogue;
  k.align_a = alignment(A); k.align_b = alignment(B); k.align_c = std::min(alignment(C), alignment(cin));
  k.align_bias = bias ? alignment(bias) : 0;
  k.align_aux = aux ? alignment(aux) : 0;
  k.sm_target = sm_target_of(side_scope_active());
  k.candidate = g_candidate;
  Plan& p = get_plan(k);
  if (!p.ok) return false;
  if (g_candidate >= 0) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "%d %d %d %d %d %d %d", k.M, k.N, k.K, k.ta, k.tb, k.epilogue, k.batch);
    g_last_algo = std::string(buf) + " | " + describe(p.algo);
  }
  if (bias) {
    const void* bp = bias;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof(bp)));
  }
  if (aux) {
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
  }
  size_t ws = 0;
  void* w = cublaslt_workspace(&ws);
  CUBLAS_CHECK(cublasLtMatmul(cublaslt_handle(), p.op, &alpha, B, p.a, A, p.b, &beta, cin, p.c, C, p.c,
                              &p.algo, w, ws, s));
  return true;
}

void say_once(const char* what) {
  static std::mutex mu;
  static std::unordered_map<std::string, bool> said;
  std::lock_guard<std::mutex> lock(mu);
  if (!said[what]) {
    said[what] = true;
    std::fprintf(stderr, "loom: %s\n", what);
  }
}

// out[N,O] += bias[O] (the fallback when cuBLASLt has no BIAS-epilogue algorithm)
template <class DT>
__global__ void add_bias_kernel(DT* __restrict__ out, const DT* __restrict__ bias, int64_t N, int O) {
  pdl_entry();
  int64_t n = N * O;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = from_float<DT>(to_float(out[i]) + to_float(bias[i % O]));
}

// add_bias_kernel's launch (T the host type), for linear_forward's and linear_forward_add's
// fallbacks
template <class T>
void add_bias(T* out, const T* bias, int64_t N, int O, Stream s) {
  const int64_t n = N * O;
  const int g = int(std::min<int64_t>(4096, (n + 255) / 256));
  launch_kernel(add_bias_kernel<dev_t<T>>, g, 256, 0, s, dptr(out), dptr(bias), N, O);
  LAUNCH_CHECK();
}

}  // namespace

// bench_gemm_shapes' candidate ranking (LOOM_BENCH_GEMM_RANKS): every plan made after this call
// takes the heuristic's rank-th algorithm (-1: back to the first, and to the buckets); plans are
// cached with their rank, so a product measured at several ranks keeps each.
void gemm_set_candidate(int rank) { g_candidate = rank < 0 ? -1 : rank; }
// how many candidate plans found no algorithm at their rank (the heuristic offered fewer)
long gemm_candidate_missing() { return g_candidate_missing; }
// "M N K ta tb epilogue batch | id .. tile .. stages .." of the last candidate product run
std::string gemm_last_algo() { return g_last_algo; }

template <class T>
void gemm(T* C, const T* A, const T* B, int M, int N, int K, bool transA, bool transB, double alpha,
          double beta, int batch, int64_t strideA, int64_t strideB, int64_t strideC, Stream s) {
  if (M <= 0 || N <= 0 || batch <= 0) return;
  if (K <= 0) {
    throw std::runtime_error("gemm: K must be > 0, got K=" + std::to_string(K));
  }
  if (!lt_matmul(C, A, B, (const T*)nullptr, M, N, K, transA, transB, float(alpha), float(beta), batch,
                 strideA, strideB, strideC, s)) {
    char buf[200];
    std::snprintf(buf, sizeof buf, "gemm: cuBLASLt has no algorithm for M=%d N=%d K=%d batch=%d", M, N, K, batch);
    throw std::runtime_error(buf);
  }
}

// Which calls gemm_sm90.cu takes, from LOOM_GEMM90 (read at every call: tests switch it):
// "0" none, "1" every call it supports, anything else (or unset) the defaults below.
namespace {
enum class Gemm90 { off, defaults, all };
Gemm90 gemm90_mode() {
  const char* e = std::getenv("LOOM_GEMM90");
  if (e && e[0] == '0' && e[1] == 0) return Gemm90::off;
  if (e && e[0] == '1' && e[1] == 0) return Gemm90::all;
  return Gemm90::defaults;
}
}  // namespace

// gemm_sm90.cu's kernel instead of cuBLASLt for a bf16 linear forward (bias, GELU, residual) on
// a Hopper device, with LOOM_GEMM90=1 (every call the kernel supports). Off by default: it runs
// the SPEC steps' forward products about as fast as cuBLASLt (bench_gemm_shapes, H200,
// 2026-11-27), but the steps were slower with it on the products of inner size <= 1024 and
// those of >= 8 tiles per multiprocessor (same binary, same call, medians of steps 6-30, two
// rounds: bench_mim 23.96 / 23.99 -> 24.33 / 24.33 ms, contrastive 46.05 / 46.02 ->
// 46.94 / 46.95, fixed-batch VLM 52.45 / 52.44 -> 52.86 / 53.13; a kernel trace of the MIM
// step without PDL: products 15.00 -> 15.13 ms). What it is for is the epilogues cuBLASLt
// lacks: linear_swiglu_forward below uses it by default.
template <class T>
bool sm90_linear(T* out, T* pre, const T* inp, const T* weight, const T* bias, const T* resid, int64_t N, int I, int O,
                 bool gelu, Stream s) {
  if constexpr (!std::is_same_v<T, bf16>) {
    return false;
  } else {
    if (gemm90_mode() != Gemm90::all) return false;
    if (!gemm90::supported(out, pre, resid, inp, weight, bias, N, I, O)) return false;
    gemm90::linear_forward(dptr(out), dptr(pre), dptr(inp), dptr(weight), dptr(bias), dptr(resid), N, I, O, gelu, s);
    return true;
  }
}

template <class T>
void linear_forward(T* out, const T* inp, const T* weight, const T* bias, int64_t N, int I, int O, Stream s) {
  if (N <= 0 || O <= 0) return;
  if (sm90_linear(out, (T*)nullptr, inp, weight, bias, (const T*)nullptr, N, I, O, false, s)) return;
  if (N > INT32_MAX) throw std::runtime_error("linear_forward: N too large for one GEMM");
  if (bias && lt_matmul(out, inp, weight, bias, int(N), O, I, false, true, 1.f, 0.f, 1, 0, 0, 0, s)) return;
  gemm(out, inp, weight, int(N), O, I, false, true, 1.0, 0.0, 1, 0, 0, 0, s);
  if (bias) {
    say_once("linear_forward: no cuBLASLt BIAS-epilogue algorithm for this shape; adding the bias in a separate kernel");
    add_bias(out, bias, N, O, s);
  }
}

template <class T>
void linear_forward_add(T* out, const T* inp, const T* weight, const T* bias, const T* resid, int64_t N, int I, int O,
                        Stream s) {
  if (N <= 0 || O <= 0) return;
  if (N > INT32_MAX) throw std::runtime_error("linear_forward_add: N too large for one GEMM");
  if (sm90_linear(out, (T*)nullptr, inp, weight, bias, resid, N, I, O, false, s)) return;
  if (lt_matmul(out, inp, weight, bias, int(N), O, I, false, true, 1.f, 1.f, 1, 0, 0, 0, s, CUBLASLT_EPILOGUE_DEFAULT,
                nullptr, resid))
    return;
  say_once("linear_forward_add: no cuBLASLt algorithm reads the residual for this shape; copying it first");
  if (out != resid) memcpy_d2d(out, resid, size_t(N) * O * sizeof(T), s);
  gemm(out, inp, weight, int(N), O, I, false, true, 1.0, 1.0, 1, 0, 0, 0, s);
  if (bias) add_bias(out, bias, N, O, s);
}

template <class T>
void linear_forward_batched(T* out, const T* inp, const T* weight, const T* bias, int64_t N, int I, int O, int batch,
                            Stream s) {
  if (N <= 0 || O <= 0 || batch <= 0) return;
  if (N > INT32_MAX) throw std::runtime_error("linear_forward_batched: N too large for one GEMM");
  if (batch > 1 && lt_matmul(out, inp, weight, bias, int(N), O, I, false, true, 1.f, 0.f, batch, 0, int64_t(O) * I,
                             N * O, s))
    return;
  for (int b = 0; b < batch; b++)  // one item, or no batched algorithm: one GEMM each
    linear_forward(out + b * N * O, inp, weight + int64_t(b) * O * I, bias ? bias + int64_t(b) * O : nullptr, N, I, O, s);
}

template <class T>
void linear_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight, int64_t N,
                     int I, int O, Stream s) {
  if (N <= 0) return;
  if (N > INT32_MAX) throw std::runtime_error("linear_backward: N too large for one GEMM");
  if (dinp) gemm(dinp, dout, weight, int(N), I, O, false, false, 1.0, 0.0, 1, 0, 0, 0, s);
  if (dweight) gemm(dweight, dout, inp, O, I, int(N), true, false, 1.0, 1.0, 1, 0, 0, 0, s);
  if (dbias) column_sums(dbias, dout, N, O, /*accumulate=*/true, s);
}

// The fallbacks of the fused GELU GEMMs, when cuBLASLt offers no epilogue algorithm for a
// shape or dtype: the same math in separate passes (reported once).
template <class T>
void linear_gelu_forward(T* out, T* pre, const T* inp, const T* weight, const T* bias, int64_t N, int I, int O,
                         Stream s) {
  if (N <= 0 || O <= 0) return;
  if (N > INT32_MAX) throw std::runtime_error("linear_gelu_forward: N too large for one GEMM");
  if (sm90_linear(out, pre, inp, weight, bias, (const T*)nullptr, N, I, O, true, s)) return;
  // pre null (a forward without a backward, e.g. the EMA target): GELU_BIAS writes out alone
  if (bias && lt_matmul(out, inp, weight, bias, int(N), O, I, false, true, 1.f, 0.f, 1, 0, 0, 0, s,
                        pre ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_BIAS, pre))
    return;
  say_once("linear_gelu_forward: no cuBLASLt GELU epilogue algorithm for this shape; GEMM and GELU run apart");
  T* p = pre ? pre : out;
  linear_forward(p, inp, weight, bias, N, I, O, s);
  gelu_forward(out, p, N * O, s);
}

// gemm_sm90.cu's SwiGLU epilogue on Hopper for bf16 (LOOM_GEMM90=0 turns it off with the rest),
// else the product and swiglu_forward_joined
template <class T>
void linear_swiglu_forward(T* gu, T* h, const T* inp, const T* wgu, int64_t N, int C, int I, Stream s) {
  if (N <= 0 || I <= 0) return;
  if constexpr (std::is_same_v<T, bf16>) {
    if (gemm90_mode() != Gemm90::off && gemm90::swiglu_supported(gu, h, inp, wgu, N, C, I)) {
      gemm90::linear_swiglu_forward(dptr(gu), dptr(h), dptr(inp), dptr(wgu), N, C, I, s);
      return;
    }
  }
  linear_forward(gu, inp, wgu, (const T*)nullptr, N, C, 2 * I, s);
  swiglu_forward_joined(h, gu, N, I, s);
}

// The same for the backward through the down projection (gemm_sm90.cu's SwiGLU-backward
// epilogue), else the input-gradient product into a scratch dh and swiglu_backward_joined
template <class T>
void linear_swiglu_backward(T* dgu, T* prod, const T* dout, const T* wd, const T* gu, int64_t N, int C2, int I,
                            Stream s) {
  if (N <= 0 || I <= 0) return;
  if constexpr (std::is_same_v<T, bf16>) {
    if (gemm90_mode() != Gemm90::off && gemm90::swiglu_bwd_supported(dgu, prod, dout, wd, gu, N, C2, I)) {
      gemm90::linear_swiglu_backward(dptr(dgu), dptr(prod), dptr(dout), dptr(wd), dptr(gu), N, C2, I, s);
      return;
    }
  }
  T* dh = static_cast<T*>(device_malloc(sizeof(T) * size_t(N) * I));
  linear_backward(dh, (T*)nullptr, (T*)nullptr, dout, (const T*)nullptr, wd, N, I, C2, s);
  swiglu_backward_joined(dgu, prod, dh, gu, N, I, s);
  device_free(dh);  // stream-ordered reuse
}

// gemm_sm90.cu's q|k|v epilogue (RoPE on the accumulators) on Hopper for bf16 at hd 64 (off with
// LOOM_GEMM90=0, or LOOM_GEMM90_QKV=0 alone, read at every call), else the product into a scratch
// of joined rows and rope_qkv_split
template <class T>
void linear_qkv_rope(T* q, T* k, T* v, const T* inp, const T* w, const int32_t* pos, int64_t N, int C, int H, int KV,
                     int hd, double theta, Stream s) {
  if (N <= 0) return;
  if constexpr (std::is_same_v<T, bf16>) {
    const char* e = std::getenv("LOOM_GEMM90_QKV");
    if (gemm90_mode() != Gemm90::off && !(e && e[0] == '0') &&
        gemm90::qkv_rope_supported(q, k, v, inp, w, N, C, H, KV, hd)) {
      int rows = 0;
      const float2* table = rope_table(hd, theta, N, &rows, s);  // null while capturing, before a build
      gemm90::linear_qkv_rope(dptr(q), dptr(k), dptr(v), dptr(inp), dptr(w), pos, table, rows, N, C, H, KV, hd, theta,
                              s);
      return;
    }
  }
  const int W = (H + 2 * KV) * hd;
  T* qkv = static_cast<T*>(device_malloc(sizeof(T) * size_t(N) * W));
  linear_forward(qkv, inp, w, (const T*)nullptr, N, C, W, s);
  rope_qkv_split(q, k, v, qkv, pos, N, H, KV, hd, theta, s);
  device_free(qkv);  // stream-ordered reuse
}

template <class T>
void linear_dgelu_backward(T* dpre, T* dbias, const T* dout, const T* weight, const T* pre, int64_t N, int I, int O,
                           Stream s) {
  if (N <= 0 || I <= 0) return;
  if (N > INT32_MAX) throw std::runtime_error("linear_dgelu_backward: N too large for one GEMM");
  bool done = false;
  // gemm_sm90.cu's DGELU epilogue with LOOM_GEMM90=1 only: it ran the MIM step's 16 calls in 1.53
  // ms against cuBLASLt's DGELU kernel's 1.38 (H200, 2026-11-27, traces), bench_mim 23.82 / 23.76
  // -> 23.90 / 23.96 ms and contrastive 45.56 / 45.64 -> 45.94 / 46.00 with it (same call)
  if constexpr (std::is_same_v<T, bf16>) {
    if (gemm90_mode() == Gemm90::all && gemm90::dgelu_supported(dpre, dout, weight, pre, N, I, O)) {
      gemm90::linear_dgelu(dptr(dpre), dptr(dout), dptr(weight), dptr(pre), N, I, O, s);
      done = true;
    }
  }
  if (!done && !lt_matmul(dpre, dout, weight, (const T*)nullptr, int(N), I, O, false, false, 1.f, 0.f, 1, 0, 0, 0, s,
                          CUBLASLT_EPILOGUE_DGELU, pre)) {
    say_once("linear_dgelu_backward: no cuBLASLt DGELU algorithm for this shape; GEMM and GELU backward run apart");
    gemm(dpre, dout, weight, int(N), I, O, false, false, 1.0, 0.0, 1, 0, 0, 0, s);
    gelu_backward(dpre, dpre, pre, N * I, s);
  }
  if (dbias) linear_backward((T*)nullptr, (T*)nullptr, dbias, dpre, (const T*)nullptr, (const T*)nullptr, N, O, I, s);
}

#define LOOM_MATMUL(T)                                                                                 \
  template void gemm<T>(T*, const T*, const T*, int, int, int, bool, bool, double, double, int, int64_t, \
                        int64_t, int64_t, Stream);                                                     \
  template void linear_forward<T>(T*, const T*, const T*, const T*, int64_t, int, int, Stream);        \
  template void linear_forward_add<T>(T*, const T*, const T*, const T*, const T*, int64_t, int, int, Stream); \
  template void linear_backward<T>(T*, T*, T*, const T*, const T*, const T*, int64_t, int, int, Stream); \
  template void linear_forward_batched<T>(T*, const T*, const T*, const T*, int64_t, int, int, int, Stream); \
  template void linear_gelu_forward<T>(T*, T*, const T*, const T*, const T*, int64_t, int, int, Stream);  \
  template void linear_dgelu_backward<T>(T*, T*, const T*, const T*, const T*, int64_t, int, int, Stream); \
  template void linear_swiglu_forward<T>(T*, T*, const T*, const T*, int64_t, int, int, Stream); \
  template void linear_swiglu_backward<T>(T*, T*, const T*, const T*, const T*, int64_t, int, int, Stream); \
  template void linear_qkv_rope<T>(T*, T*, T*, const T*, const T*, const int32_t*, int64_t, int, int, int, int, double, \
                                   Stream);
LOOM_MATMUL(float)
LOOM_MATMUL(bf16)
LOOM_MATMUL(f16)

}  // namespace loom::cuda
