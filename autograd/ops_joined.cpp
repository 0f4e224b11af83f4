// ops_joined.cpp: products that share an input run as one GEMM where their weights lie side
// by side in memory (docs/DESIGN.md, "One training step on the GPU"): a Llama layer's q|k|v
// with RoPE (qkv_rope) and gate|up with SwiGLU (mlp_swiglu's joined branch).
#include <cstdlib>

#include "autograd/ops_util.h"

namespace loom {

// Matrices that lie one after another in memory (each contiguous, the same width, dtype and
// device) as one [sum of rows, C] matrix over that memory: a borrowed view that keeps the first
// one's storage alive; undefined when they do not. The optimizer's flat parameter and gradient
// buffers place a layer's weights so, in the order the module registers them
// (optim/optimizer.h): q_proj, k_proj, v_proj and gate_proj, up_proj of a Llama layer. The
// products against them then run as one GEMM (mlp_swiglu, qkv_rope): one launch with more
// tiles than each part alone (bench/bench_gemm_shapes.cpp: 576 -> 192 ran at 140-220 TFLOP/s,
// the joined 576 -> 960 at 410-490, H100).
Tensor stacked_view(const std::vector<Tensor>& ts) {
  int64_t rows = 0;
  for (size_t i = 0; i < ts.size(); i++) {
    const Tensor& t = ts[i];
    if (!t.defined() || t.dim() != 2 || !t.is_contiguous() || t.dtype() != ts[0].dtype() ||
        t.device() != ts[0].device() || t.size(1) != ts[0].size(1))
      return Tensor();
    if (i > 0 && static_cast<const char*>(t.raw()) != static_cast<const char*>(ts[i - 1].raw()) + ts[i - 1].nbytes())
      return Tensor();
    rows += t.size(0);
  }
  return Tensor::wrap(ts[0].raw(), {rows, ts[0].size(1)}, ts[0].dtype(), ts[0].device(),
                      std::shared_ptr<void>(ts[0].impl()->storage));
}

// dW_p += d[:, cols_p]^T x for the parts of a joined product d [N, sum of widths]: one GEMM
// into the stacked gradient buffers when they lie side by side, else one per part (its columns
// copied out first). x [N, C] contiguous. dws: the parts' gradient buffers (weight_grad_buffer;
// undefined: none wanted). Run inside weight_grads() by the callers.
static std::vector<Tensor> weight_grad_buffers(const std::vector<Tensor>& weights) {
  std::vector<Tensor> dws;
  for (auto& w : weights) dws.push_back(weight_grad_buffer(w));
  return dws;
}
static void joined_weight_grads(const Tensor& d, const Tensor& xc, const std::vector<Tensor>& weights,
                                const std::vector<Tensor>& dws) {
  bool all = true;
  for (auto& dw : dws) all = all && dw.defined();
  const int64_t N = d.size(0);
  const int C = int(xc.size(-1));
  Tensor joined = all ? stacked_view(dws) : Tensor();
  dispatch_float(d, [&](auto dev, auto zero) {
    using T = decltype(zero);
    if (joined.defined()) {
      KERNEL(dev, linear_backward)((T*)nullptr, joined.data<T>(), (T*)nullptr, d.data<T>(), xc.data<T>(), (const T*)nullptr,
                                   N, C, int(d.size(1)), stream_for(dev));
      return;
    }
    int64_t col = 0;
    for (size_t p = 0; p < weights.size(); p++) {
      const int rows = int(weights[p].size(0));
      if (dws[p].defined()) {
        Tensor part = d.narrow(1, col, rows).contiguous();
        KERNEL(dev, linear_backward)((T*)nullptr, dws[p].data<T>(), (T*)nullptr, part.data<T>(), xc.data<T>(),
                                     (const T*)nullptr, N, C, rows, stream_for(dev));
      }
      col += rows;
    }
  });
}

// mlp_swiglu with gate and up as one product: gu [N, 2I] = x [Wg; Wu]^T (one GEMM; row n holds
// gate | up), h = swiglu over gu's two halves (linear_swiglu_forward: in the GEMM's epilogue on
// Hopper), out = h Wd^T. Backward:
// dh = go Wd, dgu = swiglu'(dh) in the same layout (with h again for Wd's gradient; one call,
// linear_swiglu_backward, the SwiGLU's gradient in the product's epilogue on Hopper; with
// keep_product the forward's h instead, and the epilogue writes dgu only), then
// dx = dgu [Wg; Wu] and d[Wg; Wu] += dgu^T x, one GEMM each (joined_weight_grads). The same
// math as the separate products, summed in another order (dx over 2I at once). `residual` and
// `keep_product`: as mlp_swiglu's.
Tensor mlp_swiglu_joined(const Tensor& x, const Tensor& w_gate, const Tensor& w_up, const Tensor& wgu,
                         const Tensor& w_down, const Tensor& residual, bool keep_product) {
  const int C = int(w_gate.size(1)), I = int(w_gate.size(0)), C2 = int(w_down.size(0));
  Tensor xc = x.contiguous(), wdc = w_down.contiguous();
  const int64_t N = xc.numel() / C;
  Tensor gu = Tensor::empty({N, 2 * I}, x.dtype(), x.device());
  Shape os = x.shape();
  os.back() = C2;
  Tensor out = Tensor::empty(os, x.dtype(), x.device());
  Tensor rc = residual.defined() ? residual.contiguous() : Tensor();
  // h: freed when the forward returns unless w_down's gradient will read it (keep_product)
  Tensor h = Tensor::empty({N, I}, x.dtype(), x.device());
  dispatch_float(xc, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, linear_swiglu_forward)(gu.data<T>(), h.data<T>(), xc.data<T>(), wgu.data<T>(), N, C, I, stream_for(dev));
    linear_out(dev, out.data<T>(), h.data<T>(), wdc.data<T>(), (const T*)nullptr, ptr<T>(rc), N, I, C2);
  });
  Tensor kept = keep_product && w_down.requires_grad() ? h : Tensor();
  h = Tensor();
  const bool mlp_grad = any_requires_grad({x, w_gate, w_up, w_down});
  if (mlp_grad || any_requires_grad({residual}))
    record("linear", {out}, [x, xc, w_gate, w_up, wgu, w_down, wdc, residual, mlp_grad, out, gu, kept, N, C, I, C2]() {
      Tensor go = grad_of(out).contiguous();
      accumulate_grad(residual, go);  // passed on (aliased)
      if (!mlp_grad) return;
      Tensor dwd = weight_grad_buffer(w_down);
      std::vector<Tensor> dwgu = weight_grad_buffers({w_gate, w_up});
      LOOM_CHECK(!dwd.defined() || w_down.is_contiguous(), "mlp_swiglu: gradient of a strided weight");
      Tensor dx = x.requires_grad() ? Tensor::empty(x.shape(), x.dtype(), x.device()) : Tensor();
      Tensor dgu = Tensor::empty({N, 2 * I}, go.dtype(), go.device());
      // dh = go Wd and the SwiGLU's gradient (and h again, for Wd's gradient, unless the
      // forward's is kept) in one call: gemm_sm90.cu's epilogue on Hopper, else the product
      // into a scratch dh and one pass
      Tensor h = !dwd.defined() ? Tensor() : kept.defined() ? kept : Tensor::empty({N, I}, go.dtype(), go.device());
      dispatch_float(go, [&](auto dev, auto zero) {
        using T = decltype(zero);
        KERNEL(dev, linear_swiglu_backward)(dgu.data<T>(), kept.defined() ? (T*)nullptr : ptr<T>(h), go.data<T>(),
                                            wdc.data<T>(), gu.data<T>(), N, C2, I, stream_for(dev));
      });
      // the three weights' gradients (beside the next work under train.side_weight_grads)
      bool any_dw = dwd.defined();
      for (auto& dw : dwgu) any_dw = any_dw || dw.defined();
      if (any_dw)
        weight_grads({go, h, dgu, xc}, [&] {
          if (dwd.defined())
            dispatch_float(go, [&](auto dev, auto zero) {
              using T = decltype(zero);
              KERNEL(dev, linear_backward)((T*)nullptr, dwd.data<T>(), (T*)nullptr, go.data<T>(), h.data<T>(),
                                           wdc.data<T>(), N, I, C2, stream_for(dev));
            });
          joined_weight_grads(dgu, xc, {w_gate, w_up}, dwgu);
        });
      if (dx.defined())
        dispatch_float(go, [&](auto dev, auto zero) {
          using T = decltype(zero);
          KERNEL(dev, gemm)(dx.data<T>(), dgu.data<T>(), wgu.data<T>(), int(N), C, 2 * I, false, false, 1.0, 0.0, 1, 0, 0,
                            0, stream_for(dev));
        });
      if (dx.defined()) accumulate_grad(x, dx, true);
    });
  return out;
}

