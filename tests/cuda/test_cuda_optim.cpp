// test_cuda_optim.cpp: optim/optimizer.h on CUDA, in f32 and bf16 compute, against the CPU
// f64 optimizer given the same starting values and the same gradients.
//
// The gradients are written into the flat gradient buffers directly (rounded to bf16 first in
// the bf16 runs, and the f64 reference gets the same rounded values), so the comparison is the
// optimizer's arithmetic alone; a separate case runs a real forward/backward on the GPU and
// checks that it lands in the flat buffers. Sizes are odd and one tensor has > 1024 columns so
// that the vectorized update's tail and the multi-block norm are reached.
// Exits with code 4 (skipped) when no GPU is present.
//   bash tools/gpu-kernels.sh tests/cuda/test_cuda_optim.cpp -- tensor/tensor.cpp
//     tensor/safetensors.cpp autograd/*.cpp nn/module.cpp optim/optimizer.cpp   (one line)
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "optim/optimizer.h"
#include "tests/tolerances.h"

using namespace loom;
using std::vector;

namespace {

void need_gpu() {
  if (!cuda::available()) {
    std::fprintf(stderr, "no CUDA device: skipping\n");
    std::exit(4);
  }
}

constexpr int I = 1031, O = 67, N = 5;  // in features (> 1024), out features, rows

// Linear(I -> O) times a gain vector, plus a frozen Linear. Built on the CPU in f64 from a
// seed; to_device() gives the GPU twin with the same values.
struct Net : Module {
  Linear lin, frozen;
  Tensor gain;
  explicit Net(uint64_t seed, double gain_std = 1.0) : Net(Rng(seed), gain_std) {}
  Net(Rng rng, double gain_std)
      : lin(I, O, true, Init{DType::F64, Device::CPU, &rng}), frozen(I, O, true, Init{DType::F64, Device::CPU, &rng}) {
    child("lin", lin);
    child("frozen", frozen);
    gain = Tensor::randn({O}, rng, gain_std, DType::F64).requires_grad_();
    param("gain", gain);
    // weights std 0.03 keep |z| ~ 1 over 1031 inputs (gradients O(1), so bf16's absolute
    // tolerance is meaningful); biases random instead of Linear's zeros
    lin.weight.copy_(Tensor::randn({O, I}, rng, 0.03, DType::F64));
    lin.bias.copy_(Tensor::randn({O}, rng, 0.5, DType::F64));
    frozen.requires_grad_(false);
  }
  Tensor loss(const Tensor& x) const {
    Tensor y = mul(lin.forward(x), gain);
    return sum(mul(y, y));
  }
  // every slot to `dt` on `dev` (keeping requires_grad)
  void to_device(DType dt, Device dev) {
    for (auto& [n, t] : named_parameters()) {
      bool rg = t->requires_grad();
      *t = t->to(dt).to(dev);
      t->requires_grad_(rg);
    }
  }
};

const char* kTrained[] = {"lin.weight", "lin.bias", "gain"};
Tensor* slot_of(Module& m, const std::string& name) {
  for (auto& [k, t] : m.named_parameters())
    if (k == name) return t;
  FAIL("no parameter " << name);
  return nullptr;
}

std::vector<ParamGroup> groups_of(Net& n) {
  return {{"matrices", 1.0, 0.1, {{"lin.weight", &n.lin.weight}, {"frozen.weight", &n.frozen.weight}}},
          {"vectors", 0.5, 0.02, {{"lin.bias", &n.lin.bias}, {"gain", &n.gain}, {"frozen.bias", &n.frozen.bias}}}};
}

double round_bf16(double x) { return double(float(bf16(float(x)))); }

// The same random gradient into each model's flat gradient buffers (bf16-rounded when the GPU
// computes in bf16, so that every side sees the same values).
void set_grads(std::initializer_list<Net*> nets, Rng& rng, bool bf) {
  for (const char* name : kTrained) {
    Tensor* first = slot_of(**nets.begin(), name);
    vector<double> g(size_t(first->numel()));
    for (auto& e : g) e = bf ? round_bf16(rng.normal()) : rng.normal();
    Tensor h = Tensor::from_vector(g, first->shape());
    for (Net* n : nets) slot_of(*n, name)->grad().copy_(h);
  }
}

void check_against(Net& gpu, const Optimizer& og, const Optimizer& oref, bool bf, const char* when) {
  for (const char* name : kTrained) {
    INFO(when << ": " << name);
    auto want = oref.master(name).to_vector<double>();
    auto master = og.master(name).to_vector<double>();
    LOOM_CHECK_CLOSE(tol::compare(master, want, tol::kCudaF32, name));
    auto slot = slot_of(gpu, name)->to_vector<double>();
    if (bf) {
      // the forward's weights are the master rounded to bf16, exactly
      vector<double> rounded(master.size());
      for (size_t i = 0; i < master.size(); i++) rounded[i] = round_bf16(master[i]);
      CHECK(slot == rounded);
      LOOM_CHECK_CLOSE(tol::compare(slot, want, tol::kCudaBF16, name));
    } else {
      CHECK(slot == master);
    }
  }
}

void optimizer_vs_cpu(const std::string& kind, DType compute) {
  const bool bf = compute == DType::BF16;
  INFO(kind << " " << dtype_name(compute));
  Net ref(21), gpu(21);
  gpu.to_device(DType::F32, Device::CUDA);
  // the f32 GPU master starts from f32-rounded values: give the reference the same start
  ref.to_device(DType::F32, Device::CPU);
  ref.to_device(DType::F64, Device::CPU);
  OptimConfig cfg;
  cfg.kind = kind;
  Optimizer oref(groups_of(ref), cfg, DType::F64, Device::CPU);
  Optimizer og(groups_of(gpu), cfg, compute, Device::CUDA);
  CHECK(og.num_parameters() == int64_t(O) * I + 2 * O);
  CHECK(slot_of(gpu, "lin.weight")->dtype() == compute);
  CHECK(slot_of(gpu, "frozen.weight")->dtype() == DType::F32);  // frozen: untouched
  Rng rng(3);
  const double lrs[] = {1e-2, 2e-2, 5e-3, 1e-2};
  for (int step = 1; step <= 4; step++) {
    INFO("step " << step);
    og.zero_grad();
    oref.zero_grad();
    set_grads({&ref, &gpu}, rng, bf);
    if (step >= 3) {  // clipped steps; the scale is < 1 on step 3 and 1 on step 4
      const double max_norm = step == 3 ? 50.0 : 1e6;
      Tensor ng = og.clip_grad_norm(max_norm), nr = oref.clip_grad_norm(max_norm);
      CHECK(ng.is_cuda());
      const double a = ng.item(), b = nr.item();
      LOOM_CHECK_CLOSE(tol::compare(&a, &b, 1, tol::kCudaF32, "grad norm"));
      if (step == 3) CHECK(b > 50.0);
    }
    og.step(lrs[step - 1]);
    oref.step(lrs[step - 1]);
    check_against(gpu, og, oref, bf, "after step");
  }

  // state round trip on the GPU: a fresh optimizer continues bit-identically, and its bf16
  // weights are re-derived from the loaded masters
  Net gpu2(99);
  gpu2.to_device(DType::F32, Device::CUDA);
  Optimizer og2(groups_of(gpu2), cfg, compute, Device::CUDA);
  std::map<std::string, Tensor> host;
  for (auto& [k, t] : og.state_dict()) host[k] = t.to(Device::CPU);  // what a checkpoint holds
  og2.load_state_dict(host, "gpu-ckpt");
  for (const char* name : kTrained)
    CHECK(slot_of(gpu2, name)->to_vector<double>() == slot_of(gpu, name)->to_vector<double>());
  Rng more(5);
  set_grads({&gpu, &gpu2}, more, bf);
  og.step(1e-2);
  og2.step(1e-2);
  for (const char* name : kTrained) {
    CHECK(og.master(name).to_vector<double>() == og2.master(name).to_vector<double>());
    CHECK(slot_of(gpu2, name)->to_vector<double>() == slot_of(gpu, name)->to_vector<double>());
  }
}

}  // namespace

