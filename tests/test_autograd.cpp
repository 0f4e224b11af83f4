// test_autograd.cpp: the tape's semantics (autograd/autograd.h).
//
// - backward walks the tape in reverse recording order, and skips nodes nothing flowed into;
// - parameter (leaf) gradients accumulate: two forward+backward passes give exactly twice the
//   gradients of one, bit for bit in f64, for a small ViT and a small LM from nn/;
// - NoGradGuard records nothing;
// - a tensor used twice gets the sum of both gradients, and two inputs never share one buffer;
// - activation gradients and saved tensors are freed by backward;
// - backward refuses a non-scalar root without a seed, a wrong seed, and a root nothing recorded.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "autograd/ops.h"
#include "nn/lm.h"
#include "nn/mim.h"
#include "nn/vit.h"
#include "tests/tolerances.h"

using namespace loom;
using Catch::Contains;
using std::string;
using std::vector;

namespace {

Tensor leaf(const Shape& s, Rng& rng) { return Tensor::randn(s, rng, 1.0, DType::F64).requires_grad_(); }

// out = in (a copy), recording a node that logs `id` when its backward runs
Tensor logged(const Tensor& in, int id, vector<int>& log) {
  Tensor out = in.clone();
  record("logged", {out}, [in, out, id, &log]() {
    log.push_back(id);
    accumulate_grad(in, grad_of(out));
  });
  return out;
}

bool bitwise_equal(const vector<double>& a, const vector<double>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0);
}

// every parameter's gradient (zeros for a parameter nothing reached)
std::map<string, vector<double>> grads_of(Module& m) {
  std::map<string, vector<double>> g;
  for (auto& [name, t] : m.named_parameters())
    g[name] = t->grad().defined() ? t->grad().to_vector<double>() : vector<double>(size_t(t->numel()), 0.0);
  return g;
}

// the tests' ViT: 12 px images of 4 px patches (9 tokens), 16 wide, 2 heads, MLP 32
ViTConfig tiny_vit(int depth) {
  ViTConfig c;
  c.image_size = 12;
  c.patch_size = 4;
  c.channels = 3;
  c.dim = 16;
  c.depth = depth;
  c.heads = 2;
  c.mlp_ratio = 2;
  return c;
}

// every parameter's gradient equal to same-math tolerance in f64 (another summation order)
void check_same_grads(const std::map<string, vector<double>>& got, const std::map<string, vector<double>>& want) {
  REQUIRE(got.size() == want.size());
  for (auto& [name, a] : want) {
    INFO("parameter " << name);
    LOOM_CHECK_CLOSE(tol::compare(got.at(name), a, tol::kSameMathF64, name.c_str()));
  }
}

void zero_grads(Module& m) {
  for (auto& [name, t] : m.named_parameters()) t->impl()->grad.reset();
}

// second == 2 * first for every parameter; `exact` names the ones that must match bit for bit
void check_twice(const std::map<string, vector<double>>& g1, const std::map<string, vector<double>>& g2,
                 const std::function<bool(const string&)>& exact) {
  for (auto& [name, a] : g1) {
    INFO("parameter " << name);
    const auto& b = g2.at(name);
    vector<double> twice(a.size());
    double norm = 0;
    for (size_t i = 0; i < a.size(); i++) {
      twice[i] = 2.0 * a[i];  // exact in binary floating point
      norm += a[i] * a[i];
    }
    CHECK(norm > 0);  // every parameter got a gradient (else "2x" proves nothing)
    if (exact(name)) CHECK(bitwise_equal(b, twice));
    else LOOM_CHECK_CLOSE(tol::compare(b, twice, tol::kSameMathF64, name.c_str()));
  }
}

}  // namespace

