// optim.cpp: CPU reference of the optimizer updates and the gradient-norm clipping scalars.
//
// Shape legend: n elements of one flat parameter group. M master/state type (f32; f64 for
// tests), G gradient / compute-copy type (the CPU backend instantiates G = M).
//
//   master, m, v, buf, target, source [n] in M      grad, copy [n] in G
//   ctl [4] step control (nullable; device memory on CUDA, host memory here: see kernels.inc):
//     {gradient scale, apply 1 / skip 0, step t, lr}; norm_sq, norm [1]
//
// AdamW, torch.optim.AdamW (single-tensor path) operation by operation, step t >= 1
// (t = ctl[2] and lr = h.lr * ctl[3] when ctl is given; nothing changes when ctl[1] == 0):
//   g       = grad * ctl[0]
//   master *= 1 - lr wd                        decoupled weight decay, before the Adam step
//   m       = m + (1 - b1)(g - m)              (torch's lerp; = b1 m + (1 - b1) g)
//   v       = b2 v + (1 - b2) g^2
//   master -= (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps)
//   copy    = master (in G)                    when copy != null
// SGD with momentum (dampening 0, no Nesterov) and decoupled weight decay; buf starts at 0,
// so the first step sets buf = g as torch does (buf may be null when momentum == 0):
//   buf     = mu buf + g
//   master -= lr (buf + wd master)
// EMA (the target encoder), torch's lerp with weight w = 1 - decay:
//   target  = target + (1 - decay)(source - target)   (= decay target + (1 - decay) source)
// AdamW with the EMA fused in (adamw_ema_update): the AdamW update, then the EMA whose source
//   is the group's elements [lo, hi) of the new master (CUDA does both in one pass).
// Clipping: norm_sq += sum grad^2 per flat buffer; norm = sqrt(norm_sq),
//   scale = min(1, max_norm / (norm + 1e-6))   (torch.nn.utils.clip_grad_norm_)
// Step control: apply = norm and loss finite; t += apply (step_control). With a loss scale S
//   the gradients are S times too large: norm /= S, the update's gradient scale /= S; a
//   skipped step halves S, growth_interval applied steps in a row double it (torch's GradScaler).
//
// Every update is elementwise (parallel_for over elements, kernels/cpu/parallel.h). The norm's sum is cut into a fixed
// number of blocks added in order, so it does not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/cpu/parallel.h"
#include "kernels/kernels.h"

