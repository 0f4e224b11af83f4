/*
 * norms.cu: LayerNorm and RMSNorm over the last dim, forward (plain and fused with the
 * residual add) and backward.  Reference: kernels/cpu/norms.cpp.  This file holds the forward
 * kernels; the backward ones are in norms_backward.cu, the pieces both use in norms.cuh; the
 * notes below cover both.
 *
 * Shapes: N rows (tokens), C channels.  inp/out/dout/dinp/resid/x/resid_out [N, C];
 *   weight/bias/dweight/dbias [C]; mean/rstd [N] in fp32 (acc_t<T>).
 * Forward (statistics in fp32, two passes over the row held in registers):
 *   LayerNorm: mean = sum(x)/C, var = sum((x-mean)^2)/C, rstd = 1/sqrt(var+eps),
 *              out = (x-mean) rstd w + b;                 saves mean, rstd      (all =)
 *   RMSNorm:   rstd = 1/sqrt(sum(x^2)/C + eps), out = x rstd w;   saves rstd    (all =)
 *   residual_*: x := round_T(resid + x) is written to resid_out first and normalized; the
 *              statistics come from the rounded value, so backward (which reads resid_out)
 *              sees exactly the x that forward normalized.
 * Backward, with xhat = (x-mean) rstd (RMS: x rstd), g = dout w:
 *   LayerNorm: dinp = rstd (g - mean(g) - xhat mean(g xhat))    (=)
 *   RMSNorm:   dinp = rstd (g - xhat mean(g xhat))              (=)
 *   dweight += sum_rows(dout xhat),  dbias += sum_rows(dout)     (+=)
 *   dresid (nullable): the gradient reaching the norm's input by the residual stream, added
 *   as dinp = round_T(round_T(dinp) + dresid): bit for bit the separate add it replaces (one
 *   read instead of two reads and a write; add_layernorm / add_rmsnorm, 2026-11-26).
 *   Parameter gradients are deterministic: each block keeps its partial sums (a thread owns
 *   fixed columns, so partials live in registers), blocks write partial rows [G, C] in fp32,
 *   and a finishing kernel adds them to dweight/dbias in a fixed order. No float atomics.
 * Napkin bytes (bf16, 16384 x 768): forward reads x and writes out: 2 * 25.2 MB = 50.3 MB
 *   (+ w, b from L1/L2, + 128 KB of statistics); at ~3 TB/s that is ~17 us. The reference
 *   counts 4 M C bytes. Backward reads dout, x and writes dinp: 75 MB, plus G x C x 8 B of
 *   partials (G = the resident blocks: 1-2 per SM, ~0.8-1.6 MB).
 * Launch shape: a row is owned by a group of TPR threads (32 = one warp, 128 or 1024 = a
 *   block), each holding up to 4 vectors of 16 bytes (8 bf16 / 4 f32) in registers; TPR is
 *   the smallest of {32, 128, 1024} that covers the row. Warp groups: 4 rows per 128-thread
 *   block (forward), 8 warps per block looping over rows (backward). C not a multiple of the
 *   vector width, or misaligned pointers, take the same kernels with scalar (1-element)
 *   vectors; rows longer than 1024 x 4 vectors take a block-per-row kernel that re-reads
 *   the row from global memory (slow, but correct for any C).
 * Versions (H200, bf16, bench/bench_kernels_a.cpp, medians; bytes = 4 N C forward):
 *   v1_generic_block_per_row: the reference loop, a block per row, three passes over global
 *     memory; the fallback for rows longer than 1024 x 4 vectors. Not timed.
 *   v2_row_in_registers: warp / block per row, 16-byte loads, the row in registers; the
 *     production path. layernorm_fwd 16384x768 2.55 TB/s, rmsnorm_fwd 16384x576 2.31 TB/s with
 *     every call reading DRAM (a device-to-device copy of the same bytes: 2.36-2.54), 2.87-3.09
 *     timed on one buffer as torch_ref.py times PyTorch (PyTorch 0.80-1.09 TB/s);
 *     layernorm_bwd 16384x768 1.25 TB/s counting 6 N C bytes (163 registers, one 256-thread
 *     block per SM).
 *   v2 backward, vectors per lane as the row needs (the CH template argument of the
 *     warp-per-row kernel: C 768 bf16 holds 3 of its 4 slots): 128 registers, 2 blocks per
 *     SM; layernorm_bwd 16384x768 0.066 -> 0.056 ms, 1.15 -> 1.36 TB/s (H100, same call,
 *     2026-11-24); the SPEC MIM contrastive step 55.1 -> 54.3 ms, the VLM step 72.35 -> 71.95.
 *   dresid loaded with the row (packed, before the reduction; it used to be loaded after it,
 *     a second memory latency per row), 2 blocks per SM required up to 3 vectors per lane
 *     (LayerNorm C 768 at 128 registers then spills 68 bytes): fixed-batch VLM step 53.05 /
 *     52.99 -> 52.82 / 52.76 ms, bench_mim and contrastive unchanged (H200, same call, tree
 *     before built beside it, 2026-11-27), bit for bit the same losses.
 *   v3 backward, rows in flight (norm_bwd_rows, the default for a warp per row with 16-byte
 *     vectors): the next row's dout, x and dresid copied into shared memory by cp.async while
 *     the current one is computed from shared memory (71 registers for RMSNorm C 576, 95 for
 *     LayerNorm C 768, no spill; 74 KB of shared memory a block at 2 stages). H200, one
 *     binary, v2 (LOOM_NORM_BWD_ST=0) | 2 stages | 3 stages: rmsnorm_bwd 16384x576 + dresid
 *     0.0429 | 0.0373 | 0.0390 ms, layernorm_bwd 16384x768 0.0492 | 0.0458 | 0.0537 (a copy of
 *     the rmsnorm_fwd bytes in that call: 2.3-2.4 TB/s; v3 moves 2.0); medians of steps 6-30,
 *     two rounds: fixed-batch VLM 52.19 / 52.16 -> 51.96 / 52.02 ms, bench_mim 24.01 / 24.02
 *     -> 23.92 / 23.98 (2026-11-27). dinp has v2's bits at the bf16 widths of the models (576,
 *     768, 1024; one value in 262k differs at C 64), dweight adds the rows in other partials.
 *   v3's block partials after one barrier (2026-12-02): the 8 warps' dweight / dbias rows into
 *     the (then unused) stage memory, one barrier, each thread adding a column's 8 rows in warp
 *     order; v2's eight turns (a barrier each) took a third of the kernel at the MIM encoder's
 *     12544 rows, ~6 a warp (Nsight Compute, contrastive step: 33-36 us, 37% of its cycles at the
 *     barrier, 25% occupancy). The same terms in the same order on the same grid: the same bits
 *     (test_cuda_norms compares the two; LOOM_NORM_BWD_TURNS=1 runs the turns). Steps, H200, one
 *     binary, two rounds alternated, turns | one barrier: bench_mim 22.26 / 22.28 | 22.04 / 21.94
 *     ms, contrastive 42.03 / 41.96 | 41.78 / 41.80, the reference's VLM batch 47.60 / 47.53 |
 *     47.38 / 47.20; step-2 losses identical.
 * Measured alternatives that lost (rmsnorm_fwd 16384x576, against v2's 2.27-2.39 TB/s in the
 * same runs; dated in docs/kernels/norms.md):
 *   8 threads x 9 vectors per row, 4 rows per warp (95 registers): 2.10-2.17 TB/s (-8%);
 *     with 6 blocks/SM forced (spills): 1.93-1.97.
 *   16 threads x 5 vectors per row: 2.06-2.16 (-7%).
 *   the weight slice loaded with the row (86 registers): 2.15-2.19 (-6%); LayerNorm 768 fell
 *     to 2.30.
 *   a warp per row with 36 bytes per lane (every lane busy): 2.21 (-6%); a persistent
 *     grid-stride kernel: 2.35 (same); without the streaming cache hints: 2.11 (-11%).
 *   the row kept as packed bf16 instead of floats: same registers (53), same time;
 *     10-12 blocks/SM forced with __launch_bounds__: spills of 24-64 B.
 * Measured and dropped (H200, 2026-11-28): the LayerNorm backward also adding up the dinp rows it
 *   stores per column (a third partial row per block, finished with dweight and dbias), handed
 *   by autograd to the linear whose output gradient dinp is (a ViT block's proj and fc2: their
 *   bias gradient without a column sum of dout). Correct (the column sums against the stored
 *   dinp at N 4099 and every test width, a gradient check where the gradient is added to after
 *   the norm), but the rows kernel with the sums took 31.9 against 27.0 us (C 768) and 39.0
 *   against 32.9 (C 384), its finish 6.5 against 4.8: in a trace of the MIM step (LOOM_PDL=0)
 *   the 33 column sums it saved (0.175 ms) cost as much in the norms (+0.18 ms); steps, same
 *   call: bench_mim 22.73 / 22.60 -> 22.65 / 22.66 ms, contrastive 43.34 -> 42.93, VLM 52.01 ->
 *   51.95 (noise). Where the norm's extra time goes was not measured apart (a round trip to
 *   bf16 and an add per element, a second shared-memory reduction per block, 121 registers).
 * History: docs/kernels/norms.md.
 * Test: tests/cuda/test_cuda_norms.cpp [norms] (C = 1, 31, 64, 576, 768, 1030, 3000,
 *   5000, odd N, N = 1), on a CUDA machine:
 *   bash tools/gpu-kernels.sh tests/cuda/test_cuda_norms.cpp
 */