TEST_CASE("backward walks the tape in reverse and skips nodes without a gradient", "[autograd]") {
  Rng rng(1);
  Tensor x = leaf({3, 4}, rng);
  vector<int> log;
  Tensor a = logged(x, 1, log);
  Tensor unused = logged(x, 99, log);  // recorded, but the loss never reads it
  Tensor b = logged(a, 2, log);
  Tensor c = logged(b, 3, log);
  Tensor loss = sum(c);
  CHECK(tape_size() == 5);
  CHECK(a.requires_grad());
  CHECK(a.impl()->tape_id == 0);
  CHECK(c.impl()->tape_id == 3);
  backward(loss);
  CHECK(log == vector<int>{3, 2, 1});
  CHECK(tape_size() == 0);
  CHECK(c.impl()->tape_id == -1);
  REQUIRE(x.grad().defined());
  for (double g : x.grad().to_vector<double>()) CHECK(g == 1.0);
}

TEST_CASE("parameter gradients accumulate: two passes give exactly twice one pass", "[autograd]") {
  SECTION("ViT, 2 blocks, f64") {
    Rng rng(2);
    ViT vit(tiny_vit(2), Init{DType::F64, Device::CPU, &rng});
    Tensor images = Tensor::randn({2, 3, 12, 12}, rng, 1.0, DType::F64);
    Tensor R = Tensor::randn({2, 9, 16}, rng, 1.0, DType::F64);
    auto pass = [&]() { backward(sum(mul(vit.forward(images), R))); };
    zero_grads(vit);
    pass();
    auto g1 = grads_of(vit);
    pass();
    auto g2 = grads_of(vit);
    check_twice(g1, g2, [](const string&) { return true; });
    // zeroing starts over: a third pass after a reset equals the first
    zero_grads(vit);
    pass();
    auto g3 = grads_of(vit);
    for (auto& [name, a] : g1) {
      INFO(name);
      CHECK(bitwise_equal(g3.at(name), a));
    }
  }
  SECTION("LM, 2 layers, GQA, packed ragged batch, tied head, f64") {
    Rng rng(3);
    LMConfig c;
    c.vocab = 23;
    c.dim = 16;
    c.depth = 2;
    c.heads = 4;
    c.kv_heads = 2;
    c.hidden = 24;
    LM lm(c, Init{DType::F64, Device::CPU, &rng});
    lm.loss_chunk = 5;
    vector<int32_t> cu = {0, 6, 13};
    SeqInfo seq = SeqInfo::packed(cu, Device::CPU);
    vector<int32_t> ids(13), pos(13), tgt(13);
    for (int i = 0; i < 13; i++) {
      ids[size_t(i)] = int32_t(rng.randint(c.vocab));
      tgt[size_t(i)] = i == 5 || i == 12 || i == 8 ? -1 : int32_t(rng.randint(c.vocab));
      pos[size_t(i)] = i < 6 ? i : i - 6;
    }
    Tensor tid = Tensor::from_vector(ids, {13}), tpos = Tensor::from_vector(pos, {13});
    Tensor ttgt = Tensor::from_vector(tgt, {13});
    auto pass = [&]() {
      Tensor h = lm.hidden(embedding(tid, lm.embed_tokens), tpos, seq);
      backward(lm.loss(h, ttgt));
    };
    zero_grads(lm);
    pass();
    auto g1 = grads_of(lm);
    pass();
    auto g2 = grads_of(lm);
    // The tied embedding receives two `+=` per backward (the head, then the embedding rows);
    // on the second pass they land on a non-zero buffer, so (G + h) + e need not round like
    // 2 (h + e): equal to same-math tolerance, not bit for bit. Every other parameter has one
    // consumer and must be exact.
    check_twice(g1, g2, [](const string& n) { return n != "embed_tokens.weight"; });
  }
}

