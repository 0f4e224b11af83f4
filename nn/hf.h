// hf.h: HF transformers checkpoints to and from the project's names (SPEC §1); import in
// hf.cpp, export in hf_export.cpp.
//   LlamaForCausalLM / SmolLM2: model.layers.{i}.self_attn.q_proj.weight -> layers.{i}.q_proj.weight, ...
//   SiglipVisionModel: Conv2d patch embedding -> linear (permute(0,2,3,1).reshape(D, -1)),
//   separate q/k/v -> fused qkv, out_proj -> proj, layer_norm1/2 -> norm1/2, post_layernorm -> norm.
#pragma once
#include <map>
#include <string>

#include "nn/lm.h"
#include "nn/vit.h"

namespace loom {

struct HFFolder {
  std::string path, model_type;  // "llama" | "siglip_vision_model" | ...
  std::map<std::string, Tensor> weights;  // model.safetensors, prefixes as saved
};
HFFolder read_hf_folder(const std::string& dir);  // config.json + model.safetensors

LMConfig llama_config(const std::string& dir);
ViTConfig siglip_config(const std::string& dir);

// HF state dict -> ours (tensors converted, not copied twice)
std::map<std::string, Tensor> llama_to_loom(const std::map<std::string, Tensor>& hf, const LMConfig& c,
                                            const std::string& source);
std::map<std::string, Tensor> siglip_to_loom(const std::map<std::string, Tensor>& hf, const ViTConfig& c,
                                             const std::string& source);
// Our names -> HF names (hf_export.cpp): the inverse maps (fused qkv split back, the Conv2d
// layout), for export and for comparing gradients under HF names. Tensors absent from `ours`
// are left out.
std::map<std::string, Tensor> loom_to_llama(const std::map<std::string, Tensor>& ours, const LMConfig& c);
std::map<std::string, Tensor> loom_to_siglip(const std::map<std::string, Tensor>& ours, const ViTConfig& c);

// The config.json text of the inverse direction: a LlamaForCausalLM of the LM's shape (tied
// head, RoPE rotate-half as HF's) and a SiglipVisionModel without pooling head. Reading them
// back with llama_config / siglip_config gives the same config.
struct HFTokenIds {
  int bos = -1, eos = -1, pad = -1;  // -1: null
};
std::string llama_config_json(const LMConfig& c, const HFTokenIds& ids, int max_positions);
std::string siglip_config_json(const ViTConfig& c);

// dir/config.json and dir/model.safetensors (float32, HF names, metadata format=pt) from our
// state dict of the part (the LM's or the ViT's own names). Every tensor of `ours` must map and
// every HF tensor must be written: checked by converting back with the importer.
void write_llama_folder(const std::string& dir, const std::map<std::string, Tensor>& ours, const LMConfig& c,
                        const HFTokenIds& ids, int max_positions);
void write_siglip_folder(const std::string& dir, const std::map<std::string, Tensor>& ours, const ViTConfig& c);

}  // namespace loom
