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

TEST_CASE("rope: q|k|v rows split and joined against the windows' rope and copies", "[rope]") {
  // rope_qkv_split: q, k = rope of their windows of the joined rows, v = its window;
  // rope_qkv_join: the rows = rope^-1(dq) | rope^-1(dk) | dv. The naive rope on the windows is
  // the reference (the same math, so kSameMathF64).
  struct Shape { int64_t N; int H, KV, hd; };
  for (Shape sh : {Shape{7, 3, 1, 8}, Shape{1, 1, 1, 2}, Shape{20, 9, 3, 64}, Shape{5, 4, 2, 6}}) {
    const int64_t N = sh.N;
    const int H = sh.H, KV = sh.KV, hd = sh.hd;
    const int64_t qw = int64_t(H) * hd, kw = int64_t(KV) * hd, W = qw + 2 * kw;
    INFO("N=" << N << " H=" << H << " KV=" << KV << " hd=" << hd);
    vector<double> qkv = uniform(N * W), dq = uniform(N * qw), dk = uniform(N * kw), dv = uniform(N * kw);
    vector<int32_t> pos = randint(N, 0, 3000);
    const double theta = 10000.0;
    auto window = [&](const vector<double>& rows, int64_t col, int64_t w) {
      vector<double> o(sz(N * w));
      for (int64_t n = 0; n < N; n++)
        for (int64_t j = 0; j < w; j++) o[sz(n * w + j)] = rows[sz(n * W + col + j)];
      return o;
    };
    vector<double> q = poisoned<double>(N * qw), k = poisoned<double>(N * kw), v = poisoned<double>(N * kw);
    cpu::rope_qkv_split(q.data(), k.data(), v.data(), qkv.data(), pos.data(), N, H, KV, hd, theta, s0);
    LOOM_CHECK_CLOSE(tol::compare(q, naive_rope(window(qkv, 0, qw), pos, N, H, hd, theta), tol::kSameMathF64, "q"));
    LOOM_CHECK_CLOSE(tol::compare(k, naive_rope(window(qkv, qw, kw), pos, N, KV, hd, theta), tol::kSameMathF64, "k"));
    CHECK(v == window(qkv, qw + kw, kw));

    vector<double> dqkv = poisoned<double>(N * W);
    cpu::rope_qkv_join(dqkv.data(), dq.data(), dk.data(), dv.data(), pos.data(), N, H, KV, hd, theta, s0);
    vector<int32_t> neg(pos.size());  // the rotation by -angle: rope at -pos
    for (size_t i = 0; i < pos.size(); i++) neg[i] = -pos[i];
    LOOM_CHECK_CLOSE(tol::compare(window(dqkv, 0, qw), naive_rope(dq, neg, N, H, hd, theta), tol::kSameMathF64, "dq"));
    LOOM_CHECK_CLOSE(tol::compare(window(dqkv, qw, kw), naive_rope(dk, neg, N, KV, hd, theta), tol::kSameMathF64, "dk"));
    CHECK(window(dqkv, qw + kw, kw) == dv);
  }
}
