// test_cpu_kernels_b.cpp: the CPU reference kernels of part B (attention, losses,
// optimizers) against naive formulas written here, and their gradients against central
// differences in double.
//
// Every reference below is the plainest possible version of the math: materialized masks
// and score matrices, explicit normalize / log-softmax, torch's optimizer formulas. Inputs are
// fresh seeded random numbers; outputs are poisoned with NaN before each call.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "tests/tolerances.h"

using namespace loom;
using std::vector;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();
const Stream s0 = nullptr;

vector<double> randn(size_t n, uint64_t seed, double scale = 1.0) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> d(0.0, scale);
  vector<double> x(n);
  for (auto& e : x) e = d(gen);
  return x;
}

template <class T> vector<T> cast(const vector<double>& x) { return vector<T>(x.begin(), x.end()); }
template <class T> vector<T> poisoned(size_t n) { return vector<T>(n, T(kNaN)); }

// Central differences of a scalar function f with respect to every element of x.
// With stride > 1 only every stride-th element is differentiated (the others are left 0).
vector<double> numeric_grad(const std::function<double()>& f, vector<double>& x, double eps = 1e-6,
                            size_t stride = 1) {
  vector<double> g(x.size(), 0.0);
  for (size_t i = 0; i < x.size(); i += stride) {
    const double keep = x[i];
    x[i] = keep + eps;
    const double up = f();
    x[i] = keep - eps;
    const double down = f();
    x[i] = keep;
    g[i] = (up - down) / (2 * eps);
  }
  return g;
}

// The compute copy must be the master exactly (same type here: no rounding allowed).
template <class T>
void check_same(const vector<T>& got, const vector<T>& ref, const std::string& what) {
  REQUIRE(got.size() == ref.size());
  for (size_t i = 0; i < got.size(); i++) {
    INFO(what << "[" << i << "]: got " << got[i] << " expected " << ref[i]);
    REQUIRE(got[i] == ref[i]);
  }
}

}  // namespace

