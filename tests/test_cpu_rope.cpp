// test_cpu_rope.cpp: the CPU reference kernels of kernels/cpu/rope.cpp (rotary position embedding)
// against naive formulas and central differences in double (the method:
// tests/cpu_kernel_test_util.h).
#include <catch2/catch.hpp>

#include "kernels/kernels.h"
#include "tests/tolerances.h"

#include "tests/cpu_kernel_test_util.h"

namespace {
vector<double> naive_rope(const vector<double>& x, const vector<int32_t>& pos, int64_t N, int H,
                          int hd, double theta) {
  vector<double> out(x.size());
  const int half = hd / 2;
  for (int64_t n = 0; n < N; n++)
    for (int h = 0; h < H; h++)
      for (int i = 0; i < half; i++) {
        const long double ang = pos[sz(n)] * std::pow((long double)theta, -2.0L * i / hd);
        const long double c = std::cos(ang), s = std::sin(ang);
        const size_t b = sz((n * H + h) * hd);
        out[b + i] = double(x[b + i] * c - x[b + i + half] * s);
        out[b + i + half] = double(x[b + i + half] * c + x[b + i] * s);
      }
  return out;
}
}  // namespace

TEST_CASE("rope: forward naive, float like the reference, backward gradcheck and inverse", "[rope]") {
  struct Shape { int64_t N; int H, hd; };
  for (Shape sh : {Shape{7, 3, 8}, Shape{1, 1, 2}, Shape{13, 4, 64}, Shape{80, 9, 64}}) {
    const int64_t N = sh.N;
    const int H = sh.H, hd = sh.hd;
    const int64_t n = N * H * hd;
    vector<double> x = uniform(n), R = uniform(n);
    // ragged documents: positions restart at 0
    vector<int32_t> pos(sz(N));
    for (int64_t t = 0; t < N; t++) pos[sz(t)] = int32_t(t < 5 ? t : t - 5);
    if (N > 2) pos[sz(N - 1)] = 300;
    const double theta = 100000.0;
    vector<double> out = poisoned<double>(n);
    cpu::rope_forward(out.data(), x.data(), pos.data(), N, H, hd, theta, s0);
    INFO("N=" << N << " H=" << H << " hd=" << hd);
    LOOM_CHECK_CLOSE(tol::compare(out, naive_rope(x, pos, N, H, hd, theta), tol::kSameMathF64, "rope"));

    // float: angles in float, exactly as torch_ref.py rope_cos_sin does in f32
    vector<float> xf = cast_vec<float>(x), of = poisoned<float>(n);
    cpu::rope_forward(of.data(), xf.data(), pos.data(), N, H, hd, theta, s0);
    vector<double> rf(sz(n));
    for (int64_t t = 0; t < N; t++)
      for (int h = 0; h < H; h++)
        for (int i = 0; i < hd / 2; i++) {
          const float inv = 1.0f / std::pow(float(theta), float(2 * i) / float(hd));
          const float ang = float(pos[sz(t)]) * inv;
          const double c = std::cos(ang), s = std::sin(ang);
          const size_t b = sz((t * H + h) * hd);
          rf[b + i] = double(xf[b + i]) * c - double(xf[b + i + hd / 2]) * s;
          rf[b + i + hd / 2] = double(xf[b + i + hd / 2]) * c + double(xf[b + i]) * s;
        }
    LOOM_CHECK_CLOSE(tol::compare(of, rf, tol::kCpuF32, "rope f32"));

    // a rotation's transpose is its inverse; in place (out aliases inp) too
    vector<double> back = out;
    cpu::rope_backward(back.data(), back.data(), pos.data(), N, H, hd, theta, s0);
    LOOM_CHECK_CLOSE(tol::compare(back, x, tol::kSameMathF64, "rope inverse"));
    if (n > 5000) continue;  // the gradcheck is O(n^2); 80x9x64 is there for the threaded path

    auto fwd = [&] {
      vector<double> o(sz(n));
      cpu::rope_forward(o.data(), x.data(), pos.data(), N, H, hd, theta, s0);
      return o;
    };
    vector<double> dx = poisoned<double>(n);
    cpu::rope_backward(dx.data(), R.data(), pos.data(), N, H, hd, theta, s0);
    LOOM_CHECK_CLOSE(tol::compare(dx, numeric_grad(x, R, fwd), tol::kGradcheckF64, "rope dinp"));
  }
  vector<double> x(6), y(6);
  vector<int32_t> pos = {0, 1};
  CHECK_THROWS_AS(cpu::rope_forward(y.data(), x.data(), pos.data(), 2, 1, 3, 1e4, s0), std::invalid_argument);
}
