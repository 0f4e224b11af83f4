// optimizer.cpp: AdamW / SGD over flat per-group buffers, device-side clipping, schedules, EMA.
//
// Shape legend: n parameters of one group (the sum of its tensors' numel), k one tensor's numel.
//   master, m, v | buf [n]  master dtype (f32; f64 when the model is f64)
//   grad [n]                compute dtype (f32, f64, or bf16 on CUDA)
//   copy [n]                bf16, only when compute != master dtype
//   norm_sq_, norm_ [1], ctl_ [4]  f32 on the optimizer's device (ctl_: kernels.inc's step
//                                  control {gradient scale, applied, t, lr})
//
// Why flat buffers: the autograd kernels accumulate parameter gradients with `+=` into
// whatever buffer the slot's .grad points at. Pointing every slot's .grad at a slice of one
// flat buffer per group makes zero_grad one fill, the global norm one reduction per group and
// the update one adamw_update launch per group (SmolLM2-135M has ~270 tensors: 270 launches
// per step become 2), and the update also writes the bf16 compute copy in the same pass.
//
// Kernel types: the grad's dtype G picks the backend (dispatch_float) and the master type is
// acc_t<G>: cpu <double,double>, <float,float>; cuda <float,float>, <float,bf16> - exactly the
// instantiations of kernels/cpu/optim.cpp and kernels/cuda/optim.cu.
//
// Nothing in step(), zero_grad() or clip_grad_norm() reads a device value on the host: the
// clip scale, the skip of a non-finite step, the step count t of the bias corrections and the
// learning rate are device scalars (ctl_) that the update kernels read, so a whole training
// step can be enqueued (or captured into a CUDA graph) without waiting for the GPU.
#include "optim/optimizer.h"

#include <cfloat>
#include <cmath>
#include <cstring>
#include <set>

#include "tensor/dispatch.h"

namespace loom {

struct Optimizer::Group {
  std::string name;
  double lr_scale = 1.0, weight_decay = 0.0;
  std::vector<std::string> names;  // parameter names, in flat-buffer order
  std::vector<Shape> shapes;
  std::vector<int64_t> offsets;    // element offset of each tensor in the flat buffers
  int64_t n = 0;
  Tensor master, m, v, buf, grad, copy;
  // ZeRO-1 (Optimizer::shard): rank r owns [bounds[r], bounds[r + 1]); m, v / buf hold the
  // owned part only, [lo, hi) of this rank. Unsharded: lo = 0, hi = n.
  std::vector<int64_t> bounds;
  int64_t lo = 0, hi = 0;
  // an EMA fused into this group's AdamW pass (fuse_ema): its source is [ema_lo, ema_hi)
  Tensor ema_target, ema_copy;
  int64_t ema_lo = 0, ema_hi = 0;
  double ema_decay = 0;

