// test_optim.cpp: optim/optimizer.h on the CPU, in f64 and f32, against formulas written here.
//
// The model is a Linear times a gain vector plus a frozen Linear, so that there are 2-D and 1-D
// parameters, two groups and a parameter the optimizer must leave alone. Its gradients come
// from a real forward/backward through autograd (loss = sum((x W^T + b) * gain)^2) and are
// checked against the same gradient written by hand, so the reference below also checks that
// the forward reads the updated flat buffers and that backward writes into the flat gradient.
// The AdamW reference is torch.optim.AdamW's single-tensor step written out; the kernels take
// f32 hyper-parameters, so the reference uses the same f32-rounded lr / betas / eps / wd. The EMA
// of the masters and its form fused into AdamW: test_optim_ema.cpp.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "optim/optimizer.h"
#include "tests/optim_test_util.h"
#include "tests/tolerances.h"

using namespace loom;
using namespace loom::optim_test;
using std::vector;

namespace {

// what an f32 hyper-parameter holds; volatile keeps -O2 from folding the round trip away
double f32(double x) {
  volatile float f = float(x);
  return double(f);
}

struct Net : Module {
  Linear enc, frozen;
  Tensor gain;
  Net(DType dt, uint64_t seed) : Net(dt, Rng(seed)) {}
  Net(DType dt, Rng rng)
      : enc(I, O, true, Init{dt, Device::CPU, &rng}), frozen(I, O, true, Init{dt, Device::CPU, &rng}) {
    child("enc", enc);
    child("frozen", frozen);
    gain = Tensor::randn({O}, rng, 1.0, dt).requires_grad_();
    param("gain", gain);
    // Linear starts biases at zero and weights at std 0.02: make every value random and O(1)
    for (Tensor* t : {&enc.weight, &enc.bias, &frozen.weight, &frozen.bias})
      t->copy_(Tensor::randn(t->shape(), rng, 0.7, dt));
    frozen.requires_grad_(false);
  }
  Tensor loss(const Tensor& x) const {
    Tensor y = mul(enc.forward(x), gain);  // [N, O] * [O]
    return sum(mul(y, y));
  }
};

// The hand-written model: flat f64 vectors by parameter name.
struct Ref {
  std::map<std::string, vector<double>> p;
  explicit Ref(Net& net) {
    for (auto& [n, t] : net.named_parameters()) p[n] = t->to_vector<double>();
  }
  // dL/dparam of loss = sum(((x W^T + b) * g)^2) for the trained parameters
  std::map<std::string, vector<double>> grads(const vector<double>& x) const {
    const auto &W = p.at("enc.weight"), &b = p.at("enc.bias"), &g = p.at("gain");
    vector<double> dW(O * I, 0.0), db(O, 0.0), dg(O, 0.0);
    for (int r = 0; r < N; r++)
      for (int o = 0; o < O; o++) {
        double z = b[o];
        for (int i = 0; i < I; i++) z += x[r * I + i] * W[o * I + i];
        const double y = z * g[o];
        const double dz = 2 * y * g[o];  // dL/dz
        dg[o] += 2 * y * z;
        db[o] += dz;
        for (int i = 0; i < I; i++) dW[o * I + i] += dz * x[r * I + i];
      }
    return {{"enc.weight", dW}, {"enc.bias", db}, {"gain", dg}};
  }
};

struct GroupCfg {
  double lr_scale, wd;
};
// Two groups (different weight decay and lr scale); frozen tensors are offered to both.
std::vector<ParamGroup> groups_of(Net& n, GroupCfg g0 = {1.0, 0.1}, GroupCfg g1 = {0.5, 0.02}) {
  return {{"matrices", g0.lr_scale, g0.wd, {{"enc.weight", &n.enc.weight}, {"frozen.weight", &n.frozen.weight}}},
          {"vectors", g1.lr_scale, g1.wd,
           {{"enc.bias", &n.enc.bias}, {"gain", &n.gain}, {"frozen.bias", &n.frozen.bias}}}};
}
const std::map<std::string, GroupCfg> kGroupOf = {
    {"enc.weight", {1.0, 0.1}}, {"enc.bias", {0.5, 0.02}}, {"gain", {0.5, 0.02}}};

const char* kTrained[] = {"enc.weight", "enc.bias", "gain"};
Tensor* slot_of(Net& n, const std::string& name) {
  for (auto& [k, t] : n.named_parameters())
    if (k == name) return t;
  return nullptr;
}

// torch.optim.AdamW, one tensor, written out
struct AdamRef {
  double b1, b2, eps;
  std::map<std::string, vector<double>> m, v;
  void step(vector<double>& p, const vector<double>& g, const std::string& name, double lr, double wd, int64_t t) {
    auto& mm = m[name];
    auto& vv = v[name];
    mm.resize(p.size(), 0.0);
    vv.resize(p.size(), 0.0);
    const double bc1 = 1 - std::pow(b1, double(t)), bc2 = 1 - std::pow(b2, double(t));
    for (size_t i = 0; i < p.size(); i++) {
      p[i] *= 1 - lr * wd;
      mm[i] += (1 - b1) * (g[i] - mm[i]);
      vv[i] = b2 * vv[i] + (1 - b2) * g[i] * g[i];
      p[i] -= (lr / bc1) * mm[i] / (std::sqrt(vv[i]) / std::sqrt(bc2) + eps);
    }
  }
};

// Every trained parameter's slot and master against the reference.
template <class T> void check_params(Net& net, const Optimizer& opt, const Ref& ref, const char* when) {
  for (const char* name : kTrained) {
    INFO(when << ": " << name);
    Tensor* s = slot_of(net, name);
    LOOM_CHECK_CLOSE(tol::compare(s->to_vector<double>(), ref.p.at(name), tol_of<T>(), name));
    // f32/f64: the slot is a view of the master itself
    CHECK(s->raw() == opt.master(name).raw());
  }
}

template <class T> std::map<std::string, vector<double>> grads_of(Net& net) {
  std::map<std::string, vector<double>> g;
  for (const char* name : kTrained) g[name] = slot_of(net, name)->grad().to_vector<double>();
  return g;
}

template <class T> void adamw_against_torch_formula() {
  const DType dt = dtype_of<T>();
  Rng rng(11);
  Net net(dt, 1);
  Ref ref(net);
  const auto frozen_w = net.frozen.weight.to_vector<double>();
  const auto frozen_impl = net.frozen.weight.impl();
  OptimConfig cfg;
  cfg.beta1 = 0.9;
  cfg.beta2 = 0.95;
  cfg.eps = 1e-8;
  Optimizer opt(groups_of(net), cfg, dt, Device::CPU);
  CHECK(opt.num_parameters() == O * I + O + O);
  AdamRef adam{f32(cfg.beta1), f32(cfg.beta2), f32(cfg.eps), {}, {}};

  const double lrs[] = {3e-2, 2e-2, 1e-2};
  for (int step = 1; step <= 3; step++) {
    INFO("step " << step);
    Tensor x = rand_x<T>(rng);
    const auto xv = x.to_vector<double>();
    opt.zero_grad();
    backward(net.loss(x));
    auto got = grads_of<T>(net);
    auto want = ref.grads(xv);
    for (const char* name : kTrained)
      LOOM_CHECK_CLOSE(tol::compare(got[name], want[name], tol_of<T>(), (std::string("grad ") + name).c_str()));
    opt.step(lrs[step - 1]);
    CHECK(opt.steps() == step);
    // the reference steps on the gradient the model actually produced (f32 rounding included)
    for (const char* name : kTrained) {
      const GroupCfg& g = kGroupOf.at(name);
      adam.step(ref.p[name], got[name], name, f32(lrs[step - 1] * g.lr_scale), f32(g.wd), step);
    }
    check_params<T>(net, opt, ref, "after step");
  }
  // frozen: same tensor, same values, no gradient, not in the optimizer
  CHECK(net.frozen.weight.impl() == frozen_impl);
  CHECK(net.frozen.weight.to_vector<double>() == frozen_w);
  CHECK_FALSE(net.frozen.weight.grad().defined());
  CHECK_FALSE(net.frozen.weight.requires_grad());
  CHECK_THROWS_WITH(opt.master("frozen.weight"), Catch::Contains("frozen.weight"));
}

}  // namespace

