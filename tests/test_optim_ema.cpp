// test_optim_ema.cpp: the EMA of the masters (optim/optimizer.h, EMA) on the CPU in f64 and f32:
// default_groups with an EMA target, the update against its formula, and EMA::fuse, the update
// inside AdamW's pass, against step() then update() bit for bit (and the layouts it refuses).
#include <catch2/catch.hpp>

#include <string>
#include <utility>
#include <vector>

#include "kernels/kernels.h"
#include "optim/optimizer.h"
#include "tests/optim_test_util.h"
#include "tests/tolerances.h"

using namespace loom;
using namespace loom::optim_test;
using std::vector;

namespace {
// LatentMIM's layout: a trained encoder and a frozen EMA target with the same parameter names.
struct MimLike : Module {
  Linear encoder, target;
  MimLike(DType dt, Rng rng) : encoder(I, O, true, Init{dt, Device::CPU, &rng}), target(I, O, true, Init{dt, Device::CPU, &rng}) {
    child("encoder", encoder);
    child("target", target);
    for (Tensor* t : {&encoder.weight, &encoder.bias, &target.weight, &target.bias})
      t->copy_(Tensor::randn(t->shape(), rng, 0.5, dt));
    target.requires_grad_(false);
  }
};
}  // namespace

TEMPLATE_TEST_CASE("default_groups and EMA of the masters", "[optim]", double, float) {
  using T = TestType;
  const DType dt = dtype_of<T>();
  Rng rng(19);
  MimLike m(dt, Rng(8));
  auto groups = default_groups(m, 0.05);
  REQUIRE(groups.size() == 2);
  CHECK(groups[0].name == "decay");
  CHECK(groups[0].weight_decay == 0.05);
  CHECK(groups[1].name == "no_decay");
  CHECK(groups[1].weight_decay == 0.0);
  REQUIRE(groups[0].params.size() == 1);  // the target is frozen: not offered
  CHECK(groups[0].params[0].first == "encoder.weight");
  REQUIRE(groups[1].params.size() == 1);
  CHECK(groups[1].params[0].first == "encoder.bias");

  Optimizer opt(groups, OptimConfig{}, dt, Device::CPU);
  EMA ema(m.target, opt, "encoder.");
  const auto target_impl = m.target.weight.impl();
  auto expect = [&](double decay, vector<double>& t, const std::string& src) {
    auto s = opt.master(src).to_vector<double>();
    for (size_t i = 0; i < t.size(); i++) t[i] = decay * t[i] + (1 - decay) * s[i];
  };
  auto tw = m.target.weight.to_vector<double>(), tb = m.target.bias.to_vector<double>();
  for (int step = 0; step < 3; step++) {
    INFO("step " << step);
    opt.zero_grad();
    Tensor x = rand_x<T>(rng);
    Tensor y = m.encoder.forward(x);
    backward(sum(mul(y, y)));
    opt.step(5e-2);
    const double decay = 0.9 + 0.03 * step;
    ema.update(decay);
    expect(decay, tw, "encoder.weight");
    expect(decay, tb, "encoder.bias");
    LOOM_CHECK_CLOSE(tol::compare(m.target.weight.to_vector<double>(), tw, tol_of<T>(), "target.weight"));
    LOOM_CHECK_CLOSE(tol::compare(m.target.bias.to_vector<double>(), tb, tol_of<T>(), "target.bias"));
  }
  CHECK(m.target.weight.impl() == target_impl);  // f32/f64 targets are updated in place
  CHECK_FALSE(m.target.weight.requires_grad());
  CHECK_THROWS_WITH(EMA(m.target, opt, "decoder."), Catch::Contains("decoder.weight"));
}

namespace {
// An encoder, a trained head of the same shape beside it and an EMA target (of either): in each
// default group the encoder's parameters come first and the head's next, so either one's are
// whole runs of the flat buffers (the head's starting past 0).
struct MimHead : Module {
  Linear encoder, head, target;
  MimHead(DType dt, Rng rng)
      : encoder(I, O, true, Init{dt, Device::CPU, &rng}), head(I, O, true, Init{dt, Device::CPU, &rng}),
        target(I, O, true, Init{dt, Device::CPU, &rng}) {
    child("encoder", encoder);
    child("head", head);
    child("target", target);
    for (Tensor* t : {&encoder.weight, &encoder.bias, &head.weight, &head.bias, &target.weight, &target.bias})
      t->copy_(Tensor::randn(t->shape(), rng, 0.5, dt));
    target.requires_grad_(false);
  }
  Tensor loss(const Tensor& x) const { return sum(mul(encoder.forward(x), head.forward(x))); }
};
}  // namespace

