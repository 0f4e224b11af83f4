// hf_export.cpp: our weights as HF transformers folders, the inverse of hf.cpp.
//
// LM -> LlamaForCausalLM (no layout change: our RoPE is HF's rotate-half on the q/k rows as
// they are, so no permutation of q_proj/k_proj is needed either way; Meta's original
// interleaved layout is what HF's own converter permutes, and neither side uses it):
//   embed_tokens.weight                       model.embed_tokens.weight   (also the head: tied,
//                                                                          so no lm_head.weight)
//   layers.{i}.{q,k,v,o}_proj.weight          model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
//   layers.{i}.{gate,up,down}_proj.weight     model.layers.{i}.mlp.{gate,up,down}_proj.weight
//   layers.{i}.input_layernorm.weight         model.layers.{i}.input_layernorm.weight
//   layers.{i}.post_attention_layernorm.weight model.layers.{i}.post_attention_layernorm.weight
//   norm.weight                               model.norm.weight
//
// ViT -> SiglipVisionModel without pooling head (saved without a prefix, as transformers 5
// writes it; the importer also accepts vision_model.*):
//   patch_embed.proj.weight [D, p*p*C]        embeddings.patch_embedding.weight [D, C, p, p]
//       (our patch vector is row-major (py, px, c): reshape to [D, p, p, C], permute(0,3,1,2))
//   patch_embed.proj.bias                     embeddings.patch_embedding.bias
//   pos_embed [N, D]                          embeddings.position_embedding.weight
//   blocks.{i}.qkv.{weight,bias} [3D, ...]    encoder.layers.{i}.self_attn.{q,k,v}_proj.* (rows
//                                             0..D, D..2D, 2D..3D)
//   blocks.{i}.proj.*                         encoder.layers.{i}.self_attn.out_proj.*
//   blocks.{i}.norm1.* / norm2.*              encoder.layers.{i}.layer_norm1.* / layer_norm2.*
//   blocks.{i}.fc1.* / fc2.*                  encoder.layers.{i}.mlp.fc1.* / fc2.*
//   norm.*                                    post_layernorm.*
// Both use GELU with the tanh approximation (gelu_pytorch_tanh), LayerNorm with bias, and no
// CLS token, so every ViT tensor has a SigLIP counterpart.
#include <nlohmann/json.hpp>

#include "nn/hf.h"
#include "tensor/fileio.h"

