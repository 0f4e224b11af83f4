// test_cpu_optim.cpp: kernels/cpu/optim.cpp (AdamW, SGD, EMA, grad norm and step control) against
// naive formulas written here, and its gradients against central differences in double
// (tests/cpu_loss_test_util.h).
#include <catch2/catch.hpp>

#include "kernels/kernels.h"
#include "tests/tolerances.h"

#include "tests/cpu_loss_test_util.h"

TEST_CASE("adamw_update: 3 steps equal torch.optim.AdamW's formula", "[cpu][optim]") {
  const int64_t n = 37;
  AdamWHyper hp;
  hp.lr = 3e-3f, hp.beta1 = 0.9f, hp.beta2 = 0.95f, hp.eps = 1e-8f, hp.weight_decay = 0.1f;
  for (bool with_scale_and_copy : {true, false}) {
    const std::string tag = with_scale_and_copy ? "adamw scale+copy" : "adamw plain";
    auto master = randn(n, 700), m = vector<double>(n, 0.0), v = vector<double>(n, 0.0);
    auto ref_p = master, ref_m = m, ref_v = m;
    vector<float> master32 = cast<float>(master), m32(n, 0.0f), v32(n, 0.0f);
    const float scale = 0.5f;
    for (int step = 1; step <= 3; step++) {
      hp.step = step;
      const auto grad = randn(n, 710 + step, 2.0);
      // the reference: torch.optim.AdamW written out in double
      const double s = with_scale_and_copy ? double(scale) : 1.0;
      const double lr = hp.lr, b1 = hp.beta1, b2 = hp.beta2, eps = hp.eps, wd = hp.weight_decay;
      for (int64_t i = 0; i < n; i++) {
        const double g = grad[i] * s;
        ref_m[i] = b1 * ref_m[i] + (1 - b1) * g;
        ref_v[i] = b2 * ref_v[i] + (1 - b2) * g * g;
        const double mhat = ref_m[i] / (1 - std::pow(b1, step)), vhat = ref_v[i] / (1 - std::pow(b2, step));
        ref_p[i] -= lr * (wd * ref_p[i] + mhat / (std::sqrt(vhat) + eps));
      }
      auto copy = poisoned<double>(n);
      // with the device step control: scale, applied, t (the host's h.step is then ignored), lr x 1
      const float ctl[4] = {scale, 1.0f, float(step), 1.0f};
      if (with_scale_and_copy) hp.step = -7;
      cpu::adamw_update<double, double>(master.data(), with_scale_and_copy ? copy.data() : nullptr, m.data(),
                                        v.data(), grad.data(), with_scale_and_copy ? ctl : nullptr, n, hp, s0);
      const auto grad32 = cast<float>(grad);
      auto copy32 = poisoned<float>(n);
      cpu::adamw_update<float, float>(master32.data(), with_scale_and_copy ? copy32.data() : nullptr, m32.data(),
                                      v32.data(), grad32.data(), with_scale_and_copy ? ctl : nullptr, n, hp, s0);
      // a skipped step (ctl[1] == 0) writes nothing
      const float skip[4] = {1.0f, 0.0f, float(step), 1.0f};
      auto before = master;
      cpu::adamw_update<double, double>(master.data(), nullptr, m.data(), v.data(), grad.data(), skip, n, hp, s0);
      check_same(master, before, (tag + " skipped step").c_str());
      const std::string t = tag + " step " + std::to_string(step);
      LOOM_CHECK_CLOSE(tol::compare(master, ref_p, tol::kSameMathF64, (t + " master").c_str()));
      LOOM_CHECK_CLOSE(tol::compare(m, ref_m, tol::kSameMathF64, (t + " m").c_str()));
      LOOM_CHECK_CLOSE(tol::compare(v, ref_v, tol::kSameMathF64, (t + " v").c_str()));
      LOOM_CHECK_CLOSE(tol::compare(master32, ref_p, tol::kCpuF32, (t + " f32 master").c_str()));
      if (with_scale_and_copy) {
        check_same(copy, master, (t + " copy").c_str());
        check_same(copy32, master32, (t + " f32 copy").c_str());
      } else {
        for (double c : copy) REQUIRE(std::isnan(c));  // copy == null: untouched
      }
    }
  }
}