TEST_CASE("CUDA AdamW (f32, bf16) matches the CPU f64 optimizer", "[cuda][optim]") {
  need_gpu();
  optimizer_vs_cpu("adamw", DType::F32);
  optimizer_vs_cpu("adamw", DType::BF16);
}

TEST_CASE("CUDA SGD (f32, bf16) matches the CPU f64 optimizer", "[cuda][optim]") {
  need_gpu();
  optimizer_vs_cpu("sgd", DType::F32);
  optimizer_vs_cpu("sgd", DType::BF16);
}

TEST_CASE("CUDA backward lands in the flat gradient buffers", "[cuda][optim]") {
  need_gpu();
  for (DType compute : {DType::F32, DType::BF16}) {
    const bool bf = compute == DType::BF16;
    INFO(dtype_name(compute));
    // gain std 0.3 keeps |dW| <~ 1: bf16's error is relative to the sum of |terms| of
    // dW = sum_r dz x, and kCudaBF16's atol is absolute
    Net ref(31, 0.3), gpu(31, 0.3);
    gpu.to_device(DType::F32, Device::CUDA);
    Optimizer og(groups_of(gpu), OptimConfig{}, compute, Device::CUDA);
    Rng rng(8);
    Tensor x = Tensor::randn({N, I}, rng, 0.5, DType::F64);
    if (bf) {  // the reference sees the GPU's inputs and weights: bf16-rounded
      x = x.to(DType::BF16).to(DType::F64);
      for (const char* name : kTrained) slot_of(ref, name)->copy_(slot_of(gpu, name)->to(Device::CPU));
    }
    Tensor xg = x.to(compute).to(Device::CUDA);
    // poison: zero_grad must clear it
    for (const char* name : kTrained) slot_of(gpu, name)->grad().fill_(NAN);
    og.zero_grad();
    const Tensor gw = gpu.lin.weight.grad();
    backward(gpu.loss(xg));
    backward(ref.loss(x));
    CHECK(gpu.lin.weight.grad().same(gw));
    const tol::Tol t = bf ? tol::kCudaBF16 : tol::kCudaF32Gemm;
    std::map<std::string, vector<double>> once;
    for (const char* name : kTrained) {
      once[name] = slot_of(gpu, name)->grad().to_vector<double>();
      LOOM_CHECK_CLOSE(tol::compare(once[name], slot_of(ref, name)->grad().to_vector<double>(), t, name));
    }
    backward(gpu.loss(xg));  // accumulation: twice the gradient
    for (const char* name : kTrained) {
      vector<double> two = once[name];
      for (auto& e : two) e *= 2;
      LOOM_CHECK_CLOSE(tol::compare(slot_of(gpu, name)->grad().to_vector<double>(), two, t, name));
    }
    CHECK_FALSE(gpu.frozen.weight.grad().defined());
  }
}