// =========================================================================== attention
namespace {

struct AttnCase {
  std::string name;
  vector<int32_t> cu_q, cu_k;
  int64_t Nq, Nk;  // may exceed cu_*[nseq]: trailing rows outside every sequence
  int H, KV, hd;
  bool causal;
};

// Naive attention in double with an explicit [Nq, Nk] mask built from document ids.
// out [Nq, H, hd], lse [Nq, H] (+inf where a row sees no key, out 0 there).
void naive_attention(vector<double>& out, vector<double>& lse, const vector<double>& q,
                     const vector<double>& k, const vector<double>& v, const AttnCase& c,
                     double scale) {
  const int nseq = int(c.cu_q.size()) - 1;
  vector<int> qdoc(c.Nq, -1), qpos(c.Nq, 0), kdoc(c.Nk, -1), kpos(c.Nk, 0);
  for (int i = 0; i < nseq; i++) {
    for (int r = c.cu_q[i]; r < c.cu_q[i + 1]; r++) qdoc[r] = i, qpos[r] = r - c.cu_q[i];
    for (int r = c.cu_k[i]; r < c.cu_k[i + 1]; r++) kdoc[r] = i, kpos[r] = r - c.cu_k[i];
  }
  vector<char> mask(c.Nq * c.Nk, 0);
  for (int64_t r = 0; r < c.Nq; r++)
    for (int64_t j = 0; j < c.Nk; j++) {
      if (qdoc[r] < 0 || qdoc[r] != kdoc[j]) continue;
      const int d = qdoc[r];
      const int Lq = c.cu_q[d + 1] - c.cu_q[d], Lk = c.cu_k[d + 1] - c.cu_k[d];
      mask[r * c.Nk + j] = !c.causal || kpos[j] <= qpos[r] + Lk - Lq;
    }
  out.assign(c.Nq * c.H * c.hd, 0.0);
  lse.assign(c.Nq * c.H, kInf);
  const int group = c.H / c.KV;
  for (int h = 0; h < c.H; h++) {
    const int g = h / group;
    for (int64_t r = 0; r < c.Nq; r++) {
      vector<double> S(c.Nk, -kInf);
      double m = -kInf;
      for (int64_t j = 0; j < c.Nk; j++) {
        if (!mask[r * c.Nk + j]) continue;
        double dot = 0;
        for (int d = 0; d < c.hd; d++) dot += q[(r * c.H + h) * c.hd + d] * k[(j * c.KV + g) * c.hd + d];
        S[j] = dot * scale;
        m = std::max(m, S[j]);
      }
      if (m == -kInf) continue;  // sees nothing
      double l = 0;
      for (int64_t j = 0; j < c.Nk; j++) l += std::exp(S[j] - m);
      for (int64_t j = 0; j < c.Nk; j++) {
        const double p = std::exp(S[j] - m) / l;
        for (int d = 0; d < c.hd; d++) out[(r * c.H + h) * c.hd + d] += p * v[(j * c.KV + g) * c.hd + d];
      }
      lse[r * c.H + h] = m + std::log(l);
    }
  }
}

vector<AttnCase> attention_cases() {
  vector<AttnCase> cases;
  // ragged lengths 7, 1, 13, 5 and 3 padding rows after them
  const vector<int32_t> cu = {0, 7, 8, 21, 26};
  for (bool causal : {false, true}) {
    cases.push_back({"ragged GQA H6 KV2 hd8", cu, cu, 29, 29, 6, 2, 8, causal});
    cases.push_back({"ragged MHA H3 KV3 hd16", cu, cu, 29, 29, 3, 3, 16, causal});
    // decode: Lq 1 over Lk 9, Lq 3 over Lk 10, and Lq 4 over Lk 2 (causal: 2 rows see nothing)
    cases.push_back({"decode GQA H6 KV2 hd16", {0, 1, 4, 8}, {0, 9, 19, 21}, 10, 23, 6, 2, 16, causal});
    cases.push_back({"single row N=1 H2 KV1 hd8", {0, 1}, {0, 1}, 1, 1, 2, 1, 8, causal});
    // longer than one 64-row query tile: Lq = Lk = 67, Lq 70 over Lk 5 (causal: the whole first
    // tile sees nothing), Lq = Lk = 130 (three tiles), then padding rows
    cases.push_back({"multi-tile H2 KV1 hd4", {0, 67, 137, 267}, {0, 67, 72, 202}, 270, 204, 2, 1, 4, causal});
  }
  return cases;
}

std::string case_name(const AttnCase& c) { return c.name + (c.causal ? " causal" : " bidirectional"); }

// lse may hold +inf (rows that see nothing): both sides must agree on where, then the finite
// values are compared.
template <class A>
int64_t check_lse(const vector<A>& got, const vector<double>& ref, tol::Tol t, const std::string& what) {
  vector<double> g(got.size()), r(ref.size());
  int64_t inf_rows = 0;
  for (size_t i = 0; i < ref.size(); i++) {
    if (std::isinf(ref[i])) {
      INFO(what << " lse[" << i << "] = " << double(got[i]) << ", expected +inf");
      CHECK((std::isinf(double(got[i])) && got[i] > 0));
      inf_rows++;
    } else {
      g[i] = double(got[i]), r[i] = ref[i];
    }
  }
  LOOM_CHECK_CLOSE(tol::compare(g, r, t, (what + " lse").c_str()));
  return inf_rows;
}

template <class T>
void run_attention_forward(vector<T>& out, vector<acc_t<T>>& lse, const vector<double>& q,
                           const vector<double>& k, const vector<double>& v, const AttnCase& c,
                           double scale) {
  const auto qt = cast<T>(q), kt = cast<T>(k), vt = cast<T>(v);
  out = poisoned<T>(q.size());
  lse = poisoned<acc_t<T>>(c.Nq * c.H);
  int max_seqlen = 0;
  for (size_t i = 0; i + 1 < c.cu_q.size(); i++)
    max_seqlen = std::max({max_seqlen, c.cu_q[i + 1] - c.cu_q[i], c.cu_k[i + 1] - c.cu_k[i]});
  cpu::attention_forward<T>(out.data(), lse.data(), qt.data(), kt.data(), vt.data(), c.cu_q.data(),
                            c.cu_k.data(), int(c.cu_q.size()) - 1, max_seqlen, c.Nq, c.Nk, c.H, c.KV,
                            c.hd, c.causal, scale, s0);
}

template <class T>
void run_attention_backward(vector<T>& dq, vector<T>& dk, vector<T>& dv, const vector<double>& dout,
                            const vector<double>& q, const vector<double>& k, const vector<double>& v,
                            const AttnCase& c, double scale) {
  vector<T> out;
  vector<acc_t<T>> lse;
  run_attention_forward<T>(out, lse, q, k, v, c, scale);
  const auto qt = cast<T>(q), kt = cast<T>(k), vt = cast<T>(v), dt = cast<T>(dout);
  dq = poisoned<T>(q.size());
  dk = poisoned<T>(k.size());
  dv = poisoned<T>(v.size());
  auto ws = poisoned<acc_t<T>>(c.Nq * c.H);
  int max_seqlen = 0;
  for (size_t i = 0; i + 1 < c.cu_q.size(); i++)
    max_seqlen = std::max({max_seqlen, c.cu_q[i + 1] - c.cu_q[i], c.cu_k[i + 1] - c.cu_k[i]});
  cpu::attention_backward<T>(dq.data(), dk.data(), dv.data(), dt.data(), qt.data(), kt.data(), vt.data(),
                             out.data(), lse.data(), ws.data(), c.cu_q.data(), c.cu_k.data(),
                             int(c.cu_q.size()) - 1, max_seqlen, c.Nq, c.Nk, c.H, c.KV, c.hd, c.causal,
                             scale, s0);
}

}  // namespace