static void check_qkv_rope(const char* op, const Tensor& x, const Tensor& wq, const Tensor& wk, const Tensor& wv,
                           const Tensor& pos, int heads, int kv_heads, int head_dim) {
  check_same(op, {x, wq, wk, wv});
  check_index(op, pos, x);
  const int64_t H = heads, KV = kv_heads, hd = head_dim;
  LOOM_CHECK(x.dim() == 2 && wq.dim() == 2 && wq.size(0) == H * hd && wk.dim() == 2 && wk.size(0) == KV * hd &&
                 wv.dim() == 2 && wv.size(0) == KV * hd && wq.size(1) == x.size(1) && wk.size(1) == x.size(1) &&
                 wv.size(1) == x.size(1) && pos.numel() == x.size(0) && hd % 2 == 0,
             "%s: x %s, q %s, k %s, v %s, pos %s for %d heads, %d kv heads of %d", op, x.desc().c_str(),
             wq.desc().c_str(), wk.desc().c_str(), wv.desc().c_str(), pos.desc().c_str(), heads, kv_heads, head_dim);
}

// q, k, v of the joined product w (the three weights stacked) with RoPE: linear_qkv_rope
static std::vector<Tensor> qkv_rope_rows(const Tensor& xc, const Tensor& w, const Tensor& pc, int64_t H, int64_t KV,
                                         int64_t hd, double theta) {
  const int64_t N = xc.size(0);
  Tensor q = Tensor::empty({N, H, hd}, xc.dtype(), xc.device()), k = Tensor::empty({N, KV, hd}, xc.dtype(), xc.device());
  Tensor v = Tensor::empty({N, KV, hd}, xc.dtype(), xc.device());
  // the product and the split (RoPE in the product's epilogue on Hopper: kernels.inc)
  dispatch_float(xc, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, linear_qkv_rope)(q.data<T>(), k.data<T>(), v.data<T>(), xc.data<T>(), w.data<T>(), pc.data<int32_t>(),
                                 N, int(xc.size(1)), int(H), int(KV), int(hd), theta, stream_for(dev));
  });
  return {q, k, v};
}

