// mim.cpp: LatentMIM / ContrastiveLatentMIM (SPEC §1, torch_ref.py LatentMIM).
#include "nn/mim.h"

#include <cmath>

#include "kernels/kernels.h"

namespace loom {

int MIMConfig::keep_count() const {
  return int(std::nearbyint(double(vit.num_patches()) * (1.0 - mask_ratio)));
}

MIMView make_view(const Tensor& images, const MIMConfig& c, Rng& rng, Device device) {
  int B = int(images.size(0)), N = c.vit.num_patches(), K = c.keep_count();
  std::vector<int32_t> keep(size_t(B) * K), masked(size_t(B) * (N - K));
  for (int b = 0; b < B; b++) {
    auto p = rng.permutation(N);
    for (int i = 0; i < K; i++) keep[size_t(b) * K + i] = p[size_t(i)];
    for (int i = K; i < N; i++) masked[size_t(b) * (N - K) + (i - K)] = p[size_t(i)];
  }
  MIMView v;
  v.images = images.to(device);
  v.keep = Tensor::from_vector(keep, {B, K}, device);
  v.masked = Tensor::from_vector(masked, {B, N - K}, device);
  return v;
}

LatentMIM::LatentMIM(const MIMConfig& c, const Init& init)
    : cfg(c), encoder(c.vit, init), target(c.vit, init), pred_in(c.vit.dim, c.pred_dim, true, init),
      pred_norm(c.pred_dim, c.vit.eps, init), pred_out(c.pred_dim, c.vit.dim, true, init) {
  child("encoder", encoder);
  child("target", target);
  target.load_state_dict(encoder.state_dict(), "encoder");  // the EMA starts as a copy
  target.requires_grad_(false);
  child("pred_in", pred_in);
  mask_token = init.zeros({c.pred_dim});
  param("mask_token", mask_token);
  pred_pos = init_positions(init, c.vit.grid(), c.pred_dim, c.vit.pos_init);  // the predictor's queries
  param("pred_pos", pred_pos);
  for (int i = 0; i < c.pred_depth; i++) {
    pred_blocks.push_back(std::make_unique<ViTBlock>(c.pred_dim, c.pred_heads, 4 * c.pred_dim, c.vit.eps, init));
    pred_blocks_.child(std::to_string(i), *pred_blocks.back());
  }
  child("pred_blocks", pred_blocks_);
  child("pred_norm", pred_norm);
  child("pred_out", pred_out);
}

LatentMIM::~LatentMIM() {
  if (!side_fork_) return;  // (a CPU-only build has no events)
  cuda::event_destroy(side_fork_);
  cuda::event_destroy(side_join_);
}

Tensor LatentMIM::view_loss(const MIMView& v, Tensor* z_out, int target_repeat) const {
  int B = int(v.keep.size(0)), N = cfg.vit.num_patches();
  LOOM_CHECK(target_repeat >= 1 && B % target_repeat == 0, "LatentMIM: %d samples are not %d repeats of one batch",
             B, target_repeat);
  const int Bt = B / target_repeat;  // the target's own samples
  // the images are cut into patches once, for both encoders (and let go before the loss)
  Tensor patches = encoder.patches(v.images);
  // the predictor's offsets (and the target's, where it runs on fewer samples); made here, on
  // the main stream, before a side branch can ask for them
  SeqInfo rows = SeqInfo::dense(B, N, patches.device());
  if (Bt != B) SeqInfo::dense(Bt, N, patches.device());
  auto target_forward = [&] {
    NoGradGuard ng;
    // [B, N-K, D]: its last block on those tokens alone; with repeats, the blocks before it on
    // the first Bt samples, whose hidden states the last block's repeats share
    Tensor tp = Bt == B ? patches : narrow(patches, 0, 0, Bt);
    return target.forward_patches(tp, Tensor(), v.masked, target_repeat);
  };
  // The target's forward needs nothing of this step's encoder or predictor: on CUDA it runs on
  // the side stream (target_side_stream), beside them, and the main stream waits for it before
  // the loss (a side branch: allocator.cu); `patches`, which the side stream reads, lives until
  // that wait. On the side stream attention runs loom's kernels (cuDNN's plans keep state of
  // their own), so with train.attention = cudnn the target stays on the main stream; with
  // --train.profile too, so that its ops' times are their own.
  const bool side = target_side_stream && patches.device() == Device::CUDA && !cuda::side_scope_active() &&
                    !profile_enabled() && cuda::attention_backend() != cuda::AttentionBackend::Cudnn;
  Tensor t;
  if (side) {
    if (!side_fork_) {
      side_fork_ = cuda::event_create();
      side_join_ = cuda::event_create();
    }
    cuda::side_branch_fork(side_fork_);
    try {
      t = target_forward();
    } catch (...) {
      cuda::side_branch_end(side_join_);
      throw;
    }
    cuda::side_branch_end(side_join_);
  }
  Tensor z = encoder.forward_patches(patches, v.keep);  // [B, K, D]
  if (!side) {
    t = target_forward();
    patches = Tensor();
  }
  profile_phase("EMA target forward (no grad)");  // records no op: its own row in the profile
  // sync-free unmask: scatter the visible tokens into a full sequence of mask tokens
  Tensor full = expand(mask_token, {B, N, cfg.pred_dim});
  full = scatter_rows(full, v.keep, pred_in.forward(z));
  Tensor x = add(full, pred_pos);
  // (masked: a permutation's tail, distinct per sample); the last block, the norm and pred_out
  // run on the masked tokens alone
  Tensor p = pred_out.forward(vit_stack(pred_blocks, pred_norm, x, rows, checkpoint_blocks, v.masked));
  if (z_out) *z_out = z;
  if (side) {
    cuda::side_branch_join(side_join_);
    patches = Tensor();
  }
  // bf16 goes in as it is: the kernel's two products run on bf16 tensor cores with fp32
  // accumulation and its softmax and loss are fp32 (the reference's autocast bmm rounds the
  // normalized rows to bf16 as well). f16 goes up to f32: its gradient here is ~1/(B M) small,
  // below f16's normal range.
  const bool up = p.dtype() == DType::F16;
  Tensor pa = up ? cast(p, DType::F32) : p;
  Tensor ta = up ? t.to(DType::F32) : t;
  return patch_disc_loss(pa, ta, cfg.tau);
}

// Views of one shape stacked along the batch (no gradient flows into images or indices).
static Tensor stack_batch(const std::vector<Tensor>& xs) {
  Shape s = xs[0].shape();
  const int64_t n = s[0];
  s[0] = n * int64_t(xs.size());
  Tensor out = Tensor::empty(s, xs[0].dtype(), xs[0].device());
  for (size_t i = 0; i < xs.size(); i++) out.narrow(0, int64_t(i) * n, n).copy_(xs[i]);
  return out;
}

// Whether a and b are views of the same elements (one storage, offset, shape and strides).
static bool same_elements(const Tensor& a, const Tensor& b) {
  return a.defined() && b.defined() && a.impl()->storage == b.impl()->storage && a.offset() == b.offset() &&
         a.shape() == b.shape() && a.strides() == b.strides() && a.dtype() == b.dtype();
}

Tensor LatentMIM::forward(const std::vector<MIMView>& views) const {
  LOOM_CHECK(!views.empty() && (!cfg.contrastive || views.size() == 2),
             "LatentMIM: %zu views (the contrastive variant needs exactly 2)", views.size());
  // Views of one shape run as one batch of V*B samples: every op of view_loss is per sample
  // except the patch-discrimination mean, and over V parts of equal size the mean of all
  // predictions is the mean of the views' means. One pass of twice the rows instead of two:
  // half the launches, and products with twice M fill the GPU's waves better.
  bool one_batch = batch_views && views.size() > 1;
  for (auto& v : views)
    one_batch = one_batch && v.images.shape() == views[0].images.shape() && v.keep.shape() == views[0].keep.shape() &&
                v.masked.shape() == views[0].masked.shape() && !v.images.requires_grad();
  // The target's work is shared where the views are the same images (the same tensor): the
  // trainer's masked views of each image. Not for views whose images merely look alike.
  bool same_images = shared_target;
  for (auto& v : views) same_images = same_images && same_elements(v.images, views[0].images);
  std::vector<Tensor> pooled;
  auto pool = [&](const Tensor& z) {
    Tensor za = (z.dtype() == DType::BF16 || z.dtype() == DType::F16) ? cast(z, DType::F32) : z;
    return l2_normalize(mean_pool(za));
  };
  Tensor loss;
  if (one_batch) {
    std::vector<Tensor> im, keep, masked;
    for (auto& v : views) {
      im.push_back(v.images);
      keep.push_back(v.keep);
      masked.push_back(v.masked);
    }
    Tensor z;
    loss = view_loss({stack_batch(im), stack_batch(keep), stack_batch(masked)}, &z,
                     same_images ? int(views.size()) : 1);
    if (cfg.contrastive) {
      Tensor p = pool(z);  // [V*B, D]; the pooling is per sample as well
      const int64_t B = views[0].keep.size(0);
      for (size_t i = 0; i < views.size(); i++) pooled.push_back(narrow(p, 0, int64_t(i) * B, B));
    }
  } else {
    for (auto& v : views) {
      Tensor z;
      Tensor l = view_loss(v, &z);
      loss = loss.defined() ? add(loss, l) : l;
      if (cfg.contrastive) pooled.push_back(pool(z));
    }
    loss = scale(loss, 1.0 / double(views.size()));
  }
  if (cfg.contrastive) {
    if (gather_pooled)
      for (Tensor& p : pooled) p = gather_pooled(p);
    loss = add(loss, scale(infonce_loss(pooled[0], pooled[1], cfg.tau), cfg.contrastive_weight));
  }
  return loss;
}

}  // namespace loom