// ViT::forward with out_rows runs its last block after the attention on the chosen tokens
// alone (the MIM's target and predictor): the same output and parameter gradients as
// gather_rows of the full output, with kept tokens, with and without gradient checkpointing,
// and for a one-block stack. A row index mixed up in the backward (a gradient scattered to
// the wrong token) shows in the parameters before the last block.
TEST_CASE("ViT output rows: the last block on chosen tokens equals gathering the full output", "[autograd]") {
  for (int depth : {1, 2})
    for (bool ckpt : {false, true}) {
      INFO("depth " << depth << (ckpt ? ", checkpointed" : ""));
      Rng rng(40 + depth);
      ViT vit(tiny_vit(depth), Init{DType::F64, Device::CPU, &rng});
      vit.checkpoint_blocks = ckpt;
      Tensor images = Tensor::randn({2, 3, 12, 12}, rng, 1.0, DType::F64);
      Tensor keep = Tensor::from_vector(vector<int32_t>{8, 0, 3, 5, 1, 7, 2, 4, 6, 0, 1, 2, 3, 5}, {2, 7});
      Tensor sel = Tensor::from_vector(vector<int32_t>{6, 2, 0, 4, 1, 3}, {2, 3});  // among the 7 kept
      Tensor R = Tensor::randn({2, 3, 16}, rng, 1.0, DType::F64);
      zero_grads(vit);
      Tensor full = gather_rows(vit.forward(images, keep), sel);
      backward(sum(mul(full, R)));
      auto g_full = grads_of(vit);
      zero_grads(vit);
      Tensor part = vit.forward(images, keep, sel);
      backward(sum(mul(part, R)));
      auto g_part = grads_of(vit);
      REQUIRE(part.shape() == full.shape());
      LOOM_CHECK_CLOSE(tol::compare(part.to_vector<double>(), full.to_vector<double>(), tol::kSameMathF64, "out"));
      check_same_grads(g_part, g_full);
    }
}

// vit_stack's repeat: the blocks before the last on B samples, their output repeated along the
// batch before the last block, equal every block on the repeated images (values and parameter
// gradients; the repeat is differentiable, though the MIM target that uses it has none).
// Checked to fail when the repeat interleaves the samples (b r instead of r b) and when the last
// block keeps the unrepeated offsets.
TEST_CASE("ViT repeat before the last block equals every block on the repeated images", "[autograd]") {
  for (int depth : {1, 2, 3})
    for (bool ckpt : {false, true}) {
      INFO("depth " << depth << (ckpt ? ", checkpointed" : ""));
      Rng rng(70 + depth);
      ViT vit(tiny_vit(depth), Init{DType::F64, Device::CPU, &rng});
      vit.checkpoint_blocks = ckpt;
      const int B = 2, V = 3;
      Tensor images = Tensor::randn({B, 3, 12, 12}, rng, 1.0, DType::F64);
      Tensor stacked = Tensor::empty({V * B, 3, 12, 12}, DType::F64);
      for (int r = 0; r < V; r++) stacked.narrow(0, r * B, B).copy_(images);
      // each repeat picks other tokens of its sample (distinct within a row, 9 tokens)
      Tensor sel = Tensor::from_vector(vector<int32_t>{0, 4, 8, 1, 2, 3, 5, 6, 7, 8, 2, 0, 3, 1, 4, 7, 6, 5}, {V * B, 3});
      Tensor R = Tensor::randn({V * B, 3, 16}, rng, 1.0, DType::F64);
      zero_grads(vit);
      Tensor want = vit.forward(stacked, Tensor(), sel);
      backward(sum(mul(want, R)));
      auto g_want = grads_of(vit);
      zero_grads(vit);
      Tensor got = vit.forward_patches(vit.patches(images), Tensor(), sel, V);
      backward(sum(mul(got, R)));
      auto g_got = grads_of(vit);
      REQUIRE(got.shape() == want.shape());
      LOOM_CHECK_CLOSE(tol::compare(got.to_vector<double>(), want.to_vector<double>(), tol::kSameMathF64, "out"));
      check_same_grads(g_got, g_want);
    }
  Rng rng(79);
  ViT vit(tiny_vit(1), Init{DType::F64, Device::CPU, &rng});
  Tensor p = vit.patches(Tensor::randn({2, 3, 12, 12}, rng, 1.0, DType::F64));
  Tensor sel = Tensor::from_vector(vector<int32_t>{0, 1, 2, 3}, {2, 2});
  CHECK_THROWS_WITH(vit.forward_patches(p, Tensor(), sel, 2), Catch::Contains("out_rows"));
  CHECK_THROWS_WITH(vit.forward_patches(p, Tensor(), Tensor(), 0), Catch::Contains("repeat must be >= 1"));
}

