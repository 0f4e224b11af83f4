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
  // optional (the loader's batches have them): the rows whose target is >= 0, in order, and
  // those targets, int32 [K]. Then only these K rows go through the tied head (VLM::loss).
  Tensor loss_rows, loss_targets;
};
// loss_rows / loss_targets of a flattened target vector (the host side of a batch): the rows
// with a target, ascending. multiple > 1 rounds their count up to a multiple of it (at most
// every row) with rows that have none, the last ones, kept in order with target -1 (ignored:
// the same loss, one shape for batches whose counts differ a little; trainer.cpp's graphs).
void loss_rows_of(const std::vector<int32_t>& targets, std::vector<int32_t>& rows, std::vector<int32_t>& kept,
                  int64_t multiple = 1);
// b.loss_rows and b.loss_targets from the batch's targets on the host, copied to `device`
void set_loss_rows(VLMBatch& b, const std::vector<int32_t>& targets, Device device);

class VLM : public Module {
 public:
  VLM(const VLMConfig& c, const Init& init);
  // the vision tower's tokens after the pixel shuffle [Bi, Ti, D_vit * shuffle^2]
  Tensor vision_features(const Tensor& images) const;
  // projected image tokens [Bi * Ti, D_lm]
  Tensor image_embeddings(const Tensor& images) const;
  // input embeddings [Ntok, D_lm] with image tokens scattered in; `features`, when defined, are
  // vision_features(b.images) computed beforehand (a frozen tower run ahead of the step)
  Tensor embed(const VLMBatch& b, const Tensor& features = Tensor()) const;
  Tensor loss(const VLMBatch& b, const Tensor& features = Tensor()) const;  // mean CE over targets >= 0
  VLMConfig cfg;
  ViT vision;
  Linear projector;
  LM lm;
};

}  // namespace loom
