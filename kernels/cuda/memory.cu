/*
 * memory.cu: fill, convert, strided copy, broadcast binary ops, unary ops, axpby, axpy with a
 * device scalar, broadcast-reduction (reduce_sum_to) and sum_all, on the GPU.
 * Reference: kernels/cpu/memory.cpp (same declarations, kernels/kernels.inc).
 *
 * Shapes (elements): n flat length; Layout = shape + strides (elements) of up to 8 dims.
 *   fill          out[n] = value                       (float, bf16, f16, int32, int64)
 *   convert       out[n] = To(in[n])                   (every pair over f32, bf16, f16, i32, i64; f64<->f32)
 *   copy_strided  out[in.shape] (contiguous) = in read through in.stride
 *   binary        out[la.shape] = a (strides la) op b (strides lb), 0-strides broadcast
 *   unary         out[n] = f(in[n])
 *   axpby         out[n] = alpha a + beta b (b nullable)
 *   axpy_dev      y[n] += (*alpha_dev) x               (alpha on the device: no host sync), or
 *                 y[n] = (*alpha_dev) x without reading y (accumulate false: a new gradient buffer)
 *   reduce_sum_to out[kept dims] = sum over dims where out_bcast.stride == 0 (and shape > 1)
 *   sum_all       out[1] = sum(in[n]) in float
 * All outputs are `=` except axpy_dev (`+=` unless told `=`). Arithmetic is in float (bf16 and f16 are storage only).
 *
 * Napkin bytes: every kernel here is one read of each input and one write of the output;
 *   they are bandwidth-bound and run at whatever the access pattern allows. Contiguous
 *   operands take a flat path (no index arithmetic), 16 bytes per access where sizes and
 *   alignment allow; an operand broadcast over leading dims only (a bias or position table
 *   added to every row) is read at i % period, one modulo per 16 bytes; other broadcast or
 *   strided ones decompose the flat index with one div/mod per dim (measured 2026-11-24,
 *   H100: [128,196,768] + [196,768] in bf16 took 199 us on that path).
 * Launch shape: grid-stride loops, 256 threads, at most 16 blocks per SM-ish (4096 blocks).
 *   reduce_sum_to: when the reduced dims lead in a contiguous input (a position table's or a
 *   broadcast vector's gradient), colsum.cuh's column sums (linear_backward's bias gradient:
 *   partials over row splits added in order by a second launch); else one thread per output
 *   element when there are many outputs or short reductions, one 256-thread block per output
 *   element otherwise.
 *   sum_all: two deterministic passes (<= 1024 block partials, then one block), no atomics.
 * Versions: v1 plain grid-stride; v2 (2026-11-24) 16-byte accesses for contiguous binary ops,
 *   a table broadcast over leading dims and axpby, after a CUPTI trace of the SPEC steps found
 *   them on the hot path (residual adds, position embeddings, gradient sums): the MIM step's
 *   binary ops 1.47 -> 0.65 ms, the VLM's 1.16 -> 0.68 ms (H100).
 *   v3 (2026-11-28, from a trace of the contrastive MIM step, H200): reduce_sum_to's column-sum
 *   path (the predictor's position and mask-token gradients 158 + 194 -> 27 us with a 16-byte
 *   form of its own; it now calls colsum.cuh's, linear's bias-gradient sums), copies of a
 *   table broadcast over leading dims in 16-byte words (the mask-token expand 124 -> 10 us),
 *   fill and axpy_dev in 16-byte words (zeroed gradient buffers, the patch loss's scaled
 *   gradient).
 * Test: tests/cuda/test_cuda_memory.cpp [memory]:
 *   bash tools/gpu-kernels.sh tests/cuda/test_cuda_memory.cpp
 */
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels/cuda/colsum.cuh"
#include "kernels/cuda/common.cuh"

