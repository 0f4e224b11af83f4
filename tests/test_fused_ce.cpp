// test_fused_ce.cpp: fused_linear_cross_entropy (autograd/ops.h) against the plain path
// linear + cross_entropy, and its memory claim.
//
// 1. Same math: in f64, loss, dL/dh and dL/dW of the fused op equal those of
//    cross_entropy(linear(h, W), targets) to tol::kSameMathF64, for chunk sizes that divide N,
//    do not, are 1, or exceed N, with ignored targets (and all targets ignored).
// 2. Memory: the fused op never holds [N, V]. With the CPU allocation counters of tensor.h we
//    measure the peak bytes above the inputs during forward + backward at N 4096, V 8192,
//    D 64 in f32, and require
//      fused peak  <= chunk*V*4 + 2*(N*D + V*D)*4 + 64 KiB
//                     (the [chunk, V] logits workspace; the op's dh/dW and the leaves' grads;
//                      slack for scalars)
//      plain peak  >= N*V*4   (the logits alone)
//    and print the table. The counters see tensor storage only (not Eigen's internal GEMM
//    panels, which are O(block) and the same for both paths).
#include <catch2/catch.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include "autograd/ops.h"
#include "tests/tolerances.h"

using namespace loom;
using std::vector;

namespace {

struct Result {
  double loss;
  vector<double> dh, dW;
};

Result run(const Tensor& h, const Tensor& W, const Tensor& t, int64_t chunk /* 0: plain path */) {
  h.impl()->grad.reset();
  W.impl()->grad.reset();
  Tensor loss = chunk ? fused_linear_cross_entropy(h, W, t, chunk) : cross_entropy(linear(h, W), t);
  backward(loss);
  Result r;
  r.loss = loss.item();
  r.dh = h.grad().to_vector<double>();
  r.dW = W.grad().to_vector<double>();
  return r;
}

vector<int32_t> targets(int64_t N, int V, Rng& rng, double ignore_frac) {
  vector<int32_t> t(static_cast<size_t>(N));
  for (auto& x : t) x = rng.uniform() < ignore_frac ? -1 : int32_t(rng.randint(V));
  return t;
}

}  // namespace

TEST_CASE("fused linear cross-entropy equals linear + cross_entropy in f64", "[fused_ce]") {
  Rng rng(77);
  struct Shape3 {
    int64_t N;
    int V, D;
  };
  for (Shape3 s : {Shape3{37, 53, 16}, Shape3{1, 7, 3}, Shape3{64, 1030, 5}}) {
    Tensor h = Tensor::randn({s.N, s.D}, rng, 1.0, DType::F64).requires_grad_();
    Tensor W = Tensor::randn({s.V, s.D}, rng, 0.5, DType::F64).requires_grad_();
    Tensor t = Tensor::from_vector(targets(s.N, s.V, rng, 0.25), {s.N});
    if (s.N == 1) t = Tensor::from_vector(vector<int32_t>{6}, {1});  // the last class
    Result ref = run(h, W, t, 0);
    for (int64_t chunk : {int64_t(1), int64_t(5), int64_t(16), s.N, s.N + 100}) {
      INFO("N " << s.N << " V " << s.V << " D " << s.D << " chunk " << chunk);
      Result got = run(h, W, t, chunk);
      vector<double> gl = {got.loss}, rl = {ref.loss};
      LOOM_CHECK_CLOSE(tol::compare(gl, rl, tol::kSameMathF64, "loss"));
      LOOM_CHECK_CLOSE(tol::compare(got.dh, ref.dh, tol::kSameMathF64, "dh"));
      LOOM_CHECK_CLOSE(tol::compare(got.dW, ref.dW, tol::kSameMathF64, "dW"));
    }
  }
  SECTION("every target ignored: loss 0, gradients 0") {
    Tensor h = Tensor::randn({9, 4}, rng, 1.0, DType::F64).requires_grad_();
    Tensor W = Tensor::randn({6, 4}, rng, 1.0, DType::F64).requires_grad_();
    Tensor t = Tensor::from_vector(vector<int32_t>(9, -1), {9});
    Result got = run(h, W, t, 4), ref = run(h, W, t, 0);
    CHECK(got.loss == 0.0);
    CHECK(ref.loss == 0.0);
    for (double g : got.dh) CHECK(g == 0.0);
    for (double g : got.dW) CHECK(g == 0.0);
  }
  SECTION("the incoming dloss scales both gradients; parameter gradients accumulate") {
    Tensor h = Tensor::randn({11, 6}, rng, 1.0, DType::F64).requires_grad_();
    Tensor W = Tensor::randn({13, 6}, rng, 1.0, DType::F64).requires_grad_();
    Tensor t = Tensor::from_vector(targets(11, 13, rng, 0.2), {11});
    Result one = run(h, W, t, 4);
    h.impl()->grad.reset();
    W.impl()->grad.reset();
    backward(scale(fused_linear_cross_entropy(h, W, t, 4), -3.0));
    backward(fused_linear_cross_entropy(h, W, t, 4));  // accumulates: total -2x
    auto dh = h.grad().to_vector<double>(), dW = W.grad().to_vector<double>();
    for (auto& x : one.dh) x *= -2.0;
    for (auto& x : one.dW) x *= -2.0;
    LOOM_CHECK_CLOSE(tol::compare(dh, one.dh, tol::kSameMathF64, "dh"));
    LOOM_CHECK_CLOSE(tol::compare(dW, one.dW, tol::kSameMathF64, "dW"));
  }
}

