// test_cpu_contrastive.cpp: kernels/cpu/contrastive.cpp (patch discrimination and InfoNCE losses)
// against naive formulas written here, and its gradients against central differences in double
// (tests/cpu_loss_test_util.h).
#include <catch2/catch.hpp>

#include "kernels/kernels.h"
#include "tests/tolerances.h"

#include "tests/cpu_loss_test_util.h"

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
