// test_cpu_cross_entropy.cpp: kernels/cpu/cross_entropy.cpp (cross-entropy and the fused linear
// cross-entropy) against naive formulas written here, and its gradients against central differences
// in double (tests/cpu_loss_test_util.h).
#include <catch2/catch.hpp>

#include "kernels/kernels.h"
#include "tests/tolerances.h"

#include "tests/cpu_loss_test_util.h"

namespace {

// mean over rows with target >= 0 of (logsumexp(x_n) - x_n,y), 0 when there are none
double naive_ce(const vector<double>& x, const vector<int32_t>& y, int64_t N, int V) {
  double sum = 0;
  int64_t count = 0;
  for (int64_t n = 0; n < N; n++) {
    if (y[n] < 0) continue;
    double m = -kInf, l = 0;
    for (int j = 0; j < V; j++) m = std::max(m, x[n * V + j]);
    for (int j = 0; j < V; j++) l += std::exp(x[n * V + j] - m);
    sum += m + std::log(l) - x[n * V + y[n]];
    count++;
  }
  return count ? sum / double(count) : 0.0;
}

vector<int32_t> random_targets(int64_t N, int V, uint64_t seed, double p_ignore) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> cls(0, V - 1);
  std::uniform_real_distribution<double> u(0, 1);
  vector<int32_t> y(N);
  for (auto& t : y) t = u(gen) < p_ignore ? -100 : cls(gen);
  return y;
}

// logits [N,V] = h [N,D] W[V,D]^T
vector<double> naive_linear(const vector<double>& h, const vector<double>& W, int64_t N, int V, int D) {
  vector<double> x(N * V, 0.0);
  for (int64_t n = 0; n < N; n++)
    for (int j = 0; j < V; j++)
      for (int d = 0; d < D; d++) x[n * V + j] += h[n * D + d] * W[j * D + d];
  return x;
}

}  // namespace

TEST_CASE("cross_entropy forward/backward match naive math and central differences", "[cpu][loss]") {
  const int64_t N = 13;
  const int V = 37;
  auto x = randn(N * V, 300, 3.0);
  const auto y = random_targets(N, V, 301, 0.3);
  REQUIRE(std::count(y.begin(), y.end(), -100) > 0);
  REQUIRE(std::count(y.begin(), y.end(), -100) < N);

  double loss = kNaN;
  auto lse = poisoned<double>(N);
  cpu::cross_entropy_forward<double>(&loss, lse.data(), x.data(), y.data(), N, V, s0);
  const double ref = naive_ce(x, y, N, V);
  LOOM_CHECK_CLOSE(tol::compare(&loss, &ref, 1, tol::kSameMathF64, "ce loss f64"));

  const double dloss = 0.7;
  auto dx = poisoned<double>(N * V);
  cpu::cross_entropy_backward<double>(dx.data(), &dloss, x.data(), lse.data(), y.data(), N, V, s0);
  auto ng = numeric_grad([&] { return dloss * naive_ce(x, y, N, V); }, x);
  LOOM_CHECK_CLOSE(tol::compare(dx, ng, tol::kGradcheckF64, "ce dlogits f64"));
  for (int64_t n = 0; n < N; n++)
    if (y[n] < 0)
      for (int j = 0; j < V; j++) REQUIRE(dx[n * V + j] == 0.0);

  // f32 against the f64 result
  const auto x32 = cast<float>(x);
  float loss32 = NAN, dloss32 = 0.7f;
  auto lse32 = poisoned<float>(N);
  auto dx32 = poisoned<float>(N * V);
  cpu::cross_entropy_forward<float>(&loss32, lse32.data(), x32.data(), y.data(), N, V, s0);
  cpu::cross_entropy_backward<float>(dx32.data(), &dloss32, x32.data(), lse32.data(), y.data(), N, V, s0);
  LOOM_CHECK_CLOSE(tol::compare(&loss32, &ref, 1, tol::kCpuF32, "ce loss f32"));
  LOOM_CHECK_CLOSE(tol::compare(dx32, dx, tol::kCpuF32, "ce dlogits f32"));
}

TEST_CASE("cross_entropy: all-ignored batch gives 0; target >= V throws naming row and value", "[cpu][loss]") {
  const int64_t N = 5;
  const int V = 11;
  const auto x = randn(N * V, 310);
  vector<int32_t> y(N, -100);
  double loss = kNaN, dloss = 1.0;
  auto lse = poisoned<double>(N);
  auto dx = poisoned<double>(N * V);
  cpu::cross_entropy_forward<double>(&loss, lse.data(), x.data(), y.data(), N, V, s0);
  cpu::cross_entropy_backward<double>(dx.data(), &dloss, x.data(), lse.data(), y.data(), N, V, s0);
  CHECK(loss == 0.0);
  for (double g : dx) REQUIRE(g == 0.0);

  y[3] = V;  // row 3, value 11
  REQUIRE_THROWS_WITH(cpu::cross_entropy_forward<double>(&loss, lse.data(), x.data(), y.data(), N, V, s0),
                      Catch::Contains("row 3") && Catch::Contains("target 11"));
  vector<double> W = randn(V * 4, 311), h = randn(N * 4, 312), dh(N * 4), dW(V * 4), ws(N * V);
  REQUIRE_THROWS_WITH(cpu::fused_linear_cross_entropy<double>(&loss, dh.data(), dW.data(), h.data(), W.data(),
                                                              y.data(), N, V, 4, N, ws.data(), nullptr, s0),
                      Catch::Contains("row 3") && Catch::Contains("target 11"));
}

