/*
 * embedding_backward.cu: the embedding's table gradient, deterministic (no float atomics).
 * Reference: kernels/cpu/indexing.cpp (embedding_backward); the lookup is indexing.cu's row mover.
 *
 * Shapes: N ids (tokens), C channels, V table rows.
 *   dtable[V,C] += sum over n with ids[n] = v of dout[n, :]   (ids outside [0, V) add nothing)
 *   The sum of a row is over its positions n in increasing order, every run the same bits.
 * Sorted runs (large tables, the LM's 49152-token vocabulary): the (id, n) pairs are
 *   radix-sorted by id (cub, stable: n stays ascending within an id), and one warp per run of
 *   equal ids sums the dout rows of that run in order and adds the sum to dtable[id]. A run
 *   longer than kEmbChunk = 64 sorted positions (a VLM batch repeats its image placeholder id
 *   thousands of times) is first summed in pieces, one block per chunk of 64 positions
 *   (phase 1, fp32 partials), then its warp adds the pieces in order (phase 2).
 * Small tables (V <= 1024, N <= 24576: a ViT's positions looked up by its kept patches): no
 *   sort; a block per (table row, 256 columns) lists that row's positions in order (ballots
 *   over the ids in shared memory) and adds their rows, eight loads in flight.
 * Napkin bytes: dout read once, the sort ~16 B per id; the partials 2 x C floats per chunk.
 * Launch shape: grid-stride keys; phase 1 a block per chunk; phase 2 a warp per sorted
 *   position (only a run's first position works); v3 a block per (row, 256 columns).
 * Versions:
 *   v2_chunked_runs: run ends by binary search, long runs spread over blocks. v1 (one warp
 *     walking the whole run, its end found by a linear scan) took 14.5 ms on a SPEC VLM batch
 *     (16k tokens, ~3.2k image placeholders, H100); v2 under 1 ms.
 *   v3 (small tables): the contrastive MIM step's position-embedding backward 189 -> 36 us
 *     (H200, 2026-11-28; v2's sort, chunk and run passes took 0.20 ms for [12544, 768] into 196
 *     rows). A row's sum is v2's for runs of up to 64 ids (v2 adds longer runs in pieces).
 *   v4 (wide; rows of whole 16-byte words): v2's summing passes issued chains of 2-byte loads,
 *     one lane per column; v4 gives each thread 16 / sizeof(T) columns, loads eight rows' words
 *     before adding them, and reads a short run's row indices once per warp (shuffled to the
 *     lanes). It adds the same rows in the same order as v2, so the bits equal v2's (the test
 *     checks this); LOOM_EMB_BWD=2 keeps v2 for an A/B. The reference's VLM step (H200,
 *     2026-12-02, 3 rounds in one call): 47.79 -> 47.61 ms median, the same losses and peak.
 * Test: tests/cuda/test_cuda_indexing.cpp [indexing]:
 *   bash tools/gpu-kernels.sh tests/cuda/test_cuda_indexing.cpp
 */
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cstdlib>

#include "kernels/cuda/common.cuh"

