/*
 * rope.cu: rotary position embedding, rotate-half convention, forward and backward.
 * Reference: kernels/cpu/rope.cpp.
 *
 * Shapes: N tokens, H heads, hd head dim (even); inp/out/dout/dinp [N, H, hd]; pos [N] int32.
 *   For i < hd/2: angle = pos * theta^(-2i/hd)
 *     out[i]        = x[i] cos - x[i + hd/2] sin
 *     out[i + hd/2] = x[i + hd/2] cos + x[i] sin                                   (=)
 *   Backward is the rotation by -angle (the transpose of a rotation):
 *     dinp[i]        = d[i] cos + d[i + hd/2] sin
 *     dinp[i + hd/2] = d[i + hd/2] cos - d[i] sin                                  (=)
 * Nothing is saved: cos/sin are recomputed from pos (no [T, hd] tables to keep in sync).
 * Precision: the angle is formed and reduced in double. In fp32, pos * inv_freq at pos 8k
 *   is off by ~5e-4 rad (8192 * 2^-24 * 2pi-ish), which the f32 test tolerance would see;
 *   the double math is ~1 us extra per call at these sizes.
 * Napkin bytes: one read and one write of [N, H, hd] (e.g. 16k tokens x 9 heads x 64 in
 *   bf16: 2 x 18.9 MB); cos/sin are per (token, i) and shared by the H heads through the
 *   loop below.
 * Launch shape: one thread per (token, i) pair, looping over the H heads (the sincos is
 *   computed once per pair, not per head); 256 threads, grid-stride.
 * Versions: v1 one pair per thread, 2-byte accesses: 16 us a call in the SPEC VLM step
 *   (CUPTI trace, H100, 2026-11-24; napkin for the example above: 38 MB moved, ~13 us at
 *   3 TB/s, and the k calls, 3 heads, move a third of that); v2 two neighbouring pairs per
 *   thread with 2-element accesses (hd / 2 even), the default: in the same trace both rope
 *   kernels left the step's top 25 (each under 0.9 ms a step, from 0.97 and 0.92 ms); the
 *   VLM step 71.9 / 71.9 -> 71.8 / 71.6 ms (H100, same call, two rounds: within its noise).
 * Joined q|k|v rows (rope_qkv_split / rope_qkv_join, the Llama layer's joined product): per
 *   token the rows hold H heads of q, KV of k, KV of v; split writes q, k rotated and v copied,
 *   join writes dqkv's rows from dq, dk (rotated by -angle) and dv. One pass: a block takes 8
 *   tokens, puts cos/sin of each (token, pair) in shared memory (one sincos for all the
 *   token's q and k heads), then moves each head's first-half 16-byte chunk with its partner
 *   chunk in the second half. Napkin (SPEC VLM: 16384 tokens, 9 + 3 + 3 heads of 64, bf16):
 *   31.5 MB read + 31.5 MB written, ~21 us at 3 TB/s; measured 23.5 us a call (H100,
 *   2026-11-27, CUPTI trace). It replaced two rope2_kernel calls plus v's copy out of the
 *   rows (forward) and two rope2_kernel calls plus dv's copy into them (backward): 2.53 ->
 *   1.41 ms a VLM step; the first form of it (two pairs per thread, 4-byte accesses, cos/sin
 *   in registers) ran 33 us a call. Head dims whose half is no multiple of the 16-byte vector,
 *   or unaligned pointers, take the row rotations and a 2-D copy.
 *   Every kernel here rounds a rotation the same way (rotate_pair: a multiply, then one fma,
 *   written with intrinsics so that the compiler cannot contract differently per kernel): the
 *   one-pass kernel and the row kernels agree bit for bit (a test checks it), and so do the
 *   VLM's deterministic losses before and after the joined form (20 steps, H100).
 * The angle table (rope_table.h, rope_table below): (cos, sin) per (position, pair), filled by a
 *   kernel calling rope_cos_sin, so a lookup gives the very floats the kernels here form; for
 *   gemm_sm90.cu's q|k|v epilogue (linear_qkv_rope), where forming them in double per tile would
 *   cost more than the tile's product.
 * Test: tests/cuda/test_cuda_rope.cpp [rope]:
 *   bash tools/gpu-kernels.sh tests/cuda/test_cuda_rope.cpp
 */
#include <algorithm>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "kernels/cuda/rope.cuh"
#include "kernels/cuda/rope_table.h"