namespace loom::cuda {

namespace {

constexpr int kThreads = 256;
inline int grid_for(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  return int(b < 1 ? 1 : (b > 4096 ? 4096 : b));
}

// Device-side conversion between storage types; bf16 and f16 go through float.
template <class To, class From>
__device__ __forceinline__ To cast_to(From x) {
  if constexpr (std::is_same_v<From, __nv_bfloat16>) return cast_to<To>(__bfloat162float(x));
  else if constexpr (std::is_same_v<From, __half>) return cast_to<To>(__half2float(x));
  else if constexpr (std::is_same_v<To, __nv_bfloat16>) return __float2bfloat16(float(x));
  else if constexpr (std::is_same_v<To, __half>) return __float2half_rn(float(x));
  else return static_cast<To>(x);
}

// Sum over a block (blockDim.x a multiple of 32, <= 1024); the result is valid in thread 0.
__device__ float block_sum(float v) {
  __shared__ float part[32];
  v = warp_sum(v);
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  __syncthreads();  // `part` may still be read by a previous call
  if (lane == 0) part[w] = v;
  __syncthreads();
  int nw = blockDim.x >> 5;
  v = threadIdx.x < nw ? part[threadIdx.x] : 0.f;
  if (w == 0) v = warp_sum(v);
  return v;
}

bool is_contiguous(const Layout& l) {
  int64_t expect = 1;
  for (int d = l.ndim - 1; d >= 0; d--) {
    if (l.shape[d] != 1 && l.stride[d] != expect) return false;
    expect *= l.shape[d];
  }
  return true;
}

// ---------------------------------------------------------------- kernels
template <class T>
__global__ void fill_kernel(T* out, T value, int64_t n) {
  pdl_entry();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = value;
}

template <class To, class From>
__global__ void convert_kernel(To* __restrict__ out, const From* __restrict__ in, int64_t n) {
  pdl_entry();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = cast_to<To>(in[i]);
}

// offset of flat (row-major) index i of `shape` through `stride`
__device__ __forceinline__ int64_t strided_offset(int64_t i, const Layout& l) {
  int64_t off = 0;
  for (int d = l.ndim - 1; d >= 0; d--) {
    int64_t q = i / l.shape[d];
    off += (i - q * l.shape[d]) * l.stride[d];
    i = q;
  }
  return off;
}

template <class T>  // T: any storage type (a copy moves bits)
__global__ void copy_strided_kernel(T* __restrict__ out, const T* __restrict__ in, Layout l, int64_t n) {
  pdl_entry();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = in[strided_offset(i, l)];
}

// out[i] = in[i % period] in 16-byte words: a table broadcast over leading dims made contiguous
// (expand() then contiguous(); the MIM predictor's mask tokens). The flat path above did one
// div/mod per dim per element (124 us for a [256, 196, 384] bf16 expand, H200, 2026-11-28).
__global__ void broadcast_words(uint4* __restrict__ out, const uint4* __restrict__ in, int64_t pw, int64_t nw) {
  pdl_entry();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < nw; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = in[i % pw];
}

__device__ __forceinline__ float apply(BinaryOp op, float a, float b) {
  switch (op) {
    case BinaryOp::Add: return a + b;
    case BinaryOp::Sub: return a - b;
    case BinaryOp::Mul: return a * b;
    default: return a / b;
  }
}

template <class DT, bool kContiguous>
__global__ void binary_kernel(DT* __restrict__ out, const DT* __restrict__ a, Layout la,
                              const DT* __restrict__ b, Layout lb, BinaryOp op, int64_t n) {
  pdl_entry();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t ia = i, ib = i;
    if constexpr (!kContiguous) {
      ia = strided_offset(i, la);
      ib = strided_offset(i, lb);
    }
    out[i] = from_float<DT>(apply(op, to_float(a[ia]), to_float(b[ib])));
  }
}

// out[i] = a[i % pa] op b[i % pb]: each operand is contiguous over its trailing dims and
// broadcast (stride 0) over the leading ones, with period pa / pb (n when not broadcast).
// VEC elements per step (16-byte accesses for VEC = 16 / sizeof(DT)); n, pa, pb multiples of
// VEC and the pointers aligned, so one modulo serves VEC elements.
template <class DT, int VEC>
__global__ void binary_periodic_kernel(DT* __restrict__ out, const DT* __restrict__ a, int64_t pa,
                                       const DT* __restrict__ b, int64_t pb, BinaryOp op, int64_t n) {
  pdl_entry();
  const int64_t nv = n / VEC;
  for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < nv; v += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = v * VEC;
    const int64_t ia = pa == n ? i : i % pa, ib = pb == n ? i : i % pb;
    Pack<DT, VEC> x = *reinterpret_cast<const Pack<DT, VEC>*>(a + ia);
    Pack<DT, VEC> y = *reinterpret_cast<const Pack<DT, VEC>*>(b + ib);
    Pack<DT, VEC> o;
#pragma unroll
    for (int k = 0; k < VEC; k++) o.v[k] = from_float<DT>(apply(op, to_float(x.v[k]), to_float(y.v[k])));
    *reinterpret_cast<Pack<DT, VEC>*>(out + i) = o;
  }
}

