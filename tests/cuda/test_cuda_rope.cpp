// test_cuda_rope.cpp: kernels/cuda/rope.cu (rotary position embedding) against the loom::cpu
// reference, f32 and bf16 (tests/cuda/cuda_kernel_test_util.h). Skipped without a GPU.
//   bash tools/gpu-kernels.sh tests/cuda/test_cuda_rope.cpp
#include <catch2/catch.hpp>

#include "kernels/kernels.h"
#include "tests/tolerances.h"

#include "tests/cuda/cuda_kernel_test_util.h"

TEMPLATE_TEST_CASE("rope: forward and backward against the f64 reference", "[rope]", float, bf16, f16) {
  need_gpu();
  using T = TestType;
  // The CUDA kernel forms the angle in double; the CPU f32 path rounds it in float like the
  // PyTorch reference (~pos * 2^-24 rad), so the f64 CPU path is the reference here.
  const auto t = tol_of<T>();
  struct Case { int64_t N; int H, hd; };
  for (Case c : {Case{1, 1, 2}, Case{13, 3, 8}, Case{29, 9, 64}, Case{5, 2, 130}}) {
    INFO("N " << c.N << " H " << c.H << " hd " << c.hd);
    int64_t n = c.N * c.H * c.hd;
    auto pos = rnd_int(c.N, 100, 0, 4096);
    auto hx = rounded<T>(rnd(n, 101)), hd = rounded<T>(rnd(n, 102));
    std::vector<double> x64(hx.begin(), hx.end()), d64(hd.begin(), hd.end()), r(n), rb(n);
    cpu::rope_forward(r.data(), x64.data(), pos.data(), c.N, c.H, c.hd, 100000.0, nullptr);
    cpu::rope_backward(rb.data(), d64.data(), pos.data(), c.N, c.H, c.hd, 100000.0, nullptr);
    IBuf dp(pos);
    DBuf<T> x(hx), d(hd), o(n), dx(n);
    cu::rope_forward(o.p, x.p, dp.p, c.N, c.H, c.hd, 100000.0, S());
    cu::rope_backward(dx.p, d.p, dp.p, c.N, c.H, c.hd, 100000.0, S());
    CHECK_CLOSE(o.get(), r, t, "rope_forward");
    CHECK_CLOSE(dx.get(), rb, t, "rope_backward");
  }
}

TEMPLATE_TEST_CASE("rope: rows of a joined q|k|v product (row strides)", "[rope]", float, bf16, f16) {
  need_gpu();
  using T = TestType;
  const auto t = tol_of<T>();
  struct Case { int64_t N; int H, hd, ld; };
  // the window of H heads at column `col` of rows `ld` wide; an odd ld takes the scalar kernel
  for (Case c : {Case{7, 3, 8, 40}, Case{29, 9, 64, 960}, Case{5, 2, 8, 33}}) {
    INFO("N " << c.N << " H " << c.H << " hd " << c.hd << " ld " << c.ld);
    const int w = c.H * c.hd, col = c.ld - w;  // the last columns of each row
    const int64_t n = c.N * c.ld;
    auto pos = rnd_int(c.N, 103, 0, 4096);
    auto hx = rounded<T>(rnd(n, 104)), hd = rounded<T>(rnd(c.N * w, 105));
    // reference: the contiguous f64 rope of the window
    std::vector<double> win(size_t(c.N) * w), d64(hd.begin(), hd.end()), r(size_t(c.N) * w), rb(size_t(c.N) * w);
    for (int64_t i = 0; i < c.N; i++)
      for (int j = 0; j < w; j++) win[size_t(i * w + j)] = hx[size_t(i * c.ld + col + j)];
    cpu::rope_forward(r.data(), win.data(), pos.data(), c.N, c.H, c.hd, 100000.0, nullptr);
    cpu::rope_backward(rb.data(), d64.data(), pos.data(), c.N, c.H, c.hd, 100000.0, nullptr);
    IBuf dp(pos);
    DBuf<T> x(hx), d(hd), o(c.N * w), dx(n);
    // forward: read the window (stride ld), write contiguous
    cu::rope_forward_rows(o.p, w, x.p + col, c.ld, dp.p, c.N, c.H, c.hd, 100000.0, S());
    CHECK_CLOSE(o.get(), r, t, "rope_forward_rows");
    // backward: read contiguous, write into the window; the columns outside it stay poisoned
    cu::rope_backward_rows(dx.p + col, c.ld, d.p, w, dp.p, c.N, c.H, c.hd, 100000.0, S());
    auto got = dx.get();
    std::vector<float> in_win(size_t(c.N) * w);
    bool outside_untouched = true;
    for (int64_t i = 0; i < c.N; i++)
      for (int j = 0; j < c.ld; j++) {
        float v = got[size_t(i * c.ld + j)];
        if (j >= col) in_win[size_t(i * w + j - col)] = v;
        else outside_untouched &= std::isnan(v);
      }
    CHECK(outside_untouched);
    CHECK_CLOSE(in_win, rb, t, "rope_backward_rows");
  }
}
