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

// Weights of rows[i] rows each, one after another in b: windows of b whose gradients are windows
// of gb (the layout of the optimizer's flat buffers: the joined products), or, not joined, clones
// with gradients of their own
static vector<Tensor> weight_windows(const Tensor& b, const Tensor& gb, const vector<int64_t>& rows, bool joined) {
  vector<Tensor> w;
  int64_t r0 = 0;
  for (int64_t n : rows) {
    Tensor t = joined ? b.narrow(0, r0, n) : b.narrow(0, r0, n).clone();
    t.requires_grad_();
    if (joined) t.set_grad(gb.narrow(0, r0, n));
    w.push_back(t);
    r0 += n;
  }
  return w;
}

// The joined products of a Llama layer on the GPU (autograd/ops.h qkv_rope, mlp_swiglu): with the
// weights and their gradients as windows of one buffer (the optimizer's flat buffers) one GEMM
// runs for q|k|v and one for gate|up, with RoPE and SwiGLU on the joined rows; against the CPU
// f64 ops on separate weights (linear_many + rope, two GEMMs). Values and every gradient.
TEST_CASE("joined q|k|v and gate|up products on CUDA against separate weights on the CPU", "[optim]") {
  need_gpu();
  const int N = 53, C = 64, H = 3, KV = 1, hd = 16, I = 40;
  const int R = (H + 2 * KV) * hd;
  Rng rng(77);
  std::vector<int32_t> pv(N);
  for (int i = 0; i < N; i++) pv[size_t(i)] = (i * 7) % 23;
  Tensor pos = Tensor::from_vector(pv, {N});
  // inputs rounded to bf16 values (exact in every dtype below), so that the reference and the
  // bf16 run start from the same numbers; magnitudes ~0.5 keep the long sums' absolute error
  // (53-row weight gradients from bf16 intermediates) inside kCudaBF16's 2e-2
  auto in = [&](const Shape& sh, double std) { return Tensor::randn(sh, rng, std, DType::F64).to(DType::BF16).to(DType::F64); };
  Tensor x = in({N, C}, 0.5), buf = in({R + 2 * I, C}, 0.125), wd = in({C, I}, 0.15);
  Tensor rq = in({N, H, hd}, 0.5), rk = in({N, KV, hd}, 0.5), rv = in({N, KV, hd}, 0.5), rm = in({N, C}, 0.5);
  const std::vector<int64_t> rows = {H * hd, KV * hd, KV * hd, I, I};
  struct Out { std::vector<Tensor> vals, grads; };
  // joined: weights and gradients as windows of one buffer each (on `dev` in `dt`); else clones
  auto run = [&](Device dev, DType dt, bool joined) {
    auto mv = [&](const Tensor& t) { return t.to(dev).to(dt); };
    Tensor b = mv(buf), gb = Tensor::zeros({R + 2 * I, C}, dt, dev), xd = mv(x).requires_grad_(), wdd = mv(wd).requires_grad_();
    std::vector<Tensor> w = weight_windows(b, gb, rows, joined);
    Tensor p = pos.to(dev);
    auto qkv = qkv_rope(xd, w[0], w[1], w[2], p, H, KV, hd, 1e4);
    Tensor m = mlp_swiglu(xd, w[3], w[4], wdd);
    Tensor loss = add(add(sum(mul(qkv[0], mv(rq))), sum(mul(qkv[1], mv(rk)))),
                      add(sum(mul(qkv[2], mv(rv))), sum(mul(m, mv(rm)))));
    backward(loss);
    Out o{{qkv[0], qkv[1], qkv[2], m}, {xd.grad(), wdd.grad()}};
    for (auto& t : w) o.grads.push_back(t.grad());
    return o;
  };
  Out ref = run(Device::CPU, DType::F64, false);
  for (DType dt : {DType::F32, DType::BF16}) {
    Out got = run(Device::CUDA, dt, true);
    const tol::Tol& t = dt == DType::F32 ? tol::kCudaF32Gemm : tol::kCudaBF16;
    const char* vn[] = {"q", "k", "v", "mlp"};
    const char* gn[] = {"dx", "dWdown", "dWq", "dWk", "dWv", "dWgate", "dWup"};
    for (size_t i = 0; i < ref.vals.size(); i++)
      LOOM_CHECK_CLOSE(tol::compare(got.vals[i].to(Device::CPU).to_vector<double>(), ref.vals[i].to_vector<double>(), t, vn[i]));
    for (size_t i = 0; i < ref.grads.size(); i++)
      LOOM_CHECK_CLOSE(tol::compare(got.grads[i].to(Device::CPU).to_vector<double>(), ref.grads[i].to_vector<double>(), t, gn[i]));
  }
}

