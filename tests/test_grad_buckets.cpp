// test_grad_buckets.cpp: data parallel's gradient buckets (trainer/grad_buckets.h) on the CPU.
// The property that makes averaging beside the backward correct: nothing writes a bucket's
// gradients after it was launched. The launch callback here copies the bucket's values; after
// the backward every copy must equal the bucket's final values bit for bit, in a small network
// with a weight used twice, a block recomputed by checkpoint() and a frozen parameter. And the
// property that keeps the ranks' collectives matched: every backward launches the buckets in
// one order (index order in the first, the learned order() after), also when a step leaves a
// parameter unused.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <random>

#include "autograd/ops.h"
#include "optim/optimizer.h"
#include "trainer/grad_buckets.h"

using namespace loom;
using Catch::Matchers::Contains;

namespace {

struct Net {
  Tensor w1, b1, w2, b2, shared, gain, frozen;
  explicit Net(Rng& rng) {
    w1 = Tensor::randn({32, 16}, rng, 0.3);
    b1 = Tensor::randn({32}, rng, 0.1);
    w2 = Tensor::randn({32, 32}, rng, 0.2);
    b2 = Tensor::randn({32}, rng, 0.1);
    shared = Tensor::randn({8, 32}, rng, 0.2);  // used twice: two writes a backward
    gain = Tensor::randn({32}, rng, 0.5);
    frozen = Tensor::randn({32}, rng, 0.5);
    for (Tensor* t : {&w1, &b1, &w2, &b2, &shared, &gain}) t->requires_grad_(true);
  }
  std::vector<ParamGroup> groups() {
    return {{"matrices", 1.0, 0.1, {{"w1", &w1}, {"w2", &w2}, {"shared", &shared}}},
            {"vectors", 1.0, 0.0, {{"b1", &b1}, {"b2", &b2}, {"gain", &gain}, {"frozen", &frozen}}}};
  }
  // extra_use: one more use of w2 (the graph of a later step that differs from the first);
  // skip_gain: gain unused (a step that leaves a parameter out: its bucket is never complete)
  Tensor loss(const Tensor& x, bool extra_use = false, bool skip_gain = false) {
    Tensor h = gelu(linear(x, w1, b1));
    Tensor w2_ = w2, b2_ = b2;
    h = checkpoint([w2_, b2_](const Tensor& t) { return gelu(linear(t, w2_, b2_)); }, h);  // recomputed
    if (!skip_gain) h = mul(h, expand(reshape(gain, {1, 32}), h.shape()));
    h = add(h, mul(h, expand(reshape(frozen, {1, 32}), h.shape())));
    if (extra_use) h = linear(h, w2);
    Tensor a = linear(h, shared), b = linear(scale(h, 0.5), shared);
    return mean(mul(add(a, b), add(a, b)));
  }
};

struct Launched {
  GradBuckets::Bucket bucket;
  std::vector<float> values;  // at the launch
};

int index_of(const GradBuckets& gb, const GradBuckets::Bucket& b) {
  for (size_t k = 0; k < gb.buckets().size(); k++) {
    const auto& c = gb.buckets()[k];
    if (c.buffer == b.buffer && c.offset == b.offset && c.numel == b.numel) return int(k);
  }
  return -1;
}

}  // namespace