namespace loom::cuda {

namespace {

template <class DT, bool BACKWARD>
__global__ void rope_kernel(DT* __restrict__ out, int64_t ldo, const DT* __restrict__ inp, int64_t ldi,
                            const int32_t* __restrict__ pos, int64_t N, int H, int hd, double log_theta) {
  pdl_entry();
  const int half = hd / 2;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < N * half;
       t += int64_t(gridDim.x) * blockDim.x) {
    int64_t n = t / half;
    int i = int(t - n * half);
    float cs, sn;
    rope_cos_sin<BACKWARD>(cs, sn, pos[n], i, hd, log_theta);
    for (int h = 0; h < H; h++) {
      const int64_t bi = n * ldi + h * hd, bo = n * ldo + h * hd;
      float y0, y1;
      rotate_pair(y0, y1, to_float(inp[bi + i]), to_float(inp[bi + i + half]), cs, sn);
      out[bo + i] = from_float<DT>(y0);
      out[bo + i + half] = from_float<DT>(y1);
    }
  }
}

// The same with two neighbouring pairs (i, i + 1) per thread, moved as one 2-element access
// each (hd / 2 even, pointers aligned to two elements): half the load/store instructions of
// the kernel above, whose 2-byte accesses kept it at about half the bandwidth.
template <class DT, bool BACKWARD>
__global__ void rope2_kernel(DT* __restrict__ out, int64_t ldo, const DT* __restrict__ inp, int64_t ldi,
                             const int32_t* __restrict__ pos, int64_t N, int H, int hd, double log_theta) {
  pdl_entry();
  const int half = hd / 2, pairs = half / 2;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < N * pairs;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = t / pairs;
    const int i = 2 * int(t - n * pairs);
    float cs[2], sn[2];
    rope_cos_sin<BACKWARD>(cs[0], sn[0], pos[n], i, hd, log_theta);
    rope_cos_sin<BACKWARD>(cs[1], sn[1], pos[n], i + 1, hd, log_theta);
    for (int h = 0; h < H; h++) {
      const int64_t bi = n * ldi + h * hd + i, bo = n * ldo + h * hd + i;
      Pack<DT, 2> a = *reinterpret_cast<const Pack<DT, 2>*>(inp + bi);
      Pack<DT, 2> b = *reinterpret_cast<const Pack<DT, 2>*>(inp + bi + half);
      Pack<DT, 2> oa, ob;
#pragma unroll
      for (int k = 0; k < 2; k++) {
        float y0, y1;
        rotate_pair(y0, y1, to_float(a.v[k]), to_float(b.v[k]), cs[k], sn[k]);
        oa.v[k] = from_float<DT>(y0);
        ob.v[k] = from_float<DT>(y1);
      }
      *reinterpret_cast<Pack<DT, 2>*>(out + bo) = oa;
      *reinterpret_cast<Pack<DT, 2>*>(out + bo + half) = ob;
    }
  }
}

template <class T, bool BACKWARD>
void launch(T* out, int64_t ldo, const T* inp, int64_t ldi, const int32_t* pos, int64_t N, int H, int hd, double theta,
            Stream s) {
  if (hd % 2) throw std::runtime_error("rope: head dim must be even, got " + std::to_string(hd));
  int64_t n = N * (hd / 2);
  if (n <= 0 || H <= 0) return;
  if ((hd / 2) % 2 == 0 && aligned(out, 2 * sizeof(T)) && aligned(inp, 2 * sizeof(T)) && ldo % 2 == 0 && ldi % 2 == 0) {
    const int g = int(std::min<int64_t>((n / 2 + 255) / 256, 8192));
    launch_kernel(rope2_kernel<dev_t<T>, BACKWARD>, g, 256, 0, s, dptr(out), ldo, dptr(inp), ldi, pos, N, H, hd,
                  std::log(theta));
    LAUNCH_CHECK();
    return;
  }
  int g = int(std::min<int64_t>((n + 255) / 256, 8192));
  launch_kernel(rope_kernel<dev_t<T>, BACKWARD>, g, 256, 0, s, dptr(out), ldo, dptr(inp), ldi, pos, N, H, hd,
                std::log(theta));
  LAUNCH_CHECK();
}

