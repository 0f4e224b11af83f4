/*
 * indexing.cu: embedding, row gather/scatter, patchify, pixel shuffle, mean pool, L2 norm of
 * rows and row argmax, forward and backward.  Reference: kernels/cpu/indexing.cpp.
 *
 * Shapes: B batch, N rows (tokens), K kept rows, C channels, V vocab, Ch image channels,
 *   H x W image, p patch, G x G token grid, s shuffle factor, D token width.
 *   embedding   out[N,C] = table[ids[N], :]                      (=; an id outside [0,V) gives 0)
 *               dtable[V,C] += sum over n with ids[n] = v of dout[n, :]      (deterministic)
 *   gather_rows out[B,K,C] = inp[b, idx[b,k], :]                 (=)
 *   scatter_rows out[b, idx[b,k], :] (= or +=) src[b,k,:]; repeated indices accumulate in k order
 *   zero_rows   out[b, idx[b,k], :] = 0
 *   patchify    out[B, (H/p)(W/p), p p Ch]: out[b, i (W/p) + j, (u p + v) Ch + c] = img[b, c, i p + u, j p + v]
 *   pixel_shuffle out[B, (G/s)^2, s s D]: out[b, i (G/s) + j, (u s + v) D + d] = inp[b, (i s + u) G + j s + v, d]
 *               (both backward passes are the inverse permutation, =)
 *   mean_pool   out[B,C] = mean_k inp[B,K,C];  dinp[b,k,c] = dout[b,c] / K
 *   l2norm      r = 1 / max(||x||, eps), out = x r (saves rnorm[N] = r)
 *               dinp = r (dout - out (dout . out)) when ||x|| > eps, else dout r
 *   argmax_rows out[N] = first index of the row maximum (a NaN counts as largest)
 * Embedding backward: embedding_backward.cu (sorted runs, deterministic).
 *   scatter_rows with accumulate: one thread per (b, c) walks k in order: no races even when
 *   an index repeats; without (distinct indices) one thread per element (scatter_rows_set).
 * Napkin bytes: all of these move each element once.
 * Launch shape: rows (gather, scatter without accumulation, zero rows, the embedding lookup,
 *   the pixel shuffle) a warp per row, its lanes moving 16-, 8-, 4- or 2-byte words (the widest
 *   the row's bytes and the pointers allow); a block per patch row for patchify; grid-stride,
 *   one thread per element or column for the rest; warp per row for l2norm/argmax.
 * Versions: patchify forward v2 through shared memory (one block per patch row: the p image rows of every channel are
 *   contiguous runs in, the row's patches one contiguous run out; 148 -> 103 us for 128 images
 *   of 224 px, H100), v3 with 3 channels and patch 16 known at compile time and 16-byte words
 *   both ways; the row ops v2 (move_rows, 2026-11-28). A trace of the contrastive MIM step
 *   (H200, 256 images) had v1's row ops at 0.3-1 TB/s: 6 gathers 568 us, 3 scatters 189,
 *   2 patchify 394, the position embedding's backward 189 (embedding_backward.cu's v3); with v2 / v3 (and one patchify for
 *   both encoders, nn/mim.cpp) 165, -, 67 and 36 us; bench_mim 23.70 -> 22.78 ms, contrastive
 *   43.95 -> 42.69 (with memory.cu's v3, same call). The VLM's pixel shuffle (2 x 72 us) and
 *   image-token scatter are the same row kernel.
 * Test: tests/cuda/test_cuda_indexing.cpp [indexing]:
 *   bash tools/gpu-kernels.sh tests/cuda/test_cuda_indexing.cpp
 */
#include <algorithm>
#include <cstdlib>

#include "kernels/cuda/common.cuh"

