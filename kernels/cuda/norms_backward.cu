// norms_backward.cu: the LayerNorm and RMSNorm backward kernels (v1 block per row, v2 row in
// registers, v3 rows in flight), the parameter gradients' partial rows and their fixed-order
// finish, and the launcher that picks among them. The math, the launch shapes and the measured
// versions are in norms.cu's header; the shared row helpers in norms.cuh.
#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <unordered_map>

#include "kernels/cuda/colsum.cuh"
#include "kernels/cuda/norms.cuh"

namespace loom::cuda {

namespace {

using namespace norm_rows;

struct BwdArgs {
  void* dinp;             // [N, C]
  const void* dresid;     // [N, C] or null: added to dinp (kernels.inc)
  float* pw;              // [G, C] partial dweight
  float* pb;              // [G, C] partial dbias (LayerNorm)
  const void* dout;       // [N, C]
  const void* inp;        // [N, C]
  const void* w;          // [C]
  const float* mean;      // [N]
  const float* rstd;      // [N]
  int64_t N;
  int C;
  int turns;              // v3: 1 adds the warps' partial rows in v2's eight turns (LOOM_NORM_BWD_TURNS=1)
};

// A block's partial dweight / dbias row when its 8 warps own the same columns (a warp per row,
// lane t holding vectors k * 32 + t): the warps add into shared memory one after another (a
// fixed order, so the sums are deterministic), then the block writes its row of pw / pb.
template <bool RMS, int CH, int VEC>
__device__ __forceinline__ void warp_partials(const float (&dw)[CH][VEC], const float (&db)[CH][VEC], float* pw,
                                              float* pb, int C, int nv, int grp, int t) {
  __shared__ float acc_w[32 * CH * VEC], acc_b[RMS ? 1 : 32 * CH * VEC];
  for (int gi = 0; gi < 8; gi++) {
    if (grp == gi) {
#pragma unroll
      for (int k = 0; k < CH; k++) {
        const int vi = k * 32 + t;
        if (vi < nv)
#pragma unroll
          for (int i = 0; i < VEC; i++) {
            const int c = vi * VEC + i;
            acc_w[c] = gi == 0 ? dw[k][i] : acc_w[c] + dw[k][i];
            if constexpr (!RMS) acc_b[c] = gi == 0 ? db[k][i] : acc_b[c] + db[k][i];
          }
      }
    }
    __syncthreads();
  }
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    pw[c] = acc_w[c];
    if constexpr (!RMS) pb[c] = acc_b[c];
  }
}

// v2_row_in_registers, backward. TPR == 32: 8 warps per block, each warp loops over rows
// blockIdx*8 + warp, += gridDim*8; TPR > 32: the block loops over rows blockIdx, += gridDim.
// CH: the vectors a thread holds (kChunks, or fewer when the row needs fewer: every held
// vector costs 4 VEC registers, and the warp-per-row kernel's occupancy is register-bound:
// up to 3 vectors a lane it is held to 2 blocks of 256 threads per SM, 128 registers).
template <class DT, int VEC, int TPR, bool RMS, int CH = kChunks>
__global__ void __launch_bounds__(TPR == 32 ? 256 : TPR, TPR == 32 && CH <= 3 ? 2 : 1)
norm_bwd(BwdArgs a) {
  pdl_entry();
  __shared__ float2 sh[32];
  constexpr int kGroups = TPR == 32 ? 8 : 1;
  const int t = TPR == 32 ? (threadIdx.x & 31) : threadIdx.x;
  const int grp = TPR == 32 ? threadIdx.x >> 5 : 0;
  const int C = a.C, nv = C / VEC;
  float dw[CH][VEC], db[CH][VEC];
#pragma unroll
  for (int k = 0; k < CH; k++)
#pragma unroll
    for (int i = 0; i < VEC; i++) dw[k][i] = db[k][i] = 0.f;

  for (int64_t row = int64_t(blockIdx.x) * kGroups + grp; row < a.N; row += int64_t(gridDim.x) * kGroups) {
    const DT* dout = static_cast<const DT*>(a.dout) + row * C;
    const DT* inp = static_cast<const DT*>(a.inp) + row * C;
    const DT* dres = a.dresid ? static_cast<const DT*>(a.dresid) + row * C : nullptr;
    // dresid is loaded with the row, as packed 16-bit vectors, so that its load does not wait
    // for the reduction: one memory latency per row instead of two.
    Pack<DT, VEC> pr[CH];
    if (dres)
#pragma unroll
      for (int k = 0; k < CH; k++)
        if (k * TPR + t < nv) pr[k] = *reinterpret_cast<const Pack<DT, VEC>*>(dres + (k * TPR + t) * VEC);
    const float mean = RMS ? 0.f : a.mean[row], rstd = a.rstd[row];
    float g[CH][VEC], xh[CH][VEC];
    float sg = 0.f, sgx = 0.f;
#pragma unroll
    for (int k = 0; k < CH; k++) {
      int vi = k * TPR + t;
      if (vi < nv) {
        float d[VEC], w[VEC];
        load_vec<DT, VEC>(d, dout + vi * VEC);
        load_vec<DT, VEC>(xh[k], inp + vi * VEC);
        load_vec<DT, VEC>(w, static_cast<const DT*>(a.w) + vi * VEC);
#pragma unroll
        for (int i = 0; i < VEC; i++) {
          xh[k][i] = (xh[k][i] - mean) * rstd;
          g[k][i] = d[i] * w[i];
          sg += g[k][i];
          sgx += g[k][i] * xh[k][i];
          dw[k][i] += d[i] * xh[k][i];
          db[k][i] += d[i];
        }
      }
    }
    float2 s = group_sum2<TPR>(make_float2(sg, sgx), sh);
    const float mg = RMS ? 0.f : s.x / C, mgx = s.y / C;
    DT* dinp = static_cast<DT*>(a.dinp) + row * C;
#pragma unroll
    for (int k = 0; k < CH; k++) {
      int vi = k * TPR + t;
      if (vi < nv) {
        float o[VEC];
#pragma unroll
        for (int i = 0; i < VEC; i++) o[i] = rstd * (g[k][i] - mg - xh[k][i] * mgx);
        if (dres)  // round, then add: bit for bit the norm's dinp followed by an add
#pragma unroll
          for (int i = 0; i < VEC; i++) o[i] = to_float(from_float<DT>(o[i])) + to_float(pr[k].v[i]);
        store_vec<DT, VEC>(dinp + vi * VEC, o);
      }
    }
  }

  // Block partials. TPR > 32: the block's threads own distinct columns. TPR == 32: the 8
  // warps own the same columns; they add into shared memory one after another (fixed order).
  float* pw = a.pw + int64_t(blockIdx.x) * C;
  float* pb = RMS ? nullptr : a.pb + int64_t(blockIdx.x) * C;
  if constexpr (TPR == 32) {
    warp_partials<RMS>(dw, db, pw, pb, C, nv, grp, t);
  } else {
#pragma unroll
    for (int k = 0; k < CH; k++) {
      int vi = k * TPR + t;
      if (vi < nv) {
        store_vec<float, VEC>(pw + vi * VEC, dw[k]);
        if constexpr (!RMS) store_vec<float, VEC>(pb + vi * VEC, db[k]);
      }
    }
  }
}

// v3 backward, rows in flight (the warp-per-row path with 16-byte vectors): v2 loads a row,
// waits, reduces, stores, and only then loads the next one, so a warp has one row's loads in
// flight at a time. Here each lane copies its own vectors of dout, x (and dresid) for the row
// ST - 1 rows ahead into shared memory with cp.async while it works on the current one from
// shared memory. A lane reads only the bytes it copied itself, so cp.async.wait_group is the
// only synchronization (no barrier); the stage it refills was read by the same lane an
// iteration earlier. A row's dinp is written after its own bytes have landed (so, as in v2, it
// may alias that row's dout or dresid). The arithmetic is v2's, in v2's order: dinp came out
// with v2's bits at the models' bf16 widths (576, 768, 1024), while f32 rows differ in the last
// bits where the compiler contracts a product differently; dweight / dbias add the same per-row terms, but
// another grid (the resident blocks differ) groups the rows into other partials
// (tests/cuda/test_cuda_norms.cpp compares the two).
// Shared memory: 8 warps x ST stages x 3 tensors x CH vectors x 32 lanes x 16 bytes.
template <class DT, int VEC, bool RMS, int CH, int ST>
__global__ void __launch_bounds__(256, 2) norm_bwd_rows(BwdArgs a) {
  pdl_entry();
  extern __shared__ __align__(16) unsigned char norm_rows_smem[];
  using P = Pack<DT, VEC>;
  static_assert(sizeof(P) == 16, "16-byte vectors");
  constexpr int kGroups = 8, kT = 3;
  const int t = threadIdx.x & 31, grp = threadIdx.x >> 5;
  const int C = a.C, nv = C / VEC;
  P* buf = reinterpret_cast<P*>(norm_rows_smem) + grp * (ST * kT * CH * 32);
  auto slot = [&](int s, int j, int k) -> P& { return buf[((s * kT + j) * CH + k) * 32 + t]; };
  const DT* dout = static_cast<const DT*>(a.dout);
  const DT* inp = static_cast<const DT*>(a.inp);
  const DT* dres = static_cast<const DT*>(a.dresid);
  const DT* wt = static_cast<const DT*>(a.w);
  const int64_t stride = int64_t(gridDim.x) * kGroups, first = int64_t(blockIdx.x) * kGroups + grp;
  auto issue = [&](int64_t row, int s) {  // one commit group per row, empty past the last
    if (row < a.N)
#pragma unroll
      for (int k = 0; k < CH; k++) {
        const int vi = k * 32 + t;
        if (vi < nv) {
          const int64_t off = row * C + int64_t(vi) * VEC;
          cp_async16(&slot(s, 0, k), dout + off, true);
          cp_async16(&slot(s, 1, k), inp + off, true);
          if (dres) cp_async16(&slot(s, 2, k), dres + off, true);
        }
      }
    cp_async_commit();
  };
  float dw[CH][VEC], db[CH][VEC];
#pragma unroll
  for (int k = 0; k < CH; k++)
#pragma unroll
    for (int i = 0; i < VEC; i++) dw[k][i] = db[k][i] = 0.f;
#pragma unroll
  for (int s = 0; s < ST - 1; s++) issue(first + s * stride, s);
  int s = 0;
  for (int64_t row = first; row < a.N; row += stride) {
    asm volatile("" ::: "memory");  // the last iteration's reads of the stage refilled here stay before it
    issue(row + (ST - 1) * stride, s == 0 ? ST - 1 : s - 1);
    const float mean = RMS ? 0.f : a.mean[row], rstd = a.rstd[row];
    cp_async_wait<ST - 1>();  // this row's group has landed
    float sg = 0.f, sgx = 0.f;
#pragma unroll
    for (int k = 0; k < CH; k++) {
      const int vi = k * 32 + t;
      if (vi < nv) {
        float d[VEC], x[VEC], w[VEC];
        const P pd = slot(s, 0, k), px = slot(s, 1, k);
        load_vec<DT, VEC>(w, wt + vi * VEC);
#pragma unroll
        for (int i = 0; i < VEC; i++) {
          d[i] = to_float(pd.v[i]);
          x[i] = (to_float(px.v[i]) - mean) * rstd;
          const float g = d[i] * w[i];
          sg += g;
          sgx += g * x[i];
          dw[k][i] += d[i] * x[i];
          db[k][i] += d[i];
        }
      }
    }
    const float2 r = group_sum2<32>(make_float2(sg, sgx), nullptr);
    const float mg = RMS ? 0.f : r.x / C, mgx = r.y / C;
    DT* dinp = static_cast<DT*>(a.dinp) + row * C;
#pragma unroll
    for (int k = 0; k < CH; k++) {
      const int vi = k * 32 + t;
      if (vi < nv) {
        float o[VEC], w[VEC];
        const P pd = slot(s, 0, k), px = slot(s, 1, k);
        load_vec<DT, VEC>(w, wt + vi * VEC);
#pragma unroll
        for (int i = 0; i < VEC; i++) {
          const float xh = (to_float(px.v[i]) - mean) * rstd, g = to_float(pd.v[i]) * w[i];
          o[i] = rstd * (g - mg - xh * mgx);
        }
        if (dres) {  // round, then add: bit for bit the norm's dinp followed by an add
          const P pr = slot(s, 2, k);
#pragma unroll
          for (int i = 0; i < VEC; i++) o[i] = to_float(from_float<DT>(o[i])) + to_float(pr.v[i]);
        }
        store_vec<DT, VEC>(dinp + vi * VEC, o);
      }
    }
    s = s + 1 == ST ? 0 : s + 1;
  }
  cp_async_wait<0>();  // only empty groups can be left: rows past N are not copied

  // Block partials, the sum of the 8 warps' rows in v2's order (warp 0 + warp 1 + ... + warp 7,
  // so v2's bits), but with one barrier instead of v2's eight turns: every warp puts its dw (and
  // db) row into its own row of the staging memory, which no copy uses any more, then each thread
  // adds one column's 8 rows in order. (The eight turns were a third of the kernel's time at the
  // MIM encoder's 12544 rows, ~6 a warp: Nsight Compute counted 37% of its cycles at the barrier.)
  if (a.turns) {  // the eight turns, for A/B
    warp_partials<RMS>(dw, db, a.pw + int64_t(blockIdx.x) * C, RMS ? nullptr : a.pb + int64_t(blockIdx.x) * C, C,
                       nv, grp, t);
    return;
  }
  __syncthreads();  // every warp is done with its stages (rows of another warp's stages are written below)
  float* rw = reinterpret_cast<float*>(norm_rows_smem);  // [8][C] dweight rows, then [8][C] dbias rows
  float* rb = rw + 8 * C;
#pragma unroll
  for (int k = 0; k < CH; k++) {
    const int vi = k * 32 + t;
    if (vi < nv)  // 16-byte stores (the dynamic shared memory is declared 16-byte aligned)
#pragma unroll
      for (int i = 0; i < VEC; i += 4) {
        *reinterpret_cast<float4*>(rw + grp * C + vi * VEC + i) = make_float4(dw[k][i], dw[k][i + 1], dw[k][i + 2], dw[k][i + 3]);
        if constexpr (!RMS)
          *reinterpret_cast<float4*>(rb + grp * C + vi * VEC + i) = make_float4(db[k][i], db[k][i + 1], db[k][i + 2], db[k][i + 3]);
      }
  }
  __syncthreads();
  float* pw = a.pw + int64_t(blockIdx.x) * C;
  float* pb = RMS ? nullptr : a.pb + int64_t(blockIdx.x) * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float sw = rw[c], sb = RMS ? 0.f : rb[c];
#pragma unroll
    for (int g = 1; g < kGroups; g++) {
      sw += rw[g * C + c];
      if constexpr (!RMS) sb += rb[g * C + c];
    }
    pw[c] = sw;
    if constexpr (!RMS) pb[c] = sb;
  }
}