// The rows of a joined q|k|v product split into q, k (rotated) and v (copied), or, in the
// backward, dq, dk, dv joined into dqkv's rows (rotated by -angle, dv copied). A block takes
// kQkvTokens tokens: first the cos/sin of each (token, i) pair into shared memory (once for
// all the token's q and k heads), then every (token, head, 16-byte chunk) of the first half
// of a head with its partner chunk in the second half, 16-byte loads and stores throughout.
constexpr int kQkvTokens = 8;

template <class DT, bool BACKWARD>
__global__ void __launch_bounds__(256)
    rope_qkv_kernel(DT* __restrict__ joined, DT* __restrict__ q, DT* __restrict__ k, DT* __restrict__ v,
                    const int32_t* __restrict__ pos, int64_t N, int H, int KV, int hd, double log_theta) {
  pdl_entry();
  constexpr int VEC = 16 / sizeof(DT);
  extern __shared__ float2 cs_sh[];  // [kQkvTokens][half]: cos, sin
  const int half = hd / 2, heads = H + 2 * KV, chunks = half / VEC, per_token = heads * chunks;
  const int64_t n0 = int64_t(blockIdx.x) * kQkvTokens, W = int64_t(heads) * hd;
  const int tokens = int(min(int64_t(kQkvTokens), N - n0));
  for (int e = threadIdx.x; e < tokens * half; e += blockDim.x) {
    const int t = e / half, i = e - t * half;
    float cs, sn;
    rope_cos_sin<BACKWARD>(cs, sn, pos[n0 + t], i, hd, log_theta);
    cs_sh[e] = make_float2(cs, sn);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < tokens * per_token; e += blockDim.x) {
    const int t = e / per_token, r = e - t * per_token, h = r / chunks, i = (r - h * chunks) * VEC;
    const int64_t n = n0 + t;
    DT* part = h < H ? q + (n * H + h) * hd : h < H + KV ? k + (n * KV + h - H) * hd : v + (n * KV + h - H - KV) * hd;
    DT* row = joined + n * W + int64_t(h) * hd;
    const DT* src = BACKWARD ? part : row;
    DT* dst = BACKWARD ? row : part;
    Pack<DT, VEC> a = *reinterpret_cast<const Pack<DT, VEC>*>(src + i);
    Pack<DT, VEC> b = *reinterpret_cast<const Pack<DT, VEC>*>(src + i + half);
    if (h < H + KV) {
#pragma unroll
      for (int j = 0; j < VEC; j++) {
        const float2 c = cs_sh[t * half + i + j];
        float y0, y1;
        rotate_pair(y0, y1, to_float(a.v[j]), to_float(b.v[j]), c.x, c.y);
        a.v[j] = from_float<DT>(y0);
        b.v[j] = from_float<DT>(y1);
      }
    }
    *reinterpret_cast<Pack<DT, VEC>*>(dst + i) = a;
    *reinterpret_cast<Pack<DT, VEC>*>(dst + i + half) = b;
  }
}

template <class T, bool BACKWARD>
void launch_qkv(T* joined, T* q, T* k, T* v, const int32_t* pos, int64_t N, int H, int KV, int hd, double theta,
                Stream s) {
  if (hd % 2) throw std::runtime_error("rope: head dim must be even, got " + std::to_string(hd));
  if (N <= 0) return;
  const int64_t W = int64_t(H + 2 * KV) * hd, qw = int64_t(H) * hd, kw = int64_t(KV) * hd;
  constexpr int VEC = 16 / sizeof(T);
  if ((hd / 2) % VEC == 0 && aligned(joined, 16) && aligned(q, 16) && aligned(k, 16) && aligned(v, 16)) {
    const int64_t g = (N + kQkvTokens - 1) / kQkvTokens;
    const size_t smem = size_t(kQkvTokens) * (hd / 2) * sizeof(float2);
    launch_kernel(rope_qkv_kernel<dev_t<T>, BACKWARD>, unsigned(g), 256, smem, s, dptr(joined), dptr(q), dptr(k),
                  dptr(v), pos, N, H, KV, hd, std::log(theta));
    LAUNCH_CHECK();
    return;
  }
  // otherwise (hd / 2 not a multiple of the vector, unaligned pointers): the two rotations and
  // a 2-D copy
  const size_t es = sizeof(T);
  if constexpr (BACKWARD) {
    launch<T, true>(joined, W, q, qw, pos, N, H, hd, theta, s);
    launch<T, true>(joined + qw, W, k, kw, pos, N, KV, hd, theta, s);
    CUDA_CHECK(cudaMemcpy2DAsync(joined + qw + kw, W * es, v, kw * es, kw * es, N, cudaMemcpyDeviceToDevice, s));
  } else {
    launch<T, false>(q, qw, joined, W, pos, N, H, hd, theta, s);
    launch<T, false>(k, kw, joined + qw, W, pos, N, KV, hd, theta, s);
    CUDA_CHECK(cudaMemcpy2DAsync(v, kw * es, joined + qw + kw, W * es, kw * es, N, cudaMemcpyDeviceToDevice, s));
  }
}

