// ops_index.cpp: gathers, scatters, patch and pixel-shuffle layouts, RoPE, L2 normalize.
#include "autograd/ops_util.h"

namespace loom {

Tensor gather_rows(const Tensor& x, const Tensor& idx, bool distinct) {
  check_index("gather_rows", idx, x);
  LOOM_CHECK(x.dim() == 3 && idx.dim() == 2 && idx.size(0) == x.size(0),
             "gather_rows: expected x [B, N, C] and idx [B, K], got %s and %s", x.desc().c_str(), idx.desc().c_str());
  int B = int(x.size(0)), N = int(x.size(1)), C = int(x.size(2)), K = int(idx.size(1));
  Tensor xc = x.contiguous(), ic = idx.contiguous();
  Tensor out = Tensor::empty({B, K, C}, x.dtype(), x.device());
  dispatch_float(xc, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, gather_rows)(out.data<T>(), xc.data<T>(), ic.data<int32_t>(), B, N, K, C, stream_for(dev));
  });
  if (any_requires_grad({x}))
    record("gather_rows", {out}, [x, ic, out, B, N, K, C, distinct]() {
      Tensor g = grad_of(out).contiguous(), dx = Tensor::zeros(x.shape(), x.dtype(), x.device());
      dispatch_float(g, [&](auto dev, auto zero) {
        using T = decltype(zero);
        // into zeros, distinct rows: setting them is adding them (one thread per element)
        KERNEL(dev, scatter_rows)(dx.data<T>(), ic.data<int32_t>(), g.data<T>(), B, N, K, C, !distinct,
                                  stream_for(dev));
      });
      accumulate_grad(x, dx, true);
    });
  return out;
}

Tensor scatter_rows(const Tensor& base, const Tensor& idx, const Tensor& src) {
  check_same("scatter_rows", {base, src});
  check_index("scatter_rows", idx, base);
  LOOM_CHECK(base.dim() == 3 && idx.dim() == 2 && src.dim() == 3 && idx.size(0) == base.size(0) &&
                 src.size(0) == base.size(0) && src.size(1) == idx.size(1) && src.size(2) == base.size(2),
             "scatter_rows: expected base [B, N, C], idx [B, K], src [B, K, C], got %s, %s, %s",
             base.desc().c_str(), idx.desc().c_str(), src.desc().c_str());
  int B = int(base.size(0)), N = int(base.size(1)), C = int(base.size(2)), K = int(idx.size(1));
  Tensor out = base.clone(), ic = idx.contiguous(), sc = src.contiguous();
  dispatch_float(out, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, scatter_rows)(out.data<T>(), ic.data<int32_t>(), sc.data<T>(), B, N, K, C, false, stream_for(dev));
  });
  if (any_requires_grad({base, src}))
    record("scatter_rows", {out}, [base, src, ic, out, B, N, K, C]() {
      Tensor g = grad_of(out).contiguous();
      dispatch_float(g, [&](auto dev, auto zero) {
        using T = decltype(zero);
        if (src.requires_grad()) {
          Tensor ds = Tensor::empty(src.shape(), src.dtype(), src.device());
          KERNEL(dev, gather_rows)(ds.data<T>(), g.data<T>(), ic.data<int32_t>(), B, N, K, C, stream_for(dev));
          accumulate_grad(src, ds, true);
        }
        if (base.requires_grad()) {
          Tensor db = g.clone();
          KERNEL(dev, zero_rows)(db.data<T>(), ic.data<int32_t>(), B, N, K, C, stream_for(dev));
          accumulate_grad(base, db, true);
        }
      });
    });
  return out;
}

Tensor patchify(const Tensor& images, int p) {
  LOOM_CHECK(images.dim() == 4 && images.size(2) % p == 0 && images.size(3) % p == 0,
             "patchify: expected images [B, C, H, W] with H, W divisible by %d, got %s", p, images.desc().c_str());
  int B = int(images.size(0)), Ch = int(images.size(1)), H = int(images.size(2)), W = int(images.size(3));
  Tensor ic = images.contiguous();
  Tensor out = Tensor::empty({B, (H / p) * (W / p), p * p * Ch}, images.dtype(), images.device());
  dispatch_float(ic, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, patchify)(out.data<T>(), ic.data<T>(), B, Ch, H, W, p, stream_for(dev));
  });
  if (any_requires_grad({images}))
    record("patchify", {out}, [images, out, B, Ch, H, W, p]() {
      Tensor g = grad_of(out).contiguous(), dx = Tensor::empty(images.shape(), images.dtype(), images.device());
      dispatch_float(g, [&](auto dev, auto zero) {
        using T = decltype(zero);
        KERNEL(dev, patchify_backward)(dx.data<T>(), g.data<T>(), B, Ch, H, W, p, stream_for(dev));
      });
      accumulate_grad(images, dx, true);
    });
  return out;
}