TEST_CASE("AdamW matches torch.optim.AdamW over two groups (f64)", "[optim]") { adamw_against_torch_formula<double>(); }
TEST_CASE("AdamW matches torch.optim.AdamW over two groups (f32)", "[optim]") { adamw_against_torch_formula<float>(); }

TEMPLATE_TEST_CASE("gradient accumulation and zero_grad use the flat buffer", "[optim]", double, float) {
  const DType dt = dtype_of<TestType>();
  Rng rng(5);
  Net net(dt, 2);
  Optimizer opt(groups_of(net), OptimConfig{}, dt, Device::CPU);
  // poison: zero_grad must clear whatever was there
  for (const char* name : kTrained) slot_of(net, name)->grad().fill_(std::numeric_limits<double>::quiet_NaN());
  opt.zero_grad();
  for (const char* name : kTrained)
    CHECK(slot_of(net, name)->grad().to_vector<double>() == vector<double>(size_t(slot_of(net, name)->numel()), 0.0));

  const Tensor gw = net.enc.weight.grad();
  Tensor x = rand_x<TestType>(rng);
  backward(net.loss(x));
  auto once = grads_of<TestType>(net);
  backward(net.loss(x));
  auto twice = grads_of<TestType>(net);
  CHECK(net.enc.weight.grad().same(gw));  // accumulated into the view, never replaced
  for (const char* name : kTrained) {
    INFO(name);
    for (auto& g : once[name]) g *= 2;  // g + g == 2 g exactly
    CHECK(twice[name] == once[name]);
    double mx = 0;
    for (double g : twice[name]) mx = std::max(mx, std::fabs(g));
    CHECK(mx > 0);
  }
  opt.zero_grad();
  for (const char* name : kTrained)
    CHECK(slot_of(net, name)->grad().to_vector<double>() == vector<double>(size_t(slot_of(net, name)->numel()), 0.0));
}

