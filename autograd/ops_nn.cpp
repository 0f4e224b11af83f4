// ops_nn.cpp: dense layers, norms and activations with their backward.
#include "autograd/ops_util.h"

namespace loom {

// ------------------------------------------------------------------ linear / matmul
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& residual) {
  check_same("linear", {x, weight, bias, residual});
  LOOM_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1),
             "linear: expected x [..., %lld] for weight %s, got %s", (long long)weight.size(1),
             weight.desc().c_str(), x.desc().c_str());
  int I = int(weight.size(1)), O = int(weight.size(0));
  LOOM_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == O), "linear: bias %s for %d outputs",
             bias.desc().c_str(), O);
  Tensor xc = x.contiguous(), wc = weight.contiguous();
  int64_t N = xc.numel() / I;
  Shape os = x.shape();
  os.back() = O;
  LOOM_CHECK(!residual.defined() || residual.shape() == os, "linear: residual %s for an output [%s]",
             residual.desc().c_str(), shape_str(os).c_str());
  Tensor out = Tensor::empty(os, x.dtype(), x.device());
  Tensor rc = residual.defined() ? residual.contiguous() : Tensor();
  dispatch_float(xc, [&](auto dev, auto zero) {
    using T = decltype(zero);
    linear_out(dev, out.data<T>(), xc.data<T>(), wc.data<T>(), ptr<T>(bias), ptr<T>(rc), N, I, O);
  });
  if (any_requires_grad({x, weight, bias, residual}))
    record("linear", {out}, [x, xc, weight, wc, bias, residual, out, N, I, O]() {
      Tensor g = grad_of(out).contiguous();
      accumulate_grad(residual, g);  // the residual's gradient is out's, passed on (aliased)
      Tensor dx = x.requires_grad() ? Tensor::empty(x.shape(), x.dtype(), x.device()) : Tensor();
      Tensor dw = weight_grad_buffer(weight), db = weight_grad_buffer(bias);
      LOOM_CHECK(!dw.defined() || weight.is_contiguous(), "linear: gradient of a strided weight");
      // dW += g^T x and db += colsum(g) (beside the next nodes under train.side_weight_grads),
      // then dx = g W on the main stream
      if (dw.defined() || db.defined())
        weight_grads({g, xc}, [&] {
          dispatch_float(g, [&](auto dev, auto zero) {
            using T = decltype(zero);
            KERNEL(dev, linear_backward)((T*)nullptr, ptr<T>(dw), ptr<T>(db), g.data<T>(), xc.data<T>(), wc.data<T>(),
                                         N, I, O, stream_for(dev));
          });
        });
      if (dx.defined())
        dispatch_float(g, [&](auto dev, auto zero) {
          using T = decltype(zero);
          KERNEL(dev, linear_backward)(dx.data<T>(), (T*)nullptr, (T*)nullptr, g.data<T>(), xc.data<T>(), wc.data<T>(),
                                       N, I, O, stream_for(dev));
        });
      if (dx.defined()) accumulate_grad(x, dx, true);
    });
  return out;
}