#include "kernels/cuda/norms.cuh"

namespace loom::cuda {

namespace {

using namespace norm_rows;

struct FwdArgs {
  void* out;          // [N, C]
  void* resid_out;    // [N, C] (residual variants)
  float* mean;        // [N] (LayerNorm)
  float* rstd;        // [N]
  const void* inp;    // [N, C] (residual: resid)
  const void* x;      // [N, C] (residual variants)
  const void* w;      // [C]
  const void* b;      // [C] (LayerNorm, nullable)
  int64_t N;
  int C;
  float eps;
};

// v2_row_in_registers, forward.
template <class DT, int VEC, int TPR, bool RMS, bool RESID>
__global__ void __launch_bounds__(TPR == 32 ? 128 : TPR)
norm_fwd(FwdArgs a) {
  pdl_entry();
  __shared__ float2 sh[32];
  constexpr int kRowsPerBlock = TPR == 32 ? 4 : 1;
  const int t = TPR == 32 ? (threadIdx.x & 31) : threadIdx.x;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + (TPR == 32 ? threadIdx.x >> 5 : 0);
  if (row >= a.N) return;  // whole group exits together (TPR > 32: one row per block)
  const int C = a.C, nv = C / VEC;
  const DT* inp = static_cast<const DT*>(a.inp) + row * C;
  // The row stays in registers in its storage type (bf16: 4 x 16 B = 16 registers instead of
  // 32 floats): fewer registers, more resident warps, more loads in flight.
  Pack<DT, VEC> xr[kChunks];
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < kChunks; k++) {
    int vi = k * TPR + t;
    if (vi < nv) {
      xr[k] = *reinterpret_cast<const Pack<DT, VEC>*>(inp + vi * VEC);
      if constexpr (RESID) {
        Pack<DT, VEC> y = *reinterpret_cast<const Pack<DT, VEC>*>(static_cast<const DT*>(a.x) + row * C + vi * VEC);
#pragma unroll
        for (int i = 0; i < VEC; i++) xr[k].v[i] = from_float<DT>(to_float(xr[k].v[i]) + to_float(y.v[i]));
        *reinterpret_cast<Pack<DT, VEC>*>(static_cast<DT*>(a.resid_out) + row * C + vi * VEC) = xr[k];
      }
#pragma unroll
      for (int i = 0; i < VEC; i++) sum += to_float(xr[k].v[i]);
    }
  }
  float mean = 0.f;
  if constexpr (!RMS) mean = group_sum2<TPR>(make_float2(sum, 0.f), sh).x / C;
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kChunks; k++)
    if (k * TPR + t < nv)
#pragma unroll
      for (int i = 0; i < VEC; i++) { float d = to_float(xr[k].v[i]) - mean; ss += d * d; }
  float rstd = rsqrtf(group_sum2<TPR>(make_float2(ss, 0.f), sh).x / C + a.eps);
  if (t == 0) {
    if constexpr (!RMS) a.mean[row] = mean;
    a.rstd[row] = rstd;
  }
  DT* out = static_cast<DT*>(a.out) + row * C;
#pragma unroll
  for (int k = 0; k < kChunks; k++) {
    int vi = k * TPR + t;
    if (vi < nv) {
      float w[VEC], b[VEC], o[VEC];
      load_vec<DT, VEC>(w, static_cast<const DT*>(a.w) + vi * VEC);
      if (!RMS && a.b) load_vec<DT, VEC>(b, static_cast<const DT*>(a.b) + vi * VEC);
      else
#pragma unroll
        for (int i = 0; i < VEC; i++) b[i] = 0.f;
#pragma unroll
      for (int i = 0; i < VEC; i++) o[i] = (to_float(xr[k].v[i]) - mean) * rstd * w[i] + b[i];
      store_vec<DT, VEC>(out + vi * VEC, o);
    }
  }
}