TEST_CASE("fused linear cross-entropy never holds [N, V]: peak memory", "[fused_ce][memory]") {
  const int64_t N = 4096;
  const int V = 8192, D = 64;
  Rng rng(5);
  Tensor h = Tensor::randn({N, D}, rng, 1.0, DType::F32).requires_grad_();
  Tensor W = Tensor::randn({V, D}, rng, 0.1, DType::F32).requires_grad_();
  Tensor t = Tensor::from_vector(targets(N, V, rng, 0.1), {N});

  struct Row {
    std::string path;
    int64_t chunk;
    size_t peak, bound;
    double loss;
  };
  vector<Row> rows;
  const size_t grads = 2 * size_t(N * D + int64_t(V) * D) * 4;  // op's dh, dW + leaves' grads
  auto measure = [&](int64_t chunk) {
    h.impl()->grad.reset();
    W.impl()->grad.reset();
    size_t base = cpu_bytes_in_use();
    cpu_reset_peak();
    double loss;
    {
      Tensor l = chunk ? fused_linear_cross_entropy(h, W, t, chunk) : cross_entropy(linear(h, W), t);
      backward(l);
      loss = l.item();
    }
    size_t peak = cpu_peak_bytes() - base;
    size_t bound = chunk ? size_t(chunk) * V * 4 + grads + (64u << 10) : size_t(N) * V * 4;
    rows.push_back({chunk ? "fused" : "linear + cross_entropy", chunk, peak, bound, loss});
    return peak;
  };
  size_t fused256 = measure(256);
  size_t fused1024 = measure(1024);
  size_t plain = measure(0);

  std::printf("\nfused linear CE memory, N %lld V %d D %d f32 (peak tensor bytes above the inputs,\n"
              "forward + backward; logits [N, V] alone would be %.1f MiB)\n",
              (long long)N, V, D, double(N) * V * 4 / (1 << 20));
  std::printf("%-24s %6s %12s %14s %10s\n", "path", "chunk", "peak MiB", "bound MiB", "loss");
  for (auto& r : rows)
    std::printf("%-24s %6lld %12.2f %13s%.2f %10.6f\n", r.path.c_str(), (long long)r.chunk,
                double(r.peak) / (1 << 20), r.chunk ? "<= " : ">= ", double(r.bound) / (1 << 20), r.loss);

  CHECK(fused256 <= rows[0].bound);
  CHECK(fused1024 <= rows[1].bound);
  CHECK(plain >= rows[2].bound);
  CHECK(fused1024 > fused256);  // the workspace grows with the chunk
  // the three computations are the same loss (f32, different summation orders)
  CHECK(rows[0].loss == Approx(rows[2].loss).epsilon(1e-5));
  CHECK(rows[1].loss == Approx(rows[2].loss).epsilon(1e-5));
}

// fp16 loss scaling (autograd.h set_loss_scale): the op stores dh, dW for dloss = S and
// multiplies by dloss / S in backward; seeded with S, the gradients are S times the plain
// ones, bit for bit for a power-of-two S (f32: every step is an exact scaling).
TEST_CASE("fused linear cross-entropy under a loss scale", "[fused_ce]") {
  Rng rng(23);
  Tensor h = Tensor::randn({19, 8}, rng, 1.0, DType::F32).requires_grad_();
  Tensor W = Tensor::randn({37, 8}, rng, 0.5, DType::F32).requires_grad_();
  Tensor t = Tensor::from_vector(targets(19, 37, rng, 0.2), {19});
  backward(fused_linear_cross_entropy(h, W, t, 5));
  auto dh1 = h.grad().to_vector<double>(), dW1 = W.grad().to_vector<double>();
  h.impl()->grad.reset();
  W.impl()->grad.reset();
  const float S = 4096.f;
  Tensor scale_t = Tensor::from_vector(vector<float>{S}, {1});
  set_loss_scale(scale_t);
  Tensor loss = fused_linear_cross_entropy(h, W, t, 5);
  backward(loss, scale_t.reshape(loss.shape()));
  set_loss_scale(Tensor());
  auto dh = h.grad().to_vector<double>(), dW = W.grad().to_vector<double>();
  for (auto& x : dh1) x *= S;
  for (auto& x : dW1) x *= S;
  CHECK(dh == dh1);
  CHECK(dW == dW1);
  CHECK_THROWS_WITH(set_loss_scale(Tensor::from_vector(vector<float>{1.f, 2.f}, {2})),
                    Catch::Contains("set_loss_scale"));
}