namespace {
// One output of linear_parts: rows [row0, row0 + rows) of `weight` (and of `bias`).
struct LinearPart {
  Tensor weight, bias;
  int64_t row0 = 0;
  int rows = 0;
};

// Several linears reading one input: part p = x W_p^T + b_p, each its own GEMM (bias in the
// epilogue) into its own contiguous output. Backward: dx = sum_p g_p W_p accumulated by the
// GEMMs themselves (beta = 1 after the first), so no separate add kernels; dW_p, db_p (+=)
// land in their rows of the weights' gradient buffers.
// Parts of equal width taken in turn from one weight (and bias), linear_split's case: one
// batched GEMM writes them all into one [P, N, O] buffer, each part a contiguous block of it.
bool one_batch(const std::vector<LinearPart>& parts) {
  if (parts.size() < 2) return false;
  for (size_t p = 0; p < parts.size(); p++)
    if (!parts[p].weight.same(parts[0].weight) || !parts[p].bias.same(parts[0].bias) || parts[p].rows != parts[0].rows ||
        parts[p].row0 != parts[0].row0 + int64_t(p) * parts[0].rows)
      return false;
  return parts[0].weight.is_contiguous() && (!parts[0].bias.defined() || parts[0].bias.is_contiguous());
}

std::vector<Tensor> linear_parts(const Tensor& x, const std::vector<LinearPart>& parts) {
  const int I = int(parts[0].weight.size(1));
  Tensor xc = x.contiguous();
  const int64_t N = xc.numel() / I;
  std::vector<Tensor> outs, wcs;
  bool needs_grad = x.requires_grad() && grad_enabled();
  for (auto& p : parts) {
    check_same("linear", {x, p.weight, p.bias});
    LOOM_CHECK(p.weight.dim() == 2 && p.weight.size(1) == I && x.size(-1) == I && p.row0 >= 0 &&
                   p.row0 + p.rows <= p.weight.size(0) && (!p.bias.defined() || p.bias.numel() == p.weight.size(0)),
               "linear: x %s with weight %s rows [%lld, %lld) and bias %s", x.desc().c_str(), p.weight.desc().c_str(),
               (long long)p.row0, (long long)(p.row0 + p.rows), p.bias.desc().c_str());
    wcs.push_back(p.weight.contiguous());
    needs_grad |= any_requires_grad({p.weight, p.bias});
  }
  const bool batched = one_batch(parts);
  Tensor all;  // batched: [P, N, O], part p the block all[p]
  if (batched) {
    const LinearPart& p0 = parts[0];
    all = Tensor::empty({int64_t(parts.size()), N, p0.rows}, x.dtype(), x.device());
    dispatch_float(xc, [&](auto dev, auto zero) {
      using T = decltype(zero);
      KERNEL(dev, linear_forward_batched)(all.data<T>(), xc.data<T>(), p0.weight.data<T>() + p0.row0 * I,
                                          p0.bias.defined() ? p0.bias.data<T>() + p0.row0 : (T*)nullptr, N, I,
                                          int(p0.rows), int(parts.size()), stream_for(dev));
    });
  }
  for (size_t pi = 0; pi < parts.size(); pi++) {
    const LinearPart& p = parts[pi];
    Shape os = x.shape();
    os.back() = p.rows;
    if (batched) {
      outs.push_back(all.narrow(0, int64_t(pi), 1).view(os));
      continue;
    }
    Tensor out = Tensor::empty(os, x.dtype(), x.device());
    dispatch_float(xc, [&](auto dev, auto zero) {
      using T = decltype(zero);
      KERNEL(dev, linear_forward)(out.data<T>(), xc.data<T>(), wcs[pi].data<T>() + p.row0 * I,
                                  p.bias.defined() ? p.bias.data<T>() + p.row0 : (T*)nullptr, N, I, p.rows,
                                  stream_for(dev));
    });
    outs.push_back(out);
  }
  if (needs_grad)
    record("linear", outs, [x, xc, parts, wcs, outs, N, I, batched]() {
      Tensor dx = x.requires_grad() ? Tensor::empty(x.shape(), x.dtype(), x.device()) : Tensor();
      std::vector<Tensor> gs, dws, dbs;
      for (size_t p = 0; p < parts.size(); p++) {
        Tensor g = grad_of(outs[p]);  // undefined: this part did not reach the loss
        gs.push_back(g.defined() ? g.contiguous() : g);
        dws.push_back(weight_grad_buffer(parts[p].weight));
        dbs.push_back(weight_grad_buffer(parts[p].bias));
        LOOM_CHECK(!dws.back().defined() || parts[p].weight.is_contiguous(), "linear: gradient of a strided weight");
      }
      // the weight and bias gradients (beside the next nodes under train.side_weight_grads):
      // the parts' weight gradients in one batched GEMM when their output gradients lie one
      // after another too (the attention backward writes dq, dk, dv so): dW_p += g_p^T x
      std::vector<Tensor> keep = gs;
      keep.push_back(xc);
      bool any_dw = false;
      for (size_t p = 0; p < parts.size(); p++) any_dw = any_dw || dws[p].defined() || dbs[p].defined();
      if (any_dw)
        weight_grads(keep, [&] {
          bool dw_done = false;
          if (batched) {
            Tensor dw = dws[0];
            const int64_t O = parts[0].rows, step = N * O * int64_t(dtype_size(xc.dtype()));
            bool spaced = dw.defined();  // (one_batch: the weight is contiguous)
            for (size_t p = 0; p < gs.size() && spaced; p++)
              spaced = gs[p].defined() &&
                       static_cast<const char*>(gs[p].raw()) == static_cast<const char*>(gs[0].raw()) + int64_t(p) * step;
            if (spaced) {
              dispatch_float(gs[0], [&](auto dev, auto zero) {
                using T = decltype(zero);
                KERNEL(dev, gemm)(dw.data<T>() + parts[0].row0 * I, gs[0].data<T>(), xc.data<T>(), int(O), I, int(N), true,
                                  false, 1.0, 1.0, int(gs.size()), N * O, 0, O * I, stream_for(dev));
              });
              dw_done = true;
            }
          }
          for (size_t p = 0; p < parts.size(); p++) {
            if (!gs[p].defined()) continue;
            const LinearPart& lp = parts[p];
            Tensor dw = dw_done ? Tensor() : dws[p], db = dbs[p];
            if (!dw.defined() && !db.defined()) continue;
            dispatch_float(gs[p], [&](auto dev, auto zero) {
              using T = decltype(zero);
              KERNEL(dev, linear_backward)((T*)nullptr, dw.defined() ? dw.data<T>() + lp.row0 * I : (T*)nullptr,
                                           db.defined() ? db.data<T>() + lp.row0 : (T*)nullptr, gs[p].data<T>(),
                                           xc.data<T>(), wcs[p].data<T>() + lp.row0 * I, N, I, lp.rows, stream_for(dev));
            });
          }
        });
      // dx = sum_p g_p W_p, the GEMMs adding (beta 1) after the first
      bool dx_written = false;
      for (size_t p = 0; p < parts.size() && dx.defined(); p++) {
        if (!gs[p].defined()) continue;
        const LinearPart& lp = parts[p];
        dispatch_float(gs[p], [&](auto dev, auto zero) {
          using T = decltype(zero);
          KERNEL(dev, gemm)(dx.data<T>(), gs[p].data<T>(), wcs[p].data<T>() + lp.row0 * I, int(N), I, lp.rows, false,
                            false, 1.0, dx_written ? 1.0 : 0.0, 1, 0, 0, 0, stream_for(dev));
        });
        dx_written = true;
      }
      if (dx.defined()) {
        if (!dx_written) dx.zero_();
        accumulate_grad(x, dx, true);
      }
    });
  return outs;
}
}  // namespace

