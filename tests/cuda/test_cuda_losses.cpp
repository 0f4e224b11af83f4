// test_cuda_losses.cpp: the CUDA cross-entropy, fused linear cross-entropy and contrastive
// losses (patch discrimination, InfoNCE) against the loom::cpu references, forward and
// backward, f32, bf16 and f16 (the fused loss with loss scaling).
//
// 16-bit runs round the same random f32 data to their type, give the rounded values (as f32)
// to the CPU, and compare with the type's tolerance. Every output is poisoned with NaN before
// the launch. Shapes reach every branch: N = 1, V > 1024, ignored targets, chunks that do not
// divide N. Exits with code 4 (ctest: skipped) when no GPU is present.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "tests/cuda/vec_test_util.h"

namespace {


// ---------------------------------------------------------------------------- cross-entropy
std::vector<int32_t> rand_targets(int64_t N, int V, std::mt19937& rng, double p_ignore) {
  std::uniform_int_distribution<int> d(0, V - 1);
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<int32_t> t(N);
  for (auto& x : t) x = u(rng) < p_ignore ? -100 : d(rng);
  return t;
}

template <class T>
void run_ce(int64_t N, int V, double p_ignore, uint32_t seed) {
  std::mt19937 rng(seed);
  auto x = randn(size_t(N) * V, rng, 3.f);
  auto xs = seen<T>(x);
  auto tg = rand_targets(N, V, rng, p_ignore);
  float loss_ref = 0, dloss = 0.7f;
  std::vector<float> lse_ref(N), dx_ref(size_t(N) * V);
  loom::cpu::cross_entropy_forward<float>(&loss_ref, lse_ref.data(), xs.data(), tg.data(), N, V, nullptr);
  loom::cpu::cross_entropy_backward<float>(dx_ref.data(), &dloss, xs.data(), lse_ref.data(), tg.data(), N, V, nullptr);
  Dev<T> dx_in(to_t<T>(x)), ddx(size_t(N) * V);
  Dev<int32_t> dt(tg);
  Dev<float> dl(1), dlse(N), ddl(std::vector<float>{dloss});
  dl.poison();
  dlse.poison();
  ddx.poison();
  cu::cross_entropy_forward<T>(dl.p, dlse.p, dx_in.p, dt.p, N, V, cu::default_stream());
  cu::cross_entropy_backward<T>(ddx.p, ddl.p, dx_in.p, dlse.p, dt.p, N, V, cu::default_stream());
  INFO(std::string(tname<T>()) + " N=" + std::to_string(N) + " V=" + std::to_string(V));
  LOOM_CHECK_CLOSE(tol::compare(dl.down(), std::vector<float>{loss_ref}, tol::kCudaF32, "ce loss"));
  LOOM_CHECK_CLOSE(tol::compare(dlse.down(), lse_ref, tol::kCudaF32, "ce lse"));
  LOOM_CHECK_CLOSE(tol::compare(to_f(ddx.down()), dx_ref, out_tol<T>(), "ce dlogits"));
}

// grad_scale > 0: the kernel computes dh, dW for dloss = grad_scale (fp16 loss scaling), which
// are compared with grad_scale x the reference.
template <class T>
void run_lce(int64_t N, int V, int D, int64_t chunk, double p_ignore, uint32_t seed, float grad_scale = 0) {
  std::mt19937 rng(seed);
  auto h = randn(size_t(N) * D, rng), W = randn(size_t(V) * D, rng, 0.2f);
  auto hs = seen<T>(h), Ws = seen<T>(W);
  auto tg = rand_targets(N, V, rng, p_ignore);
  float loss_ref = 0;
  std::vector<float> dh_ref(size_t(N) * D), dW_ref(size_t(V) * D), ws(size_t(std::min(chunk, N)) * V);
  loom::cpu::fused_linear_cross_entropy<float>(&loss_ref, dh_ref.data(), dW_ref.data(), hs.data(), Ws.data(),
                                               tg.data(), N, V, D, chunk, ws.data(), nullptr, nullptr);
  Dev<T> dh_in(to_t<T>(h)), dW_in(to_t<T>(W)), ddh(size_t(N) * D), ddW(size_t(V) * D);
  Dev<int32_t> dt(tg);
  Dev<float> dl(1), dws(size_t(std::min(chunk, N)) * V);
  dl.poison();
  ddh.poison();
  ddW.poison();
  dws.poison();
  Dev<float> dgs(std::vector<float>{grad_scale});
  cu::fused_linear_cross_entropy<T>(dl.p, ddh.p, ddW.p, dh_in.p, dW_in.p, dt.p, N, V, D, chunk, dws.p,
                                    grad_scale > 0 ? dgs.p : nullptr, cu::default_stream());
  if (grad_scale > 0) {
    for (auto& x : dh_ref) x *= grad_scale;
    for (auto& x : dW_ref) x *= grad_scale;
  }
  INFO(std::string(tname<T>()) + " N=" + std::to_string(N) + " V=" + std::to_string(V) + " D=" +
       std::to_string(D) + " chunk=" + std::to_string(chunk) + " grad_scale=" + std::to_string(grad_scale));
  if (sizeof(T) == 2) {
    // 16-bit T: the kernel rounds the logits to T before the softmax (as the reference's
    // autocast head); the loss of those rounded logits, in double, is what it must match
    double sum = 0;
    int64_t cnt = 0;
    std::vector<float> row(V);
    for (int64_t r = 0; r < N; r++) {
      if (tg[r] < 0) continue;
      for (int j = 0; j < V; j++) {
        double a = 0;
        for (int d = 0; d < D; d++) a += double(hs[r * D + d]) * Ws[int64_t(j) * D + d];
        row[j] = float(a);
      }
      row = seen<T>(row);
      double m = -INFINITY, e = 0;
      for (float x : row) m = std::max(m, double(x));
      for (float x : row) e += std::exp(double(x) - m);
      sum += m + std::log(e) - row[tg[r]];
      cnt++;
    }
    loss_ref = cnt ? float(sum / cnt) : 0.f;
  }
  LOOM_CHECK_CLOSE(tol::compare(dl.down(), std::vector<float>{loss_ref}, tol::kCudaF32Gemm, "lce loss"));
  LOOM_CHECK_CLOSE(tol::compare(to_f(ddh.down()), dh_ref, gemm_tol<T>(), "lce dh"));
  LOOM_CHECK_CLOSE(tol::compare(to_f(ddW.down()), dW_ref, gemm_tol<T>(), "lce dW"));
}

// ---------------------------------------------------------------------------- contrastive
template <class T>
void run_patch(int B, int M, int D, uint32_t seed) {
  std::mt19937 rng(seed);
  auto p = randn(size_t(B) * M * D, rng), t = randn(size_t(B) * M * D, rng);
  auto ps = seen<T>(p), ts = seen<T>(t);
  const double tau = 0.1;
  float loss_ref = 0;
  std::vector<float> dp_ref(p.size()), ws(size_t(B) * M * M + 2 * size_t(B) * M);
  loom::cpu::patch_disc_loss<float>(&loss_ref, dp_ref.data(), ps.data(), ts.data(), B, M, D, tau, ws.data(), nullptr);
  Dev<T> dp_in(to_t<T>(p)), dt_in(to_t<T>(t)), ddp(p.size());
  Dev<float> dl(1), dws(ws.size());
  dl.poison();
  ddp.poison();
  dws.poison();
  cu::patch_disc_loss<T>(dl.p, ddp.p, dp_in.p, dt_in.p, B, M, D, tau, dws.p, cu::default_stream());
  INFO(std::string(tname<T>()) + " B=" + std::to_string(B) + " M=" + std::to_string(M) + " D=" + std::to_string(D));
  LOOM_CHECK_CLOSE(tol::compare(dl.down(), std::vector<float>{loss_ref}, tol::kCudaF32Gemm, "patch loss"));
  LOOM_CHECK_CLOSE(tol::compare(to_f(ddp.down()), dp_ref, gemm_tol<T>(), "patch dpred"));
}

std::vector<float> normalized_rows(int B, int D, std::mt19937& rng) {
  auto x = randn(size_t(B) * D, rng);
  for (int i = 0; i < B; i++) {
    double s = 0;
    for (int d = 0; d < D; d++) s += double(x[i * D + d]) * x[i * D + d];
    for (int d = 0; d < D; d++) x[i * D + d] = float(x[i * D + d] / std::sqrt(s));
  }
  return x;
}

template <class T>
void run_infonce(int B, int D, uint32_t seed) {
  std::mt19937 rng(seed);
  auto a = normalized_rows(B, D, rng), b = normalized_rows(B, D, rng);
  auto as = seen<T>(a), bs = seen<T>(b);
  const double tau = 0.1;
  float loss_ref = 0;
  std::vector<float> da_ref(a.size()), db_ref(b.size()), ws(size_t(B) * B + 4 * size_t(B));
  loom::cpu::infonce_loss<float>(&loss_ref, da_ref.data(), db_ref.data(), as.data(), bs.data(), B, D, tau,
                                 ws.data(), nullptr);
  Dev<T> da_in(to_t<T>(a)), db_in(to_t<T>(b)), dda(a.size()), ddb(b.size());
  Dev<float> dl(1), dws(ws.size());
  dl.poison();
  dda.poison();
  ddb.poison();
  dws.poison();
  cu::infonce_loss<T>(dl.p, dda.p, ddb.p, da_in.p, db_in.p, B, D, tau, dws.p, cu::default_stream());
  INFO(std::string(tname<T>()) + " B=" + std::to_string(B) + " D=" + std::to_string(D));
  LOOM_CHECK_CLOSE(tol::compare(dl.down(), std::vector<float>{loss_ref}, tol::kCudaF32Gemm, "infonce loss"));
  LOOM_CHECK_CLOSE(tol::compare(to_f(dda.down()), da_ref, gemm_tol<T>(), "infonce da"));
  LOOM_CHECK_CLOSE(tol::compare(to_f(ddb.down()), db_ref, gemm_tol<T>(), "infonce db"));
}

}  // namespace

