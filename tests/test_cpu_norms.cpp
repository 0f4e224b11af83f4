// test_cpu_norms.cpp: the CPU reference kernels of kernels/cpu/norms.cpp (layernorm and rmsnorm (+
// residual), forward and backward) against naive formulas and central differences in double (the
// method: tests/cpu_kernel_test_util.h).
#include <catch2/catch.hpp>

#include "kernels/cpu/parallel.h"
#include "kernels/kernels.h"
#include "tests/tolerances.h"

#include "tests/cpu_kernel_test_util.h"

// no dresid: a null pointer of the vector's element type (the kernels deduce T from it)
template <class V> static const typename V::value_type* none(const V&) { return nullptr; }

namespace {
const NC kNormShapes[] = {{1, 1}, {3, 3}, {5, 37}, {1, 64}, {3, 1030}};

// naive LayerNorm in long double with the one-pass variance (a different formula from the
// kernel's two-pass one)
void naive_layernorm(vector<double>& out, vector<double>& mean, vector<double>& rstd,
                     const vector<double>& x, const vector<double>& w, const double* b, int64_t N,
                     int C, double eps) {
  for (int64_t n = 0; n < N; n++) {
    long double s = 0, ss = 0;
    for (int c = 0; c < C; c++) {
      s += x[n * C + c];
      ss += (long double)x[n * C + c] * x[n * C + c];
    }
    const long double mu = s / C, var = ss / C - mu * mu, r = 1 / std::sqrt(var + eps);
    for (int c = 0; c < C; c++)
      out[n * C + c] = double((x[n * C + c] - mu) * r * w[c] + (b ? b[c] : 0.0));
    mean[n] = double(mu);
    rstd[n] = double(r);
  }
}
}  // namespace

TEST_CASE("layernorm_forward against a naive formula; mean/rstd saved", "[norms]") {
  for (NC sh : kNormShapes) {
    for (bool with_bias : {true, false}) {
      const int64_t N = sh.N;
      const int C = sh.C;
      vector<double> x = uniform(N * C, -2, 3), w = uniform(C), b = uniform(C);
      vector<double> out = poisoned<double>(N * C), mean = poisoned<double>(N), rstd = poisoned<double>(N);
      vector<double> ro(sz(N * C)), rm(sz(N)), rr(sz(N));
      cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(),
                             with_bias ? b.data() : nullptr, N, C, 1e-6, s0);
      naive_layernorm(ro, rm, rr, x, w, with_bias ? b.data() : nullptr, N, C, 1e-6);
      INFO("N=" << N << " C=" << C << " bias=" << with_bias);
      // the naive one-pass variance loses ~1e-16 * mean^2 / var relative: allow 1e-10
      LOOM_CHECK_CLOSE(tol::compare(out, ro, tol::kSameMathF64, "out"));
      LOOM_CHECK_CLOSE(tol::compare(mean, rm, tol::kSameMathF64, "mean"));
      LOOM_CHECK_CLOSE(tol::compare(rstd, rr, tol::kSameMathF64, "rstd"));
    }
  }
}

TEST_CASE("layernorm_backward: gradcheck of inp, weight, bias (+=)", "[norms]") {
  for (NC sh : kNormShapes) {
    for (bool with_bias : {true, false}) {
      const int64_t N = sh.N;
      const int C = sh.C;
      vector<double> x = uniform(N * C, -2, 3), w = uniform(C), b = uniform(C), R = uniform(N * C);
      auto fwd = [&] {
        vector<double> out(sz(N * C)), m(sz(N)), r(sz(N));
        cpu::layernorm_forward(out.data(), m.data(), r.data(), x.data(), w.data(),
                               with_bias ? b.data() : nullptr, N, C, 1e-6, s0);
        return out;
      };
      vector<double> out(sz(N * C)), mean(sz(N)), rstd(sz(N));
      cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(),
                             with_bias ? b.data() : nullptr, N, C, 1e-6, s0);
      vector<double> dx = poisoned<double>(N * C), dw0 = uniform(C), db0 = uniform(C);
      vector<double> dw = dw0, db = db0;
      cpu::layernorm_backward(dx.data(), none(dx), dw.data(), with_bias ? db.data() : nullptr, R.data(),
                              x.data(), w.data(), mean.data(), rstd.data(), N, C, s0);
      INFO("N=" << N << " C=" << C << " bias=" << with_bias);
      LOOM_CHECK_CLOSE(tol::compare(dx, numeric_grad(x, R, fwd), tol::kGradcheckF64, "dinp"));
      LOOM_CHECK_CLOSE(tol::compare(minus(dw, dw0), numeric_grad(w, R, fwd), tol::kGradcheckF64, "dweight"));
      if (with_bias)
        LOOM_CHECK_CLOSE(tol::compare(minus(db, db0), numeric_grad(b, R, fwd), tol::kGradcheckF64, "dbias"));
      else
        CHECK(db == db0);
    }
  }
}