// v1_generic_block_per_row, backward: block loops over rows, partials accumulate in global
// memory (pw/pb zeroed first; each thread owns columns c = tid + j*blockDim).
template <class DT, bool RMS>
__global__ void norm_bwd_generic(BwdArgs a) {
  pdl_entry();
  __shared__ float2 sh[32];
  const int C = a.C;
  float* pw = a.pw + int64_t(blockIdx.x) * C;
  float* pb = RMS ? nullptr : a.pb + int64_t(blockIdx.x) * C;
  const DT* w = static_cast<const DT*>(a.w);
  for (int64_t row = blockIdx.x; row < a.N; row += gridDim.x) {
    const DT* dout = static_cast<const DT*>(a.dout) + row * C;
    const DT* inp = static_cast<const DT*>(a.inp) + row * C;
    const float mean = RMS ? 0.f : a.mean[row], rstd = a.rstd[row];
    float sg = 0.f, sgx = 0.f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      float d = to_float(dout[c]), xh = (to_float(inp[c]) - mean) * rstd, g = d * to_float(w[c]);
      sg += g;
      sgx += g * xh;
      pw[c] += d * xh;
      if constexpr (!RMS) pb[c] += d;
    }
    float2 s = group_sum2<256>(make_float2(sg, sgx), sh);
    const float mg = RMS ? 0.f : s.x / C, mgx = s.y / C;
    DT* dinp = static_cast<DT*>(a.dinp) + row * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      float xh = (to_float(inp[c]) - mean) * rstd, g = to_float(dout[c]) * to_float(w[c]);
      dinp[c] = from_float<DT>(rstd * (g - mg - xh * mgx));
      if (a.dresid) dinp[c] = from_float<DT>(to_float(dinp[c]) + to_float(static_cast<const DT*>(a.dresid)[row * C + c]));
    }
  }
}

