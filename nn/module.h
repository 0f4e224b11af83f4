// module.h: modules with named parameters (names = the PyTorch reference's state-dict names,
// SPEC §1), and the basic layers. A Module owns Tensor slots; named_parameters() returns
// pointers to them, so a trainer can swap a slot for a bf16 compute copy, or an optimizer
// can point it into a flat buffer, without the module knowing.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "autograd/ops.h"
#include "tensor/safetensors.h"

namespace loom {

// How new parameters are made: dtype, device and the random stream.
struct Init {
  DType dtype = DType::F32;
  Device device = Device::CPU;
  Rng* rng = nullptr;
  Tensor normal(const Shape& s, double std) const;
  Tensor zeros(const Shape& s) const { return Tensor::zeros(s, dtype, device).requires_grad_(); }
  Tensor ones(const Shape& s) const { return Tensor::full(s, 1.0, dtype, device).requires_grad_(); }
};

class Module {
 public:
  virtual ~Module() = default;
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // every parameter, depth first, as "child.sub.name"
  std::vector<std::pair<std::string, Tensor*>> named_parameters(const std::string& prefix = "");
  std::map<std::string, Tensor> state_dict();
  // Copies values by name (converted to each slot's dtype/device). Strict: every parameter
  // must be present with its shape, and (when strict_unused) every entry must be used; errors
  // name the parameter and the source.
  void load_state_dict(const std::map<std::string, Tensor>& sd, const std::string& source,
                       bool strict_unused = true);
  int64_t num_parameters();
  void requires_grad_(bool on);

  // registration (public so plain containers such as "blocks" need no subclass)
  void param(const std::string& name, Tensor& slot) { params_.push_back({name, &slot}); }
  void child(const std::string& name, Module& m) { children_.push_back({name, &m}); }

 private:
  std::vector<std::pair<std::string, Tensor*>> params_;
  std::vector<std::pair<std::string, Module*>> children_;
};

class Linear : public Module {
 public:
  Linear(int in, int out, bool bias, const Init& init);
  Tensor forward(const Tensor& x) const { return linear(x, weight, bias); }
  Tensor weight, bias;
};

class LayerNorm : public Module {
 public:
  LayerNorm(int dim, double eps, const Init& init);
  Tensor forward(const Tensor& x) const { return layernorm(x, weight, bias, eps); }
  Tensor weight, bias;
  double eps;
};

class RMSNorm : public Module {
 public:
  RMSNorm(int dim, double eps, const Init& init);
  Tensor forward(const Tensor& x) const { return rmsnorm(x, weight, eps); }
  Tensor weight;
  double eps;
};

}  // namespace loom
