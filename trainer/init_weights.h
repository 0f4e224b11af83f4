// init_weights.h: what model.lm_init / model.vision_init may name, resolved to the state dict
// of the part (our names, as Module::load_state_dict takes them):
//   - an HF model folder (config.json + model.safetensors): LlamaForCausalLM / SigLIP names,
//     converted (nn/hf.h);
//   - one of our checkpoint folders (step_NNNNNNNN/ with trainer.json);
//   - a run folder: its newest complete checkpoint;
//   - a .safetensors file with our names: a checkpoint's model.safetensors (lm.*, vision.*,
//     encoder.* of a MIM run), or the part's own names without a prefix.
// Errors name the key, the path and what was expected.
#pragma once
#include <map>
#include <string>

#include "nn/lm.h"
#include "nn/vit.h"

namespace loom {

std::map<std::string, Tensor> lm_init_weights(const std::string& path, const LMConfig& c);
std::map<std::string, Tensor> vision_init_weights(const std::string& path, const ViTConfig& c);

}  // namespace loom
