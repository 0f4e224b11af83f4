/*
 * activations.cu: GELU (tanh approximation), SiLU, SwiGLU, and row softmax, forward and
 * backward.  Reference: kernels/cpu/activations.cpp.
 *
 * Shapes: n flat length for the pointwise ops; [N, C] rows for softmax. All outputs `=`.
 *   gelu     y = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
 *            dy/dx = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 0.044715 x^2)
 *   silu     y = x s(x), s = sigmoid;  dy/dx = s (1 + x (1 - s))
 *   swiglu   out = silu(gate) up;  dgate = dout up silu'(gate),  dup = dout silu(gate)
 *            (swiglu_backward_product: both and out again in one pass, for a layer that
 *            recomputes out in its backward instead of keeping it)
 *   softmax  out = exp(x - max) / sum exp(x - max);  dinp = out (dout - sum(dout out))
 * Saved for backward: the pointwise backwards take the forward input (recompute is cheaper
 *   than storing tanh/sigmoid); softmax backward takes the forward output.
 * Math in fp32 for every storage type.
 * Napkin bytes: pointwise ops read each input once and write each output once (GELU bf16
 *   at 16384 x 3072: 100 MB forward, ~33 us at 3 TB/s). Softmax: 2 reads (max+sum online,
 *   then normalize; the second read hits L1/L2 for rows <= a few KB) + 1 write.
 * Launch shape: pointwise: grid-stride, 256 threads, 8 elements (16 B of bf16) per thread
 *   per step when every pointer is 16-byte aligned, scalar otherwise and for the tail.
 *   softmax: C <= 1024: one warp per row, 4 rows per 128-thread block; larger C: one
 *   256-thread block per row.
 * Versions: v1 only. Measured (H200): gelu_forward 16384x768 bf16 0.021 ms = 2.39 TB/s
 *   (4 bytes per element counted).
 * Test: tests/cuda/test_cuda_activations.cpp [activations]:
 *   bash tools/gpu-kernels.sh tests/cuda/test_cuda_activations.cpp
 */
#include <algorithm>

#include "kernels/cuda/common.cuh"