TEST_CASE("attention forward matches a naive masked softmax(QK^T)V", "[cpu][attention]") {
  uint64_t seed = 100;
  int64_t inf_rows = 0;
  for (const auto& c : attention_cases()) {
    const double scale = 1.0 / std::sqrt(double(c.hd));
    const auto q = randn(c.Nq * c.H * c.hd, seed++), k = randn(c.Nk * c.KV * c.hd, seed++),
               v = randn(c.Nk * c.KV * c.hd, seed++);
    vector<double> out_ref, lse_ref;
    naive_attention(out_ref, lse_ref, q, k, v, c, scale);

    vector<double> out64;
    vector<double> lse64;
    run_attention_forward<double>(out64, lse64, q, k, v, c, scale);
    LOOM_CHECK_CLOSE(tol::compare(out64, out_ref, tol::kSameMathF64, (case_name(c) + " f64 out").c_str()));
    inf_rows += check_lse(lse64, lse_ref, tol::kSameMathF64, case_name(c) + " f64");

    vector<float> out32, lse32;
    run_attention_forward<float>(out32, lse32, q, k, v, c, scale);
    LOOM_CHECK_CLOSE(tol::compare(out32, out_ref, tol::kCpuF32, (case_name(c) + " f32 out").c_str()));
    check_lse(lse32, lse_ref, tol::kCpuF32, case_name(c) + " f32");
  }
  CHECK(inf_rows > 0);  // the +inf convention was reached (padding rows, causal Lq > Lk)
}

TEST_CASE("attention backward matches central differences in double", "[cpu][attention][grad]") {
  uint64_t seed = 200;
  for (const auto& c : attention_cases()) {
    const double scale = 1.0 / std::sqrt(double(c.hd));
    auto q = randn(c.Nq * c.H * c.hd, seed++), k = randn(c.Nk * c.KV * c.hd, seed++),
         v = randn(c.Nk * c.KV * c.hd, seed++);
    const auto dout = randn(q.size(), seed++);  // loss = sum(out * dout)
    auto loss = [&]() {
      vector<double> out;
      vector<double> lse;
      run_attention_forward<double>(out, lse, q, k, v, c, scale);
      double L = 0;
      for (size_t i = 0; i < out.size(); i++) L += out[i] * dout[i];
      return L;
    };
    vector<double> dq, dk, dv;
    run_attention_backward<double>(dq, dk, dv, dout, q, k, v, c, scale);
    // every element of the small cases; every 3rd of the multi-tile one (keeps the test ~5 s)
    const size_t stride = q.size() > 2000 ? 3 : 1;
    auto check = [&](const vector<double>& analytic, vector<double>& x, const char* what) {
      vector<double> got, ref;
      const auto numeric = numeric_grad(loss, x, 1e-6, stride);
      for (size_t e = 0; e < x.size(); e += stride) got.push_back(analytic[e]), ref.push_back(numeric[e]);
      LOOM_CHECK_CLOSE(tol::compare(got, ref, tol::kGradcheckF64, (case_name(c) + " " + what).c_str()));
    };
    check(dq, q, "dq");
    check(dk, k, "dk");
    check(dv, v, "dv");

    // rows outside every sequence: exactly zero
    const int nseq = int(c.cu_q.size()) - 1;
    for (int64_t r = c.cu_q[nseq]; r < c.Nq; r++)
      for (int64_t e = 0; e < int64_t(c.H) * c.hd; e++) REQUIRE(dq[r * c.H * c.hd + e] == 0.0);
    for (int64_t r = c.cu_k[nseq]; r < c.Nk; r++)
      for (int64_t e = 0; e < int64_t(c.KV) * c.hd; e++)
        REQUIRE((dk[r * c.KV * c.hd + e] == 0.0 && dv[r * c.KV * c.hd + e] == 0.0));

    // f32 against the f64 analytic gradient
    vector<float> dq32, dk32, dv32;
    run_attention_backward<float>(dq32, dk32, dv32, dout, q, k, v, c, scale);
    LOOM_CHECK_CLOSE(tol::compare(dq32, dq, tol::kCpuF32, (case_name(c) + " f32 dq").c_str()));
    LOOM_CHECK_CLOSE(tol::compare(dk32, dk, tol::kCpuF32, (case_name(c) + " f32 dk").c_str()));
    LOOM_CHECK_CLOSE(tol::compare(dv32, dv, tol::kCpuF32, (case_name(c) + " f32 dv").c_str()));
  }
}

