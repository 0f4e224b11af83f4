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
 * Embedding backward without float atomics: the (id, n) pairs are radix-sorted by id (a
 *   stable sort keeps n ascending within an id), and one warp per run of equal ids sums the
 *   dout rows of that run in order and adds the sum to dtable[id]. Same result every run.
 *   A run longer than 64 rows (a VLM batch repeats its image placeholder id thousands of times)
 *   is first summed in pieces of at most 64 sorted positions, one block per piece, then its
 *   warp adds the pieces in order: v1 (one warp walking the whole run, and finding its end by a
 *   linear scan) took 14.5 ms on a SPEC VLM batch (16k tokens, ~3.2k image placeholders,
 *   H100); v2_chunked_runs finds run ends by binary search and spreads long runs over blocks.
 *   scatter_rows with accumulate: one thread per (b, c) walks k in order: no races even when
 *   an index repeats; without (distinct indices) one thread per element (scatter_rows_set).
 * Napkin bytes: all of these move each element once (embedding backward: dout once, the
 *   sort 16 B per token).
 * Launch shape: grid-stride, 256 threads, one thread per output element (gathers read
 *   coalesced along C); warp per row for l2norm/argmax; warp per id run for embedding bwd.
 * Versions: embedding backward v2_chunked_runs (above); patchify forward v2 through shared
 *   memory (one block per patch row: the p image rows of every channel are contiguous runs in,
 *   the row's patches one contiguous run out; 148 -> 103 us for 128 images of 224 px, H100);
 *   the others v1 only.
 * Test: tests/cuda/test_cuda_indexing.cpp [indexing]:
 *   bash tools/gpu-kernels.sh tests/cuda/test_cuda_indexing.cpp
 */
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>

#include "kernels/cuda/common.cuh"

namespace loom::cuda {

namespace {

inline int grid_for(int64_t n, int threads = 256) {
  return int(std::min<int64_t>(std::max<int64_t>(1, (n + threads - 1) / threads), 16384));
}
#define GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

template <class DT>
__global__ void embedding_fwd_kernel(DT* __restrict__ out, const int32_t* __restrict__ ids,
                                     const DT* __restrict__ table, int64_t N, int C, int V) {
  pdl_entry();
  GRID_STRIDE(i, N * C) {
    int64_t n = i / C;
    int c = int(i - n * C);
    int id = ids[n];
    out[i] = (id >= 0 && id < V) ? table[int64_t(id) * C + c] : from_float<DT>(0.f);
  }
}

__global__ void embedding_keys(int32_t* __restrict__ keys, int32_t* __restrict__ vals, const int32_t* __restrict__ ids,
                               int64_t N, int V) {
  pdl_entry();
  GRID_STRIDE(n, N) {
    int id = ids[n];
    keys[n] = (id >= 0 && id < V) ? id : V;  // out-of-range ids sort last and are skipped
    vals[n] = int32_t(n);
  }
}

// Sorted keys: the first position with key >= k / > k (binary search; the runs of one id can
// be thousands long, e.g. the image placeholder id of a VLM batch).
__device__ __forceinline__ int64_t lower_pos(const int32_t* keys, int64_t N, int k) {
  int64_t lo = 0, hi = N;
  while (lo < hi) {
    int64_t mid = (lo + hi) >> 1;
    if (keys[mid] < k) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}
__device__ __forceinline__ int64_t upper_pos(const int32_t* keys, int64_t N, int k) { return lower_pos(keys, N, k + 1); }

constexpr int kEmbChunk = 64;  // runs longer than this are summed in chunk pieces first

// Long runs, phase 1: block per chunk of kEmbChunk sorted positions; the pieces of long runs in
// it (at most two: the run holding the chunk's first position, slot 0, and a long run starting
// inside it, slot 1) are summed row by row in order into partial[chunk][slot][C] (fp32).
template <class DT>
__global__ void embedding_bwd_chunks(float* __restrict__ partial, const DT* __restrict__ dout,
                                     const int32_t* __restrict__ keys, const int32_t* __restrict__ rows, int64_t N,
                                     int C, int V) {
  pdl_entry();
  const int64_t c0 = int64_t(blockIdx.x) * kEmbChunk, c1 = min(N, c0 + kEmbChunk);
  for (int slot = 0; slot < 2; slot++) {
    int64_t p0;
    if (slot == 0) {
      p0 = c0;
    } else {  // the last run starting inside the chunk
      int k_last = keys[c1 - 1];
      p0 = max(c0, lower_pos(keys, N, k_last));
      if (p0 == c0) continue;  // that is slot 0's run
    }
    int key = keys[p0];
    if (key >= V) continue;
    int64_t rs = lower_pos(keys, N, key), re = upper_pos(keys, N, key);
    if (re - rs <= kEmbChunk) continue;  // short: phase 2 sums it directly
    int64_t p1 = min(c1, re);
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      float acc = 0.f;
      for (int64_t j = p0; j < p1; j++) acc += to_float(dout[int64_t(rows[j]) * C + c]);
      partial[(int64_t(blockIdx.x) * 2 + slot) * C + c] = acc;
    }
  }
}

// Phase 2: one warp per sorted position; only the first position of each run works. A short
// run sums its rows in order; a long one adds its chunk pieces in order. Same result every run.
template <class DT>
__global__ void embedding_bwd_runs(DT* __restrict__ dtable, const DT* __restrict__ dout, const float* __restrict__ partial,
                                   const int32_t* __restrict__ keys, const int32_t* __restrict__ rows, int64_t N,
                                   int C, int V) {
  pdl_entry();
  int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  int lane = threadIdx.x & 31;
  if (i >= N) return;
  int key = keys[i];
  if (key >= V || (i > 0 && keys[i - 1] == key)) return;
  int64_t end = upper_pos(keys, N, key);
  const bool long_run = end - i > kEmbChunk;
  for (int c0 = 0; c0 < C; c0 += 32) {
    int c = c0 + lane;
    if (c >= C) break;
    float acc = 0.f;
    if (!long_run) {
      for (int64_t j = i; j < end; j++) acc += to_float(dout[int64_t(rows[j]) * C + c]);
    } else {
      int64_t first = i / kEmbChunk, last = (end - 1) / kEmbChunk;
      acc += partial[(first * 2 + (i % kEmbChunk == 0 ? 0 : 1)) * C + c];
      for (int64_t ch = first + 1; ch <= last; ch++) acc += partial[(ch * 2) * C + c];
    }
    DT* d = dtable + int64_t(key) * C + c;
    *d = from_float<DT>(to_float(*d) + acc);
  }
}

template <class DT>
__global__ void gather_rows_kernel(DT* __restrict__ out, const DT* __restrict__ inp, const int32_t* __restrict__ idx,
                                   int B, int N, int K, int C) {
  pdl_entry();
  GRID_STRIDE(i, int64_t(B) * K * C) {
    int64_t bk = i / C;
    int c = int(i - bk * C);
    int b = int(bk / K);
    out[i] = inp[(int64_t(b) * N + idx[bk]) * C + c];
  }
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

// scatter_rows without accumulation (indices distinct within a b): one thread per element of
// src, like the gather. The loop over k above leaves only B * C threads: with B = 1 (a VLM
// batch's image tokens, 576 wide) 576 threads walking thousands of rows each.
template <class DT>
__global__ void scatter_rows_set_kernel(DT* __restrict__ out, const int32_t* __restrict__ idx,
                                        const DT* __restrict__ src, int B, int N, int K, int C) {
  pdl_entry();
  GRID_STRIDE(i, int64_t(B) * K * C) {
    const int64_t bk = i / C;
    const int c = int(i - bk * C);
    const int b = int(bk / K);
    out[(int64_t(b) * N + idx[bk]) * C + c] = src[i];
  }
}

template <class DT>
__global__ void zero_rows_kernel(DT* __restrict__ out, const int32_t* __restrict__ idx, int B, int N, int K, int C) {
  pdl_entry();
  GRID_STRIDE(i, int64_t(B) * K * C) {
    int64_t bk = i / C;
    int c = int(i - bk * C);
    int b = int(bk / K);
    out[(int64_t(b) * N + idx[bk]) * C + c] = from_float<DT>(0.f);
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

// pixel shuffle: i indexes the shuffled layout; BACKWARD writes the grid layout.
template <class DT, bool BACKWARD>
__global__ void pixel_shuffle_kernel(DT* __restrict__ dst, const DT* __restrict__ src, int B, int G, int D, int s) {
  pdl_entry();
  const int Gs = G / s, F = s * s * D;
  GRID_STRIDE(i, int64_t(B) * Gs * Gs * F) {
    int f = int(i % F);
    int64_t bt = i / F;
    int tok = int(bt % (Gs * Gs)), b = int(bt / (Gs * Gs));
    int ti = tok / Gs, tj = tok % Gs;
    int d = f % D, uv = f / D, u = uv / s, v = uv % s;
    int64_t g = (int64_t(b) * G * G + int64_t(ti * s + u) * G + tj * s + v) * D + d;
    if (BACKWARD) dst[g] = src[i];
    else dst[i] = src[g];
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
  launch_kernel(embedding_fwd_kernel<dev_t<T>>, grid_for(N * C), 256, 0, s, dptr(out), ids, dptr(table), N, C, V);
  LAUNCH_CHECK();
}

template <class T>
void embedding_backward(T* dtable, const T* dout, const int32_t* ids, int64_t N, int C, int V, Stream s) {
  if (N <= 0 || C <= 0) return;
  if (N > INT32_MAX) throw std::runtime_error("embedding_backward: N must fit in int32");
  int bits = 1;
  while ((int64_t(1) << bits) <= V) bits++;  // keys are in [0, V]
  size_t temp_bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, (const int32_t*)nullptr, (int32_t*)nullptr,
                                             (const int32_t*)nullptr, (int32_t*)nullptr, int(N), 0, bits, s));
  size_t arrays = sizeof(int32_t) * size_t(N) * 4;
  const int64_t chunks = (N + kEmbChunk - 1) / kEmbChunk;
  size_t partial_bytes = sizeof(float) * size_t(chunks) * 2 * size_t(C);
  arrays = (arrays + 255) / 256 * 256;
  char* ws = static_cast<char*>(device_malloc(arrays + partial_bytes + temp_bytes));
  float* partial = reinterpret_cast<float*>(ws + arrays);
  int32_t* keys_in = reinterpret_cast<int32_t*>(ws);
  int32_t* keys_out = keys_in + N;
  int32_t* vals_in = keys_out + N;
  int32_t* vals_out = vals_in + N;
  launch_kernel(embedding_keys, grid_for(N), 256, 0, s, keys_in, vals_in, ids, N, V);
  LAUNCH_CHECK();
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(ws + arrays + partial_bytes, temp_bytes, keys_in, keys_out, vals_in,
                                             vals_out, int(N), 0, bits, s));
  launch_kernel(embedding_bwd_chunks<dev_t<T>>, unsigned(chunks), 256, 0, s, partial, dptr(dout), keys_out, vals_out, N,
                C, V);
  LAUNCH_CHECK();
  launch_kernel(embedding_bwd_runs<dev_t<T>>, ceil_div(N * 32, 256), 256, 0, s, dptr(dtable), dptr(dout), partial,
                keys_out, vals_out, N, C, V);
  LAUNCH_CHECK();
  device_free(ws);  // stream-ordered reuse
}

template <class T>
void gather_rows(T* out, const T* inp, const int32_t* idx, int B, int N, int K, int C, Stream s) {
  if (int64_t(B) * K * C <= 0) return;
  launch_kernel(gather_rows_kernel<dev_t<T>>, grid_for(int64_t(B) * K * C), 256, 0, s, dptr(out), dptr(inp), idx, B, N,
                K, C);
  LAUNCH_CHECK();
}

template <class T>
void scatter_rows(T* out, const int32_t* idx, const T* src, int B, int N, int K, int C, bool accumulate, Stream s) {
  if (int64_t(B) * K * C <= 0) return;
  if (!accumulate)
    launch_kernel(scatter_rows_set_kernel<dev_t<T>>, grid_for(int64_t(B) * K * C), 256, 0, s, dptr(out), idx, dptr(src),
                  B, N, K, C);
  else
    launch_kernel(scatter_rows_kernel<dev_t<T>>, grid_for(int64_t(B) * C), 256, 0, s, dptr(out), idx, dptr(src), B, N,
                  K, C, accumulate);
  LAUNCH_CHECK();
}

template <class T> void zero_rows(T* out, const int32_t* idx, int B, int N, int K, int C, Stream s) {
  if (int64_t(B) * K * C <= 0) return;
  launch_kernel(zero_rows_kernel<dev_t<T>>, grid_for(int64_t(B) * K * C), 256, 0, s, dptr(out), idx, B, N, K, C);
  LAUNCH_CHECK();
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
  if (smem <= 48 * 1024 && int64_t(B) * (H / p) < (int64_t(1) << 31))
    launch_kernel(patchify_rows_kernel<dev_t<T>>, unsigned(int64_t(B) * (H / p)), 256, smem, s, dptr(out), dptr(img),
                  Ch, H, W, p);
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
  launch_kernel(pixel_shuffle_kernel<dev_t<T>, false>, grid_for(n), 256, 0, s_, dptr(out), dptr(inp), B, G, D, s);
  LAUNCH_CHECK();
}
template <class T> void pixel_shuffle_backward(T* dinp, const T* dout, int B, int G, int D, int s, Stream s_) {
  check_shuffle(G, s);
  int64_t n = int64_t(B) * G * G * D;
  if (n <= 0) return;
  launch_kernel(pixel_shuffle_kernel<dev_t<T>, true>, grid_for(n), 256, 0, s_, dptr(dinp), dptr(dout), B, G, D, s);
  LAUNCH_CHECK();
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
  template void embedding_backward<T>(T*, const T*, const int32_t*, int64_t, int, int, Stream);  \
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