// ViT::forward with kept patches embeds only those (their pixels gathered, the product on K
// rows, positions looked up by index and added in the product): the same output and parameter
// gradients, pos_embed's among them, as embedding every patch and gathering the kept rows.
TEST_CASE("ViT kept patches: embedding only those equals gathering the full embedding", "[autograd]") {
  Rng rng(50);
  ViT vit(tiny_vit(1), Init{DType::F64, Device::CPU, &rng});
  Tensor images = Tensor::randn({2, 3, 12, 12}, rng, 1.0, DType::F64);
  Tensor keep = Tensor::from_vector(vector<int32_t>{8, 0, 3, 5, 2, 1, 7, 4, 6, 0}, {2, 5});
  Tensor R = Tensor::randn({2, 5, 16}, rng, 1.0, DType::F64);
  zero_grads(vit);
  Tensor x = gather_rows(vit.embed(images), keep);
  Tensor ref = vit_stack(vit.blocks, vit.norm, x, SeqInfo::dense(2, 5, Device::CPU), false);
  backward(sum(mul(ref, R)));
  auto g_ref = grads_of(vit);
  zero_grads(vit);
  Tensor out = vit.forward(images, keep);
  backward(sum(mul(out, R)));
  auto g_out = grads_of(vit);
  REQUIRE(out.shape() == ref.shape());
  LOOM_CHECK_CLOSE(tol::compare(out.to_vector<double>(), ref.to_vector<double>(), tol::kSameMathF64, "out"));
  check_same_grads(g_out, g_ref);
}

namespace {
// the tests' LatentMIM: tiny_vit(2) encoders, a predictor 8 wide with one block of two heads
MIMConfig tiny_mim(bool contrastive) {
  MIMConfig c;
  c.vit = tiny_vit(2);
  c.pred_dim = 8;
  c.pred_depth = 1;
  c.pred_heads = 2;
  c.contrastive = contrastive;
  return c;
}

// the target made to differ from the encoder (as after EMA steps), so a mix-up between them shows
void target_apart(LatentMIM& m, Rng& rng) {
  for (auto& [name, p] : m.target.named_parameters()) p->copy_(Tensor::randn(p->shape(), rng, 0.1, DType::F64));
}
}  // namespace

// LatentMIM runs views of one shape as one batch (batch_views): the same loss and parameter
// gradients as one pass per view, plain and contrastive, each view with its own images and
// masks. Checked to fail when both pooled parts come from the first view's rows, and when the
// views' images are stacked in the other order than their masks.
TEST_CASE("LatentMIM: views as one batch equal one pass per view", "[autograd]") {
  for (bool contrastive : {false, true}) {
    INFO((contrastive ? "contrastive" : "two plain views"));
    Rng rng(60 + int(contrastive));
    const MIMConfig c = tiny_mim(contrastive);
    LatentMIM m(c, Init{DType::F64, Device::CPU, &rng});
    target_apart(m, rng);
    std::vector<MIMView> views;
    for (int v = 0; v < 2; v++)
      views.push_back(make_view(Tensor::randn({3, 3, 12, 12}, rng, 1.0, DType::F64), c, rng, Device::CPU));
    auto run = [&](bool batch) {
      m.batch_views = batch;
      zero_grads(m);
      Tensor loss = m.forward(views);
      backward(loss);
      return std::make_pair(loss.item(), grads_of(m));
    };
    auto [l_one, g_one] = run(false);
    auto [l_batch, g_batch] = run(true);
    LOOM_CHECK_CLOSE(tol::compare(vector<double>{l_batch}, vector<double>{l_one}, tol::kSameMathF64, "loss"));
    check_same_grads(g_batch, g_one);
  }
}