// Blocks of a backward kernel that are resident at once on the whole GPU: the grid of the
// persistent backward (more blocks would run as a second, unbalanced wave).
template <class K>
int resident_grid(K kernel, int threads, size_t smem = 0) {
  int b = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, threads, smem));
  return std::max(1, b) * sm_count();
}

// The backward kernel for a vector width and threads per row; a warp per row with full
// vectors also takes its vectors per thread (ch). *threads gets the block size.
using BwdKernel = void (*)(BwdArgs);
template <class DT, bool RMS>
BwdKernel bwd_kernel(int vec, int tpr, int ch, int* threads) {
  constexpr int V = 16 / int(sizeof(DT));
  *threads = tpr == 32 || tpr == 0 ? 256 : tpr;
  if (tpr == 0) return norm_bwd_generic<DT, RMS>;
  if (vec == 1) return tpr == 32 ? norm_bwd<DT, 1, 32, RMS> : tpr == 128 ? norm_bwd<DT, 1, 128, RMS>
                                                                          : norm_bwd<DT, 1, 1024, RMS>;
  if (tpr == 32) return ch == 1 ? norm_bwd<DT, V, 32, RMS, 1> : ch == 2 ? norm_bwd<DT, V, 32, RMS, 2>
                       : ch == 3 ? norm_bwd<DT, V, 32, RMS, 3> : norm_bwd<DT, V, 32, RMS, 4>;
  return tpr == 128 ? norm_bwd<DT, V, 128, RMS> : norm_bwd<DT, V, 1024, RMS>;
}