namespace loom::cuda {

namespace {

inline int grid_for(int64_t n, int threads = 256) {
  return int(std::min<int64_t>(std::max<int64_t>(1, (n + threads - 1) / threads), 16384));
}
#define GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

// ---- v2: whole rows moved as words, one warp per row
// Gathers, scatters, zeroed rows, the embedding lookup and the pixel shuffle move rows of C
// contiguous elements. v1 gave each element its own thread and found its row with 64-bit
// divisions per element; here a warp takes a row (one index or mapping per row) and its lanes
// move the row's words w = lane, lane + 32, ..., a word being the widest of 16 / 8 / 4 / 2 bytes
// that divides the row's bytes and every pointer's alignment. `Map` gives, for row r of the
// side walked in order, the row of the other side (-1: the row is zeros).
struct GatherMap {  // row (b, k) of [B, K, C] <-> row b N + idx[b K + k] of [B, N, C]
  const int32_t* idx;
  int K, N;
  __device__ int64_t operator()(int64_t r) const { return (r / K) * N + idx[r]; }
};
struct EmbedMap {  // out row n <- table row ids[n]; an id outside [0, V) gives zeros
  const int32_t* ids;
  int V;
  __device__ int64_t operator()(int64_t r) const {
    const int id = ids[r];
    return id >= 0 && id < V ? id : -1;
  }
};
struct ShuffleMap {  // row ((b, i Gs + j), u s + v) of the shuffled [B, Gs^2, s^2, D] <- row b G^2 + (i s + u) G + j s + v
  int G, s;
  __device__ int64_t operator()(int64_t r) const {
    const int ss = s * s, Gs = G / s;
    const int64_t bt = r / ss;
    const int uv = int(r - bt * ss), u = uv / s, v = uv - u * s;
    const int64_t b = bt / (int64_t(Gs) * Gs);
    const int tok = int(bt - b * Gs * Gs), i = tok / Gs, j = tok - i * Gs;
    return (b * G + i * s + u) * G + j * s + v;
  }
};

// SCATTER false: dst row r = src row map(r) (zeros where map(r) < 0).
// SCATTER true:  dst row map(r) = src row r, or zeros when src is null (zero_rows).
template <class Wd, class Map, bool SCATTER>
__global__ void move_rows(Wd* __restrict__ dst, const Wd* __restrict__ src, Map map, int64_t rows, int words) {
  pdl_entry();
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t r = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
    const int64_t o = map(r);
    Wd* d = dst + (SCATTER ? o : r) * words;
    if (!src || o < 0) {
#pragma unroll 4
      for (int w = lane; w < words; w += 32) d[w] = Wd{};
      continue;
    }
    const Wd* sr = src + (SCATTER ? r : o) * words;
#pragma unroll 4
    for (int w = lane; w < words; w += 32) d[w] = sr[w];
  }
}

// move_rows with the widest word the rows and pointers allow (elements are 2 or 4 bytes).
template <bool SCATTER, class Map>
void launch_move_rows(void* dst, const void* src, Map map, int64_t rows, int64_t row_bytes, Stream s) {
  if (rows <= 0 || row_bytes <= 0) return;
  auto fits = [&](size_t a) { return row_bytes % int64_t(a) == 0 && aligned(dst, a) && (!src || aligned(src, a)); };
  const int grid = int(std::min<int64_t>((rows + 7) / 8, 16384));
  if (fits(16))
    launch_kernel(move_rows<uint4, Map, SCATTER>, grid, 256, 0, s, static_cast<uint4*>(dst),
                  static_cast<const uint4*>(src), map, rows, int(row_bytes / 16));
  else if (fits(8))
    launch_kernel(move_rows<uint2, Map, SCATTER>, grid, 256, 0, s, static_cast<uint2*>(dst),
                  static_cast<const uint2*>(src), map, rows, int(row_bytes / 8));
  else if (fits(4))
    launch_kernel(move_rows<uint32_t, Map, SCATTER>, grid, 256, 0, s, static_cast<uint32_t*>(dst),
                  static_cast<const uint32_t*>(src), map, rows, int(row_bytes / 4));
  else
    launch_kernel(move_rows<uint16_t, Map, SCATTER>, grid, 256, 0, s, static_cast<uint16_t*>(dst),
                  static_cast<const uint16_t*>(src), map, rows, int(row_bytes / 2));
  LAUNCH_CHECK();
}

template <class DT>
__global__ void scatter_rows_kernel(DT* __restrict__ out, const int32_t* __restrict__ idx, const DT* __restrict__ src,
                                    int B, int N, int K, int C, bool accumulate) {
  pdl_entry();
  GRID_STRIDE(i, int64_t(B) * C) {
    int b = int(i / C);
    int c = int(i - int64_t(b) * C);
    for (int k = 0; k < K; k++) {
      DT* o = out + (int64_t(b) * N + idx[int64_t(b) * K + k]) * C + c;
      float v = to_float(src[(int64_t(b) * K + k) * C + c]);
      *o = from_float<DT>(accumulate ? to_float(*o) + v : v);
    }
  }
}

// patchify: i indexes the patch layout (forward: out; backward: dout); BACKWARD writes img.
template <class DT, bool BACKWARD>
__global__ void patchify_kernel(DT* __restrict__ dst, const DT* __restrict__ src, int B, int Ch, int H, int W, int p) {
  pdl_entry();
  const int Wp = W / p, np = (H / p) * Wp, F = p * p * Ch;
  GRID_STRIDE(i, int64_t(B) * np * F) {
    int f = int(i % F);
    int64_t bp = i / F;
    int P = int(bp % np), b = int(bp / np);
    int pi = P / Wp, pj = P % Wp;
    int c = f % Ch, uv = f / Ch, u = uv / p, v = uv % p;
    int64_t img = ((int64_t(b) * Ch + c) * H + pi * p + u) * W + pj * p + v;
    if (BACKWARD) dst[img] = src[i];
    else dst[i] = src[img];
  }
}

// patchify forward through shared memory: one block per (image b, patch row pi). The p image
// rows of the patch row are p * W contiguous elements in each channel plane, and the Wp
// patches they form are Wp * F contiguous elements of the output, so both sides move as
// contiguous runs: every channel's run is read into shared memory, then the output run is
// written in order (the per-element kernel above reads across the channel planes).
template <class DT>
__global__ void patchify_rows_kernel(DT* __restrict__ out, const DT* __restrict__ img, int Ch, int H, int W, int p) {
  pdl_entry();
  extern __shared__ unsigned char patch_smem[];
  DT* sm = reinterpret_cast<DT*>(patch_smem);  // [Ch][p][W]
  const int Wp = W / p, Hp = H / p, F = p * p * Ch;
  const int pi = blockIdx.x % Hp, b = blockIdx.x / Hp;
  const int run = p * W;
  for (int c = 0; c < Ch; c++) {
    const DT* src = img + ((int64_t(b) * Ch + c) * H + int64_t(pi) * p) * W;
    for (int k = threadIdx.x; k < run; k += blockDim.x) sm[c * run + k] = src[k];
  }
  __syncthreads();
  DT* dst = out + (int64_t(b) * Hp + pi) * Wp * F;
  for (int o = threadIdx.x; o < Wp * F; o += blockDim.x) {
    const int pj = o / F, f = o - pj * F;
    const int c = f % Ch, uv = f / Ch, u = uv / p, v = uv - u * p;
    dst[o] = sm[c * run + u * W + pj * p + v];
  }
}

// patchify v3, the same block per (image b, patch row pi) with the channel count and patch size
// known at compile time (3 and 16: the SPEC ViTs): the runs come in as 16-byte words and every
// thread writes 16-byte words of the output row, each of its VEC elements found in shared memory
// by index arithmetic on constants (v2 divides by runtime values per element and moves 2 bytes
// per access). Needs each channel's run (P W elements), the output row (W / P patches of
// P P CH elements) and both pointers to fall on 16 bytes.
template <class DT, int CH, int P>
__global__ void patchify_rows_vec(DT* __restrict__ out, const DT* __restrict__ img, int H, int W) {
  pdl_entry();
  constexpr int VEC = 16 / int(sizeof(DT)), F = P * P * CH;
  extern __shared__ __align__(16) unsigned char patch_smem_v[];
  DT* sm = reinterpret_cast<DT*>(patch_smem_v);  // [CH][P][W]
  const int Wp = W / P, Hp = H / P;
  const int pi = blockIdx.x % Hp, b = blockIdx.x / Hp;
  const int run = P * W, runv = run / VEC;
  for (int c = 0; c < CH; c++) {
    const uint4* src = reinterpret_cast<const uint4*>(img + ((int64_t(b) * CH + c) * H + int64_t(pi) * P) * W);
    uint4* dsm = reinterpret_cast<uint4*>(sm + c * run);
    for (int k = threadIdx.x; k < runv; k += blockDim.x) dsm[k] = src[k];
  }
  __syncthreads();
  Pack<DT, VEC>* dst = reinterpret_cast<Pack<DT, VEC>*>(out + (int64_t(b) * Hp + pi) * Wp * F);
  for (int o = threadIdx.x; o < Wp * F / VEC; o += blockDim.x) {
    Pack<DT, VEC> w;
#pragma unroll
    for (int e = 0; e < VEC; e++) {
      const int oe = o * VEC + e, pj = oe / F, f = oe - pj * F;
      const int c = f % CH, uv = f / CH, u = uv / P, v = uv % P;
      w.v[e] = sm[c * run + u * W + pj * P + v];
    }
    dst[o] = w;
  }
}

template <class DT>
__global__ void mean_pool_fwd_kernel(DT* __restrict__ out, const DT* __restrict__ inp, int B, int K, int C) {
  pdl_entry();
  GRID_STRIDE(i, int64_t(B) * C) {
    int b = int(i / C), c = int(i % C);
    float acc = 0.f;
    for (int k = 0; k < K; k++) acc += to_float(inp[(int64_t(b) * K + k) * C + c]);
    out[i] = from_float<DT>(acc / K);
  }
}

template <class DT>
__global__ void mean_pool_bwd_kernel(DT* __restrict__ dinp, const DT* __restrict__ dout, int B, int K, int C) {
  pdl_entry();
  GRID_STRIDE(i, int64_t(B) * K * C) {
    int c = int(i % C);
    int b = int(i / (int64_t(K) * C));
    dinp[i] = from_float<DT>(to_float(dout[int64_t(b) * C + c]) / K);
  }
}

template <class DT>  // warp per row, 4 rows per 128-thread block
__global__ void l2norm_fwd_kernel(DT* __restrict__ out, float* __restrict__ rnorm, const DT* __restrict__ inp,
                                  int64_t N, int C, float eps) {
  pdl_entry();
  int64_t row = int64_t(blockIdx.x) * 4 + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31;
  if (row >= N) return;
  const DT* x = inp + row * C;
  float ss = 0.f;
  for (int c = lane; c < C; c += 32) { float v = to_float(x[c]); ss += v * v; }
  ss = warp_sum(ss);
  float r = 1.f / fmaxf(sqrtf(ss), eps);
  if (lane == 0) rnorm[row] = r;
  for (int c = lane; c < C; c += 32) out[row * C + c] = from_float<DT>(to_float(x[c]) * r);
}

template <class DT>
__global__ void l2norm_bwd_kernel(DT* __restrict__ dinp, const DT* __restrict__ dout, const DT* __restrict__ inp,
                                  const float* __restrict__ rnorm, int64_t N, int C) {
  pdl_entry();
  int64_t row = int64_t(blockIdx.x) * 4 + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31;
  if (row >= N) return;
  const DT* x = inp + row * C;
  const DT* d = dout + row * C;
  float r = rnorm[row];
  float dot = 0.f, ss = 0.f;
  for (int c = lane; c < C; c += 32) {
    float xv = to_float(x[c]);
    dot += to_float(d[c]) * xv * r;
    ss += xv * xv;
  }
  dot = warp_sum(dot);
  ss = warp_sum(ss);
  // eps is not an argument of the backward: the norm was clamped to eps exactly when
  // ||x|| r < 1 (unclamped, ||x|| r = 1 up to rounding); then r is a constant of x.
  if (sqrtf(ss) * r < 0.999f) dot = 0.f;
  for (int c = lane; c < C; c += 32) {
    float y = to_float(x[c]) * r;
    dinp[row * C + c] = from_float<DT>(r * (to_float(d[c]) - y * dot));
  }
}

template <class DT>
__global__ void argmax_kernel(int32_t* __restrict__ out, const DT* __restrict__ inp, int64_t N, int C) {
  pdl_entry();
  int64_t row = int64_t(blockIdx.x) * 4 + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31;
  if (row >= N) return;
  const DT* x = inp + row * C;
  // "a beats b": larger, or NaN (a NaN counts as largest), or equal and earlier
  auto beats = [](float a, int ai, float b, int bi) {
    bool an = isnan(a), bn = isnan(b);
    if (an != bn) return an;
    if (an || a == b) return ai < bi;
    return a > b;
  };
  float best = -INFINITY;
  int bi = C;  // larger than every index: "none yet"
  for (int c = lane; c < C; c += 32) {
    float v = to_float(x[c]);
    if (bi == C || beats(v, c, best, bi)) { best = v; bi = c; }
  }
  for (int o = 16; o > 0; o >>= 1) {
    float ov = __shfl_xor_sync(0xffffffffu, best, o);
    int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (oi < C && (bi == C || beats(ov, oi, best, bi))) { best = ov; bi = oi; }
  }
  if (lane == 0) out[row] = bi < C ? bi : 0;
}

}  // namespace

