// tolerances.h: the one table of test tolerances. A check passes when
//   |got - ref| <= atol + rtol * |ref|      (elementwise)
// Every number says why it is what it is. Tests never loosen a number to pass: a failing
// comparison is a bug or a reason to add a new, explained row.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace loom::tol {

struct Tol {
  double atol, rtol;
  const char* why;
};

// f64 gradient check by central differences (eps 1e-6): the truncation error is O(eps^2 f''')
// and the rounding error O(1e-16 / eps) = 1e-10; torch.autograd.gradcheck uses the same.
inline constexpr Tol kGradcheckF64{1e-5, 1e-3, "central differences, eps 1e-6, in double"};
// Two f64 computations of the same math by different summation orders (fused vs plain
// cross-entropy, chunked vs whole): rounding is ~1e-16 per op, 1e-10 leaves room for
// thousands of accumulated terms.
inline constexpr Tol kSameMathF64{1e-12, 1e-10, "same math, different order, double"};
// CPU f32 kernels against an f64 reference of the same inputs: float keeps 24 bits (6e-8);
// sums of up to ~1e3 terms and an exp/log per element give a few 1e-6 relative.
inline constexpr Tol kCpuF32{1e-5, 1e-4, "f32 CPU kernel vs f64 reference"};
// CUDA f32 against the CPU f32/f64 reference: float has 24 bits (6e-8); reductions of up
// to ~1e4 terms in a different order give ~1e-5 relative.
inline constexpr Tol kCudaF32{1e-5, 1e-4, "f32, reductions in another order"};
// CUDA f32 through GEMMs: cuBLAS may use TF32-free kernels with split-K; relative 1e-4 of
// the row's magnitude covers K up to a few thousand.
inline constexpr Tol kCudaF32Gemm{1e-4, 2e-4, "f32 GEMM, other blocking/split-K"};
// One f32 sum of up to ~3e5 terms of magnitude <= 1 on the GPU (block partials) against the
// CPU's sequential order, when the sum itself may be near 0: each order's rounding error is
// at worst n 2^-24 = 2e-2 of the term scale and typically sqrt(n) 2^-24 = 3e-5; 1e-3 sits
// between, and no relative term can absorb it because the reference may be ~0.
inline constexpr Tol kCudaSumF32{1e-3, 1e-4, "f32 long sum, other order, result may be ~0"};
// CUDA bf16 against the f32 reference: bf16 keeps 8 bits (3.9e-3 relative per rounding);
// inputs and outputs are rounded once each, plus accumulation in f32.
inline constexpr Tol kCudaBF16{2e-2, 2e-2, "bf16 storage: 2^-8 per rounding, 2-3 roundings"};
// CUDA f16 against the f32 reference: f16 keeps 11 bits (4.9e-4 relative per rounding), the
// same 2-3 roundings; values stay far inside its range (|x| < 65504, > 6e-5) in these tests.
inline constexpr Tol kCudaF16{4e-3, 4e-3, "f16 storage: 2^-11 per rounding, 2-3 roundings"};
// Image decode + bilinear resize against the same math written in the test: float weights
// on 8-bit pixels, a handful of roundings of values in [-1, 1].
inline constexpr Tol kImageF32{1e-5, 1e-5, "bilinear weights in f32 on 8-bit pixels"};
// JPEG at quality 100 round trip: DCT quantization and YCbCr rounding move a pixel by a few
// of 255 levels (x2 after (x - 0.5) / 0.5); 0.1 is about 13 levels.
inline constexpr Tol kJpegQ100{0.1, 0.0, "JPEG q100: lossy by a few levels per pixel"};
// Data parallel (tests/data_parallel.sh reads this line): the per-step f32 training loss of N
// processes x batch B against 1 process x N*B. The same math with the batch's sums split
// differently (each rank's products and means over B rows, then the mean of N means): 1.8e-7
// and 2.3e-7 relative seen over 8 steps on the CPU; a wrong average or ranks whose weights
// drift apart are off by 1e-3 or more from the second step on.
inline constexpr double kDataParallelLossF32 = 1e-5;
// Whole-model fixture checks on the CPU in f64 against PyTorch f64 (issue requirement).
inline constexpr double kFixtureRelF64 = 1e-6;
// Sampled token frequencies against their probabilities: n draws of a token of probability p
// give a binomial count, standard deviation sqrt(p (1 - p) / n) of the frequency; 5 of them
// fail a correct sampler once in ~1.7 million checks, while a wrong cut (top_k, top_p) or a
// missing temperature moves a frequency by 0.05 or more, 10+ deviations at n = 40000.
inline constexpr double kSamplingSigmas = 5.0;

struct Report {
  bool ok = true;
  int64_t bad = 0, worst_at = -1;
  double worst = 0;  // largest |got-ref| / (atol + rtol|ref|)
  std::string text;
};

// Compare two arrays; the report lists the first mismatches and the worst element.
template <class A, class B>
Report compare(const A* got, const B* ref, int64_t n, Tol t, const char* what = "") {
  Report r;
  char buf[256];
  for (int64_t i = 0; i < n; i++) {
    double g = double(got[i]), f = double(ref[i]);
    double lim = t.atol + t.rtol * std::fabs(f);
    double err = std::fabs(g - f);
    double ratio = std::isnan(g) || std::isnan(f) ? INFINITY : err / lim;
    if (!(ratio <= 1.0)) {
      if (r.bad < 5) {
        std::snprintf(buf, sizeof buf, "  %s[%lld]: got %.9g ref %.9g (|diff| %.3g > %.3g)\n", what,
                      (long long)i, g, f, err, lim);
        r.text += buf;
      }
      r.bad++;
      r.ok = false;
    }
    if (!(ratio <= r.worst)) { r.worst = ratio; r.worst_at = i; }
  }
  std::snprintf(buf, sizeof buf, "%s: %lld/%lld mismatches, worst err/limit %.3g at %lld (%s)\n", what,
                (long long)r.bad, (long long)n, r.worst, (long long)r.worst_at, t.why);
  r.text = buf + r.text;
  return r;
}

template <class A, class B>
Report compare(const std::vector<A>& got, const std::vector<B>& ref, Tol t, const char* what = "") {
  if (got.size() != ref.size()) {
    Report r;
    r.ok = false;
    r.text = std::string(what) + ": size mismatch " + std::to_string(got.size()) + " vs " +
             std::to_string(ref.size());
    return r;
  }
  return compare(got.data(), ref.data(), int64_t(got.size()), t, what);
}

}  // namespace loom::tol

// Catch2 helper: INFO the report, then CHECK it.
#define LOOM_CHECK_CLOSE(report_expr)   \
  do {                                  \
    auto _r = (report_expr);            \
    INFO(_r.text);                      \
    CHECK(_r.ok);                       \
  } while (0)
