/*
 * optim.cu: AdamW, SGD with momentum, EMA, squared gradient norm and the clip scale.
 * Reference: kernels/cpu/optim.cpp (same declarations in kernels/kernels.inc).
 *
 * Shapes: one flat parameter group of n elements. master/m/v/buf/target/source [n] fp32 (M);
 *   grad [n] and copy [n] in G (fp32 or bf16); norm_sq, norm [1] and the step control ctl [4]
 *   = {gradient scale, apply 1 / skip 0, step t, lr} fp32 on the device (kernels.inc).
 *   adamw  g = grad * scale;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
 *          master -= lr (wd master + (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps))
 *          copy = G(master)                             (master, m, v updated in place, copy =)
 *   sgd    g = grad * scale;  buf = mu buf + g;  master -= lr (buf + wd master);  copy = G(master)
 *   ema    target = decay target + (1-decay) source;  copy = G(target)
 *          (ema_update_many: the same for many tensors, up to 96 per launch; the mix rounded as
 *          fma(decay, target, (1-decay) source) in every kernel, ema_mix)
 *   adamw_ema_update  adamw, and for the group's elements [lo, hi) the ema of target[i - lo]
 *          toward the new master[i], taken from registers: the EMA's read of its source (4 of
 *          its 14 bytes a parameter) and its launches are gone (EMA::fuse, optim/optimizer.h)
 *   grad_norm_squared  out[0] += sum(grad^2)   (two deterministic passes, no float atomics)
 *   step_control  norm = sqrt(norm_sq) / S, scale = min(1, max_norm / (norm + 1e-6)) / S,
 *                 apply = isfinite(norm) && isfinite(loss), t += apply; S is the loss scale
 *                 (1 without one; fp16: halved on a skipped step, doubled after a good run)
 * Everything a step decides is read on the device from ctl (nullable: scale 1, apply, t and
 * lr from the host), so clipping, skipping a non-finite step and the learning-rate schedule
 * never wait on the host, and a captured step replays with the values of its own step. With
 * ctl the bias corrections 1/(1-b^t) are computed once per block in fp32 from t (powf; exact
 * to ~1 ulp for t < 2^24); without it on the host in double.
 * Napkin bytes (AdamW, fp32 grads, 134.5M params): read master, m, v, grad, write master,
 *   m, v = 28 B/param = 3.77 GB: ~1.2 ms at 3.2 TB/s (H200), ~1.3 ms at 2.9 TB/s (H100);
 *   with bf16 grad and copy: 4 + 4 + 4 + 2 + 4 + 4 + 4 + 2 = 28 B/param as well.
 * Launch shape: one launch per flat group ("multi-tensor": the model's parameters live in
 *   one buffer per group), grid-stride, 256 threads, 4 elements per thread per step with
 *   16-byte loads of the fp32 arrays; scalar path when a pointer is not aligned, and for the
 *   tail. Grid = 8 blocks per SM-ish (2048 blocks max), enough bytes in flight to saturate HBM.
 * Versions: v1 vectorized grid-stride. Measured (H200, bench/bench_kernels_a.cpp, median of 20):
 *   adamw 134.5M fp32 params 0.946 ms = 3.98 TB/s (PyTorch fused 1.189 ms, foreach 3.16 ms);
 *   with bf16 grad + bf16 copy 0.966 ms. grad_norm_squared over 134.5M bf16: 0.070 ms with
 *   16-byte loads (0.211 ms with scalar loads and 1 element per thread per step).
 *   EMA v2 multi-tensor (2026-11-24, H100, CUPTI trace of the SPEC MIM step, 149 target
 *   tensors, 86M parameters): one launch per tensor 0.69 ms -> two launches 0.44 ms.
 * Test: tests/cuda/test_cuda_optim_kernels.cpp [optim]:
 *   bash tools/gpu-kernels.sh tests/cuda/test_cuda_optim_kernels.cpp
 */
#include <algorithm>
#include <cmath>

#include "kernels/cuda/common.cuh"

