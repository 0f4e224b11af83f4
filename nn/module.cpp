// module.cpp: parameter registry and the basic layers.
#include "nn/module.h"

#include <cmath>

namespace loom {

Tensor Init::normal(const Shape& s, double std) const {
  LOOM_CHECK(rng, "Init: no random generator");
  return Tensor::randn(s, *rng, std, dtype, device).requires_grad_();
}

std::vector<std::pair<std::string, Tensor*>> Module::named_parameters(const std::string& prefix) {
  std::vector<std::pair<std::string, Tensor*>> out;
  for (auto& [n, t] : params_) out.push_back({prefix + n, t});
  for (auto& [n, m] : children_) {
    auto sub = m->named_parameters(prefix + n + ".");
    out.insert(out.end(), sub.begin(), sub.end());
  }
  return out;
}

std::map<std::string, Tensor> Module::state_dict() {
  std::map<std::string, Tensor> sd;
  for (auto& [n, t] : named_parameters()) sd[n] = *t;
  return sd;
}

void Module::load_state_dict(const std::map<std::string, Tensor>& sd, const std::string& source, bool strict_unused) {
  size_t used = 0;
  for (auto& [n, t] : named_parameters()) {
    auto it = sd.find(n);
    LOOM_CHECK(it != sd.end(), "%s: missing parameter '%s' (expected %s)", source.c_str(), n.c_str(),
               shape_str(t->shape()).c_str());
    LOOM_CHECK(it->second.shape() == t->shape(), "%s: parameter '%s' has shape %s, the model expects %s",
               source.c_str(), n.c_str(), shape_str(it->second.shape()).c_str(), shape_str(t->shape()).c_str());
    // copy into the existing slot: it may be a view into an optimizer's flat buffer
    t->copy_(it->second);
    used++;
  }
  if (strict_unused && used != sd.size()) {
    auto names = named_parameters();
    for (auto& [k, v] : sd) {
      bool found = false;
      for (auto& [n, t] : names) found |= n == k;
      LOOM_CHECK(found, "%s: unexpected parameter '%s' %s (not in the model)", source.c_str(), k.c_str(),
                 shape_str(v.shape()).c_str());
    }
  }
}

int64_t Module::num_parameters() {
  int64_t n = 0;
  for (auto& [name, t] : named_parameters()) n += t->numel();
  return n;
}

void Module::requires_grad_(bool on) {
  for (auto& [name, t] : named_parameters()) t->requires_grad_(on);
}

// GPT-2 style initialization: N(0, 0.02) weights, zero biases, unit norm gains.
Linear::Linear(int in, int out, bool has_bias, const Init& init) {
  weight = init.normal({out, in}, 0.02);
  param("weight", weight);
  if (has_bias) {
    bias = init.zeros({out});
    param("bias", bias);
  }
}

LayerNorm::LayerNorm(int dim, double eps_, const Init& init) : eps(eps_) {
  weight = init.ones({dim});
  bias = init.zeros({dim});
  param("weight", weight);
  param("bias", bias);
}

RMSNorm::RMSNorm(int dim, double eps_, const Init& init) : eps(eps_) {
  weight = init.ones({dim});
  param("weight", weight);
}

}  // namespace loom