TEST_CASE("gradient buckets: a launched bucket is never written again in that backward", "[distributed]") {
  const uint64_t seed = std::random_device{}();
  INFO("seed " << seed);
  Rng rng(seed);
  Net net(rng);
  Optimizer opt(net.groups(), OptimConfig{}, DType::F32, Device::CPU);
  std::vector<Launched> got;
  auto launch = [&](const Tensor& buf, const GradBuckets::Bucket& b) {
    const float* p = buf.data<float>() + b.offset;
    got.push_back({b, std::vector<float>(p, p + b.numel)});
  };
  // 128-byte buckets: 32 floats, so each parameter is a bucket of its own, and the vectors'
  // buckets complete between the matrices' (gain before w2): a learned order that is not the
  // index order
  GradBuckets gb(opt.grad_buffers(), opt.grad_offsets(), 128, launch);
  REQUIRE(gb.buckets().size() >= 6);
  std::vector<int64_t> covered(opt.grad_buffers().size(), 0);
  for (auto& b : gb.buckets()) covered[size_t(b.buffer)] += b.numel;
  for (size_t i = 0; i < covered.size(); i++) CHECK(covered[i] == opt.grad_buffers()[i].numel());

  // step 3 leaves gain out: its bucket is incomplete, the ones after it in order() wait for
  // finish(), and the launches keep the order
  for (int step = 0; step < 4; step++) {
    INFO("backward " << step);
    got.clear();
    opt.zero_grad();
    Tensor x = Tensor::randn({6, 16}, rng);
    Tensor l = net.loss(x, false, step == 3);
    gb.begin();
    backward(l);
    gb.finish();
    CHECK(got.size() == gb.buckets().size());  // each bucket once
    std::vector<int> seq;
    for (auto& g : got) {
      const float* now = opt.grad_buffers()[size_t(g.bucket.buffer)].data<float>() + g.bucket.offset;
      CHECK(std::memcmp(now, g.values.data(), g.values.size() * sizeof(float)) == 0);
      seq.push_back(index_of(gb, g.bucket));
    }
    if (step == 0) {
      CHECK(gb.launched_early() == 0);  // the first backward only counts, and launches in index order
      for (size_t k = 0; k < seq.size(); k++) CHECK(seq[k] == int(k));
    } else {
      CHECK(seq == gb.order());  // later ones in the learned order, while the backward runs
      if (step < 3) CHECK(gb.launched_early() >= 2);
      else CHECK(gb.launched_early() < int(gb.buckets().size()));
    }
  }
  // the learned order is a permutation, not the index order here, and its hash tells the two
  // apart
  std::vector<int> sorted = gb.order();
  std::sort(sorted.begin(), sorted.end());
  for (size_t k = 0; k < sorted.size(); k++) CHECK(sorted[k] == int(k));
  const double learned = gb.order_fingerprint();
  std::vector<int> index(gb.order().size());
  for (size_t k = 0; k < index.size(); k++) index[k] = int(k);
  CHECK(gb.order() != index);
  gb.use_index_order();
  CHECK(gb.order() == index);
  CHECK(gb.order_fingerprint() != learned);
  SECTION("a later graph that writes a parameter more often is an error, not a wrong average") {
    Tensor l = net.loss(Tensor::randn({6, 16}, rng), true);
    gb.begin();
    CHECK_THROWS_WITH(backward(l), Contains("the step's graph changed") && Contains("train.dist_bucket_mb = 0"));
    clear_tape();
    set_backward_observer(nullptr);
  }
}

TEST_CASE("gradient buckets: whole parameters, the buffers' last parameters first", "[distributed]") {
  Tensor buf = Tensor::zeros({100}, DType::F32);
  std::vector<std::vector<int64_t>> offsets = {{0, 10, 40, 45, 90}};  // sizes 10, 30, 5, 45, 10
  GradBuckets gb({buf}, offsets, 40 * 4, [](const Tensor&, const GradBuckets::Bucket&) {});
  // from the end: 10 -> +45 would pass 40: [90, 100); 45 alone [45, 90); 5 + 30 = 35 [10, 45);
  // then 10 more would pass 40: [0, 10)
  REQUIRE(gb.buckets().size() == 4);
  const int64_t want[4][2] = {{90, 10}, {45, 45}, {10, 35}, {0, 10}};
  for (int i = 0; i < 4; i++) {
    CHECK(gb.buckets()[size_t(i)].offset == want[i][0]);
    CHECK(gb.buckets()[size_t(i)].numel == want[i][1]);
  }
}
