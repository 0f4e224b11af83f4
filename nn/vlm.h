// vlm.h: ViT -> pixel shuffle -> projector -> LM (SPEC §1 VLM).
#pragma once
#include "nn/lm.h"
#include "nn/vit.h"

namespace loom {

struct VLMConfig {
  ViTConfig vit;
  LMConfig lm;
  int shuffle = 2;
  int image_token = -1;  // id whose positions receive image tokens
  int image_tokens() const { return vit.num_patches() / (shuffle * shuffle); }
};

// One packed batch on the model's device.
struct VLMBatch {
  Tensor images;           // [Bi, C, H, W], one per image placeholder block, in order
  Tensor ids, pos, targets;  // int32 [Ntok] (rows flattened)
  Tensor image_positions;  // int32 [Bi * image_tokens]: where image tokens go, in order
  SeqInfo seq;             // cu_seqlens over the flattened rows
};

class VLM : public Module {
 public:
  VLM(const VLMConfig& c, const Init& init);
  // projected image tokens [Bi * Ti, D_lm]
  Tensor image_embeddings(const Tensor& images) const;
  // input embeddings [Ntok, D_lm] with image tokens scattered in
  Tensor embed(const VLMBatch& b) const;
  Tensor loss(const VLMBatch& b) const;  // mean CE over targets >= 0
  VLMConfig cfg;
  ViT vision;
  Linear projector;
  LM lm;
};

}  // namespace loom