std::vector<Tensor> linear_split(const Tensor& x, const Tensor& weight, const Tensor& bias, int parts) {
  LOOM_CHECK(parts >= 1 && weight.dim() == 2 && weight.size(0) % parts == 0 && x.dim() >= 1 &&
                 x.size(-1) == weight.size(1),
             "linear_split: expected x [..., %lld] and weight [P*O, %lld] with P = %d parts, got %s and %s",
             (long long)weight.size(1), (long long)weight.size(1), parts, x.desc().c_str(), weight.desc().c_str());
  const int O = int(weight.size(0) / parts);
  std::vector<LinearPart> ps;
  for (int p = 0; p < parts; p++) ps.push_back({weight, bias, int64_t(p) * O, O});
  return linear_parts(x, ps);
}

std::vector<Tensor> linear_many(const Tensor& x, const std::vector<Tensor>& weights, const std::vector<Tensor>& biases) {
  LOOM_CHECK(!weights.empty() && (biases.empty() || biases.size() == weights.size()),
             "linear_many: %zu weights with %zu biases", weights.size(), biases.size());
  std::vector<LinearPart> ps;
  for (size_t i = 0; i < weights.size(); i++)
    ps.push_back({weights[i], biases.empty() ? Tensor() : biases[i], 0, int(weights[i].size(0))});
  return linear_parts(x, ps);
}

Tensor mlp_gelu(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
                const Tensor& residual, bool keep_activation) {
  check_same("mlp_gelu", {x, w1, b1, w2, b2, residual});
  LOOM_CHECK(w1.dim() == 2 && w2.dim() == 2 && x.dim() >= 1 && x.size(-1) == w1.size(1) && w2.size(1) == w1.size(0) &&
                 (!b1.defined() || b1.numel() == w1.size(0)) && (!b2.defined() || b2.numel() == w2.size(0)),
             "mlp_gelu: x %s, fc1 %s (bias %s), fc2 %s (bias %s) do not chain", x.desc().c_str(), w1.desc().c_str(),
             b1.desc().c_str(), w2.desc().c_str(), b2.desc().c_str());
  const int C = int(w1.size(1)), H = int(w1.size(0)), C2 = int(w2.size(0));
  Tensor xc = x.contiguous(), w1c = w1.contiguous(), w2c = w2.contiguous();
  const int64_t N = xc.numel() / C;
  // without a backward (no gradient wanted: the EMA target, evaluation) the GELU's input is
  // not kept: fc1's GEMM writes only its output (kernels.inc, pre nullable)
  const bool grad = any_requires_grad({x, w1, b1, w2, b2});
  Tensor pre = grad ? Tensor::empty({N, H}, x.dtype(), x.device()) : Tensor();
  Tensor h = Tensor::empty({N, H}, x.dtype(), x.device());
  Shape os = x.shape();
  os.back() = C2;
  LOOM_CHECK(!residual.defined() || residual.shape() == os, "mlp_gelu: residual %s for an output [%s]",
             residual.desc().c_str(), shape_str(os).c_str());
  Tensor out = Tensor::empty(os, x.dtype(), x.device());
  Tensor rc = residual.defined() ? residual.contiguous() : Tensor();
  dispatch_float(xc, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, linear_gelu_forward)(h.data<T>(), grad ? pre.data<T>() : (T*)nullptr, xc.data<T>(), w1c.data<T>(),
                                     ptr<T>(b1), N, C, H, stream_for(dev));
    linear_out(dev, out.data<T>(), h.data<T>(), w2c.data<T>(), ptr<T>(b2), ptr<T>(rc), N, H, C2);
  });
  const Tensor kept = grad && keep_activation ? h : Tensor();  // else freed after the forward
  if (grad || any_requires_grad({residual}))
    record("linear", {out}, [x, xc, w1, w1c, b1, w2, w2c, b2, residual, out, pre, kept, N, C, H, C2]() {
      Tensor g = grad_of(out).contiguous();
      accumulate_grad(residual, g);  // passed on (aliased)
      if (!pre.defined()) return;    // only the residual wanted a gradient
      Tensor dw1 = weight_grad_buffer(w1), db2 = weight_grad_buffer(b2), dw2 = weight_grad_buffer(w2);
      Tensor db1 = grad_buffer(b1);  // the DGELU product's column sums, on the main stream
      LOOM_CHECK((!dw1.defined() || w1.is_contiguous()) && (!dw2.defined() || w2.is_contiguous()),
                 "mlp_gelu: gradient of a strided weight");
      Tensor dpre = Tensor::empty({N, H}, g.dtype(), g.device());
      Tensor dx = x.requires_grad() ? Tensor::empty(x.shape(), x.dtype(), x.device()) : Tensor();
      // fc2's weight and bias gradients (beside the next work under train.side_weight_grads);
      // its weight needs the activation: kept, or recomputed from pre
      if (dw2.defined() || db2.defined())
        weight_grads({g, pre, kept}, [&] {
          dispatch_float(g, [&](auto dev, auto zero) {
            using T = decltype(zero);
            Tensor h = kept;
            if (dw2.defined() && !h.defined()) {
              h = Tensor::empty({N, H}, g.dtype(), g.device());
              KERNEL(dev, gelu_forward)(h.data<T>(), pre.data<T>(), N * H, stream_for(dev));
            }
            KERNEL(dev, linear_backward)((T*)nullptr, ptr<T>(dw2), ptr<T>(db2), g.data<T>(), ptr<T>(h), w2c.data<T>(),
                                         N, H, C2, stream_for(dev));
          });
        });
      // dpre = (g W2) * gelu'(pre), db1 += colsum(dpre); then fc1's dW1 (beside) and dx
      dispatch_float(g, [&](auto dev, auto zero) {
        using T = decltype(zero);
        KERNEL(dev, linear_dgelu_backward)(dpre.data<T>(), ptr<T>(db1), g.data<T>(), w2c.data<T>(), pre.data<T>(), N, H,
                                           C2, stream_for(dev));
      });
      if (dw1.defined())
        weight_grads({dpre, xc}, [&] {
          dispatch_float(g, [&](auto dev, auto zero) {
            using T = decltype(zero);
            KERNEL(dev, linear_backward)((T*)nullptr, dw1.data<T>(), (T*)nullptr, dpre.data<T>(), xc.data<T>(),
                                         w1c.data<T>(), N, C, H, stream_for(dev));
          });
        });
      if (dx.defined())
        dispatch_float(g, [&](auto dev, auto zero) {
          using T = decltype(zero);
          KERNEL(dev, linear_backward)(dx.data<T>(), (T*)nullptr, (T*)nullptr, dpre.data<T>(), xc.data<T>(),
                                       w1c.data<T>(), N, C, H, stream_for(dev));
        });
      if (dx.defined()) accumulate_grad(x, dx, true);
    });
  return out;
}

