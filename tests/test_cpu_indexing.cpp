// test_cpu_indexing.cpp: the CPU reference kernels of kernels/cpu/indexing.cpp (embedding, gather /
// scatter / zero rows, patchify, pixel_shuffle, mean_pool, l2norm, argmax) against naive formulas
// and central differences in double (the method: tests/cpu_kernel_test_util.h).
#include <catch2/catch.hpp>

#include "kernels/kernels.h"
#include "tests/tolerances.h"

#include "tests/cpu_kernel_test_util.h"

TEST_CASE("embedding: forward exact, backward gradcheck (+=, repeated ids), bad ids throw", "[indexing]") {
  const int V = 11, C = 5;
  const int64_t N = 17;  // > V: ids repeat
  vector<int32_t> ids = randint(N, 0, V);
  vector<double> table = uniform(int64_t(V) * C), R = uniform(N * C);
  vector<double> out = poisoned<double>(N * C);
  cpu::embedding_forward(out.data(), ids.data(), table.data(), N, C, V, s0);
  int bad = 0;
  for (int64_t n = 0; n < N; n++)
    for (int c = 0; c < C; c++) bad += out[sz(n * C + c)] != table[sz(ids[sz(n)] * C + c)];
  CHECK(bad == 0);
  auto fwd = [&] {
    vector<double> o(sz(N * C));
    cpu::embedding_forward(o.data(), ids.data(), table.data(), N, C, V, s0);
    return o;
  };
  vector<double> dt0 = uniform(int64_t(V) * C), dt = dt0;
  cpu::embedding_backward(dt.data(), R.data(), ids.data(), N, C, V, s0);
  LOOM_CHECK_CLOSE(tol::compare(minus(dt, dt0), numeric_grad(table, R, fwd), tol::kGradcheckF64, "dtable"));

  vector<int32_t> bad_ids = {0, 3, V, 1};
  CHECK_THROWS_AS(cpu::embedding_forward(out.data(), bad_ids.data(), table.data(), 4, C, V, s0),
                  std::out_of_range);
  CHECK_THROWS_WITH(cpu::embedding_forward(out.data(), bad_ids.data(), table.data(), 4, C, V, s0),
                    Catch::Contains("11") && Catch::Contains("position 2"));
  bad_ids[2] = -1;
  CHECK_THROWS_AS(cpu::embedding_backward(dt.data(), R.data(), bad_ids.data(), 4, C, V, s0),
                  std::out_of_range);
}

TEST_CASE("embedding: threaded float backward is deterministic and matches double", "[indexing]") {
  const int V = 50, C = 1030;
  const int64_t N = 300;
  vector<int32_t> ids = randint(N, 0, V);
  vector<double> dy = uniform(N * C);
  vector<float> dyf = cast_vec<float>(dy);
  vector<double> dt(sz(V * C), 0.0);
  vector<float> a(sz(V * C), 0.f), b(sz(V * C), 0.f);
  cpu::embedding_backward(dt.data(), dy.data(), ids.data(), N, C, V, s0);
  cpu::embedding_backward(a.data(), dyf.data(), ids.data(), N, C, V, s0);
  cpu::embedding_backward(b.data(), dyf.data(), ids.data(), N, C, V, s0);
  CHECK(a == b);
  LOOM_CHECK_CLOSE(tol::compare(a, dt, tol::kCpuF32, "dtable f32"));
}