// The backward of the joined product from its rows' gradient dqkv [N, W]: dx = dqkv w (one GEMM)
// and the three weight gradients (joined_weight_grads)
static void qkv_product_backward(const Tensor& x, const Tensor& xc, const Tensor& w, const Tensor& dqkv,
                                 const std::vector<Tensor>& weights) {
  // the weights' gradients beside the next work under train.side_weight_grads
  std::vector<Tensor> dws = weight_grad_buffers(weights);
  weight_grads({dqkv, xc}, [&] { joined_weight_grads(dqkv, xc, weights, dws); });
  if (x.requires_grad()) {
    Tensor dx = Tensor::empty(x.shape(), x.dtype(), x.device());
    dispatch_float(dqkv, [&](auto dev, auto zero) {
      using T = decltype(zero);
      KERNEL(dev, gemm)(dx.data<T>(), dqkv.data<T>(), w.data<T>(), int(xc.size(0)), int(xc.size(1)),
                        int(dqkv.size(1)), false, false, 1.0, 0.0, 1, 0, 0, 0, stream_for(dev));
    });
    accumulate_grad(x, dx, true);
  }
}

std::vector<Tensor> qkv_rope(const Tensor& x, const Tensor& wq, const Tensor& wk, const Tensor& wv, const Tensor& pos,
                             int heads, int kv_heads, int head_dim, double theta) {
  check_qkv_rope("qkv_rope", x, wq, wk, wv, pos, heads, kv_heads, head_dim);
  const int64_t H = heads, KV = kv_heads, hd = head_dim;
  const int64_t N = x.size(0);
  Tensor w = stacked_view({wq, wk, wv});
  if (!w.defined()) {
    std::vector<Tensor> p = linear_many(x, {wq, wk, wv});
    return {rope(reshape(p[0], {N, H, hd}), pos, theta), rope(reshape(p[1], {N, KV, hd}), pos, theta),
            reshape(p[2], {N, KV, hd})};
  }
  const int64_t W = (H + 2 * KV) * hd;  // row n of qkv: q (H hd) | k (KV hd) | v (KV hd)
  Tensor xc = x.contiguous(), pc = pos.contiguous();
  std::vector<Tensor> qkv = qkv_rope_rows(xc, w, pc, H, KV, hd, theta);
  Tensor q = qkv[0], k = qkv[1], v = qkv[2];
  if (any_requires_grad({x, wq, wk, wv}))
    record("qkv_rope", {q, k, v}, [x, xc, wq, wk, wv, w, pc, q, k, v, N, H, KV, hd, W, theta]() {
      // dqkv in the forward's row layout: rope^-1 of dq and dk, dv copied, in one pass (a part
      // without a gradient counts as zeros)
      auto grad_or_zeros = [](const Tensor& t) {
        Tensor g = grad_of(t);
        return g.defined() ? g.contiguous() : Tensor::zeros(t.shape(), t.dtype(), t.device());
      };
      Tensor gq = grad_or_zeros(q), gk = grad_or_zeros(k), gv = grad_or_zeros(v);
      Tensor dqkv = Tensor::empty({N, W}, xc.dtype(), xc.device());
      dispatch_float(dqkv, [&](auto dev, auto zero) {
        using T = decltype(zero);
        KERNEL(dev, rope_qkv_join)(dqkv.data<T>(), gq.data<T>(), gk.data<T>(), gv.data<T>(), pc.data<int32_t>(), N,
                                   int(H), int(KV), int(hd), theta, stream_for(dev));
      });
      qkv_product_backward(x, xc, w, dqkv, {wq, wk, wv});
    });
  return {q, k, v};
}

