// hf.cpp: HF checkpoints into our names and layouts (see hf.h); the way back is hf_export.cpp.
#include "nn/hf.h"

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
  c.vocab = j.at("vocab_size");
  c.dim = j.at("hidden_size");
  c.hidden = j.at("intermediate_size");
  c.depth = j.at("num_hidden_layers");
  c.heads = j.at("num_attention_heads");
  c.kv_heads = j.value("num_key_value_heads", c.heads);
  c.eps = j.value("rms_norm_eps", 1e-5);
  if (j.contains("rope_parameters") && j["rope_parameters"].contains("rope_theta"))
    c.rope_theta = j["rope_parameters"]["rope_theta"];
  else c.rope_theta = j.value("rope_theta", 10000.0);
  LOOM_CHECK(j.value("tie_word_embeddings", true), "%s/config.json: untied output heads are not supported", dir.c_str());
  LOOM_CHECK(!j.contains("head_dim") || j["head_dim"].get<int>() == c.dim / c.heads,
             "%s/config.json: head_dim %d != hidden_size / heads", dir.c_str(), j["head_dim"].get<int>());
  return c;
}

ViTConfig siglip_config(const std::string& dir) {
  json j = read_config(dir);
  ViTConfig c;
  c.image_size = j.at("image_size");
  c.patch_size = j.at("patch_size");
  c.channels = j.value("num_channels", 3);
  c.dim = j.at("hidden_size");
  c.depth = j.at("num_hidden_layers");
  c.heads = j.at("num_attention_heads");
  int inter = j.at("intermediate_size");
  c.mlp_ratio = inter / c.dim;
  c.mlp_hidden = inter;  // SigLIP widths need not be a multiple of hidden_size
  c.eps = j.value("layer_norm_eps", 1e-6);
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