// A Llama layer's attention from its input in one node (autograd/ops.h qkv_rope_attention): with
// the weights as windows of one buffer and sequences of >= 512 tokens, bf16 on CUDA runs the
// backward that writes the joined product's gradient rows itself (attention_backward_qkv). Against
// qkv_rope + attention: on the CPU in f64 (separate weights, the reference), on CUDA in f32 (the
// joined op's two-call path), and on CUDA in bf16 with the same joined weights (the same forward
// bits; gradients within bf16's tolerance, dq's reductions running in another order).
TEST_CASE("qkv_rope_attention against qkv_rope and attention", "[optim][attention]") {
  need_gpu();
  const int C = 64, H = 2, KV = 1, hd = 64, R = (H + 2 * KV) * hd;
  const std::vector<int32_t> cuv = {0, 600, 1130};
  const int N = 1130;
  Rng rng(91);
  std::vector<int32_t> pv(N);
  for (int i = 0; i < N; i++) pv[size_t(i)] = i < 600 ? i : i - 600;
  auto in = [&](const Shape& sh, double std) { return Tensor::randn(sh, rng, std, DType::F64).to(DType::BF16).to(DType::F64); };
  Tensor x = in({N, C}, 0.5), buf = in({R, C}, 0.125), rout = in({N, H * hd}, 0.5);
  const std::vector<int64_t> rows = {H * hd, KV * hd, KV * hd};
  struct Out { Tensor val; std::vector<Tensor> grads; };
  auto run = [&](Device dev, DType dt, bool joined, bool one_node) {
    auto mv = [&](const Tensor& t) { return t.to(dev).to(dt); };
    // clones: on the CPU in f64 mv hands back x itself, whose gradient would pile up run after run
    Tensor b = mv(buf).clone(), gb = Tensor::zeros({R, C}, dt, dev), xd = mv(x).clone().requires_grad_();
    std::vector<Tensor> w = weight_windows(b, gb, rows, joined);
    SeqInfo seq = SeqInfo::packed(cuv, dev);
    Tensor p = Tensor::from_vector(pv, {N}).to(dev);
    const double scale = 1.0 / std::sqrt(double(hd));
    Tensor a;
    if (one_node) {
      a = qkv_rope_attention(xd, w[0], w[1], w[2], p, seq, H, KV, hd, 1e4, scale);
    } else {
      auto qkv = qkv_rope(xd, w[0], w[1], w[2], p, H, KV, hd, 1e4);
      a = reshape(attention(qkv[0], qkv[1], qkv[2], seq, true, scale), {N, H * hd});
    }
    backward(sum(mul(a, mv(rout))));
    Out o{a, {xd.grad()}};
    for (auto& t : w) o.grads.push_back(t.grad());
    return o;
  };
  const char* gn[] = {"dx", "dWq", "dWk", "dWv"};
  auto compare = [&](const Out& got, const Out& want, const tol::Tol& t) {
    LOOM_CHECK_CLOSE(tol::compare(got.val.to(Device::CPU).to_vector<double>(), want.val.to(Device::CPU).to_vector<double>(), t, "attention out"));
    for (size_t i = 0; i < want.grads.size(); i++)
      LOOM_CHECK_CLOSE(tol::compare(got.grads[i].to(Device::CPU).to_vector<double>(),
                                    want.grads[i].to(Device::CPU).to_vector<double>(), t, gn[i]));
  };
  Out ref = run(Device::CPU, DType::F64, false, false);
  {
    INFO("CPU f64, one node with joined weights");
    compare(run(Device::CPU, DType::F64, true, true), ref, tol::kSameMathF64);
  }
  {
    INFO("CUDA f32, one node with joined weights");
    compare(run(Device::CUDA, DType::F32, true, true), ref, tol::kCudaF32Gemm);
  }
  {
    INFO("CUDA bf16, one node against the two ops, joined weights both");
    Out one = run(Device::CUDA, DType::BF16, true, true), two = run(Device::CUDA, DType::BF16, true, false);
    CHECK(one.val.to(Device::CPU).to_vector<double>() == two.val.to(Device::CPU).to_vector<double>());
    compare(one, two, tol::kCudaBF16);
  }
}