namespace loom::cuda {

namespace {

// gelu_f, gelu_df: common.cuh (gemm_sm90.cu's DGELU epilogue uses gelu_df too)

// One pointwise op: out0 (and out1) from in0, in1, in2 at the same index.
struct GeluF { __device__ void operator()(float& o0, float&, float a, float, float) const { o0 = gelu_f(a); } };
struct GeluB { __device__ void operator()(float& o0, float&, float d, float x, float) const { o0 = d * gelu_df(x); } };
struct SiluF { __device__ void operator()(float& o0, float&, float a, float, float) const { o0 = a * sigmoid_f(a); } };
struct SiluB {
  __device__ void operator()(float& o0, float&, float d, float x, float) const {
    float s = sigmoid_f(x);
    o0 = d * s * (1.f + x * (1.f - s));
  }
};
struct SwigluF {  // common.cuh's swiglu_f / swiglu_b (gemm_sm90.cu's epilogues use them too)
  __device__ void operator()(float& o0, float&, float g, float u, float) const { o0 = swiglu_f(g, u); }
};
struct SwigluB {  // inputs: dout, gate, up -> dgate, dup
  __device__ void operator()(float& dg, float& du, float d, float g, float u) const { swiglu_b(dg, du, d, g, u); }
};
// swiglu_backward_product: dgate, dup and the product in one pass over gate and up (3 reads and
// 3 writes instead of the backward's 3 + 2 and a separate recompute's 2 + 1); the two functors
// above, so each output is bit for bit what swiglu_backward / swiglu_forward give
struct SwigluBP {  // inputs: dout, gate, up -> dgate, dup, prod
  __device__ void operator()(float& dg, float& du, float& p, float d, float g, float u) const {
    float unused;
    SwigluB{}(dg, du, d, g, u);
    SwigluF{}(p, unused, g, u, 0.f);
  }
};

// NIN inputs, NOUT outputs (a functor of three outputs takes o2 too). Vector part: elements
// [0, nvec*VEC); the tail is scalar.
template <class DT, int VEC, int NIN, int NOUT, class F>
__global__ void pointwise(DT* o0, DT* o1, DT* o2, const DT* i0, const DT* i1, const DT* i2, int64_t n, F f) {
  pdl_entry();
  // the functor's outputs y0 (y1, y2) from the inputs at one index
  auto apply = [&](float (&y)[3], float a, float b, float c) {
    if constexpr (NOUT > 2) f(y[0], y[1], y[2], a, b, c);
    else f(y[0], y[1], a, b, c);
  };
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t nvec = n / VEC;
  for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < nvec; v += stride) {
    Pack<DT, VEC> a = reinterpret_cast<const Pack<DT, VEC>*>(i0)[v], b, c, r0, r1, r2;
    if (NIN > 1) b = reinterpret_cast<const Pack<DT, VEC>*>(i1)[v];
    if (NIN > 2) c = reinterpret_cast<const Pack<DT, VEC>*>(i2)[v];
#pragma unroll
    for (int k = 0; k < VEC; k++) {
      float y[3] = {0.f, 0.f, 0.f};
      apply(y, to_float(a.v[k]), NIN > 1 ? to_float(b.v[k]) : 0.f, NIN > 2 ? to_float(c.v[k]) : 0.f);
      r0.v[k] = from_float<DT>(y[0]);
      if (NOUT > 1) r1.v[k] = from_float<DT>(y[1]);
      if (NOUT > 2) r2.v[k] = from_float<DT>(y[2]);
    }
    reinterpret_cast<Pack<DT, VEC>*>(o0)[v] = r0;
    if (NOUT > 1) reinterpret_cast<Pack<DT, VEC>*>(o1)[v] = r1;
    if (NOUT > 2) reinterpret_cast<Pack<DT, VEC>*>(o2)[v] = r2;
  }
  for (int64_t i = nvec * VEC + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
    float y[3] = {0.f, 0.f, 0.f};
    apply(y, to_float(i0[i]), NIN > 1 ? to_float(i1[i]) : 0.f, NIN > 2 ? to_float(i2[i]) : 0.f);
    o0[i] = from_float<DT>(y[0]);
    if (NOUT > 1) o1[i] = from_float<DT>(y[1]);
    if (NOUT > 2) o2[i] = from_float<DT>(y[2]);
  }
}

template <int NIN, int NOUT, class T, class F>
void launch_pointwise(T* o0, T* o1, T* o2, const T* i0, const T* i1, const T* i2, int64_t n, F f, Stream s) {
  using DT = dev_t<T>;
  constexpr int V = 16 / int(sizeof(T));
  if (n <= 0) return;
  bool vec = aligned(o0, 16) && aligned(i0, 16) && (NOUT < 2 || aligned(o1, 16)) && (NOUT < 3 || aligned(o2, 16)) &&
             (NIN < 2 || aligned(i1, 16)) && (NIN < 3 || aligned(i2, 16));
  int64_t work = vec ? (n + V - 1) / V : n;
  int g = int(std::min<int64_t>(std::max<int64_t>(1, (work + 255) / 256), 8192));
  if (vec)
    launch_kernel(pointwise<DT, V, NIN, NOUT, F>, g, 256, 0, s, dptr(o0), dptr(o1), dptr(o2), dptr(i0), dptr(i1),
                  dptr(i2), n, f);
  else
    launch_kernel(pointwise<DT, 1, NIN, NOUT, F>, g, 256, 0, s, dptr(o0), dptr(o1), dptr(o2), dptr(i0), dptr(i1),
                  dptr(i2), n, f);
  LAUNCH_CHECK();
}

// SwiGLU over a joined gate|up product (rows of 2I: gate in [0, I), up in [I, 2I)): element
// (n, c) of the [N, I] side reads gu[n, c] and gu[n, I + c]; the functors above, so every value
// is bit for bit the flat kernels'. VEC elements per step (I % VEC == 0, 16-byte aligned
// pointers), else one. Forward: o = out [N, I]. Backward: o = dgu [N, 2I], prod [N, I] when PROD.
template <class DT, int VEC, bool BACKWARD, bool PROD>
__global__ void swiglu_joined_kernel(DT* __restrict__ o, DT* __restrict__ prod, const DT* __restrict__ dout,
                                     const DT* __restrict__ gu, int64_t N, int I) {
  pdl_entry();
  using P = Pack<DT, VEC>;
  const int cv = I / VEC;
  const int64_t total = N * cv, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < total; v += stride) {
    const int64_t n = v / cv;
    const int c = int(v - n * cv) * VEC;
    const P g = *reinterpret_cast<const P*>(gu + n * 2 * I + c), u = *reinterpret_cast<const P*>(gu + n * 2 * I + I + c);
    float unused;
    if constexpr (!BACKWARD) {
      P r;
#pragma unroll
      for (int k = 0; k < VEC; k++) {
        float y;
        SwigluF{}(y, unused, to_float(g.v[k]), to_float(u.v[k]), 0.f);
        r.v[k] = from_float<DT>(y);
      }
      *reinterpret_cast<P*>(o + n * I + c) = r;
    } else {
      const P d = *reinterpret_cast<const P*>(dout + n * I + c);
      P dg, du, pr;
#pragma unroll
      for (int k = 0; k < VEC; k++) {
        float a, b;
        SwigluB{}(a, b, to_float(d.v[k]), to_float(g.v[k]), to_float(u.v[k]));
        dg.v[k] = from_float<DT>(a);
        du.v[k] = from_float<DT>(b);
        if constexpr (PROD) {
          float y;
          SwigluF{}(y, unused, to_float(g.v[k]), to_float(u.v[k]), 0.f);
          pr.v[k] = from_float<DT>(y);
        }
      }
      *reinterpret_cast<P*>(o + n * 2 * I + c) = dg;
      *reinterpret_cast<P*>(o + n * 2 * I + I + c) = du;
      if constexpr (PROD) *reinterpret_cast<P*>(prod + n * I + c) = pr;
    }
  }
}

