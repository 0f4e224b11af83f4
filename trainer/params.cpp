// params.cpp: the model's parameters as the config asks for them (see run.h): the [model] and
// [train] keys as structs, freezing by name prefix, the optimizer's parameter groups, the
// frozen parameters cast to the compute dtype, and the one-line summary.
#include <cstdio>
#include <sstream>

#include "trainer/run.h"

namespace loom {

void freeze_prefixes(Module& m, const std::string& prefixes) {
  if (prefixes.empty()) return;
  std::vector<std::string> ps;
  std::stringstream ss(prefixes);
  std::string p;
  while (std::getline(ss, p, ','))
    if (!p.empty()) ps.push_back(p);
  for (auto& [name, t] : m.named_parameters())
    for (auto& pre : ps)
      if (name.rfind(pre, 0) == 0) t->requires_grad_(false);
}

std::vector<ParamGroup> param_groups_from(Module& m, const Config& cfg) {
  double wd = cfg.get_float("train.weight_decay"), ewd = cfg.get_float("train.embeddings_weight_decay");
  if (ewd < 0) ewd = wd;
  double s_emb = cfg.get_float("train.lr_scale_embeddings"), s_proj = cfg.get_float("train.lr_scale_projector"),
         s_norm = cfg.get_float("train.lr_scale_norms");
  auto has = [](const std::string& n, const char* part) { return n.find(part) != std::string::npos; };
  // With every factor at its default the four groups collapse to two (decay: all matrices,
  // embeddings and the projector; no decay: 1-D), in parameter order, so runs made before the
  // groups existed reproduce bit for bit.
  bool split = s_emb != 1.0 || s_proj != 1.0 || s_norm != 1.0 || ewd != wd;
  std::vector<ParamGroup> g;
  if (split) {
    g = {{"matrices", 1.0, wd, {}}, {"embeddings", s_emb, ewd, {}}, {"projector", s_proj, wd, {}}, {"norms", s_norm, 0.0, {}}};
  } else {
    g = {{"decay", 1.0, wd, {}}, {"no_decay", 1.0, 0.0, {}}};
  }
  for (auto& [name, t] : m.named_parameters()) {
    if (!t->requires_grad()) continue;
    size_t i;
    if (!split) i = t->dim() >= 2 ? 0 : 1;
    else if (has(name, "embed_tokens") || has(name, "pos_embed") || has(name, "pred_pos") || has(name, "mask_token")) i = 1;
    else if (name.rfind("projector.", 0) == 0) i = 2;
    else if (t->dim() < 2) i = 3;
    else i = 0;
    g[i].params.push_back({name, t});
  }
  return g;
}

ViTConfig vit_config_from(const Config& cfg) {
  ViTConfig c;
  c.image_size = cfg.get_int("model.image_size");
  c.patch_size = cfg.get_int("model.patch_size");
  c.channels = cfg.get_int("model.channels");
  c.dim = cfg.get_int("model.vit_dim");
  c.depth = cfg.get_int("model.vit_depth");
  c.heads = cfg.get_int("model.vit_heads");
  c.mlp_ratio = cfg.get_int("model.vit_mlp_ratio");
  c.pos_init = cfg.get_str("model.pos_init");
  return c;
}

OptimConfig optim_config_from(const Config& cfg) {
  OptimConfig oc;
  oc.kind = cfg.get_str("train.optimizer");
  oc.beta1 = cfg.get_float("train.beta1");
  oc.beta2 = cfg.get_float("train.beta2");
  oc.eps = cfg.get_float("train.eps");
  oc.momentum = cfg.get_float("train.momentum");
  return oc;
}

void pack_like_optimizer(Module& m, const Config& cfg, DType dtype) {
  for (auto& g : param_groups_from(m, cfg)) {
    int64_t n = 0;
    for (auto& [name, t] : g.params) n += t->numel();
    if (n == 0) continue;
    Tensor flat = Tensor::empty({n}, dtype, g.params[0].second->device());
    int64_t off = 0;
    for (auto& [name, t] : g.params) {
      Tensor v = flat.narrow(0, off, t->numel()).view(t->shape());
      v.copy_(*t);
      const bool rg = t->requires_grad();
      *t = v;
      t->requires_grad_(rg);
      off += t->numel();
    }
  }
}

void cast_frozen(Module& m, DType compute) {
  for (auto& [name, t] : m.named_parameters())
    if (!t->requires_grad() && t->dtype() != compute) *t = t->to(compute);
}

std::string describe_params(Module& m) {
  int64_t total = 0, trained = 0;
  for (auto& [n, t] : m.named_parameters()) {
    total += t->numel();
    if (t->requires_grad()) trained += t->numel();
  }
  char b[160];
  std::snprintf(b, sizeof b, "parameters: %.3fM total, %.3fM trained", double(total) / 1e6, double(trained) / 1e6);
  return b;
}

}  // namespace loom