// Row p of the table, entry i: (cos, sin) of pair i at position p (rope_table.h).
__global__ void rope_table_kernel(float2* __restrict__ table, int rows, int hd, double log_theta) {
  pdl_entry();
  const int half = hd / 2;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < int64_t(rows) * half;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int p = int(e / half), i = int(e - int64_t(p) * half);
    float cs, sn;
    rope_cos_sin<false>(cs, sn, p, i, hd, log_theta);
    table[e] = make_float2(cs, sn);
  }
}

}  // namespace

const float2* rope_table(int hd, double theta, int64_t rows, int* table_rows, cudaStream_t s) {
  constexpr int64_t kMaxRows = 65536, kStep = 2048;
  const int want = int(std::min(kMaxRows, std::max<int64_t>(kStep, (rows + kStep - 1) / kStep * kStep)));
  static std::mutex mu;
  static auto* tables = new std::map<std::pair<int, double>, std::pair<float2*, int>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& t = (*tables)[{hd, theta}];
  if (t.first && t.second >= want) {
    *table_rows = t.second;
    return t.first;
  }
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(s, &cap));
  if (cap != cudaStreamCaptureStatusNone) {  // no build inside a graph: the table there is, if any
    *table_rows = t.first ? t.second : 0;
    return t.first;
  }
  // the old table (if any) stays allocated: a graph captured earlier may read it
  auto* table = static_cast<float2*>(device_malloc(sizeof(float2) * size_t(want) * (hd / 2)));
  const int64_t n = int64_t(want) * (hd / 2);
  launch_kernel(rope_table_kernel, unsigned(std::min<int64_t>((n + 255) / 256, 4096)), 256, 0, s, table, want, hd,
                std::log(theta));
  LAUNCH_CHECK();
  // once per build: a later call on another stream must not read the table before it is filled
  CUDA_CHECK(cudaStreamSynchronize(s));
  t = {table, want};
  *table_rows = want;
  return table;
}

template <class T>
void rope_qkv_split(T* q, T* k, T* v, const T* qkv, const int32_t* pos, int64_t N, int H, int KV, int hd,
                    double theta, Stream s) {
  launch_qkv<T, false>(const_cast<T*>(qkv), q, k, v, pos, N, H, KV, hd, theta, s);
}
template <class T>
void rope_qkv_join(T* dqkv, const T* dq, const T* dk, const T* dv, const int32_t* pos, int64_t N, int H, int KV,
                   int hd, double theta, Stream s) {
  launch_qkv<T, true>(dqkv, const_cast<T*>(dq), const_cast<T*>(dk), const_cast<T*>(dv), pos, N, H, KV, hd, theta, s);
}

template <class T>
void rope_forward(T* out, const T* inp, const int32_t* pos, int64_t N, int H, int hd, double theta, Stream s) {
  launch<T, false>(out, int64_t(H) * hd, inp, int64_t(H) * hd, pos, N, H, hd, theta, s);
}
template <class T>
void rope_backward(T* dinp, const T* dout, const int32_t* pos, int64_t N, int H, int hd, double theta, Stream s) {
  launch<T, true>(dinp, int64_t(H) * hd, dout, int64_t(H) * hd, pos, N, H, hd, theta, s);
}

#define LOOM_ROPE(T)                                                                               \
  template void rope_forward<T>(T*, const T*, const int32_t*, int64_t, int, int, double, Stream);  \
  template void rope_backward<T>(T*, const T*, const int32_t*, int64_t, int, int, double, Stream);  \
  template void rope_qkv_split<T>(T*, T*, T*, const T*, const int32_t*, int64_t, int, int, int, double, Stream); \
  template void rope_qkv_join<T>(T*, const T*, const T*, const T*, const int32_t*, int64_t, int, int, int, double, \
                                 Stream);
LOOM_ROPE(float)
LOOM_ROPE(bf16)
LOOM_ROPE(f16)

}  // namespace loom::cuda
