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

TEMPLATE_TEST_CASE("rope: q|k|v rows split and joined in one pass", "[rope]", float, bf16, f16) {
  // rope_qkv_split / rope_qkv_join against the f64 CPU reference. hd / 2 a multiple of the
  // 16-byte vector (8 bf16 / f16, 4 f32) with 16-byte aligned pointers takes the one-pass kernel
  // (N not a multiple of its 8 tokens per block: the last block's tail); the others (hd 6, hd 8
  // in 16-bit types) and a pointer one element off take the two rotations and a 2-D copy.
  // Outputs start poisoned: every element must be written.
  need_gpu();
  using T = TestType;
  const auto t = tol_of<T>();
  struct Case { int64_t N; int H, KV, hd, off; };
  for (Case c : {Case{29, 9, 3, 64, 0}, Case{7, 3, 1, 8, 0}, Case{5, 4, 2, 6, 0}, Case{11, 2, 2, 8, 1},
                  Case{3, 1, 1, 32, 0}, Case{16, 9, 3, 64, 8}}) {
    INFO("N " << c.N << " H " << c.H << " KV " << c.KV << " hd " << c.hd << " pointer offset " << c.off);
    const int64_t qw = int64_t(c.H) * c.hd, kw = int64_t(c.KV) * c.hd, W = qw + 2 * kw;
    auto pos = rnd_int(c.N, 106, 0, 4096);
    auto hx = rounded<T>(rnd(c.N * W, 107)), hq = rounded<T>(rnd(c.N * qw, 108));
    auto hk = rounded<T>(rnd(c.N * kw, 109)), hv = rounded<T>(rnd(c.N * kw, 110));
    auto f64 = [](const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); };
    std::vector<double> rq(c.N * qw), rk(c.N * kw), rv(c.N * kw), rj(c.N * W);
    auto x64 = f64(hx), q64 = f64(hq), k64 = f64(hk), v64 = f64(hv);
    cpu::rope_qkv_split(rq.data(), rk.data(), rv.data(), x64.data(), pos.data(), c.N, c.H, c.KV, c.hd, 100000.0, nullptr);
    cpu::rope_qkv_join(rj.data(), q64.data(), k64.data(), v64.data(), pos.data(), c.N, c.H, c.KV, c.hd, 100000.0,
                       nullptr);
    IBuf dp(pos);
    // each buffer `off` elements into a larger one (off 1: 2-byte / 4-byte misalignment)
    auto padded = [&](const std::vector<float>& v) {
      std::vector<float> p(v.size() + c.off, 0.f);
      std::copy(v.begin(), v.end(), p.begin() + c.off);
      return p;
    };
    DBuf<T> x(padded(hx)), dq(padded(hq)), dk(padded(hk)), dv(padded(hv));
    DBuf<T> q(c.N * qw + c.off), k(c.N * kw + c.off), v(c.N * kw + c.off), j(c.N * W + c.off);
    cu::rope_qkv_split(q.p + c.off, k.p + c.off, v.p + c.off, x.p + c.off, dp.p, c.N, c.H, c.KV, c.hd, 100000.0, S());
    cu::rope_qkv_join(j.p + c.off, dq.p + c.off, dk.p + c.off, dv.p + c.off, dp.p, c.N, c.H, c.KV, c.hd, 100000.0, S());
    auto tail = [&](const std::vector<float>& g) { return std::vector<float>(g.begin() + c.off, g.end()); };
    CHECK_CLOSE(tail(q.get()), rq, t, "rope_qkv_split q");
    CHECK_CLOSE(tail(k.get()), rk, t, "rope_qkv_split k");
    CHECK_CLOSE(tail(v.get()), rv, t, "rope_qkv_split v");
    CHECK_CLOSE(tail(j.get()), rj, t, "rope_qkv_join");
  }
}

TEMPLATE_TEST_CASE("rope: the q|k|v kernel and the row kernels agree bit for bit", "[rope]", float, bf16, f16) {
  // the one-pass kernel (aligned) against the fallback of two row rotations and a 2-D copy (the
  // same buffers one element off): one rounding of the rotation in every kernel (rotate_pair)
  need_gpu();
  using T = TestType;
  const int64_t N = 37;
  const int H = 9, KV = 3, hd = 64;
  const int64_t W = int64_t(H + 2 * KV) * hd, qw = int64_t(H) * hd, kw = int64_t(KV) * hd;
  auto pos = rnd_int(N, 111, 0, 8192);
  IBuf dp(pos);
  auto hx = rounded<T>(rnd(N * W, 112, -4.f, 4.f)), hx1 = hx;
  hx1.insert(hx1.begin(), 0.f);  // the same values one element further on
  DBuf<T> x0(hx), x1(hx1);
  for (bool backward : {false, true}) {
    INFO((backward ? "join" : "split"));
    std::vector<float> got[2];
    for (int off : {0, 1}) {
      DBuf<T>& x = off ? x1 : x0;
      DBuf<T> q(N * qw + 1), k(N * kw + 1), v(N * kw + 1), j(N * W + 1);
      if (!backward) {
        cu::rope_qkv_split(q.p + off, k.p + off, v.p + off, x.p + off, dp.p, N, H, KV, hd, 100000.0, S());
        auto a = q.get(), b = k.get(), c = v.get();
        got[off].assign(a.begin() + off, a.begin() + off + N * qw);
        got[off].insert(got[off].end(), b.begin() + off, b.begin() + off + N * kw);
        got[off].insert(got[off].end(), c.begin() + off, c.begin() + off + N * kw);
      } else {
        // dq, dk, dv: consecutive slices of x
        cu::rope_qkv_join(j.p + off, x.p + off, x.p + off + N * qw, x.p + off + N * (qw + kw), dp.p, N, H, KV, hd,
                          100000.0, S());
        auto a = j.get();
        got[off].assign(a.begin() + off, a.begin() + off + N * W);
      }
    }
    REQUIRE(got[0].size() == got[1].size());
    size_t differ = 0;
    for (size_t i = 0; i < got[0].size(); i++) differ += !(got[0][i] == got[1][i]);
    CHECK(differ == 0);
  }
}