Tensor mlp_swiglu(const Tensor& x, const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down,
                  const Tensor& residual, bool keep_product) {
  check_same("mlp_swiglu", {x, w_gate, w_up, w_down, residual});
  LOOM_CHECK(w_gate.dim() == 2 && w_up.shape() == w_gate.shape() && w_down.dim() == 2 && x.dim() >= 1 &&
                 x.size(-1) == w_gate.size(1) && w_down.size(1) == w_gate.size(0),
             "mlp_swiglu: x %s, gate %s, up %s, down %s do not chain", x.desc().c_str(), w_gate.desc().c_str(),
             w_up.desc().c_str(), w_down.desc().c_str());
  const int C = int(w_gate.size(1)), I = int(w_gate.size(0)), C2 = int(w_down.size(0));
  Shape os = x.shape();
  os.back() = C2;
  LOOM_CHECK(!residual.defined() || residual.shape() == os, "mlp_swiglu: residual %s for an output [%s]",
             residual.desc().c_str(), shape_str(os).c_str());
  // gate and up side by side in memory: one GEMM for both (mlp_swiglu_joined)
  if (Tensor wgu = stacked_view({w_gate, w_up}); wgu.defined())
    return mlp_swiglu_joined(x, w_gate, w_up, wgu, w_down, residual, keep_product);
  Tensor xc = x.contiguous(), wgc = w_gate.contiguous(), wuc = w_up.contiguous(), wdc = w_down.contiguous();
  const int64_t N = xc.numel() / C;
  Tensor g = Tensor::empty({N, I}, x.dtype(), x.device()), u = Tensor::empty({N, I}, x.dtype(), x.device());
  Tensor out = Tensor::empty(os, x.dtype(), x.device());
  Tensor rc = residual.defined() ? residual.contiguous() : Tensor();
  // the product, freed when the forward returns unless w_down's gradient will read it
  Tensor h = Tensor::empty({N, I}, x.dtype(), x.device());
  dispatch_float(xc, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, linear_forward)(g.data<T>(), xc.data<T>(), wgc.data<T>(), (const T*)nullptr, N, C, I, stream_for(dev));
    KERNEL(dev, linear_forward)(u.data<T>(), xc.data<T>(), wuc.data<T>(), (const T*)nullptr, N, C, I, stream_for(dev));
    KERNEL(dev, swiglu_forward)(h.data<T>(), g.data<T>(), u.data<T>(), N * I, stream_for(dev));
    linear_out(dev, out.data<T>(), h.data<T>(), wdc.data<T>(), (const T*)nullptr, ptr<T>(rc), N, I, C2);
  });
  Tensor kept = keep_product && w_down.requires_grad() ? h : Tensor();
  h = Tensor();
  const bool mlp_grad = any_requires_grad({x, w_gate, w_up, w_down});
  if (mlp_grad || any_requires_grad({residual}))
    record("linear", {out}, [x, xc, w_gate, wgc, w_up, wuc, w_down, wdc, residual, mlp_grad, out, g, u, kept, N, C, I,
                             C2]() {
      Tensor go = grad_of(out).contiguous();
      accumulate_grad(residual, go);  // passed on (aliased)
      if (!mlp_grad) return;
      Tensor dwg = weight_grad_buffer(w_gate), dwu = weight_grad_buffer(w_up), dwd = weight_grad_buffer(w_down);
      LOOM_CHECK((!dwg.defined() || w_gate.is_contiguous()) && (!dwu.defined() || w_up.is_contiguous()) &&
                     (!dwd.defined() || w_down.is_contiguous()),
                 "mlp_swiglu: gradient of a strided weight");
      Tensor dx = x.requires_grad() ? Tensor::empty(x.shape(), x.dtype(), x.device()) : Tensor();
      Tensor dh = Tensor::empty({N, I}, go.dtype(), go.device());
      Tensor dg = Tensor::empty({N, I}, go.dtype(), go.device()), du = Tensor::empty({N, I}, go.dtype(), go.device());
      // down's weight needs the product: the forward's (keep_product), or recomputed from gate and
      // up in the same pass as the SwiGLU's gradient (swiglu_backward_product)
      Tensor h = dwd.defined() && !kept.defined() ? Tensor::empty({N, I}, go.dtype(), go.device()) : kept;
      dispatch_float(go, [&](auto dev, auto zero) {
        using T = decltype(zero);
        // dh = go W_down; (dgate, dup) = swiglu'(dh)
        KERNEL(dev, linear_backward)(dh.data<T>(), (T*)nullptr, (T*)nullptr, go.data<T>(), (const T*)nullptr,
                                     wdc.data<T>(), N, I, C2, stream_for(dev));
        if (dwd.defined() && !kept.defined())
          KERNEL(dev, swiglu_backward_product)(dg.data<T>(), du.data<T>(), h.data<T>(), dh.data<T>(), g.data<T>(),
                                               u.data<T>(), N * I, stream_for(dev));
        else
          KERNEL(dev, swiglu_backward)(dg.data<T>(), du.data<T>(), dh.data<T>(), g.data<T>(), u.data<T>(), N * I,
                                       stream_for(dev));
      });
      // dW += d^T x for the three weights (beside the next work under train.side_weight_grads)
      if (dwd.defined() || dwg.defined() || dwu.defined())
        weight_grads({go, h, dg, du, xc}, [&] {
          dispatch_float(go, [&](auto dev, auto zero) {
            using T = decltype(zero);
            if (dwd.defined())
              KERNEL(dev, linear_backward)((T*)nullptr, dwd.data<T>(), (T*)nullptr, go.data<T>(), h.data<T>(),
                                           wdc.data<T>(), N, I, C2, stream_for(dev));
            if (dwg.defined())
              KERNEL(dev, linear_backward)((T*)nullptr, dwg.data<T>(), (T*)nullptr, dg.data<T>(), xc.data<T>(),
                                           wgc.data<T>(), N, C, I, stream_for(dev));
            if (dwu.defined())
              KERNEL(dev, linear_backward)((T*)nullptr, dwu.data<T>(), (T*)nullptr, du.data<T>(), xc.data<T>(),
                                           wuc.data<T>(), N, C, I, stream_for(dev));
          });
        });
      // dx = dgate W_gate + dup W_up (the second GEMM adds, beta 1)
      if (dx.defined())
        dispatch_float(go, [&](auto dev, auto zero) {
          using T = decltype(zero);
          KERNEL(dev, gemm)(dx.data<T>(), dg.data<T>(), wgc.data<T>(), int(N), C, I, false, false, 1.0, 0.0, 1, 0, 0, 0,
                            stream_for(dev));
          KERNEL(dev, gemm)(dx.data<T>(), du.data<T>(), wuc.data<T>(), int(N), C, I, false, false, 1.0, 1.0, 1, 0, 0, 0,
                            stream_for(dev));
        });
      if (dx.defined()) accumulate_grad(x, dx, true);
    });
  return out;
}

