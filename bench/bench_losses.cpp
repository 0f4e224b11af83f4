// bench_losses.cpp: fused linear + cross-entropy at the shape (N 16384, V 49152,
// D 576, bf16; PyTorch's materialized linear + cross_entropy is the yardstick) for a few chunk
// sizes, and the contrastive losses at the MIM shapes. cudaEvent timings, median of 20 after
// 3 warm-up runs; JSON lines. LCE FLOPs 6 N V D; peak extra memory = the allocator's peak
// above what the inputs (h, W, targets) hold, so dh, dW, the workspace and scratch all count.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <vector>

#include "kernels/kernels.h"

#if LOOM_CUDA
#include <cuda_runtime.h>

#include "bench/bench_timing.h"

namespace cu = loom::cuda;
using loom::bf16;

// bench_timing.h's median of 20 event-timed runs, after 3 warm-ups
static float median_ms(const std::function<void()>& f) {
  return float(loom::bench::median_ms([&](int) { f(); }, 3, 20));
}

template <class T>
static T* upload(const std::vector<T>& h) {
  auto* p = static_cast<T*>(cu::device_malloc(h.size() * sizeof(T)));
  cu::memcpy_h2d(p, h.data(), h.size() * sizeof(T), cu::default_stream());
  return p;
}
static std::vector<bf16> randn_bf16(size_t n, std::mt19937& rng, float sd) {
  std::normal_distribution<float> d(0.f, sd);
  std::vector<bf16> h(n);
  for (auto& x : h) x = bf16(d(rng));
  return h;
}

int main() {
  if (!cu::available()) {
    std::printf("{\"error\":\"no CUDA device\"}\n");
    return 4;
  }
  std::mt19937 rng(0);
  {  // fused linear cross-entropy
    const int64_t N = 16384;
    const int V = 49152, D = 576;
    bf16* h = upload(randn_bf16(size_t(N) * D, rng, 1.f));
    bf16* W = upload(randn_bf16(size_t(V) * D, rng, 0.05f));
    std::vector<int32_t> tg(N);
    std::uniform_int_distribution<int> dv(0, V - 1);
    for (auto& t : tg) t = dv(rng);
    int32_t* t = upload(tg);
    for (int64_t chunk : {2048, 4096}) {
      cu::synchronize();
      const size_t base = cu::bytes_in_use();
      cu::reset_peak_bytes();
      auto* loss = static_cast<float*>(cu::device_malloc(sizeof(float)));
      auto* dh = static_cast<bf16*>(cu::device_malloc(size_t(N) * D * sizeof(bf16)));
      auto* dW = static_cast<bf16*>(cu::device_malloc(size_t(V) * D * sizeof(bf16)));
      auto* ws = static_cast<float*>(cu::device_malloc(size_t(chunk) * V * sizeof(float)));
      auto run = [&] { cu::fused_linear_cross_entropy<bf16>(loss, dh, dW, h, W, t, N, V, D, chunk, ws, nullptr, cu::default_stream()); };
      const float ms = median_ms(run);
      cu::synchronize();
      const double extra_gb = double(cu::peak_bytes_in_use() - base) / double(1ull << 30);
      float l = 0;
      cu::memcpy_d2h(&l, loss, sizeof(float), cu::default_stream());
      std::printf("{\"impl\":\"loom\",\"kernel\":\"linear_cross_entropy_fwd_bwd\",\"ms\":%.4f,\"tflops\":%.1f,"
                  "\"shape\":\"N%lld V%d D%d\",\"chunk\":%lld,\"peak_extra_gb\":%.2f,\"loss\":%.4f}\n",
                  ms, 6.0 * N * V * D / ms / 1e9, (long long)N, V, D, (long long)chunk, extra_gb, l);
      std::fflush(stdout);
      for (void* p : {(void*)loss, (void*)dh, (void*)dW, (void*)ws}) cu::device_free(p);
    }
    for (void* p : {(void*)h, (void*)W, (void*)t}) cu::device_free(p);
  }
  {  // patch discrimination (one MIM view: B 128, 147 masked patches, D 768) and InfoNCE
    const int B = 128, M = 147, D = 768;
    bf16* p = upload(randn_bf16(size_t(B) * M * D, rng, 1.f));
    bf16* tt = upload(randn_bf16(size_t(B) * M * D, rng, 1.f));
    auto* dp = static_cast<bf16*>(cu::device_malloc(size_t(B) * M * D * sizeof(bf16)));
    auto* ws = static_cast<float*>(cu::device_malloc((size_t(B) * M * M + 2 * size_t(B) * M) * sizeof(float)));
    auto* loss = static_cast<float*>(cu::device_malloc(sizeof(float)));
    const float ms = median_ms([&] { cu::patch_disc_loss<bf16>(loss, dp, p, tt, B, M, D, 0.1, ws, cu::default_stream()); });
    std::printf("{\"impl\":\"loom\",\"kernel\":\"patch_disc_loss_fwd_bwd\",\"ms\":%.4f,\"tflops\":%.1f,\"shape\":\"B%d M%d D%d\"}\n",
                ms, 4.0 * B * M * M * D / ms / 1e9, B, M, D);
    std::vector<bf16> a(size_t(B) * D);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& x : a) x = bf16(nd(rng) / std::sqrt(float(D)));
    bf16* da = upload(a);
    bf16* db = upload(a);
    auto* ga = static_cast<bf16*>(cu::device_malloc(a.size() * sizeof(bf16)));
    auto* gb = static_cast<bf16*>(cu::device_malloc(a.size() * sizeof(bf16)));
    const float ms2 = median_ms([&] { cu::infonce_loss<bf16>(loss, ga, gb, da, db, B, D, 0.1, ws, cu::default_stream()); });
    std::printf("{\"impl\":\"loom\",\"kernel\":\"infonce_loss_fwd_bwd\",\"ms\":%.4f,\"shape\":\"B%d D%d\"}\n", ms2, B, D);
    for (void* x : {(void*)p, (void*)tt, (void*)dp, (void*)ws, (void*)loss, (void*)da, (void*)db, (void*)ga, (void*)gb})
      cu::device_free(x);
  }
  return 0;
}
#else
int main() {
  std::printf("{\"error\":\"loom was built without CUDA\"}\n");
  return 0;
}
#endif
