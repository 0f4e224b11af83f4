// ops_basic.cpp: views, broadcasting elementwise ops and reductions with their backward.
#include "autograd/ops_util.h"

namespace loom {

DType acc_dtype(DType t) { return t == DType::F64 ? DType::F64 : DType::F32; }

// ------------------------------------------------------------------ views
Tensor reshape(const Tensor& x, const Shape& shape) {
  Tensor out = x.reshape(shape);
  if (any_requires_grad({x})) {
    if (out.same(x)) out = x.view(x.shape());  // a distinct node output
    record("reshape", {out}, [x, out]() { accumulate_grad(x, grad_of(out).reshape(x.shape()), true); });
  }
  return out;
}

Tensor permute(const Tensor& x, const std::vector<int>& dims) {
  Tensor out = x.permute(dims);
  if (any_requires_grad({x})) {
    std::vector<int> inv(dims.size());
    for (size_t i = 0; i < dims.size(); i++) inv[size_t(dims[i] < 0 ? dims[i] + x.dim() : dims[i])] = int(i);
    record("permute", {out}, [x, out, inv]() { accumulate_grad(x, grad_of(out).permute(inv).contiguous(), true); });
  }
  return out;
}

Tensor transpose(const Tensor& x, int a, int b) {
  std::vector<int> p(size_t(x.dim()));
  for (int i = 0; i < x.dim(); i++) p[size_t(i)] = i;
  std::swap(p[size_t(a < 0 ? a + x.dim() : a)], p[size_t(b < 0 ? b + x.dim() : b)]);
  return permute(x, p);
}

Tensor narrow(const Tensor& x, int dim, int64_t start, int64_t length) {
  Tensor out = x.narrow(dim, start, length);
  if (any_requires_grad({x})) {
    record("narrow", {out}, [x, out, dim, start, length]() {
      Tensor g = Tensor::zeros_like(x);
      g.narrow(dim, start, length).copy_(grad_of(out));
      accumulate_grad(x, g, true);
    });
  }
  return out;
}

Tensor contiguous(const Tensor& x) {
  if (x.is_contiguous()) return x;
  Tensor out = x.contiguous();
  if (any_requires_grad({x}))
    record("contiguous", {out}, [x, out]() { accumulate_grad(x, grad_of(out), true); });
  return out;
}

Tensor expand(const Tensor& x, const Shape& shape) {
  Tensor out = x.expand(shape).contiguous();
  if (out.same(x)) out = x.clone();
  if (any_requires_grad({x}))
    record("expand", {out}, [x, out]() { accumulate_grad(x, sum_to(grad_of(out), x.shape()), true); });
  return out;
}

Tensor cast(const Tensor& x, DType dtype) {
  if (x.dtype() == dtype) return x;
  Tensor out = x.to(dtype);
  if (any_requires_grad({x}))
    record("cast", {out}, [x, out]() { accumulate_grad(x, grad_of(out).to(x.dtype()), true); });
  return out;
}

// ------------------------------------------------------------------ reductions
// Sum g over the dims that broadcasting added or stretched, to `shape`.
Tensor sum_to(const Tensor& g, const Shape& shape) {
  if (g.shape() == shape) return g;
  Tensor out = Tensor::empty(shape, g.dtype(), g.device());
  // out viewed with g's rank: leading dims absent, stretched dims stride 0
  Layout ob, il = layout_of(g);
  ob.ndim = il.ndim;
  size_t lead = size_t(g.dim()) - shape.size();
  Shape ost(shape.size());
  int64_t acc = 1;
  for (int i = int(shape.size()) - 1; i >= 0; i--) { ost[size_t(i)] = acc; acc *= shape[size_t(i)]; }
  for (int i = 0; i < il.ndim; i++) {
    ob.shape[i] = il.shape[i];
    if (size_t(i) < lead) { ob.stride[i] = 0; continue; }
    int64_t d = shape[size_t(i) - lead];
    LOOM_CHECK(d == il.shape[i] || d == 1, "sum_to: %s cannot reduce to %s", g.desc().c_str(), shape_str(shape).c_str());
    ob.stride[i] = d == 1 && il.shape[i] != 1 ? 0 : ost[size_t(i) - lead];
  }
  dispatch_float(g, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, reduce_sum_to)(out.data<T>(), ob, g.data<T>(), il, stream_for(dev));
  });
  return out;
}

Tensor sum(const Tensor& x) {
  Tensor xc = x.contiguous();
  Tensor out = acc_empty({1}, x);
  dispatch_float(xc, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, sum_all)(out.data<acc_t<T>>(), xc.data<T>(), xc.numel(), stream_for(dev));
  });
  if (any_requires_grad({x}))
    record("sum", {out}, [x, out]() {
      Shape ones(size_t(x.dim()), 1);
      Tensor g = grad_of(out).view(ones.empty() ? Shape{1} : ones);
      accumulate_grad(x, g.expand(x.shape()).contiguous().to(x.dtype()), true);
    });
  return out;
}

Tensor mean(const Tensor& x) { return scale(sum(x), 1.0 / double(std::max<int64_t>(x.numel(), 1))); }