// v3 (norm_bwd_rows) for a warp per row with 16-byte vectors: the kernel and its shared memory
// (2 stages: one row computed while the next one loads; 3 were slower for LayerNorm, see the
// header). LOOM_NORM_BWD_ST=3 picks 3, =0 runs v2 (read at every call: tests and benchmarks
// switch it).
template <class DT, bool RMS>
BwdKernel bwd_rows_kernel(int ch, size_t* smem) {
  constexpr int V = 16 / int(sizeof(DT));
  const char* e = std::getenv("LOOM_NORM_BWD_ST");
  const int st = e ? std::atoi(e) : 2;
  if (st != 2 && st != 3) return nullptr;
  // the stages; after the rows, the 8 warps' partial rows [2][8][C] fp32 (C <= ch * 256) reuse them
  *smem = std::max(size_t(8) * st * 3 * ch * 32 * 16, size_t(2) * 8 * ch * 256 * sizeof(float));
  BwdKernel k = nullptr;
  switch (ch * 4 + st) {
    case 1 * 4 + 2: k = norm_bwd_rows<DT, V, RMS, 1, 2>; break;
    case 1 * 4 + 3: k = norm_bwd_rows<DT, V, RMS, 1, 3>; break;
    case 2 * 4 + 2: k = norm_bwd_rows<DT, V, RMS, 2, 2>; break;
    case 2 * 4 + 3: k = norm_bwd_rows<DT, V, RMS, 2, 3>; break;
    case 3 * 4 + 2: k = norm_bwd_rows<DT, V, RMS, 3, 2>; break;
    case 3 * 4 + 3: k = norm_bwd_rows<DT, V, RMS, 3, 3>; break;
    case 4 * 4 + 2: k = norm_bwd_rows<DT, V, RMS, 4, 2>; break;
    default: k = norm_bwd_rows<DT, V, RMS, 4, 3>; break;
  }
  return k;
}