Tensor qkv_rope_attention(const Tensor& x, const Tensor& wq, const Tensor& wk, const Tensor& wv, const Tensor& pos,
                          const SeqInfo& seq, int heads, int kv_heads, int head_dim, double theta, double scale) {
  check_qkv_rope("qkv_rope_attention", x, wq, wk, wv, pos, heads, kv_heads, head_dim);
  Tensor w = stacked_view({wq, wk, wv});
  if (!w.defined() || seq.cu_q.raw() != seq.cu_k.raw()) {  // the two ops
    std::vector<Tensor> qkv = qkv_rope(x, wq, wk, wv, pos, heads, kv_heads, head_dim, theta);
    return reshape(attention(qkv[0], qkv[1], qkv[2], seq, /*causal=*/true, scale), {x.size(0), int64_t(heads) * head_dim});
  }
  check_index("qkv_rope_attention", seq.cu_q, x);
  const int64_t H = heads, KV = kv_heads, hd = head_dim, N = x.size(0), W = (H + 2 * KV) * hd;
  Tensor xc = x.contiguous(), pc = pos.contiguous();
  std::vector<Tensor> qkv = qkv_rope_rows(xc, w, pc, H, KV, hd, theta);
  Tensor q = qkv[0], k = qkv[1], v = qkv[2];
  AttentionOut fwd = attention_rows(q, k, v, seq, /*causal=*/true, scale);
  Tensor out = fwd.out, lse = fwd.lse;
  if (any_requires_grad({x, wq, wk, wv}))
    record("qkv_rope_attention", {out}, [x, xc, wq, wk, wv, w, pc, q, k, v, out, lse, seq, N, H, KV, hd, W, theta,
                                         scale]() {
      Tensor g = grad_of(out).contiguous();
      Tensor ws = attention_workspace(q);
      Tensor dqkv = Tensor::empty({N, W}, xc.dtype(), xc.device());
      dispatch_float(g, [&](auto dev, auto zero) {
        using T = decltype(zero);
        using A = acc_t<T>;
        KERNEL(dev, attention_backward_qkv)(dqkv.data<T>(), g.data<T>(), q.data<T>(), k.data<T>(), v.data<T>(),
                                            out.data<T>(), lse.data<A>(), ws.data<A>(), seq.cu_q.data<int32_t>(),
                                            pc.data<int32_t>(), seq.nseq, seq.max_seqlen, N, int(H), int(KV), int(hd),
                                            true, scale, theta, stream_for(dev));
      });
      qkv_product_backward(x, xc, w, dqkv, {wq, wk, wv});
    });
  return reshape(out, {N, H * hd});
}