template <bool BACKWARD, bool PROD, class T>
void launch_swiglu_joined(T* o, T* prod, const T* dout, const T* gu, int64_t N, int I, Stream s) {
  using DT = dev_t<T>;
  constexpr int V = 16 / int(sizeof(T));
  if (N <= 0 || I <= 0) return;
  const bool vec = I % V == 0 && aligned(o, 16) && aligned(gu, 16) && (!BACKWARD || aligned(dout, 16)) &&
                   (!PROD || aligned(prod, 16));
  const int64_t work = N * (vec ? I / V : I);
  const int g = int(std::min<int64_t>(std::max<int64_t>(1, (work + 255) / 256), 8192));
  if (vec)
    launch_kernel(swiglu_joined_kernel<DT, V, BACKWARD, PROD>, g, 256, 0, s, dptr(o), dptr(prod), dptr(dout), dptr(gu),
                  N, I);
  else
    launch_kernel(swiglu_joined_kernel<DT, 1, BACKWARD, PROD>, g, 256, 0, s, dptr(o), dptr(prod), dptr(dout), dptr(gu),
                  N, I);
  LAUNCH_CHECK();
}

// Reduction over the threads of a row: a warp (WARP) or the whole block.
template <bool WARP>
__device__ __forceinline__ float row_reduce(float v, bool is_max, float* sh) {
  v = is_max ? warp_max(v) : warp_sum(v);
  if constexpr (!WARP) {
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    v = sh[0];
    for (int i = 1; i < int(blockDim.x >> 5); i++) v = is_max ? fmaxf(v, sh[i]) : v + sh[i];
  }
  return v;
}

template <class DT, bool WARP>
__global__ void softmax_fwd_kernel(DT* __restrict__ out, const DT* __restrict__ inp, int64_t N, int C) {
  pdl_entry();
  __shared__ float sh[32];
  const int64_t row = WARP ? int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5) : blockIdx.x;
  const int t = WARP ? threadIdx.x & 31 : threadIdx.x, nt = WARP ? 32 : blockDim.x;
  if (row >= N) return;
  const DT* x = inp + row * C;
  // online max and sum of exponentials in one pass
  float m = -INFINITY, sum = 0.f;
  for (int c = t; c < C; c += nt) {
    float v = to_float(x[c]);
    if (v > m) { sum *= expf(m - v); m = v; }
    sum += expf(v - m);
  }
  float gm = row_reduce<WARP>(m, true, sh);
  sum = m == -INFINITY ? 0.f : sum * expf(m - gm);
  float gs = row_reduce<WARP>(sum, false, sh);
  float inv = 1.f / gs;
  DT* y = out + row * C;
  for (int c = t; c < C; c += nt) y[c] = from_float<DT>(expf(to_float(x[c]) - gm) * inv);
}

template <class DT, bool WARP>
__global__ void softmax_bwd_kernel(DT* __restrict__ dinp, const DT* __restrict__ dout, const DT* __restrict__ out,
                                   int64_t N, int C) {
  pdl_entry();
  __shared__ float sh[32];
  const int64_t row = WARP ? int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5) : blockIdx.x;
  const int t = WARP ? threadIdx.x & 31 : threadIdx.x, nt = WARP ? 32 : blockDim.x;
  if (row >= N) return;
  const DT* d = dout + row * C;
  const DT* y = out + row * C;
  float dot = 0.f;
  for (int c = t; c < C; c += nt) dot += to_float(d[c]) * to_float(y[c]);
  dot = row_reduce<WARP>(dot, false, sh);
  DT* dx = dinp + row * C;
  for (int c = t; c < C; c += nt) dx[c] = from_float<DT>(to_float(y[c]) * (to_float(d[c]) - dot));
}

}  // namespace