// C = op(A) @ op(B) over matching leading (batch) dims; B may be 2-D (shared).
static Tensor matmul_raw(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  int64_t M = ta ? a.size(-1) : a.size(-2), K = ta ? a.size(-2) : a.size(-1);
  int64_t Kb = tb ? b.size(-1) : b.size(-2), N = tb ? b.size(-2) : b.size(-1);
  LOOM_CHECK(K == Kb, "matmul: inner dims differ: %s%s @ %s%s", a.desc().c_str(), ta ? "^T" : "",
             b.desc().c_str(), tb ? "^T" : "");
  int64_t batch = a.numel() / (M * K);
  bool shared_b = b.dim() == 2;
  LOOM_CHECK(shared_b || b.numel() / (K * N) == batch, "matmul: batch of %s and %s differ", a.desc().c_str(),
             b.desc().c_str());
  Tensor ac = a.contiguous(), bc = b.contiguous();
  Shape os(a.shape().begin(), a.shape().end() - 2);
  os.push_back(M);
  os.push_back(N);
  Tensor out = Tensor::empty(os, a.dtype(), a.device());
  dispatch_float(ac, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, gemm)(out.data<T>(), ac.data<T>(), bc.data<T>(), int(M), int(N), int(K), ta, tb, 1.0, 0.0, int(batch),
                      M * K, shared_b ? 0 : K * N, M * N, stream_for(dev));
  });
  return out;
}

