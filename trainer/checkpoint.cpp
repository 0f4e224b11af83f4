// checkpoint.cpp: checkpoints of a run (see run.h): out_dir/step_00001234/{model.safetensors,
// optimizer.safetensors, trainer.json}, written under a temporary name and renamed when
// complete, the oldest beyond train.keep_last removed; found again by --train.resume.
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tensor/safetensors.h"
#include "trainer/run.h"

namespace loom {

using json = nlohmann::json;

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
    if (n.rfind("step_", 0) == 0 && n.find(".tmp") == std::string::npos) {
      struct stat s;
      if (stat((out_dir + "/" + n + "/trainer.json").c_str(), &s) == 0) v.push_back(n);
    }
  }
  closedir(d);
  std::sort(v.begin(), v.end());
  return v;
}

static void remove_dir(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (!d) return;
  while (dirent* e = readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") std::remove((dir + "/" + n).c_str());
  }
  closedir(d);
  rmdir(dir.c_str());
}

void save_checkpoint(const RunContext& ctx, Module& model, const Optimizer& opt, const TrainerState& st) {
  if (ctx.rank != 0) return;  // data parallel: every rank holds the same weights; rank 0 writes them
  char name[64];
  std::snprintf(name, sizeof name, "step_%08lld", (long long)st.step);
  std::string final_dir = ctx.out_dir + "/" + name, tmp = final_dir + ".tmp";
  remove_dir(tmp);
  mkdirs(tmp);
  save_safetensors(tmp + "/model.safetensors", model_master_state(model, opt));
  save_safetensors(tmp + "/optimizer.safetensors", opt.state_dict());
  json j = {{"step", st.step}, {"config", ctx.cfg.dump()}, {"extra", st.extra}};
  {
    std::ofstream f(tmp + "/trainer.json");
    f << j.dump(1) << "\n";
    LOOM_CHECK(f.good(), "%s/trainer.json: write failed", tmp.c_str());
  }
  remove_dir(final_dir);
  LOOM_CHECK(std::rename(tmp.c_str(), final_dir.c_str()) == 0, "cannot rename %s to %s", tmp.c_str(), final_dir.c_str());
  int keep = std::max(1, ctx.cfg.get_int("train.keep_last"));
  auto dirs = checkpoint_dirs(ctx.out_dir);
  for (size_t i = 0; i + size_t(keep) < dirs.size(); i++) remove_dir(ctx.out_dir + "/" + dirs[i]);
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

}  // namespace loom
