// init_weights.cpp: model.lm_init / model.vision_init (see init_weights.h).
#include "trainer/init_weights.h"

#include <sys/stat.h>

#include <algorithm>

#include "nn/hf.h"
#include "tensor/fileio.h"
#include "trainer/config.h"
#include "trainer/run.h"

namespace loom {

namespace {

enum class Source { File, Checkpoint, HF };

struct Resolved {
  Source kind;
  std::string path;  // the file, the checkpoint folder or the HF folder
};

bool is_file(const std::string& p) {
  struct stat s;
  return ::stat(p.c_str(), &s) == 0 && S_ISREG(s.st_mode);
}

bool is_dir(const std::string& p) {
  struct stat s;
  return ::stat(p.c_str(), &s) == 0 && S_ISDIR(s.st_mode);
}

Resolved resolve(const std::string& key, const std::string& path) {
  if (is_file(path)) return {Source::File, path};
  LOOM_CHECK(is_dir(path), "%s = %s: no such file or folder", key.c_str(), path.c_str());
  if (is_file(path + "/trainer.json")) return {Source::Checkpoint, path};
  if (is_file(path + "/config.json")) return {Source::HF, path};
  RunContext run;
  run.out_dir = path;
  std::string ck = find_checkpoint(run, "latest");
  LOOM_CHECK(!ck.empty(),
             "%s = %s: not a .safetensors file, a checkpoint folder (trainer.json), a run folder with checkpoints "
             "(step_*/trainer.json) or an HF model folder (config.json + model.safetensors)",
             key.c_str(), path.c_str());
  return {Source::Checkpoint, ck};
}

// The tensors under `prefix` (stripped) when any name has it; nullptr-equivalent (empty) if none.
std::map<std::string, Tensor> under(const std::map<std::string, Tensor>& sd, const std::string& prefix) {
  std::map<std::string, Tensor> out;
  for (auto& [k, v] : sd)
    if (k.rfind(prefix, 0) == 0) out[k.substr(prefix.size())] = v;
  return out;
}

// model.init as a checkpoint folder (resolve() as for the part keys; a checkpoint's
// model.safetensors counts as its checkpoint), or "" for a bare .safetensors file.
std::string init_checkpoint(const std::string& path) {
  const Resolved r = resolve("model.init", path);
  LOOM_CHECK(r.kind != Source::HF, "model.init = %s: an HF folder holds one part (an LM or a vision tower): name it in "
             "model.lm_init or model.vision_init", path.c_str());
  if (r.kind == Source::Checkpoint) return r.path;
  const std::string dir = parent_dir(path), name = "/model.safetensors";
  const bool in_checkpoint = path.size() >= name.size() && path.compare(path.size() - name.size(), name.size(), name) == 0 &&
                             is_file(dir + "/trainer.json");
  return in_checkpoint ? dir : "";
}

}  // namespace

std::map<std::string, Tensor> vlm_init_weights(const std::string& path) {
  std::string ck = init_checkpoint(path);
  std::string file = ck.empty() ? path : ck + "/model.safetensors";
  auto sd = load_safetensors(file).tensors;
  for (const char* part : {"vision.", "projector.", "lm."})
    LOOM_CHECK(!under(sd, part).empty(),
               "model.init = %s: %s holds no %s* weights: not a VLM checkpoint (a part alone goes in model.lm_init / "
               "model.vision_init)", path.c_str(), file.c_str(), part);
  return sd;
}

std::string vlm_init_tokenizer(const std::string& path) {
  std::string ck = init_checkpoint(path);
  if (ck.empty()) {
    std::string beside = parent_dir(path) + "/tokenizer.json";
    LOOM_CHECK(is_file(beside), "model.init = %s: a bare .safetensors file needs its tokenizer: put tokenizer.json "
               "beside it or set data.tokenizer", path.c_str());
    return beside;
  }
  Config src = Config::parse(checkpoint_config_text(ck), ck + "/trainer.json");
  std::string given = src.get_str("data.tokenizer");
  if (!given.empty()) {
    LOOM_CHECK(is_file(given), "model.init = %s: its run was trained with data.tokenizer = %s, which is gone; set "
               "data.tokenizer", path.c_str(), given.c_str());
    return given;
  }
  std::string cached = parent_dir(ck) + "/tokenizer.json";
  LOOM_CHECK(is_file(cached), "model.init = %s: its run folder lacks the tokenizer it trained (%s); set data.tokenizer",
             path.c_str(), cached.c_str());
  return cached;
}

std::map<std::string, Tensor> lm_init_weights(const std::string& path, const LMConfig& c) {
  Resolved r = resolve("model.lm_init", path);
  if (r.kind == Source::HF) return llama_to_loom(read_hf_folder(r.path).weights, c, r.path);
  std::string file = r.kind == Source::File ? r.path : r.path + "/model.safetensors";
  auto sd = load_safetensors(file).tensors;
  auto lm = under(sd, "lm.");  // a VLM checkpoint
  if (!lm.empty()) return lm;
  if (sd.count("model.embed_tokens.weight")) return llama_to_loom(sd, c, file);  // HF names in a bare file
  LOOM_CHECK(r.kind == Source::File, "model.lm_init = %s: %s holds no lm.* weights (not a VLM checkpoint)", path.c_str(),
             file.c_str());
  return sd;  // the LM's own names
}

int64_t grow_embedding(std::map<std::string, Tensor>& weights, const Tensor& fresh) {
  auto it = weights.find("embed_tokens.weight");
  if (it == weights.end()) return 0;
  const Shape have = it->second.shape(), want = fresh.shape();  // copies: it->second is replaced below
  if (have.size() != 2 || want.size() != 2 || have[1] != want[1] || have[0] >= want[0]) return 0;
  std::vector<float> rows = fresh.to(Device::CPU).to_vector<float>();  // [V, D]
  std::vector<float> src = it->second.to(Device::CPU).to_vector<float>();  // [V_src, D]
  std::copy(src.begin(), src.end(), rows.begin());
  it->second = Tensor::from_vector(rows, want).to(it->second.dtype());
  return want[0] - have[0];
}

std::map<std::string, Tensor> vision_init_weights(const std::string& path, const ViTConfig& c) {
  Resolved r = resolve("model.vision_init", path);
  if (r.kind == Source::HF) return siglip_to_loom(read_hf_folder(r.path).weights, c, r.path);
  std::string file = r.kind == Source::File ? r.path : r.path + "/model.safetensors";
  auto sd = load_safetensors(file).tensors;
  for (const char* prefix : {"vision.", "encoder."})  // a VLM's vision tower, a MIM run's encoder
    if (auto v = under(sd, prefix); !v.empty()) return v;
  auto hf = under(sd, "vision_model.");
  if (!hf.empty()) return siglip_to_loom(hf, c, file);  // HF SigLIP names in a bare file
  LOOM_CHECK(r.kind == Source::File, "model.vision_init = %s: %s holds no vision.* or encoder.* weights", path.c_str(),
             file.c_str());
  return sd;  // the ViT's own names
}

}  // namespace loom