namespace loom::cuda {

namespace {

__global__ void embedding_keys(int32_t* __restrict__ keys, int32_t* __restrict__ vals, const int32_t* __restrict__ ids,
                               int64_t N, int V) {
  pdl_entry();
  for (int64_t n = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; n < N; n += int64_t(gridDim.x) * blockDim.x) {
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
// The piece of a long run that chunk [c0, c1) sums into slot `slot` of its partials: [p0, p1)
// (false: nothing, the slot's run is short, outside the table, or slot 0's own).
__device__ __forceinline__ bool emb_chunk_piece(const int32_t* keys, int64_t N, int V, int64_t c0, int64_t c1, int slot,
                                                int64_t& p0, int64_t& p1) {
  if (slot == 0) {
    p0 = c0;
  } else {  // the last run starting inside the chunk
    p0 = max(c0, lower_pos(keys, N, keys[c1 - 1]));
    if (p0 == c0) return false;  // that is slot 0's run
  }
  const int key = keys[p0];
  if (key >= V) return false;
  const int64_t rs = lower_pos(keys, N, key), re = upper_pos(keys, N, key);
  if (re - rs <= kEmbChunk) return false;  // short: phase 2 sums it directly
  p1 = min(c1, re);
  return true;
}

template <class DT>
__global__ void embedding_bwd_chunks(float* __restrict__ partial, const DT* __restrict__ dout,
                                     const int32_t* __restrict__ keys, const int32_t* __restrict__ rows, int64_t N,
                                     int C, int V) {
  pdl_entry();
  const int64_t c0 = int64_t(blockIdx.x) * kEmbChunk, c1 = min(N, c0 + kEmbChunk);
  for (int slot = 0; slot < 2; slot++) {
    int64_t p0, p1;
    if (!emb_chunk_piece(keys, N, V, c0, c1, slot, p0, p1)) continue;
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

// v4 (wide): the same two phases, the same sums in the same order (so v2's bits), with each
// thread holding VEC = 16 / sizeof(T) adjacent columns, 16-byte loads, and U rows' loads issued
// before their adds. v2's lanes each walked one 2-byte column down a run, one dependent load
// after another (a 576-wide row is 18 such walks per warp); here a 576-wide row is 72 vectors,
// 3 per lane, each walk U rows at a time. Needs C % VEC == 0 and 16-byte aligned dout / dtable.
constexpr int kEmbU = 8;

// v4 phase 1: as embedding_bwd_chunks; a thread per VEC columns.
template <class DT>
__global__ void embedding_bwd_chunks_wide(float* __restrict__ partial, const DT* __restrict__ dout,
                                          const int32_t* __restrict__ keys, const int32_t* __restrict__ rows,
                                          int64_t N, int C, int V) {
  pdl_entry();
  constexpr int VEC = 16 / int(sizeof(DT));
  const int nv = C / VEC;
  const int64_t c0 = int64_t(blockIdx.x) * kEmbChunk, c1 = min(N, c0 + kEmbChunk);
  for (int slot = 0; slot < 2; slot++) {
    int64_t p0, p1;
    if (!emb_chunk_piece(keys, N, V, c0, c1, slot, p0, p1)) continue;
    for (int vi = threadIdx.x; vi < nv; vi += blockDim.x) {
      float acc[VEC];
#pragma unroll
      for (int e = 0; e < VEC; e++) acc[e] = 0.f;
      for (int64_t j0 = p0; j0 < p1; j0 += kEmbU) {
        uint4 w[kEmbU];
#pragma unroll
        for (int u = 0; u < kEmbU; u++)
          if (j0 + u < p1) w[u] = __ldg(reinterpret_cast<const uint4*>(dout + int64_t(rows[j0 + u]) * C) + vi);
#pragma unroll
        for (int u = 0; u < kEmbU; u++)
          if (j0 + u < p1) {
            const DT* x = reinterpret_cast<const DT*>(&w[u]);
#pragma unroll
            for (int e = 0; e < VEC; e++) acc[e] += to_float(x[e]);
          }
      }
      float4* out = reinterpret_cast<float4*>(partial + (int64_t(blockIdx.x) * 2 + slot) * C + int64_t(vi) * VEC);
#pragma unroll
      for (int e = 0; e < VEC; e += 4) out[e / 4] = make_float4(acc[e], acc[e + 1], acc[e + 2], acc[e + 3]);
    }
  }
}

// v4 phase 2: as embedding_bwd_runs; a short run's row indices are loaded by the lanes at once
// (lane l: positions i + l and i + 32 + l) and handed round with shuffles.
template <class DT>
__global__ void embedding_bwd_runs_wide(DT* __restrict__ dtable, const DT* __restrict__ dout,
                                        const float* __restrict__ partial, const int32_t* __restrict__ keys,
                                        const int32_t* __restrict__ rows, int64_t N, int C, int V) {
  pdl_entry();
  constexpr int VEC = 16 / int(sizeof(DT));
  const int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (i >= N) return;
  const int key = keys[i];
  if (key >= V || (i > 0 && keys[i - 1] == key)) return;  // the whole warp leaves together
  const int64_t end = upper_pos(keys, N, key);
  const bool long_run = end - i > kEmbChunk;
  const int len = int(min(end - i, int64_t(kEmbChunk)));
  int r_lo = 0, r_hi = 0;
  if (!long_run) {
    if (lane < len) r_lo = rows[i + lane];
    if (32 + lane < len) r_hi = rows[i + 32 + lane];
  }
  const int nv = C / VEC;
  for (int v0 = 0; v0 < nv; v0 += 32) {
    const int vi = v0 + lane;
    const bool on = vi < nv;
    float acc[VEC];
#pragma unroll
    for (int e = 0; e < VEC; e++) acc[e] = 0.f;
    if (!long_run) {
      for (int j0 = 0; j0 < len; j0 += kEmbU) {
        uint4 w[kEmbU];
#pragma unroll
        for (int u = 0; u < kEmbU; u++) {
          const int j = j0 + u;  // uniform across the warp
          const int r = __shfl_sync(0xffffffffu, j < 32 ? r_lo : r_hi, j & 31);
          if (on && j < len) w[u] = __ldg(reinterpret_cast<const uint4*>(dout + int64_t(r) * C) + vi);
        }
#pragma unroll
        for (int u = 0; u < kEmbU; u++)
          if (on && j0 + u < len) {
            const DT* x = reinterpret_cast<const DT*>(&w[u]);
#pragma unroll
            for (int e = 0; e < VEC; e++) acc[e] += to_float(x[e]);
          }
      }
    } else if (on) {
      const int64_t first = i / kEmbChunk, last = (end - 1) / kEmbChunk;
      auto add_piece = [&](int64_t piece) {
        const float4* p = reinterpret_cast<const float4*>(partial + piece * C + int64_t(vi) * VEC);
#pragma unroll
        for (int e = 0; e < VEC; e += 4) {
          const float4 f = p[e / 4];
          acc[e] += f.x;
          acc[e + 1] += f.y;
          acc[e + 2] += f.z;
          acc[e + 3] += f.w;
        }
      };
      add_piece(first * 2 + (i % kEmbChunk == 0 ? 0 : 1));
      for (int64_t ch = first + 1; ch <= last; ch++) add_piece(ch * 2);
    }
    if (on) {
      uint4* d = reinterpret_cast<uint4*>(dtable + int64_t(key) * C) + vi;
      uint4 w = *d;
      DT* t = reinterpret_cast<DT*>(&w);
#pragma unroll
      for (int e = 0; e < VEC; e++) t[e] = from_float<DT>(to_float(t[e]) + acc[e]);
      *d = w;
    }
  }
}

// embedding backward v3, small tables (V <= 1024, N <= 24576 ids: a ViT's positions looked up
// by the kept patches' indices): block (v, 256 columns) copies the ids into shared memory, lists
// the positions n with ids[n] == v in increasing n (ballots, a tile of 256 at a time, the list
// written over the ids already read) and adds their dout rows in that order, 8 loads in flight.
// No sort: v2's sort, chunk and run passes took 0.20 ms for the contrastive MIM's [12544, 768]
// into 196 rows (H200, 2026-11-28). A row's sum is v2's for runs of up to 64 ids (v2 adds longer
// runs in pieces of 64, so those may differ in the last bits); deterministic either way.
constexpr int kEmbSmallV = 1024, kEmbSmallN = 24576;
template <class DT>
__global__ void embedding_bwd_small(DT* __restrict__ dtable, const DT* __restrict__ dout,
                                    const int32_t* __restrict__ ids, int N, int C) {
  pdl_entry();
  extern __shared__ int32_t emb_ids[];  // [N]: the ids, then the list of positions
  __shared__ int wcount[8];
  const int v = blockIdx.x, c = blockIdx.y * 256 + threadIdx.x;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < N; i += 256) emb_ids[i] = ids[i];
  __syncthreads();
  int total = 0;  // positions listed so far (the same in every thread)
  for (int t0 = 0; t0 < N; t0 += 256) {
    const int n = t0 + threadIdx.x;
    const bool hit = n < N && emb_ids[n] == v;
    const unsigned m = __ballot_sync(0xffffffffu, hit);
    if (lane == 0) wcount[w] = __popc(m);
    __syncthreads();  // every id of this tile is read before the list overwrites any
    int before = 0, tile = 0;
#pragma unroll
    for (int k = 0; k < 8; k++) {
      const int x = wcount[k];
      before += k < w ? x : 0;
      tile += x;
    }
    if (hit) emb_ids[total + before + __popc(m & ((1u << lane) - 1))] = n;  // total + before <= n
    total += tile;
    __syncthreads();  // wcount is rewritten by the next tile
  }
  if (c >= C) return;
  float acc = 0.f;
  int j = 0;
  for (; j + 8 <= total; j += 8) {
    float x[8];
#pragma unroll
    for (int k = 0; k < 8; k++) x[k] = to_float(dout[int64_t(emb_ids[j + k]) * C + c]);
#pragma unroll
    for (int k = 0; k < 8; k++) acc += x[k];
  }
  for (; j < total; j++) acc += to_float(dout[int64_t(emb_ids[j]) * C + c]);
  DT* d = dtable + int64_t(v) * C + c;
  *d = from_float<DT>(to_float(*d) + acc);
}

}  // namespace

template <class T>
void embedding_backward(T* dtable, const T* dout, const int32_t* ids, int64_t N, int C, int V, Stream s) {
  if (N <= 0 || C <= 0) return;
  if (N > INT32_MAX) throw std::runtime_error("embedding_backward: N must fit in int32");
  if (V <= kEmbSmallV && N <= kEmbSmallN) {
    const size_t smem = sizeof(int32_t) * size_t(N);
    static bool attr = [] {  // up to 96 KB of ids (one attribute per instance: set once each)
      CUDA_CHECK(cudaFuncSetAttribute(embedding_bwd_small<dev_t<T>>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      int(sizeof(int32_t) * kEmbSmallN)));
      return true;
    }();
    (void)attr;
    launch_kernel(embedding_bwd_small<dev_t<T>>, dim3(unsigned(V), unsigned(ceil_div(C, 256))), 256, smem, s,
                  dptr(dtable), dptr(dout), ids, int(N), C);
    LAUNCH_CHECK();
    return;
  }
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
  launch_kernel(embedding_keys, std::min(ceil_div(N, 256), 16384), 256, 0, s, keys_in, vals_in, ids, N, V);
  LAUNCH_CHECK();
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(ws + arrays + partial_bytes, temp_bytes, keys_in, keys_out, vals_in,
                                             vals_out, int(N), 0, bits, s));
  constexpr int VEC = 16 / int(sizeof(T));
  const char* e = std::getenv("LOOM_EMB_BWD");  // =2: v2's 2-byte columns (read at every call: A/B, tests)
  if (!(e && e[0] == '2') && C % VEC == 0 && aligned(dout, 16) && aligned(dtable, 16)) {
    // v4: a thread per 16 bytes of columns; phase 1's blocks as wide as the row's vectors
    const int threads = int(std::min<int64_t>(256, (C / VEC + 31) / 32 * 32));
    launch_kernel(embedding_bwd_chunks_wide<dev_t<T>>, unsigned(chunks), threads, 0, s, partial, dptr(dout), keys_out,
                  vals_out, N, C, V);
    LAUNCH_CHECK();
    launch_kernel(embedding_bwd_runs_wide<dev_t<T>>, ceil_div(N * 32, 256), 256, 0, s, dptr(dtable), dptr(dout),
                  partial, keys_out, vals_out, N, C, V);
    LAUNCH_CHECK();
  } else {
    launch_kernel(embedding_bwd_chunks<dev_t<T>>, unsigned(chunks), 256, 0, s, partial, dptr(dout), keys_out, vals_out,
                  N, C, V);
    LAUNCH_CHECK();
    launch_kernel(embedding_bwd_runs<dev_t<T>>, ceil_div(N * 32, 256), 256, 0, s, dptr(dtable), dptr(dout), partial,
                  keys_out, vals_out, N, C, V);
    LAUNCH_CHECK();
  }
  device_free(ws);  // stream-ordered reuse
}

template void embedding_backward<float>(float*, const float*, const int32_t*, int64_t, int, int, Stream);
template void embedding_backward<bf16>(bf16*, const bf16*, const int32_t*, int64_t, int, int, Stream);
template void embedding_backward<f16>(f16*, const f16*, const int32_t*, int64_t, int, int, Stream);

}  // namespace loom::cuda
