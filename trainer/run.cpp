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
#include <thread>
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
  } else if (dt == "fp16") {
    LOOM_CHECK(ctx.device == Device::CUDA, "%s: train.dtype = fp16 needs the CUDA device (CPU kernels run f32/f64)",
               cfg.source().c_str());
    ctx.compute = DType::F16;
  } else LOOM_CHECK(false, "%s: train.dtype '%s' (auto, f32, bf16, fp16)", cfg.source().c_str(), dt.c_str());
  // data.workers = 0: one loader thread on the CPU (its cores run the step); with a GPU, up to 4
  // (half the cores, shared by the ranks of the machine): one thread can take about as long to
  // build a 128-image batch at 224 px as the GPU takes for the step (bench_mim.cfg, H100)
  const int workers = cfg.get_int("data.workers");
  const int cores = std::max(1, int(std::thread::hardware_concurrency()));
  ctx.loader_threads = workers > 0 ? workers
                       : ctx.device == Device::CUDA ? std::min(4, std::max(1, cores / (2 * world)))
                                                    : 1;
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
  t0_ms_ = now_ms();
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
        std::string kind = j.value("kind", "");
        if (kind == "train" && j.contains("loss") && j["loss"].is_number()) train_.push_back({j["step"], j["loss"]});
        if (kind == "train" && j.contains("lr") && j["lr"].is_number()) lr_.push_back({j["step"], j["lr"]});
        if (kind == "eval" && j.contains("val_loss") && j["val_loss"].is_number())
          val_.push_back({j["step"], j["val_loss"]});
        for (const char* k : {"accuracy", "probe"})
          if (kind == "eval" && j.contains(k) && j[k].is_number()) acc_.push_back({j["step"], j[k]}), acc_name_ = k;
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

std::string fmt_duration(double sec) {
  char b[32];
  long long t = std::llround(std::max(0.0, sec));
  if (t < 60) std::snprintf(b, sizeof b, "%llds", t);
  else if (t < 3600) std::snprintf(b, sizeof b, "%lldm%02llds", t / 60, t % 60);
  else std::snprintf(b, sizeof b, "%lldh%02lldm", t / 3600, (t % 3600) / 60);
  return b;
}

void RunLog::step(const StepStats& s) {
  double now = now_ms(), elapsed = (now - t0_ms_) / 1e3, eta = -1;
  if (first_ms_ < 0) first_ms_ = now, first_step_ = s.step;
  else if (s.step > first_step_)
    eta = (now - first_ms_) / 1e3 / double(s.step - first_step_) * double(std::max<int64_t>(s.total - s.step, 0));
  std::string times = fmt_duration(elapsed) + (eta >= 0 ? ", ETA " + fmt_duration(eta) : std::string());
  json j = {{"kind", "train"}, {"step", s.step}, {"loss", std::isfinite(s.loss) ? json(s.loss) : json(nullptr)},
            {"lr", s.lr}, {"grad_norm", std::isfinite(s.grad_norm) ? json(s.grad_norm) : json(nullptr)},
            {"ms", s.ms}, {"data_ms", s.data_ms}, {s.items, s.items_per_s}, {"mem_mb", s.mem_mb},
            {"skipped", s.skipped}, {"elapsed_s", std::round(elapsed * 10) / 10}};
  if (eta >= 0) j["eta_s"] = std::round(eta * 10) / 10;
  if (s.reserved_mb >= 0) j["reserved_mb"] = s.reserved_mb;
  if (s.loss_scale > 0) j["loss_scale"] = s.loss_scale;
  if (s.mfu >= 0) j["mfu"] = s.mfu;
  if (s.energy_j >= 0) j["energy_j"] = std::round(s.energy_j * 1000) / 1000;
  write_line(j.dump());
  if (!s.skipped && std::isfinite(s.loss)) train_.push_back({s.step, s.loss});
  lr_.push_back({s.step, s.lr});
  char line[640];
  int n = std::snprintf(line, sizeof line, "step %5lld/%lld | loss %.4f | lr %.2e | norm %.3f | %.1f ms | %s %s | data %.1f ms",
                        (long long)s.step, (long long)s.total, s.loss, s.lr, s.grad_norm, s.ms,
                        fmt_rate(s.items_per_s).c_str(), s.items, s.data_ms);
  if (s.mfu >= 0) n += std::snprintf(line + n, sizeof line - size_t(n), " | MFU %.1f%%", 100 * s.mfu);
  if (s.reserved_mb >= 0)
    n += std::snprintf(line + n, sizeof line - size_t(n), " | peak %.0f MB, reserved %.0f MB", s.mem_mb, s.reserved_mb);
  else
    n += std::snprintf(line + n, sizeof line - size_t(n), " | mem %.0f MB", s.mem_mb);
  if (s.loss_scale > 0) n += std::snprintf(line + n, sizeof line - size_t(n), " | scale %g", s.loss_scale);
  std::snprintf(line + n, sizeof line - size_t(n), " | %s%s", times.c_str(), s.skipped ? " | SKIPPED" : "");
  bool due = s.step % log_every_ == 0 || s.step == s.total || s.step == 1 || s.skipped;
  if (tty_) {  // a progress bar that the periodic lines scroll past
    int width = 30, done = int(width * double(s.step) / double(std::max<int64_t>(s.total, 1)));
    if (due) std::printf("\r\033[K%s\n", line);
    std::printf("\r\033[K[%s%s] %lld/%lld loss %.4f | %s", std::string(size_t(done), '#').c_str(),
                std::string(size_t(width - done), '.').c_str(), (long long)s.step, (long long)s.total, s.loss,
                times.c_str());
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
  for (const char* k : {"accuracy", "probe"})
    if (kind == "eval" && values.count(k) && values.count("step") && std::isfinite(values.at(k)))
      acc_.push_back({int64_t(values.at("step")), values.at(k)}), acc_name_ = k;
  if (!text.empty()) std::printf("%s%s\n", tty_ ? "\r\033[K" : "", text.c_str());
}

// loss.svg (see loss_svg), written at the end of the run.
void RunLog::finish() {
  if (tty_) std::printf("\n");
  if (train_.empty() || ctx_.rank != 0) return;
  std::string svg = loss_svg(ctx_.cfg.get_str("train.trainer"), train_, val_, lr_, acc_, acc_name_);
  std::string p = ctx_.out_dir + "/loss.svg";
  write_file_atomic(p, {{svg.data(), svg.size()}});
  std::printf("wrote %s and metrics.jsonl (%s)\n", p.c_str(), fmt_duration((now_ms() - t0_ms_) / 1e3).c_str());
}

namespace {

// Round tick steps (1, 2, 5 x 10^k) for a linear axis over [0, hi].
std::vector<double> linear_ticks(double hi, int want) {
  double raw = hi / std::max(1, want), mag = std::pow(10.0, std::floor(std::log10(std::max(raw, 1e-300))));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  std::vector<double> t;
  for (double v = 0; v <= hi * (1 + 1e-9); v += step) t.push_back(v);
  return t;
}

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}

}  // namespace