TEST_CASE("residual_layernorm_forward = add, then layernorm_forward", "[norms]") {
  for (NC sh : kNormShapes) {
    const int64_t N = sh.N;
    const int C = sh.C;
    vector<double> resid = uniform(N * C), x = uniform(N * C), w = uniform(C), b = uniform(C);
    vector<double> ro = poisoned<double>(N * C), out = poisoned<double>(N * C);
    vector<double> mean = poisoned<double>(N), rstd = poisoned<double>(N);
    cpu::residual_layernorm_forward(ro.data(), out.data(), mean.data(), rstd.data(), resid.data(),
                                    x.data(), w.data(), b.data(), N, C, 1e-6, s0);
    vector<double> sum(sz(N * C));
    for (size_t i = 0; i < sum.size(); i++) sum[i] = resid[i] + x[i];
    vector<double> out2(sz(N * C)), m2(sz(N)), r2(sz(N));
    cpu::layernorm_forward(out2.data(), m2.data(), r2.data(), sum.data(), w.data(), b.data(), N, C, 1e-6, s0);
    CHECK(ro == sum);
    CHECK(out == out2);
    CHECK(mean == m2);
    CHECK(rstd == r2);
  }
}

TEST_CASE("rmsnorm_forward against a naive formula; rstd saved", "[norms]") {
  for (NC sh : kNormShapes) {
    const int64_t N = sh.N;
    const int C = sh.C;
    vector<double> x = uniform(N * C, -2, 3), w = uniform(C);
    vector<double> out = poisoned<double>(N * C), rstd = poisoned<double>(N);
    vector<double> ro(sz(N * C)), rr(sz(N));
    cpu::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5, s0);
    for (int64_t n = 0; n < N; n++) {
      long double ss = 0;
      for (int c = 0; c < C; c++) ss += (long double)x[n * C + c] * x[n * C + c];
      const long double r = 1 / std::sqrt(ss / C + 1e-5L);
      for (int c = 0; c < C; c++) ro[sz(n * C + c)] = double(x[n * C + c] * r * w[c]);
      rr[sz(n)] = double(r);
    }
    INFO("N=" << N << " C=" << C);
    LOOM_CHECK_CLOSE(tol::compare(out, ro, tol::kSameMathF64, "out"));
    LOOM_CHECK_CLOSE(tol::compare(rstd, rr, tol::kSameMathF64, "rstd"));
  }
}

TEST_CASE("rmsnorm_backward: gradcheck of inp and weight (+=)", "[norms]") {
  for (NC sh : kNormShapes) {
    const int64_t N = sh.N;
    const int C = sh.C;
    vector<double> x = uniform(N * C, -2, 3), w = uniform(C), R = uniform(N * C);
    auto fwd = [&] {
      vector<double> out(sz(N * C)), r(sz(N));
      cpu::rmsnorm_forward(out.data(), r.data(), x.data(), w.data(), N, C, 1e-5, s0);
      return out;
    };
    vector<double> out(sz(N * C)), rstd(sz(N));
    cpu::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5, s0);
    vector<double> dx = poisoned<double>(N * C), dw0 = uniform(C), dw = dw0;
    cpu::rmsnorm_backward(dx.data(), none(dx), dw.data(), R.data(), x.data(), w.data(), rstd.data(), N, C, s0);
    INFO("N=" << N << " C=" << C);
    LOOM_CHECK_CLOSE(tol::compare(dx, numeric_grad(x, R, fwd), tol::kGradcheckF64, "dinp"));
    LOOM_CHECK_CLOSE(tol::compare(minus(dw, dw0), numeric_grad(w, R, fwd), tol::kGradcheckF64, "dweight"));
  }
}