namespace loom::cuda {

namespace {

struct AdamConst {
  float lr, b1, b2, eps, wd, inv_bc1, inv_bc2;
};

__device__ __forceinline__ float adam_step(float& p, float& m, float& v, float g, const AdamConst& c) {
  m = c.b1 * m + (1.f - c.b1) * g;
  v = c.b2 * v + (1.f - c.b2) * g * g;
  float upd = (m * c.inv_bc1) / (sqrtf(v * c.inv_bc2) + c.eps);
  p -= c.lr * (c.wd * p + upd);
  return p;
}

// With ctl: skip when ctl[1] == 0, else lr *= ctl[3], g *= ctl[0] and the bias corrections
// from t = ctl[2]; without: the host's constants.
__device__ __forceinline__ bool adam_control(AdamConst& c, float& scale, const float* ctl) {
  scale = 1.f;
  if (!ctl) return true;
  if (ctl[1] == 0.f) return false;
  scale = ctl[0];
  c.lr *= ctl[3];
  c.inv_bc1 = 1.f / (1.f - powf(c.b1, ctl[2]));
  c.inv_bc2 = 1.f / (1.f - powf(c.b2, ctl[2]));
  return true;
}

// The EMA's mix, rounded the same way in every kernel that forms it (no contraction left to the
// compiler), so that the fused form and ema_kernel / ema_many_kernel agree bit for bit.
__device__ __forceinline__ float ema_mix(float decay, float target, float source) {
  return __fmaf_rn(decay, target, __fmul_rn(1.f - decay, source));
}

// The EMA fused into adamw_kernel (t null: none): elements [lo, hi) of the group are its
// source, t[i - lo] / cp[i - lo] its target and copy; vec: lo % VEC == 0 and t, cp aligned.
template <class GT>
struct EmaPass {
  float* t;
  GT* cp;
  int64_t lo, hi;
  float decay;
  bool vec;
};

template <class GT>
__device__ __forceinline__ void ema_one(const EmaPass<GT>& e, int64_t i, float p) {
  if (i < e.lo || i >= e.hi) return;
  const float t = ema_mix(e.decay, e.t[i - e.lo], p);
  e.t[i - e.lo] = t;
  if (e.cp) e.cp[i - e.lo] = from_float<GT>(t);
}

template <class GT, int VEC>
__global__ void adamw_kernel(float* __restrict__ master, GT* __restrict__ copy, float* __restrict__ m,
                             float* __restrict__ v, const GT* __restrict__ grad, const float* __restrict__ ctl,
                             int64_t n, AdamConst c, const EmaPass<GT> e) {
  pdl_entry();
  float scale;
  if (!adam_control(c, scale, ctl)) return;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t nv = n / VEC;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < nv; i += stride) {
    Pack<float, VEC> p = reinterpret_cast<const Pack<float, VEC>*>(master)[i];
    Pack<float, VEC> mm = reinterpret_cast<const Pack<float, VEC>*>(m)[i];
    Pack<float, VEC> vv = reinterpret_cast<const Pack<float, VEC>*>(v)[i];
    Pack<GT, VEC> g = reinterpret_cast<const Pack<GT, VEC>*>(grad)[i];
    Pack<GT, VEC> cp;
#pragma unroll
    for (int k = 0; k < VEC; k++)
      cp.v[k] = from_float<GT>(adam_step(p.v[k], mm.v[k], vv.v[k], to_float(g.v[k]) * scale, c));
    reinterpret_cast<Pack<float, VEC>*>(master)[i] = p;
    reinterpret_cast<Pack<float, VEC>*>(m)[i] = mm;
    reinterpret_cast<Pack<float, VEC>*>(v)[i] = vv;
    if (copy) reinterpret_cast<Pack<GT, VEC>*>(copy)[i] = cp;
    const int64_t i0 = i * VEC;  // the EMA reads the new master from registers, not memory
    if (e.t && i0 + VEC > e.lo && i0 < e.hi) {
      if (e.vec && i0 >= e.lo && i0 + VEC <= e.hi) {
        Pack<float, VEC> t = reinterpret_cast<const Pack<float, VEC>*>(e.t + (i0 - e.lo))[0];
        Pack<GT, VEC> tc;
#pragma unroll
        for (int k = 0; k < VEC; k++) {
          t.v[k] = ema_mix(e.decay, t.v[k], p.v[k]);
          tc.v[k] = from_float<GT>(t.v[k]);
        }
        reinterpret_cast<Pack<float, VEC>*>(e.t + (i0 - e.lo))[0] = t;
        if (e.cp) reinterpret_cast<Pack<GT, VEC>*>(e.cp + (i0 - e.lo))[0] = tc;
      } else {
#pragma unroll
        for (int k = 0; k < VEC; k++) ema_one(e, i0 + k, p.v[k]);
      }
    }
  }
  for (int64_t i = nv * VEC + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
    float p = master[i], mm = m[i], vv = v[i];
    adam_step(p, mm, vv, to_float(grad[i]) * scale, c);
    master[i] = p;
    m[i] = mm;
    v[i] = vv;
    if (copy) copy[i] = from_float<GT>(p);
    if (e.t) ema_one(e, i, p);
  }
}

template <class GT>
__global__ void sgd_kernel(float* __restrict__ master, GT* __restrict__ copy, float* __restrict__ buf,
                           const GT* __restrict__ grad, const float* __restrict__ ctl, int64_t n, float lr,
                           float mu, float wd) {
  pdl_entry();
  if (ctl && ctl[1] == 0.f) return;
  const float scale = ctl ? ctl[0] : 1.f;
  if (ctl) lr *= ctl[3];
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float g = to_float(grad[i]) * scale;
    float b = g;  // without momentum (and without a buffer) the step is the gradient
    if (buf) {
      b = mu * buf[i] + g;
      buf[i] = b;
    }
    float p = master[i];
    p -= lr * (b + wd * p);
    master[i] = p;
    if (copy) copy[i] = from_float<GT>(p);
  }
}