TEMPLATE_TEST_CASE("clip_grad_norm: norm, and a clipped step = a step on scaled gradients", "[optim]", double, float) {
  using T = TestType;
  const DType dt = dtype_of<T>();
  Rng rng(7);
  Tensor x1 = rand_x<T>(rng), x2 = rand_x<T>(rng);
  Net a(dt, 3), b(dt, 3);  // identical
  Optimizer oa(groups_of(a), OptimConfig{}, dt, Device::CPU), ob(groups_of(b), OptimConfig{}, dt, Device::CPU);

  oa.zero_grad();
  ob.zero_grad();
  backward(a.loss(x1));
  backward(b.loss(x1));
  double sq = 0;
  for (auto& [n, g] : grads_of<T>(a))
    for (double e : g) sq += e * e;
  const double norm_ref = std::sqrt(sq);

  const double max_norm = 0.3 * norm_ref;
  Tensor norm = oa.clip_grad_norm(max_norm);
  CHECK(norm.dtype() == DType::F32);
  CHECK(norm.shape() == Shape{1});
  const float norm_f = float(norm.item());
  // the norm is accumulated in double partials and stored in f32: one f32 rounding
  LOOM_CHECK_CLOSE(tol::compare(&norm_f, &norm_ref, 1, tol::kCpuF32, "norm"));
  // b: the same scale applied by hand (the kernel's f32 formula), then an unclipped step
  const float s = std::min(1.0f, float(max_norm) / (norm_f + 1e-6f));
  CHECK(s < 0.5f);
  for (const char* name : kTrained) {
    Tensor g = slot_of(b, name)->grad();
    T* p = g.data<T>();
    for (int64_t i = 0; i < g.numel(); i++) p[i] = p[i] * T(s);
  }
  oa.step(1e-2);
  ob.step(1e-2);
  for (const char* name : kTrained)
    CHECK(oa.master(name).to_vector<double>() == ob.master(name).to_vector<double>());

  // the scale applies to one step only
  oa.zero_grad();
  ob.zero_grad();
  backward(a.loss(x2));
  backward(b.loss(x2));
  oa.step(2e-2);
  ob.step(2e-2);
  for (const char* name : kTrained)
    CHECK(oa.master(name).to_vector<double>() == ob.master(name).to_vector<double>());

  // max_norm <= 0 computes the norm and does not clip; a max_norm above the norm leaves the
  // gradients as they are
  for (double mn : {0.0, 1e6}) {
    INFO("max_norm " << mn);
    oa.zero_grad();
    ob.zero_grad();
    backward(a.loss(x1));
    backward(b.loss(x1));
    double sq2 = 0;
    for (auto& [n, g] : grads_of<T>(a))
      for (double e : g) sq2 += e * e;
    const double n2_ref = std::sqrt(sq2);
    Tensor norm2 = oa.clip_grad_norm(mn);
    const float n2 = float(norm2.item());
    LOOM_CHECK_CLOSE(tol::compare(&n2, &n2_ref, 1, tol::kCpuF32, "norm"));
    oa.step(1e-2);
    ob.step(1e-2);
    for (const char* name : kTrained)
      CHECK(oa.master(name).to_vector<double>() == ob.master(name).to_vector<double>());
  }
  CHECK(norm.item() == Approx(norm_f));  // the first handle was not overwritten
}

