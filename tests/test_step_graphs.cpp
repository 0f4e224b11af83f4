// test_step_graphs.cpp: what lets one CUDA graph serve many packed VLM steps (trainer.cpp):
// the rounded batch shapes compute the same loss and gradients (on the CPU, in double), and
// StepGraphCache's rule for which shapes it captures. The graphs themselves need a GPU:
// `bash tools/gpu-ci.sh graphs` compares the first 20 losses with them on and off.
#include <catch2/catch.hpp>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "data/chat.h"
#include "data/packing.h"
#include "nn/vlm.h"
#include "tests/tolerances.h"
#include "trainer/staging.h"

using namespace loom;
using Catch::Matchers::Contains;

TEST_CASE("rounded batch shapes: empty sequences, a longer max_seqlen and loss rows without a target "
          "change no loss and no gradient", "[trainer]") {
  // What a CUDA run does to its packed batches so that one graph serves many (trainer.cpp):
  // round_batch_shapes and loss_rows_of(..., multiple). The same math either way, in double.
  VLMConfig c;
  c.vit = ViTConfig{16, 4, 3, 16, 1, 2, 2, 1e-6};  // 4x4 patches -> 4 image tokens
  c.lm.vocab = 40;
  c.lm.dim = 16;
  c.lm.depth = 2;
  c.lm.heads = 2;
  c.lm.kv_heads = 1;
  c.lm.hidden = 32;
  c.image_token = 3;
  const int ti = c.image_tokens(), row_len = 48;
  std::mt19937 g(uint32_t(std::random_device{}()));
  std::vector<Sample> samples;
  for (int i = 0; i < 9; i++) {
    Sample smp;
    smp.image = i;
    const int L = std::uniform_int_distribution<int>(ti + 3, 20)(g);
    for (int t = 0; t < L; t++) {
      const bool img = t < ti;
      const int32_t id = img ? 3 : std::uniform_int_distribution<int32_t>(4, 39)(g);
      smp.ids.push_back(id);
      smp.labels.push_back(t < ti + 2 ? kIgnoreLabel : id);  // image and a 2-token prompt: no target
    }
    samples.push_back(smp);
  }
  std::vector<std::vector<int>> rows = plan_rows(samples, row_len, true, true, nullptr);
  PackedBatch plain = build_batch(samples, rows, row_len, 0, 3), rounded = plain;
  round_batch_shapes(rounded, 8, 32);
  INFO("seed-free draw: " << plain.cu_seqlens.size() - 1 << " sequences, max " << plain.max_seqlen);
  REQUIRE((rounded.cu_seqlens.size() - 1) % 8 == 0);
  REQUIRE((rounded.max_seqlen % 32 == 0 || rounded.max_seqlen == row_len));  // rounded up, at most the row
  REQUIRE(rounded.max_seqlen >= plain.max_seqlen);
  Rng rng(11);
  std::vector<double> px(size_t(plain.images.size()) * 3 * 16 * 16);
  for (auto& x : px) x = rng.normal();
  auto run = [&](const PackedBatch& pb, int64_t multiple, int64_t* nk) {
    Rng init(5);
    VLM m(c, Init{DType::F64, Device::CPU, &init});
    VLMBatch b;
    const int64_t n = int64_t(pb.ids.size());
    b.images = Tensor::from_vector(px, {int64_t(pb.images.size()), 3, 16, 16});
    b.ids = Tensor::from_vector(pb.ids, {n});
    b.pos = Tensor::from_vector(pb.pos, {n});
    b.targets = Tensor::from_vector(pb.targets, {n});
    b.image_positions = Tensor::from_vector(pb.image_positions, {int64_t(pb.image_positions.size())});
    b.seq = SeqInfo::packed(pb.cu_seqlens, Device::CPU);
    b.seq.max_seqlen = pb.max_seqlen;
    std::vector<int32_t> lr, lt;
    loss_rows_of(pb.targets, lr, lt, multiple);
    *nk = int64_t(lr.size());
    b.loss_rows = Tensor::from_vector(lr, {int64_t(lr.size())});
    b.loss_targets = Tensor::from_vector(lt, {int64_t(lt.size())});
    Tensor loss = m.loss(b);
    backward(loss);
    std::vector<double> out = loss.to_vector<double>();
    for (auto& [pn, t] : m.named_parameters()) {  // every parameter's gradient, in one order
      REQUIRE(t->grad().defined());
      auto gv = t->grad().to_vector<double>();
      out.insert(out.end(), gv.begin(), gv.end());
    }
    return out;
  };
  int64_t with = 0, nk_plain = 0, nk_round = 0;
  for (int32_t t : plain.targets) with += t >= 0;
  const int64_t multiple = with + 5;  // five rows without a target go through the head
  std::vector<double> a = run(plain, 1, &nk_plain), b = run(rounded, multiple, &nk_round);
  REQUIRE(nk_plain == with);
  REQUIRE(nk_round == multiple);
  REQUIRE(a.size() == b.size());
  REQUIRE(a.size() > 1);
  tol::Report r = tol::compare(b, a, tol::kSameMathF64, "rounded vs plain batch");
  INFO(r.text);
  CHECK(r.ok);
}

