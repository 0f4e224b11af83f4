// vit.cpp: ViT blocks and encoder (SPEC §1).
#include "nn/vit.h"

#include <cmath>

namespace loom {

ViTBlock::ViTBlock(int dim_, int heads_, int mlp_hidden, double eps, const Init& init)
    : dim(dim_), heads(heads_), norm1(dim_, eps, init), norm2(dim_, eps, init), qkv(dim_, 3 * dim_, true, init),
      proj(dim_, dim_, true, init), fc1(dim_, mlp_hidden, true, init), fc2(mlp_hidden, dim_, true, init) {
  LOOM_CHECK(dim % heads == 0, "ViT block: dim %d is not divisible by %d heads", dim, heads);
  child("norm1", norm1);
  child("qkv", qkv);
  child("proj", proj);
  child("norm2", norm2);
  child("fc1", fc1);
  child("fc2", fc2);
}

Tensor ViTBlock::forward(const Tensor& x, const SeqInfo& rows, const Tensor& out_rows) const {
  return forward_fused(x, norm1.forward(x), rows, nullptr, out_rows)[0];
}

std::vector<Tensor> ViTBlock::forward_fused(const Tensor& x, const Tensor& xn, const SeqInfo& rows,
                                            const LayerNorm* next, const Tensor& out_rows) const {
  int64_t B = x.size(0), N = x.size(1);
  int hd = dim / heads;
  // qkv split as [3, heads, head_dim] per token (SPEC §1): the weight's rows are q, k, v in
  // turn, so one batched GEMM writes q, k and v each contiguous, no copies; the backward takes
  // dq | dk | dv as rows of one gradient, so the projection's backward is one product per
  // gradient (qkv_attention)
  Tensor a = reshape(qkv_attention(reshape(xn, {B * N, dim}), qkv.weight, qkv.bias, rows, heads,
                                   1.0 / std::sqrt(double(hd))),
                     {B, N, dim});
  // only the tokens asked for go on (the MIM's target and predictor need the masked ones)
  Tensor xr = x;
  if (out_rows.defined()) {
    a = gather_rows(a, out_rows, /*distinct=*/true);
    xr = gather_rows(x, out_rows, /*distinct=*/true);
  }
  // h = x + proj(a) with the residual read by the product itself (cuBLASLt's C, beta = 1), then
  // norm2(h); out = h + fc2(gelu(fc1(.))) likewise, the GELU in fc1's epilogue (mlp_gelu). In
  // the backward each norm adds the residual stream's other gradient in its own pass.
  Tensor h = linear(a, proj.weight, proj.bias, xr);
  Tensor out = mlp_gelu(layernorm(h, norm2.weight, norm2.bias, norm2.eps), fc1.weight, fc1.bias, fc2.weight, fc2.bias, h,
                        keep_gelu);
  if (!next) return {out};  // forward(): no next norm
  return {out, layernorm(out, next->weight, next->bias, next->eps)};
}

// x [B, T, C] repeated `times` times along the batch: [times B, T, C], sample r B + b = x's b.
static Tensor repeat_batch(const Tensor& x, int times) {
  if (times == 1 || !x.defined()) return x;
  Shape s = x.shape();
  Shape one = s, many = s;
  one.insert(one.begin(), 1);
  many.insert(many.begin(), times);
  s[0] *= times;
  return reshape(expand(reshape(x, one), many), s);
}

Tensor vit_stack(const std::vector<std::unique_ptr<ViTBlock>>& blocks, const LayerNorm& final, const Tensor& x,
                 const SeqInfo& rows, bool checkpoint_blocks, const Tensor& out_rows, int repeat) {
  LOOM_CHECK(repeat >= 1, "vit_stack: repeat must be >= 1, got %d", repeat);
  LOOM_CHECK(!out_rows.defined() || out_rows.size(0) == x.size(0) * repeat,
             "vit_stack: out_rows %s for %lld samples repeated %d times", out_rows.desc().c_str(),
             (long long)x.size(0), repeat);
  // the offsets of the repeated batch, for the last block (dense rows: every sample T tokens)
  const SeqInfo last_rows =
      repeat == 1 ? rows : SeqInfo::dense(int(x.size(0)) * repeat, int(x.size(1)), x.device());
  if (blocks.empty()) {
    Tensor h = repeat_batch(x, repeat);
    return final.forward(out_rows.defined() ? gather_rows(h, out_rows, /*distinct=*/true) : h);
  }
  if (checkpoint_blocks) {
    Tensor h = x;
    for (size_t i = 0; i < blocks.size(); i++) {
      ProfileRange r("vit block");
      const ViTBlock* blk = blocks[i].get();
      const bool last = i + 1 == blocks.size();
      if (last) h = repeat_batch(h, repeat);
      Tensor sel = last ? out_rows : Tensor();
      SeqInfo ri = last ? last_rows : rows;
      h = checkpoint([blk, ri, sel](const Tensor& in) { return blk->forward(in, ri, sel); }, h);
    }
    return final.forward(h);
  }
  std::vector<Tensor> h = {x, blocks[0]->norm1.forward(x)};
  for (size_t i = 0; i < blocks.size(); i++) {
    ProfileRange r("vit block");
    const bool last = i + 1 == blocks.size();
    if (last && repeat > 1) h = {repeat_batch(h[0], repeat), repeat_batch(h[1], repeat)};
    h = blocks[i]->forward_fused(h[0], h[1], last ? last_rows : rows, last ? &final : &blocks[i + 1]->norm1,
                                 last ? out_rows : Tensor());
  }
  return h[1];
}

std::vector<float> sincos_2d(int grid, int dim) {
  LOOM_CHECK(dim % 4 == 0, "sincos position table: dim %d is not a multiple of 4", dim);
  int q = dim / 4;
  std::vector<float> t(size_t(grid) * grid * dim);
  for (int r = 0; r < grid; r++)
    for (int col = 0; col < grid; col++) {
      float* row = &t[(size_t(r) * grid + col) * dim];
      for (int i = 0; i < q; i++) {
        double w = std::pow(10000.0, -double(i) / q);
        row[i] = float(std::sin(r * w));
        row[q + i] = float(std::cos(r * w));
        row[2 * q + i] = float(std::sin(col * w));
        row[3 * q + i] = float(std::cos(col * w));
      }
    }
  return t;
}

Tensor init_positions(const Init& init, int grid, int dim, const std::string& how) {
  Tensor t = init.normal({int64_t(grid) * grid, dim}, 0.02);
  if (how == "normal") return t;
  LOOM_CHECK(how == "sincos", "position init must be normal or sincos, got '%s'", how.c_str());
  return Tensor::from_vector(sincos_2d(grid, dim), {int64_t(grid) * grid, dim}).to(t.dtype()).to(t.device()).requires_grad_();
}

ViT::ViT(const ViTConfig& c, const Init& init)
    : cfg(c), patch_embed_proj(c.patch_size * c.patch_size * c.channels, c.dim, true, init), norm(c.dim, c.eps, init) {
  LOOM_CHECK(c.image_size % c.patch_size == 0, "ViT: image size %d is not divisible by patch size %d", c.image_size,
             c.patch_size);
  patch_embed_.child("proj", patch_embed_proj);
  child("patch_embed", patch_embed_);
  pos_embed = init_positions(init, c.grid(), c.dim, c.pos_init);
  param("pos_embed", pos_embed);
  for (int i = 0; i < c.depth; i++) {
    blocks.push_back(std::make_unique<ViTBlock>(c.dim, c.heads, c.hidden(), c.eps, init));
    blocks_.child(std::to_string(i), *blocks.back());
  }
  child("blocks", blocks_);
  child("norm", norm);
}

static void check_images(const ViTConfig& cfg, const Tensor& images) {
  LOOM_CHECK(images.dim() == 4 && images.size(1) == cfg.channels && images.size(2) == cfg.image_size &&
                 images.size(3) == cfg.image_size,
             "ViT: expected images [B, %d, %d, %d], got %s", cfg.channels, cfg.image_size, cfg.image_size,
             images.desc().c_str());
}

Tensor ViT::embed(const Tensor& images) const { return add(patch_embed_proj.forward(patches(images)), pos_embed); }

Tensor ViT::patches(const Tensor& images) const {
  check_images(cfg, images);
  return patchify(images, cfg.patch_size);
}

Tensor ViT::forward(const Tensor& images, const Tensor& keep, const Tensor& out_rows) const {
  return forward_patches(patches(images), keep, out_rows);
}

Tensor ViT::forward_patches(const Tensor& patches, const Tensor& keep, const Tensor& out_rows, int repeat) const {
  const int64_t F = int64_t(cfg.patch_size) * cfg.patch_size * cfg.channels;
  LOOM_CHECK(patches.dim() == 3 && patches.size(1) == cfg.num_patches() && patches.size(2) == F,
             "ViT: expected patches [B, %d, %lld], got %s", cfg.num_patches(), (long long)F, patches.desc().c_str());
  Tensor x;
  if (keep.defined()) {
    // Only the kept patches are embedded: their pixels are gathered first, the product runs on
    // K rows instead of N, and each row's position is looked up by its index and added inside
    // the product (linear's residual). The same values as embedding every patch and gathering.
    x = linear(gather_rows(patches, keep), patch_embed_proj.weight, patch_embed_proj.bias, embedding(keep, pos_embed));
  } else {
    x = add(patch_embed_proj.forward(patches), pos_embed);
  }
  SeqInfo rows = SeqInfo::dense(int(x.size(0)), int(x.size(1)), x.device());
  return vit_stack(blocks, norm, x, rows, checkpoint_blocks, out_rows, repeat);
}

}  // namespace loom
