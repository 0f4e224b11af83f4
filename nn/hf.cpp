// hf.cpp: HF checkpoints into our names and layouts (see hf.h); the way back is hf_export.cpp.
#include "nn/hf.h"

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

namespace loom {

using json = nlohmann::json;

static json read_config(const std::string& dir) {
  std::string p = dir + "/config.json";
  std::ifstream f(p);
  LOOM_CHECK(f.good(), "%s: cannot open (an HF model folder needs config.json and model.safetensors)", p.c_str());
  try {
    return json::parse(f);
  } catch (const std::exception& e) {
    LOOM_CHECK(false, "%s: not valid JSON: %s", p.c_str(), e.what());
  }
}

// The numbers of config.json, each checked with the file and the key in the error: an integer
// field must be a JSON integer in [lo, hi] (a float such as 1e100 would convert to int with
// undefined behaviour, hidden_size 0 would divide by zero below, a string would surface as
// nlohmann's type error without the file); a real field a finite number above 0.
static int cfg_int(const json& j, const std::string& dir, const char* key, int64_t lo, int64_t hi) {
  auto it = j.find(key);
  LOOM_CHECK(it != j.end() && !it->is_null(), "%s/config.json: missing \"%s\"", dir.c_str(), key);
  bool ok = it->is_number_integer();
  if (ok && it->is_number_unsigned()) ok = it->get<uint64_t>() <= uint64_t(hi) && int64_t(it->get<uint64_t>()) >= lo;
  else if (ok) ok = it->get<int64_t>() >= lo && it->get<int64_t>() <= hi;
  std::string got = it->dump();
  if (got.size() > 40) got = got.substr(0, 40) + "...";
  LOOM_CHECK(ok, "%s/config.json: \"%s\" = %s, expected an integer in [%lld, %lld]", dir.c_str(), key, got.c_str(),
             (long long)lo, (long long)hi);
  return int(it->get<int64_t>());
}
static int cfg_int(const json& j, const std::string& dir, const char* key, int64_t lo, int64_t hi, int dflt) {
  return j.contains(key) && !j[key].is_null() ? cfg_int(j, dir, key, lo, hi) : dflt;
}
static double cfg_real(const json& j, const std::string& dir, const char* key, double dflt) {
  if (!j.contains(key) || j[key].is_null()) return dflt;
  const json& v = j[key];
  LOOM_CHECK(v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() > 0,
             "%s/config.json: \"%s\" = %s, expected a finite number above 0", dir.c_str(), key, v.dump().c_str());
  return v.get<double>();
}
// Bounds far above every published model, low enough that products of them stay in range.
constexpr int64_t kMaxWidth = 1 << 16, kMaxVocab = 1 << 24, kMaxDepth = 1024;

HFFolder read_hf_folder(const std::string& dir) {
  HFFolder h;
  h.path = dir;
  h.model_type = read_config(dir).value("model_type", "");
  SafeTensors st = load_safetensors(dir + "/model.safetensors");
  for (auto& [k, v] : st.tensors) {
    std::string n = k;
    if (n.rfind("vision_model.", 0) == 0) n = n.substr(13);  // SiglipVisionModel saved under a prefix
    h.weights[n] = v;
  }
  return h;
}

LMConfig llama_config(const std::string& dir) {
  json j = read_config(dir);
  LOOM_CHECK(j.value("model_type", "") == "llama", "%s/config.json: model_type '%s' is not llama", dir.c_str(),
             j.value("model_type", "").c_str());
  LMConfig c;
  c.vocab = cfg_int(j, dir, "vocab_size", 1, kMaxVocab);
  c.dim = cfg_int(j, dir, "hidden_size", 1, kMaxWidth);
  c.hidden = cfg_int(j, dir, "intermediate_size", 1, 4 * kMaxWidth);
  c.depth = cfg_int(j, dir, "num_hidden_layers", 1, kMaxDepth);
  c.heads = cfg_int(j, dir, "num_attention_heads", 1, c.dim);
  c.kv_heads = cfg_int(j, dir, "num_key_value_heads", 1, c.heads, c.heads);
  c.eps = cfg_real(j, dir, "rms_norm_eps", 1e-5);
  const bool in_params = j.contains("rope_parameters") && j["rope_parameters"].is_object() &&
                         j["rope_parameters"].contains("rope_theta");  // transformers 5 puts it there
  c.rope_theta = cfg_real(in_params ? j["rope_parameters"] : j, dir, "rope_theta", 10000.0);
  const bool tie_given = j.contains("tie_word_embeddings") && !j["tie_word_embeddings"].is_null();
  LOOM_CHECK(!tie_given || j["tie_word_embeddings"].is_boolean(),
             "%s/config.json: \"tie_word_embeddings\" must be true or false", dir.c_str());
  LOOM_CHECK(!tie_given || j["tie_word_embeddings"].get<bool>(), "%s/config.json: untied output heads are not supported",
             dir.c_str());
  if (j.contains("head_dim") && !j["head_dim"].is_null()) {
    const int hd = cfg_int(j, dir, "head_dim", 1, kMaxWidth);
    LOOM_CHECK(hd == c.dim / c.heads, "%s/config.json: head_dim %d != hidden_size / heads", dir.c_str(), hd);
  }
  return c;
}

ViTConfig siglip_config(const std::string& dir) {
  json j = read_config(dir);
  ViTConfig c;
  c.image_size = cfg_int(j, dir, "image_size", 1, kMaxWidth);
  c.patch_size = cfg_int(j, dir, "patch_size", 1, c.image_size);
  c.channels = cfg_int(j, dir, "num_channels", 1, 64, 3);
  c.dim = cfg_int(j, dir, "hidden_size", 1, kMaxWidth);
  c.depth = cfg_int(j, dir, "num_hidden_layers", 1, kMaxDepth);
  c.heads = cfg_int(j, dir, "num_attention_heads", 1, c.dim);
  int inter = cfg_int(j, dir, "intermediate_size", 1, 4 * kMaxWidth);
  c.mlp_ratio = inter / c.dim;
  c.mlp_hidden = inter;  // SigLIP widths need not be a multiple of hidden_size
  c.eps = cfg_real(j, dir, "layer_norm_eps", 1e-6);
  std::string act = j.value("hidden_act", "gelu_pytorch_tanh");
  LOOM_CHECK(act == "gelu_pytorch_tanh", "%s/config.json: hidden_act '%s' (only gelu_pytorch_tanh)", dir.c_str(),
             act.c_str());
  return c;
}

static const Tensor& need(const std::map<std::string, Tensor>& m, const std::string& k, const std::string& src) {
  auto it = m.find(k);
  LOOM_CHECK(it != m.end(), "%s: missing '%s'", src.c_str(), k.c_str());
  return it->second;
}

std::map<std::string, Tensor> llama_to_loom(const std::map<std::string, Tensor>& hf, const LMConfig& c,
                                            const std::string& src) {
  std::map<std::string, Tensor> o;
  o["embed_tokens.weight"] = need(hf, "model.embed_tokens.weight", src);
  o["norm.weight"] = need(hf, "model.norm.weight", src);
  for (int i = 0; i < c.depth; i++) {
    std::string h = "model.layers." + std::to_string(i) + ".", l = "layers." + std::to_string(i) + ".";
    for (auto p : {"q_proj", "k_proj", "v_proj", "o_proj"}) o[l + p + ".weight"] = need(hf, h + "self_attn." + p + ".weight", src);
    for (auto p : {"gate_proj", "up_proj", "down_proj"}) o[l + p + ".weight"] = need(hf, h + "mlp." + p + ".weight", src);
    for (auto p : {"input_layernorm", "post_attention_layernorm"}) o[l + p + ".weight"] = need(hf, h + p + ".weight", src);
  }
  return o;
}

// cat along dim 0 on the host
static Tensor cat0(const std::vector<Tensor>& ts) {
  Shape s = ts[0].shape();
  int64_t rows = 0;
  for (auto& t : ts) rows += t.size(0);
  s[0] = rows;
  Tensor out = Tensor::empty(s, ts[0].dtype());
  int64_t at = 0;
  for (auto& t : ts) {
    out.narrow(0, at, t.size(0)).copy_(t);
    at += t.size(0);
  }
  return out;
}

std::map<std::string, Tensor> siglip_to_loom(const std::map<std::string, Tensor>& hf, const ViTConfig& c,
                                             const std::string& src) {
  std::map<std::string, Tensor> o;
  Tensor conv = need(hf, "embeddings.patch_embedding.weight", src);  // [D, C, p, p]
  LOOM_CHECK(conv.dim() == 4, "%s: patch embedding %s is not a Conv2d weight", src.c_str(), conv.desc().c_str());
  o["patch_embed.proj.weight"] = conv.permute({0, 2, 3, 1}).contiguous().reshape({c.dim, -1});
  o["patch_embed.proj.bias"] = need(hf, "embeddings.patch_embedding.bias", src);
  o["pos_embed"] = need(hf, "embeddings.position_embedding.weight", src);
  for (int i = 0; i < c.depth; i++) {
    std::string h = "encoder.layers." + std::to_string(i) + ".", l = "blocks." + std::to_string(i) + ".";
    for (auto w : {"weight", "bias"}) {
      std::string W = w;
      o[l + "qkv." + W] = cat0({need(hf, h + "self_attn.q_proj." + W, src), need(hf, h + "self_attn.k_proj." + W, src),
                                need(hf, h + "self_attn.v_proj." + W, src)});
      o[l + "proj." + W] = need(hf, h + "self_attn.out_proj." + W, src);
      o[l + "norm1." + W] = need(hf, h + "layer_norm1." + W, src);
      o[l + "norm2." + W] = need(hf, h + "layer_norm2." + W, src);
      o[l + "fc1." + W] = need(hf, h + "mlp.fc1." + W, src);
      o[l + "fc2." + W] = need(hf, h + "mlp.fc2." + W, src);
    }
  }
  o["norm.weight"] = need(hf, "post_layernorm.weight", src);
  o["norm.bias"] = need(hf, "post_layernorm.bias", src);
  return o;
}

}  // namespace loom
