// ops_nn.cpp: dense layers, norms and activations with their backward.
#include "autograd/ops_util.h"

namespace loom {

// ------------------------------------------------------------------ linear / matmul
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  check_same("linear", {x, weight, bias});
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
  Tensor out = Tensor::empty(os, x.dtype(), x.device());
  dispatch_float(xc, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, linear_forward)(out.data<T>(), xc.data<T>(), wc.data<T>(), ptr<T>(bias), N, I, O, stream_for(dev));
  });
  if (any_requires_grad({x, weight, bias}))
    record("linear", {out}, [x, xc, weight, wc, bias, out, N, I, O]() {
      Tensor g = grad_of(out).contiguous();
      Tensor dx = x.requires_grad() ? Tensor::empty(x.shape(), x.dtype(), x.device()) : Tensor();
      Tensor dw = grad_buffer(weight), db = grad_buffer(bias);
      LOOM_CHECK(!dw.defined() || weight.is_contiguous(), "linear: gradient of a strided weight");
      dispatch_float(g, [&](auto dev, auto zero) {
        using T = decltype(zero);
        KERNEL(dev, linear_backward)(ptr<T>(dx), ptr<T>(dw), ptr<T>(db), g.data<T>(), xc.data<T>(), wc.data<T>(),
                                     N, I, O, stream_for(dev));
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
      dispatch_float(g, [&](auto dev, auto zero) {
        using T = decltype(zero);
        using A = acc_t<T>;
        KERNEL(dev, layernorm_backward)(dx.data<T>(), dw_tmp.data<T>(), ptr<T>(db_tmp), g.data<T>(), xc.data<T>(),
                                        weight.data<T>(), mean.data<A>(), rstd.data<A>(), N, C, stream_for(dev));
      });
      accumulate_grad(x, dx, true);
    });
  return out;
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
      dispatch_float(g, [&](auto dev, auto zero) {
        using T = decltype(zero);
        KERNEL(dev, rmsnorm_backward)(dx.data<T>(), dw_tmp.data<T>(), g.data<T>(), xc.data<T>(), weight.data<T>(),
                                      rstd.data<acc_t<T>>(), N, C, stream_for(dev));
      });
      accumulate_grad(x, dx, true);
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