TEST_CASE("attention rejects bad shapes with the values in the message", "[cpu][attention]") {
  vector<double> x(64, 1.0), lse(8);
  const vector<int32_t> cu = {0, 4};
  REQUIRE_THROWS_WITH(cpu::attention_forward<double>(x.data(), lse.data(), x.data(), x.data(), x.data(),
                                                     cu.data(), cu.data(), 1, 4, 4, 4, 3, 2, 4, false,
                                                     0.5, s0),
                      Catch::Contains("H=3 KV=2"));
  REQUIRE_THROWS_WITH(cpu::attention_forward<double>(x.data(), lse.data(), x.data(), x.data(), x.data(),
                                                     cu.data(), cu.data(), 1, 3, 4, 4, 2, 2, 4, false,
                                                     0.5, s0),
                      Catch::Contains("max_seqlen=3"));
}

// =========================================================================== cross-entropy
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
                                                              y.data(), N, V, 4, N, ws.data(), s0),
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
                                            D, chunk, ws.data(), s0);
    LOOM_CHECK_CLOSE(tol::compare(&loss, &loss_ref, 1, tol::kSameMathF64, (tag + " loss").c_str()));
    LOOM_CHECK_CLOSE(tol::compare(dh, dh_ref, tol::kSameMathF64, (tag + " dh").c_str()));
    LOOM_CHECK_CLOSE(tol::compare(dW, dW_ref, tol::kSameMathF64, (tag + " dW").c_str()));
    for (int64_t i = ws_elems; i < ws_elems + guard; i++) REQUIRE(std::isnan(ws[i]));
  }

  // gradients of the fused loss itself by central differences
  vector<double> ws(5 * V), dh(N * D), dW(V * D);
  double loss = kNaN;
  cpu::fused_linear_cross_entropy<double>(&loss, dh.data(), dW.data(), h.data(), W.data(), y.data(), N, V, D,
                                          5, ws.data(), s0);
  auto f = [&] { return naive_ce(naive_linear(h, W, N, V, D), y, N, V); };
  LOOM_CHECK_CLOSE(tol::compare(dh, numeric_grad(f, h), tol::kGradcheckF64, "fused dh vs central diff"));
  LOOM_CHECK_CLOSE(tol::compare(dW, numeric_grad(f, W), tol::kGradcheckF64, "fused dW vs central diff"));

  // f32 against the f64 plain path
  const auto h32 = cast<float>(h), W32 = cast<float>(W);
  auto ws32 = poisoned<float>(5 * V), dh32 = poisoned<float>(N * D), dW32 = poisoned<float>(V * D);
  float loss32 = NAN;
  cpu::fused_linear_cross_entropy<float>(&loss32, dh32.data(), dW32.data(), h32.data(), W32.data(), y.data(),
                                         N, V, D, 5, ws32.data(), s0);
  LOOM_CHECK_CLOSE(tol::compare(&loss32, &loss_ref, 1, tol::kCpuF32, "fused f32 loss"));
  LOOM_CHECK_CLOSE(tol::compare(dh32, dh_ref, tol::kCpuF32, "fused f32 dh"));
  LOOM_CHECK_CLOSE(tol::compare(dW32, dW_ref, tol::kCpuF32, "fused f32 dW"));

  // all targets ignored: loss 0 and both gradients exactly 0
  const vector<int32_t> none(N, -100);
  auto dh0 = poisoned<double>(N * D), dW0 = poisoned<double>(V * D);
  double loss0 = kNaN;
  cpu::fused_linear_cross_entropy<double>(&loss0, dh0.data(), dW0.data(), h.data(), W.data(), none.data(), N,
                                          V, D, 5, ws.data(), s0);
  CHECK(loss0 == 0.0);
  for (double g : dh0) REQUIRE(g == 0.0);
  for (double g : dW0) REQUIRE(g == 0.0);
}