template <class DT>
__global__ void unary_kernel(DT* __restrict__ out, const DT* __restrict__ in, UnaryOp op, int64_t n) {
  pdl_entry();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float x = to_float(in[i]), y;
    switch (op) {
      case UnaryOp::Neg: y = -x; break;
      case UnaryOp::Exp: y = expf(x); break;
      case UnaryOp::Log: y = logf(x); break;
      case UnaryOp::Sqrt: y = sqrtf(x); break;
      case UnaryOp::Square: y = x * x; break;
      default: y = fabsf(x); break;
    }
    out[i] = from_float<DT>(y);
  }
}

template <class DT>  // out may alias a or b: each element is read before it is written
__global__ void axpby_kernel(DT* out, const DT* a, float alpha, const DT* b, float beta, int64_t n) {
  pdl_entry();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float v = alpha * to_float(a[i]);
    if (b) v += beta * to_float(b[i]);
    out[i] = from_float<DT>(v);
  }
}

// axpby with VEC elements per access (16 bytes); n a multiple of VEC, pointers aligned.
template <class DT, int VEC>
__global__ void axpby_vec_kernel(DT* out, const DT* a, float alpha, const DT* b, float beta, int64_t n) {
  pdl_entry();
  const int64_t nv = n / VEC;
  for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < nv; v += int64_t(gridDim.x) * blockDim.x) {
    Pack<DT, VEC> x = reinterpret_cast<const Pack<DT, VEC>*>(a)[v], y;
    if (b) y = reinterpret_cast<const Pack<DT, VEC>*>(b)[v];
#pragma unroll
    for (int k = 0; k < VEC; k++) {
      float r = alpha * to_float(x.v[k]);
      if (b) r += beta * to_float(y.v[k]);
      x.v[k] = from_float<DT>(r);
    }
    reinterpret_cast<Pack<DT, VEC>*>(out)[v] = x;
  }
}

// VEC elements a step (16 bytes; n a multiple of VEC and the pointers aligned, else VEC 1)
template <class DT, int VEC, bool ACC>
__global__ void axpy_dev_kernel(DT* y, const float* __restrict__ alpha, const DT* __restrict__ x, int64_t n) {
  pdl_entry();
  const float a = *alpha;
  for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < n / VEC; v += int64_t(gridDim.x) * blockDim.x) {
    Pack<DT, VEC> yv;
    if (ACC) yv = reinterpret_cast<const Pack<DT, VEC>*>(y)[v];
    const Pack<DT, VEC> xv = reinterpret_cast<const Pack<DT, VEC>*>(x)[v];
#pragma unroll
    for (int k = 0; k < VEC; k++) yv.v[k] = from_float<DT>((ACC ? to_float(yv.v[k]) : 0.f) + a * to_float(xv.v[k]));
    reinterpret_cast<Pack<DT, VEC>*>(y)[v] = yv;
  }
}

// reduce_sum_to: the input's dims split into kept dims (shape/stride `kept`, row-major order =
// out's contiguous order) and reduced dims (`red`).
struct ReducePlan {
  Layout kept, red;
  int64_t nout, nred;
};


template <class DT>
__global__ void reduce_thread_per_out(DT* __restrict__ out, const DT* __restrict__ in, ReducePlan p) {
  pdl_entry();
  for (int64_t o = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; o < p.nout; o += int64_t(gridDim.x) * blockDim.x) {
    int64_t base = strided_offset(o, p.kept);
    float acc = 0.f;
    for (int64_t r = 0; r < p.nred; r++) acc += to_float(in[base + strided_offset(r, p.red)]);
    out[o] = from_float<DT>(acc);
  }
}