template <class GT>
__global__ void ema_kernel(float* __restrict__ target, GT* __restrict__ copy, const float* __restrict__ source,
                           const float* __restrict__ ctl, int64_t n, float decay) {
  pdl_entry();
  if (ctl && ctl[1] == 0.f) return;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float t = ema_mix(decay, target[i], source[i]);
    target[i] = t;
    if (copy) copy[i] = from_float<GT>(t);
  }
}

// Multi-tensor EMA: up to kEmaMaxTensors tensors per launch, passed by value in the kernel's
// parameters (under the 4 KB limit, so a captured graph holds them and no table lives in
// device memory). Tensor i owns blocks [first[i], first[i+1]); each block updates one
// kEmaSlice-element slice of its tensor.
constexpr int kEmaMaxTensors = 96;
constexpr int kEmaSlice = 4096;
template <class GT>
struct EmaLaunch {
  int count;
  int first[kEmaMaxTensors + 1];
  float* target[kEmaMaxTensors];
  GT* copy[kEmaMaxTensors];
  const float* source[kEmaMaxTensors];
  int64_t n[kEmaMaxTensors];
};

template <class GT>
__global__ void ema_many_kernel(const __grid_constant__ EmaLaunch<GT> L, const float* __restrict__ ctl, float decay) {
  pdl_entry();
  if (ctl && ctl[1] == 0.f) return;
  int lo = 0, hi = L.count - 1;  // the tensor whose block range holds blockIdx.x
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (L.first[mid] <= int(blockIdx.x)) lo = mid;
    else hi = mid - 1;
  }
  const int64_t begin = int64_t(int(blockIdx.x) - L.first[lo]) * kEmaSlice;
  const int64_t end = min(L.n[lo], begin + kEmaSlice);
  float* __restrict__ t = L.target[lo];
  const float* __restrict__ src = L.source[lo];
  GT* __restrict__ cp = L.copy[lo];
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float v = ema_mix(decay, t[i], src[i]);
    t[i] = v;
    if (cp) cp[i] = from_float<GT>(v);
  }
}

__device__ float block_sum(float v) {
  __shared__ float part[32];
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  v = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.f;
  if (threadIdx.x < 32) v = warp_sum(v);
  return v;
}