TEST_CASE("residual_rmsnorm_forward = add, then rmsnorm_forward", "[norms]") {
  for (NC sh : kNormShapes) {
    const int64_t N = sh.N;
    const int C = sh.C;
    vector<double> resid = uniform(N * C), x = uniform(N * C), w = uniform(C);
    vector<double> ro = poisoned<double>(N * C), out = poisoned<double>(N * C), rstd = poisoned<double>(N);
    cpu::residual_rmsnorm_forward(ro.data(), out.data(), rstd.data(), resid.data(), x.data(),
                                  w.data(), N, C, 1e-5, s0);
    vector<double> sum(sz(N * C));
    for (size_t i = 0; i < sum.size(); i++) sum[i] = resid[i] + x[i];
    vector<double> out2(sz(N * C)), r2(sz(N));
    cpu::rmsnorm_forward(out2.data(), r2.data(), sum.data(), w.data(), N, C, 1e-5, s0);
    CHECK(ro == sum);
    CHECK(out == out2);
    CHECK(rstd == r2);
  }
}

TEST_CASE("norms: float against double, large enough to take the threaded paths", "[norms]") {
  const int64_t N = 41;
  const int C = 1030;  // N*C > 32768: rows and row splits run on threads
  vector<double> x = uniform(N * C, -2, 3), w = uniform(C), b = uniform(C), dy = uniform(N * C);
  vector<float> xf = cast_vec<float>(x), wf = cast_vec<float>(w), bf = cast_vec<float>(b),
                dyf = cast_vec<float>(dy);
  vector<double> out(sz(N * C)), mean(sz(N)), rstd(sz(N)), dx(sz(N * C)),
      dw(sz(C), 0.0), db(sz(C), 0.0);
  vector<float> outf = poisoned<float>(N * C), meanf = poisoned<float>(N), rstdf = poisoned<float>(N),
                dxf = poisoned<float>(N * C), dwf(sz(C), 0.f), dbf(sz(C), 0.f);
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, 1e-6, s0);
  cpu::layernorm_forward(outf.data(), meanf.data(), rstdf.data(), xf.data(), wf.data(), bf.data(), N, C, 1e-6, s0);
  cpu::layernorm_backward(dx.data(), none(dx), dw.data(), db.data(), dy.data(), x.data(), w.data(), mean.data(),
                          rstd.data(), N, C, s0);
  cpu::layernorm_backward(dxf.data(), none(dxf), dwf.data(), dbf.data(), dyf.data(), xf.data(), wf.data(),
                          meanf.data(), rstdf.data(), N, C, s0);
  LOOM_CHECK_CLOSE(tol::compare(outf, out, tol::kCpuF32, "layernorm out f32"));
  LOOM_CHECK_CLOSE(tol::compare(dxf, dx, tol::kCpuF32, "layernorm dinp f32"));
  LOOM_CHECK_CLOSE(tol::compare(dwf, dw, tol::kCpuF32, "layernorm dweight f32"));
  LOOM_CHECK_CLOSE(tol::compare(dbf, db, tol::kCpuF32, "layernorm dbias f32"));
  // and the threaded double path against the naive formula
  vector<double> ro(sz(N * C)), rm(sz(N)), rr(sz(N));
  naive_layernorm(ro, rm, rr, x, w, b.data(), N, C, 1e-6);
  LOOM_CHECK_CLOSE(tol::compare(out, ro, tol::kSameMathF64, "layernorm threaded f64"));

  vector<double> rs(sz(N)), dw2(sz(C), 0.0);
  vector<float> rsf = poisoned<float>(N), dw2f(sz(C), 0.f);
  cpu::rmsnorm_forward(out.data(), rs.data(), x.data(), w.data(), N, C, 1e-5, s0);
  cpu::rmsnorm_forward(outf.data(), rsf.data(), xf.data(), wf.data(), N, C, 1e-5, s0);
  cpu::rmsnorm_backward(dx.data(), none(dx), dw2.data(), dy.data(), x.data(), w.data(), rs.data(), N, C, s0);
  cpu::rmsnorm_backward(dxf.data(), none(dxf), dw2f.data(), dyf.data(), xf.data(), wf.data(), rsf.data(), N, C, s0);
  LOOM_CHECK_CLOSE(tol::compare(outf, out, tol::kCpuF32, "rmsnorm out f32"));
  LOOM_CHECK_CLOSE(tol::compare(dxf, dx, tol::kCpuF32, "rmsnorm dinp f32"));
  LOOM_CHECK_CLOSE(tol::compare(dw2f, dw2, tol::kCpuF32, "rmsnorm dweight f32"));
}