TEST_CASE("gather_rows / scatter_rows / zero_rows: exact", "[indexing]") {
  for (int B : {1, 3}) {
    const int N = 9, K = 4, C = 3;
    vector<double> inp = uniform(int64_t(B) * N * C), src = uniform(int64_t(B) * K * C);
    vector<int32_t> idx;  // distinct within each b (a random permutation prefix)
    for (int b = 0; b < B; b++) {
      vector<int32_t> perm(N);
      for (int i = 0; i < N; i++) perm[sz(i)] = i;
      std::shuffle(perm.begin(), perm.end(), rng());
      idx.insert(idx.end(), perm.begin(), perm.begin() + K);
    }
    vector<double> out = poisoned<double>(int64_t(B) * K * C);
    cpu::gather_rows(out.data(), inp.data(), idx.data(), B, N, K, C, s0);
    int bad = 0;
    for (int b = 0; b < B; b++)
      for (int k = 0; k < K; k++)
        for (int c = 0; c < C; c++)
          bad += out[sz((b * K + k) * C + c)] != inp[sz((b * N + idx[sz(b * K + k)]) * C + c)];
    CHECK(bad == 0);

    // scatter (=): the scattered rows hold src, every other row is untouched
    vector<double> base = uniform(int64_t(B) * N * C), sc = base;
    cpu::scatter_rows(sc.data(), idx.data(), src.data(), B, N, K, C, false, s0);
    vector<double> ref = base;
    for (int b = 0; b < B; b++)
      for (int k = 0; k < K; k++)
        for (int c = 0; c < C; c++)
          ref[sz((b * N + idx[sz(b * K + k)]) * C + c)] = src[sz((b * K + k) * C + c)];
    CHECK(sc == ref);

    // scatter (+=) with repeated indices
    vector<int32_t> rep = randint(int64_t(B) * K, 0, 3);
    vector<double> acc = base;
    cpu::scatter_rows(acc.data(), rep.data(), src.data(), B, N, K, C, true, s0);
    ref = base;
    for (int b = 0; b < B; b++)
      for (int k = 0; k < K; k++)
        for (int c = 0; c < C; c++)
          ref[sz((b * N + rep[sz(b * K + k)]) * C + c)] += src[sz((b * K + k) * C + c)];
    LOOM_CHECK_CLOSE(tol::compare(acc, ref, tol::kSameMathF64, "scatter +="));

    vector<double> z = base;
    cpu::zero_rows(z.data(), idx.data(), B, N, K, C, s0);
    ref = base;
    for (int b = 0; b < B; b++)
      for (int k = 0; k < K; k++)
        for (int c = 0; c < C; c++) ref[sz((b * N + idx[sz(b * K + k)]) * C + c)] = 0;
    CHECK(z == ref);
  }
  vector<int32_t> bad = {0, 9};
  vector<double> inp(27), out(6);
  CHECK_THROWS_AS(cpu::gather_rows(out.data(), inp.data(), bad.data(), 1, 9, 2, 3, s0), std::out_of_range);
}

TEST_CASE("patchify: SPEC layout, H != W, exact inverse, gradcheck", "[indexing]") {
  struct Shape { int B, Ch, H, W, p; };
  for (Shape sh : {Shape{1, 3, 12, 8, 4}, Shape{3, 1, 6, 10, 2}, Shape{2, 3, 4, 4, 1}, Shape{1, 2, 5, 5, 5}}) {
    const int B = sh.B, Ch = sh.Ch, H = sh.H, W = sh.W, p = sh.p;
    const int64_t n = int64_t(B) * Ch * H * W;
    vector<double> img = uniform(n);
    vector<double> out = poisoned<double>(n);
    cpu::patchify(out.data(), img.data(), B, Ch, H, W, p, s0);
    // SPEC §1: element (c, i p + u, j p + v) goes to patch i (W/p) + j, feature (u p + v) Ch + c
    int bad = 0;
    for (int b = 0; b < B; b++)
      for (int c = 0; c < Ch; c++)
        for (int y = 0; y < H; y++)
          for (int x = 0; x < W; x++) {
            const int i = y / p, u = y % p, j = x / p, v = x % p;
            const int64_t patch = int64_t(b) * (H / p) * (W / p) + i * (W / p) + j;
            const int64_t feat = (u * p + v) * Ch + c;
            bad += out[sz(patch * p * p * Ch + feat)] != img[sz(((b * Ch + c) * H + y) * W + x)];
          }
    INFO("B=" << B << " Ch=" << Ch << " H=" << H << " W=" << W << " p=" << p);
    CHECK(bad == 0);
    vector<double> back = poisoned<double>(n);
    cpu::patchify_backward(back.data(), out.data(), B, Ch, H, W, p, s0);
    CHECK(back == img);
    vector<double> R = uniform(n);
    auto fwd = [&] { vector<double> o(sz(n)); cpu::patchify(o.data(), img.data(), B, Ch, H, W, p, s0); return o; };
    vector<double> dimg = poisoned<double>(n);
    cpu::patchify_backward(dimg.data(), R.data(), B, Ch, H, W, p, s0);
    LOOM_CHECK_CLOSE(tol::compare(dimg, numeric_grad(img, R, fwd), tol::kGradcheckF64, "dimg"));
  }
  vector<double> img(3 * 10 * 8), out(3 * 10 * 8);
  CHECK_THROWS_AS(cpu::patchify(out.data(), img.data(), 1, 3, 10, 8, 4, s0), std::invalid_argument);
}