// Two panels over the same step axis. Top: the loss on a log scale (ticks at 1, 2, 5 x 10^k),
// the raw training loss, its moving average (0.9) and the validation loss (line and points).
// Bottom: the learning rate (left axis, linear from 0) and the eval accuracy or probe (right
// axis, 0-100%, squares).
std::string loss_svg(const std::string& title, const std::vector<std::pair<int64_t, double>>& train,
                     const std::vector<std::pair<int64_t, double>>& val, const std::vector<std::pair<int64_t, double>>& lr,
                     const std::vector<std::pair<int64_t, double>>& acc, const std::string& acc_name) {
  const double W = 760, L = 70, R = 60, T1 = 34, H1 = 300, T2 = T1 + H1 + 40, H2 = 120, H = T2 + H2 + 45;
  double xmax = 1, lo = 1e300, hi = 0, lrmax = 0;
  for (auto* c : {&train, &val})
    for (auto& p : *c)
      if (p.second > 0) xmax = std::max(xmax, double(p.first)), lo = std::min(lo, p.second), hi = std::max(hi, p.second);
  for (auto& p : lr) lrmax = std::max(lrmax, p.second), xmax = std::max(xmax, double(p.first));
  if (!(hi > 0)) lo = 0.1, hi = 1;
  double llo = std::floor(std::log10(lo) * 4) / 4, lhi = std::ceil(std::log10(hi) * 4) / 4;
  if (lhi - llo < 0.25) lhi = llo + 0.25;
  auto X = [&](double x) { return L + (W - L - R) * x / xmax; };
  auto Y1 = [&](double y) { return T1 + H1 * (1 - (std::log10(std::max(y, 1e-300)) - llo) / (lhi - llo)); };
  auto Y2 = [&](double f) { return T2 + H2 * (1 - f); };  // f in [0, 1]
  std::ostringstream s;
  s << "<svg xmlns='http://www.w3.org/2000/svg' width='" << W << "' height='" << H
    << "' font-family='sans-serif' font-size='12'>\n<rect width='100%' height='100%' fill='white'/>\n";
  s << "<text x='" << L << "' y='20' font-size='14'>" << title << ": loss (log scale)</text>\n";
  // loss ticks: 1, 2, 5 x 10^k inside the range
  for (int e = int(std::floor(llo)) - 1; e <= int(std::ceil(lhi)); e++)
    for (double m : {1.0, 2.0, 5.0}) {
      double v = m * std::pow(10.0, e), lv = std::log10(v);
      if (lv < llo - 1e-9 || lv > lhi + 1e-9) continue;
      s << "<line x1='" << L << "' x2='" << W - R << "' y1='" << Y1(v) << "' y2='" << Y1(v) << "' stroke='"
        << (m == 1 ? "#bbb" : "#e6e6e6") << "'/><text x='" << L - 6 << "' y='" << Y1(v) + 4
        << "' text-anchor='end'>" << num(v) << "</text>\n";
    }
  // step ticks on both panels
  for (double x : linear_ticks(xmax, 8)) {
    s << "<line x1='" << X(x) << "' x2='" << X(x) << "' y1='" << T1 << "' y2='" << T1 + H1 << "' stroke='#f0f0f0'/>";
    s << "<line x1='" << X(x) << "' x2='" << X(x) << "' y1='" << T2 << "' y2='" << T2 + H2 << "' stroke='#f0f0f0'/>";
    s << "<text x='" << X(x) << "' y='" << T2 + H2 + 16 << "' text-anchor='middle'>" << num(x) << "</text>\n";
  }
  s << "<text x='" << (L + W - R) / 2 << "' y='" << H - 8 << "' text-anchor='middle'>step</text>\n";
  s << "<rect x='" << L << "' y='" << T1 << "' width='" << W - L - R << "' height='" << H1
    << "' fill='none' stroke='#888'/>\n";
  auto line = [&](const std::vector<std::pair<int64_t, double>>& c, const char* colour, double width, auto Yf) {
    s << "<polyline fill='none' stroke='" << colour << "' stroke-width='" << width << "' points='";
    for (auto& p : c) s << X(double(p.first)) << "," << Yf(p.second) << " ";
    s << "'/>\n";
  };
  line(train, "#9cf", 1, Y1);
  std::vector<std::pair<int64_t, double>> avg;
  double ema = train.empty() ? 0 : train[0].second;
  for (auto& p : train) ema = 0.9 * ema + 0.1 * p.second, avg.push_back({p.first, ema});
  line(avg, "#05a", 2, Y1);
  if (val.size() > 1) line(val, "#e50", 1.5, Y1);
  for (auto& p : val) s << "<circle cx='" << X(double(p.first)) << "' cy='" << Y1(p.second) << "' r='4' fill='#e50'/>\n";
  s << "<text x='" << W - R - 300 << "' y='20' fill='#05a'>train (moving avg)</text><text x='" << W - R - 170
    << "' y='20' fill='#9cf'>train</text><text x='" << W - R - 110 << "' y='20' fill='#e50'>validation</text>\n";
  // bottom panel: learning rate (left) and accuracy / probe (right)
  s << "<rect x='" << L << "' y='" << T2 << "' width='" << W - L - R << "' height='" << H2
    << "' fill='none' stroke='#888'/>\n";
  if (lrmax > 0) {
    for (double v : linear_ticks(lrmax, 3))
      s << "<text x='" << L - 6 << "' y='" << Y2(v / lrmax) + 4 << "' text-anchor='end' fill='#393'>" << num(v)
        << "</text>\n";
    line(lr, "#393", 1.5, [&](double v) { return Y2(v / lrmax); });
  }
  s << "<text x='" << L << "' y='" << T2 - 8 << "' fill='#393'>learning rate</text>\n";
  if (!acc.empty()) {
    for (int pc = 0; pc <= 100; pc += 25)
      s << "<text x='" << W - R + 6 << "' y='" << Y2(pc / 100.0) + 4 << "' fill='#a0a'>" << pc << "%</text>\n";
    for (auto& p : acc)
      s << "<rect x='" << X(double(p.first)) - 4 << "' y='" << Y2(p.second) - 4
        << "' width='8' height='8' fill='#a0a'/><text x='" << X(double(p.first)) - 6 << "' y='" << Y2(p.second) - 8
        << "' text-anchor='end' fill='#a0a'>" << num(std::round(p.second * 1000) / 10) << "%</text>\n";
    s << "<text x='" << W - R << "' y='" << T2 - 8 << "' text-anchor='end' fill='#a0a'>eval " << acc_name << "</text>\n";
  }
  s << "</svg>\n";
  return s.str();
}

// ------------------------------------------------------------------ guards and helpers
Tensor setup_loss_scaling(Optimizer& opt, const RunContext& ctx) {
  if (ctx.compute != DType::F16) {
    set_loss_scale(Tensor());
    return Tensor();
  }
  opt.enable_loss_scaling(ctx.cfg.get_float("train.loss_scale"), ctx.cfg.get_int("train.loss_scale_window"));
  Tensor s = opt.loss_scale_value();
  set_loss_scale(s);
  return s;
}

bool NanGuard::ok(int64_t step, double loss, double grad_norm, double loss_scale) {
  if (std::isfinite(loss) && std::isfinite(grad_norm)) {
    run_ = 0;
    return true;
  }
  if (std::isfinite(loss) && loss_scale > 1) {
    total_++;
    std::printf("step %lld: gradients overflow at loss scale %g: step skipped, scale halved\n", (long long)step,
                loss_scale);
    return false;
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
