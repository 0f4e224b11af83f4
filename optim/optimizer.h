// optimizer.h: AdamW / SGD over flat parameter buffers, with parameter groups, mixed
// precision, device-side gradient clipping, learning-rate schedules and EMA.
//
// Layout (what makes one launch per group possible): the optimizer takes the model's
// parameter slots (Tensor*), groups them, and for each group allocates flat buffers
//   master [n] (f32, or f64 when the model is f64), m [n], v [n] (AdamW) or buf [n] (SGD),
//   grad [n] in the compute dtype, and, when compute != master dtype, copy [n] (bf16 or f16).
// Each slot is then re-pointed to a view of the compute copy (or of master when the dtypes
// match) with requires_grad, and its .grad to a view of the flat grad buffer, so the kernels'
// `+=` into parameter gradients lands in the flat buffer directly. One optimizer step is then
// one adamw_update launch per group, which also writes the new bf16 copy.
// Frozen parameters (requires_grad false at construction) are left alone.
#pragma once
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "nn/module.h"

namespace loom {

struct OptimConfig {
  std::string kind = "adamw";  // adamw | sgd
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, momentum = 0.9;
};

struct ParamGroup {
  std::string name;                 // e.g. "matrices", "norms", "embeddings", "projector"
  double lr_scale = 1.0;            // group lr = schedule lr * lr_scale
  double weight_decay = 0.0;
  std::vector<std::pair<std::string, Tensor*>> params;
};

// The usual split: 2-D weights (and embeddings) decay, biases / norm gains / positional
// vectors (1-D) do not. `prefix_lr` can scale groups by name prefix ("projector." -> 10x).
std::vector<ParamGroup> default_groups(Module& m, double weight_decay);

class Optimizer {
 public:
  // compute_dtype: the dtype the forward runs in (F32/F64 = master dtype, or BF16 / F16 on CUDA).
  Optimizer(std::vector<ParamGroup> groups, const OptimConfig& cfg, DType compute_dtype, Device device);
  void zero_grad();  // zeros the flat gradient buffers (one memset per group)
  // Global gradient norm and the step's control on the device (no host sync): returns the norm
  // as a device tensor f32 [1]; the next step() multiplies gradients by min(1, max_norm / norm)
  // (max_norm <= 0: no clipping, the norm is still computed) and is skipped, on the device,
  // when the norm or `loss` (optional, a device scalar) is not finite.
  Tensor clip_grad_norm(double max_norm, const Tensor& loss = Tensor());
  // The learning rate of the next step() (times each group's lr_scale), written to the device
  // control vector by a one-element fill: call it outside a captured step.
  void set_lr(double lr);
  // One update with the last set_lr (all of it on the device: graph-capturable).
  void step();
  void step(double lr) { set_lr(lr); step(); }
  // Applied steps (skipped ones do not count): reads the device, so it waits for the GPU.
  int64_t steps() const;
  // The step control [4] f32 (kernels.inc): {gradient scale, applied 1 / skipped 0, t, lr}.
  // The EMA reads it to skip with the optimizer; a trainer copies [1] out to log skips.
  const Tensor& control() const { return ctl_; }

  // Dynamic loss scaling (fp16 training, torch's GradScaler): the loss scale S lives on the
  // device ({S, applied steps in a row}, f32 [2]); the trainer seeds backward with S
  // (loss_scale_value()), clip_grad_norm() divides the norm and the update's gradient scale by
  // S, and a step with non-finite gradients is skipped and halves S (not below 1), while
  // growth_interval applied steps in a row double it. The state is saved as "loss_scale".
  void enable_loss_scaling(double init_scale = 65536.0, int growth_interval = 2000);
  bool loss_scaling() const { return scaler_.defined(); }
  Tensor loss_scale_value() const;  // a view of S, f32 [1] on the device

  // the fp32 (or f64) master value of a parameter by its name (EMA reads it)
  Tensor master(const std::string& name) const;
  // optimizer state for checkpoints: "group.{i}.master", "group.{i}.m", "group.{i}.v" /
  // "group.{i}.buf", and "step"; load checks names and shapes and re-derives the copies
  std::map<std::string, Tensor> state_dict() const;
  void load_state_dict(const std::map<std::string, Tensor>& sd, const std::string& source);
  int64_t num_parameters() const;
  // The flat gradient buffers (one per non-empty group, compute dtype): data parallel averages
  // them across ranks between backward and clip_grad_norm.
  std::vector<Tensor> grad_buffers() const;
  // For each of grad_buffers(): the element offsets at which its parameters' gradients start
  // (data parallel's gradient buckets hold whole parameters).
  std::vector<std::vector<int64_t>> grad_offsets() const;
  // ZeRO stage 1 (data parallel, train.zero_stage = 1): each group's flat buffers are cut into
  // `world` contiguous parts (bounds multiples of 64 elements); this rank keeps the AdamW
  // moments (SGD: the momentum) of part `rank` only and updates only that part of the master
  // weights. `gather(flat, bounds)` is a collective that hands every rank part r of `flat` (the
  // elements [bounds[r], bounds[r + 1])) from rank r, in place; step() calls it on each group's
  // master, and the bf16 / f16 copy is then cast from the whole master. The gradients stay
  // whole (averaged as without it), so the clip norm and the skip are the same on every rank.
  // state_dict() gathers the moments (then every rank must call it: a collective) into the one
  // single-process layout, and load_state_dict() takes this rank's part of it, so checkpoints
  // move freely between sharded, unsharded and single-process runs. Call before the first
  // step and before load_state_dict.
  using PartGather = std::function<void(Tensor& flat, const std::vector<int64_t>& bounds)>;
  void shard(int rank, int world, PartGather gather);
  bool sharded() const { return world_ > 1; }
  // parameters whose moments this rank holds (all of them unless sharded)
  int64_t owned_parameters() const;
  // One line naming the update kernel in use, e.g. "adamw: one fused multi-tensor kernel per
  // group (cuda, 4 groups, fp32 master + bf16 copy)".
  std::string backend() const;