// v1_generic_block_per_row, forward: any C, three passes over the row in global memory.
template <class DT, bool RMS, bool RESID>
__global__ void norm_fwd_generic(FwdArgs a) {
  pdl_entry();
  __shared__ float2 sh[32];
  const int64_t row = blockIdx.x;
  const int C = a.C;
  const DT* inp = static_cast<const DT*>(a.inp) + row * C;
  const DT* src = inp;
  if constexpr (RESID) {
    const DT* x = static_cast<const DT*>(a.x) + row * C;
    DT* ro = static_cast<DT*>(a.resid_out) + row * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) ro[c] = from_float<DT>(to_float(inp[c]) + to_float(x[c]));
    src = ro;  // each thread re-reads only the columns it wrote itself
  }
  float sum = 0.f;
  for (int c = threadIdx.x; c < C; c += blockDim.x) sum += to_float(src[c]);
  float mean = RMS ? 0.f : group_sum2<256>(make_float2(sum, 0.f), sh).x / C;
  float ss = 0.f;
  for (int c = threadIdx.x; c < C; c += blockDim.x) { float d = to_float(src[c]) - mean; ss += d * d; }
  float rstd = rsqrtf(group_sum2<256>(make_float2(ss, 0.f), sh).x / C + a.eps);
  if (threadIdx.x == 0) {
    if constexpr (!RMS) a.mean[row] = mean;
    a.rstd[row] = rstd;
  }
  const DT* w = static_cast<const DT*>(a.w);
  const DT* b = static_cast<const DT*>(a.b);
  DT* out = static_cast<DT*>(a.out) + row * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float o = (to_float(src[c]) - mean) * rstd * to_float(w[c]);
    if (!RMS && b) o += to_float(b[c]);
    out[c] = from_float<DT>(o);
  }
}