Tensor mean_pool(const Tensor& x) {
  LOOM_CHECK(x.dim() == 3, "mean_pool: expected x of shape [B, K, C], got %s", x.desc().c_str());
  Tensor xc = x.contiguous();
  int B = int(x.size(0)), K = int(x.size(1)), C = int(x.size(2));
  Tensor out = Tensor::empty({B, C}, x.dtype(), x.device());
  dispatch_float(xc, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, mean_pool_forward)(out.data<T>(), xc.data<T>(), B, K, C, stream_for(dev));
  });
  if (any_requires_grad({x}))
    record("mean_pool", {out}, [x, out, B, K, C]() {
      Tensor g = grad_of(out).contiguous(), dx = Tensor::empty(x.shape(), x.dtype(), x.device());
      dispatch_float(g, [&](auto dev, auto zero) {
        using T = decltype(zero);
        KERNEL(dev, mean_pool_backward)(dx.data<T>(), g.data<T>(), B, K, C, stream_for(dev));
      });
      accumulate_grad(x, dx, true);
    });
  return out;
}

// ------------------------------------------------------------------ elementwise
// out = a op b with broadcasting (no autograd)
static Tensor binary_raw(const Tensor& a, const Tensor& b, BinaryOp op) {
  check_same("binary op", {a, b});
  Shape s = broadcast_shapes(a.shape(), b.shape());
  Tensor out = Tensor::empty(s, a.dtype(), a.device());
  Tensor ae = a.expand(s), be = b.expand(s);
  dispatch_float(a, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, binary)(out.data<T>(), ae.data<T>(), layout_of(ae), be.data<T>(), layout_of(be), op, stream_for(dev));
  });
  return out;
}

static Tensor binary_op(const Tensor& a, const Tensor& b, BinaryOp op, const char* name) {
  Tensor out = binary_raw(a, b, op);
  if (!any_requires_grad({a, b})) return out;
  record(name, {out}, [a, b, out, op]() {
    Tensor g = grad_of(out);
    switch (op) {
      case BinaryOp::Add:
        // the tape owns g: the first input takes it, the second aliases it (copy on write,
        // accumulate_grad): no copy of the gradient in a residual add
        accumulate_grad(a, sum_to(g, a.shape()), true);
        accumulate_grad(b, sum_to(g, b.shape()));
        break;
      case BinaryOp::Sub:
        accumulate_grad(a, sum_to(g, a.shape()), true);
        if (b.requires_grad()) accumulate_grad(b, sum_to(binary_raw(g, Tensor::full({1}, -1.0, g.dtype(), g.device()), BinaryOp::Mul), b.shape()), true);
        break;
      case BinaryOp::Mul:
        if (a.requires_grad()) accumulate_grad(a, sum_to(binary_raw(g, b, BinaryOp::Mul), a.shape()), true);
        if (b.requires_grad()) accumulate_grad(b, sum_to(binary_raw(g, a, BinaryOp::Mul), b.shape()), true);
        break;
      case BinaryOp::Div:
        if (a.requires_grad()) accumulate_grad(a, sum_to(binary_raw(g, b, BinaryOp::Div), a.shape()), true);
        if (b.requires_grad()) {  // d(a/b)/db = -a / b^2 = -(a/b)/b
          Tensor t = binary_raw(binary_raw(g, out, BinaryOp::Mul), b, BinaryOp::Div);
          accumulate_grad(b, sum_to(binary_raw(t, Tensor::full({1}, -1.0, t.dtype(), t.device()), BinaryOp::Mul), b.shape()), true);
        }
        break;
    }
  });
  return out;
}

Tensor add(const Tensor& a, const Tensor& b) { return binary_op(a, b, BinaryOp::Add, "add"); }
Tensor sub(const Tensor& a, const Tensor& b) { return binary_op(a, b, BinaryOp::Sub, "sub"); }
Tensor mul(const Tensor& a, const Tensor& b) { return binary_op(a, b, BinaryOp::Mul, "mul"); }
Tensor div(const Tensor& a, const Tensor& b) { return binary_op(a, b, BinaryOp::Div, "div"); }

static Tensor scale_raw(const Tensor& x, double s) {
  Tensor xc = x.contiguous(), out = Tensor::empty_like(xc);
  dispatch_float(xc, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, axpby)(out.data<T>(), xc.data<T>(), s, (const T*)nullptr, 0.0, xc.numel(), stream_for(dev));
  });
  return out;
}

Tensor scale(const Tensor& x, double s) {
  Tensor out = scale_raw(x, s);
  if (any_requires_grad({x}))
    record("scale", {out}, [x, out, s]() { accumulate_grad(x, scale_raw(grad_of(out), s), true); });
  return out;
}

static Tensor unary_raw(const Tensor& x, UnaryOp op) {
  Tensor xc = x.contiguous(), out = Tensor::empty_like(xc);
  dispatch_float(xc, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, unary)(out.data<T>(), xc.data<T>(), op, xc.numel(), stream_for(dev));
  });
  return out;
}

Tensor unary(const Tensor& x, UnaryOp op) {
  Tensor out = unary_raw(x, op);
  if (any_requires_grad({x}))
    record("unary", {out}, [x, out, op]() {
      Tensor g = grad_of(out), d;
      switch (op) {
        case UnaryOp::Neg: d = scale_raw(g, -1.0); break;
        case UnaryOp::Exp: d = binary_raw(g, out, BinaryOp::Mul); break;
        case UnaryOp::Log: d = binary_raw(g, x, BinaryOp::Div); break;
        case UnaryOp::Sqrt: d = scale_raw(binary_raw(g, out, BinaryOp::Div), 0.5); break;
        case UnaryOp::Square: d = scale_raw(binary_raw(g, x, BinaryOp::Mul), 2.0); break;
        case UnaryOp::Abs: {  // sign(x) = x / |x| (0 where x == 0 is not needed by any model)
          d = binary_raw(g, binary_raw(x, out, BinaryOp::Div), BinaryOp::Mul);
          break;
        }
      }
      accumulate_grad(x, d, true);
    });
  return out;
}

}  // namespace loom