// Blocks of a backward kernel resident at once on the GPU (cached per kernel); a kernel with
// dynamic shared memory gets its attribute set here, once.
int bwd_grid(BwdKernel k, int threads, size_t smem = 0) {
  static std::mutex mu;
  static std::unordered_map<BwdKernel, int> grid;
  std::lock_guard<std::mutex> lock(mu);
  auto it = grid.find(k);
  if (it != grid.end()) return it->second;
  if (smem > 0) CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  return grid[k] = resident_grid(k, threads, smem);
}

template <class T, bool RMS>
void launch_bwd(T* dweight, T* dbias, BwdArgs a, Stream s) {
  using DT = dev_t<T>;
  if (a.N <= 0) return;
  if (a.C <= 0) throw std::runtime_error("norm backward: C must be > 0");
  bool ok = aligned(a.dinp, 16) && aligned(a.dout, 16) && aligned(a.inp, 16) && aligned(a.w, 16) &&
            aligned(a.dresid, 16);
  int vec, tpr;
  pick<T>(a.C, ok, &vec, &tpr);
  // warp per row: as many vectors per lane as the row needs (C 768 bf16: 3 vectors of 8)
  const int ch = std::max(1, ceil_div(ceil_div(a.C, vec), 32));
  int threads = 0;
  size_t smem = 0;
  BwdKernel kernel = tpr == 32 && vec > 1 ? bwd_rows_kernel<DT, RMS>(ch, &smem) : nullptr;
  if (kernel) threads = 256;
  else kernel = bwd_kernel<DT, RMS>(vec, tpr, ch, &threads);
  int64_t groups = tpr == 32 ? (a.N + 7) / 8 : a.N;
  int G = int(std::min<int64_t>(groups, bwd_grid(kernel, threads, smem)));
  // pw and pb in one allocation: [2, G, C] fp32
  float* part = static_cast<float*>(device_malloc(sizeof(float) * 2 * size_t(G) * a.C));
  a.pw = part;
  a.pb = RMS ? nullptr : part + size_t(G) * a.C;
  if (tpr == 0) CUDA_CHECK(cudaMemsetAsync(part, 0, sizeof(float) * 2 * size_t(G) * a.C, s));
  launch_kernel(kernel, G, threads, smem, s, a);
  LAUNCH_CHECK();
  if (dweight || dbias) {
    // dweight[c] += sum_g pw[g, c] (and dbias), in a fixed order (colsum.cuh)
    colsum::launch_finish_rows<DT>(dptr(dweight), RMS ? nullptr : dptr(dbias), a.pw, a.pb, G, a.C,
                                   /*accumulate=*/true, s);
  }
  device_free(part);  // stream-ordered reuse
}