namespace loom::cpu {
namespace {
constexpr int64_t kParallelMin = 1 << 15;  // below this, threads cost more than they save
}  // namespace

template <class M, class G>
void adamw_update(M* master, G* copy, M* m, M* v, const G* grad, const float* ctl,
                  int64_t n, AdamWHyper h, Stream) {
  if (ctl && ctl[1] == 0.0f) return;  // a skipped (non-finite) step
  // Scalars in double, as torch computes them in Python floats.
  const double t = ctl ? double(ctl[2]) : double(h.step);
  const double lr = ctl ? double(h.lr) * double(ctl[3]) : double(h.lr);
  const M decay = M(1.0 - lr * double(h.weight_decay));
  const M one_minus_b1 = M(1.0 - double(h.beta1));
  const M b2 = M(h.beta2), one_minus_b2 = M(1.0 - double(h.beta2));
  const M step_size = M(lr / (1.0 - std::pow(double(h.beta1), t)));
  const M bias_correction2_sqrt = M(std::sqrt(1.0 - std::pow(double(h.beta2), t)));
  const M eps = M(h.eps);
  const M scale = ctl ? M(ctl[0]) : M(1);

  parallel_for(n, [&](int64_t i) {
    const M g = M(grad[i]) * scale;
    master[i] *= decay;
    m[i] += one_minus_b1 * (g - m[i]);
    v[i] = b2 * v[i] + one_minus_b2 * g * g;
    const M denom = std::sqrt(v[i]) / bias_correction2_sqrt + eps;
    master[i] -= step_size * m[i] / denom;
    if (copy) copy[i] = G(master[i]);
  }, n > kParallelMin);
}

template <class M, class G>
void sgd_update(M* master, G* copy, M* buf, const G* grad, const float* ctl, int64_t n,
                float lr, float momentum, float weight_decay, Stream) {
  if (ctl && ctl[1] == 0.0f) return;  // a skipped (non-finite) step
  const M scale = ctl ? M(ctl[0]) : M(1);
  const M mu = M(momentum), wd = M(weight_decay), lr_ = ctl ? M(double(lr) * double(ctl[3])) : M(lr);
  parallel_for(n, [&](int64_t i) {
    const M g = M(grad[i]) * scale;
    M step = g;  // without momentum the step is the gradient itself
    if (momentum != 0.0f) {
      buf[i] = mu * buf[i] + g;
      step = buf[i];
    } else if (buf) {
      buf[i] = g;
    }
    master[i] -= lr_ * (step + wd * master[i]);
    if (copy) copy[i] = G(master[i]);
  }, n > kParallelMin);
}

template <class M, class G>
void ema_update(M* target, G* copy, const M* source, const float* ctl, int64_t n, double decay, Stream) {
  if (ctl && ctl[1] == 0.0f) return;  // the optimizer skipped this step: so does the EMA
  const M w = M(1.0 - decay);
  parallel_for(n, [&](int64_t i) {
    target[i] += w * (source[i] - target[i]);
    if (copy) copy[i] = G(target[i]);
  }, n > kParallelMin);
}

template <class M, class G>
void ema_update_many(const EmaTensor<M, G>* tensors, int count, const float* ctl, double decay, Stream s) {
  for (int i = 0; i < count; i++)
    ema_update(tensors[i].target, tensors[i].copy, tensors[i].source, ctl, tensors[i].n, decay, s);
}

// The specification of the fused form: the two updates one after the other.
template <class M, class G>
void adamw_ema_update(M* master, G* copy, M* m, M* v, const G* grad, const float* ctl, int64_t n, AdamWHyper h,
                      EmaRange<M, G> e, Stream s) {
  check_ema_range(e, n);
  adamw_update(master, copy, m, v, grad, ctl, n, h, s);
  ema_update(e.target, e.copy, master + e.lo, ctl, e.hi - e.lo, e.decay, s);
}

template <class G>
void grad_norm_squared(float* out, const G* grad, int64_t n, Stream) {
  constexpr int kBlocks = 64;
  double partial[kBlocks] = {};  // double partials: n is up to ~1e8 squares
  parallel_for(kBlocks, [&](int64_t b) {
    for (int64_t i = n * b / kBlocks; i < n * (b + 1) / kBlocks; i++)
      partial[b] += double(grad[i]) * double(grad[i]);
  }, n > kParallelMin);
  double sum = 0;
  for (int b = 0; b < kBlocks; b++) sum += partial[b];
  out[0] += float(sum);
}

void step_control(float* ctl, float* norm, const float* norm_sq, const float* loss, float max_norm,
                  float* loss_scale, int growth_interval, Stream) {
  const float S = loss_scale ? loss_scale[0] : 1.0f;
  const float total = norm_sq ? std::sqrt(*norm_sq) / S : 0.0f;
  if (norm) *norm = total;
  ctl[0] = ((norm_sq && max_norm > 0) ? std::min(1.0f, max_norm / (total + 1e-6f)) : 1.0f) / S;
  ctl[1] = std::isfinite(total) && (!loss || std::isfinite(*loss)) ? 1.0f : 0.0f;
  ctl[2] += ctl[1];
  if (loss_scale) {
    if (ctl[1] == 0.0f) {
      loss_scale[0] = std::max(1.0f, S * 0.5f);
      loss_scale[1] = 0.0f;
    } else if (++loss_scale[1] >= float(growth_interval)) {
      loss_scale[0] = std::min(16777216.0f, S * 2.0f);
      loss_scale[1] = 0.0f;
    }
  }
}

#define LOOM_INSTANTIATE(M, G)                                                                  \
  template void adamw_update<M, G>(M*, G*, M*, M*, const G*, const float*, int64_t, AdamWHyper, \
                                   Stream);                                                     \
  template void sgd_update<M, G>(M*, G*, M*, const G*, const float*, int64_t, float, float,     \
                                 float, Stream);                                                \
  template void ema_update<M, G>(M*, G*, const M*, const float*, int64_t, double, Stream);          \
  template void ema_update_many<M, G>(const EmaTensor<M, G>*, int, const float*, double, Stream);       \
  template void adamw_ema_update<M, G>(M*, G*, M*, M*, const G*, const float*, int64_t, AdamWHyper,      \
                                       EmaRange<M, G>, Stream);
LOOM_INSTANTIATE(float, float)
LOOM_INSTANTIATE(double, double)
#undef LOOM_INSTANTIATE
template void grad_norm_squared<float>(float*, const float*, int64_t, Stream);
template void grad_norm_squared<double>(float*, const double*, int64_t, Stream);

}  // namespace loom::cpu
