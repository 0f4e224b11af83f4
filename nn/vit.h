// vit.h: the ViT encoder of SPEC §1 (pre-norm blocks, learned positions, no CLS token) and
// the block it is made of (also used by the LatentMIM predictor).
#pragma once

#include <string>
#include <memory>

#include "nn/module.h"

namespace loom {

struct ViTConfig {
  int image_size = 224, patch_size = 16, channels = 3, dim = 768, depth = 12, heads = 12, mlp_ratio = 4;
  double eps = 1e-6;
  int mlp_hidden = 0;  // MLP width when it is not a multiple of dim (HF SigLIP); 0: mlp_ratio * dim
  // Initial position embeddings: "normal" (std 0.02, learned from there, as ViT/SigLIP) or
  // "sincos" (MAE's 2-D sine-cosine table, then learned: every patch starts distinguishable by
  // its row and column; needs dim % 4 == 0). The random draw happens either way, so the other
  // parameters' initial values do not depend on this choice.
  std::string pos_init = "normal";
  int hidden() const { return mlp_hidden > 0 ? mlp_hidden : mlp_ratio * dim; }
  int num_patches() const { return (image_size / patch_size) * (image_size / patch_size); }
  int grid() const { return image_size / patch_size; }
};

// MAE's fixed 2-D sine-cosine position table [grid*grid, dim] (row-major patches): the first
// dim/2 columns encode the patch's row, the last dim/2 its column, each as
// [sin(p * w_i), cos(p * w_i)] with w_i = 10000^(-i / (dim/4)), i < dim/4.
std::vector<float> sincos_2d(int grid, int dim);
// Position parameters [grid*grid, dim] initialised as `how` says ("normal": std 0.02;
// "sincos": the table above). The normal draw happens either way, so the parameters made
// after it start the same whichever is chosen. Used for the ViT's and the MIM predictor's.
Tensor init_positions(const Init& init, int grid, int dim, const std::string& how);

class ViTBlock : public Module {
 public:
  ViTBlock(int dim, int heads, int mlp_hidden, double eps, const Init& init);
  // x [B, N, D] -> [B, N, D]; bidirectional attention within each of the B rows.
  // out_rows int32 [B, M] (distinct within a row; undefined: all): only those tokens come out,
  // [B, M, D], the same values as gather_rows of the full output: every token is still a key
  // and a value of the attention, and everything after it (projection, residual, norm, MLP)
  // runs on the M tokens alone.
  Tensor forward(const Tensor& x, const SeqInfo& rows, const Tensor& out_rows = Tensor()) const;
  // The same block inside a stack: xn = norm1(x) comes from the block before, and the block
  // ends with the next norm (the next block's norm1, or the stack's final norm): -> {x_out,
  // next(x_out)}, the same values as forward() then next->forward (next null: {x_out} alone,
  // which is forward()). Both residual adds run inside the products (linear's and mlp_gelu's
  // residual).
  std::vector<Tensor> forward_fused(const Tensor& x, const Tensor& xn, const SeqInfo& rows, const LayerNorm* next,
                                    const Tensor& out_rows = Tensor()) const;
  int dim, heads;
  LayerNorm norm1, norm2;
  Linear qkv, proj, fc1, fc2;
  bool keep_gelu = false;  // train.keep_gelu: the MLP keeps its activation for the backward (mlp_gelu)
};

// x through a stack of blocks and then `final`: final(blocks(x)). Without gradient
// checkpointing each block hands the next one its normed input (forward_fused); with it, block
// by block (a checkpointed block keeps one tensor in and one out). out_rows [B, M] (distinct
// within a row): only those tokens of the output, from the last block on (ViTBlock::forward).
// repeat > 1: the blocks before the last run once on x's B samples, and their output is
// repeated `repeat` times along the batch before the last block (sample r B + b is b's), so that
// out_rows [repeat B, M] can pick other tokens of the same sample in each repeat: the MIM's EMA
// target, where two masked views of the same images want the same hidden states at other
// positions (nn/mim.cpp). The values are those of running every block on the repeated x.
Tensor vit_stack(const std::vector<std::unique_ptr<ViTBlock>>& blocks, const LayerNorm& final, const Tensor& x,
                 const SeqInfo& rows, bool checkpoint_blocks, const Tensor& out_rows = Tensor(), int repeat = 1);

class ViT : public Module {
 public:
  ViT(const ViTConfig& c, const Init& init);
  // images [B, C, H, W]; keep int32 [B, K] (undefined: all patches) -> [B, K or N, D];
  // out_rows int32 [B, M] (distinct within a row, positions among the kept tokens): only
  // those tokens of the output, [B, M, D] (vit_stack)
  Tensor forward(const Tensor& images, const Tensor& keep = Tensor(), const Tensor& out_rows = Tensor()) const;
  // images checked against the config and cut into patches: [B, N, p p C]
  Tensor patches(const Tensor& images) const;
  // forward() from patches(images): two encoders of the same images (the MIM's online encoder
  // and its EMA target) cut them once; repeat: vit_stack's (the output then has repeat B rows)
  Tensor forward_patches(const Tensor& patches, const Tensor& keep = Tensor(), const Tensor& out_rows = Tensor(),
                         int repeat = 1) const;
  // patch embedding + positions only: [B, N, D]
  Tensor embed(const Tensor& images) const;
  ViTConfig cfg;
  Linear patch_embed_proj;  // state-dict name patch_embed.proj
  Tensor pos_embed;
  std::vector<std::unique_ptr<ViTBlock>> blocks;
  bool checkpoint_blocks = false;  // gradient checkpointing: recompute each block in backward
  LayerNorm norm;

 private:
  Module patch_embed_;  // holds "proj" so names read patch_embed.proj.*
  Module blocks_;
};

}  // namespace loom