// train.shared_target: two masked views of the same images (one tensor) run the target's
// blocks before its last once; the loss and every gradient equal running it once per view
// (shared_target off). Views of other images never share: their loss is the same with it on.
// Checked to fail with the repeat interleaved and with the last block on the unrepeated offsets.
TEST_CASE("LatentMIM: the target shared by views of the same images", "[autograd]") {
  for (bool contrastive : {false, true}) {
    INFO((contrastive ? "contrastive" : "two plain views"));
    Rng rng(80 + int(contrastive));
    const MIMConfig c = tiny_mim(contrastive);
    LatentMIM m(c, Init{DType::F64, Device::CPU, &rng});
    target_apart(m, rng);
    Tensor images = Tensor::randn({3, 3, 12, 12}, rng, 1.0, DType::F64);
    std::vector<MIMView> views;
    for (int v = 0; v < 2; v++) views.push_back(make_view(images, c, rng, Device::CPU));
    views[1].images = views[0].images;  // one tensor, as the trainer's views
    auto run = [&](bool shared, const std::vector<MIMView>& vs) {
      m.shared_target = shared;
      zero_grads(m);
      Tensor loss = m.forward(vs);
      backward(loss);
      return std::make_pair(loss.item(), grads_of(m));
    };
    auto [l_own, g_own] = run(false, views);
    auto [l_shared, g_shared] = run(true, views);
    LOOM_CHECK_CLOSE(tol::compare(vector<double>{l_shared}, vector<double>{l_own}, tol::kSameMathF64, "loss"));
    check_same_grads(g_shared, g_own);
    // the same pixels in another tensor: not shared, the same loss
    std::vector<MIMView> copies = views;
    copies[1].images = views[0].images.clone();
    auto [l_copies, g_copies] = run(true, copies);
    LOOM_CHECK_CLOSE(tol::compare(vector<double>{l_copies}, vector<double>{l_own}, tol::kSameMathF64, "loss"));
  }
}

TEST_CASE("NoGradGuard records nothing", "[autograd]") {
  Rng rng(4);
  Tensor x = leaf({5, 6}, rng), w = leaf({3, 6}, rng);
  clear_tape();
  {
    NoGradGuard ng;
    CHECK_FALSE(grad_enabled());
    Tensor y = sum(gelu(linear(x, w)));
    y = mul(y, y);
    CHECK(tape_size() == 0);
    CHECK_FALSE(y.requires_grad());
    REQUIRE_THROWS_WITH(backward(y), Contains("does not require grad"));
    {
      NoGradGuard nested;
    }
    CHECK_FALSE(grad_enabled());  // the inner guard restores the outer state
  }
  CHECK(grad_enabled());
  Tensor y = sum(linear(x, w));
  CHECK(tape_size() == 2);
  backward(y);
  CHECK(w.grad().defined());
  CHECK(tape_size() == 0);
}

TEST_CASE("a tensor used twice gets the summed gradient", "[autograd]") {
  Rng rng(5);
  Tensor x = leaf({4, 3}, rng);
  auto xv = x.to_vector<double>();
  SECTION("x + x") {
    backward(sum(add(x, x)));
    for (double g : x.grad().to_vector<double>()) CHECK(g == 2.0);
  }
  SECTION("x * x") {
    backward(sum(mul(x, x)));
    auto g = x.grad().to_vector<double>();
    for (size_t i = 0; i < g.size(); i++) CHECK(g[i] == 2.0 * xv[i]);
  }
  SECTION("x feeding two branches of different ops") {
    backward(sum(add(scale(x, 3.0), unary(x, UnaryOp::Square))));
    auto g = x.grad().to_vector<double>();
    for (size_t i = 0; i < g.size(); i++) CHECK(g[i] == Approx(3.0 + 2.0 * xv[i]).epsilon(1e-15));
  }
  SECTION("two inputs passed the same gradient never share one buffer") {
    Tensor y = leaf({4, 3}, rng);
    backward(sum(add(x, y)));
    REQUIRE(x.grad().defined());
    REQUIRE(y.grad().defined());
    CHECK(x.grad().impl()->storage != y.grad().impl()->storage);
    x.grad().fill_(5.0);  // writing one must not change the other
    for (double g : y.grad().to_vector<double>()) CHECK(g == 1.0);
  }
  SECTION("an activation used twice passes the sum on") {
    Tensor h = scale(x, 2.0);
    backward(sum(mul(h, h)));  // d/dx (2x)^2 = 8x
    auto g = x.grad().to_vector<double>();
    for (size_t i = 0; i < g.size(); i++) CHECK(g[i] == Approx(8.0 * xv[i]).epsilon(1e-15));
  }
}

