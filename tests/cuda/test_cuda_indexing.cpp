// test_cuda_indexing.cpp: kernels/cuda/indexing.cu and embedding_backward.cu (embedding, rows,
// patchify, pixel shuffle, mean pool, l2norm, argmax) against the loom::cpu reference, f32 and
// bf16 (tests/cuda/cuda_kernel_test_util.h). Skipped without a GPU.
//   bash tools/gpu-kernels.sh tests/cuda/test_cuda_indexing.cpp
#include <catch2/catch.hpp>

#include "kernels/kernels.h"
#include "tests/tolerances.h"

#include "tests/cuda/cuda_kernel_test_util.h"

TEMPLATE_TEST_CASE("indexing: embedding forward and deterministic backward", "[indexing]", float, bf16, f16) {
  need_gpu();
  using T = TestType;
  const auto t = tol_of<T>();
  struct Case { int64_t N; int C, V; };
  // V <= 1024 and N <= 24576 take the small-table backward (one block per table row), the rest
  // the sorted one (16-byte columns where C allows: 40, 576, 24; 2-byte ones for C 70 and in
  // the bit comparison below); the N 4099 cases repeat ids in long runs under both
  for (Case c : {Case{1, 1, 1}, Case{37, 33, 11}, Case{500, 64, 7}, Case{2049, 130, 1000}, Case{4099, 70, 300},
                 Case{300, 600, 50}, Case{3000, 40, 5000}, Case{4099, 70, 3000}, Case{4099, 576, 3000},
                 Case{30000, 24, 1000}}) {
    INFO("N " << c.N << " C " << c.C << " V " << c.V);
    auto ids = rnd_int(c.N, 70, 0, c.V);
    if (c.N == 4099) {  // long runs (the image placeholder of a VLM batch): 1500, 200, 65 and 64 repeats
      int at = 0;
      for (auto [id, count] : {std::pair{5, 1500}, std::pair{17, 200}, std::pair{3, 65}, std::pair{9, 64}})
        for (int k = 0; k < count; k++) ids[size_t(at++)] = id;
      std::shuffle(ids.begin(), ids.end(), std::mt19937(71));
    }
    auto ht = rounded<T>(rnd(int64_t(c.V) * c.C, 71)), hd = rounded<T>(rnd(c.N * c.C, 72));
    IBuf di(ids);
    DBuf<T> table(ht), out(c.N * c.C), dout(hd);
    std::vector<float> r(c.N * c.C);
    cpu::embedding_forward(r.data(), ids.data(), ht.data(), c.N, c.C, c.V, nullptr);
    cu::embedding_forward(out.p, di.p, table.p, c.N, c.C, c.V, S());
    CHECK_CLOSE(out.get(), r, t, "embedding_forward");
    {  // on the GPU an id outside [0, V) gives a zero row (the CPU reference throws on it)
      auto bad = ids;
      for (size_t i = 0; i < bad.size(); i += 3) bad[i] = i % 2 ? c.V : -1 - int32_t(i);
      IBuf db(bad);
      std::vector<float> rb(c.N * c.C, 0.f);
      for (int64_t n = 0; n < c.N; n++)
        if (bad[size_t(n)] >= 0 && bad[size_t(n)] < c.V)
          for (int k = 0; k < c.C; k++) rb[size_t(n * c.C + k)] = ht[size_t(int64_t(bad[size_t(n)]) * c.C + k)];
      out.poison();
      cu::embedding_forward(out.p, db.p, table.p, c.N, c.C, c.V, S());
      CHECK_CLOSE(out.get(), rb, t, "embedding_forward, ids outside the table");
    }
    std::vector<float> rdt = ht;  // += into a non-zero table
    cpu::embedding_backward(rdt.data(), hd.data(), ids.data(), c.N, c.C, c.V, nullptr);
    std::vector<float> first;
    for (int rep = 0; rep < 2; rep++) {
      DBuf<T> dt(ht);
      cu::embedding_backward(dt.p, dout.p, di.p, c.N, c.C, c.V, S());
      auto g = dt.get();
      CHECK_CLOSE(g, rdt, t, "embedding_backward");
      if (rep == 0) first = g;
      else CHECK(g == first);
    }
    {  // the sorted backward's 16-byte form adds the same terms in the same order as the 2-byte one
      setenv("LOOM_EMB_BWD", "2", 1);
      DBuf<T> dt(ht);
      cu::embedding_backward(dt.p, dout.p, di.p, c.N, c.C, c.V, S());
      unsetenv("LOOM_EMB_BWD");
      CHECK(dt.get() == first);
    }
  }
}