TEST_CASE("cross_entropy forward/backward against the CPU reference", "[cuda][losses]") {
  need_gpu();
  run_ce<float>(37, 1500, 0.2, 1);   // V > 1024, ignored rows
  run_ce<bf16>(37, 1500, 0.2, 2);
  run_ce<float>(1, 17, 0.0, 3);      // N = 1, V < 32
  run_ce<bf16>(1, 17, 0.0, 4);
  run_ce<f16>(37, 1500, 0.2, 6);
  run_ce<float>(5, 33, 1.0, 5);      // every row ignored: loss 0, gradient 0
}

TEST_CASE("fused_linear_cross_entropy against the CPU reference", "[cuda][losses]") {
  need_gpu();
  run_lce<float>(23, 301, 40, 5, 0.25, 11);    // chunk 5 does not divide N 23; odd V
  run_lce<bf16>(23, 301, 40, 5, 0.25, 12);
  run_lce<float>(70, 1100, 64, 128, 0.1, 13);  // chunk > N, V > 1024
  run_lce<bf16>(70, 1100, 64, 128, 0.1, 14);
  run_lce<bf16>(1, 50, 16, 1, 0.0, 15);        // N = 1
  run_lce<f16>(23, 301, 40, 5, 0.25, 17);
  run_lce<f16>(70, 1100, 64, 128, 0.1, 18, 1024.f);  // fp16 loss scaling: gradients for dloss = 1024
  run_lce<float>(23, 301, 40, 5, 0.25, 19, 8.f);
  run_lce<float>(9, 64, 24, 4, 1.0, 16);       // every target ignored
  // the register-resident row kernel (V a multiple of the 16-byte vector, 4 fp32 or 8 16-bit
  // values, V <= 49152): SmolLM2's vocabulary exactly; V 4100 in f16 and 49156 in bf16 are no
  // multiple of 8 (two-pass kernel); fp32 in place
  run_lce<bf16>(6, 49152, 16, 4, 0.2, 20);
  run_lce<f16>(5, 4100, 16, 2, 0.1, 21);
  run_lce<float>(7, 8192, 16, 3, 0.2, 22);
  run_lce<bf16>(3, 49156, 16, 2, 0.0, 23);
  // 16-bit logits in registers: one vector per thread (V 1024), and 3 of 4 vectors with the
  // last ones past the row (V 12288); V 49160, a multiple of 8 beyond the register path: two-pass
  run_lce<bf16>(5, 1024, 16, 3, 0.2, 24);
  run_lce<f16>(4, 12288, 16, 4, 0.0, 25);
  run_lce<bf16>(3, 49160, 16, 2, 0.1, 26);
  // a ragged last chunk after full ones, padded to 256 rows (cross_entropy.cu): 700 = 512 + 188,
  // 1100 = 2 x 400 + 300 (padded to 512 > chunk 400: left as it is), 768 = 512 + 256 (no padding)
  run_lce<bf16>(700, 1100, 64, 512, 0.1, 27);
  run_lce<float>(700, 1100, 64, 512, 0.1, 28);
  run_lce<f16>(700, 1100, 64, 512, 0.2, 29, 1024.f);
  run_lce<bf16>(1100, 1100, 64, 400, 0.2, 30);
  run_lce<bf16>(768, 1100, 64, 512, 0.1, 31);
}