// The parameters an EMA test moves, and a fresh standard-normal gradient for each of them.
const char* const kEmaNames[] = {"lin.weight", "lin.bias", "gain", "frozen.weight", "frozen.bias"};
static void random_grads(Net& enc, Rng& rng) {
  for (const char* n : kEmaNames) {
    Tensor* s = slot_of(enc, n);
    vector<double> g(size_t(s->numel()));
    for (auto& e : g) e = rng.normal();
    s->grad().copy_(Tensor::from_vector(g, s->shape()));
  }
}

TEST_CASE("CUDA EMA of the f32 masters into f32 and bf16 targets", "[cuda][optim]") {
  need_gpu();
  for (DType compute : {DType::F32, DType::BF16}) {
    const bool bf = compute == DType::BF16;
    INFO(dtype_name(compute));
    Net enc(41), target(42);
    enc.to_device(DType::F32, Device::CUDA);
    target.to_device(compute, Device::CUDA);  // the target runs in the compute dtype
    target.requires_grad_(false);
    enc.frozen.requires_grad_(true);  // every target name needs a master
    Optimizer og(groups_of(enc), OptimConfig{}, compute, Device::CUDA);
    EMA ema(target, og, "");  // same names on both sides
    // the reference: f64 from the target's starting values
    std::map<std::string, vector<double>> want;
    for (const char* n : kEmaNames) want[n] = slot_of(target, n)->to_vector<double>();
    Rng rng(6);
    for (int step = 0; step < 3; step++) {
      INFO("step " << step);
      random_grads(enc, rng);
      og.step(1e-2);
      const double decay = 0.99 - 0.1 * step;
      ema.update(decay);
      for (const char* n : kEmaNames) {
        auto src = og.master(n).to_vector<double>();
        auto& w = want[n];
        for (size_t i = 0; i < w.size(); i++) w[i] = decay * w[i] + (1 - decay) * src[i];
        LOOM_CHECK_CLOSE(tol::compare(slot_of(target, n)->to_vector<double>(), w,
                                      bf ? tol::kCudaBF16 : tol::kCudaF32, n));
      }
    }
  }
}