TEST_CASE("sgd_update with momentum and decoupled weight decay, 3 steps", "[cpu][optim]") {
  const int64_t n = 29;
  const float lr = 0.05f, mu = 0.9f, wd = 0.01f, scale = 0.25f;
  auto master = randn(n, 800), buf = vector<double>(n, 0.0);
  auto ref_p = master, ref_buf = buf;
  for (int step = 1; step <= 3; step++) {
    const auto grad = randn(n, 810 + step);
    for (int64_t i = 0; i < n; i++) {
      const double g = grad[i] * double(scale);
      ref_buf[i] = step == 1 ? g : double(mu) * ref_buf[i] + g;  // torch: buf = clone(g) on the first step
      ref_p[i] -= double(lr) * (ref_buf[i] + double(wd) * ref_p[i]);
    }
    auto copy = poisoned<double>(n);
    const float ctl[4] = {scale, 1.0f, float(step), 1.0f};
    cpu::sgd_update<double, double>(master.data(), copy.data(), buf.data(), grad.data(), ctl, n, lr, mu, wd, s0);
    LOOM_CHECK_CLOSE(tol::compare(master, ref_p, tol::kSameMathF64, "sgd master"));
    LOOM_CHECK_CLOSE(tol::compare(buf, ref_buf, tol::kSameMathF64, "sgd buf"));
    check_same(copy, master, "sgd copy");
  }
  // no momentum, no buffer, no scale: plain p -= lr (g + wd p)
  auto p0 = randn(n, 820);
  const auto g0 = randn(n, 821);
  auto ref0 = p0;
  for (int64_t i = 0; i < n; i++) ref0[i] -= double(lr) * (g0[i] + double(wd) * ref0[i]);
  cpu::sgd_update<double, double>(p0.data(), nullptr, nullptr, g0.data(), nullptr, n, lr, 0.0f, wd, s0);
  LOOM_CHECK_CLOSE(tol::compare(p0, ref0, tol::kSameMathF64, "sgd no momentum"));
}

TEST_CASE("ema_update: target = decay target + (1 - decay) source", "[cpu][optim]") {
  const int64_t n = 41;
  const double decay = 0.996;
  auto target = randn(n, 900);
  auto ref = target;
  auto target32 = cast<float>(target);
  for (int step = 0; step < 2; step++) {
    const auto source = randn(n, 910 + step);
    for (int64_t i = 0; i < n; i++) ref[i] = decay * ref[i] + (1 - decay) * source[i];
    auto copy = poisoned<double>(n);
    cpu::ema_update<double, double>(target.data(), copy.data(), source.data(), nullptr, n, decay, s0);
    const auto source32 = cast<float>(source);
    const float applied[4] = {1.0f, 1.0f, 1.0f, 1.0f}, skipped[4] = {1.0f, 0.0f, 1.0f, 1.0f};
    cpu::ema_update<float, float>(target32.data(), nullptr, source32.data(), applied, n, decay, s0);
    auto before = target32;
    cpu::ema_update<float, float>(target32.data(), nullptr, source32.data(), skipped, n, decay, s0);
    check_same(target32, before, "ema skipped with the optimizer");
    LOOM_CHECK_CLOSE(tol::compare(target, ref, tol::kSameMathF64, "ema target"));
    check_same(copy, target, "ema copy");
    LOOM_CHECK_CLOSE(tol::compare(target32, ref, tol::kCpuF32, "ema f32 target"));
  }
}

