// test_cpu_attention.cpp: kernels/cpu/attention.cpp (varlen flash attention with GQA and the causal
// mask) against naive formulas written here, and its gradients against central differences in
// double (tests/cpu_loss_test_util.h).
#include <catch2/catch.hpp>

#include "kernels/kernels.h"
#include "tests/tolerances.h"

#include "tests/cpu_loss_test_util.h"

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
  // one cu_seqlens and Nq = Nk = nseq * max_seqlen declares a dense batch: lengths 3 and 2 in 6
  // rows (the last outside every sequence) with max_seqlen 3 are not one (the CUDA kernels would
  // read sequence 1 as rows 3..6)
  const vector<int32_t> ragged = {0, 3, 5};
  vector<double> y(6 * 2 * 4, 1.0), o(6 * 2 * 4, 7.0), lse_y(6 * 2);
  REQUIRE_THROWS_WITH(cpu::attention_forward<double>(o.data(), lse_y.data(), y.data(), y.data(), y.data(),
                                                     ragged.data(), ragged.data(), 2, 3, 6, 6, 2, 2, 4, false,
                                                     0.5, s0),
                      Catch::Contains("dense batch") && Catch::Contains("cu_seqlens[2] = 5, not 6"));
  // the same lengths with their own key offsets (another array) are a ragged batch
  const vector<int32_t> ragged_k = ragged;
  cpu::attention_forward<double>(o.data(), lse_y.data(), y.data(), y.data(), y.data(), ragged.data(),
                                 ragged_k.data(), 2, 3, 6, 6, 2, 2, 4, false, 0.5, s0);
  CHECK(o[0] == 1.0);          // every value 1: the average of ones
  CHECK(o[5 * 2 * 4] == 0.0);  // row 5, outside every sequence
}