// LOOM_NORM_BWD_TURNS=1: v3's block partials in v2's eight turns (read at every call: A/B)
int bwd_turns() {
  const char* e = std::getenv("LOOM_NORM_BWD_TURNS");
  return e && e[0] == '1' ? 1 : 0;
}

}  // namespace

template <class T>
void layernorm_backward(T* dinp, const T* dresid, T* dweight, T* dbias, const T* dout, const T* inp,
                        const T* weight, const acc_t<T>* mean, const acc_t<T>* rstd, int64_t N, int C, Stream s) {
  BwdArgs a{dinp, dresid, nullptr, nullptr, dout, inp, weight, mean, rstd, N, C, bwd_turns()};
  launch_bwd<T, false>(dweight, dbias, a, s);
}

template <class T>
void rmsnorm_backward(T* dinp, const T* dresid, T* dweight, const T* dout, const T* inp, const T* weight,
                      const acc_t<T>* rstd, int64_t N, int C, Stream s) {
  BwdArgs a{dinp, dresid, nullptr, nullptr, dout, inp, weight, nullptr, rstd, N, C, bwd_turns()};
  launch_bwd<T, true>(dweight, nullptr, a, s);
}

#define LOOM_NORMS_BACKWARD(T)                                                                                 \
  template void layernorm_backward<T>(T*, const T*, T*, T*, const T*, const T*, const T*, const acc_t<T>*,     \
                                      const acc_t<T>*, int64_t, int, Stream);                                  \
  template void rmsnorm_backward<T>(T*, const T*, T*, const T*, const T*, const T*, const acc_t<T>*, int64_t,  \
                                    int, Stream);
LOOM_NORMS_BACKWARD(float)
LOOM_NORMS_BACKWARD(bf16)
LOOM_NORMS_BACKWARD(f16)

}  // namespace loom::cuda
