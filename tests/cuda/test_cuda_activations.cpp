// test_cuda_activations.cpp: kernels/cuda/activations.cu (gelu, silu, swiglu, softmax) against the
// loom::cpu reference, f32 and bf16 (tests/cuda/cuda_kernel_test_util.h). Skipped without a GPU.
//   bash tools/gpu-kernels.sh tests/cuda/test_cuda_activations.cpp
#include <catch2/catch.hpp>

#include "kernels/kernels.h"
#include "tests/tolerances.h"

#include "tests/cuda/cuda_kernel_test_util.h"

TEMPLATE_TEST_CASE("activations: gelu, silu, swiglu forward and backward", "[activations]", float, bf16, f16) {
  need_gpu();
  using T = TestType;
  const auto t = tol_of<T>();
  for (int64_t n : {1, 7, 1000, 4099}) {
    for (int off : {0, 1}) {  // off = 1: misaligned pointers take the scalar path
      INFO("n " << n << " offset " << off);
      auto hx = rounded<T>(rnd(n + off, 60, -4.f, 4.f)), hu = rounded<T>(rnd(n + off, 61));
      auto hd = rounded<T>(rnd(n + off, 62));
      DBuf<T> x(hx), u(hu), d(hd), o(n + off), o2(n + off);
      const float* X = hx.data() + off;
      const float* U = hu.data() + off;
      const float* D = hd.data() + off;
      auto tail = [&](const DBuf<T>& b) { auto v = b.get(); return std::vector<float>(v.begin() + off, v.end()); };
      std::vector<float> r(n), r2(n);
      cpu::gelu_forward(r.data(), X, n, nullptr);
      cu::gelu_forward(o.p + off, x.p + off, n, S());
      CHECK_CLOSE(tail(o), r, t, "gelu");
      cpu::gelu_backward(r.data(), D, X, n, nullptr);
      cu::gelu_backward(o.p + off, d.p + off, x.p + off, n, S());
      CHECK_CLOSE(tail(o), r, t, "gelu_backward");
      cpu::silu_forward(r.data(), X, n, nullptr);
      cu::silu_forward(o.p + off, x.p + off, n, S());
      CHECK_CLOSE(tail(o), r, t, "silu");
      cpu::silu_backward(r.data(), D, X, n, nullptr);
      cu::silu_backward(o.p + off, d.p + off, x.p + off, n, S());
      CHECK_CLOSE(tail(o), r, t, "silu_backward");
      cpu::swiglu_forward(r.data(), X, U, n, nullptr);
      cu::swiglu_forward(o.p + off, x.p + off, u.p + off, n, S());
      CHECK_CLOSE(tail(o), r, t, "swiglu");
      o.poison();
      cpu::swiglu_backward(r.data(), r2.data(), D, X, U, n, nullptr);
      cu::swiglu_backward(o.p + off, o2.p + off, d.p + off, x.p + off, u.p + off, n, S());
      CHECK_CLOSE(tail(o), r, t, "swiglu dgate");
      CHECK_CLOSE(tail(o2), r2, t, "swiglu dup");
      // the fused backward + product: bit for bit the separate kernels' outputs
      const auto sep_dg = o.get(), sep_du = o2.get();
      DBuf<T> p(n + off), pf(n + off);
      cu::swiglu_forward(pf.p + off, x.p + off, u.p + off, n, S());
      const auto sep_p = pf.get();
      o.poison();
      o2.poison();
      p.poison();
      cu::swiglu_backward_product(o.p + off, o2.p + off, p.p + off, d.p + off, x.p + off, u.p + off, n, S());
      CHECK(tail(o) == std::vector<float>(sep_dg.begin() + off, sep_dg.end()));
      CHECK(tail(o2) == std::vector<float>(sep_du.begin() + off, sep_du.end()));
      CHECK(tail(p) == std::vector<float>(sep_p.begin() + off, sep_p.end()));
    }
  }
}