TEMPLATE_TEST_CASE("SGD with momentum and decoupled weight decay", "[optim]", double, float) {
  using T = TestType;
  const DType dt = dtype_of<T>();
  Rng rng(13);
  Net net(dt, 4);
  Ref ref(net);
  OptimConfig cfg;
  cfg.kind = "sgd";
  cfg.momentum = 0.8;
  Optimizer opt(groups_of(net), cfg, dt, Device::CPU);
  std::map<std::string, vector<double>> buf;
  const double mu = f32(cfg.momentum);
  for (int step = 1; step <= 3; step++) {
    INFO("step " << step);
    Tensor x = rand_x<T>(rng);
    opt.zero_grad();
    backward(net.loss(x));
    auto got = grads_of<T>(net);
    const double lr = 1e-2 * step;
    opt.step(lr);
    for (const char* name : kTrained) {
      const GroupCfg& g = kGroupOf.at(name);
      const double glr = f32(lr * g.lr_scale), wd = f32(g.wd);
      auto& p = ref.p[name];
      auto& bb = buf[name];
      bb.resize(p.size(), 0.0);
      for (size_t i = 0; i < p.size(); i++) {
        bb[i] = mu * bb[i] + got[name][i];  // torch: buf = g on step 1, = mu buf + g after
        p[i] -= glr * (bb[i] + wd * p[i]);
      }
    }
    check_params<T>(net, opt, ref, "after sgd step");
  }
  auto sd = opt.state_dict();
  CHECK(sd.count("group.0.buf") == 1);
  CHECK(sd.count("group.0.m") == 0);
}