// A ViT block's attention from its normed input in one node (autograd/ops.h qkv_attention): its
// backward writes dq | dk | dv as the rows of one gradient (attention_backward_qkv without RoPE;
// bf16 on CUDA: the one-tile backward at 49 tokens, the warp-specialized one at 196), so that the
// projection's backward is one product each for dx, dW and db. Against linear_split + attention:
// on the CPU in f64 (the reference), on CUDA in f32 (the strided copies), and in bf16 against the
// two ops on CUDA (the same forward bits; gradients within bf16's tolerance: the products sum in
// another order).
TEST_CASE("qkv_attention against linear_split and attention", "[optim][attention]") {
  need_gpu();
  const int C = 96, H = 2, hd = 64, D = H * hd;
  Rng rng(uint64_t(std::random_device{}()));
  for (const int L : {49, 196}) {
    const int B = L == 49 ? 7 : 3, N = B * L;
    auto in = [&](const Shape& sh, double std) { return Tensor::randn(sh, rng, std, DType::F64).to(DType::BF16).to(DType::F64); };
    Tensor x = in({N, C}, 0.5), w = in({3 * D, C}, 0.1), b = in({3 * D}, 0.1), rout = in({N, D}, 0.5);
    struct Out { Tensor val; std::vector<Tensor> grads; };
    auto run = [&](Device dev, DType dt, bool one_node) {
      auto mv = [&](const Tensor& t) { return t.to(dev).to(dt).clone(); };
      Tensor xd = mv(x).requires_grad_(), wd = mv(w).requires_grad_(), bd = mv(b).requires_grad_();
      SeqInfo seq = SeqInfo::dense(B, L, dev);
      const double scale = 1.0 / std::sqrt(double(hd));
      Tensor a;
      if (one_node) {
        a = qkv_attention(xd, wd, bd, seq, H, scale);
      } else {
        auto p = linear_split(xd, wd, bd, 3);
        a = reshape(attention(reshape(p[0], {N, H, hd}), reshape(p[1], {N, H, hd}), reshape(p[2], {N, H, hd}), seq,
                              false, scale),
                    {N, D});
      }
      backward(sum(mul(a, mv(rout))));
      return Out{a, {xd.grad(), wd.grad(), bd.grad()}};
    };
    const char* gn[] = {"dx", "dW", "db"};
    auto compare = [&](const Out& got, const Out& want, const tol::Tol& t) {
      LOOM_CHECK_CLOSE(tol::compare(got.val.to(Device::CPU).to_vector<double>(), want.val.to(Device::CPU).to_vector<double>(), t, "attention out"));
      for (size_t i = 0; i < want.grads.size(); i++)
        LOOM_CHECK_CLOSE(tol::compare(got.grads[i].to(Device::CPU).to_vector<double>(),
                                      want.grads[i].to(Device::CPU).to_vector<double>(), t, gn[i]));
    };
    INFO(L << " tokens a sequence, " << B << " sequences");
    Out ref = run(Device::CPU, DType::F64, false);
    {
      INFO("CPU f64, one node");
      compare(run(Device::CPU, DType::F64, true), ref, tol::kSameMathF64);
    }
    {
      INFO("CUDA f32, one node");
      compare(run(Device::CUDA, DType::F32, true), ref, tol::kCudaF32Gemm);
    }
    {
      INFO("CUDA bf16, one node against the two ops");
      Out one = run(Device::CUDA, DType::BF16, true), two = run(Device::CUDA, DType::BF16, false);
      CHECK(one.val.to(Device::CPU).to_vector<double>() == two.val.to(Device::CPU).to_vector<double>());
      compare(one, two, tol::kCudaBF16);
    }
  }
}

