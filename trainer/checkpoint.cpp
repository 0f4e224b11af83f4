// checkpoint.cpp: checkpoints of a run (see run.h): out_dir/step_00001234/{model.safetensors,
// optimizer.safetensors, trainer.json}, written under a temporary name and renamed when
// complete (fsync'ed files and folder, so a kill or power cut at any moment leaves the
// previous checkpoint as the latest), the oldest beyond train.keep_last removed; found again by --train.resume.
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tensor/fileio.h"
#include "tensor/safetensors.h"
#include "trainer/distributed.h"
#include "trainer/run.h"

namespace loom {

using json = nlohmann::json;

std::map<std::string, Tensor> model_master_state(Module& model, const Optimizer& opt,
                                                 const std::map<std::string, Tensor>& held) {
  std::map<std::string, Tensor> sd;
  for (auto& [name, slot] : model.named_parameters()) {
    Tensor m;
    try {
      m = opt.master(name);
    } catch (const std::exception&) {
      auto h = held.find(name);
      if (h != held.end()) m = h->second;
    }
    sd[name] = m.defined() ? m : *slot;
  }
  return sd;
}

double weights_fingerprint(Module& model, const Optimizer& opt, const std::map<std::string, Tensor>& held) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the names and bytes
  auto add = [&h](const uint8_t* p, size_t n) {
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
  };
  for (auto& [name, t] : model_master_state(model, opt, held)) {
    const Tensor c = t.to(Device::CPU).contiguous();
    add(reinterpret_cast<const uint8_t*>(name.data()), name.size());
    add(static_cast<const uint8_t*>(c.raw()), size_t(c.numel()) * dtype_size(c.dtype()));
  }
  return double(h >> 11);  // exact in a double
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
void save_checkpoint(const RunContext& ctx, Module& model, const Optimizer& opt, const TrainerState& st,
                     const std::map<std::string, Tensor>& held) {
  // ZeRO-1: the moments are gathered from every rank (a collective every rank joins)
  const std::map<std::string, Tensor> opt_state = opt.state_dict();
  if (ctx.rank != 0) return;  // data parallel: every rank holds the same weights; rank 0 writes them
  char name[64];
  std::snprintf(name, sizeof name, "step_%08lld", (long long)st.step);
  std::string final_dir = ctx.out_dir + "/" + name, tmp = final_dir + ".tmp";
  remove_stale_dirs(ctx.out_dir);
  mkdirs(tmp);
  save_safetensors(tmp + "/model.safetensors", model_master_state(model, opt, held));
  save_safetensors(tmp + "/optimizer.safetensors", opt_state);
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

TrainerState read_checkpoint_state(const std::string& dir) {
  json j = read_trainer_json(dir);
  TrainerState st;
  // "step" a JSON integer >= 0 (a float would convert with undefined behaviour past int64's range)
  LOOM_CHECK(j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
                 (j["step"].is_number_unsigned() ? j["step"].get<uint64_t>() <= uint64_t(INT64_MAX)
                                                 : j["step"].get<int64_t>() >= 0),
             "%s/trainer.json: \"step\" = %s, expected a step count (an integer >= 0)", dir.c_str(),
             j.is_object() && j.contains("step") ? j["step"].dump().c_str() : "(missing)");
  try {
    st.step = j["step"].get<int64_t>();
    if (j.contains("extra")) st.extra = j["extra"].get<std::map<std::string, double>>();
  } catch (const std::exception& e) {
    LOOM_CHECK(false, "%s/trainer.json: %s", dir.c_str(), e.what());
  }
  return st;
}

std::string resolve_checkpoint(const std::string& given, const std::string& what) {
  std::string path = given;
  while (path.size() > 1 && path.back() == '/') path.pop_back();  // "run/" names the run folder
  struct stat s;
  LOOM_CHECK(!path.empty() && stat(path.c_str(), &s) == 0 && S_ISDIR(s.st_mode), "%s: %s: no such folder", what.c_str(),
             path.c_str());
  if (stat((path + "/trainer.json").c_str(), &s) == 0) return path;
  auto dirs = checkpoint_dirs(path);
  LOOM_CHECK(!dirs.empty(), "%s: %s is neither a checkpoint folder (step_NNNNNNNN/ with trainer.json) nor a run folder "
             "holding one", what.c_str(), path.c_str());
  return path + "/" + dirs.back();
}

TrainerState load_checkpoint(const std::string& dir, Module& model, Optimizer& opt,
                             const std::map<std::string, Tensor>& held) {
  TrainerState st = read_checkpoint_state(dir);
  opt.load_state_dict(load_safetensors(dir + "/optimizer.safetensors").tensors, dir + "/optimizer.safetensors");
  // parameters the optimizer does not own (frozen, EMA target) come from the model file, and
  // a master held beside a 16-bit slot (the EMA target's) takes the exact value
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
    if (owned) continue;
    slot->copy_(it->second);
    auto h = held.find(name);
    if (h != held.end()) {
      Tensor master = h->second;  // a handle: the copy lands in the holder's tensor
      LOOM_CHECK(master.shape() == it->second.shape(), "%s/model.safetensors: '%s' is %s, its master %s", dir.c_str(),
                 name.c_str(), it->second.desc().c_str(), master.desc().c_str());
      master.copy_(it->second);
    }
  }
  return st;
}

TrainerState start_run(const RunContext& ctx, const std::string& resume, Module& model, Optimizer& opt,
                       const std::map<std::string, Tensor>& held, std::string* from) {
  TrainerState st;
  const std::string ck = find_checkpoint(ctx, resume);
  if (!ck.empty()) {
    st = load_checkpoint(ck, model, opt, held);
    std::printf("resumed from %s at step %lld\n", ck.c_str(), (long long)st.step);
  }
  if (from) *from = ck;
  if (ctx.dp) {
    // a rank that found no checkpoint (or another one) would train other weights silently
    ctx.dp->check_same("the step the run starts from", double(st.step),
                       "every rank must see the same checkpoint (train.out_dir on a file system all machines share, "
                       "or train.resume naming the same folder everywhere)");
    // init files named by path (node-local copies) could differ: compare what was loaded
    ctx.dp->check_same("the weights the run starts from", weights_fingerprint(model, opt, held),
                       "every rank must load the same files (model.init, model.lm_init, model.vision_init: paths, which "
                       "the config comparison leaves out) or checkpoint");
  }
  return st;
}

std::map<std::string, Tensor> load_checkpoint_model(const std::string& dir) {
  return load_safetensors(dir + "/model.safetensors").tensors;
}

std::string checkpoint_config_text(const std::string& dir) { return read_trainer_json(dir).at("config"); }

}  // namespace loom