Tensor matmul(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  check_same("matmul", {a, b});
  LOOM_CHECK(a.dim() >= 2 && b.dim() >= 2, "matmul: expected matrices, got %s and %s", a.desc().c_str(), b.desc().c_str());
  LOOM_CHECK(!(ta && b.dim() == 2 && a.dim() > 2), "matmul: a^T with a shared 2-D b is not supported");
  Tensor out = matmul_raw(a, b, ta, tb);
  if (any_requires_grad({a, b}))
    record("matmul", {out}, [a, b, out, ta, tb]() {
      Tensor g = grad_of(out);
      // C = A B: dA = G B^T, dB = A^T G (with the transposes folded in)
      if (a.requires_grad()) {
        Tensor da = ta ? matmul_raw(b, g, tb, true) : matmul_raw(g, b, false, !tb);
        accumulate_grad(a, da, true);
      }
      if (b.requires_grad()) {
        Tensor db;
        if (b.dim() == 2 && a.dim() > 2) {  // shared B: fold the batch into the rows
          Tensor a2 = a.contiguous().reshape({-1, a.size(-1)}), g2 = g.contiguous().reshape({-1, g.size(-1)});
          db = tb ? matmul_raw(g2, a2, true, false) : matmul_raw(a2, g2, true, false);
        } else {
          db = tb ? matmul_raw(g, a, true, ta) : matmul_raw(a, g, !ta, false);
        }
        accumulate_grad(b, db, true);
      }
    });
  return out;
}

// ------------------------------------------------------------------ norms
Tensor layernorm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  check_same("layernorm", {x, weight, bias});
  int C = int(x.size(-1));
  LOOM_CHECK(weight.numel() == C && (!bias.defined() || bias.numel() == C),
             "layernorm: x %s with weight %s", x.desc().c_str(), weight.desc().c_str());
  Tensor xc = x.contiguous();
  int64_t N = xc.numel() / C;
  Tensor out = Tensor::empty_like(xc), mean = acc_empty({N}, x), rstd = acc_empty({N}, x);
  dispatch_float(xc, [&](auto dev, auto zero) {
    using T = decltype(zero);
    using A = acc_t<T>;
    KERNEL(dev, layernorm_forward)(out.data<T>(), mean.data<A>(), rstd.data<A>(), xc.data<T>(), weight.data<T>(),
                                   ptr<T>(bias), N, C, eps, stream_for(dev));
  });
  if (any_requires_grad({x, weight, bias}))
    record("layernorm", {out}, [x, xc, weight, bias, out, mean, rstd, N, C]() {
      Tensor g = grad_of(out).contiguous(), dx = Tensor::empty_like(xc);
      Tensor dw = grad_buffer(weight), db = grad_buffer(bias);
      Tensor dw_tmp = dw.defined() ? dw : Tensor::zeros_like(weight);
      Tensor db_tmp = bias.defined() ? (db.defined() ? db : Tensor::zeros_like(bias)) : Tensor();
      Tensor pend = pending_grad(x);  // a residual stream's other gradient, added by the kernel
      dispatch_float(g, [&](auto dev, auto zero) {
        using T = decltype(zero);
        using A = acc_t<T>;
        KERNEL(dev, layernorm_backward)(dx.data<T>(), ptr<T>(pend), dw_tmp.data<T>(), ptr<T>(db_tmp), g.data<T>(),
                                        xc.data<T>(), weight.data<T>(), mean.data<A>(), rstd.data<A>(), N, C,
                                        stream_for(dev));
      });
      if (pend.defined()) replace_grad(x, dx);
      else accumulate_grad(x, dx, true);
    });
  return out;
}