template <class T>
void embedding_forward(T* out, const int32_t* ids, const T* table, int64_t N, int C, int V, Stream s) {
  if (N <= 0 || C <= 0) return;
  launch_move_rows<false>(out, table, EmbedMap{ids, V}, N, int64_t(C) * sizeof(T), s);
}

template <class T>
void gather_rows(T* out, const T* inp, const int32_t* idx, int B, int N, int K, int C, Stream s) {
  if (int64_t(B) * K * C <= 0) return;
  launch_move_rows<false>(out, inp, GatherMap{idx, K, N}, int64_t(B) * K, int64_t(C) * sizeof(T), s);
}

template <class T>
void scatter_rows(T* out, const int32_t* idx, const T* src, int B, int N, int K, int C, bool accumulate, Stream s) {
  if (int64_t(B) * K * C <= 0) return;
  if (!accumulate) {
    launch_move_rows<true>(out, src, GatherMap{idx, K, N}, int64_t(B) * K, int64_t(C) * sizeof(T), s);
    return;
  }
  launch_kernel(scatter_rows_kernel<dev_t<T>>, grid_for(int64_t(B) * C), 256, 0, s, dptr(out), idx, dptr(src), B, N, K,
                C, accumulate);
  LAUNCH_CHECK();
}

template <class T> void zero_rows(T* out, const int32_t* idx, int B, int N, int K, int C, Stream s) {
  if (int64_t(B) * K * C <= 0) return;
  launch_move_rows<true>(out, nullptr, GatherMap{idx, K, N}, int64_t(B) * K, int64_t(C) * sizeof(T), s);
}