template <class T> void gelu_forward(T* out, const T* inp, int64_t n, Stream s) {
  launch_pointwise<1, 1>(out, (T*)nullptr, (T*)nullptr, inp, (const T*)nullptr, (const T*)nullptr, n, GeluF{}, s);
}
template <class T> void gelu_backward(T* dinp, const T* dout, const T* inp, int64_t n, Stream s) {
  launch_pointwise<2, 1>(dinp, (T*)nullptr, (T*)nullptr, dout, inp, (const T*)nullptr, n, GeluB{}, s);
}
template <class T> void silu_forward(T* out, const T* inp, int64_t n, Stream s) {
  launch_pointwise<1, 1>(out, (T*)nullptr, (T*)nullptr, inp, (const T*)nullptr, (const T*)nullptr, n, SiluF{}, s);
}
template <class T> void silu_backward(T* dinp, const T* dout, const T* inp, int64_t n, Stream s) {
  launch_pointwise<2, 1>(dinp, (T*)nullptr, (T*)nullptr, dout, inp, (const T*)nullptr, n, SiluB{}, s);
}
template <class T> void swiglu_forward(T* out, const T* gate, const T* up, int64_t n, Stream s) {
  launch_pointwise<2, 1>(out, (T*)nullptr, (T*)nullptr, gate, up, (const T*)nullptr, n, SwigluF{}, s);
}
template <class T>
void swiglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n, Stream s) {
  launch_pointwise<3, 2>(dgate, dup, (T*)nullptr, dout, gate, up, n, SwigluB{}, s);
}
template <class T>
void swiglu_backward_product(T* dgate, T* dup, T* prod, const T* dout, const T* gate, const T* up, int64_t n,
                             Stream s) {
  launch_pointwise<3, 3>(dgate, dup, prod, dout, gate, up, n, SwigluBP{}, s);
}

template <class T> void swiglu_forward_joined(T* out, const T* gu, int64_t N, int I, Stream s) {
  launch_swiglu_joined<false, false>(out, (T*)nullptr, (const T*)nullptr, gu, N, I, s);
}
template <class T> void swiglu_backward_joined(T* dgu, T* prod, const T* dout, const T* gu, int64_t N, int I, Stream s) {
  if (prod) launch_swiglu_joined<true, true>(dgu, prod, dout, gu, N, I, s);
  else launch_swiglu_joined<true, false>(dgu, prod, dout, gu, N, I, s);
}

template <class T> void softmax_forward(T* out, const T* inp, int64_t N, int C, Stream s) {
  if (N <= 0) return;
  if (C <= 1024) launch_kernel(softmax_fwd_kernel<dev_t<T>, true>, ceil_div(N, 4), 128, 0, s, dptr(out), dptr(inp), N,
                               C);
  else launch_kernel(softmax_fwd_kernel<dev_t<T>, false>, unsigned(N), 256, 0, s, dptr(out), dptr(inp), N, C);
  LAUNCH_CHECK();
}
template <class T> void softmax_backward(T* dinp, const T* dout, const T* out, int64_t N, int C, Stream s) {
  if (N <= 0) return;
  if (C <= 1024)
    launch_kernel(softmax_bwd_kernel<dev_t<T>, true>, ceil_div(N, 4), 128, 0, s, dptr(dinp), dptr(dout), dptr(out), N,
                  C);
  else
    launch_kernel(softmax_bwd_kernel<dev_t<T>, false>, unsigned(N), 256, 0, s, dptr(dinp), dptr(dout), dptr(out), N, C);
  LAUNCH_CHECK();
}

#define LOOM_ACT(T)                                                                          \
  template void gelu_forward<T>(T*, const T*, int64_t, Stream);                              \
  template void gelu_backward<T>(T*, const T*, const T*, int64_t, Stream);                   \
  template void silu_forward<T>(T*, const T*, int64_t, Stream);                              \
  template void silu_backward<T>(T*, const T*, const T*, int64_t, Stream);                   \
  template void swiglu_forward<T>(T*, const T*, const T*, int64_t, Stream);                  \
  template void swiglu_backward<T>(T*, T*, const T*, const T*, const T*, int64_t, Stream);   \
  template void swiglu_backward_product<T>(T*, T*, T*, const T*, const T*, const T*, int64_t, Stream); \
  template void swiglu_forward_joined<T>(T*, const T*, int64_t, int, Stream);                        \
  template void swiglu_backward_joined<T>(T*, T*, const T*, const T*, int64_t, int, Stream);          \
  template void softmax_forward<T>(T*, const T*, int64_t, int, Stream);                      \
  template void softmax_backward<T>(T*, const T*, const T*, int64_t, int, Stream);
LOOM_ACT(float)
LOOM_ACT(bf16)
LOOM_ACT(f16)

}  // namespace loom::cuda