TEST_CASE("lr_at: warmup, then cosine / linear / constant to min_lr", "[optim]") {
  const double lr = 1.0, lo = 0.1;
  for (const char* sch : {"cosine", "linear", "constant"}) {
    INFO(sch);
    // warmup 10 of 110: lr (step + 1) / warmup
    CHECK(lr_at(0, 110, 10, lr, lo, sch) == Approx(0.1));
    CHECK(lr_at(4, 110, 10, lr, lo, sch) == Approx(0.5));
    CHECK(lr_at(9, 110, 10, lr, lo, sch) == Approx(1.0));
    CHECK(lr_at(10, 110, 10, lr, lo, sch) == Approx(1.0));  // decay starts at lr
  }
  // middle of the decay (step 60 of 10..110): cosine and linear meet at the midpoint
  CHECK(lr_at(60, 110, 10, lr, lo, "cosine") == Approx(0.55));
  CHECK(lr_at(60, 110, 10, lr, lo, "linear") == Approx(0.55));
  CHECK(lr_at(60, 110, 10, lr, lo, "constant") == Approx(1.0));
  // a quarter in: cosine is above linear
  CHECK(lr_at(35, 110, 10, lr, lo, "cosine") == Approx(lo + (lr - lo) * 0.5 * (1 + std::cos(M_PI / 4))));
  CHECK(lr_at(35, 110, 10, lr, lo, "linear") == Approx(1.0 - 0.9 * 0.25));
  // end (and past it): min_lr
  for (int64_t s : {110, 200}) {
    CHECK(lr_at(s, 110, 10, lr, lo, "cosine") == Approx(lo));
    CHECK(lr_at(s, 110, 10, lr, lo, "linear") == Approx(lo));
    CHECK(lr_at(s, 110, 10, lr, lo, "constant") == Approx(lr));
  }
  CHECK(lr_at(0, 100, 0, 3e-4, 0.0, "cosine") == Approx(3e-4));  // no warmup
  CHECK_THROWS_WITH(lr_at(0, 100, 0, 1.0, 0.0, "step"), Catch::Contains("step"));
}

TEMPLATE_TEST_CASE("state_dict round trip continues bit-identically", "[optim]", double, float) {
  using T = TestType;
  const DType dt = dtype_of<T>();
  Rng rng(17);
  vector<Tensor> xs;
  for (int i = 0; i < 4; i++) xs.push_back(rand_x<T>(rng));
  Net a(dt, 5), b(dt, 6);  // b starts elsewhere: everything must come from the state
  Optimizer oa(groups_of(a), OptimConfig{}, dt, Device::CPU), ob(groups_of(b), OptimConfig{}, dt, Device::CPU);
  auto train = [&](Net& n, Optimizer& o, const Tensor& x, double lr) {
    o.zero_grad();
    backward(n.loss(x));
    o.clip_grad_norm(1.0);
    o.step(lr);
  };
  train(a, oa, xs[0], 1e-2);
  train(a, oa, xs[1], 2e-2);

  auto sd = oa.state_dict();
  for (const char* k : {"group.0.master", "group.0.m", "group.0.v", "group.1.master", "group.1.m", "group.1.v", "step"})
    CHECK(sd.count(k) == 1);
  CHECK(sd.size() == 7);
  CHECK(sd.at("group.0.master").numel() == O * I);
  CHECK(sd.at("group.1.master").numel() == 2 * O);
  ob.load_state_dict(sd, "ckpt/optimizer.safetensors");
  CHECK(ob.steps() == 2);
  for (const char* name : kTrained)
    CHECK(slot_of(b, name)->to_vector<double>() == slot_of(a, name)->to_vector<double>());

  train(a, oa, xs[2], 3e-2);
  train(b, ob, xs[2], 3e-2);
  train(a, oa, xs[3], 1e-2);
  train(b, ob, xs[3], 1e-2);
  auto sa = oa.state_dict(), sb = ob.state_dict();
  for (auto& kv : sa) {
    INFO(kv.first);
    CHECK(kv.second.to_vector<double>() == sb.at(kv.first).to_vector<double>());
  }
  CHECK(ob.steps() == 4);

  // errors name the source and the tensor; nothing is written before the checks pass
  const auto before = ob.master("gain").to_vector<double>();
  auto missing = sa;
  missing.erase("group.1.v");
  CHECK_THROWS_WITH(ob.load_state_dict(missing, "ckpt/x.safetensors"),
                    Catch::Contains("ckpt/x.safetensors") && Catch::Contains("group.1.v"));
  auto bad_shape = sa;
  bad_shape["group.0.m"] = Tensor::zeros({O * I + 1}, dt);
  CHECK_THROWS_WITH(ob.load_state_dict(bad_shape, "ckpt/y"), Catch::Contains("ckpt/y") && Catch::Contains("group.0.m"));
  auto extra = sa;
  extra["group.2.master"] = Tensor::zeros({3}, dt);
  CHECK_THROWS_WITH(ob.load_state_dict(extra, "ckpt/z"), Catch::Contains("ckpt/z") && Catch::Contains("group.2.master"));
  auto no_step = sa;
  no_step.erase("step");
  CHECK_THROWS_WITH(ob.load_state_dict(no_step, "ckpt/w"), Catch::Contains("ckpt/w") && Catch::Contains("step"));
  CHECK(ob.master("gain").to_vector<double>() == before);
  // an SGD optimizer has no place for m / v
  Net c(dt, 7);
  OptimConfig sgd;
  sgd.kind = "sgd";
  Optimizer oc(groups_of(c), sgd, dt, Device::CPU);
  CHECK_THROWS_WITH(oc.load_state_dict(sa, "ckpt/adamw"), Catch::Contains("group.0.buf"));
}