namespace {
void check_patch(int H, int W, int p) {
  if (p <= 0 || H % p || W % p)
    throw std::runtime_error("patchify: image " + std::to_string(H) + "x" + std::to_string(W) +
                             " is not a multiple of patch " + std::to_string(p));
}
void check_shuffle(int G, int s) {
  if (s <= 0 || G % s)
    throw std::runtime_error("pixel_shuffle: grid " + std::to_string(G) + " is not a multiple of " + std::to_string(s));
}
}  // namespace

template <class T> void patchify(T* out, const T* img, int B, int Ch, int H, int W, int p, Stream s) {
  check_patch(H, W, p);
  int64_t n = int64_t(B) * Ch * H * W;
  if (n <= 0) return;
  const size_t smem = sizeof(T) * size_t(Ch) * p * W;
  const int64_t blocks = int64_t(B) * (H / p);
  if (Ch == 3 && p == 16 && smem <= 48 * 1024 && blocks < (int64_t(1) << 31) && aligned(out, 16) && aligned(img, 16) &&
      (int64_t(p) * W * sizeof(T)) % 16 == 0 && (int64_t(W) * p * Ch * sizeof(T)) % 16 == 0) {
    launch_kernel(patchify_rows_vec<dev_t<T>, 3, 16>, unsigned(blocks), 256, smem, s, dptr(out), dptr(img), H, W);
  } else if (smem <= 48 * 1024 && blocks < (int64_t(1) << 31))
    launch_kernel(patchify_rows_kernel<dev_t<T>>, unsigned(blocks), 256, smem, s, dptr(out), dptr(img), Ch, H, W, p);
  else
    launch_kernel(patchify_kernel<dev_t<T>, false>, grid_for(n), 256, 0, s, dptr(out), dptr(img), B, Ch, H, W, p);
  LAUNCH_CHECK();
}
template <class T> void patchify_backward(T* dimg, const T* dout, int B, int Ch, int H, int W, int p, Stream s) {
  check_patch(H, W, p);
  int64_t n = int64_t(B) * Ch * H * W;
  if (n <= 0) return;
  launch_kernel(patchify_kernel<dev_t<T>, true>, grid_for(n), 256, 0, s, dptr(dimg), dptr(dout), B, Ch, H, W, p);
  LAUNCH_CHECK();
}