namespace loom {

using ojson = nlohmann::ordered_json;

std::map<std::string, Tensor> loom_to_llama(const std::map<std::string, Tensor>& ours, const LMConfig& c) {
  std::map<std::string, Tensor> o;
  auto put = [&](const std::string& hf, const std::string& l) {
    auto it = ours.find(l);
    if (it != ours.end() && it->second.defined()) o[hf] = it->second;
  };
  put("model.embed_tokens.weight", "embed_tokens.weight");
  put("model.norm.weight", "norm.weight");
  for (int i = 0; i < c.depth; i++) {
    std::string h = "model.layers." + std::to_string(i) + ".", l = "layers." + std::to_string(i) + ".";
    for (auto p : {"q_proj", "k_proj", "v_proj", "o_proj"}) put(h + "self_attn." + p + ".weight", l + p + ".weight");
    for (auto p : {"gate_proj", "up_proj", "down_proj"}) put(h + "mlp." + p + ".weight", l + p + ".weight");
    for (auto p : {"input_layernorm", "post_attention_layernorm"}) put(h + p + ".weight", l + p + ".weight");
  }
  return o;
}

std::map<std::string, Tensor> loom_to_siglip(const std::map<std::string, Tensor>& ours, const ViTConfig& c) {
  std::map<std::string, Tensor> o;
  auto get = [&](const std::string& k) {
    auto it = ours.find(k);
    return it == ours.end() ? Tensor() : it->second.to(Device::CPU);
  };
  int p = c.patch_size;
  if (Tensor w = get("patch_embed.proj.weight"); w.defined())
    o["embeddings.patch_embedding.weight"] = w.reshape({c.dim, p, p, c.channels}).permute({0, 3, 1, 2}).contiguous();
  if (Tensor b = get("patch_embed.proj.bias"); b.defined()) o["embeddings.patch_embedding.bias"] = b;
  if (Tensor pe = get("pos_embed"); pe.defined()) o["embeddings.position_embedding.weight"] = pe;
  for (int i = 0; i < c.depth; i++) {
    std::string h = "encoder.layers." + std::to_string(i) + ".", l = "blocks." + std::to_string(i) + ".";
    for (auto w : {"weight", "bias"}) {
      std::string W = w;
      if (Tensor q = get(l + "qkv." + W); q.defined()) {
        o[h + "self_attn.q_proj." + W] = q.narrow(0, 0, c.dim).contiguous();
        o[h + "self_attn.k_proj." + W] = q.narrow(0, c.dim, c.dim).contiguous();
        o[h + "self_attn.v_proj." + W] = q.narrow(0, 2 * c.dim, c.dim).contiguous();
      }
      auto put = [&](const std::string& hf, const std::string& lk) {
        if (Tensor t = get(lk); t.defined()) o[hf] = t;
      };
      put(h + "self_attn.out_proj." + W, l + "proj." + W);
      put(h + "layer_norm1." + W, l + "norm1." + W);
      put(h + "layer_norm2." + W, l + "norm2." + W);
      put(h + "mlp.fc1." + W, l + "fc1." + W);
      put(h + "mlp.fc2." + W, l + "fc2." + W);
    }
  }
  if (Tensor t = get("norm.weight"); t.defined()) o["post_layernorm.weight"] = t;
  if (Tensor t = get("norm.bias"); t.defined()) o["post_layernorm.bias"] = t;
  return o;
}

static ojson id_or_null(int id) { return id >= 0 ? ojson(id) : ojson(nullptr); }

std::string llama_config_json(const LMConfig& c, const HFTokenIds& ids, int max_positions) {
  ojson j;
  j["architectures"] = {"LlamaForCausalLM"};
  j["model_type"] = "llama";
  j["vocab_size"] = c.vocab;
  j["hidden_size"] = c.dim;
  j["intermediate_size"] = c.hidden;
  j["num_hidden_layers"] = c.depth;
  j["num_attention_heads"] = c.heads;
  j["num_key_value_heads"] = c.kv_heads;
  j["head_dim"] = c.head_dim();
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = c.eps;
  // transformers 5 reads rope_parameters, 4.x reads rope_theta: both are written
  j["rope_theta"] = c.rope_theta;
  j["rope_parameters"] = {{"rope_theta", c.rope_theta}, {"rope_type", "default"}};
  j["max_position_embeddings"] = max_positions;
  j["tie_word_embeddings"] = true;  // our output head is embed_tokens
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["mlp_bias"] = false;
  j["pretraining_tp"] = 1;
  j["initializer_range"] = 0.02;
  j["bos_token_id"] = id_or_null(ids.bos);
  j["eos_token_id"] = id_or_null(ids.eos);
  j["pad_token_id"] = id_or_null(ids.pad);
  j["torch_dtype"] = "float32";  // transformers 4.x's key
  j["dtype"] = "float32";        // transformers 5's
  j["use_cache"] = true;
  return j.dump(2) + "\n";
}

std::string siglip_config_json(const ViTConfig& c) {
  ojson j;
  j["architectures"] = {"SiglipVisionModel"};
  j["model_type"] = "siglip_vision_model";
  j["image_size"] = c.image_size;
  j["patch_size"] = c.patch_size;
  j["num_channels"] = c.channels;
  j["hidden_size"] = c.dim;
  j["intermediate_size"] = c.hidden();
  j["num_hidden_layers"] = c.depth;
  j["num_attention_heads"] = c.heads;
  j["hidden_act"] = "gelu_pytorch_tanh";
  j["layer_norm_eps"] = c.eps;
  j["attention_dropout"] = 0.0;
  j["vision_use_head"] = false;  // our ViT ends at its final LayerNorm (no attention pooling)
  j["torch_dtype"] = "float32";
  j["dtype"] = "float32";
  return j.dump(2) + "\n";
}

static void write_text(const std::string& path, const std::string& text) {
  write_file_atomic(path, {{text.data(), text.size()}});
}

// f32, contiguous, on the host: what model.safetensors holds
static std::map<std::string, Tensor> host_f32(const std::map<std::string, Tensor>& m) {
  std::map<std::string, Tensor> o;
  for (auto& [k, v] : m) o[k] = v.to(Device::CPU).to(DType::F32).contiguous();
  return o;
}

// Every tensor of `ours` must come back from the HF names, and nothing else.
static void check_complete(const std::map<std::string, Tensor>& ours, const std::map<std::string, Tensor>& back,
                           const std::string& dir) {
  for (auto& [k, v] : ours) LOOM_CHECK(back.count(k), "%s: '%s' has no HF counterpart", dir.c_str(), k.c_str());
  LOOM_CHECK(back.size() == ours.size(), "%s: %zu tensors exported, %zu given", dir.c_str(), back.size(), ours.size());
}

void write_llama_folder(const std::string& dir, const std::map<std::string, Tensor>& ours, const LMConfig& c,
                        const HFTokenIds& ids, int max_positions) {
  auto hf = host_f32(loom_to_llama(ours, c));
  check_complete(ours, llama_to_loom(hf, c, dir), dir);  // throws naming a missing HF tensor
  save_safetensors(dir + "/model.safetensors", hf, {{"format", "pt"}});
  write_text(dir + "/config.json", llama_config_json(c, ids, max_positions));
}

void write_siglip_folder(const std::string& dir, const std::map<std::string, Tensor>& ours, const ViTConfig& c) {
  auto hf = host_f32(loom_to_siglip(ours, c));
  check_complete(ours, siglip_to_loom(hf, c, dir), dir);
  save_safetensors(dir + "/model.safetensors", hf, {{"format", "pt"}});
  write_text(dir + "/config.json", siglip_config_json(c));
}

}  // namespace loom
