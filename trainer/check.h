// check.h: `./train check FILE [--device cpu|cuda]`: rebuild a model from a fixture's
// metadata, run forward and backward, print loss and every gradient's relative error
// ||got - ref|| / ||ref||, and fail past the tolerance.
#pragma once
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace loom {

struct CheckRow {
  std::string name;
  long long numel;
  double err_norm, ref_norm;  // ||got - ref||, ||ref||
  double max_abs = 0;         // max |got - ref| over the elements
  double rel_err = 0;         // err_norm / ref_norm (see finalize_rows for ~zero references)
  bool vs_largest = false;
};
CheckRow make_row(const std::string& name, const Tensor& got, const Tensor& ref);

struct CheckResult {
  std::string kind;  // "mim", "vlm", "llama", "siglip"
  std::vector<CheckRow> rows;
  double tolerance = 0, worst = 0;
  bool ok() const { return worst <= tolerance; }
};

// path: a .safetensors fixture (mim_*, vlm_*) or an HF model folder with golden.safetensors.
// device "cpu" runs in f64 (tolerance 1e-6), "cuda" in f32.
CheckResult run_check(const std::string& path, const std::string& device);
int check_command(int argc, char** argv);

// HF folders (check_hf.cpp): llama (logits, loss, gradients) and siglip (last hidden state,
// gradients of sum(h * R) including the pixels)
CheckResult check_hf_folder(const std::string& dir, int device, int dtype);

}  // namespace loom