TEST_CASE("pixel_shuffle: reference layout, exact inverse, gradcheck", "[indexing]") {
  const int s = 2;
  struct Shape { int B, G, D; };
  for (Shape sh : {Shape{1, 4, 3}, Shape{3, 6, 5}, Shape{2, 2, 1}}) {
    const int B = sh.B, G = sh.G, D = sh.D, g = G / s;
    const int64_t n = int64_t(B) * G * G * D;
    vector<double> inp = uniform(n), out = poisoned<double>(n);
    cpu::pixel_shuffle(out.data(), inp.data(), B, G, D, s, s0);
    // torch_ref.py: x.view(B, g, s, g, s, D).permute(0, 1, 3, 2, 4, 5).reshape(B, g*g, s*s*D):
    // out index (b, I, J, u, v, d) reads view index (b, I, u, J, v, d)
    int bad = 0;
    for (int b = 0; b < B; b++)
      for (int I = 0; I < g; I++)
        for (int J = 0; J < g; J++)
          for (int u = 0; u < s; u++)
            for (int v = 0; v < s; v++)
              for (int d = 0; d < D; d++) {
                const int64_t o = ((((int64_t(b) * g + I) * g + J) * s + u) * s + v) * D + d;
                const int64_t i = ((((int64_t(b) * g + I) * s + u) * g + J) * s + v) * D + d;
                bad += out[sz(o)] != inp[sz(i)];
              }
    INFO("B=" << B << " G=" << G << " D=" << D);
    CHECK(bad == 0);
    vector<double> back = poisoned<double>(n);
    cpu::pixel_shuffle_backward(back.data(), out.data(), B, G, D, s, s0);
    CHECK(back == inp);
    vector<double> R = uniform(n);
    auto fwd = [&] { vector<double> o(sz(n)); cpu::pixel_shuffle(o.data(), inp.data(), B, G, D, s, s0); return o; };
    vector<double> dinp = poisoned<double>(n);
    cpu::pixel_shuffle_backward(dinp.data(), R.data(), B, G, D, s, s0);
    LOOM_CHECK_CLOSE(tol::compare(dinp, numeric_grad(inp, R, fwd), tol::kGradcheckF64, "dinp"));
  }
  vector<double> x(5 * 5 * 2), y(5 * 5 * 2);
  CHECK_THROWS_AS(cpu::pixel_shuffle(y.data(), x.data(), 1, 5, 2, 2, s0), std::invalid_argument);
}

TEST_CASE("mean_pool: forward naive, backward gradcheck", "[indexing]") {
  struct Shape { int B, K, C; };
  for (Shape sh : {Shape{1, 1, 1}, Shape{3, 7, 5}, Shape{2, 16, 33}}) {
    const int B = sh.B, K = sh.K, C = sh.C;
    vector<double> x = uniform(int64_t(B) * K * C), out = poisoned<double>(int64_t(B) * C),
                   ref(sz(B * C)), R = uniform(int64_t(B) * C);
    cpu::mean_pool_forward(out.data(), x.data(), B, K, C, s0);
    for (int b = 0; b < B; b++)
      for (int c = 0; c < C; c++) {
        long double acc = 0;
        for (int k = 0; k < K; k++) acc += x[sz((b * K + k) * C + c)];
        ref[sz(b * C + c)] = double(acc / K);
      }
    LOOM_CHECK_CLOSE(tol::compare(out, ref, tol::kSameMathF64, "mean_pool"));
    auto fwd = [&] { vector<double> o(sz(B * C)); cpu::mean_pool_forward(o.data(), x.data(), B, K, C, s0); return o; };
    vector<double> dx = poisoned<double>(int64_t(B) * K * C);
    cpu::mean_pool_backward(dx.data(), R.data(), B, K, C, s0);
    LOOM_CHECK_CLOSE(tol::compare(dx, numeric_grad(x, R, fwd), tol::kGradcheckF64, "mean_pool dinp"));
  }
}

