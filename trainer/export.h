// export.h: `./train export RUN_OR_CHECKPOINT --hf DIR`: a VLM run's language model as a Hugging
// Face LlamaForCausalLM folder, its vision tower as a SiglipVisionModel folder in DIR/vision/,
// and the projector beside them. The name mapping is at the top of nn/hf_export.cpp.
//
//   DIR/config.json               LlamaForCausalLM: shape, rms_norm_eps, rope_theta, tied head,
//                                 bos <|im_start|>, eos <|im_end|>, pad <|endoftext|>,
//                                 max_position_embeddings = data.pack_max_length
//   DIR/model.safetensors         the LM in float32 under HF names
//   DIR/generation_config.json    greedy, eos <|im_end|> (the end of an assistant turn)
//   DIR/tokenizer.json            the run's tokenizer, copied byte for byte
//   DIR/tokenizer_config.json     PreTrainedTokenizerFast, special tokens, the ChatML
//                                 chat_template of data/chat.h
//   DIR/special_tokens_map.json
//   DIR/vision/config.json, model.safetensors, preprocessor_config.json   SiglipVisionModel
//   DIR/projector.safetensors     weight [D_lm, shuffle^2 * D_vit] and bias of the linear after
//                                 the pixel shuffle (metadata: shuffle, image_token, image_tokens)
//                                 which HF has no class for
//
// The LM is all a text-only LlamaForCausalLM needs; the VLM itself (image tokens written
// over the <image> positions) has no transformers class, hence the separate parts.
#pragma once
#include <string>

#include "nn/vlm.h"

namespace loom {

struct ExportResult {
  std::string checkpoint;  // the checkpoint folder exported
  VLMConfig config;
};

// Throws with the path in the message: not a checkpoint or run folder, DIR not empty, a
// vit_mim run (no language model), a missing tokenizer.
ExportResult export_hf(const std::string& run_or_checkpoint, const std::string& dir);
int export_command(int argc, char** argv);  // ./train export RUN_OR_CHECKPOINT --hf DIR

}  // namespace loom