TEST_CASE("optimizer preconditions throw with names", "[optim]") {
  Net net(DType::F32, 9);
  CHECK_THROWS_WITH(Optimizer(groups_of(net), OptimConfig{}, DType::BF16, Device::CPU), Catch::Contains("bf16"));
  OptimConfig bad;
  bad.kind = "lion";
  CHECK_THROWS_WITH(Optimizer(groups_of(net), bad, DType::F32, Device::CPU), Catch::Contains("lion"));
  std::vector<ParamGroup> twice = {{"a", 1.0, 0.0, {{"enc.weight", &net.enc.weight}}},
                                   {"b", 1.0, 0.0, {{"enc.weight", &net.enc.weight}}}};
  const auto impl = net.enc.weight.impl();
  CHECK_THROWS_WITH(Optimizer(twice, OptimConfig{}, DType::F32, Device::CPU), Catch::Contains("enc.weight"));
  CHECK(net.enc.weight.impl() == impl);  // nothing was re-pointed
  // an empty group is allowed and holds nothing
  std::vector<ParamGroup> with_empty = {{"empty", 1.0, 0.0, {}}, {"all", 1.0, 0.0, {{"gain", &net.gain}}}};
  Optimizer opt(with_empty, OptimConfig{}, DType::F32, Device::CPU);
  CHECK(opt.num_parameters() == O);
  auto sd = opt.state_dict();
  CHECK(sd.count("group.1.master") == 1);
  CHECK(sd.count("group.0.master") == 0);
}

