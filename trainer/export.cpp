// export.cpp: ./train export (see export.h; the tensors' names: nn/hf_export.cpp).
#include "trainer/export.h"

#include <dirent.h>
#include <sys/stat.h>

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "data/chat.h"
#include "data/tokenizer.h"
#include "nn/hf.h"
#include "tensor/fileio.h"
#include "trainer/run.h"
#include "trainer/vlm_task.h"

namespace loom {

using ojson = nlohmann::ordered_json;

namespace {

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  LOOM_CHECK(f.good(), "export: cannot read %s", path.c_str());
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_text(const std::string& path, const std::string& text) {
  write_file_atomic(path, {{text.data(), text.size()}});
}

// The output folder: created, or an existing empty one; anything else is refused so that
// an export never mixes its files with others'.
void prepare_output(const std::string& dir) {
  struct stat s;
  if (stat(dir.c_str(), &s) == 0) {
    LOOM_CHECK(S_ISDIR(s.st_mode), "export: --hf %s exists and is not a folder", dir.c_str());
    DIR* d = opendir(dir.c_str());
    LOOM_CHECK(d, "export: --hf %s: cannot open the folder", dir.c_str());
    bool empty = true;
    while (dirent* e = readdir(d)) empty &= !std::strcmp(e->d_name, ".") || !std::strcmp(e->d_name, "..");
    closedir(d);
    LOOM_CHECK(empty, "export: --hf %s exists and is not empty (export writes into a new or empty folder)", dir.c_str());
  }
  mkdirs(dir);
}

std::map<std::string, Tensor> under(const std::map<std::string, Tensor>& sd, const std::string& prefix) {
  std::map<std::string, Tensor> out;
  for (auto& [k, v] : sd)
    if (k.rfind(prefix, 0) == 0) out[k.substr(prefix.size())] = v;
  return out;
}

// tokenizer_config.json: the class transformers builds from tokenizer.json alone, the special
// tokens by content, and every added token of tokenizer.json under its id.
std::string tokenizer_config(const std::string& tokenizer_text, const std::string& source, int max_len) {
  ojson tj;
  try {
    tj = ojson::parse(tokenizer_text);
  } catch (const std::exception& e) {
    LOOM_CHECK(false, "export: %s: not valid JSON: %s", source.c_str(), e.what());
  }
  ojson added = ojson::object();
  for (auto& a : tj.value("added_tokens", ojson::array())) {
    LOOM_CHECK(a.is_object() && a.contains("id") && a["id"].is_number_integer() && a.contains("content"),
               "export: %s: an added token without an integer id and a content: %s", source.c_str(),
               a.dump().substr(0, 80).c_str());
    added[std::to_string(a["id"].get<int64_t>())] = {
        {"content", a.at("content")},       {"lstrip", a.value("lstrip", false)},
        {"normalized", a.value("normalized", false)}, {"rstrip", a.value("rstrip", false)},
        {"single_word", a.value("single_word", false)}, {"special", a.value("special", false)}};
  }
  ojson j;
  j["tokenizer_class"] = "PreTrainedTokenizerFast";
  j["bos_token"] = "<|im_start|>";
  j["eos_token"] = "<|im_end|>";
  j["pad_token"] = "<|endoftext|>";
  j["model_max_length"] = max_len;
  j["clean_up_tokenization_spaces"] = false;  // decode returns the text as trained
  j["chat_template"] = kChatTemplateJinja;
  j["added_tokens_decoder"] = added;
  return j.dump(2) + "\n";
}

}  // namespace

ExportResult export_hf(const std::string& run_or_checkpoint, const std::string& dir) {
  LOOM_CHECK(!dir.empty(), "export: --hf DIR is required (usage: ./train export RUN_OR_CHECKPOINT --hf DIR)");
  ExportResult r;
  r.checkpoint = resolve_checkpoint(run_or_checkpoint, "export");
  const std::string& ck = r.checkpoint;
  Config cfg = Config::parse(checkpoint_config_text(ck), ck + "/trainer.json");
  const std::string trainer = cfg.get_str("train.trainer");
  LOOM_CHECK(trainer != "vit_mim",
             "export: %s is a vit_mim run (train.trainer = vit_mim): it has no language model to write as "
             "LlamaForCausalLM; --hf exports the LM and vision tower of a vlm_sft / vlm_pretrain run",
             ck.c_str());
  // the run's tokenizer: the file it was given, or the one it trained and cached
  std::string tok_path = cfg.get_str("data.tokenizer");
  if (tok_path.empty()) tok_path = parent_dir(ck) + "/tokenizer.json";
  struct stat s;
  LOOM_CHECK(stat(tok_path.c_str(), &s) == 0, "export: the run's tokenizer %s is missing", tok_path.c_str());
  Tokenizer tok = Tokenizer::from_file(tok_path);
  for (const char* t : {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"})
    LOOM_CHECK(tok.has_token(t), "export: %s lacks the special token %s", tok_path.c_str(), t);
  r.config = vlm_config_from(cfg, tok.vocab_size(), tok.token_id("<image>"));
  const VLMConfig& vc = r.config;

  // the checkpoint's weights, checked against the config by loading them into the model
  std::map<std::string, Tensor> sd = load_checkpoint_model(ck);
  std::map<std::string, Tensor> lm = under(sd, "lm."), vision = under(sd, "vision."), proj = under(sd, "projector.");
  {
    Rng rng(0);
    VLM m(vc, Init{DType::F32, Device::CPU, &rng});
    m.load_state_dict(sd, ck + "/model.safetensors");  // every tensor there, with its shape
  }
  prepare_output(dir);
  HFTokenIds ids{tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")};
  const int max_len = cfg.get_int("data.pack_max_length");
  write_llama_folder(dir, lm, vc.lm, ids, max_len);
  const std::string tok_text = read_bytes(tok_path);
  write_text(dir + "/tokenizer.json", tok_text);
  write_text(dir + "/tokenizer_config.json", tokenizer_config(tok_text, tok_path, max_len));
  write_text(dir + "/special_tokens_map.json",
             ojson({{"bos_token", "<|im_start|>"}, {"eos_token", "<|im_end|>"}, {"pad_token", "<|endoftext|>"}}).dump(2) +
                 "\n");
  ojson gen;
  gen["bos_token_id"] = ids.bos;
  gen["eos_token_id"] = ids.eos;
  gen["pad_token_id"] = ids.pad;
  gen["do_sample"] = false;  // the evaluation's greedy decoding
  gen["max_new_tokens"] = cfg.get_int("eval.max_new_tokens");
  write_text(dir + "/generation_config.json", gen.dump(2) + "\n");

  // vision tower: SiglipVisionModel; pixels as our loaders make them, (x/255 - 0.5) / 0.5
  // after a bilinear resize (data/images.cpp)
  const std::string vdir = dir + "/vision";
  mkdirs(vdir);
  write_siglip_folder(vdir, vision, vc.vit);
  ojson pre;
  pre["image_processor_type"] = "SiglipImageProcessor";
  pre["do_resize"] = true;
  pre["size"] = {{"height", vc.vit.image_size}, {"width", vc.vit.image_size}};
  pre["resample"] = 2;  // PIL bilinear
  pre["do_rescale"] = true;
  pre["rescale_factor"] = 1.0 / 255.0;
  pre["do_normalize"] = true;
  pre["image_mean"] = std::vector<double>(size_t(vc.vit.channels), 0.5);
  pre["image_std"] = std::vector<double>(size_t(vc.vit.channels), 0.5);
  write_text(vdir + "/preprocessor_config.json", pre.dump(2) + "\n");
  std::map<std::string, Tensor> proj_out;
  for (auto& [k, v] : proj) proj_out[k] = v.to(DType::F32).contiguous();
  save_safetensors(dir + "/projector.safetensors", proj_out,
                   {{"format", "pt"},
                    {"shuffle", std::to_string(vc.shuffle)},
                    {"image_token", std::to_string(vc.image_token)},
                    {"image_tokens", std::to_string(vc.image_tokens())},
                    {"note", "VLM projector: image tokens = linear(pixel_shuffle(vision last_hidden_state, shuffle)) "
                             "written over the <image> positions (nn/vlm.cpp)"}});
  return r;
}

int export_command(int argc, char** argv) {
  const char* usage = "usage: ./train export RUN_OR_CHECKPOINT --hf DIR";
  std::string src, dir;
  bool hf = false;
  for (int i = 0; i < argc; i++) {
    std::string a = argv[i];
    if (a == "--hf") {
      LOOM_CHECK(i + 1 < argc, "export: --hf needs a folder (%s)", usage);
      dir = argv[++i];
      hf = true;
    } else if (a.rfind("--hf=", 0) == 0) {
      dir = a.substr(5);
      hf = true;
    } else if (a.rfind("--", 0) == 0) {
      LOOM_CHECK(false, "export: unknown option %s (%s)", a.c_str(), usage);
    } else {
      LOOM_CHECK(src.empty(), "export: two sources given ('%s', '%s'); %s", src.c_str(), a.c_str(), usage);
      src = a;
    }
  }
  LOOM_CHECK(!src.empty(), "export: no run or checkpoint folder given; %s", usage);
  LOOM_CHECK(hf && !dir.empty(), "export: --hf DIR is required (the only export format); %s", usage);
  ExportResult r = export_hf(src, dir);
  const LMConfig& c = r.config.lm;
  std::printf("exported %s to %s: LlamaForCausalLM (vocab %d, hidden %d, %d layers, %d heads, %d kv heads, "
              "intermediate %d), tokenizer with chat template; vision tower (SiglipVisionModel) in %s/vision; "
              "projector in %s/projector.safetensors\n",
              r.checkpoint.c_str(), dir.c_str(), c.vocab, c.dim, c.depth, c.heads, c.kv_heads, c.hidden, dir.c_str(),
              dir.c_str());
  return 0;
}

}  // namespace loom
