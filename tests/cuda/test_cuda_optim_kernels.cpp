// test_cuda_optim_kernels.cpp: kernels/cuda/optim.cu (adamw, sgd, ema, grad norm, step control)
// against the loom::cpu reference, f32 and bf16 (tests/cuda/cuda_kernel_test_util.h). Skipped
// without a GPU.
//   bash tools/gpu-kernels.sh tests/cuda/test_cuda_optim_kernels.cpp
#include <catch2/catch.hpp>

#include "kernels/kernels.h"
#include "tests/tolerances.h"

#include "tests/cuda/cuda_kernel_test_util.h"

TEMPLATE_TEST_CASE("optim: adamw, sgd, ema with f32 and bf16 gradients/copies", "[optim]", float, bf16, f16) {
  need_gpu();
  using G = TestType;
  for (int64_t n : {1, 1001, 4096}) {
    for (bool scaled : {false, true}) {
      INFO("n " << n << " step control " << scaled);
      auto hp = rnd(n, 110), hm = rnd(n, 111, -0.1f, 0.1f), hv = rnd(n, 112, 0.f, 0.01f);
      auto hg = rounded<G>(rnd(n, 113));
      // step control: gradient scale, applied, t = 3, lr x 0.5 (h.lr is then the group factor)
      std::vector<float> scale = {0.37f, 1.f, 3.f, 0.5f};
      DBuf<float> p(hp), m(hm), v(hv), sc(scale);
      DBuf<G> g(hg), copy(n);
      loom::AdamWHyper h;
      h.lr = 1e-2f; h.beta1 = 0.9f; h.beta2 = 0.95f; h.eps = 1e-8f; h.weight_decay = 0.1f; h.step = 3;
      std::vector<float> rp = hp, rm = hm, rv = hv, rc(n);
      cpu::adamw_update(rp.data(), rc.data(), rm.data(), rv.data(), hg.data(), scaled ? scale.data() : nullptr, n, h, nullptr);
      cu::adamw_update(p.p, copy.p, m.p, v.p, g.p, scaled ? sc.p : nullptr, n, h, S());
      CHECK_CLOSE(p.get(), rp, tol::kCudaF32, "adamw master");
      CHECK_CLOSE(m.get(), rm, tol::kCudaF32, "adamw m");
      CHECK_CLOSE(v.get(), rv, tol::kCudaF32, "adamw v");
      CHECK_CLOSE(copy.get(), rc, tol_of<G>(), "adamw copy");

      DBuf<float> p2(hp), buf(hm);
      std::vector<float> rp2 = hp, rbuf = hm;
      cpu::sgd_update(rp2.data(), rc.data(), rbuf.data(), hg.data(), scaled ? scale.data() : nullptr, n, 0.05f, 0.9f, 0.01f, nullptr);
      copy.poison();
      cu::sgd_update(p2.p, copy.p, buf.p, g.p, scaled ? sc.p : nullptr, n, 0.05f, 0.9f, 0.01f, S());
      CHECK_CLOSE(p2.get(), rp2, tol::kCudaF32, "sgd master");
      CHECK_CLOSE(buf.get(), rbuf, tol::kCudaF32, "sgd buf");
      CHECK_CLOSE(copy.get(), rc, tol_of<G>(), "sgd copy");

      DBuf<float> tgt(hm), src(hp);
      std::vector<float> rt = hm;
      cpu::ema_update(rt.data(), rc.data(), hp.data(), scaled ? scale.data() : nullptr, n, 0.996, nullptr);
      copy.poison();
      cu::ema_update(tgt.p, copy.p, src.p, scaled ? sc.p : nullptr, n, 0.996, S());
      CHECK_CLOSE(tgt.get(), rt, tol::kCudaF32, "ema target");
      CHECK_CLOSE(copy.get(), rc, tol_of<G>(), "ema copy");

      // a skipped step (ctl[1] == 0) writes nothing, in every update
      DBuf<float> skip(std::vector<float>{1.f, 0.f, 3.f, 1.f});
      auto p_before = p.get(), p2_before = p2.get(), t_before = tgt.get();
      cu::adamw_update(p.p, copy.p, m.p, v.p, g.p, skip.p, n, h, S());
      cu::sgd_update(p2.p, copy.p, buf.p, g.p, skip.p, n, 0.05f, 0.9f, 0.01f, S());
      cu::ema_update(tgt.p, copy.p, src.p, skip.p, n, 0.996, S());
      CHECK(p.get() == p_before);
      CHECK(p2.get() == p2_before);
      CHECK(tgt.get() == t_before);
    }
  }
}

TEMPLATE_TEST_CASE("optim: grad norm (+=, deterministic) and step control", "[optim]", float, bf16, f16) {
  need_gpu();
  using G = TestType;
  for (int64_t n : {1, 777, 1000003}) {
    auto hg = rounded<G>(rnd(n, 120 + n));
    DBuf<G> g(hg);
    double ref = 1.5;  // out starts at 1.5: the kernel adds
    for (float x : hg) ref += double(x) * x;
    std::vector<float> first;
    for (int rep = 0; rep < 2; rep++) {
      DBuf<float> out(std::vector<float>{1.5f});
      cu::grad_norm_squared(out.p, g.p, n, S());
      auto o = out.get();
      CHECK_CLOSE(o, std::vector<double>{ref}, tol::kCudaF32, "grad_norm_squared");
      if (rep == 0) first = o;
      else CHECK(o == first);
    }
  }
  for (float nsq : {0.25f, 4.f, 1e6f, NAN}) {
    for (float loss : {1.5f, INFINITY}) {
      DBuf<float> ctl(std::vector<float>{0.f, 0.f, 5.f, 0.1f}), norm(1), ns(std::vector<float>{nsq}),
          dl(std::vector<float>{loss});
      cu::step_control(ctl.p, norm.p, ns.p, dl.p, 1.0f, nullptr, 0, S());
      float rc[4] = {0.f, 0.f, 5.f, 0.1f}, rn = 0;
      cpu::step_control(rc, &rn, &nsq, &loss, 1.0f, nullptr, 0, nullptr);
      auto c = ctl.get();
      INFO("norm_sq " << nsq << " loss " << loss);
      CHECK(c[1] == rc[1]);
      CHECK(c[2] == rc[2]);
      CHECK(c[3] == rc[3]);
      if (std::isfinite(nsq)) {
        CHECK_CLOSE(std::vector<float>{c[0]}, std::vector<float>{rc[0]}, tol::kCudaF32, "clip scale");
        CHECK_CLOSE(norm.get(), std::vector<float>{rn}, tol::kCudaF32, "norm");
      }
    }
  }
}