// A resumed run's EMA target: the exact masters a bf16 target keeps (EMA::masters) go to the
// checkpoint and back (as save_checkpoint / load_checkpoint move them: into the masters and,
// rounded, into the slots), and the next update gives the same bits as the run that went on.
// Before, the checkpoint held the rounded slots and the masters stayed at their starting
// values, so the first update after a resume blended the initial target back in.
TEST_CASE("CUDA EMA masters of a bf16 target survive a checkpoint round trip", "[cuda][optim]") {
  need_gpu();
  // an encoder trained in bf16 compute and its bf16 EMA target, from two seeds
  struct Run {
    Net enc, target;
    std::unique_ptr<Optimizer> og;
    std::unique_ptr<EMA> ema;
    Run(uint64_t enc_seed, uint64_t target_seed) : enc(enc_seed), target(target_seed) {
      enc.to_device(DType::F32, Device::CUDA);
      target.to_device(DType::BF16, Device::CUDA);
      target.requires_grad_(false);
      enc.frozen.requires_grad_(true);
      og = std::make_unique<Optimizer>(groups_of(enc), OptimConfig{}, DType::BF16, Device::CUDA);
      ema = std::make_unique<EMA>(target, *og, "");
    }
    void steps(Rng& rng, int n) {
      for (int i = 0; i < n; i++) {
        random_grads(enc, rng);
        og->step(1e-2);
        ema->update(0.9);
      }
    }
  };
  Run a(51, 52);
  Rng rng(7);
  a.steps(rng, 3);
  std::map<std::string, Tensor> saved;  // what the checkpoint holds: f32 masters, on the host
  for (auto& [name, m] : a.ema->masters("target.")) {
    CHECK(m.dtype() == DType::F32);
    saved[name] = m.to(Device::CPU);
  }
  REQUIRE(saved.size() == 5);
  for (const char* n : kEmaNames)  // the masters are not the rounded slots (3 updates of 0.1)
    CHECK(saved.at(std::string("target.") + n).to_vector<double>() != slot_of(a.target, n)->to_vector<double>());
  std::map<std::string, Tensor> opt_saved;
  for (auto& [k, v] : a.og->state_dict()) opt_saved[k] = v.to(Device::CPU);

  Rng rng_on = rng;  // the run that goes on
  a.steps(rng_on, 2);
  Run b(61, 62);  // the resumed one: other seeds, then the saved state written into it
  b.og->load_state_dict(opt_saved, "ckpt/optimizer.safetensors");
  auto held = b.ema->masters("target.");
  for (const char* n : kEmaNames) {
    const std::string key = std::string("target.") + n;
    slot_of(b.target, n)->copy_(saved.at(key));  // load_checkpoint: the slot, rounded
    Tensor master = held.at(key);
    master.copy_(saved.at(key));  // and the held master, exact
  }
  Rng rng_resumed = rng;
  b.steps(rng_resumed, 2);
  for (const char* n : kEmaNames) {
    INFO(n);
    const std::string key = std::string("target.") + n;
    CHECK(slot_of(b.target, n)->to_vector<double>() == slot_of(a.target, n)->to_vector<double>());
    CHECK(b.ema->masters("target.").at(key).to_vector<double>() == a.ema->masters("target.").at(key).to_vector<double>());
  }
}