// 16-byte loads when `grad` is aligned (VEC = 16 / sizeof(GT)), scalar tail.
template <class GT, int VEC>
__global__ void sumsq_partials(float* __restrict__ partial, const GT* __restrict__ grad, int64_t n) {
  pdl_entry();
  float acc = 0.f;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x, nv = n / VEC;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < nv; i += stride) {
    Pack<GT, VEC> g = reinterpret_cast<const Pack<GT, VEC>*>(grad)[i];
#pragma unroll
    for (int k = 0; k < VEC; k++) acc += to_float(g.v[k]) * to_float(g.v[k]);
  }
  for (int64_t i = nv * VEC + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
    float g = to_float(grad[i]);
    acc += g * g;
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void sumsq_finish(float* __restrict__ out, const float* __restrict__ partial, int np) {
  pdl_entry();
  float acc = 0.f;
  for (int i = threadIdx.x; i < np; i += blockDim.x) acc += partial[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) out[0] += acc;
}

__global__ void step_control_kernel(float* ctl, float* norm, const float* norm_sq, const float* loss, float max_norm,
                                    float* loss_scale, int growth_interval) {
  pdl_entry();
  const float S = loss_scale ? loss_scale[0] : 1.f;
  float nrm = norm_sq ? sqrtf(*norm_sq) / S : 0.f;
  if (norm) *norm = nrm;
  ctl[0] = ((norm_sq && max_norm > 0.f) ? fminf(1.f, max_norm / (nrm + 1e-6f)) : 1.f) / S;
  ctl[1] = (isfinite(nrm) && (!loss || isfinite(*loss))) ? 1.f : 0.f;
  ctl[2] += ctl[1];
  if (loss_scale) {  // dynamic loss scaling: halve on a skipped step, double after a good run
    if (ctl[1] == 0.f) {
      loss_scale[0] = fmaxf(1.f, S * 0.5f);
      loss_scale[1] = 0.f;
    } else if ((loss_scale[1] += 1.f) >= float(growth_interval)) {
      loss_scale[0] = fminf(16777216.f, S * 2.f);
      loss_scale[1] = 0.f;
    }
  }
}

int elementwise_grid(int64_t work) {
  return int(std::min<int64_t>(std::max<int64_t>(1, (work + 255) / 256), 2048));
}

template <class M, class G>
void adamw_launch(M* master, G* copy, M* m, M* v, const G* grad, const float* ctl, int64_t n, AdamWHyper h,
                  const EmaRange<M, G>* ema, Stream s) {
  static_assert(std::is_same_v<M, float>, "CUDA AdamW keeps fp32 master weights and states");
  if (n <= 0) return;
  if (!ctl && h.step < 1) throw std::runtime_error("adamw_update: step is 1-based, got " + std::to_string(h.step));
  AdamConst c;
  c.lr = h.lr; c.b1 = h.beta1; c.b2 = h.beta2; c.eps = h.eps; c.wd = h.weight_decay;
  c.inv_bc1 = ctl ? 1.f : float(1.0 / (1.0 - std::pow(double(h.beta1), double(h.step))));
  c.inv_bc2 = ctl ? 1.f : float(1.0 / (1.0 - std::pow(double(h.beta2), double(h.step))));
  constexpr int V = 4;
  EmaPass<dev_t<G>> e{};
  if (ema && ema->hi > ema->lo) {
    e.t = ema->target;
    e.cp = dptr(ema->copy);
    e.lo = ema->lo;
    e.hi = ema->hi;
    e.decay = float(ema->decay);
    e.vec = ema->lo % V == 0 && aligned(ema->target, 16) && (!ema->copy || aligned(ema->copy, V * sizeof(G)));
  }
  bool vec = aligned(master, 16) && aligned(m, 16) && aligned(v, 16) && aligned(grad, V * sizeof(G)) &&
             (!copy || aligned(copy, V * sizeof(G)));
  if (vec)
    launch_kernel(adamw_kernel<dev_t<G>, V>, elementwise_grid(n / V), 256, 0, s, master, dptr(copy), m, v, dptr(grad),
                  ctl, n, c, e);
  else
    launch_kernel(adamw_kernel<dev_t<G>, 1>, elementwise_grid(n), 256, 0, s, master, dptr(copy), m, v, dptr(grad), ctl,
                  n, c, e);
  LAUNCH_CHECK();
}

}  // namespace

template <class M, class G>
void adamw_update(M* master, G* copy, M* m, M* v, const G* grad, const float* ctl, int64_t n, AdamWHyper h,
                  Stream s) {
  adamw_launch(master, copy, m, v, grad, ctl, n, h, static_cast<const EmaRange<M, G>*>(nullptr), s);
}

template <class M, class G>
void adamw_ema_update(M* master, G* copy, M* m, M* v, const G* grad, const float* ctl, int64_t n, AdamWHyper h,
                      EmaRange<M, G> e, Stream s) {
  check_ema_range(e, n);
  adamw_launch(master, copy, m, v, grad, ctl, n, h, &e, s);
}

