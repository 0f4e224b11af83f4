// hf.h: HF transformers checkpoints to and from the project's names (SPEC §1).
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
// our name -> HF name(s) for gradients: the inverse maps (fused qkv split back, conv layout)
std::map<std::string, Tensor> loom_to_llama(const std::map<std::string, Tensor>& ours, const LMConfig& c);
std::map<std::string, Tensor> loom_to_siglip(const std::map<std::string, Tensor>& ours, const ViTConfig& c);

}  // namespace loom