template <class T> void pixel_shuffle(T* out, const T* inp, int B, int G, int D, int s, Stream s_) {
  check_shuffle(G, s);
  int64_t n = int64_t(B) * G * G * D;
  if (n <= 0) return;
  launch_move_rows<false>(out, inp, ShuffleMap{G, s}, int64_t(B) * G * G, int64_t(D) * sizeof(T), s_);
}
template <class T> void pixel_shuffle_backward(T* dinp, const T* dout, int B, int G, int D, int s, Stream s_) {
  check_shuffle(G, s);
  int64_t n = int64_t(B) * G * G * D;
  if (n <= 0) return;
  launch_move_rows<true>(dinp, dout, ShuffleMap{G, s}, int64_t(B) * G * G, int64_t(D) * sizeof(T), s_);
}

template <class T> void mean_pool_forward(T* out, const T* inp, int B, int K, int C, Stream s) {
  if (int64_t(B) * C <= 0) return;
  launch_kernel(mean_pool_fwd_kernel<dev_t<T>>, grid_for(int64_t(B) * C), 256, 0, s, dptr(out), dptr(inp), B, K, C);
  LAUNCH_CHECK();
}
template <class T> void mean_pool_backward(T* dinp, const T* dout, int B, int K, int C, Stream s) {
  if (int64_t(B) * K * C <= 0) return;
  launch_kernel(mean_pool_bwd_kernel<dev_t<T>>, grid_for(int64_t(B) * K * C), 256, 0, s, dptr(dinp), dptr(dout), B, K,
                C);
  LAUNCH_CHECK();
}

