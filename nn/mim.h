// mim.h: LatentMIM and ContrastiveLatentMIM (SPEC §1): an encoder on the kept patches, an EMA
// target encoder on all patches, a predictor that unmasks by scatter (no host sync), the
// vectorized patch-discrimination loss and, for the contrastive variant, InfoNCE between the
// two views' pooled encodings.
#pragma once
#include <functional>

#include "nn/vit.h"

namespace loom {

struct MIMConfig {
  ViTConfig vit;
  int pred_dim = 384, pred_depth = 4, pred_heads = 6;
  double mask_ratio = 0.75, tau = 0.1, ema = 0.996;
  bool contrastive = false;
  double contrastive_weight = 0.1;
  int keep_count() const;  // K = round(N (1 - mask_ratio))
};

struct MIMView {
  Tensor images;          // [B, C, H, W]
  Tensor keep, masked;    // int32 [B, K], [B, N - K]
};

// Random masks for one view: a uniform permutation per sample, first K kept (torch_ref's
// mask_indices). Host-side, then copied to `device`.
MIMView make_view(const Tensor& images, const MIMConfig& c, Rng& rng, Device device);

class LatentMIM : public Module {
 public:
  LatentMIM(const MIMConfig& c, const Init& init);
  ~LatentMIM() override;
  LatentMIM(const LatentMIM&) = delete;
  LatentMIM& operator=(const LatentMIM&) = delete;
  // loss of one view; z [B, K, D] (the encoder's output) is returned for pooling.
  // target_repeat > 1: v's B samples are target_repeat copies of the first B / target_repeat
  // samples' images (views of the same images stacked), and the target runs on those once
  // (ViT::forward_patches' repeat)
  Tensor view_loss(const MIMView& v, Tensor* z_out, int target_repeat = 1) const;
  // mean of the views' losses (+ contrastive_weight * InfoNCE of two views when contrastive);
  // views of one shape run through view_loss as one batch (batch_views)
  Tensor forward(const std::vector<MIMView>& views) const;
  // state-dict: encoder.*, target.*, pred_in.*, mask_token, pred_pos, pred_blocks.*, pred_norm.*, pred_out.*
  MIMConfig cfg;
  ViT encoder, target;
  Linear pred_in;
  Tensor mask_token, pred_pos;
  std::vector<std::unique_ptr<ViTBlock>> pred_blocks;
  bool checkpoint_blocks = false;  // gradient checkpointing of the predictor blocks
  bool batch_views = true;         // views of one shape as one batch (false: one pass per view)
  // train.shared_target: where the views batched together are the same images (MIMView::images
  // one tensor, as the MIM trainer's two masked views of each image), the EMA target's blocks
  // before its last run once per image and only its last block once per view: the same
  // targets for about half of the target's FLOPs. Views of other images (augmented crops, the
  // reference's contrastive workload) run the target once per view whatever this says.
  bool shared_target = true;
  // CUDA: the target's forward on the side stream beside the encoder's and predictor's (a side
  // branch, kernels.h; the same kernels where attention runs loom's, so the same values)
  bool target_side_stream = false;
  // Data parallel with train.dist_infonce = global: each view's pooled features [B, D] become
  // every rank's [ranks x B, D] (DataParallel::all_gather_rows) before the InfoNCE. Unset: the
  // InfoNCE's negatives are this process's batch.
  std::function<Tensor(const Tensor&)> gather_pooled;
  LayerNorm pred_norm;
  Linear pred_out;

 private:
  Module pred_blocks_;
  mutable void* side_fork_ = nullptr;  // events of the side branch (created at its first use)
  mutable void* side_join_ = nullptr;
};

}  // namespace loom