// =========================================================================== contrastive
namespace {

// torch: F.cross_entropy(bmm(F.normalize(p), F.normalize(t)^T) / tau flattened, arange), mean
double naive_patch_disc(const vector<double>& p, const vector<double>& t, int B, int M, int D, double tau) {
  auto normalize = [&](const vector<double>& x) {
    vector<double> y(x.size());
    for (int64_t r = 0; r < int64_t(B) * M; r++) {
      double ss = 0;
      for (int d = 0; d < D; d++) ss += x[r * D + d] * x[r * D + d];
      const double denom = std::max(std::sqrt(ss), 1e-12);
      for (int d = 0; d < D; d++) y[r * D + d] = x[r * D + d] / denom;
    }
    return y;
  };
  const auto pn = normalize(p), tn = normalize(t);
  double total = 0;
  for (int b = 0; b < B; b++)
    for (int i = 0; i < M; i++) {
      vector<double> logit(M, 0.0);
      for (int j = 0; j < M; j++) {
        for (int d = 0; d < D; d++) logit[j] += pn[(int64_t(b) * M + i) * D + d] * tn[(int64_t(b) * M + j) * D + d];
        logit[j] /= tau;
      }
      const double m = *std::max_element(logit.begin(), logit.end());
      double l = 0;
      for (double z : logit) l += std::exp(z - m);
      total += -(logit[i] - m - std::log(l));  // -log_softmax at the diagonal
    }
  return total / (double(B) * M);
}

// (CE(a b^T / tau, arange) + CE((a b^T / tau)^T, arange)) / 2
double naive_infonce(const vector<double>& a, const vector<double>& b, int B, int D, double tau) {
  vector<double> L(B * B, 0.0);
  for (int i = 0; i < B; i++)
    for (int j = 0; j < B; j++) {
      for (int d = 0; d < D; d++) L[i * B + j] += a[i * D + d] * b[j * D + d];
      L[i * B + j] /= tau;
    }
  auto ce = [&](bool transpose) {
    double total = 0;
    for (int i = 0; i < B; i++) {
      auto at = [&](int j) { return transpose ? L[j * B + i] : L[i * B + j]; };
      double m = -kInf, l = 0;
      for (int j = 0; j < B; j++) m = std::max(m, at(j));
      for (int j = 0; j < B; j++) l += std::exp(at(j) - m);
      total += m + std::log(l) - at(i);
    }
    return total / B;
  };
  return (ce(false) + ce(true)) / 2;
}

void normalize_rows(vector<double>& x, int D) {
  for (size_t r = 0; r < x.size() / D; r++) {
    double ss = 0;
    for (int d = 0; d < D; d++) ss += x[r * D + d] * x[r * D + d];
    for (int d = 0; d < D; d++) x[r * D + d] /= std::sqrt(ss);
  }
}

}  // namespace

TEST_CASE("patch discrimination loss and dpred match naive math and central differences", "[cpu][loss]") {
  struct Shape { int B, M, D; };
  const double tau = 0.1;
  uint64_t seed = 500;
  for (Shape sh : {Shape{3, 5, 7}, Shape{1, 1, 4}, Shape{2, 9, 33}}) {
    const int B = sh.B, M = sh.M, D = sh.D;
    const std::string tag = "patch_disc B" + std::to_string(B) + " M" + std::to_string(M) + " D" + std::to_string(D);
    auto p = randn(int64_t(B) * M * D, seed++), t = randn(int64_t(B) * M * D, seed++);
    // a prediction row below the eps of F.normalize (the clamped branch) and an all-zero target row
    const int64_t tiny_row = (int64_t(B) * M) / 2;
    if (B * M > 1) {
      for (int d = 0; d < D; d++) p[tiny_row * D + d] *= 1e-14;
      for (int d = 0; d < D; d++) t[(int64_t(B) * M - 1) * D + d] = 0.0;
    }
    const double ref = naive_patch_disc(p, t, B, M, D, tau);

    double loss = kNaN;
    auto dp = poisoned<double>(p.size());
    auto ws = poisoned<double>(int64_t(B) * M * M + 2 * int64_t(B) * M);
    cpu::patch_disc_loss<double>(&loss, dp.data(), p.data(), t.data(), B, M, D, tau, ws.data(), s0);
    LOOM_CHECK_CLOSE(tol::compare(&loss, &ref, 1, tol::kSameMathF64, (tag + " loss").c_str()));

    // central differences; the tiny row needs a step far below its norm (1e-14 scale)
    vector<double> ng(p.size());
    for (size_t i = 0; i < p.size(); i++) {
      const bool tiny = B * M > 1 && int64_t(i) / D == tiny_row;
      const double eps = tiny ? 1e-20 : 1e-6, keep = p[i];
      p[i] = keep + eps;
      const double up = naive_patch_disc(p, t, B, M, D, tau);
      p[i] = keep - eps;
      const double down = naive_patch_disc(p, t, B, M, D, tau);
      p[i] = keep;
      ng[i] = (up - down) / (2 * eps);
    }
    LOOM_CHECK_CLOSE(tol::compare(dp, ng, tol::kGradcheckF64, (tag + " dpred").c_str()));

    // f32 against f64 (the tiny row's gradient is ~1e13: relative tolerance covers it)
    const auto p32 = cast<float>(p), t32 = cast<float>(t);
    float loss32 = NAN;
    auto dp32 = poisoned<float>(p.size());
    auto ws32 = poisoned<float>(ws.size());
    cpu::patch_disc_loss<float>(&loss32, dp32.data(), p32.data(), t32.data(), B, M, D, tau, ws32.data(), s0);
    LOOM_CHECK_CLOSE(tol::compare(&loss32, &ref, 1, tol::kCpuF32, (tag + " f32 loss").c_str()));
    LOOM_CHECK_CLOSE(tol::compare(dp32, dp, tol::kCpuF32, (tag + " f32 dpred").c_str()));
  }
}

