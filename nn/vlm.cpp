// vlm.cpp: the vision-language model (SPEC §1 VLM).
#include "nn/vlm.h"

#include <algorithm>

namespace loom {

VLM::VLM(const VLMConfig& c, const Init& init)
    : cfg(c), vision(c.vit, init), projector(c.vit.dim * c.shuffle * c.shuffle, c.lm.dim, false, init), lm(c.lm, init) {
  child("vision", vision);
  child("projector", projector);
  child("lm", lm);
}

Tensor VLM::vision_features(const Tensor& images) const { return pixel_shuffle(vision.forward(images), cfg.shuffle); }

static Tensor project(const Linear& projector, const Tensor& features) {
  Tensor t = projector.forward(features);  // [Bi, Ti, D]
  return reshape(t, {t.size(0) * t.size(1), t.size(2)});
}

Tensor VLM::image_embeddings(const Tensor& images) const { return project(projector, vision_features(images)); }

Tensor VLM::embed(const VLMBatch& b, const Tensor& features) const {
  int64_t N = b.ids.numel();
  Tensor x = embedding(b.ids, lm.embed_tokens);  // [Ntok, D]
  if (!b.images.defined() || b.images.size(0) == 0) return x;
  if (features.defined())
    LOOM_CHECK(features.dim() == 3 && features.size(0) == b.images.size(0),
               "VLM: vision features %s for %lld images", features.desc().c_str(), (long long)b.images.size(0));
  Tensor img = features.defined() ? project(projector, features) : image_embeddings(b.images);
  int64_t M = img.size(0), D = img.size(1);
  LOOM_CHECK(b.image_positions.numel() == M, "VLM: %lld image-token positions for %lld image tokens (%lld images)",
             (long long)b.image_positions.numel(), (long long)M, (long long)b.images.size(0));
  Tensor full = scatter_rows(reshape(x, {1, N, D}), reshape(b.image_positions, {1, M}), reshape(img, {1, M, D}));
  return reshape(full, {N, D});
}

void loss_rows_of(const std::vector<int32_t>& targets, std::vector<int32_t>& rows, std::vector<int32_t>& kept,
                  int64_t multiple) {
  LOOM_CHECK(multiple >= 1, "loss_rows_of: multiple %lld (>= 1)", (long long)multiple);
  rows.clear();
  kept.clear();
  const int64_t n = int64_t(targets.size());
  int64_t with = 0;
  for (int32_t t : targets) with += t >= 0;
  const int64_t want = std::min(n, (with + multiple - 1) / multiple * multiple);
  int64_t extra = want - with;  // rows without a target taken, from the last one back
  std::vector<char> take(size_t(n), 0);
  for (int64_t i = n - 1; i >= 0 && extra > 0; i--)
    if (targets[size_t(i)] < 0) take[size_t(i)] = 1, extra--;
  for (int64_t i = 0; i < n; i++)
    if (targets[size_t(i)] >= 0 || take[size_t(i)]) {
      rows.push_back(int32_t(i));
      kept.push_back(targets[size_t(i)] >= 0 ? targets[size_t(i)] : -1);
    }
}

void set_loss_rows(VLMBatch& b, const std::vector<int32_t>& targets, Device device) {
  std::vector<int32_t> rows, kept;
  loss_rows_of(targets, rows, kept);
  b.loss_rows = Tensor::from_vector(rows, {int64_t(rows.size())}, device);
  b.loss_targets = Tensor::from_vector(kept, {int64_t(kept.size())}, device);
}

Tensor VLM::loss(const VLMBatch& b, const Tensor& features) const {
  Tensor h = lm.hidden(embed(b, features), b.pos, b.seq);
  // Only the rows with a target go through the tied head: the mean over them is the same
  // number, and image, prompt and padding rows (about a sixth of bench_vlm_sft's rows) cost no [., V]
  // products. The row list comes from the host with the batch: no count read back.
  const int64_t N = h.size(0), K = b.loss_rows.defined() ? b.loss_rows.numel() : -1;
  if (K > 0 && K < N) {
    LOOM_CHECK(b.loss_targets.defined() && b.loss_targets.numel() == K, "VLM: %lld loss rows with %s targets",
               (long long)K, b.loss_targets.desc().c_str());
    const int64_t D = h.size(1);
    Tensor hk = reshape(gather_rows(reshape(h, {1, N, D}), reshape(b.loss_rows, {1, K}), /*distinct=*/true), {K, D});
    return lm.loss(hk, b.loss_targets);
  }
  return lm.loss(h, b.targets);
}

}  // namespace loom
