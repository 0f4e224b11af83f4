// ops_loss.cpp: cross-entropy (plain and fused with the output projection), patch
// discrimination and InfoNCE. The fused losses compute their gradients in the forward pass
// (for dloss = 1); backward scales them by the incoming dloss on the device (axpy_dev), so no
// value crosses to the host.
#include "autograd/ops_util.h"

namespace loom {

// x.grad += (*dloss) * g, with dloss a device scalar tensor of the accumulation dtype; a
// gradient buffer made here is written (=), not zeroed and then added to
static void add_scaled_grad(const Tensor& x, const Tensor& dloss, const Tensor& g) {
  bool is_new = false;
  Tensor buf = grad_buffer(x, &is_new);
  if (!buf.defined()) return;
  dispatch_float(buf, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, axpy_dev)(buf.data<T>(), dloss.data<acc_t<T>>(), g.data<T>(), g.numel(), !is_new,
                          stream_for(dev));
  });
}

Tensor cross_entropy(const Tensor& logits, const Tensor& targets) {
  check_index("cross_entropy", targets, logits);
  LOOM_CHECK(logits.dim() == 2 && targets.numel() == logits.size(0),
             "cross_entropy: expected logits [N, V] and targets [N], got %s and %s", logits.desc().c_str(),
             targets.desc().c_str());
  int64_t N = logits.size(0);
  int V = int(logits.size(1));
  Tensor lc = logits.contiguous(), tc = targets.contiguous();
  Tensor loss = acc_empty({1}, logits), lse = acc_empty({N}, logits);
  dispatch_float(lc, [&](auto dev, auto zero) {
    using T = decltype(zero);
    using A = acc_t<T>;
    KERNEL(dev, cross_entropy_forward)(loss.data<A>(), lse.data<A>(), lc.data<T>(), tc.data<int32_t>(), N, V,
                                       stream_for(dev));
  });
  if (any_requires_grad({logits}))
    record("cross_entropy", {loss}, [logits, lc, tc, loss, lse, N, V]() {
      Tensor dl = grad_of(loss), dx = Tensor::empty_like(lc);
      dispatch_float(lc, [&](auto dev, auto zero) {
        using T = decltype(zero);
        using A = acc_t<T>;
        KERNEL(dev, cross_entropy_backward)(dx.data<T>(), dl.data<A>(), lc.data<T>(), lse.data<A>(),
                                            tc.data<int32_t>(), N, V, stream_for(dev));
      });
      accumulate_grad(logits, dx, true);
    });
  return loss;
}

Tensor fused_linear_cross_entropy(const Tensor& h, const Tensor& W, const Tensor& targets, int64_t chunk) {
  check_same("fused_linear_cross_entropy", {h, W});
  check_index("fused_linear_cross_entropy", targets, h);
  LOOM_CHECK(h.dim() == 2 && W.dim() == 2 && h.size(1) == W.size(1) && targets.numel() == h.size(0),
             "fused_linear_cross_entropy: expected h [N, D], W [V, D], targets [N], got %s, %s, %s",
             h.desc().c_str(), W.desc().c_str(), targets.desc().c_str());
  int64_t N = h.size(0);
  int V = int(W.size(0)), D = int(W.size(1));
  chunk = std::max<int64_t>(1, std::min(chunk, N));
  Tensor hc = h.contiguous(), Wc = W.contiguous(), tc = targets.contiguous();
  Tensor loss = acc_empty({1}, h), dh = Tensor::empty_like(hc), dW = Tensor::empty_like(Wc);
  // fp16 loss scaling (autograd.h): dh, dW for dloss = S, then scaled by dloss / S in backward
  Tensor gs = loss_scale();
  if (gs.defined() && (gs.device() != h.device() || h.dtype() == DType::F64)) gs = Tensor();  // f32 accumulators only
  {
    // the only [*, V] buffer: chunk rows, never N. The CUDA kernels keep 16-bit logits in
    // their own type (half the accumulator's bytes); the CPU reference computes in f32/f64.
    const bool half = h.device() == Device::CUDA && (h.dtype() == DType::BF16 || h.dtype() == DType::F16);
    Tensor ws = acc_empty({half ? (chunk * V + 1) / 2 : chunk * V}, h);
    dispatch_float(hc, [&](auto dev, auto zero) {
      using T = decltype(zero);
      using A = acc_t<T>;
      KERNEL(dev, fused_linear_cross_entropy)(loss.data<A>(), dh.data<T>(), dW.data<T>(), hc.data<T>(), Wc.data<T>(),
                                              tc.data<int32_t>(), N, V, D, chunk, ws.data<A>(),
                                              gs.defined() ? gs.data<A>() : nullptr, stream_for(dev));
    });
  }
  if (any_requires_grad({h, W}))
    record("fused_linear_cross_entropy", {loss}, [h, W, loss, dh, dW, gs]() {
      Tensor dl = grad_of(loss);
      if (gs.defined()) dl = div(dl, gs.reshape(dl.shape()));  // on the device: S / S = 1 when seeded with S
      add_scaled_grad(h, dl, dh);
      add_scaled_grad(W, dl, dW);
    });
  return loss;
}