// Part of Net's names, as a target whose sources start past 0 (and at no multiple of 4) in
// both of groups_of's groups: the fused kernel's element-wise path.
struct Tail : Module {
  Linear frozen;
  Tensor gain;
  explicit Tail(uint64_t seed) : Tail(Rng(seed)) {}
  explicit Tail(Rng rng) : frozen(I, O, true, Init{DType::F64, Device::CPU, &rng}) {
    child("frozen", frozen);
    gain = Tensor::randn({O}, rng, 1.0, DType::F64);
    param("gain", gain);
    frozen.weight.copy_(Tensor::randn({O, I}, rng, 0.5, DType::F64));
    frozen.bias.copy_(Tensor::randn({O}, rng, 0.5, DType::F64));
  }
};

// EMA::fuse on CUDA: adamw_ema_update takes the new masters from registers; the targets, their
// masters and the encoder's masters must be the bits of step() then update(), on the vectorized
// path (the whole Net as the target: runs from 0, lengths no multiple of 4) and the element-wise
// one (Tail: runs from 69077 and 67), including a skipped step.
TEST_CASE("CUDA EMA fused into AdamW: the bits of step() then update()", "[cuda][optim]") {
  need_gpu();
  for (int whole = 1; whole >= 0; whole--) {
    for (DType compute : {DType::F32, DType::BF16}) {
      INFO((whole ? "Net" : "Tail") << " target, " << dtype_name(compute));
      struct Side {
        Net enc;
        std::unique_ptr<Module> target;
        std::unique_ptr<Optimizer> og;
        std::unique_ptr<EMA> ema;
      };
      Side sides[2] = {{Net(71), nullptr, nullptr, nullptr}, {Net(71), nullptr, nullptr, nullptr}};
      for (Side& sd : sides) {
        sd.enc.to_device(DType::F32, Device::CUDA);
        sd.enc.frozen.requires_grad_(true);  // every target name needs a master
        if (whole) {
          auto t = std::make_unique<Net>(72);
          t->to_device(compute, Device::CUDA);
          sd.target = std::move(t);
        } else {
          sd.target = std::make_unique<Tail>(73);
          for (auto& [n, t] : sd.target->named_parameters()) *t = t->to(compute).to(Device::CUDA);
        }
        sd.target->requires_grad_(false);
        sd.og = std::make_unique<Optimizer>(groups_of(sd.enc), OptimConfig{}, compute, Device::CUDA);
        sd.ema = std::make_unique<EMA>(*sd.target, *sd.og, "");
      }
      REQUIRE(sides[1].ema->fuse(*sides[1].og, 0.9));
      Rng rng(8);
      for (int step = 0; step < 4; step++) {
        INFO("step " << step);
        Rng r0 = rng;
        random_grads(sides[0].enc, r0);
        random_grads(sides[1].enc, rng);
        for (Side& sd : sides) {
          Tensor loss = Tensor::from_vector(std::vector<float>{step == 1 ? NAN : 1.f}, {1}, Device::CUDA);
          sd.og->clip_grad_norm(0.0, loss);  // step 1: non-finite, skipped with its EMA
          sd.og->step(1e-2);
          sd.ema->update(0.9);
        }
        for (auto& [n, t] : sides[0].target->named_parameters()) {
          INFO(n);
          Tensor* f = slot_of(*sides[1].target, n);
          CHECK(f->dtype() == t->dtype());
          CHECK(f->to_vector<double>() == t->to_vector<double>());
          CHECK(sides[1].og->master(n).to_vector<double>() == sides[0].og->master(n).to_vector<double>());
        }
        auto ma = sides[0].ema->masters("target."), mb = sides[1].ema->masters("target.");
        REQUIRE(ma.size() == mb.size());
        for (auto& [k, m] : ma) CHECK(mb.at(k).to_vector<double>() == m.to_vector<double>());
      }
    }
  }
}