TEST_CASE("symmetric InfoNCE and its gradients match naive math and central differences", "[cpu][loss]") {
  const double tau = 0.1;
  uint64_t seed = 600;
  for (int B : {1, 6, 17}) {
    const int D = 9;
    const std::string tag = "infonce B" + std::to_string(B);
    auto a = randn(int64_t(B) * D, seed++), b = randn(int64_t(B) * D, seed++);
    normalize_rows(a, D);
    normalize_rows(b, D);
    const double ref = naive_infonce(a, b, B, D, tau);

    double loss = kNaN;
    auto da = poisoned<double>(a.size()), db = poisoned<double>(b.size());
    auto ws = poisoned<double>(int64_t(B) * B + 4 * int64_t(B));
    cpu::infonce_loss<double>(&loss, da.data(), db.data(), a.data(), b.data(), B, D, tau, ws.data(), s0);
    LOOM_CHECK_CLOSE(tol::compare(&loss, &ref, 1, tol::kSameMathF64, (tag + " loss").c_str()));
    auto f = [&] { return naive_infonce(a, b, B, D, tau); };
    LOOM_CHECK_CLOSE(tol::compare(da, numeric_grad(f, a), tol::kGradcheckF64, (tag + " da").c_str()));
    LOOM_CHECK_CLOSE(tol::compare(db, numeric_grad(f, b), tol::kGradcheckF64, (tag + " db").c_str()));

    const auto a32 = cast<float>(a), b32 = cast<float>(b);
    float loss32 = NAN;
    auto da32 = poisoned<float>(a.size()), db32 = poisoned<float>(b.size()), ws32 = poisoned<float>(ws.size());
    cpu::infonce_loss<float>(&loss32, da32.data(), db32.data(), a32.data(), b32.data(), B, D, tau, ws32.data(), s0);
    LOOM_CHECK_CLOSE(tol::compare(&loss32, &ref, 1, tol::kCpuF32, (tag + " f32 loss").c_str()));
    LOOM_CHECK_CLOSE(tol::compare(da32, da, tol::kCpuF32, (tag + " f32 da").c_str()));
    LOOM_CHECK_CLOSE(tol::compare(db32, db, tol::kCpuF32, (tag + " f32 db").c_str()));
  }
}