TEST_CASE("StepGraphCache: a shape is captured once it repeats often enough, replayed after, at most cap shapes",
          "[trainer]") {
  auto pool = std::make_shared<PinnedPool>(Device::CPU);
  auto batch = [&](int64_t n, int64_t nseq) {
    StagedBatch b(pool, StagedBatch::bytes_for({{DType::I32, n}, {DType::BF16, 2 * n}}));
    b.add("ids", DType::I32, {n});
    b.add("images", DType::BF16, {2, n});
    b.meta["nseq"] = nseq;
    b.meta["real_tokens"] = n - 1;  // not a shape: left out of the key below
    return b;
  };
  const std::vector<std::string> meta{"nseq"};
  const std::string a = shape_key(batch(8, 2), meta);
  CHECK(a == shape_key(batch(8, 2), meta));
  CHECK(a != shape_key(batch(9, 2), meta));   // a field's shape
  CHECK(a != shape_key(batch(8, 3), meta));   // a meta value
  CHECK(a != shape_key(batch(8, 2), {}));
  CHECK_THROWS_WITH(shape_key(batch(8, 2), {"max_seqlen"}), Contains("max_seqlen"));
  const std::string b = shape_key(batch(16, 2), meta), d = shape_key(batch(32, 2), meta),
                    e = shape_key(batch(64, 2), meta);

  StepGraphCache c(2, 4, 2);  // two graphs, a shape captured when it is 2 of the last 4 steps
  CHECK(c.find(a, true) == nullptr);  // first sight: eager
  StepGraph* g = c.find(a, true);     // second: a graph to capture
  REQUIRE(g != nullptr);
  CHECK(!g->ready());
  CHECK(c.find(a, true) == g);        // then the same one
  CHECK(c.find(a, false) == g);       // a graph that exists runs whatever may_capture says
  CHECK(c.find(b, false) == nullptr);  // may_capture false: eager, but the sight counts
  CHECK(c.find(d, true) == nullptr);  // window a a b d
  CHECK(c.find(e, true) == nullptr);  // a b d e
  StepGraph* gd = c.find(d, true);    // b d e d: d is 2 of the last 4
  CHECK(gd != nullptr);
  CHECK(gd != g);
  CHECK(c.size() == 2);
  CHECK(c.find(b, true) == nullptr);  // d e d b: b's first sight fell out of the window
  CHECK(c.find(e, true) == nullptr);  // e d b e: e twice, but the cache is full: eager
  CHECK(c.find(e, true) == nullptr);
  CHECK(c.size() == 2);
  CHECK(c.replays() == 4);  // a: 3 (its capture included), d: 1

  // shapes that seldom repeat (each twice, far apart) are never captured with the default rule
  StepGraphCache r(64);
  for (int i = 0; i < 60; i++) CHECK(r.find(shape_key(batch(1 + i % 30, 2), meta), true) == nullptr);
  CHECK(r.size() == 0);
  // one shape every step: captured at its fourth sight
  StepGraphCache one(64);
  for (int i = 0; i < 3; i++) CHECK(one.find(a, true) == nullptr);
  CHECK(one.find(a, true) != nullptr);
}
