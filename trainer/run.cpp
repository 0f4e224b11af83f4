// run.cpp: the run folder, the run log (metrics.jsonl, the step line, the loss plot) and the
// NaN guard (see run.h). Checkpoints: checkpoint.cpp; config -> structs, parameter groups and
// freezing: params.cpp.
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

void mkdirs(const std::string& path) {
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

RunContext make_context(const Config& cfg, int rank, int world) {
  RunContext ctx;
  ctx.rank = rank;
  ctx.world = world;
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
  const std::string attn = cfg.get_str("train.attention");
  cuda::set_attention_backend(attn == "cudnn" ? cuda::AttentionBackend::Cudnn
                              : attn == "loom" ? cuda::AttentionBackend::Loom
                                               : cuda::AttentionBackend::Auto);
  return ctx;
}

RunContext open_run(const Config& cfg, int rank, int world) {
  RunContext ctx = make_context(cfg, rank, world);
  mkdirs(ctx.out_dir);
  if (rank != 0) return ctx;  // data parallel: rank 0 prints and saves the config
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
  std::string p = ctx.rank == 0 ? ctx.out_dir + "/metrics.jsonl" : std::string("/dev/null");
  if (append && ctx.rank == 0) {
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
  if (s.reserved_mb >= 0) j["reserved_mb"] = s.reserved_mb;
  if (s.mfu >= 0) j["mfu"] = s.mfu;
  write_line(j.dump());
  if (!s.skipped && std::isfinite(s.loss)) train_.push_back({s.step, s.loss});
  char line[512];
  int n = std::snprintf(line, sizeof line, "step %5lld/%lld | loss %.4f | lr %.2e | norm %.3f | %.1f ms | %s %s | data %.1f ms",
                        (long long)s.step, (long long)s.total, s.loss, s.lr, s.grad_norm, s.ms,
                        fmt_rate(s.items_per_s).c_str(), s.items, s.data_ms);
  if (s.mfu >= 0) n += std::snprintf(line + n, sizeof line - size_t(n), " | MFU %.1f%%", 100 * s.mfu);
  if (s.reserved_mb >= 0)
    n += std::snprintf(line + n, sizeof line - size_t(n), " | peak %.0f MB, reserved %.0f MB", s.mem_mb, s.reserved_mb);
  else
    n += std::snprintf(line + n, sizeof line - size_t(n), " | mem %.0f MB", s.mem_mb);
  std::snprintf(line + n, sizeof line - size_t(n), "%s", s.skipped ? " | SKIPPED" : "");
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
  if (train_.empty() || ctx_.rank != 0) return;
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

}  // namespace loom