// =========================================================================== optimizers
TEST_CASE("adamw_update: 3 steps equal torch.optim.AdamW's formula", "[cpu][optim]") {
  const int64_t n = 37;
  AdamWHyper hp;
  hp.lr = 3e-3f, hp.beta1 = 0.9f, hp.beta2 = 0.95f, hp.eps = 1e-8f, hp.weight_decay = 0.1f;
  for (bool with_scale_and_copy : {true, false}) {
    const std::string tag = with_scale_and_copy ? "adamw scale+copy" : "adamw plain";
    auto master = randn(n, 700), m = vector<double>(n, 0.0), v = vector<double>(n, 0.0);
    auto ref_p = master, ref_m = m, ref_v = m;
    vector<float> master32 = cast<float>(master), m32(n, 0.0f), v32(n, 0.0f);
    const float scale = 0.5f;
    for (int step = 1; step <= 3; step++) {
      hp.step = step;
      const auto grad = randn(n, 710 + step, 2.0);
      // the reference: torch.optim.AdamW written out in double
      const double s = with_scale_and_copy ? double(scale) : 1.0;
      const double lr = hp.lr, b1 = hp.beta1, b2 = hp.beta2, eps = hp.eps, wd = hp.weight_decay;
      for (int64_t i = 0; i < n; i++) {
        const double g = grad[i] * s;
        ref_m[i] = b1 * ref_m[i] + (1 - b1) * g;
        ref_v[i] = b2 * ref_v[i] + (1 - b2) * g * g;
        const double mhat = ref_m[i] / (1 - std::pow(b1, step)), vhat = ref_v[i] / (1 - std::pow(b2, step));
        ref_p[i] -= lr * (wd * ref_p[i] + mhat / (std::sqrt(vhat) + eps));
      }
      auto copy = poisoned<double>(n);
      // with the device step control: scale, applied, t (the host's h.step is then ignored), lr x 1
      const float ctl[4] = {scale, 1.0f, float(step), 1.0f};
      if (with_scale_and_copy) hp.step = -7;
      cpu::adamw_update<double, double>(master.data(), with_scale_and_copy ? copy.data() : nullptr, m.data(),
                                        v.data(), grad.data(), with_scale_and_copy ? ctl : nullptr, n, hp, s0);
      const auto grad32 = cast<float>(grad);
      auto copy32 = poisoned<float>(n);
      cpu::adamw_update<float, float>(master32.data(), with_scale_and_copy ? copy32.data() : nullptr, m32.data(),
                                      v32.data(), grad32.data(), with_scale_and_copy ? ctl : nullptr, n, hp, s0);
      // a skipped step (ctl[1] == 0) writes nothing
      const float skip[4] = {1.0f, 0.0f, float(step), 1.0f};
      auto before = master;
      cpu::adamw_update<double, double>(master.data(), nullptr, m.data(), v.data(), grad.data(), skip, n, hp, s0);
      check_same(master, before, (tag + " skipped step").c_str());
      const std::string t = tag + " step " + std::to_string(step);
      LOOM_CHECK_CLOSE(tol::compare(master, ref_p, tol::kSameMathF64, (t + " master").c_str()));
      LOOM_CHECK_CLOSE(tol::compare(m, ref_m, tol::kSameMathF64, (t + " m").c_str()));
      LOOM_CHECK_CLOSE(tol::compare(v, ref_v, tol::kSameMathF64, (t + " v").c_str()));
      LOOM_CHECK_CLOSE(tol::compare(master32, ref_p, tol::kCpuF32, (t + " f32 master").c_str()));
      if (with_scale_and_copy) {
        check_same(copy, master, (t + " copy").c_str());
        check_same(copy32, master32, (t + " f32 copy").c_str());
      } else {
        for (double c : copy) REQUIRE(std::isnan(c));  // copy == null: untouched
      }
    }
  }
}

TEST_CASE("sgd_update with momentum and decoupled weight decay, 3 steps", "[cpu][optim]") {
  const int64_t n = 29;
  const float lr = 0.05f, mu = 0.9f, wd = 0.01f, scale = 0.25f;
  auto master = randn(n, 800), buf = vector<double>(n, 0.0);
  auto ref_p = master, ref_buf = buf;
  for (int step = 1; step <= 3; step++) {
    const auto grad = randn(n, 810 + step);
    for (int64_t i = 0; i < n; i++) {
      const double g = grad[i] * double(scale);
      ref_buf[i] = step == 1 ? g : double(mu) * ref_buf[i] + g;  // torch: buf = clone(g) on the first step
      ref_p[i] -= double(lr) * (ref_buf[i] + double(wd) * ref_p[i]);
    }
    auto copy = poisoned<double>(n);
    const float ctl[4] = {scale, 1.0f, float(step), 1.0f};
    cpu::sgd_update<double, double>(master.data(), copy.data(), buf.data(), grad.data(), ctl, n, lr, mu, wd, s0);
    LOOM_CHECK_CLOSE(tol::compare(master, ref_p, tol::kSameMathF64, "sgd master"));
    LOOM_CHECK_CLOSE(tol::compare(buf, ref_buf, tol::kSameMathF64, "sgd buf"));
    check_same(copy, master, "sgd copy");
  }
  // no momentum, no buffer, no scale: plain p -= lr (g + wd p)
  auto p0 = randn(n, 820);
  const auto g0 = randn(n, 821);
  auto ref0 = p0;
  for (int64_t i = 0; i < n; i++) ref0[i] -= double(lr) * (g0[i] + double(wd) * ref0[i]);
  cpu::sgd_update<double, double>(p0.data(), nullptr, nullptr, g0.data(), nullptr, n, lr, 0.0f, wd, s0);
  LOOM_CHECK_CLOSE(tol::compare(p0, ref0, tol::kSameMathF64, "sgd no momentum"));
}

