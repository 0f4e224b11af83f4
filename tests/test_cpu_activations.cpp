// test_cpu_activations.cpp: the CPU reference kernels of kernels/cpu/activations.cpp (gelu, silu,
// swiglu, softmax) against naive formulas and central differences in double (the method:
// tests/cpu_kernel_test_util.h).
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <random>

#include "kernels/cpu/vec_exp.h"
#include "kernels/kernels.h"
#include "tests/tolerances.h"

#include "tests/cpu_kernel_test_util.h"

namespace {
long double naive_gelu(long double x) {
  const long double k = std::sqrt(2.0L / 3.14159265358979323846264338327950288L);
  return 0.5L * x * (1 + std::tanh(k * (x + 0.044715L * x * x * x)));
}
long double naive_silu(long double x) { return x / (1 + std::exp(-x)); }

vector<double> activation_inputs(int64_t n) {
  vector<double> x = uniform(n, -4, 4);
  if (n > 4) { x[0] = -12; x[1] = 12; x[2] = 0; x[3] = -30; }  // saturated tails and zero
  return x;
}
}  // namespace

// exp_f32 (vec_exp.h), the exp of the f32 kernels: within 1.25 ulp of the exact value at fresh random
// points over the whole range of normal results and at the ends of that range, 0 below it, +inf
// above it, NaN through.
TEST_CASE("exp_f32 within 1.25 ulp of exp, NaN kept, ends of the range", "[activations]") {
  const uint64_t seed = std::random_device{}();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> wide(-87.33f, 88.72f), narrow(-1.f, 1.f);
  double worst = 0;
  float worst_at = 0;
  auto check = [&](float x) {
    const double e = std::exp(double(x));
    const double ulp = std::ldexp(1.0, std::ilogb(e) - 23);  // the spacing of floats at e
    const double err = std::fabs(double(cpu::exp_f32(x)) - e) / ulp;
    if (err > worst) worst = err, worst_at = x;
  };
  for (int i = 0; i < 200000; i++) check(wide(rng));
  for (int i = 0; i < 20000; i++) check(narrow(rng));  // r near 0, n in -2..1
  for (float x : {0.f, -0.f, 1.f, -1.f, 0.34657359f, -0.34657359f, 88.3762626f, 88.72f, -87.33f, -86.9f})
    check(x);
  INFO("worst " << worst << " ulp at x = " << worst_at);
  // 0.94 ulp at worst with FMA-fused Horner steps (the -march=native build), 1.22 without
  // (portable and sanitizer builds): vec_exp.h
  CHECK(worst <= 1.25);
  CHECK(cpu::exp_f32(0.f) == 1.f);
  CHECK(cpu::exp_f32(-88.f) == 0.f);  // under FLT_MIN: 0 (std::exp: a denormal)
  CHECK(cpu::exp_f32(-std::numeric_limits<float>::infinity()) == 0.f);
  CHECK(std::isinf(cpu::exp_f32(88.73f)));
  CHECK(std::isinf(cpu::exp_f32(std::numeric_limits<float>::infinity())));
  CHECK(std::isnan(cpu::exp_f32(std::numeric_limits<float>::quiet_NaN())));
  CHECK(cpu::exp_acc(0.5) == std::exp(0.5));  // double: the C library's
}

TEST_CASE("gelu / silu forward against naive formulas", "[activations]") {
  for (int64_t n : {1, 7, 1001, 40000}) {
    vector<double> x = activation_inputs(n);
    vector<double> g = poisoned<double>(n), sl = poisoned<double>(n), rg(sz(n)), rs(sz(n));
    cpu::gelu_forward(g.data(), x.data(), n, s0);
    cpu::silu_forward(sl.data(), x.data(), n, s0);
    for (int64_t i = 0; i < n; i++) {
      rg[sz(i)] = double(naive_gelu(x[sz(i)]));
      rs[sz(i)] = double(naive_silu(x[sz(i)]));
    }
    LOOM_CHECK_CLOSE(tol::compare(g, rg, tol::kSameMathF64, "gelu"));
    LOOM_CHECK_CLOSE(tol::compare(sl, rs, tol::kSameMathF64, "silu"));
    vector<float> xf = cast_vec<float>(x), gf = poisoned<float>(n), sf = poisoned<float>(n);
    cpu::gelu_forward(gf.data(), xf.data(), n, s0);
    cpu::silu_forward(sf.data(), xf.data(), n, s0);
    LOOM_CHECK_CLOSE(tol::compare(gf, rg, tol::kCpuF32, "gelu f32"));
    LOOM_CHECK_CLOSE(tol::compare(sf, rs, tol::kCpuF32, "silu f32"));
  }
}