TEMPLATE_TEST_CASE("indexing: gather, scatter, zero rows; patchify; pixel shuffle; mean pool", "[indexing]", float, bf16, f16) {
  need_gpu();
  using T = TestType;
  const auto t = tol_of<T>();
  // row widths for each word the row kernels move: bf16 C 7 (2-byte words), 6 (4), 4 (8), 40 (16)
  for (int C : {7, 6, 4, 40}) {
    INFO("C " << C);
    const int B = 3, N = 13, K = 5;
    std::vector<int32_t> idx;
    for (int b = 0; b < B; b++) {  // distinct indices per b
      auto perm = rnd_int(N, 80 + b, 0, 1000);
      std::vector<int32_t> order(N);
      for (int i = 0; i < N; i++) order[i] = i;
      std::sort(order.begin(), order.end(), [&](int a, int c) { return perm[a] < perm[c] || (perm[a] == perm[c] && a < c); });
      idx.insert(idx.end(), order.begin(), order.begin() + K);
    }
    auto hin = rounded<T>(rnd(B * N * C, 81)), hsrc = rounded<T>(rnd(B * K * C, 82));
    IBuf di(idx);
    DBuf<T> in(hin), src(hsrc), out(B * K * C);
    std::vector<float> r(B * K * C);
    cpu::gather_rows(r.data(), hin.data(), idx.data(), B, N, K, C, nullptr);
    out.poison();
    cu::gather_rows(out.p, in.p, di.p, B, N, K, C, S());
    CHECK_CLOSE(out.get(), r, t, "gather_rows");
    for (bool acc : {false, true}) {
      std::vector<float> rs = hin;
      cpu::scatter_rows(rs.data(), idx.data(), hsrc.data(), B, N, K, C, acc, nullptr);
      DBuf<T> o(hin);
      cu::scatter_rows(o.p, di.p, src.p, B, N, K, C, acc, S());
      CHECK_CLOSE(o.get(), rs, t, acc ? "scatter_rows +=" : "scatter_rows =");
    }
    {  // repeated indices accumulate
      auto rep = rnd_int(B * K, 83, 0, 3);
      IBuf dr(rep);
      std::vector<float> rs = hin;
      cpu::scatter_rows(rs.data(), rep.data(), hsrc.data(), B, N, K, C, true, nullptr);
      DBuf<T> o(hin);
      cu::scatter_rows(o.p, dr.p, src.p, B, N, K, C, true, S());
      CHECK_CLOSE(o.get(), rs, t, "scatter_rows += repeated");
    }
    std::vector<float> rz = hin;
    cpu::zero_rows(rz.data(), idx.data(), B, N, K, C, nullptr);
    DBuf<T> z(hin);
    cu::zero_rows(z.p, di.p, B, N, K, C, S());
    CHECK_CLOSE(z.get(), rz, t, "zero_rows");
  }
  {
    const int B = 2, Ch = 3, H = 8, W = 12, p = 4;
    const int64_t n = int64_t(B) * Ch * H * W;
    auto himg = rounded<T>(rnd(n, 84));
    DBuf<T> img(himg), out(n), back(n);
    std::vector<float> r(n), rb(n);
    cpu::patchify(r.data(), himg.data(), B, Ch, H, W, p, nullptr);
    cu::patchify(out.p, img.p, B, Ch, H, W, p, S());
    CHECK_CLOSE(out.get(), r, t, "patchify");
    cpu::patchify_backward(rb.data(), r.data(), B, Ch, H, W, p, nullptr);
    cu::patchify_backward(back.p, out.p, B, Ch, H, W, p, S());
    CHECK_CLOSE(back.get(), rb, t, "patchify_backward");
    CHECK(back.get() == himg);
    REQUIRE_THROWS(cu::patchify(out.p, img.p, B, Ch, H, W, 5, S()));
  }
  // 3 channels, patch 16: W 48 takes the kernel with both known at compile time (16-byte
  // words); W 1024 rows are too wide for shared memory (3 x 16 x 1024 elements): the per-element one
  for (int W : {48, 1024}) {
    INFO("patchify, 3 channels, patch 16, W " << W);
    const int B = 2, Ch = 3, H = 32, p = 16;
    const int64_t n = int64_t(B) * Ch * H * W;
    auto himg = rounded<T>(rnd(n, 85 + W));
    DBuf<T> img(himg), out(n);
    std::vector<float> r(n);
    cpu::patchify(r.data(), himg.data(), B, Ch, H, W, p, nullptr);
    out.poison();
    cu::patchify(out.p, img.p, B, Ch, H, W, p, S());
    CHECK_CLOSE(out.get(), r, t, "patchify, 3 channels, patch 16");
  }
  for (int s : {2, 3})
    for (int D : {5, 16}) {
    INFO("s " << s << " D " << D);
    const int B = 2, G = 6;
    const int64_t n = int64_t(B) * G * G * D;
    auto h = rounded<T>(rnd(n, 85));
    DBuf<T> in(h), out(n), back(n);
    std::vector<float> r(n), rb(n);
    cpu::pixel_shuffle(r.data(), h.data(), B, G, D, s, nullptr);
    out.poison();
    cu::pixel_shuffle(out.p, in.p, B, G, D, s, S());
    CHECK_CLOSE(out.get(), r, t, "pixel_shuffle");
    cpu::pixel_shuffle_backward(rb.data(), r.data(), B, G, D, s, nullptr);
    back.poison();
    cu::pixel_shuffle_backward(back.p, out.p, B, G, D, s, S());
    CHECK_CLOSE(back.get(), rb, t, "pixel_shuffle_backward");
  }
  {
    const int B = 3, K = 11, C = 37;
    auto h = rounded<T>(rnd(B * K * C, 86)), hd = rounded<T>(rnd(B * C, 87));
    DBuf<T> in(h), out(B * C), d(hd), dx(B * K * C);
    std::vector<float> r(B * C), rdx(B * K * C);
    cpu::mean_pool_forward(r.data(), h.data(), B, K, C, nullptr);
    cu::mean_pool_forward(out.p, in.p, B, K, C, S());
    CHECK_CLOSE(out.get(), r, t, "mean_pool_forward");
    cpu::mean_pool_backward(rdx.data(), hd.data(), B, K, C, nullptr);
    cu::mean_pool_backward(dx.p, d.p, B, K, C, S());
    CHECK_CLOSE(dx.get(), rdx, t, "mean_pool_backward");
  }
}

