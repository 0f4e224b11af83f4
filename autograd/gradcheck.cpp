// gradcheck.cpp: central differences through the autograd op (see gradcheck.h).
#include "autograd/gradcheck.h"

#include <cmath>

#include "autograd/ops.h"

namespace loom {

GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                          const std::vector<Tensor>& inputs, double eps, double atol, double rtol, uint64_t seed) {
  for (auto& t : inputs)
    LOOM_CHECK(!t.requires_grad() || (t.dtype() == DType::F64 && t.device() == Device::CPU),
               "gradcheck: differentiable inputs must be f64 on the CPU, got %s", t.desc().c_str());
  // the scalar objective: sum(f(x) * R)
  Tensor R;
  auto objective = [&](const std::vector<Tensor>& in) -> Tensor {
    Tensor y = f(in);
    if (y.numel() == 1) return reshape(y, {1});  // the recorded op: a raw view would drop the graph
    if (!R.defined()) {
      Rng rng(seed);
      R = Tensor::randn(y.shape(), rng, 1.0, y.dtype(), y.device());
    }
    return sum(mul(y, R));
  };
  // analytic
  for (auto& t : inputs)
    if (t.requires_grad()) t.impl()->grad.reset();
  Tensor loss = objective(inputs);
  backward(loss);
  GradcheckResult res;
  char buf[512];
  for (size_t i = 0; i < inputs.size(); i++) {
    const Tensor& x = inputs[i];
    if (!x.requires_grad()) continue;
    Tensor ga = x.grad().defined() ? x.grad() : Tensor::zeros_like(x);
    std::vector<double> analytic = ga.to_vector<double>();
    double* xp = x.data<double>();
    LOOM_CHECK(x.is_contiguous(), "gradcheck: input %zu must be contiguous", i);
    int bad = 0;
    for (int64_t j = 0; j < x.numel(); j++) {
      double old = xp[j];
      double lp, lm;
      {
        NoGradGuard ng;
        xp[j] = old + eps;
        lp = objective(inputs).item();
        xp[j] = old - eps;
        lm = objective(inputs).item();
        xp[j] = old;
      }
      double numeric = (lp - lm) / (2 * eps);
      double lim = atol + rtol * std::fabs(numeric);
      double ratio = std::fabs(analytic[size_t(j)] - numeric) / lim;
      if (!(ratio <= 1.0)) {
        res.ok = false;
        if (bad++ < 5) {
          std::snprintf(buf, sizeof buf, "  input %zu %s element %lld: analytic %.10g numeric %.10g\n", i,
                        shape_str(x.shape()).c_str(), (long long)j, analytic[size_t(j)], numeric);
          res.report += buf;
        }
      }
      if (!(ratio <= res.worst)) res.worst = ratio;
    }
    x.impl()->grad.reset();
  }
  std::snprintf(buf, sizeof buf, "gradcheck %s: worst |analytic-numeric|/(atol+rtol|numeric|) = %.3g\n",
                res.ok ? "passed" : "FAILED", res.worst);
  res.report = buf + res.report;
  return res;
}

}  // namespace loom