// EMA::fuse moves the update into AdamW's pass: the same values as step() then update(), bit for
// bit, a skipped step skipping both; and no fusing (nothing changed) where the layout or the
// optimizer does not allow it.
TEMPLATE_TEST_CASE("EMA fused into the AdamW step: the same values as the two updates", "[optim]", double, float) {
  using T = TestType;
  const DType dt = dtype_of<T>();
  const double decay = 0.8;
  for (const char* source : {"encoder.", "head."}) {
  INFO("the EMA of " << source);
  MimHead a(dt, Rng(31)), b(dt, Rng(31));
  Optimizer oa(default_groups(a, 0.05), OptimConfig{}, dt, Device::CPU);
  Optimizer ob(default_groups(b, 0.05), OptimConfig{}, dt, Device::CPU);
  EMA ea(a.target, oa, source), eb(b.target, ob, source);
  REQUIRE(eb.fuse(ob, decay));
  CHECK(eb.fused());
  CHECK_FALSE(eb.fuse(ob, decay));  // once
  {  // a second EMA (of the other source) into the same groups: refused, nothing re-pointed
    Rng r2(36);
    Linear t2(I, O, true, Init{dt, Device::CPU, &r2});
    t2.requires_grad_(false);
    EMA e2(t2, ob, std::string(source) == "encoder." ? "head." : "encoder.");
    const auto w2 = t2.weight.impl();
    const auto v2 = t2.weight.to_vector<double>();
    CHECK_FALSE(e2.fuse(ob, decay));
    CHECK_FALSE(e2.fused());
    CHECK(t2.weight.impl() == w2);
    CHECK(t2.weight.to_vector<double>() == v2);
  }
  CHECK(ob.backend().find("the EMA of " + std::to_string(O * I + O) + " parameters") != std::string::npos);
  CHECK(oa.backend().find("EMA") == std::string::npos);
  // the target was re-pointed to the flat buffers with its values
  CHECK(b.target.weight.to_vector<double>() == a.target.weight.to_vector<double>());
  CHECK_FALSE(b.target.weight.requires_grad());
  Rng rng(5);
  for (int step = 0; step < 4; step++) {
    INFO("step " << step);
    Tensor x = rand_x<T>(rng);
    for (auto* side : {&a, &b}) backward(side->loss(x));
    // step 2: a non-finite loss skips the step, and with it the EMA
    Tensor bad = Tensor::from_vector(std::vector<float>{step == 2 ? NAN : 1.f}, {1}, Device::CPU);
    oa.clip_grad_norm(0.0, bad);
    ob.clip_grad_norm(0.0, bad);
    const auto before = b.target.weight.to_vector<double>();
    oa.step(3e-2);
    ob.step(3e-2);
    ea.update(decay);
    eb.update(decay);
    oa.zero_grad();
    ob.zero_grad();
    for (const char* n : {"weight", "bias"}) {
      INFO(n);
      Tensor* ta = std::string(n) == "weight" ? &a.target.weight : &a.target.bias;
      Tensor* tb = std::string(n) == "weight" ? &b.target.weight : &b.target.bias;
      CHECK(tb->to_vector<double>() == ta->to_vector<double>());
      CHECK(ob.master(std::string("encoder.") + n).to_vector<double>() ==
            oa.master(std::string("encoder.") + n).to_vector<double>());
      CHECK(ob.master(std::string("head.") + n).to_vector<double>() ==
            oa.master(std::string("head.") + n).to_vector<double>());
    }
    if (step == 2) CHECK(b.target.weight.to_vector<double>() == before);
    else CHECK(b.target.weight.to_vector<double>() != before);
  }
  CHECK(eb.masters("target.").empty());  // the slots are their own masters here, as unfused
  CHECK_THROWS_WITH(eb.update(0.5), Catch::Contains("0.5") && Catch::Contains("0.8"));
  // fusing first makes sharding an error naming the group
  CHECK_THROWS_WITH(ob.shard(0, 2, [](Tensor&, const std::vector<int64_t>&) {}), Catch::Contains("decay"));
  }

  // sources that are not whole runs: the head's weight between the encoder's two parameters
  MimHead c(dt, Rng(32));
  std::vector<ParamGroup> mixed = {{"all", 1.0, 0.0,
                                    {{"encoder.weight", &c.encoder.weight}, {"head.weight", &c.head.weight},
                                     {"encoder.bias", &c.encoder.bias}, {"head.bias", &c.head.bias}}}};
  Optimizer oc(mixed, OptimConfig{}, dt, Device::CPU);
  EMA ec(c.target, oc, "encoder.");
  const auto impl = c.target.weight.impl();
  CHECK_FALSE(ec.fuse(oc, decay));
  CHECK_FALSE(ec.fused());
  CHECK(c.target.weight.impl() == impl);  // nothing was re-pointed
  // SGD has no fused form; a sharded optimizer updates part of each master
  MimHead d(dt, Rng(33));
  OptimConfig sgd;
  sgd.kind = "sgd";
  Optimizer od(default_groups(d, 0.0), sgd, dt, Device::CPU);
  EMA ed(d.target, od, "encoder.");
  CHECK_FALSE(ed.fuse(od, decay));
  MimHead e(dt, Rng(34));
  Optimizer oe(default_groups(e, 0.0), OptimConfig{}, dt, Device::CPU);
  oe.shard(0, 2, [](Tensor&, const std::vector<int64_t>&) {});
  EMA ee(e.target, oe, "encoder.");
  CHECK_FALSE(ee.fuse(oe, decay));
}

// adamw_ema_update's range check (kernels.h, check_ema_range, the same on both backends): an EMA
// range past the group's elements is refused before anything is written.
TEST_CASE("adamw_ema_update refuses an EMA range outside the group", "[optim]") {
  vector<float> master = {1, 2, 3, 4}, m(4, 0.f), v(4, 0.f), grad = {1, 1, 1, 1}, target(2, 7.f);
  const vector<float> before = master;
  for (auto [lo, hi] : {std::pair<int64_t, int64_t>{3, 5}, {-1, 1}, {2, 1}}) {
    INFO("[" << lo << ", " << hi << ")");
    EmaRange<float, float> e{target.data(), nullptr, lo, hi, 0.9};
    CHECK_THROWS_WITH(cpu::adamw_ema_update(master.data(), static_cast<float*>(nullptr), m.data(), v.data(), grad.data(),
                                            nullptr, 4, AdamWHyper{}, e, nullptr),
                      Catch::Contains("[" + std::to_string(lo) + ", " + std::to_string(hi) + ")") &&
                          Catch::Contains("4 elements"));
    CHECK(master == before);
    CHECK(target == vector<float>(2, 7.f));
  }
}