template <class DT>
__global__ void reduce_block_per_out(DT* __restrict__ out, const DT* __restrict__ in, ReducePlan p) {
  pdl_entry();
  for (int64_t o = blockIdx.x; o < p.nout; o += gridDim.x) {
    int64_t base = strided_offset(o, p.kept);
    float acc = 0.f;
    for (int64_t r = threadIdx.x; r < p.nred; r += blockDim.x) acc += to_float(in[base + strided_offset(r, p.red)]);
    acc = block_sum(acc);
    if (threadIdx.x == 0) out[o] = from_float<DT>(acc);
  }
}

template <class DT>
__global__ void sum_partials(float* __restrict__ partial, const DT* __restrict__ in, int64_t n) {
  pdl_entry();
  float acc = 0.f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    acc += to_float(in[i]);
  acc = block_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void sum_final(float* __restrict__ out, const float* __restrict__ partial, int np) {
  pdl_entry();
  float acc = 0.f;
  for (int i = threadIdx.x; i < np; i += blockDim.x) acc += partial[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) out[0] = acc;
}

template <class T> T host_value(double v) {
  if constexpr (std::is_same_v<T, bf16>) return bf16(float(v));
  else if constexpr (std::is_same_v<T, f16>) return f16(float(v));
  else return static_cast<T>(v);
}

}  // namespace

// ---------------------------------------------------------------- launchers
template <class T> void fill(T* out, double value, int64_t n, Stream s) {
  if (n <= 0) return;
  const T v = host_value<T>(value);
  if constexpr (sizeof(T) <= 8) {
    // 16-byte stores of the value repeated (a zeroed gradient buffer is tens of MB)
    if ((n * int64_t(sizeof(T))) % 16 == 0 && aligned(out, 16)) {
      uint4 w;
      for (size_t k = 0; k < 16 / sizeof(T); k++) std::memcpy(reinterpret_cast<char*>(&w) + k * sizeof(T), &v, sizeof(T));
      const int64_t nw = n * int64_t(sizeof(T)) / 16;
      launch_kernel(fill_kernel<uint4>, grid_for(nw), kThreads, 0, s, reinterpret_cast<uint4*>(out), w, nw);
      LAUNCH_CHECK();
      return;
    }
  }
  launch_kernel(fill_kernel<T>, grid_for(n), kThreads, 0, s, out, v, n);
  LAUNCH_CHECK();
}

template <class To, class From> void convert(To* out, const From* in, int64_t n, Stream s) {
  if (n <= 0) return;
  launch_kernel(convert_kernel<dev_t<To>, dev_t<From>>, grid_for(n), kThreads, 0, s, dptr(out), dptr(in), n);
  LAUNCH_CHECK();
}

// The period of a layout that is contiguous over its trailing dims and broadcast (stride 0)
// over the leading ones (n itself when contiguous), or 0 when it is neither.
int64_t period_of(const Layout& l) {
  int64_t expect = 1;
  int d = l.ndim - 1;
  for (; d >= 0; d--) {
    if (l.shape[d] == 1) continue;
    if (l.stride[d] != expect) break;
    expect *= l.shape[d];
  }
  for (; d >= 0; d--)
    if (l.shape[d] != 1 && l.stride[d] != 0) return 0;
  return expect;
}

template <class T> void copy_strided(T* out, const T* in, Layout l, Stream s) {
  int64_t n = l.numel();
  if (n <= 0) return;
  if (is_contiguous(l)) {
    CUDA_CHECK(cudaMemcpyAsync(out, in, size_t(n) * sizeof(T), cudaMemcpyDeviceToDevice, s));
    return;
  }
  const int64_t period = period_of(l);
  if (period > 0 && (period * int64_t(sizeof(T))) % 16 == 0 && (n * int64_t(sizeof(T))) % 16 == 0 && aligned(out, 16) &&
      aligned(in, 16)) {
    const int64_t nw = n * int64_t(sizeof(T)) / 16;
    launch_kernel(broadcast_words, grid_for(nw), kThreads, 0, s, reinterpret_cast<uint4*>(out),
                  reinterpret_cast<const uint4*>(in), period * int64_t(sizeof(T)) / 16, nw);
    LAUNCH_CHECK();
    return;
  }
  launch_kernel(copy_strided_kernel<T>, grid_for(n), kThreads, 0, s, out, in, l, n);
  LAUNCH_CHECK();
}