// {h = x + y, norm(h)} for LayerNorm (rms false) and RMSNorm (rms true, bias undefined).
static std::vector<Tensor> add_norm(const Tensor& x, const Tensor& y, const Tensor& weight, const Tensor& bias,
                                    double eps, bool rms) {
  check_same(rms ? "add_rmsnorm" : "add_layernorm", {x, y, weight, bias});
  const int C = int(x.size(-1));
  LOOM_CHECK(x.shape() == y.shape() && weight.numel() == C && (!bias.defined() || bias.numel() == C),
             "%s: x %s, y %s with weight %s", rms ? "add_rmsnorm" : "add_layernorm", x.desc().c_str(),
             y.desc().c_str(), weight.desc().c_str());
  Tensor xc = x.contiguous(), yc = y.contiguous();
  const int64_t N = xc.numel() / C;
  Tensor h = Tensor::empty_like(xc), out = Tensor::empty_like(xc), rstd = acc_empty({N}, x);
  Tensor mean = rms ? Tensor() : acc_empty({N}, x);
  dispatch_float(xc, [&](auto dev, auto zero) {
    using T = decltype(zero);
    using A = acc_t<T>;
    if (rms)
      KERNEL(dev, residual_rmsnorm_forward)(h.data<T>(), out.data<T>(), rstd.data<A>(), xc.data<T>(), yc.data<T>(),
                                            weight.data<T>(), N, C, eps, stream_for(dev));
    else
      KERNEL(dev, residual_layernorm_forward)(h.data<T>(), out.data<T>(), mean.data<A>(), rstd.data<A>(), xc.data<T>(),
                                              yc.data<T>(), weight.data<T>(), ptr<T>(bias), N, C, eps, stream_for(dev));
  });
  if (any_requires_grad({x, y, weight, bias}))
    record(rms ? "rmsnorm" : "layernorm", {h, out}, [x, y, weight, bias, h, out, mean, rstd, N, C, rms]() {
      // d(h) = norm_backward(g_out) + g_h, the add inside the norm's backward pass (dresid)
      Tensor gh = grad_of(h), go = grad_of(out), dh;
      if (go.defined()) {
        go = go.contiguous();
        dh = Tensor::empty_like(h);
        Tensor dw = grad_buffer(weight), db = grad_buffer(bias);
        Tensor dw_tmp = dw.defined() ? dw : Tensor::zeros_like(weight);
        Tensor db_tmp = bias.defined() ? (db.defined() ? db : Tensor::zeros_like(bias)) : Tensor();
        Tensor ghc = gh.defined() ? gh.contiguous() : Tensor();
        dispatch_float(go, [&](auto dev, auto zero) {
          using T = decltype(zero);
          using A = acc_t<T>;
          if (rms)
            KERNEL(dev, rmsnorm_backward)(dh.data<T>(), ptr<T>(ghc), dw_tmp.data<T>(), go.data<T>(), h.data<T>(),
                                          weight.data<T>(), rstd.data<A>(), N, C, stream_for(dev));
          else
            KERNEL(dev, layernorm_backward)(dh.data<T>(), ptr<T>(ghc), dw_tmp.data<T>(), ptr<T>(db_tmp), go.data<T>(),
                                            h.data<T>(), weight.data<T>(), mean.data<A>(), rstd.data<A>(), N, C,
                                            stream_for(dev));
        });
      } else {
        dh = gh;
      }
      if (!dh.defined()) return;
      accumulate_grad(x, dh, true);  // h's gradient dies with this node: x may take it
      accumulate_grad(y, dh);        // y aliases it (copy on write)
    });
  return {h, out};
}

std::vector<Tensor> add_layernorm(const Tensor& x, const Tensor& y, const Tensor& weight, const Tensor& bias,
                                  double eps) {
  return add_norm(x, y, weight, bias, eps, false);
}
std::vector<Tensor> add_rmsnorm(const Tensor& x, const Tensor& y, const Tensor& weight, double eps) {
  return add_norm(x, y, weight, Tensor(), eps, true);
}

Tensor rmsnorm(const Tensor& x, const Tensor& weight, double eps) {
  check_same("rmsnorm", {x, weight});
  int C = int(x.size(-1));
  LOOM_CHECK(weight.numel() == C, "rmsnorm: x %s with weight %s", x.desc().c_str(), weight.desc().c_str());
  Tensor xc = x.contiguous();
  int64_t N = xc.numel() / C;
  Tensor out = Tensor::empty_like(xc), rstd = acc_empty({N}, x);
  dispatch_float(xc, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, rmsnorm_forward)(out.data<T>(), rstd.data<acc_t<T>>(), xc.data<T>(), weight.data<T>(), N, C, eps,
                                 stream_for(dev));
  });
  if (any_requires_grad({x, weight}))
    record("rmsnorm", {out}, [x, xc, weight, out, rstd, N, C]() {
      Tensor g = grad_of(out).contiguous(), dx = Tensor::empty_like(xc);
      Tensor dw = grad_buffer(weight);
      Tensor dw_tmp = dw.defined() ? dw : Tensor::zeros_like(weight);
      Tensor pend = pending_grad(x);  // as layernorm
      dispatch_float(g, [&](auto dev, auto zero) {
        using T = decltype(zero);
        KERNEL(dev, rmsnorm_backward)(dx.data<T>(), ptr<T>(pend), dw_tmp.data<T>(), g.data<T>(), xc.data<T>(),
                                      weight.data<T>(), rstd.data<acc_t<T>>(), N, C, stream_for(dev));
      });
      if (pend.defined()) replace_grad(x, dx);
      else accumulate_grad(x, dx, true);
    });
  return out;
}