TEST_CASE("Tensor::copy_ into a window of a CUDA tensor, from every kind of source", "[cuda][tensor]") {
  // A window (narrow) of a contiguous CUDA tensor takes one 2-D copy; a contiguous CUDA source
  // of its dtype goes straight into it, the others (CPU, another dtype, strided) through a
  // contiguous temporary. The columns outside the window keep their poison.
  need_gpu();
  Rng rng(uint64_t(std::random_device{}()));
  const int64_t R = 37, C = 21, c0 = 5, w = 9;
  for (DType dt : {DType::F32, DType::BF16}) {
    Tensor host = Tensor::randn({R, w}, rng, 1.0, DType::F32).to(dt);   // the values, as dt
    Tensor wide = Tensor::randn({R, w + 7}, rng, 1.0, DType::F32).to(dt);
    wide.narrow(1, 3, w).copy_(host);                                   // a strided source of the same values
    const std::vector<std::pair<const char*, Tensor>> sources = {
        {"CUDA contiguous", host.to(Device::CUDA)},
        {"CPU", host},
        {"CUDA f64", host.to(DType::F64).to(Device::CUDA)},
        {"CUDA strided", wide.to(Device::CUDA).narrow(1, 3, w)}};
    for (const auto& [what, src] : sources) {
      INFO(what << ", " << dtype_name(dt));
      Tensor dst = Tensor::full({R, C}, std::nan(""), dt, Device::CUDA);
      dst.narrow(1, c0, w).copy_(src);
      std::vector<double> got = dst.to(Device::CPU).to_vector<double>(), want = host.to_vector<double>();
      for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < C; c++) {
          const double g = got[size_t(r * C + c)];
          if (c < c0 || c >= c0 + w) CHECK(std::isnan(g));
          else CHECK(g == want[size_t(r * w + c - c0)]);
        }
    }
  }
}

TEST_CASE("Tensor::contiguous of strided CUDA views: windows, transposes, broadcasts", "[cuda][tensor]") {
  // into a contiguous tensor of the same device and dtype in one pass: a window by one 2-D copy,
  // other layouts by the strided kernel; the values against the same views on the CPU
  need_gpu();
  Rng rng(uint64_t(std::random_device{}()));
  for (DType dt : {DType::F32, DType::BF16}) {
    Tensor host = Tensor::randn({6, 11, 13}, rng, 1.0, DType::F32).to(dt), dev = host.to(Device::CUDA);
    Tensor row = Tensor::randn({1, 13}, rng, 1.0, DType::F32).to(dt);
    const std::vector<std::pair<const char*, std::function<Tensor(const Tensor&)>>> views = {
        {"window of the last dim", [](const Tensor& t) { return t.narrow(2, 4, 7); }},
        {"window of the middle dim", [](const Tensor& t) { return t.narrow(1, 2, 5); }},
        {"window of both", [](const Tensor& t) { return t.narrow(1, 1, 9).narrow(2, 3, 1); }},
        {"transpose", [](const Tensor& t) { return t.transpose(1, 2); }}};
    for (const auto& [what, view] : views) {
      INFO(what << ", " << dtype_name(dt));
      Tensor v = view(dev);
      REQUIRE_FALSE(v.is_contiguous());
      Tensor c = v.contiguous();
      CHECK(c.is_contiguous());
      CHECK(c.to(Device::CPU).to_vector<double>() == view(host).contiguous().to_vector<double>());
    }
    INFO("broadcast, " << dtype_name(dt));
    Tensor b = row.to(Device::CUDA).expand({5, 13}).contiguous();
    std::vector<double> got = b.to(Device::CPU).to_vector<double>(), want = row.to_vector<double>();
    for (int i = 0; i < 5 * 13; i++) CHECK(got[size_t(i)] == want[size_t(i % 13)]);
  }
}