template <class T>
void binary(T* out, const T* a, Layout la, const T* b, Layout lb, BinaryOp op, Stream s) {
  int64_t n = la.numel();
  if (n <= 0) return;
  constexpr int V = 16 / int(sizeof(T));
  const int64_t pa = period_of(la), pb = period_of(lb);
  if (pa > 0 && pb > 0 && n % V == 0 && pa % V == 0 && pb % V == 0 && aligned(out, 16) && aligned(a, 16) &&
      aligned(b, 16)) {
    launch_kernel(binary_periodic_kernel<dev_t<T>, V>, grid_for(n / V), kThreads, 0, s, dptr(out), dptr(a), pa, dptr(b),
                  pb, op, n);
  } else if (is_contiguous(la) && is_contiguous(lb) && lb.numel() == n)
    launch_kernel(binary_kernel<dev_t<T>, true>, grid_for(n), kThreads, 0, s, dptr(out), dptr(a), la, dptr(b), lb, op,
                  n);
  else
    launch_kernel(binary_kernel<dev_t<T>, false>, grid_for(n), kThreads, 0, s, dptr(out), dptr(a), la, dptr(b), lb, op,
                  n);
  LAUNCH_CHECK();
}

template <class T> void unary(T* out, const T* in, UnaryOp op, int64_t n, Stream s) {
  if (n <= 0) return;
  launch_kernel(unary_kernel<dev_t<T>>, grid_for(n), kThreads, 0, s, dptr(out), dptr(in), op, n);
  LAUNCH_CHECK();
}

template <class T>
void axpby(T* out, const T* a, double alpha, const T* b, double beta, int64_t n, Stream s) {
  if (n <= 0) return;
  constexpr int V = 16 / int(sizeof(T));
  if (n % V == 0 && aligned(out, 16) && aligned(a, 16) && (!b || aligned(b, 16)))
    launch_kernel(axpby_vec_kernel<dev_t<T>, V>, grid_for(n / V), kThreads, 0, s, dptr(out), dptr(a), float(alpha),
                  dptr(b), float(beta), n);
  else
    launch_kernel(axpby_kernel<dev_t<T>>, grid_for(n), kThreads, 0, s, dptr(out), dptr(a), float(alpha), dptr(b),
                  float(beta), n);
  LAUNCH_CHECK();
}

template <class T, bool ACC> void axpy_dev_launch(T* y, const acc_t<T>* alpha_dev, const T* x, int64_t n, Stream s) {
  constexpr int V = 16 / int(sizeof(T));
  if (n % V == 0 && aligned(y, 16) && aligned(x, 16))
    launch_kernel(axpy_dev_kernel<dev_t<T>, V, ACC>, grid_for(n / V), kThreads, 0, s, dptr(y), alpha_dev, dptr(x), n);
  else
    launch_kernel(axpy_dev_kernel<dev_t<T>, 1, ACC>, grid_for(n), kThreads, 0, s, dptr(y), alpha_dev, dptr(x), n);
}

template <class T> void axpy_dev(T* y, const acc_t<T>* alpha_dev, const T* x, int64_t n, bool accumulate, Stream s) {
  if (n <= 0) return;
  if (accumulate) axpy_dev_launch<T, true>(y, alpha_dev, x, n, s);
  else axpy_dev_launch<T, false>(y, alpha_dev, x, n, s);
  LAUNCH_CHECK();
}