template <class DT, int VEC, bool RMS, bool RESID>
void launch_fwd_vec(int tpr, const FwdArgs& a, Stream s) {
  switch (tpr) {
    case 32: launch_kernel(norm_fwd<DT, VEC, 32, RMS, RESID>, ceil_div(a.N, 4), 128, 0, s, a); break;
    case 128: launch_kernel(norm_fwd<DT, VEC, 128, RMS, RESID>, unsigned(a.N), 128, 0, s, a); break;
    default: launch_kernel(norm_fwd<DT, VEC, 1024, RMS, RESID>, unsigned(a.N), 1024, 0, s, a); break;
  }
  LAUNCH_CHECK();
}

template <class T, bool RMS, bool RESID>
void launch_fwd(const FwdArgs& a, Stream s) {
  using DT = dev_t<T>;
  if (a.N <= 0) return;
  if (a.C <= 0) throw std::runtime_error("norm forward: C must be > 0");
  bool ok = aligned(a.out, 16) && aligned(a.inp, 16) && aligned(a.w, 16) &&
            (RMS || !a.b || aligned(a.b, 16)) && (!RESID || (aligned(a.x, 16) && aligned(a.resid_out, 16)));
  int vec, tpr;
  pick<T>(a.C, ok, &vec, &tpr);
  if (tpr == 0) {
    launch_kernel(norm_fwd_generic<DT, RMS, RESID>, unsigned(a.N), 256, 0, s, a);
    LAUNCH_CHECK();
  } else if (vec == 1) {
    launch_fwd_vec<DT, 1, RMS, RESID>(tpr, a, s);
  } else {
    launch_fwd_vec<DT, kVec<T>, RMS, RESID>(tpr, a, s);
  }
}

}  // namespace