TEST_CASE("gelu / silu / swiglu backward: gradcheck", "[activations]") {
  const int64_t n = 301;
  vector<double> x = activation_inputs(n), up = uniform(n, -2, 2), R = uniform(n);
  auto gelu = [&] { vector<double> o(sz(n)); cpu::gelu_forward(o.data(), x.data(), n, s0); return o; };
  auto silu = [&] { vector<double> o(sz(n)); cpu::silu_forward(o.data(), x.data(), n, s0); return o; };
  auto swiglu = [&] {
    vector<double> o(sz(n));
    cpu::swiglu_forward(o.data(), x.data(), up.data(), n, s0);
    return o;
  };
  vector<double> d = poisoned<double>(n);
  cpu::gelu_backward(d.data(), R.data(), x.data(), n, s0);
  LOOM_CHECK_CLOSE(tol::compare(d, numeric_grad(x, R, gelu), tol::kGradcheckF64, "gelu dinp"));
  d = poisoned<double>(n);
  cpu::silu_backward(d.data(), R.data(), x.data(), n, s0);
  LOOM_CHECK_CLOSE(tol::compare(d, numeric_grad(x, R, silu), tol::kGradcheckF64, "silu dinp"));
  vector<double> dg = poisoned<double>(n), du = poisoned<double>(n);
  cpu::swiglu_backward(dg.data(), du.data(), R.data(), x.data(), up.data(), n, s0);
  LOOM_CHECK_CLOSE(tol::compare(dg, numeric_grad(x, R, swiglu), tol::kGradcheckF64, "swiglu dgate"));
  LOOM_CHECK_CLOSE(tol::compare(du, numeric_grad(up, R, swiglu), tol::kGradcheckF64, "swiglu dup"));
  // the fused backward + product: dgate / dup / prod bit for bit those of the separate calls
  vector<double> dg2 = poisoned<double>(n), du2 = poisoned<double>(n), pr = poisoned<double>(n);
  cpu::swiglu_backward_product(dg2.data(), du2.data(), pr.data(), R.data(), x.data(), up.data(), n, s0);
  CHECK(dg2 == dg);
  CHECK(du2 == du);
  CHECK(pr == swiglu());
  // swiglu forward against the naive product
  vector<double> o = swiglu(), ro(sz(n));
  for (int64_t i = 0; i < n; i++) ro[sz(i)] = double(naive_silu(x[sz(i)]) * up[sz(i)]);
  LOOM_CHECK_CLOSE(tol::compare(o, ro, tol::kSameMathF64, "swiglu"));
}

TEST_CASE("activations: float backward against double", "[activations]") {
  const int64_t n = 40001;  // threaded
  vector<double> x = activation_inputs(n), up = uniform(n), dy = uniform(n);
  vector<float> xf = cast_vec<float>(x), upf = cast_vec<float>(up), dyf = cast_vec<float>(dy);
  vector<double> a(sz(n)), b(sz(n));
  vector<float> af = poisoned<float>(n), bf = poisoned<float>(n);
  cpu::gelu_backward(a.data(), dy.data(), x.data(), n, s0);
  cpu::gelu_backward(af.data(), dyf.data(), xf.data(), n, s0);
  LOOM_CHECK_CLOSE(tol::compare(af, a, tol::kCpuF32, "gelu_backward f32"));
  cpu::silu_backward(a.data(), dy.data(), x.data(), n, s0);
  cpu::silu_backward(af.data(), dyf.data(), xf.data(), n, s0);
  LOOM_CHECK_CLOSE(tol::compare(af, a, tol::kCpuF32, "silu_backward f32"));
  cpu::swiglu_backward(a.data(), b.data(), dy.data(), x.data(), up.data(), n, s0);
  cpu::swiglu_backward(af.data(), bf.data(), dyf.data(), xf.data(), upf.data(), n, s0);
  LOOM_CHECK_CLOSE(tol::compare(af, a, tol::kCpuF32, "swiglu dgate f32"));
  LOOM_CHECK_CLOSE(tol::compare(bf, b, tol::kCpuF32, "swiglu dup f32"));
}

TEST_CASE("softmax: stable forward, gradcheck backward", "[activations]") {
  for (NC sh : {NC{1, 1}, NC{3, 5}, NC{4, 33}, NC{2, 1030}, NC{40, 1030}}) {
    const int64_t N = sh.N;
    const int C = sh.C;
    vector<double> x = uniform(N * C, -5, 5);
    for (int c = 0; c < C; c++) x[sz(c)] += 1000;  // row 0 would overflow a naive exp
    vector<double> y = poisoned<double>(N * C), ref(sz(N * C));
    cpu::softmax_forward(y.data(), x.data(), N, C, s0);
    for (int64_t n = 0; n < N; n++) {
      long double mx = -INFINITY, sum = 0;
      for (int c = 0; c < C; c++) mx = std::max(mx, (long double)x[n * C + c]);
      for (int c = 0; c < C; c++) sum += std::exp(x[n * C + c] - mx);
      for (int c = 0; c < C; c++) ref[sz(n * C + c)] = double(std::exp(x[n * C + c] - mx) / sum);
    }
    INFO("N=" << N << " C=" << C);
    LOOM_CHECK_CLOSE(tol::compare(y, ref, tol::kSameMathF64, "softmax"));
    vector<float> xf = cast_vec<float>(x), yf = poisoned<float>(N * C);
    cpu::softmax_forward(yf.data(), xf.data(), N, C, s0);
    vector<double> ref_f(sz(N * C));  // the float input rounds x by up to 6e-5 at 1000
    for (int64_t n = 0; n < N; n++) {
      long double mx = -INFINITY, sum = 0;
      for (int c = 0; c < C; c++) mx = std::max(mx, (long double)xf[n * C + c]);
      for (int c = 0; c < C; c++) sum += std::exp(xf[n * C + c] - mx);
      for (int c = 0; c < C; c++) ref_f[sz(n * C + c)] = double(std::exp(xf[n * C + c] - mx) / sum);
    }
    LOOM_CHECK_CLOSE(tol::compare(yf, ref_f, tol::kCpuF32, "softmax f32"));
    if (N * C > 5000) continue;  // the gradcheck below is O((NC)^2)
    vector<double> R = uniform(N * C);
    auto fwd = [&] { vector<double> o(sz(N * C)); cpu::softmax_forward(o.data(), x.data(), N, C, s0); return o; };
    vector<double> dx = poisoned<double>(N * C);
    cpu::softmax_backward(dx.data(), R.data(), y.data(), N, C, s0);
    LOOM_CHECK_CLOSE(tol::compare(dx, numeric_grad(x, R, fwd), tol::kGradcheckF64, "softmax dinp"));
  }
}