template <class T> void reduce_sum_to(T* out, Layout ob, const T* in, Layout il, Stream s) {
  if (ob.ndim != il.ndim) throw std::runtime_error("reduce_sum_to: out_bcast and in must have the same ndim");
  ReducePlan p{};
  p.nout = 1;
  p.nred = 1;
  for (int d = 0; d < il.ndim; d++) {
    if (ob.shape[d] != il.shape[d]) throw std::runtime_error("reduce_sum_to: out_bcast.shape must equal in.shape");
    bool reduced = ob.stride[d] == 0 && il.shape[d] > 1;
    Layout& dst = reduced ? p.red : p.kept;
    dst.shape[dst.ndim] = il.shape[d];
    dst.stride[dst.ndim] = il.stride[d];
    dst.ndim++;
    (reduced ? p.nred : p.nout) *= il.shape[d];
  }
  if (p.nout <= 0) return;
  if (p.nred == 0) { fill(out, 0.0, p.nout, s); return; }
  // the reduced dims lead (no kept dim of size > 1 before one) in a contiguous input: column sums
  bool leading = is_contiguous(il);
  for (int d = 0, kept_seen = 0; d < il.ndim && leading; d++) {
    if (il.shape[d] == 1) continue;
    if (ob.stride[d] == 0) leading = !kept_seen;
    else kept_seen = 1;
  }
  if (leading) {
    column_sums(out, in, p.nred, p.nout, /*accumulate=*/false, s);
    return;
  }
  if (p.nout >= 8192 || p.nred < 256)
    launch_kernel(reduce_thread_per_out<dev_t<T>>, grid_for(p.nout), kThreads, 0, s, dptr(out), dptr(in), p);
  else
    launch_kernel(reduce_block_per_out<dev_t<T>>,
                  int(p.nout < 65535 ? p.nout : 65535), kThreads, 0, s, dptr(out), dptr(in), p);
  LAUNCH_CHECK();
}

template <class T> void sum_all(acc_t<T>* out, const T* in, int64_t n, Stream s) {
  // The number of partials depends only on n, so the summation order (and result) is
  // the same on every run.
  int g = int(std::min<int64_t>(1024, std::max<int64_t>(1, (n + 4 * kThreads - 1) / (4 * kThreads))));
  float* partial = static_cast<float*>(device_malloc(sizeof(float) * g));
  launch_kernel(sum_partials<dev_t<T>>, g, kThreads, 0, s, partial, dptr(in), n);
  LAUNCH_CHECK();
  launch_kernel(sum_final, 1, 1024, 0, s, out, partial, g);
  LAUNCH_CHECK();
  device_free(partial);  // stream-ordered reuse (allocator.cu)
}

// ---------------------------------------------------------------- instantiations
#define LOOM_FILL(T)                                              \
  template void fill<T>(T*, double, int64_t, Stream);             \
  template void copy_strided<T>(T*, const T*, Layout, Stream);
LOOM_FILL(float)
LOOM_FILL(bf16)
LOOM_FILL(f16)
LOOM_FILL(int32_t)
LOOM_FILL(int64_t)

#define LOOM_CONVERT(To, From) template void convert<To, From>(To*, const From*, int64_t, Stream);
#define LOOM_CONVERT_FROM(From) \
  LOOM_CONVERT(float, From) LOOM_CONVERT(bf16, From) LOOM_CONVERT(f16, From) LOOM_CONVERT(int32_t, From) \
  LOOM_CONVERT(int64_t, From)
LOOM_CONVERT_FROM(float)
LOOM_CONVERT_FROM(bf16)
LOOM_CONVERT_FROM(f16)
LOOM_CONVERT_FROM(int32_t)
LOOM_CONVERT_FROM(int64_t)
LOOM_CONVERT(double, float)
LOOM_CONVERT(float, double)

#define LOOM_MEM(T)                                                                        \
  template void binary<T>(T*, const T*, Layout, const T*, Layout, BinaryOp, Stream);      \
  template void unary<T>(T*, const T*, UnaryOp, int64_t, Stream);                         \
  template void axpby<T>(T*, const T*, double, const T*, double, int64_t, Stream);        \
  template void axpy_dev<T>(T*, const acc_t<T>*, const T*, int64_t, bool, Stream);        \
  template void reduce_sum_to<T>(T*, Layout, const T*, Layout, Stream);                   \
  template void sum_all<T>(acc_t<T>*, const T*, int64_t, Stream);
LOOM_MEM(float)
LOOM_MEM(bf16)
LOOM_MEM(f16)

}  // namespace loom::cuda