template <class T>
void layernorm_forward(T* out, acc_t<T>* mean, acc_t<T>* rstd, const T* inp, const T* weight, const T* bias,
                       int64_t N, int C, double eps, Stream s) {
  FwdArgs a{out, nullptr, mean, rstd, inp, nullptr, weight, bias, N, C, float(eps)};
  launch_fwd<T, false, false>(a, s);
}

template <class T>
void residual_layernorm_forward(T* resid_out, T* out, acc_t<T>* mean, acc_t<T>* rstd, const T* resid, const T* x,
                                const T* weight, const T* bias, int64_t N, int C, double eps, Stream s) {
  FwdArgs a{out, resid_out, mean, rstd, resid, x, weight, bias, N, C, float(eps)};
  launch_fwd<T, false, true>(a, s);
}

template <class T>
void rmsnorm_forward(T* out, acc_t<T>* rstd, const T* inp, const T* weight, int64_t N, int C, double eps, Stream s) {
  FwdArgs a{out, nullptr, nullptr, rstd, inp, nullptr, weight, nullptr, N, C, float(eps)};
  launch_fwd<T, true, false>(a, s);
}

template <class T>
void residual_rmsnorm_forward(T* resid_out, T* out, acc_t<T>* rstd, const T* resid, const T* x, const T* weight,
                              int64_t N, int C, double eps, Stream s) {
  FwdArgs a{out, resid_out, nullptr, rstd, resid, x, weight, nullptr, N, C, float(eps)};
  launch_fwd<T, true, true>(a, s);
}

#define LOOM_NORMS_FORWARD(T)                                                                                  \
  template void layernorm_forward<T>(T*, acc_t<T>*, acc_t<T>*, const T*, const T*, const T*, int64_t, int,     \
                                     double, Stream);                                                          \
  template void residual_layernorm_forward<T>(T*, T*, acc_t<T>*, acc_t<T>*, const T*, const T*, const T*,      \
                                              const T*, int64_t, int, double, Stream);                         \
  template void rmsnorm_forward<T>(T*, acc_t<T>*, const T*, const T*, int64_t, int, double, Stream);           \
  template void residual_rmsnorm_forward<T>(T*, T*, acc_t<T>*, const T*, const T*, const T*, int64_t, int,     \
                                            double, Stream);
LOOM_NORMS_FORWARD(float)
LOOM_NORMS_FORWARD(bf16)
LOOM_NORMS_FORWARD(f16)

}  // namespace loom::cuda
