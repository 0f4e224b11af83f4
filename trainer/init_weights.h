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

// The LM's tokenizer may have more ids than the LM it starts from: a data.tokenizer that got
// the ChatML tokens added (trainer/vlm_task.cpp). Then the source's embed_tokens.weight
// [V_src, D] is widened to the model's [V, D]: rows below V_src come from the source, the
// others keep the model's fresh initialization `fresh` (nanoVLM grows its embedding the same
// way, with HF's resize_token_embeddings). Returns the number of rows added (0: unchanged,
// also when the shapes differ otherwise, which load_state_dict then reports).
// model.init: a whole VLM to continue from (stage 2 of the two-stage recipe continues stage
// 1): a run folder (newest checkpoint), a checkpoint folder, or a .safetensors file with
// vision.*, projector.* and lm.* names. The weights, and where the tokenizer it was trained
// with is: the source run's data.tokenizer, else the tokenizer.json its run folder cached
// (or one beside a bare .safetensors file). Errors name model.init and the path.
std::map<std::string, Tensor> vlm_init_weights(const std::string& path);
std::string vlm_init_tokenizer(const std::string& path);

int64_t grow_embedding(std::map<std::string, Tensor>& weights, const Tensor& fresh);

}  // namespace loom