  // the flat buffer the model's slots view (what the forward reads)
  const Tensor& compute() const { return copy.defined() ? copy : master; }
  Tensor slice(const Tensor& flat, size_t i) const {
    return flat.narrow(0, offsets[i], shape_numel(shapes[i])).view(shapes[i]);
  }
};

namespace {

template <class T> T* data_or_null(const Tensor& t) { return t.defined() ? t.data<T>() : nullptr; }

}  // namespace

Optimizer::Optimizer(std::vector<ParamGroup> groups, const OptimConfig& cfg, DType compute_dtype,
                     Device device)
    : cfg_(cfg), compute_(compute_dtype), device_(device) {
  LOOM_CHECK(cfg.kind == "adamw" || cfg.kind == "sgd", "optimizer: unknown kind '%s' (adamw | sgd)",
             cfg.kind.c_str());
  const bool ok_dtype = device == Device::CPU ? (compute_dtype == DType::F32 || compute_dtype == DType::F64)
                                              : (compute_dtype == DType::F32 || compute_dtype == DType::BF16 ||
                                                 compute_dtype == DType::F16);
  LOOM_CHECK(ok_dtype, "optimizer: compute dtype %s is not supported on %s (cpu: f32, f64; cuda: f32, bf16, f16)",
             dtype_name(compute_dtype), device_name(device));
  master_dtype_ = compute_dtype == DType::F64 ? DType::F64 : DType::F32;
  const bool adamw = cfg.kind == "adamw";

  // Check every group before any slot is re-pointed, so a bad call leaves the model as it was.
  // A tensor in two groups (or twice in one, or two slots holding one tensor) is a bug.
  std::set<const void*> seen;
  for (auto& pg : groups)
    for (auto& [name, slot] : pg.params) {
      LOOM_CHECK(slot && slot->defined(), "optimizer: parameter '%s' of group '%s' is undefined",
                 name.c_str(), pg.name.c_str());
      if (!slot->requires_grad()) continue;  // frozen: left alone
      LOOM_CHECK(seen.insert(slot).second && seen.insert(slot->impl().get()).second,
                 "optimizer: parameter '%s' appears twice (group '%s')", name.c_str(), pg.name.c_str());
      LOOM_CHECK(slot->device() == device, "optimizer: parameter '%s' is %s, the optimizer runs on %s",
                 name.c_str(), slot->desc().c_str(), device_name(device));
      LOOM_CHECK(dtype_is_float(slot->dtype()), "optimizer: parameter '%s' is %s, not floating",
                 name.c_str(), slot->desc().c_str());
    }
  try {
    for (auto& pg : groups) {
      auto* g = new Group();
      groups_.push_back(g);
      g->name = pg.name;
      g->lr_scale = pg.lr_scale;
      g->weight_decay = pg.weight_decay;
      std::vector<Tensor*> slots;
      for (auto& [name, slot] : pg.params) {
        if (!slot->requires_grad()) continue;
        g->names.push_back(name);
        g->shapes.push_back(slot->shape());
        g->offsets.push_back(g->n);
        g->n += slot->numel();
        slots.push_back(slot);
      }
      g->hi = g->n;
      if (g->n == 0) continue;  // an empty group keeps its index and owns no buffers
      g->master = Tensor::empty({g->n}, master_dtype_, device);
      for (size_t i = 0; i < slots.size(); i++) g->slice(g->master, i).copy_(*slots[i]);
      if (adamw) {
        g->m = Tensor::zeros({g->n}, master_dtype_, device);
        g->v = Tensor::zeros({g->n}, master_dtype_, device);
      } else {
        g->buf = Tensor::zeros({g->n}, master_dtype_, device);
      }
      g->grad = Tensor::zeros({g->n}, compute_dtype, device);
      if (compute_dtype != master_dtype_) {
        g->copy = Tensor::empty({g->n}, compute_dtype, device);
        g->copy.copy_(g->master);
      }
      // Re-point the model's slots: value = view of the compute buffer, grad = view of the
      // flat gradient, so backward's `+=` lands in the flat buffer.
      for (size_t i = 0; i < slots.size(); i++) {
        *slots[i] = g->slice(g->compute(), i);
        slots[i]->requires_grad_(true);
        slots[i]->set_grad(g->slice(g->grad, i));
      }
    }
  } catch (...) {
    for (auto* g : groups_) delete g;
    throw;
  }
  norm_sq_ = Tensor::zeros({1}, DType::F32, device);
  norm_ = Tensor::zeros({1}, DType::F32, device);
  ctl_ = Tensor::from_vector(std::vector<float>{1.f, 1.f, 0.f, 0.f}, {4}, device);
}

Optimizer::~Optimizer() {
  for (auto* g : groups_) delete g;
}

void Optimizer::zero_grad() {
  for (auto* g : groups_)
    if (g->n) g->grad.fill_(0.0);  // one fill kernel per group
}

Tensor Optimizer::clip_grad_norm(double max_norm, const Tensor& loss) {
  LOOM_CHECK(!loss.defined() || (loss.numel() == 1 && loss.dtype() == DType::F32 && loss.device() == device_),
             "clip_grad_norm: the loss must be one f32 value on %s, got %s", device_name(device_),
             loss.desc().c_str());
  norm_sq_.fill_(0.0);
  for (auto* g : groups_) {
    if (!g->n) continue;
    dispatch_float(g->grad, [&](auto dev, auto zero) {
      using G = decltype(zero);
      KERNEL(dev, grad_norm_squared)(norm_sq_.data<float>(), g->grad.data<G>(), g->n, stream_for(dev));
    });
  }
  dispatch_float(norm_sq_, [&](auto dev, auto) {
    KERNEL(dev, step_control)(ctl_.data<float>(), norm_.data<float>(), norm_sq_.data<float>(),
                              loss.defined() ? loss.data<float>() : nullptr, float(max_norm),
                              scaler_.defined() ? scaler_.data<float>() : nullptr, growth_interval_, stream_for(dev));
  });
  controlled_ = true;
  // A copy, so that the caller's handle (read later, for the log) is not overwritten by the
  // next call: 4 bytes, device to device, no host sync.
  return norm_.clone();
}

void Optimizer::enable_loss_scaling(double init_scale, int growth_interval) {
  LOOM_CHECK(init_scale >= 1 && init_scale <= 16777216 && growth_interval >= 1,
             "enable_loss_scaling: scale %g (1 .. 2^24), growth interval %d (>= 1)", init_scale, growth_interval);
  scaler_ = Tensor::from_vector(std::vector<float>{float(init_scale), 0.f}, {2}, device_);
  growth_interval_ = growth_interval;
}

Tensor Optimizer::loss_scale_value() const {
  LOOM_CHECK(scaler_.defined(), "loss_scale_value: loss scaling is off (enable_loss_scaling)");
  return scaler_.narrow(0, 0, 1);
}

void Optimizer::set_lr(double lr) { ctl_.narrow(0, 3, 1).fill_(lr); }

int64_t Optimizer::steps() const { return int64_t(ctl_.narrow(0, 2, 1).item()); }

void Optimizer::step() {
  LOOM_CHECK(controlled_ || !scaler_.defined(),
             "optimizer step: with loss scaling, clip_grad_norm must run first (it unscales the gradients)");
  if (!controlled_)  // no norm this step: scale 1, applied, t + 1
    dispatch_float(ctl_, [&](auto dev, auto) {
      KERNEL(dev, step_control)(ctl_.data<float>(), nullptr, nullptr, nullptr, 0.0f, nullptr, 0, stream_for(dev));
    });
  controlled_ = false;
  const float* ctl = ctl_.data<float>();
  for (auto* g : groups_) {
    if (!g->n) continue;
    dispatch_float(g->grad, [&](auto dev, auto zero) {
      using G = decltype(zero);
      using M = acc_t<G>;
      // the owned part [lo, hi) (all of it unless sharded); m, v and buf start at lo
      const int64_t lo = g->lo, cnt = g->hi - g->lo;
      if (cnt == 0) return;
      G* copy = sharded() ? nullptr : data_or_null<G>(g->copy);  // sharded: cast below from the whole master
      M* master = g->master.data<M>() + lo;
      const G* grad = g->grad.data<G>() + lo;
      if (cfg_.kind == "adamw") {
        AdamWHyper h;
        h.lr = float(g->lr_scale);  // times the schedule's lr, ctl[3]
        h.beta1 = float(cfg_.beta1);
        h.beta2 = float(cfg_.beta2);
        h.eps = float(cfg_.eps);
        h.weight_decay = float(g->weight_decay);
        if (g->ema_target.defined()) {  // unsharded: lo = 0, cnt = n
          EmaRange<M, G> e{g->ema_target.data<M>(), data_or_null<G>(g->ema_copy), g->ema_lo, g->ema_hi, g->ema_decay};
          KERNEL(dev, adamw_ema_update)(master, copy, g->m.data<M>(), g->v.data<M>(), grad, ctl, cnt, h, e,
                                        stream_for(dev));
        } else {
          KERNEL(dev, adamw_update)(master, copy, g->m.data<M>(), g->v.data<M>(), grad, ctl, cnt, h, stream_for(dev));
        }
      } else {
        KERNEL(dev, sgd_update)(master, copy, g->buf.data<M>(), grad, ctl, cnt, float(g->lr_scale),
                                float(cfg_.momentum), float(g->weight_decay), stream_for(dev));
      }
    });
  }
  if (!sharded()) return;
  for (auto* g : groups_) {  // every rank's part of the new master to every rank, then the copy
    if (!g->n) continue;
    gather_(g->master, g->bounds);
    if (g->copy.defined()) g->copy.copy_(g->master);
  }
}

void Optimizer::shard(int rank, int world, PartGather gather) {
  LOOM_CHECK(world >= 1 && rank >= 0 && rank < world && (world == 1 || gather),
             "Optimizer::shard: rank %d of %d%s", rank, world, gather ? "" : " without a gather");
  LOOM_CHECK(!sharded(), "Optimizer::shard: already sharded");
  for (auto* g : groups_)
    LOOM_CHECK(!g->ema_target.defined(), "Optimizer::shard: an EMA is fused into group '%s' (a sharded step updates "
               "part of each master: fuse no EMA into it)", g->name.c_str());
  LOOM_CHECK(steps() == 0, "Optimizer::shard: after %lld steps (shard before the first step and before a resume "
             "loads the state: the moments start over)", (long long)steps());
  rank_ = rank;
  world_ = world;
  gather_ = std::move(gather);
  if (world == 1) return;
  constexpr int64_t kAlign = 64;  // elements: 256-byte aligned parts for the f32 state's 16-byte loads
  for (auto* g : groups_) {
    g->bounds.assign(size_t(world) + 1, g->n);
    for (int r = 0; r < world; r++) g->bounds[size_t(r)] = std::min(g->n, g->n * r / world / kAlign * kAlign);
    g->lo = g->bounds[size_t(rank)];
    g->hi = g->bounds[size_t(rank) + 1];
    if (!g->n) continue;
    // the owned part of the (still zero) moments; one element when the part is empty, so the
    // buffers stay allocated tensors
    const int64_t own = std::max<int64_t>(1, g->hi - g->lo);
    for (Tensor* t : {&g->m, &g->v, &g->buf})
      if (t->defined()) *t = Tensor::zeros({own}, master_dtype_, device_);
  }
}

int64_t Optimizer::owned_parameters() const {
  int64_t n = 0;
  for (auto* g : groups_) n += g->hi - g->lo;
  return n;
}

Tensor Optimizer::master(const std::string& name) const {
  for (auto* g : groups_)
    for (size_t i = 0; i < g->names.size(); i++)
      if (g->names[i] == name) return g->slice(g->master, i);
  LOOM_CHECK(false, "optimizer: no parameter named '%s' (frozen, or not in any group)", name.c_str());
  return Tensor();
}

// The tensors are the live buffers (no copy: the state is 3x the model): save them before the
// next step().
std::map<std::string, Tensor> Optimizer::state_dict() const {
  std::map<std::string, Tensor> sd;
  for (size_t i = 0; i < groups_.size(); i++) {
    const Group& g = *groups_[i];
    if (!g.n) continue;
    const std::string p = "group." + std::to_string(i) + ".";
    sd[p + "master"] = g.master;
    for (auto [key, t] : {std::pair<const char*, const Tensor*>{"m", &g.m}, {"v", &g.v}, {"buf", &g.buf}}) {
      if (!t->defined()) continue;
      if (!sharded()) {
        sd[p + key] = *t;
        continue;
      }
      Tensor whole = Tensor::zeros({g.n}, master_dtype_, device_);  // this rank's part, then the others'
      if (g.hi > g.lo) whole.narrow(0, g.lo, g.hi - g.lo).copy_(t->narrow(0, 0, g.hi - g.lo));
      gather_(whole, g.bounds);
      sd[p + key] = whole;
    }
  }
  sd["step"] = Tensor::from_vector(std::vector<int64_t>{steps()}, {1});
  if (scaler_.defined()) sd["loss_scale"] = scaler_;
  return sd;
}

void Optimizer::load_state_dict(const std::map<std::string, Tensor>& sd, const std::string& source) {
  // Check everything before writing anything, so a bad file leaves the optimizer as it was.
  struct Load {
    Tensor dst;
    const Tensor* src;
    int64_t from, count;  // src's elements [from, from + count) -> dst's first count
  };
  std::vector<Load> todo;
  for (size_t i = 0; i < groups_.size(); i++) {
    const Group& g = *groups_[i];
    if (!g.n) continue;
    const std::string p = "group." + std::to_string(i) + ".";
    const std::pair<const char*, Tensor> slots[] = {{"master", g.master}, {"m", g.m}, {"v", g.v}, {"buf", g.buf}};
    for (const auto& [key, dst] : slots) {
      if (!dst.defined()) continue;
      const bool part = sharded() && std::strcmp(key, "master") != 0;  // the file holds all ranks' moments
      const std::string name = p + key;
      auto it = sd.find(name);
      LOOM_CHECK(it != sd.end(), "%s: missing optimizer tensor '%s' (expected %s[%lld], group '%s', %s)",
                 source.c_str(), name.c_str(), dtype_name(master_dtype_), (long long)g.n, g.name.c_str(),
                 cfg_.kind.c_str());
      LOOM_CHECK(it->second.shape() == Shape{g.n} && dtype_is_float(it->second.dtype()),
                 "%s: optimizer tensor '%s' is %s, expected %s[%lld] (group '%s')", source.c_str(), name.c_str(),
                 it->second.desc().c_str(), dtype_name(master_dtype_), (long long)g.n, g.name.c_str());
      todo.push_back({dst, &it->second, part ? g.lo : 0, part ? g.hi - g.lo : g.n});
    }
  }
  auto st = sd.find("step");
  LOOM_CHECK(st != sd.end(), "%s: missing optimizer tensor 'step'", source.c_str());
  LOOM_CHECK(st->second.numel() == 1, "%s: optimizer tensor 'step' is %s, expected one value", source.c_str(),
             st->second.desc().c_str());
  // "loss_scale" (fp16 runs): loaded when this optimizer scales, ignored otherwise (a bf16 or
  // f32 run may continue an fp16 one); a scaling optimizer without it keeps its initial scale.
  auto ls = sd.find("loss_scale");
  if (ls != sd.end())
    LOOM_CHECK(ls->second.numel() == 2 && dtype_is_float(ls->second.dtype()),
               "%s: optimizer tensor 'loss_scale' is %s, expected f32[2] {scale, good steps}", source.c_str(),
               ls->second.desc().c_str());
  if (todo.size() + 1 + (ls != sd.end()) != sd.size()) {
    std::string extra;  // name the entries this optimizer has no place for
    for (auto& [k, t] : sd) {
      bool used = k == "step" || k == "loss_scale";
      for (auto& d : todo) used |= d.src == &t;
      if (!used) extra += " '" + k + "' " + t.desc();
    }
    LOOM_CHECK(false, "%s: unexpected optimizer tensors (%s optimizer, %zu groups):%s", source.c_str(),
               cfg_.kind.c_str(), groups_.size(), extra.c_str());
  }
  const double step = st->second.item();
  LOOM_CHECK(step >= 0 && step == std::floor(step), "%s: optimizer tensor 'step' = %g is not a count",
             source.c_str(), step);

  for (auto& l : todo) {
    if (l.count == 0) continue;  // a sharded rank's empty part
    Tensor d = l.dst.narrow(0, 0, l.count);
    d.copy_(l.src->narrow(0, l.from, l.count));  // converts dtype / device; exact for same-dtype state
  }
  for (auto* g : groups_)
    if (g->n && g->copy.defined()) g->copy.copy_(g->master);  // re-derive the bf16 weights
  ctl_.narrow(0, 2, 1).fill_(step);
  if (scaler_.defined() && ls != sd.end()) scaler_.copy_(ls->second);
  controlled_ = false;
}

std::string Optimizer::backend() const {
  int n = 0;
  for (auto* g : groups_) n += g->n > 0;
  return strformat("%s: one fused multi-tensor kernel per group (%s, %d groups, %s master%s); clip, skip and "
                   "lr on the device%s", cfg_.kind.c_str(), device_name(device_), n, dtype_name(master_dtype_),
                   compute_ != master_dtype_ ? (std::string(" + ") + dtype_name(compute_) + " copy").c_str() : "",
                   (scaler_.defined() ? strformat("; dynamic loss scaling (growth every %d steps)", growth_interval_)
                                      : std::string()).c_str()) +
         (sharded() ? strformat("; ZeRO-1, rank %d of %d: moments of %lld of %lld parameters", rank_, world_,
                                (long long)owned_parameters(), (long long)num_parameters())
                    : std::string()) +
         [&] {
           int64_t e = 0;
           for (auto* g : groups_) e += g->ema_hi - g->ema_lo;
           return e ? strformat("; the EMA of %lld parameters in the same pass", (long long)e) : std::string();
         }();
}

bool Optimizer::can_fuse_ema() const { return cfg_.kind == "adamw" && !sharded(); }

bool Optimizer::group_has_ema(int group) const {
  LOOM_CHECK(group >= 0 && group < int(groups_.size()), "group_has_ema: no group %d", group);
  return groups_[group]->ema_target.defined();
}

bool Optimizer::flat_runs(const std::vector<std::string>& names, std::vector<FlatRun>& runs, std::vector<int>& run_of,
                          std::vector<int64_t>& offset) const {
  runs.clear();
  run_of.assign(names.size(), -1);
  offset.assign(names.size(), 0);
  std::set<std::string> seen;
  std::vector<int64_t> covered;  // elements of each run's parameters
  for (size_t k = 0; k < names.size(); k++) {
    if (!seen.insert(names[k]).second) return false;
    int gi = -1;
    size_t pi = 0;
    for (size_t j = 0; j < groups_.size() && gi < 0; j++)
      for (size_t i = 0; i < groups_[j]->names.size(); i++)
        if (groups_[j]->names[i] == names[k]) {
          gi = int(j);
          pi = i;
          break;
        }
    if (gi < 0) return false;
    const Group& g = *groups_[gi];
    const int64_t a = g.offsets[pi], b = a + shape_numel(g.shapes[pi]);
    int r = 0;
    while (r < int(runs.size()) && runs[r].group != gi) r++;
    if (r == int(runs.size())) {
      runs.push_back({gi, a, b});
      covered.push_back(0);
    }
    runs[r].lo = std::min(runs[r].lo, a);
    runs[r].hi = std::max(runs[r].hi, b);
    covered[r] += b - a;
    run_of[k] = r;
    offset[k] = a;  // made relative below, once each run's lo is known
  }
  // the flat layout has no gaps: a run whose parameters add up to its length holds no other
  for (size_t r = 0; r < runs.size(); r++)
    if (covered[r] != runs[r].hi - runs[r].lo) return false;
  for (size_t k = 0; k < names.size(); k++) offset[k] -= runs[run_of[k]].lo;
  return true;
}

void Optimizer::fuse_ema(const FlatRun& run, const Tensor& target, const Tensor& copy, double decay) {
  LOOM_CHECK(can_fuse_ema(), "fuse_ema: the %s optimizer%s has no fused EMA", cfg_.kind.c_str(),
             sharded() ? " (sharded)" : "");
  LOOM_CHECK(run.group >= 0 && run.group < int(groups_.size()), "fuse_ema: no group %d", run.group);
  Group& g = *groups_[run.group];
  LOOM_CHECK(0 <= run.lo && run.lo < run.hi && run.hi <= g.n, "fuse_ema: run [%lld, %lld) of group '%s' (%lld elements)",
             (long long)run.lo, (long long)run.hi, g.name.c_str(), (long long)g.n);
  LOOM_CHECK(!g.ema_target.defined(), "fuse_ema: group '%s' already has an EMA", g.name.c_str());
  LOOM_CHECK(target.defined() && target.dtype() == master_dtype_ && target.device() == device_ &&
                 target.numel() == run.hi - run.lo && target.is_contiguous(),
             "fuse_ema: the target is %s; group '%s' needs %lld contiguous %s elements on %s",
             target.defined() ? target.desc().c_str() : "undefined", g.name.c_str(), (long long)(run.hi - run.lo),
             dtype_name(master_dtype_), device_name(device_));
  const bool want_copy = compute_ != master_dtype_;
  LOOM_CHECK(copy.defined() == want_copy &&
                 (!want_copy || (copy.dtype() == compute_ && copy.device() == device_ &&
                                 copy.numel() == target.numel() && copy.is_contiguous())),
             "fuse_ema: the copy is %s; with %s compute it must be %s", copy.defined() ? copy.desc().c_str() : "undefined",
             dtype_name(compute_), want_copy ? "contiguous and of the target's size in that dtype" : "undefined");
  g.ema_target = target;
  g.ema_copy = copy;
  g.ema_lo = run.lo;
  g.ema_hi = run.hi;
  g.ema_decay = decay;
}

std::vector<Tensor> Optimizer::grad_buffers() const {
  std::vector<Tensor> v;
  for (auto* g : groups_)
    if (g->n) v.push_back(g->grad);
  return v;
}

std::vector<std::vector<int64_t>> Optimizer::grad_offsets() const {
  std::vector<std::vector<int64_t>> v;
  for (auto* g : groups_)
    if (g->n) v.push_back(g->offsets);
  return v;
}

int64_t Optimizer::num_parameters() const {
  int64_t n = 0;
  for (auto* g : groups_) n += g->n;
  return n;
}

std::vector<ParamGroup> default_groups(Module& m, double weight_decay) {
  ParamGroup decay{"decay", 1.0, weight_decay, {}}, no_decay{"no_decay", 1.0, 0.0, {}};
  for (auto& [name, slot] : m.named_parameters()) {
    if (!slot->defined() || !slot->requires_grad()) continue;  // frozen (e.g. the EMA target)
    (slot->dim() >= 2 ? decay : no_decay).params.push_back({name, slot});
  }
  return {decay, no_decay};
}

constexpr double kPi = 3.14159265358979323846;

double lr_at(int64_t step, int64_t total, int64_t warmup, double lr, double min_lr, const std::string& schedule) {
  LOOM_CHECK(schedule == "cosine" || schedule == "linear" || schedule == "constant",
             "lr_at: unknown schedule '%s' (cosine | linear | constant)", schedule.c_str());
  LOOM_CHECK(step >= 0 && warmup >= 0, "lr_at: step %lld, warmup %lld", (long long)step, (long long)warmup);
  if (step < warmup) return lr * double(step + 1) / double(warmup);
  if (schedule == "constant") return lr;
  // progress through the decay phase: 0 at the end of warmup, 1 at `total` (and after)
  const double span = double(total - warmup);
  const double p = span <= 0 ? 1.0 : std::min(1.0, double(step - warmup) / span);
  if (schedule == "linear") return lr + (min_lr - lr) * p;
  return min_lr + (lr - min_lr) * 0.5 * (1.0 + std::cos(kPi * p));
}

// ------------------------------------------------------------------ EMA
EMA::EMA(Module& target, const Optimizer& opt, const std::string& source_prefix) : source_prefix_(source_prefix) {
  for (auto& [name, slot] : target.named_parameters()) {
    Tensor src = opt.master(source_prefix + name);
    LOOM_CHECK(slot->shape() == src.shape() && slot->device() == src.device(),
               "EMA: target '%s' is %s, its source '%s%s' is %s", name.c_str(), slot->desc().c_str(),
               source_prefix.c_str(), name.c_str(), src.desc().c_str());
    LOOM_CHECK(slot->dtype() == src.dtype() || acc_dtype(slot->dtype()) == src.dtype(),
               "EMA: target '%s' is %s; its master would be %s, but the source master is %s", name.c_str(),
               slot->desc().c_str(), dtype_name(acc_dtype(slot->dtype())), src.desc().c_str());
    LOOM_CHECK(slot->is_contiguous(), "EMA: target '%s' %s is not contiguous", name.c_str(), slot->desc().c_str());
    Tensor tm;  // the target's master: the slot itself when it is already in the master dtype
    if (slot->dtype() == src.dtype()) {
      tm = *slot;
    } else {
      tm = Tensor::empty(slot->shape(), src.dtype(), slot->device());
      tm.copy_(*slot);  // starts from the target's own (rounded) values
    }
    pairs_.push_back({tm, src});
    ctl_ = opt.control();
    target_slots_.push_back(slot);
    target_master_.push_back(tm);
    names_.push_back(name);
  }
}

std::map<std::string, Tensor> EMA::masters(const std::string& prefix) const {
  std::map<std::string, Tensor> out;
  for (size_t i = 0; i < pairs_.size(); i++)
    if (!target_slots_[i]->same(pairs_[i].first)) out[prefix + names_[i]] = pairs_[i].first;
  return out;
}

bool EMA::fuse(Optimizer& opt, double decay) {
  if (fused_ || pairs_.empty() || !opt.can_fuse_ema()) return false;
  // one dtype for every target slot and one for every master, one device
  const Tensor& s0 = *target_slots_[0];
  const DType mdt = pairs_[0].second.dtype();
  for (size_t k = 0; k < pairs_.size(); k++)
    if (target_slots_[k]->dtype() != s0.dtype() || pairs_[k].second.dtype() != mdt ||
        target_slots_[k]->device() != s0.device())
      return false;
  const bool sixteen = s0.dtype() != mdt;  // the slots are 16-bit rounded copies of the masters
  std::vector<std::string> sources;
  for (auto& n : names_) sources.push_back(source_prefix_ + n);
  std::vector<Optimizer::FlatRun> runs;
  std::vector<int> run_of;
  std::vector<int64_t> offset;
  if (!opt.flat_runs(sources, runs, run_of, offset)) return false;
  for (auto& r : runs)  // checked before anything moves: fuse_ema would refuse it after the re-pointing
    if (opt.group_has_ema(r.group)) return false;
  // Flat targets laid out as their sources are: the values move over, then the slots (and the
  // masters' handles, EMA::masters) become views of them.
  std::vector<Tensor> flat_t, flat_c;
  for (auto& r : runs) {
    flat_t.push_back(Tensor::zeros({r.hi - r.lo}, mdt, s0.device()));
    flat_c.push_back(sixteen ? Tensor::zeros({r.hi - r.lo}, s0.dtype(), s0.device()) : Tensor());
  }
  for (size_t k = 0; k < pairs_.size(); k++) {
    Tensor& slot = *target_slots_[k];
    const int r = run_of[k];
    Tensor tv = flat_t[r].narrow(0, offset[k], slot.numel()).view(slot.shape());
    tv.copy_(pairs_[k].first);
    if (sixteen) {
      Tensor cv = flat_c[r].narrow(0, offset[k], slot.numel()).view(slot.shape());
      cv.copy_(slot);
      slot = cv;
    } else {
      slot = tv;
    }
    pairs_[k].first = tv;
    target_master_[k] = tv;
  }
  for (size_t r = 0; r < runs.size(); r++) opt.fuse_ema(runs[r], flat_t[r], flat_c[r], decay);
  fused_ = true;
  fused_decay_ = decay;
  return true;
}

void EMA::update(double decay) {
  if (fused_) {  // the optimizer's step did it
    LOOM_CHECK(decay == fused_decay_, "EMA::update: decay %g, but the EMA fused into the optimizer's step uses %g",
               decay, fused_decay_);
    return;
  }
  // Dispatch on the copy's dtype G (bf16 on CUDA) or on the master itself; M = acc_t<G>.
  // Targets come in runs of one dtype and device, each run one ema_update_many call: a model
  // trained in one dtype is one run (a ViT-B's 149 tensors in two launches instead of 149).
  auto by_of = [&](size_t i) -> const Tensor& {
    const Tensor& tm = pairs_[i].first;
    const Tensor& slot = *target_slots_[i];
    LOOM_CHECK(slot.numel() == tm.numel() && (slot.same(tm) || slot.dtype() != tm.dtype()),
               "EMA: target slot %zu was replaced (%s) after the EMA was built", i, slot.desc().c_str());
    return slot.same(tm) ? tm : slot;
  };
  const float* ctl = ctl_.defined() ? ctl_.data<float>() : nullptr;
  for (size_t i = 0; i < pairs_.size();) {
    const Tensor& by = by_of(i);
    size_t end = i + 1;
    while (end < pairs_.size() && by_of(end).dtype() == by.dtype() && by_of(end).device() == by.device()) end++;
    dispatch_float(by, [&](auto dev, auto zero) {
      using G = decltype(zero);
      using M = acc_t<G>;
      std::vector<EmaTensor<M, G>> run;
      for (size_t k = i; k < end; k++) {
        const Tensor& tm = pairs_[k].first;
        const Tensor& slot = *target_slots_[k];
        run.push_back({tm.data<M>(), slot.same(tm) ? nullptr : slot.data<G>(), pairs_[k].second.data<M>(), tm.numel()});
      }
      KERNEL(dev, ema_update_many)(run.data(), int(run.size()), ctl, decay, stream_for(dev));
    });
    i = end;
  }
}

}  // namespace loom