// The multi-tensor kernel directly: more tensors than one launch takes (96), tensors of
// several 4096-element slices beside one-element ones, bf16 copies poisoned beforehand, and a
// skipped step (ctl[1] == 0) that must leave every target and copy as it was.
TEST_CASE("CUDA ema_update_many: many tensors, several slices each, skipped steps", "[cuda][optim]") {
  need_gpu();
  Rng rng(9);
  const int count = 130;
  vector<Tensor> tgt, src, cpy;
  vector<vector<double>> want;
  vector<EmaTensor<float, bf16>> list;
  for (int i = 0; i < count; i++) {
    const int64_t n = i % 7 == 0 ? 9000 + i : 1 + (i * 37) % 500;
    vector<double> t(static_cast<size_t>(n)), s(static_cast<size_t>(n));
    for (auto& e : t) e = rng.normal();
    for (auto& e : s) e = rng.normal();
    tgt.push_back(Tensor::from_vector(t, {n}).to(DType::F32).to(Device::CUDA));
    src.push_back(Tensor::from_vector(s, {n}).to(DType::F32).to(Device::CUDA));
    cpy.push_back(Tensor::empty({n}, DType::BF16, Device::CUDA));
    cpy.back().fill_(NAN);
    // the reference from the f32-rounded inputs
    auto tr = tgt.back().to_vector<double>(), sr = src.back().to_vector<double>();
    for (size_t k = 0; k < tr.size(); k++) tr[k] = 0.9 * tr[k] + 0.1 * sr[k];
    want.push_back(tr);
    list.push_back({tgt.back().data<float>(), cpy.back().data<bf16>(), src.back().data<float>(), n});
  }
  Tensor ctl = Tensor::from_vector(vector<double>{1, 1, 0, 1}, {4}).to(DType::F32).to(Device::CUDA);  // applied
  cuda::ema_update_many<float, bf16>(list.data(), count, ctl.data<float>(), 0.9, cuda::default_stream());
  for (int i = 0; i < count; i++) {
    INFO("tensor " << i << " of " << tgt[i].numel());
    LOOM_CHECK_CLOSE(tol::compare(tgt[i].to_vector<double>(), want[i], tol::kCudaF32, "ema target"));
    LOOM_CHECK_CLOSE(tol::compare(cpy[i].to_vector<double>(), want[i], tol::kCudaBF16, "ema bf16 copy"));
  }
  Tensor skip = Tensor::from_vector(vector<double>{1, 0, 0, 1}, {4}).to(DType::F32).to(Device::CUDA);
  vector<vector<double>> before;
  for (auto& t : tgt) before.push_back(t.to_vector<double>());
  for (auto& c : cpy) c.fill_(7.0);
  // ctl[1] == 0: the optimizer skipped this step
  cuda::ema_update_many<float, bf16>(list.data(), count, skip.data<float>(), 0.5, cuda::default_stream());
  for (int i = 0; i < count; i++) {
    CHECK(tgt[i].to_vector<double>() == before[i]);
    CHECK(cpy[i].to_vector<double>() == vector<double>(before[i].size(), 7.0));
  }
}