Tensor pixel_shuffle(const Tensor& x, int s) {
  LOOM_CHECK(x.dim() == 3, "pixel_shuffle: expected x [B, N, D], got %s", x.desc().c_str());
  int B = int(x.size(0)), N = int(x.size(1)), D = int(x.size(2));
  int G = 0;
  while (G * G < N) G++;
  LOOM_CHECK(G * G == N && G % s == 0, "pixel_shuffle: %d tokens are not a square grid divisible by %d", N, s);
  Tensor xc = x.contiguous();
  Tensor out = Tensor::empty({B, (G / s) * (G / s), s * s * D}, x.dtype(), x.device());
  dispatch_float(xc, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, pixel_shuffle)(out.data<T>(), xc.data<T>(), B, G, D, s, stream_for(dev));
  });
  if (any_requires_grad({x}))
    record("pixel_shuffle", {out}, [x, out, B, G, D, s]() {
      Tensor g = grad_of(out).contiguous(), dx = Tensor::empty(x.shape(), x.dtype(), x.device());
      dispatch_float(g, [&](auto dev, auto zero) {
        using T = decltype(zero);
        KERNEL(dev, pixel_shuffle_backward)(dx.data<T>(), g.data<T>(), B, G, D, s, stream_for(dev));
      });
      accumulate_grad(x, dx, true);
    });
  return out;
}

Tensor rope(const Tensor& x, const Tensor& pos, double theta) {
  check_index("rope", pos, x);
  LOOM_CHECK(x.dim() == 3 && pos.numel() == x.size(0) && x.size(2) % 2 == 0,
             "rope: expected x [N, H, hd] (hd even) and pos [N], got %s and %s", x.desc().c_str(), pos.desc().c_str());
  int64_t N = x.size(0);
  int H = int(x.size(1)), hd = int(x.size(2));
  Tensor xc = x.contiguous(), pc = pos.contiguous(), out = Tensor::empty_like(xc);
  dispatch_float(xc, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, rope_forward)(out.data<T>(), xc.data<T>(), pc.data<int32_t>(), N, H, hd, theta, stream_for(dev));
  });
  if (any_requires_grad({x}))
    record("rope", {out}, [x, pc, out, N, H, hd, theta]() {
      Tensor g = grad_of(out).contiguous(), dx = Tensor::empty_like(g);
      dispatch_float(g, [&](auto dev, auto zero) {
        using T = decltype(zero);
        KERNEL(dev, rope_backward)(dx.data<T>(), g.data<T>(), pc.data<int32_t>(), N, H, hd, theta, stream_for(dev));
      });
      accumulate_grad(x, dx, true);
    });
  return out;
}

Tensor l2_normalize(const Tensor& x, double eps) {
  Tensor xc = x.contiguous(), out = Tensor::empty_like(xc);
  int C = int(x.size(-1));
  int64_t N = xc.numel() / C;
  Tensor rnorm = acc_empty({N}, x);
  dispatch_float(xc, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, l2norm_forward)(out.data<T>(), rnorm.data<acc_t<T>>(), xc.data<T>(), N, C, eps, stream_for(dev));
  });
  if (any_requires_grad({x}))
    record("l2_normalize", {out}, [x, xc, out, rnorm, N, C]() {
      Tensor g = grad_of(out).contiguous(), dx = Tensor::empty_like(xc);
      dispatch_float(g, [&](auto dev, auto zero) {
        using T = decltype(zero);
        KERNEL(dev, l2norm_backward)(dx.data<T>(), g.data<T>(), xc.data<T>(), rnorm.data<acc_t<T>>(), N, C,
                                     stream_for(dev));
      });
      accumulate_grad(x, dx, true);
    });
  return out;
}

}  // namespace loom