TEST_CASE("norms: the backward's dresid is the norm's dinp followed by an add, bit for bit", "[norms]") {
  // add_layernorm / add_rmsnorm pass the residual stream's gradient as dresid instead of adding
  // it in a second pass: the result must be what that second pass gave (f32 and f64, fresh data)
  const int64_t N = 37;
  const int C = 1030;  // threaded paths
  auto run = [&](auto zero) {
    using T = decltype(zero);
    const uint32_t seed = uint32_t(std::random_device{}());
    INFO("seed " << seed);
    std::mt19937 g(seed);
    std::uniform_real_distribution<double> u(-2.0, 2.0);
    auto fill = [&](int64_t n) {
      vector<T> v(sz(n));
      for (auto& e : v) e = T(u(g));
      return v;
    };
    vector<T> x = fill(N * C), w = fill(C), b = fill(C), dy = fill(N * C), res = fill(N * C);
    vector<T> out(sz(N * C)), mean(sz(N)), rstd(sz(N));
    for (bool rms : {false, true}) {
      vector<T> two = poisoned<T>(N * C), one = poisoned<T>(N * C), dw1(sz(C), T(0)), dw2(sz(C), T(0)),
                db1(sz(C), T(0)), db2(sz(C), T(0));
      if (rms) {
        cpu::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5, s0);
        cpu::rmsnorm_backward(two.data(), none(two), dw2.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C, s0);
        cpu::rmsnorm_backward(one.data(), res.data(), dw1.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C, s0);
      } else {
        cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, 1e-6, s0);
        cpu::layernorm_backward(two.data(), none(two), dw2.data(), db2.data(), dy.data(), x.data(), w.data(),
                                mean.data(), rstd.data(), N, C, s0);
        cpu::layernorm_backward(one.data(), res.data(), dw1.data(), db1.data(), dy.data(), x.data(), w.data(),
                                mean.data(), rstd.data(), N, C, s0);
      }
      cpu::axpby(two.data(), two.data(), 1.0, res.data(), 1.0, N * C, s0);  // the second pass
      CHECK(one == two);
      CHECK(dw1 == dw2);
      CHECK(db1 == db2);
    }
  };
  run(0.f);
  run(0.0);
}

TEST_CASE("norms: the same bits on 1, 2 and 3 threads", "[norms]") {
  // the row sums (eight lanes, a tail of 6 at C 70) and the parameter gradients' row splits
  // (11 at N 700) are cut by the sizes, never by the thread count
  const int64_t N = 700;
  const int C = 70;  // N*C > 32768: threaded
  vector<double> xd = uniform(N * C, -2, 3), wd = uniform(C), bd = uniform(C), dyd = uniform(N * C), rd = uniform(N * C);
  const vector<float> x = cast_vec<float>(xd), w = cast_vec<float>(wd), b = cast_vec<float>(bd), dy = cast_vec<float>(dyd),
                      res = cast_vec<float>(rd);
  auto run = [&](int threads) {
    const int before = cpu::num_threads();
    cpu::set_num_threads(threads);
    vector<float> out = poisoned<float>(N * C), mean = poisoned<float>(N), rstd = poisoned<float>(N),
                  dx = poisoned<float>(N * C), dw(sz(C), 0.f), db(sz(C), 0.f), rout = poisoned<float>(N * C),
                  rr = poisoned<float>(N), rdx = poisoned<float>(N * C), rdw(sz(C), 0.f);
    cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, 1e-6, s0);
    cpu::layernorm_backward(dx.data(), res.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), mean.data(),
                            rstd.data(), N, C, s0);
    cpu::rmsnorm_forward(rout.data(), rr.data(), x.data(), w.data(), N, C, 1e-5, s0);
    cpu::rmsnorm_backward(rdx.data(), none(rdx), rdw.data(), dy.data(), x.data(), w.data(), rr.data(), N, C, s0);
    cpu::set_num_threads(before);
    return vector<vector<float>>{out, mean, rstd, dx, dw, db, rout, rr, rdx, rdw};
  };
  const auto one = run(1);
  for (int threads : {2, 3}) {
    INFO(threads << " threads");
    CHECK(run(threads) == one);
  }
}