template <class M, class G>
void sgd_update(M* master, G* copy, M* buf, const G* grad, const float* ctl, int64_t n, float lr, float momentum,
                float weight_decay, Stream s) {
  if (n <= 0) return;
  launch_kernel(sgd_kernel<dev_t<G>>, elementwise_grid(n), 256, 0, s, master, dptr(copy), buf, dptr(grad), ctl, n, lr,
                momentum, weight_decay);
  LAUNCH_CHECK();
}

template <class M, class G>
void ema_update(M* target, G* copy, const M* source, const float* ctl, int64_t n, double decay, Stream s) {
  if (n <= 0) return;
  launch_kernel(ema_kernel<dev_t<G>>, elementwise_grid(n), 256, 0, s, target, dptr(copy), source, ctl, n, float(decay));
  LAUNCH_CHECK();
}

template <class M, class G>
void ema_update_many(const EmaTensor<M, G>* tensors, int count, const float* ctl, double decay, Stream s) {
  EmaLaunch<dev_t<G>> L;
  L.count = 0;
  int blocks = 0;
  auto flush = [&] {
    if (L.count == 0) return;
    L.first[L.count] = blocks;
    launch_kernel(ema_many_kernel<dev_t<G>>, blocks, 256, 0, s, L, ctl, float(decay));
    LAUNCH_CHECK();
    L.count = 0;
    blocks = 0;
  };
  for (int i = 0; i < count; i++) {
    const EmaTensor<M, G>& e = tensors[i];
    if (e.n <= 0) continue;
    const int64_t nb = (e.n + kEmaSlice - 1) / kEmaSlice;
    if (nb > (1 << 30)) {  // one tensor past the grid: its own launches
      ema_update(e.target, e.copy, e.source, ctl, e.n, decay, s);
      continue;
    }
    if (L.count == kEmaMaxTensors || int64_t(blocks) + nb > (int64_t(1) << 30)) flush();
    L.first[L.count] = blocks;
    L.target[L.count] = e.target;
    L.copy[L.count] = dptr(e.copy);
    L.source[L.count] = e.source;
    L.n[L.count] = e.n;
    L.count++;
    blocks += int(nb);
  }
  flush();
}

template <class G> void grad_norm_squared(float* out, const G* grad, int64_t n, Stream s) {
  if (n <= 0) return;
  // the number of partials depends only on n: the same summation order every run
  int g = int(std::min<int64_t>(1024, std::max<int64_t>(1, (n + 4095) / 4096)));
  float* partial = static_cast<float*>(device_malloc(sizeof(float) * g));
  constexpr int V = 16 / int(sizeof(G));
  if (aligned(grad, 16)) launch_kernel(sumsq_partials<dev_t<G>, V>, g, 256, 0, s, partial, dptr(grad), n);
  else launch_kernel(sumsq_partials<dev_t<G>, 1>, g, 256, 0, s, partial, dptr(grad), n);
  LAUNCH_CHECK();
  launch_kernel(sumsq_finish, 1, 1024, 0, s, out, partial, g);
  LAUNCH_CHECK();
  device_free(partial);  // stream-ordered reuse
}

void step_control(float* ctl, float* norm, const float* norm_sq, const float* loss, float max_norm,
                  float* loss_scale, int growth_interval, Stream s) {
  launch_kernel(step_control_kernel, 1, 1, 0, s, ctl, norm, norm_sq, loss, max_norm, loss_scale, growth_interval);
  LAUNCH_CHECK();
}

#define LOOM_OPTIM(G)                                                                                          \
  template void adamw_update<float, G>(float*, G*, float*, float*, const G*, const float*, int64_t, AdamWHyper, \
                                       Stream);                                                                \
  template void sgd_update<float, G>(float*, G*, float*, const G*, const float*, int64_t, float, float, float,  \
                                     Stream);                                                                  \
  template void ema_update<float, G>(float*, G*, const float*, const float*, int64_t, double, Stream);                       \
  template void ema_update_many<float, G>(const EmaTensor<float, G>*, int, const float*, double, Stream);                  \
  template void adamw_ema_update<float, G>(float*, G*, float*, float*, const G*, const float*, int64_t, AdamWHyper,        \
                                           EmaRange<float, G>, Stream);                                                   \
  template void grad_norm_squared<G>(float*, const G*, int64_t, Stream);
LOOM_OPTIM(float)
LOOM_OPTIM(bf16)
LOOM_OPTIM(f16)

}  // namespace loom::cuda