TEST_CASE("fused linear cross-entropy equals linear then cross_entropy, chunk by chunk", "[cpu][loss]") {
  const int64_t N = 23;
  const int V = 31, D = 12;
  auto h = randn(N * D, 400), W = randn(V * D, 401, 0.5);
  const auto y = random_targets(N, V, 402, 0.25);

  // plain path: materialized logits [N, V]
  const auto x = naive_linear(h, W, N, V, D);
  double loss_ref = kNaN, one = 1.0;
  vector<double> lse(N), dx(N * V);
  cpu::cross_entropy_forward<double>(&loss_ref, lse.data(), x.data(), y.data(), N, V, s0);
  cpu::cross_entropy_backward<double>(dx.data(), &one, x.data(), lse.data(), y.data(), N, V, s0);
  vector<double> dh_ref(N * D, 0.0), dW_ref(V * D, 0.0);
  for (int64_t n = 0; n < N; n++)
    for (int j = 0; j < V; j++)
      for (int d = 0; d < D; d++) {
        dh_ref[n * D + d] += dx[n * V + j] * W[j * D + d];
        dW_ref[j * D + d] += dx[n * V + j] * h[n * D + d];
      }

  for (int64_t chunk : {int64_t(1), int64_t(5), N, N + 17}) {
    const std::string tag = "chunk " + std::to_string(chunk);
    // exactly chunk*V elements plus a NaN guard that must stay untouched
    const int64_t ws_elems = chunk * V, guard = 16;
    auto ws = poisoned<double>(ws_elems + guard);
    std::printf("fused linear CE N=%lld V=%d D=%d chunk=%lld: workspace %lld elements vs %lld for the plain [N, V] logits\n",
                (long long)N, V, D, (long long)chunk, (long long)std::min(chunk, N) * V, (long long)N * V);
    if (chunk < N) CHECK(ws_elems < N * V);
    double loss = kNaN;
    auto dh = poisoned<double>(N * D), dW = poisoned<double>(V * D);
    cpu::fused_linear_cross_entropy<double>(&loss, dh.data(), dW.data(), h.data(), W.data(), y.data(), N, V,
                                            D, chunk, ws.data(), nullptr, s0);
    LOOM_CHECK_CLOSE(tol::compare(&loss, &loss_ref, 1, tol::kSameMathF64, (tag + " loss").c_str()));
    LOOM_CHECK_CLOSE(tol::compare(dh, dh_ref, tol::kSameMathF64, (tag + " dh").c_str()));
    LOOM_CHECK_CLOSE(tol::compare(dW, dW_ref, tol::kSameMathF64, (tag + " dW").c_str()));
    for (int64_t i = ws_elems; i < ws_elems + guard; i++) REQUIRE(std::isnan(ws[i]));
  }

  // gradients of the fused loss itself by central differences
  vector<double> ws(5 * V), dh(N * D), dW(V * D);
  double loss = kNaN;
  cpu::fused_linear_cross_entropy<double>(&loss, dh.data(), dW.data(), h.data(), W.data(), y.data(), N, V, D,
                                          5, ws.data(), nullptr, s0);
  auto f = [&] { return naive_ce(naive_linear(h, W, N, V, D), y, N, V); };
  LOOM_CHECK_CLOSE(tol::compare(dh, numeric_grad(f, h), tol::kGradcheckF64, "fused dh vs central diff"));
  LOOM_CHECK_CLOSE(tol::compare(dW, numeric_grad(f, W), tol::kGradcheckF64, "fused dW vs central diff"));

  // f32 against the f64 plain path
  const auto h32 = cast<float>(h), W32 = cast<float>(W);
  auto ws32 = poisoned<float>(5 * V), dh32 = poisoned<float>(N * D), dW32 = poisoned<float>(V * D);
  float loss32 = NAN;
  cpu::fused_linear_cross_entropy<float>(&loss32, dh32.data(), dW32.data(), h32.data(), W32.data(), y.data(),
                                         N, V, D, 5, ws32.data(), nullptr, s0);
  LOOM_CHECK_CLOSE(tol::compare(&loss32, &loss_ref, 1, tol::kCpuF32, "fused f32 loss"));
  LOOM_CHECK_CLOSE(tol::compare(dh32, dh_ref, tol::kCpuF32, "fused f32 dh"));
  LOOM_CHECK_CLOSE(tol::compare(dW32, dW_ref, tol::kCpuF32, "fused f32 dW"));

  // all targets ignored: loss 0 and both gradients exactly 0
  const vector<int32_t> none(N, -100);
  auto dh0 = poisoned<double>(N * D), dW0 = poisoned<double>(V * D);
  double loss0 = kNaN;
  cpu::fused_linear_cross_entropy<double>(&loss0, dh0.data(), dW0.data(), h.data(), W.data(), none.data(), N,
                                          V, D, 5, ws.data(), nullptr, s0);
  CHECK(loss0 == 0.0);
  for (double g : dh0) REQUIRE(g == 0.0);
  for (double g : dW0) REQUIRE(g == 0.0);
}