  // An EMA fused into step() (EMA::fuse; AdamW, unsharded: can_fuse_ema()). A FlatRun is a
  // range [lo, hi) of one group's flat buffers.
  struct FlatRun {
    int group = -1;
    int64_t lo = 0, hi = 0;
  };
  bool can_fuse_ema() const;
  // Whether group `group` (a FlatRun's) already carries a fused EMA: one per group.
  bool group_has_ema(int group) const;
  // The runs the parameters `names` fill, one per group they are in, each holding those
  // parameters and no other; run_of[k] / offset[k]: name k's run and its element offset from the
  // run's lo. False (outputs unspecified) when a name is not trained here or is repeated, or
  // another parameter lies inside a run.
  bool flat_runs(const std::vector<std::string>& names, std::vector<FlatRun>& runs, std::vector<int>& run_of,
                 std::vector<int64_t>& offset) const;
  // From now on step() also moves target[i - lo] to decay * target + (1 - decay) * master[i] for
  // every i of the run, right after AdamW's update of master[i], in the same pass (copy: the
  // target in the compute dtype, when that is not the master dtype). target is the master dtype,
  // [hi - lo]; one EMA per group.
  void fuse_ema(const FlatRun& run, const Tensor& target, const Tensor& copy, double decay);

  // ... implementation-defined members (flat buffers, views, clip scale tensor)
 private:
  struct Group;
  std::vector<Group*> groups_;
  OptimConfig cfg_;
  DType compute_, master_dtype_;
  Device device_;
  Tensor norm_sq_, norm_, ctl_;
  Tensor scaler_;  // {loss scale, applied steps in a row} f32 [2], when loss scaling is on
  int growth_interval_ = 2000;
  bool controlled_ = false;  // clip_grad_norm made this step's control
  int rank_ = 0, world_ = 1;  // shard()
  PartGather gather_;
 public:
  ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;
};

// Learning rate at step (0-based) of `total`: linear warmup to lr, then cosine | linear |
// constant decay to min_lr.
double lr_at(int64_t step, int64_t total, int64_t warmup, double lr, double min_lr, const std::string& schedule);

// EMA of a module's parameters from master values: target = decay * target + (1 - decay) * source.
// target's slots are updated in place (their own dtype); source values come from `opt.master`
// under the same names (target_prefix / source_prefix map one to the other), so the EMA sees
// the f32 weights, not their bf16 copies.
class EMA {
 public:
  EMA(Module& target, const Optimizer& opt, const std::string& source_prefix);
  void update(double decay);  // one ema_update_many call per run of targets of one dtype
  // Moves the update into the optimizer's AdamW pass (Optimizer::fuse_ema), where it reads the
  // source masters from registers instead of from memory: the targets are re-pointed to flat
  // buffers laid out as the sources are in the optimizer's groups. Every later opt.step() then
  // does the update with this decay, and update() only checks that it is given the same one
  // (call it after step(), as without fusing). The values are those of step() then update(),
  // bit for bit. False, with nothing changed, where it cannot be done: SGD, a sharded (ZeRO-1)
  // optimizer, targets of mixed dtypes, sources that are not whole runs of their groups, or a
  // group that already carries another EMA (then this one keeps its own update()).
  bool fuse(Optimizer& opt, double decay);
  bool fused() const { return fused_; }
  // The masters the EMA keeps beside 16-bit targets (bf16 / fp16 compute: the slot holds the
  // rounded value, the master the exact one), by the target's parameter name behind `prefix`
  // (the target's path in the model, "target."); empty when every target is in the master
  // dtype and so its own master. Handles to the masters themselves: a checkpoint saves them
  // instead of the rounded slots (model_master_state), and a resume writes the saved values
  // into them and into the slots (load_checkpoint), so that the next update starts from the
  // exact values, as an uninterrupted run would.
  std::map<std::string, Tensor> masters(const std::string& prefix) const;
 private:
  Tensor ctl_;  // the optimizer's step control: skipped steps skip the EMA too
  std::vector<std::pair<Tensor, Tensor>> pairs_;  // (target master, source master)
  std::vector<Tensor*> target_slots_;
  std::vector<Tensor> target_master_;
  std::vector<std::string> names_;
  std::string source_prefix_;
  bool fused_ = false;
  double fused_decay_ = 0;
};

}  // namespace loom