TEMPLATE_TEST_CASE("activations: swiglu over a joined gate|up product", "[activations]", float, bf16, f16) {
  need_gpu();
  using T = TestType;
  const auto t = tol_of<T>();
  struct Case { int64_t N; int I; int off; };
  // I % 8 == 0 with aligned pointers takes the vector path; I = 13 or an offset the scalar one
  for (Case c : {Case{1, 8, 0}, Case{5, 13, 0}, Case{37, 64, 0}, Case{9, 64, 1}, Case{300, 1536, 0}}) {
    INFO("N " << c.N << " I " << c.I << " offset " << c.off);
    const int64_t n = c.N * c.I, off = c.off;
    auto hgu = rounded<T>(rnd(2 * n + off, 65, -4.f, 4.f)), hd = rounded<T>(rnd(n + off, 66));
    DBuf<T> gu(hgu), d(hd), o(n + off), dgu(2 * n + off), p(n + off);
    const float* GU = hgu.data() + off;
    auto tail = [&](const DBuf<T>& b) { auto v = b.get(); return std::vector<float>(v.begin() + off, v.end()); };
    // the reference: the flat CPU ops on each row's two halves
    std::vector<float> r(n), rdgu(2 * n);
    cpu::swiglu_forward_joined(r.data(), GU, c.N, c.I, nullptr);
    for (int64_t row = 0; row < c.N; row++) {
      std::vector<float> one(c.I);
      cpu::swiglu_forward(one.data(), GU + row * 2 * c.I, GU + row * 2 * c.I + c.I, c.I, nullptr);
      for (int i = 0; i < c.I; i++) REQUIRE(one[size_t(i)] == r[size_t(row * c.I + i)]);
    }
    cu::swiglu_forward_joined(o.p + off, gu.p + off, c.N, c.I, S());
    CHECK_CLOSE(tail(o), r, t, "swiglu_forward_joined");
    cpu::swiglu_backward_joined(rdgu.data(), (float*)nullptr, hd.data() + off, GU, c.N, c.I, nullptr);
    cu::swiglu_backward_joined(dgu.p + off, (T*)nullptr, d.p + off, gu.p + off, c.N, c.I, S());
    CHECK_CLOSE(tail(dgu), rdgu, t, "swiglu_backward_joined dgate|dup");
    // with the product: the same gradients and the forward's output, bit for bit
    const auto dg_alone = tail(dgu), fwd = o.get();  // (tails: the poisoned NaN before off is never equal)
    dgu.poison();
    cu::swiglu_backward_joined(dgu.p + off, p.p + off, d.p + off, gu.p + off, c.N, c.I, S());
    CHECK(tail(dgu) == dg_alone);
    CHECK(tail(p) == std::vector<float>(fwd.begin() + off, fwd.end()));
  }
}

TEMPLATE_TEST_CASE("activations: softmax forward and backward", "[activations]", float, bf16, f16) {
  need_gpu();
  using T = TestType;
  const auto t = tol_of<T>();
  struct Case { int64_t N; int C; };
  for (Case c : {Case{1, 1}, Case{5, 17}, Case{9, 1024}, Case{3, 1500}, Case{2, 9000}}) {
    INFO("N " << c.N << " C " << c.C);
    int64_t n = c.N * c.C;
    auto hx = rounded<T>(rnd(n, 63, -6.f, 6.f)), hd = rounded<T>(rnd(n, 64));
    std::vector<float> ry(n), rdx(n);
    cpu::softmax_forward(ry.data(), hx.data(), c.N, c.C, nullptr);
    DBuf<T> x(hx), d(hd), y(n), dx(n);
    cu::softmax_forward(y.p, x.p, c.N, c.C, S());
    CHECK_CLOSE(y.get(), ry, t, "softmax");
    auto hy = rounded<T>(ry);
    DBuf<T> yin(hy);
    cpu::softmax_backward(rdx.data(), hd.data(), hy.data(), c.N, c.C, nullptr);
    cu::softmax_backward(dx.p, d.p, yin.p, c.N, c.C, S());
    CHECK_CLOSE(dx.get(), rdx, t, "softmax_backward");
  }
}