template <class T>
void l2norm_forward(T* out, acc_t<T>* rnorm, const T* inp, int64_t N, int C, double eps, Stream s) {
  if (N <= 0) return;
  launch_kernel(l2norm_fwd_kernel<dev_t<T>>, ceil_div(N, 4), 128, 0, s, dptr(out), rnorm, dptr(inp), N, C, float(eps));
  LAUNCH_CHECK();
}
template <class T>
void l2norm_backward(T* dinp, const T* dout, const T* inp, const acc_t<T>* rnorm, int64_t N, int C, Stream s) {
  if (N <= 0) return;
  launch_kernel(l2norm_bwd_kernel<dev_t<T>>, ceil_div(N, 4), 128, 0, s, dptr(dinp), dptr(dout), dptr(inp), rnorm, N, C);
  LAUNCH_CHECK();
}

template <class T> void argmax_rows(int32_t* out, const T* inp, int64_t N, int C, Stream s) {
  if (N <= 0) return;
  launch_kernel(argmax_kernel<dev_t<T>>, ceil_div(N, 4), 128, 0, s, out, dptr(inp), N, C);
  LAUNCH_CHECK();
}

#define LOOM_INDEXING(T)                                                                          \
  template void embedding_forward<T>(T*, const int32_t*, const T*, int64_t, int, int, Stream);   \
  template void gather_rows<T>(T*, const T*, const int32_t*, int, int, int, int, Stream);        \
  template void scatter_rows<T>(T*, const int32_t*, const T*, int, int, int, int, bool, Stream); \
  template void zero_rows<T>(T*, const int32_t*, int, int, int, int, Stream);                    \
  template void patchify<T>(T*, const T*, int, int, int, int, int, Stream);                      \
  template void patchify_backward<T>(T*, const T*, int, int, int, int, int, Stream);             \
  template void pixel_shuffle<T>(T*, const T*, int, int, int, int, Stream);                      \
  template void pixel_shuffle_backward<T>(T*, const T*, int, int, int, int, Stream);             \
  template void mean_pool_forward<T>(T*, const T*, int, int, int, Stream);                       \
  template void mean_pool_backward<T>(T*, const T*, int, int, int, Stream);                      \
  template void l2norm_forward<T>(T*, acc_t<T>*, const T*, int64_t, int, double, Stream);        \
  template void l2norm_backward<T>(T*, const T*, const T*, const acc_t<T>*, int64_t, int, Stream); \
  template void argmax_rows<T>(int32_t*, const T*, int64_t, int, Stream);
LOOM_INDEXING(float)
LOOM_INDEXING(bf16)
LOOM_INDEXING(f16)

}  // namespace loom::cuda