TEST_CASE("l2norm: F.normalize semantics, clamped rows, gradcheck", "[indexing]") {
  for (NC sh : {NC{1, 1}, NC{4, 3}, NC{3, 37}, NC{2, 1030}}) {
    const int64_t N = sh.N;
    const int C = sh.C;
    vector<double> x = uniform(N * C, -2, 2), R = uniform(N * C);
    for (double eps : {1e-12, 0.0}) {
      vector<double> out = poisoned<double>(N * C), rn = poisoned<double>(N), ref(sz(N * C)), rref(sz(N));
      cpu::l2norm_forward(out.data(), rn.data(), x.data(), N, C, eps, s0);
      for (int64_t n = 0; n < N; n++) {
        long double ss = 0;
        for (int c = 0; c < C; c++) ss += (long double)x[n * C + c] * x[n * C + c];
        const long double norm = std::max(std::sqrt(ss), (long double)eps);
        for (int c = 0; c < C; c++) ref[sz(n * C + c)] = double(x[n * C + c] / norm);
        rref[sz(n)] = double(1 / norm);
      }
      INFO("N=" << N << " C=" << C);
      LOOM_CHECK_CLOSE(tol::compare(out, ref, tol::kSameMathF64, "l2norm"));
      LOOM_CHECK_CLOSE(tol::compare(rn, rref, tol::kSameMathF64, "rnorm"));
    }
    // gradcheck with some rows clamped: eps = 1 and row 0 scaled to norm ~0.3 (its
    // perturbations stay far from the boundary); other rows have norm > 1
    vector<double> xc = x;
    double ss0 = 0;
    for (int c = 0; c < C; c++) ss0 += xc[sz(c)] * xc[sz(c)];
    for (int c = 0; c < C; c++) xc[sz(c)] *= 0.3 / std::sqrt(ss0);
    for (int64_t n = 1; n < N; n++) {
      double ss = 0;
      for (int c = 0; c < C; c++) ss += xc[sz(n * C + c)] * xc[sz(n * C + c)];
      for (int c = 0; c < C; c++) xc[sz(n * C + c)] *= 2.5 / std::sqrt(ss);
    }
    for (double eps : {1e-12, 1.0}) {
      auto fwd = [&] {
        vector<double> o(sz(N * C)), r(sz(N));
        cpu::l2norm_forward(o.data(), r.data(), xc.data(), N, C, eps, s0);
        return o;
      };
      vector<double> out(sz(N * C)), rn(sz(N)), dx = poisoned<double>(N * C);
      cpu::l2norm_forward(out.data(), rn.data(), xc.data(), N, C, eps, s0);
      cpu::l2norm_backward(dx.data(), R.data(), xc.data(), rn.data(), N, C, s0);
      INFO("N=" << N << " C=" << C << " eps=" << eps);
      LOOM_CHECK_CLOSE(tol::compare(dx, numeric_grad(xc, R, fwd), tol::kGradcheckF64, "l2norm dinp"));
    }
  }
}

TEMPLATE_TEST_CASE("argmax_rows: first maximum wins", "[indexing]", float, double) {
  using T = TestType;
  for (NC sh : {NC{1, 1}, NC{5, 7}, NC{3, 1030}, NC{40, 1030}}) {
    const int64_t N = sh.N;
    const int C = sh.C;
    vector<T> x = cast_vec<T>(uniform(N * C));
    if (C > 3) {
      x[sz(C - 1)] = T(5);  // row 0: a tie at 2 and C-1, the first wins
      x[2] = T(5);
    }
    vector<int32_t> out(sz(N), -7), ref(sz(N));
    cpu::argmax_rows(out.data(), x.data(), N, C, s0);
    for (int64_t n = 0; n < N; n++) {
      int best = 0;
      for (int c = 0; c < C; c++)
        if (x[sz(n * C + c)] > x[sz(n * C + best)]) best = c;
      ref[sz(n)] = best;
    }
    CHECK(out == ref);
  }
}