TEMPLATE_TEST_CASE("indexing: l2norm forward/backward, argmax", "[indexing]", float, bf16, f16) {
  need_gpu();
  using T = TestType;
  const auto t = tol_of<T>();
  struct Case { int64_t N; int C; };
  for (Case c : {Case{1, 1}, Case{6, 31}, Case{17, 384}}) {
    INFO("N " << c.N << " C " << c.C);
    int64_t n = c.N * c.C;
    auto hx = rounded<T>(rnd(n, 88)), hd = rounded<T>(rnd(n, 89));
    // row 0 tiny: its norm is clamped to eps. f16 takes a larger eps and a less tiny row:
    // its gradient d / eps must stay under f16's 65504 (1e-6 would give ~1e6 = inf) and the
    // row above f16's subnormals.
    const bool half = std::is_same_v<T, f16>;
    const double eps = half ? 1e-2 : 1e-6;
    for (int i = 0; i < c.C; i++) hx[i] = to_f(to_t<T>(hx[i] * (half ? 1e-4f : 1e-9f)));
    DBuf<T> x(hx), d(hd), y(n), dx(n);
    DBuf<float> rn(c.N);
    std::vector<float> ry(n), rr(c.N), rdx(n);
    cpu::l2norm_forward(ry.data(), rr.data(), hx.data(), c.N, c.C, eps, nullptr);
    cu::l2norm_forward(y.p, rn.p, x.p, c.N, c.C, eps, S());
    CHECK_CLOSE(y.get(), ry, t, "l2norm_forward");
    CHECK_CLOSE(rn.get(), rr, t, "rnorm");
    DBuf<float> srn(rr);
    cpu::l2norm_backward(rdx.data(), hd.data(), hx.data(), rr.data(), c.N, c.C, nullptr);
    cu::l2norm_backward(dx.p, d.p, x.p, srn.p, c.N, c.C, S());
    CHECK_CLOSE(dx.get(), rdx, t, "l2norm_backward");
  }
  for (int C : {1, 5, 100, 3000}) {
    const int64_t N = 9;
    // few distinct values so that ties happen: the first index must win
    auto v = rnd_int(N * C, 90 + C, 0, 7);
    std::vector<float> h(v.begin(), v.end());
    DBuf<T> x(h);
    DBuf<int32_t> out(N);
    std::vector<int32_t> r(N);
    cpu::argmax_rows(r.data(), h.data(), N, C, nullptr);
    cu::argmax_rows(reinterpret_cast<int32_t*>(out.p), x.p, N, C, S());
    auto g = out.get();
    for (int64_t i = 0; i < N; i++) CHECK(int(g[i]) == r[i]);
  }
}