TEST_CASE("patch_disc_loss against the CPU reference", "[cuda][contrastive]") {
  need_gpu();
  run_patch<float>(3, 7, 40, 21);
  run_patch<bf16>(3, 7, 40, 22);
  run_patch<float>(2, 37, 130, 23);  // M > 32: several lanes per row
  run_patch<bf16>(2, 37, 130, 24);
  run_patch<float>(1, 150, 96, 25);  // the workload's M, B = 1
  run_patch<bf16>(1, 150, 96, 26);
  run_patch<f16>(2, 37, 130, 27);
  // M not a multiple of 8 runs on target rows padded to one (above: M 7, 37, 150 with 2- and
  // 16-byte copies); the MIM's own M and D; M 16 unpadded; LOOM_PATCH_PAD=0 the unpadded layout
  run_patch<bf16>(3, 147, 768, 28);
  run_patch<bf16>(2, 16, 64, 29);
  setenv("LOOM_PATCH_PAD", "0", 1);
  run_patch<bf16>(2, 37, 130, 30);
  run_patch<float>(1, 150, 96, 31);
  unsetenv("LOOM_PATCH_PAD");
}

TEST_CASE("infonce_loss against the CPU reference", "[cuda][contrastive]") {
  need_gpu();
  run_infonce<float>(5, 33, 31);
  run_infonce<bf16>(5, 33, 32);
  run_infonce<float>(40, 64, 33);
  run_infonce<bf16>(40, 64, 34);
  run_infonce<f16>(40, 64, 36);
  run_infonce<float>(1, 8, 35);  // B = 1
}