TEST_CASE("grad_norm_squared accumulates; step_control follows clip_grad_norm_ and skips non-finite steps", "[cpu][optim]") {
  const auto g1 = randn(100003, 1000), g2 = randn(17, 1001);
  double ref = 0.5;
  for (double x : g1) ref += x * x;
  for (double x : g2) ref += x * x;
  float out = 0.5f;  // += : a previous buffer's contribution stays
  cpu::grad_norm_squared<double>(&out, g1.data(), int64_t(g1.size()), s0);
  const auto g2f = cast<float>(g2);
  cpu::grad_norm_squared<float>(&out, g2f.data(), int64_t(g2f.size()), s0);
  LOOM_CHECK_CLOSE(tol::compare(&out, &ref, 1, tol::kCpuF32, "grad norm^2"));

  float ctl[4] = {NAN, NAN, 3.0f, 0.5f}, norm = NAN;
  const float norm_sq = 16.0f, loss = 2.5f, bad = INFINITY, nan_sq = NAN;
  cpu::step_control(ctl, &norm, &norm_sq, &loss, 1.0f, nullptr, 0, s0);
  CHECK(norm == 4.0f);
  CHECK(ctl[0] == 1.0f / (4.0f + 1e-6f));
  CHECK((ctl[1] == 1.0f && ctl[2] == 4.0f && ctl[3] == 0.5f));  // applied: t + 1; lr untouched
  cpu::step_control(ctl, &norm, &norm_sq, nullptr, 10.0f, nullptr, 0, s0);
  CHECK(ctl[0] == 1.0f);  // never scales up
  cpu::step_control(ctl, &norm, &norm_sq, nullptr, 0.0f, nullptr, 0, s0);
  CHECK(ctl[0] == 1.0f);  // max_norm <= 0: no clipping
  const float zero = 0.0f;
  cpu::step_control(ctl, &norm, &zero, nullptr, 1.0f, nullptr, 0, s0);
  CHECK(norm == 0.0f);
  CHECK((ctl[0] == 1.0f && ctl[2] == 7.0f));
  cpu::step_control(ctl, &norm, &norm_sq, &bad, 1.0f, nullptr, 0, s0);  // non-finite loss: skipped, t stays
  CHECK((ctl[1] == 0.0f && ctl[2] == 7.0f));
  cpu::step_control(ctl, &norm, &nan_sq, nullptr, 1.0f, nullptr, 0, s0);  // non-finite gradients: skipped
  CHECK((ctl[1] == 0.0f && ctl[2] == 7.0f && std::isnan(norm)));
  cpu::step_control(ctl, nullptr, nullptr, nullptr, 1.0f, nullptr, 0, s0);  // no norm: scale 1, applied
  CHECK((ctl[0] == 1.0f && ctl[1] == 1.0f && ctl[2] == 8.0f));

  // a loss scale S = 8: gradients 8x too large; norm and update scale come out unscaled
  float ls[2] = {8.0f, 0.0f};
  const float scaled_sq = 16.0f * 64.0f;  // the norm^2 of 8x gradients of norm 4
  cpu::step_control(ctl, &norm, &scaled_sq, &loss, 1.0f, ls, 2, s0);
  CHECK(norm == 4.0f);
  CHECK(ctl[0] == (1.0f / (4.0f + 1e-6f)) / 8.0f);
  CHECK((ctl[1] == 1.0f && ls[0] == 8.0f && ls[1] == 1.0f));
  cpu::step_control(ctl, &norm, &scaled_sq, &loss, 0.0f, ls, 2, s0);  // the 2nd good step in a row: S doubles
  CHECK((ctl[0] == 1.0f / 8.0f && ls[0] == 16.0f && ls[1] == 0.0f));
  cpu::step_control(ctl, &norm, &nan_sq, &loss, 1.0f, ls, 2, s0);  // overflow: skipped, S halves
  CHECK((ctl[1] == 0.0f && ls[0] == 8.0f && ls[1] == 0.0f));
  float floor_ls[2] = {1.0f, 5.0f};
  cpu::step_control(ctl, &norm, &nan_sq, &loss, 1.0f, floor_ls, 2, s0);
  CHECK((floor_ls[0] == 1.0f && floor_ls[1] == 0.0f));  // not below 1
  float top_ls[2] = {16777216.0f, 1.0f};
  cpu::step_control(ctl, &norm, &norm_sq, &loss, 1.0f, top_ls, 2, s0);
  CHECK((top_ls[0] == 16777216.0f && top_ls[1] == 0.0f));  // not above 2^24
}