TEST_CASE("activation gradients and saved tensors are freed after backward", "[autograd]") {
  Rng rng(6);
  Tensor x = leaf({64, 32}, rng), w = leaf({48, 32}, rng), b = leaf({48}, rng);
  size_t before = cpu_bytes_in_use();
  {
    Tensor h = linear(x, w, b);
    Tensor a = gelu(h);
    Tensor loss = mean(mul(a, a));
    CHECK(cpu_bytes_in_use() > before);
    backward(loss);
    CHECK_FALSE(h.grad().defined());
    CHECK_FALSE(a.grad().defined());
    CHECK_FALSE(loss.grad().defined());
    CHECK(x.grad().defined());
    CHECK(w.grad().defined());
    CHECK(b.grad().defined());
  }
  // once the activations go out of scope, only the three leaf gradients remain
  size_t leaf_grads = x.grad().nbytes() + w.grad().nbytes() + b.grad().nbytes();
  CHECK(cpu_bytes_in_use() == before + leaf_grads);
}

TEST_CASE("backward preconditions", "[autograd]") {
  Rng rng(7);
  Tensor x = leaf({4, 7}, rng);
  Tensor y = scale(x, 2.0);
  REQUIRE_THROWS_WITH(backward(y), Contains("not a scalar") && Contains("[4, 7]"));
  REQUIRE_THROWS_WITH(backward(y, Tensor::zeros({7, 4}, DType::F64)), Contains("[7, 4]") && Contains("[4, 7]"));
  clear_tape();
  // with a seed of the root's shape, backward runs: d(2x)/dx * seed
  Tensor z = scale(x, 2.0);
  Tensor seed = Tensor::randn({4, 7}, rng, 1.0, DType::F64);
  backward(z, seed);
  auto g = x.grad().to_vector<double>(), s = seed.to_vector<double>();
  for (size_t i = 0; i < g.size(); i++) CHECK(g[i] == 2.0 * s[i]);
  Tensor c = Tensor::randn({1}, rng, 1.0, DType::F64);
  REQUIRE_THROWS_WITH(backward(c), Contains("does not require grad"));
  CHECK(tape_size() == 0);
}

// --train.profile's table charges each recorded op to a category by its name: the joined nodes
// (a ViT block's q|k|v product with its attention, qkv_attention) to attention, not to "other"
// (where they had gone, 35% of the default VLM step on the CPU, before they were named).
TEST_CASE("the profile charges the joined q|k|v + attention node to attention", "[autograd]") {
  Rng rng(61);
  ViT vit(tiny_vit(1), Init{DType::F64, Device::CPU, &rng});
  Tensor images = Tensor::randn({2, 3, 12, 12}, rng, 1.0, DType::F64);
  profile_reset();
  profile_enable(true);
  for (int step = 0; step < 4; step++) {  // the first 2 are warm-up, left out of the table
    profile_mark();
    zero_grads(vit);
    backward(sum(vit.forward(images)));
    profile_step_end();
  }
  const string table = profile_report();
  profile_enable(false);
  profile_reset();
  INFO(table);
  CHECK_THAT(table, Contains("attention with its q|k|v product"));
  CHECK_THAT(table, Contains("linear (MLP, projections)"));
  CHECK_THAT(table, Contains("norms"));
}