// ------------------------------------------------------------------ activations
// One-input elementwise activation: forward kernel, backward kernel reading the input.
#define LOOM_ACTIVATION(fname, fwd, bwd)                                                        \
  Tensor fname(const Tensor& x) {                                                               \
    Tensor xc = x.contiguous(), out = Tensor::empty_like(xc);                                   \
    dispatch_float(xc, [&](auto dev, auto zero) {                                               \
      using T = decltype(zero);                                                                 \
      KERNEL(dev, fwd)(out.data<T>(), xc.data<T>(), xc.numel(), stream_for(dev));               \
    });                                                                                         \
    if (any_requires_grad({x}))                                                                 \
      record(#fname, {out}, [x, xc, out]() {                                                    \
        Tensor g = grad_of(out).contiguous(), dx = Tensor::empty_like(xc);                      \
        dispatch_float(g, [&](auto dev, auto zero) {                                            \
          using T = decltype(zero);                                                             \
          KERNEL(dev, bwd)(dx.data<T>(), g.data<T>(), xc.data<T>(), xc.numel(), stream_for(dev)); \
        });                                                                                     \
        accumulate_grad(x, dx, true);                                                           \
      });                                                                                       \
    return out;                                                                                 \
  }
LOOM_ACTIVATION(gelu, gelu_forward, gelu_backward)
LOOM_ACTIVATION(silu, silu_forward, silu_backward)
#undef LOOM_ACTIVATION

Tensor swiglu(const Tensor& gate, const Tensor& up) {
  check_same("swiglu", {gate, up});
  LOOM_CHECK(gate.shape() == up.shape(), "swiglu: gate %s and up %s differ", gate.desc().c_str(), up.desc().c_str());
  Tensor gc = gate.contiguous(), uc = up.contiguous(), out = Tensor::empty_like(gc);
  dispatch_float(gc, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, swiglu_forward)(out.data<T>(), gc.data<T>(), uc.data<T>(), gc.numel(), stream_for(dev));
  });
  if (any_requires_grad({gate, up}))
    record("swiglu", {out}, [gate, up, gc, uc, out]() {
      Tensor g = grad_of(out).contiguous(), dg = Tensor::empty_like(gc), du = Tensor::empty_like(uc);
      dispatch_float(g, [&](auto dev, auto zero) {
        using T = decltype(zero);
        KERNEL(dev, swiglu_backward)(dg.data<T>(), du.data<T>(), g.data<T>(), gc.data<T>(), uc.data<T>(), gc.numel(),
                                     stream_for(dev));
      });
      accumulate_grad(gate, dg, true);
      accumulate_grad(up, du, true);
    });
  return out;
}

Tensor softmax(const Tensor& x) {
  Tensor xc = x.contiguous(), out = Tensor::empty_like(xc);
  int C = int(x.size(-1));
  int64_t N = xc.numel() / C;
  dispatch_float(xc, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, softmax_forward)(out.data<T>(), xc.data<T>(), N, C, stream_for(dev));
  });
  if (any_requires_grad({x}))
    record("softmax", {out}, [x, out, N, C]() {
      Tensor g = grad_of(out).contiguous(), dx = Tensor::empty_like(out);
      dispatch_float(g, [&](auto dev, auto zero) {
        using T = decltype(zero);
        KERNEL(dev, softmax_backward)(dx.data<T>(), g.data<T>(), out.data<T>(), N, C, stream_for(dev));
      });
      accumulate_grad(x, dx, true);
    });
  return out;
}

Tensor embedding(const Tensor& ids, const Tensor& table) {
  check_index("embedding", ids, table);
  LOOM_CHECK(table.dim() == 2, "embedding: table must be [V, C], got %s", table.desc().c_str());
  Tensor ic = ids.contiguous(), tc = table.contiguous();
  int V = int(table.size(0)), C = int(table.size(1));
  int64_t N = ic.numel();
  Shape os = ids.shape();
  os.push_back(C);
  Tensor out = Tensor::empty(os, table.dtype(), table.device());
  dispatch_float(tc, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, embedding_forward)(out.data<T>(), ic.data<int32_t>(), tc.data<T>(), N, C, V, stream_for(dev));
  });
  if (any_requires_grad({table}))
    record("embedding", {out}, [ic, table, out, N, C, V]() {
      Tensor g = grad_of(out).contiguous(), dt = grad_buffer(table);
      dispatch_float(g, [&](auto dev, auto zero) {
        using T = decltype(zero);
        KERNEL(dev, embedding_backward)(dt.data<T>(), g.data<T>(), ic.data<int32_t>(), N, C, V, stream_for(dev));
      });
    });
  return out;
}

}  // namespace loom