// Dynamic loss scaling (fp16 training; the CPU runs the same step_control in f32): with a
// power-of-two scale S, seeding backward with S and letting clip_grad_norm unscale gives the
// unscaled run's norm and weights bit for bit; an overflow skips the step and halves S; a run
// of growth_interval applied steps doubles it; the scale is optimizer state.
TEST_CASE("loss scaling: a scaled step equals the unscaled one; overflow halves, a good run doubles", "[optim]") {
  const DType dt = DType::F32;
  Rng rng(11);
  Tensor x1 = rand_x<float>(rng), x2 = rand_x<float>(rng);
  Net a(dt, 3), b(dt, 3);  // identical
  Optimizer oa(groups_of(a), OptimConfig{}, dt, Device::CPU), ob(groups_of(b), OptimConfig{}, dt, Device::CPU);
  oa.enable_loss_scaling(1024.0, 2);
  CHECK(oa.loss_scaling());
  CHECK_FALSE(ob.loss_scaling());
  auto scale_state = [&] { return oa.state_dict().at("loss_scale").to_vector<double>(); };
  CHECK(scale_state() == vector<double>{1024.0, 0.0});
  int64_t applied = 0;
  for (int step = 0; step < 3; step++) {
    Tensor x = step % 2 ? x2 : x1;
    oa.zero_grad();
    ob.zero_grad();
    Tensor la = a.loss(x);
    backward(la, oa.loss_scale_value().reshape(la.shape()));
    backward(b.loss(x));
    const double max_norm = step == 0 ? 1e-3 : 0.0;  // step 0 clips, the others do not
    Tensor na = oa.clip_grad_norm(max_norm), nb = ob.clip_grad_norm(max_norm);
    CHECK(na.item() == nb.item());  // the norm of the loss's gradients, not of the scaled ones
    oa.step(1e-2);
    ob.step(1e-2);
    applied++;
    for (const char* name : kTrained)
      CHECK(oa.master(name).to_vector<double>() == ob.master(name).to_vector<double>());
  }
  // 3 applied steps with growth every 2: doubled once, one good step counted since
  CHECK(scale_state() == vector<double>{2048.0, 1.0});
  CHECK(oa.steps() == applied);

  // an overflow: the step is skipped (weights and step count stay), the scale halves
  std::map<std::string, vector<double>> before;
  for (const char* name : kTrained) before[name] = oa.master(name).to_vector<double>();
  oa.zero_grad();
  Tensor la = a.loss(x1);
  backward(la, oa.loss_scale_value().reshape(la.shape()));
  slot_of(a, kTrained[0])->grad().data<float>()[0] = INFINITY;
  Tensor n = oa.clip_grad_norm(1.0);
  CHECK_FALSE(std::isfinite(n.item()));
  oa.step(1e-2);
  for (const char* name : kTrained) CHECK(oa.master(name).to_vector<double>() == before[name]);
  CHECK(oa.steps() == applied);
  CHECK(scale_state() == vector<double>{1024.0, 0.0});

  // the scale travels with the optimizer state; an unscaled optimizer ignores it
  Net c(dt, 3);
  Optimizer oc(groups_of(c), OptimConfig{}, dt, Device::CPU);
  oc.enable_loss_scaling(65536.0, 2000);
  oc.load_state_dict(oa.state_dict(), "test");
  CHECK(oc.state_dict().at("loss_scale").to_vector<double>() == vector<double>{1024.0, 0.0});
  Net e(dt, 3);
  Optimizer oe(groups_of(e), OptimConfig{}, dt, Device::CPU);
  CHECK_NOTHROW(oe.load_state_dict(oa.state_dict(), "test"));
  CHECK(oe.state_dict().count("loss_scale") == 0);

  // with scaling on, a step needs clip_grad_norm first (it unscales); the range is checked
  oa.zero_grad();
  CHECK_THROWS_WITH(oa.step(1e-2), Catch::Contains("clip_grad_norm must run first"));
  CHECK_THROWS_WITH(oa.enable_loss_scaling(0.5, 10), Catch::Contains("enable_loss_scaling"));
  // the floor: halving stops at 1
  Net f(dt, 3);
  Optimizer of(groups_of(f), OptimConfig{}, dt, Device::CPU);
  of.enable_loss_scaling(1.0, 10);
  of.zero_grad();
  Tensor lf = f.loss(x1);
  backward(lf, of.loss_scale_value().reshape(lf.shape()));
  slot_of(f, kTrained[0])->grad().data<float>()[0] = NAN;
  of.clip_grad_norm(1.0);
  of.step(1e-2);
  CHECK(of.state_dict().at("loss_scale").to_vector<double>() == vector<double>{1.0, 0.0});
}