Tensor qkv_attention(const Tensor& x, const Tensor& weight, const Tensor& bias, const SeqInfo& seq, int heads,
                     double scale) {
  check_same("qkv_attention", {x, weight, bias});
  LOOM_CHECK(x.dim() == 2 && weight.dim() == 2 && heads > 0 && weight.size(0) % (3 * int64_t(heads)) == 0 &&
                 weight.size(1) == x.size(1) && (!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0))),
             "qkv_attention: expected x [N, C], weight [3 H hd, C] with H = %d and bias [3 H hd], got %s, %s, %s",
             heads, x.desc().c_str(), weight.desc().c_str(), bias.desc().c_str());
  const int64_t N = x.size(0), D = weight.size(0) / 3, hd = D / heads;
  // LOOM_QKV_ATTENTION=0 runs the two ops (read at every call: the step A/B of bench/ab.sh)
  const char* e = std::getenv("LOOM_QKV_ATTENTION");
  if ((e && e[0] == '0') || !weight.is_contiguous() || (bias.defined() && !bias.is_contiguous()) ||
      seq.cu_q.raw() != seq.cu_k.raw()) {
    // the two ops
    std::vector<Tensor> p = linear_split(x, weight, bias, 3);
    return reshape(attention(reshape(p[0], {N, heads, hd}), reshape(p[1], {N, heads, hd}), reshape(p[2], {N, heads, hd}),
                             seq, /*causal=*/false, scale),
                   {N, D});
  }
  check_index("qkv_attention", seq.cu_q, x);
  check_index("qkv_attention", seq.cu_k, x);
  const int C = int(x.size(1));
  Tensor xc = x.contiguous();
  // q, k, v one after another in one [3, N, D] buffer, one batched product (linear_split's)
  Tensor all = Tensor::empty({3, N, D}, x.dtype(), x.device());
  dispatch_float(xc, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, linear_forward_batched)(all.data<T>(), xc.data<T>(), weight.data<T>(), ptr<T>(bias), N, C, int(D), 3,
                                        stream_for(dev));
  });
  Tensor q = all.narrow(0, 0, 1).view({N, heads, hd});
  Tensor k = all.narrow(0, 1, 1).view({N, heads, hd});
  Tensor v = all.narrow(0, 2, 1).view({N, heads, hd});
  AttentionOut fwd = attention_rows(q, k, v, seq, /*causal=*/false, scale);
  Tensor out = fwd.out, lse = fwd.lse;
  if (any_requires_grad({x, weight, bias}))
    record("qkv_attention", {out}, [x, xc, weight, bias, q, k, v, out, lse, seq, N, D, C, heads, hd, scale]() {
      Tensor g = grad_of(out).contiguous();
      Tensor ws = attention_workspace(q);
      Tensor dqkv = Tensor::empty({N, 3 * D}, xc.dtype(), xc.device());
      Tensor dx = x.requires_grad() ? Tensor::empty(x.shape(), x.dtype(), x.device()) : Tensor();
      Tensor dw = weight_grad_buffer(weight), db = weight_grad_buffer(bias);
      dispatch_float(g, [&](auto dev, auto zero) {
        using T = decltype(zero);
        using A = acc_t<T>;
        KERNEL(dev, attention_backward_qkv)(dqkv.data<T>(), g.data<T>(), q.data<T>(), k.data<T>(), v.data<T>(),
                                            out.data<T>(), lse.data<A>(), ws.data<A>(), seq.cu_q.data<int32_t>(),
                                            (const int32_t*)nullptr, seq.nseq, seq.max_seqlen, N, heads, heads,
                                            int(hd), /*causal=*/false, scale, 0.0, stream_for(dev));
      });
      // the weight's and bias's gradients (beside the next work under train.side_weight_grads),
      // then dx = dqkv W
      if (dw.defined() || db.defined())
        weight_grads({dqkv, xc}, [&] {
          dispatch_float(g, [&](auto dev, auto zero) {
            using T = decltype(zero);
            KERNEL(dev, linear_backward)((T*)nullptr, ptr<T>(dw), ptr<T>(db), dqkv.data<T>(), xc.data<T>(),
                                         weight.data<T>(), N, C, int(3 * D), stream_for(dev));
          });
        });
      if (dx.defined())
        dispatch_float(g, [&](auto dev, auto zero) {
          using T = decltype(zero);
          KERNEL(dev, linear_backward)(dx.data<T>(), (T*)nullptr, (T*)nullptr, dqkv.data<T>(), xc.data<T>(),
                                       weight.data<T>(), N, C, int(3 * D), stream_for(dev));
        });
      if (dx.defined()) accumulate_grad(x, dx, true);
    });
  return reshape(out, {N, D});
}

}  // namespace loom