Tensor patch_disc_loss(const Tensor& pred, const Tensor& target, double tau) {
  check_same("patch_disc_loss", {pred, target});
  LOOM_CHECK(pred.dim() == 3 && pred.shape() == target.shape(),
             "patch_disc_loss: expected pred and target [B, M, D], got %s and %s", pred.desc().c_str(),
             target.desc().c_str());
  int B = int(pred.size(0)), M = int(pred.size(1)), D = int(pred.size(2));
  Tensor pc = pred.contiguous(), tc = target.contiguous();
  Tensor loss = acc_empty({1}, pred), dp = Tensor::empty_like(pc);
  Tensor ws = acc_empty({int64_t(B) * M * M + 2 * int64_t(B) * M}, pred);
  dispatch_float(pc, [&](auto dev, auto zero) {
    using T = decltype(zero);
    using A = acc_t<T>;
    KERNEL(dev, patch_disc_loss)(loss.data<A>(), dp.data<T>(), pc.data<T>(), tc.data<T>(), B, M, D, tau, ws.data<A>(),
                                 stream_for(dev));
  });
  if (any_requires_grad({pred}))
    record("patch_disc_loss", {loss}, [pred, loss, dp]() { add_scaled_grad(pred, grad_of(loss), dp); });
  return loss;
}

Tensor infonce_loss(const Tensor& a, const Tensor& b, double tau) {
  check_same("infonce_loss", {a, b});
  LOOM_CHECK(a.dim() == 2 && a.shape() == b.shape(), "infonce_loss: expected a and b [B, D], got %s and %s",
             a.desc().c_str(), b.desc().c_str());
  int B = int(a.size(0)), D = int(a.size(1));
  Tensor ac = a.contiguous(), bc = b.contiguous();
  Tensor loss = acc_empty({1}, a), da = Tensor::empty_like(ac), db = Tensor::empty_like(bc);
  Tensor ws = acc_empty({int64_t(B) * B + 4 * int64_t(B)}, a);
  dispatch_float(ac, [&](auto dev, auto zero) {
    using T = decltype(zero);
    using A = acc_t<T>;
    KERNEL(dev, infonce_loss)(loss.data<A>(), da.data<T>(), db.data<T>(), ac.data<T>(), bc.data<T>(), B, D, tau,
                              ws.data<A>(), stream_for(dev));
  });
  if (any_requires_grad({a, b}))
    record("infonce_loss", {loss}, [a, b, loss, da, db]() {
      add_scaled_grad(a, grad_of(loss), da);
      add_scaled_grad(b, grad_of(loss), db);
    });
  return loss;
}

}  // namespace loom