TEST_CASE("ema_update: target = decay target + (1 - decay) source", "[cpu][optim]") {
  const int64_t n = 41;
  const double decay = 0.996;
  auto target = randn(n, 900);
  auto ref = target;
  auto target32 = cast<float>(target);
  for (int step = 0; step < 2; step++) {
    const auto source = randn(n, 910 + step);
    for (int64_t i = 0; i < n; i++) ref[i] = decay * ref[i] + (1 - decay) * source[i];
    auto copy = poisoned<double>(n);
    cpu::ema_update<double, double>(target.data(), copy.data(), source.data(), nullptr, n, decay, s0);
    const auto source32 = cast<float>(source);
    const float applied[4] = {1.0f, 1.0f, 1.0f, 1.0f}, skipped[4] = {1.0f, 0.0f, 1.0f, 1.0f};
    cpu::ema_update<float, float>(target32.data(), nullptr, source32.data(), applied, n, decay, s0);
    auto before = target32;
    cpu::ema_update<float, float>(target32.data(), nullptr, source32.data(), skipped, n, decay, s0);
    check_same(target32, before, "ema skipped with the optimizer");
    LOOM_CHECK_CLOSE(tol::compare(target, ref, tol::kSameMathF64, "ema target"));
    check_same(copy, target, "ema copy");
    LOOM_CHECK_CLOSE(tol::compare(target32, ref, tol::kCpuF32, "ema f32 target"));
  }
}

TEST_CASE("grad_norm_squared accumulates; step_control follows clip_grad_norm_ and skips non-finite steps", "[cpu][optim]") {
  const auto g1 = randn(100003, 1000), g2 = randn(17, 1001);
  double ref = 0.5;
  for (double x : g1) ref += x * x;
  for (double x : g2) ref += x * x;
  float out = 0.5f;  // += : a previous buffer's contribution stays
  cpu::grad_norm_squared<double>(&out, g1.data(), int64_t(g1.size()), s0);
  const auto g2f = cast<float>(g2);
  cpu::grad_norm_squared<float>(&out, g2f.data(), int64_t(g2f.size()), s0);
  LOOM_CHECK_CLOSE(tol::compare(&out, &ref, 1, tol::kCpuF32, "grad norm^2"));

  float ctl[4] = {NAN, NAN, 3.0f, 0.5f}, norm = NAN;
  const float norm_sq = 16.0f, loss = 2.5f, bad = INFINITY, nan_sq = NAN;
  cpu::step_control(ctl, &norm, &norm_sq, &loss, 1.0f, s0);
  CHECK(norm == 4.0f);
  CHECK(ctl[0] == 1.0f / (4.0f + 1e-6f));
  CHECK((ctl[1] == 1.0f && ctl[2] == 4.0f && ctl[3] == 0.5f));  // applied: t + 1; lr untouched
  cpu::step_control(ctl, &norm, &norm_sq, nullptr, 10.0f, s0);
  CHECK(ctl[0] == 1.0f);  // never scales up
  cpu::step_control(ctl, &norm, &norm_sq, nullptr, 0.0f, s0);
  CHECK(ctl[0] == 1.0f);  // max_norm <= 0: no clipping
  const float zero = 0.0f;
  cpu::step_control(ctl, &norm, &zero, nullptr, 1.0f, s0);
  CHECK(norm == 0.0f);
  CHECK((ctl[0] == 1.0f && ctl[2] == 7.0f));
  cpu::step_control(ctl, &norm, &norm_sq, &bad, 1.0f, s0);  // non-finite loss: skipped, t stays
  CHECK((ctl[1] == 0.0f && ctl[2] == 7.0f));
  cpu::step_control(ctl, &norm, &nan_sq, nullptr, 1.0f, s0);  // non-finite gradients: skipped
  CHECK((ctl[1] == 0.0f && ctl[2] == 7.0f && std::isnan(norm)));
  cpu::step_control(ctl, nullptr, nullptr, nullptr, 1.0f, s0);  // no norm: scale 1, applied
  CHECK((ctl[0] == 1.0f && ctl[1] == 1.0f && ctl[2] == 8.0f));
}
