// run.h: what every trainer shares: the run folder (resolved config, metrics.jsonl, loss plot),
// the per-step log line and progress bar, checkpoints (atomic, resumable, keep last N) and
// the guard that skips non-finite steps.
#pragma once
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "nn/vit.h"
#include "optim/optimizer.h"
#include "trainer/config.h"

namespace loom {

class DataParallel;

struct RunContext {
  Config cfg;
  std::string out_dir;
  Device device = Device::CPU;
  DType compute = DType::F32;  // bf16 on CUDA by default
  uint64_t seed = 0;
  int rank = 0, world = 1;            // data parallel (trainer/distributed.h): rank 0 logs and saves
  DataParallel* dp = nullptr;         // set when world > 1
  int loader_threads = 1;             // data.workers, 0 (auto) resolved: see make_context
};

// What an evaluation reports: the values of its "eval" line in metrics.jsonl and the text
// printed (the same for the evaluations during training and ./train eval).
struct EvalReport {
  std::map<std::string, double> metrics;
  std::string text;
};

// Resolves device/dtype ("auto": CUDA + bf16 when a GPU is usable, else CPU + f32), creates
// out_dir, prints the resolved config and saves it as out_dir/config.cfg.
// rank / world: a data-parallel rank (trainer/distributed.h); ranks other than 0 write no run files.
RunContext open_run(const Config& cfg, int rank = 0, int world = 1);
// The same resolution of device, dtype and attention backend without touching any folder
// (./train eval and export read a finished run and write nothing into it).
RunContext make_context(const Config& cfg, int rank = 0, int world = 1);

struct StepStats {
  int64_t step = 0, total = 0;
  double loss = 0, lr = 0, grad_norm = 0, ms = 0, data_ms = 0;
  double items_per_s = 0;       // tokens/s (VLM) or images/s (MIM)
  const char* items = "tok/s";
  double mfu = -1;              // < 0: not shown (CPU)
  double mem_mb = 0;             // peak allocated (device on CUDA runs, host on CPU runs)
  double reserved_mb = -1;       // held by the caching allocator (CUDA); < 0: not shown
  double loss_scale = -1;        // fp16: the loss scale the step ran with; < 0: not shown
  double energy_j = -1;          // the GPU's energy counter when the step was logged (J); < 0: none
  bool skipped = false;
};

class RunLog {
 public:
  explicit RunLog(const RunContext& ctx, bool append);
  ~RunLog();
  void step(const StepStats& s);  // line (every log_every) or progress bar, + metrics.jsonl
  void event(const std::string& kind, const std::map<std::string, double>& values, const std::string& text = "");
  void finish();                  // writes loss.svg from the metrics
 private:
  void write_line(const std::string& line);
  const RunContext& ctx_;
  FILE* metrics_ = nullptr;
  bool tty_;
  int log_every_;
  // elapsed time counts from the log's creation; the ETA from the steps of this process
  // (a resumed run does not count the steps it did not run)
  double t0_ms_ = 0, first_ms_ = -1;
  int64_t first_step_ = 0;
  std::vector<std::pair<int64_t, double>> train_, val_, lr_, acc_;
  std::string acc_name_;  // "accuracy" (VLM) or "probe" (MIM)
};

// "42s", "3m05s", "1h02m"
std::string fmt_duration(double seconds);
// loss.svg from the curves: a top panel with the loss (log scale: train, its moving average,
// validation) and a bottom panel with the learning rate and the eval accuracy or probe.
std::string loss_svg(const std::string& title, const std::vector<std::pair<int64_t, double>>& train,
                     const std::vector<std::pair<int64_t, double>>& val, const std::vector<std::pair<int64_t, double>>& lr,
                     const std::vector<std::pair<int64_t, double>>& acc, const std::string& acc_name);

// Checkpoints: out_dir/step_00001234/{model.safetensors, optimizer.safetensors, trainer.json};
// written under a temporary name, fsync'ed and renamed when complete (a kill at any moment
// leaves the previous one as the latest); the oldest beyond keep_last are removed. `model`
// holds the master (f32) weights under the model's names. A resumed RunLog cuts
// metrics.jsonl back to the size the checkpoint recorded.
struct TrainerState {
  int64_t step = 0;
  std::map<std::string, double> extra;  // e.g. consecutive NaN skips, best eval
};
// `held`: masters kept outside the optimizer for parameters it does not own (EMA::masters: the
// EMA target's exact values beside its 16-bit slots), saved instead of those slots and, on
// load, written into them as well as into the slots.
void save_checkpoint(const RunContext& ctx, Module& model, const Optimizer& opt, const TrainerState& st,
                     const std::map<std::string, Tensor>& held = {});
// "latest" -> newest complete checkpoint in out_dir ("" when none); a path is used as given.
std::string find_checkpoint(const RunContext& ctx, const std::string& resume);
TrainerState load_checkpoint(const std::string& dir, Module& model, Optimizer& opt,
                             const std::map<std::string, Tensor>& held = {});
// The start of a run: the checkpoint `resume` names (find_checkpoint; none: a fresh run at step
// 0) loaded into model, opt and held, "resumed from ..." printed; under data parallel every rank
// must then start from the same step and the same weights (DataParallel::check_same stops all
// ranks, naming what to fix). *from (nullable): the checkpoint folder, "" for a fresh run.
TrainerState start_run(const RunContext& ctx, const std::string& resume, Module& model, Optimizer& opt,
                       const std::map<std::string, Tensor>& held = {}, std::string* from = nullptr);
// the model weights of a checkpoint folder (for chat / init from a checkpoint)
std::map<std::string, Tensor> load_checkpoint_model(const std::string& dir);
std::string checkpoint_config_text(const std::string& dir);
// step and extra (probe baselines, NaN skips) of a checkpoint, without the optimizer
TrainerState read_checkpoint_state(const std::string& dir);
// A checkpoint folder (trainer.json) as given, or a run folder's newest checkpoint, as
// --train.resume / model.lm_init resolve them; `what` prefixes the error, which names the path.
std::string resolve_checkpoint(const std::string& run_or_checkpoint, const std::string& what);

// Non-finite loss or gradient norm: skip the step and say so; too many in a row stop the run
// (the last checkpoint stays intact).
class NanGuard {
 public:
  explicit NanGuard(int max_in_a_row) : max_(max_in_a_row) {}
  // true: apply the step; false: skip it. Throws after max_in_a_row consecutive skips.
  // loss_scale > 1 (fp16 dynamic loss scaling): a finite loss with non-finite gradients is an
  // overflow of the scaled gradients, which halves the scale: reported, counted in the total,
  // not in the run that stops training.
  bool ok(int64_t step, double loss, double grad_norm, double loss_scale = -1);
  int64_t skipped() const { return total_; }
 private:
  int max_, run_ = 0;
  int64_t total_ = 0;
};

// fp16 (ctx.compute = F16): turns on the optimizer's dynamic loss scaling (train.loss_scale,
// train.loss_scale_window) and hands the scale to the fused losses (autograd's set_loss_scale).
// Returns the scale, f32 [1] on the device: the trainer seeds backward with it and logs it.
// Undefined (and no scaling) for every other compute dtype.
Tensor setup_loss_scaling(Optimizer& opt, const RunContext& ctx);

double now_ms();
// mkdir -p; throws when path is not a directory afterwards
void mkdirs(const std::string& path);
// A hash of every master weight's bytes (model_master_state, in name order) as a double (53
// bits): the ranks of a data-parallel run compare it before the first step (check_same).
double weights_fingerprint(Module& model, const Optimizer& opt, const std::map<std::string, Tensor>& held = {});
// master weights for saving: opt.master(name) for trained parameters, held[name] for those
// with a master of their own (save_checkpoint), the slot otherwise
std::map<std::string, Tensor> model_master_state(Module& model, const Optimizer& opt,
                                                 const std::map<std::string, Tensor>& held = {});
// parameters whose name starts with one of the comma-separated prefixes are frozen
void freeze_prefixes(Module& m, const std::string& prefixes);
// parameters the optimizer does not own (frozen, the EMA target) converted to the compute
// dtype, so a bf16 forward sees one dtype (call after building the optimizer)
void cast_frozen(Module& m, DType compute);
// Parameter groups with their own lr factor and weight decay: "embeddings" (embed_tokens,
// pos_embed, pred_pos, mask_token), "projector" (projector.*), "norms" (1-D: gains, biases),
// "matrices" (everything else); frozen parameters are left out.
std::vector<ParamGroup> param_groups_from(Module& m, const Config& cfg);
// The trained parameters laid out as the optimizer lays them out (one buffer of `dtype` per
// group of param_groups_from, in its order), without an optimizer: an evaluation of a
// checkpoint then runs the very products the run ran (a Llama layer's q|k|v and gate|up join
// into one GEMM where their weights lie side by side, autograd/ops_joined.cpp), so it reproduces
// the run's end-of-training numbers bit for bit.
void pack_like_optimizer(Module& m, const Config& cfg, DType dtype);
// the [model] ViT keys and the [train] optimizer keys
ViTConfig vit_config_from(const Config& cfg);
OptimConfig optim_config_from(const Config& cfg);
// one-line parameter count and memory summary
std::string describe_params(Module& m);

}  // namespace loom
