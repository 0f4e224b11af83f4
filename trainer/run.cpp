// run.cpp: run folder, logs, checkpoints, NaN guard (see run.h).
#include "trainer/run.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tensor/fileio.h"

namespace loom {

using json = nlohmann::json;

double now_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

static void mkdirs(const std::string& path) {
  std::string cur;
  std::stringstream ss(path);
  std::string part;
  if (!path.empty() && path[0] == '/') cur = "/";
  while (std::getline(ss, part, '/')) {
    if (part.empty()) continue;
    cur += part + "/";
    mkdir(cur.c_str(), 0755);
  }
  struct stat s;
  LOOM_CHECK(stat(path.c_str(), &s) == 0 && S_ISDIR(s.st_mode), "cannot create directory %s", path.c_str());
}

RunContext open_run(const Config& cfg) {
  RunContext ctx;
  ctx.cfg = cfg;
  ctx.out_dir = cfg.get_str("train.out_dir");
  ctx.seed = uint64_t(cfg.get_int64("train.seed"));
  std::string dev = cfg.get_str("train.device"), dt = cfg.get_str("train.dtype");
  bool gpu = cuda::available();
  if (dev == "cuda") LOOM_CHECK(gpu, "%s: train.device = cuda, but no usable GPU (or a CPU-only build)", cfg.source().c_str());
  ctx.device = (dev == "cuda" || (dev == "auto" && gpu)) ? Device::CUDA : Device::CPU;
  if (dt == "auto") ctx.compute = ctx.device == Device::CUDA ? DType::BF16 : DType::F32;
  else if (dt == "f32") ctx.compute = DType::F32;
  else if (dt == "bf16") {
    LOOM_CHECK(ctx.device == Device::CUDA, "%s: train.dtype = bf16 needs the CUDA device (CPU kernels run f32/f64)",
               cfg.source().c_str());
    ctx.compute = DType::BF16;
  } else LOOM_CHECK(false, "%s: train.dtype '%s' (auto, f32, bf16)", cfg.source().c_str(), dt.c_str());
  mkdirs(ctx.out_dir);
  std::printf("# resolved config (%s)\n%s", cfg.source().c_str(), cfg.dump().c_str());
  std::printf("# device %s, compute %s, run folder %s\n", device_name(ctx.device), dtype_name(ctx.compute),
              ctx.out_dir.c_str());
  cfg.save(ctx.out_dir + "/config.cfg");
  return ctx;
}

// ------------------------------------------------------------------ logging
// The metrics.jsonl size recorded by the checkpoint a resume starts from (-1: unknown, or
// the checkpoint belongs to another run folder).
static int64_t resumed_metrics_bytes(const RunContext& ctx) {
  std::string ck = find_checkpoint(ctx, ctx.cfg.get_str("train.resume"));
  if (ck.empty() || parent_dir(ck) != ctx.out_dir) return -1;
  try {
    std::ifstream f(ck + "/trainer.json");
    json j = json::parse(f);
    if (j.contains("metrics_bytes") && j["metrics_bytes"].is_number_unsigned()) return j["metrics_bytes"].get<int64_t>();
  } catch (const std::exception&) {
  }
  return -1;
}

RunLog::RunLog(const RunContext& ctx, bool append) : ctx_(ctx), tty_(isatty(fileno(stdout))) {
  log_every_ = std::max(1, ctx.cfg.get_int("train.log_every"));
  std::string p = ctx.out_dir + "/metrics.jsonl";
  if (append) {
    // Lines written after the checkpoint (the steps about to be redone, and a line cut by a
    // kill) are dropped, so the resumed file reads as if the run had never stopped.
    int64_t keep = resumed_metrics_bytes(ctx);
    struct stat s;
    if (keep >= 0 && stat(p.c_str(), &s) == 0 && s.st_size > keep)
      LOOM_CHECK(truncate(p.c_str(), keep) == 0, "%s: cannot truncate to the checkpoint's %lld bytes: %s", p.c_str(),
                 (long long)keep, std::strerror(errno));
  }
  metrics_ = std::fopen(p.c_str(), append ? "a" : "w");
  LOOM_CHECK(metrics_, "cannot open %s for writing: %s", p.c_str(), std::strerror(errno));
  if (append) {  // keep the curve of the run being resumed
    std::ifstream f(p);
    std::string line;
    while (std::getline(f, line)) {
      try {
        json j = json::parse(line);
        if (j.value("kind", "") == "train" && j.contains("loss") && j["loss"].is_number())
          train_.push_back({j["step"], j["loss"]});
        if (j.value("kind", "") == "eval" && j.contains("val_loss")) val_.push_back({j["step"], j["val_loss"]});
      } catch (...) {
      }
    }
  }
}

// One line to metrics.jsonl, flushed; a failed write (disk full) stops the run.
void RunLog::write_line(const std::string& line) {
  std::string p = ctx_.out_dir + "/metrics.jsonl";
  bool ok = std::fprintf(metrics_, "%s\n", line.c_str()) >= 0;
  ok = std::fflush(metrics_) == 0 && ok;
  LOOM_CHECK(ok && !std::ferror(metrics_), "%s: write failed: %s (the last checkpoint is intact)", p.c_str(),
             std::strerror(errno));
}

RunLog::~RunLog() {
  if (metrics_) std::fclose(metrics_);
}

static std::string fmt_rate(double v) {
  char b[32];
  if (v >= 1e6) std::snprintf(b, sizeof b, "%.2fM", v / 1e6);
  else if (v >= 1e3) std::snprintf(b, sizeof b, "%.1fk", v / 1e3);
  else std::snprintf(b, sizeof b, "%.1f", v);
  return b;
}

void RunLog::step(const StepStats& s) {
  json j = {{"kind", "train"}, {"step", s.step}, {"loss", std::isfinite(s.loss) ? json(s.loss) : json(nullptr)},
            {"lr", s.lr}, {"grad_norm", std::isfinite(s.grad_norm) ? json(s.grad_norm) : json(nullptr)},
            {"ms", s.ms}, {"data_ms", s.data_ms}, {s.items, s.items_per_s}, {"mem_mb", s.mem_mb},
            {"skipped", s.skipped}};
  if (s.mfu >= 0) j["mfu"] = s.mfu;
  write_line(j.dump());
  if (!s.skipped && std::isfinite(s.loss)) train_.push_back({s.step, s.loss});
  char line[512];
  int n = std::snprintf(line, sizeof line, "step %5lld/%lld | loss %.4f | lr %.2e | norm %.3f | %.1f ms | %s %s | data %.1f ms",
                        (long long)s.step, (long long)s.total, s.loss, s.lr, s.grad_norm, s.ms,
                        fmt_rate(s.items_per_s).c_str(), s.items, s.data_ms);
  if (s.mfu >= 0) n += std::snprintf(line + n, sizeof line - size_t(n), " | MFU %.1f%%", 100 * s.mfu);
  std::snprintf(line + n, sizeof line - size_t(n), " | mem %.0f MB%s", s.mem_mb, s.skipped ? " | SKIPPED" : "");
  bool due = s.step % log_every_ == 0 || s.step == s.total || s.step == 1 || s.skipped;
  if (tty_) {  // a progress bar that the periodic lines scroll past
    int width = 30, done = int(width * double(s.step) / double(std::max<int64_t>(s.total, 1)));
    if (due) std::printf("\r\033[K%s\n", line);
    std::printf("\r\033[K[%s%s] %lld/%lld loss %.4f", std::string(size_t(done), '#').c_str(),
                std::string(size_t(width - done), '.').c_str(), (long long)s.step, (long long)s.total, s.loss);
    std::fflush(stdout);
  } else if (due) {
    std::printf("%s\n", line);
    std::fflush(stdout);
  }
}

void RunLog::event(const std::string& kind, const std::map<std::string, double>& values, const std::string& text) {
  json j = {{"kind", kind}};
  for (auto& [k, v] : values) j[k] = std::isfinite(v) ? json(v) : json(nullptr);
  write_line(j.dump());
  if (kind == "eval" && values.count("val_loss") && values.count("step"))
    val_.push_back({int64_t(values.at("step")), values.at("val_loss")});
  if (!text.empty()) std::printf("%s%s\n", tty_ ? "\r\033[K" : "", text.c_str());
}

// loss.svg: training loss (and its moving average) and validation loss against the step.
void RunLog::finish() {
  if (tty_) std::printf("\n");
  if (train_.empty()) return;
  const double W = 720, H = 420, L = 60, R = 20, T = 30, B = 45;
  double xmax = 1, ymin = 1e300, ymax = -1e300;
  for (auto& p : train_) xmax = std::max(xmax, double(p.first)), ymin = std::min(ymin, p.second), ymax = std::max(ymax, p.second);
  for (auto& p : val_) xmax = std::max(xmax, double(p.first)), ymin = std::min(ymin, p.second), ymax = std::max(ymax, p.second);
  if (ymax <= ymin) ymax = ymin + 1;
  auto X = [&](double x) { return L + (W - L - R) * x / xmax; };
  auto Y = [&](double y) { return T + (H - T - B) * (1 - (y - ymin) / (ymax - ymin)); };
  std::ostringstream s;
  s << "<svg xmlns='http://www.w3.org/2000/svg' width='" << W << "' height='" << H << "' font-family='sans-serif' font-size='12'>\n";
  s << "<rect width='100%' height='100%' fill='white'/>\n";
  s << "<text x='" << L << "' y='18'>loss (" << ctx_.cfg.get_str("train.trainer") << ")</text>\n";
  for (int i = 0; i <= 4; i++) {
    double y = ymin + (ymax - ymin) * i / 4;
    s << "<line x1='" << L << "' x2='" << W - R << "' y1='" << Y(y) << "' y2='" << Y(y) << "' stroke='#ddd'/>";
    s << "<text x='5' y='" << Y(y) + 4 << "'>" << std::to_string(y).substr(0, 6) << "</text>\n";
  }
  s << "<text x='" << W / 2 << "' y='" << H - 10 << "'>step (max " << int64_t(xmax) << ")</text>\n";
  s << "<polyline fill='none' stroke='#9cf' stroke-width='1' points='";
  for (auto& p : train_) s << X(double(p.first)) << "," << Y(p.second) << " ";
  s << "'/>\n<polyline fill='none' stroke='#05a' stroke-width='2' points='";
  double ema = train_[0].second;
  for (auto& p : train_) {
    ema = 0.9 * ema + 0.1 * p.second;
    s << X(double(p.first)) << "," << Y(ema) << " ";
  }
  s << "'/>\n";
  for (auto& p : val_) s << "<circle cx='" << X(double(p.first)) << "' cy='" << Y(p.second) << "' r='4' fill='#e50'/>\n";
  s << "<text x='" << W - 230 << "' y='18' fill='#05a'>train (moving avg)</text><text x='" << W - 90
    << "' y='18' fill='#e50'>validation</text>\n</svg>\n";
  std::ofstream f(ctx_.out_dir + "/loss.svg");
  f << s.str();
  std::printf("wrote %s/loss.svg and metrics.jsonl\n", ctx_.out_dir.c_str());
}

// ------------------------------------------------------------------ checkpoints
std::map<std::string, Tensor> model_master_state(Module& model, const Optimizer& opt) {
  std::map<std::string, Tensor> sd;
  for (auto& [name, slot] : model.named_parameters()) {
    Tensor m;
    try {
      m = opt.master(name);
    } catch (const std::exception&) {
    }
    sd[name] = m.defined() ? m : *slot;
  }
  return sd;
}

static std::vector<std::string> checkpoint_dirs(const std::string& out_dir) {
  std::vector<std::string> v;
  DIR* d = opendir(out_dir.c_str());
  if (!d) return v;
  while (dirent* e = readdir(d)) {
    std::string n = e->d_name;
    if (n.rfind("step_", 0) == 0 && n.find('.') == std::string::npos) {  // not .tmp / .old
      struct stat s;
      if (stat((out_dir + "/" + n + "/trainer.json").c_str(), &s) == 0) v.push_back(n);
    }
  }
  closedir(d);
  std::sort(v.begin(), v.end());
  return v;
}

static void remove_files_and_dir(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (!d) return;
  while (dirent* e = readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") std::remove((dir + "/" + n).c_str());
  }
  closedir(d);
  rmdir(dir.c_str());
}

// A checkpoint is first renamed to NAME.old (atomic: it stops being a checkpoint at once),
// then emptied, so a kill during the removal never leaves a half-deleted one that looks
// complete.
static void remove_checkpoint_dir(const std::string& dir) {
  struct stat s;
  if (stat(dir.c_str(), &s) != 0) return;
  std::string old = dir + ".old";
  remove_files_and_dir(old);
  if (std::rename(dir.c_str(), old.c_str()) == 0) remove_files_and_dir(old);
  else remove_files_and_dir(dir);
}

// Leftovers of a run killed while saving or deleting: step_*.tmp and step_*.old folders.
static void remove_stale_dirs(const std::string& out_dir) {
  std::vector<std::string> stale;
  if (DIR* d = opendir(out_dir.c_str())) {
    while (dirent* e = readdir(d)) {
      std::string n = e->d_name;
      auto ends = [&](const char* x) { return n.size() > 4 && n.compare(n.size() - 4, 4, x) == 0; };
      if (n.rfind("step_", 0) == 0 && (ends(".tmp") || ends(".old"))) stale.push_back(out_dir + "/" + n);
    }
    closedir(d);
  }
  for (auto& p : stale) remove_files_and_dir(p);
}

// Checkpoint write order: files into step_N.tmp/ (each written to a temporary name, fsync'ed
// and renamed), then the folder renamed to step_N and out_dir fsync'ed; only a folder named
// step_N holding trainer.json counts as a checkpoint (checkpoint_dirs), so a kill at any
// moment leaves the previous checkpoint as the latest. trainer.json records how many bytes
// of metrics.jsonl belong to the steps before it (the resume truncates to that).
void save_checkpoint(const RunContext& ctx, Module& model, const Optimizer& opt, const TrainerState& st) {
  char name[64];
  std::snprintf(name, sizeof name, "step_%08lld", (long long)st.step);
  std::string final_dir = ctx.out_dir + "/" + name, tmp = final_dir + ".tmp";
  remove_stale_dirs(ctx.out_dir);
  mkdirs(tmp);
  save_safetensors(tmp + "/model.safetensors", model_master_state(model, opt));
  save_safetensors(tmp + "/optimizer.safetensors", opt.state_dict());
  std::string metrics = ctx.out_dir + "/metrics.jsonl";
  struct stat ms;
  int64_t metrics_bytes = -1;
  if (stat(metrics.c_str(), &ms) == 0) {
    fsync_path(metrics);
    metrics_bytes = int64_t(ms.st_size);
  }
  json j = {{"step", st.step}, {"config", ctx.cfg.dump()}, {"extra", st.extra}};
  if (metrics_bytes >= 0) j["metrics_bytes"] = metrics_bytes;
  std::string text = j.dump(1) + "\n";
  write_file_atomic(tmp + "/trainer.json", {{text.data(), text.size()}});
  remove_checkpoint_dir(final_dir);
  LOOM_CHECK(std::rename(tmp.c_str(), final_dir.c_str()) == 0, "cannot rename %s to %s: %s", tmp.c_str(),
             final_dir.c_str(), std::strerror(errno));
  fsync_dir(ctx.out_dir);
  int keep = std::max(1, ctx.cfg.get_int("train.keep_last"));
  auto dirs = checkpoint_dirs(ctx.out_dir);
  for (size_t i = 0; i + size_t(keep) < dirs.size(); i++) remove_checkpoint_dir(ctx.out_dir + "/" + dirs[i]);
}

std::string find_checkpoint(const RunContext& ctx, const std::string& resume) {
  if (resume.empty()) return "";
  if (resume != "latest") {
    struct stat s;
    LOOM_CHECK(stat((resume + "/trainer.json").c_str(), &s) == 0, "train.resume: %s is not a checkpoint folder (no trainer.json)",
               resume.c_str());
    return resume;
  }
  auto dirs = checkpoint_dirs(ctx.out_dir);
  return dirs.empty() ? "" : ctx.out_dir + "/" + dirs.back();
}

static json read_trainer_json(const std::string& dir) {
  std::ifstream f(dir + "/trainer.json");
  LOOM_CHECK(f.good(), "%s/trainer.json: cannot open", dir.c_str());
  try {
    return json::parse(f);
  } catch (const std::exception& e) {
    LOOM_CHECK(false, "%s/trainer.json: %s", dir.c_str(), e.what());
  }
}

TrainerState load_checkpoint(const std::string& dir, Module& model, Optimizer& opt) {
  json j = read_trainer_json(dir);
  TrainerState st;
  st.step = j.at("step");
  if (j.contains("extra")) st.extra = j["extra"].get<std::map<std::string, double>>();
  opt.load_state_dict(load_safetensors(dir + "/optimizer.safetensors").tensors, dir + "/optimizer.safetensors");
  // parameters the optimizer does not own (frozen, EMA target) come from the model file
  auto sd = load_safetensors(dir + "/model.safetensors").tensors;
  for (auto& [name, slot] : model.named_parameters()) {
    auto it = sd.find(name);
    LOOM_CHECK(it != sd.end(), "%s/model.safetensors: missing '%s'", dir.c_str(), name.c_str());
    bool owned = true;
    try {
      opt.master(name);
    } catch (const std::exception&) {
      owned = false;
    }
    if (!owned) slot->copy_(it->second);
  }
  return st;
}

std::map<std::string, Tensor> load_checkpoint_model(const std::string& dir) {
  return load_safetensors(dir + "/model.safetensors").tensors;
}

std::string checkpoint_config_text(const std::string& dir) { return read_trainer_json(dir).at("config"); }

// ------------------------------------------------------------------ guards and helpers
bool NanGuard::ok(int64_t step, double loss, double grad_norm) {
  if (std::isfinite(loss) && std::isfinite(grad_norm)) {
    run_ = 0;
    return true;
  }
  run_++;
  total_++;
  std::printf("step %lld: non-finite %s (loss %g, grad norm %g): step skipped (%d in a row)\n", (long long)step,
              std::isfinite(loss) ? "gradient" : "loss", loss, grad_norm, run_);
  LOOM_CHECK(run_ < max_, "%d non-finite steps in a row (last at step %lld): stopping; the last checkpoint is intact. "
             "Lower train.lr or check the data.", run_, (long long)step);
  return false;
}

void freeze_prefixes(Module& m, const std::string& prefixes) {
  if (prefixes.empty()) return;
  std::vector<std::string> ps;
  std::stringstream ss(prefixes);
  std::string p;
  while (std::getline(ss, p, ','))
    if (!p.empty()) ps.push_back(p);
  for (auto& [name, t] : m.named_parameters())
    for (auto& pre : ps)
      if (name.rfind(pre, 0) == 0) t->requires_grad_(false);
}

std::vector<ParamGroup> param_groups_from(Module& m, const Config& cfg) {
  double wd = cfg.get_float("train.weight_decay"), ewd = cfg.get_float("train.embeddings_weight_decay");
  if (ewd < 0) ewd = wd;
  double s_emb = cfg.get_float("train.lr_scale_embeddings"), s_proj = cfg.get_float("train.lr_scale_projector"),
         s_norm = cfg.get_float("train.lr_scale_norms");
  auto has = [](const std::string& n, const char* part) { return n.find(part) != std::string::npos; };
  // With every factor at its default the four groups collapse to two (decay: all matrices,
  // embeddings and the projector; no decay: 1-D), in parameter order, so runs made before the
  // groups existed reproduce bit for bit.
  bool split = s_emb != 1.0 || s_proj != 1.0 || s_norm != 1.0 || ewd != wd;
  std::vector<ParamGroup> g;
  if (split) {
    g = {{"matrices", 1.0, wd, {}}, {"embeddings", s_emb, ewd, {}}, {"projector", s_proj, wd, {}}, {"norms", s_norm, 0.0, {}}};
  } else {
    g = {{"decay", 1.0, wd, {}}, {"no_decay", 1.0, 0.0, {}}};
  }
  for (auto& [name, t] : m.named_parameters()) {
    if (!t->requires_grad()) continue;
    size_t i;
    if (!split) i = t->dim() >= 2 ? 0 : 1;
    else if (has(name, "embed_tokens") || has(name, "pos_embed") || has(name, "pred_pos") || has(name, "mask_token")) i = 1;
    else if (name.rfind("projector.", 0) == 0) i = 2;
    else if (t->dim() < 2) i = 3;
    else i = 0;
    g[i].params.push_back({name, t});
  }
  return g;
}

ViTConfig vit_config_from(const Config& cfg) {
  ViTConfig c;
  c.image_size = cfg.get_int("model.image_size");
  c.patch_size = cfg.get_int("model.patch_size");
  c.channels = cfg.get_int("model.channels");
  c.dim = cfg.get_int("model.vit_dim");
  c.depth = cfg.get_int("model.vit_depth");
  c.heads = cfg.get_int("model.vit_heads");
  c.mlp_ratio = cfg.get_int("model.vit_mlp_ratio");
  return c;
}

OptimConfig optim_config_from(const Config& cfg) {
  OptimConfig oc;
  oc.kind = cfg.get_str("train.optimizer");
  oc.beta1 = cfg.get_float("train.beta1");
  oc.beta2 = cfg.get_float("train.beta2");
  oc.eps = cfg.get_float("train.eps");
  oc.momentum = cfg.get_float("train.momentum");
  return oc;
}

void cast_frozen(Module& m, DType compute) {
  for (auto& [name, t] : m.named_parameters())
    if (!t->requires_grad() && t->dtype() != compute) *t = t->to(compute);
}

std::string describe_params(Module& m) {
  int64_t total = 0, trained = 0;
  for (auto& [n, t] : m.named_parameters()) {
    total += t->numel();
    if (t->requires_grad()) trained += t->numel();
  }
  char b[160];
  std::snprintf(b, sizeof b, "parameters: %.3fM total, %.3fM trained", double(total) / 1e6, double(trained) / 1e6);
  return b;
}

}  // namespace loom
