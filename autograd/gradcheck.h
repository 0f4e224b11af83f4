// gradcheck.h: compare autograd gradients with central differences, in double, on the CPU.
//
//   auto r = gradcheck([](const std::vector<Tensor>& in) { return layernorm(in[0], in[1], in[2], 1e-5); },
//                      {x, w, b});
//   REQUIRE(r.ok);  // r.report says which input and element disagreed, and by how much
//
// A non-scalar output y is reduced to sum(y * R) with a fixed random R, so every output
// element's gradient is exercised. Inputs that do not require grad (indices, targets) are
// passed through untouched.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "autograd/autograd.h"

namespace loom {

struct GradcheckResult {
  bool ok = true;
  double worst = 0;  // largest |analytic - numeric| / (atol + rtol |numeric|)
  std::string report;
};

GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                          const std::vector<Tensor>& inputs, double eps = 1e-6, double atol = 1e-5,
                          double rtol = 1e-3, uint64_t seed = 1234);

}  // namespace loom
