// bench_gemm_shapes.cpp: the linear layers of the SPEC §3 training steps, one GEMM at a time,
// as the step runs them (kernels/cuda/matmul.cu): the forward (bias or GELU epilogue), the input
// gradient (dinp = dout W, beta 0) and the weight gradient (dW += dout^T inp, beta 1), each timed
// alone (median of 20 event-timed runs after 5 warm-ups, bf16, random inputs), printed as JSON
// lines with TFLOP/s, then a sum per workload weighted by how often a step runs each shape:
//   {"impl":"loom","kernel":"gemm_shape","workload":"mim","layer":"enc.qkv","op":"dw",
//    "M":6272,"I":768,"O":2304,"count":12,"ms":..,"tflops":..}
// What it answers: which of a step's products run far from the GPU's GEMM rate, and what a
// step's GEMMs would cost at that rate (the "sum" lines).
// LOOM_BENCH_GEMM_WORKLOADS=mim,vlm,... keeps some workloads.
// LOOM_BENCH_GEMM_RANKS=n: every product that runs through matmul.cu (the "loom" lines) also
// runs with each of the heuristic's first n algorithms ("gemm_rank" lines, with the plan's sizes
// in LOOM_GEMM_PICK's terms and the algorithm's tile, stages, split-K, cluster): with
// LOOM_BENCH_SUSTAIN_MS, which candidate runs a product fastest with the board at its power
// limit (its joules too, but NVML's counter moves every ~100 ms: energy over windows under a few
// seconds is noise); bench/gemm_pick.py turns the lines into a LOOM_GEMM_PICK table.
// LOOM_BENCH_SUSTAIN_MS=n: after its 20 timed runs each product also runs back to back for n ms
// and its line gets "sustained_ms" (the wall time per call over that stretch), "mj_per_call" and
// "pj_per_flop" (the GPU's energy counter, kernels.h device_energy_joules, over the stretch): what
// a product costs once the board sits at its power limit, as it does through a training step
// (bench/RESULTS.md 2026-12-07 "energy"), where the cheapest product in joules is the fastest.
// The counter moves every ~100 ms (2026-12-07 "candidates"): the joules of a stretch of n ms are
// good to about 100 / n, the wall time far better.
// The power controller settles about a second into a load: n of 1500 or more reads the products
// as a step sees them (and adds n ms to each of the ~150 lines; LOOM_BENCH_GEMM_WORKLOADS
// narrows it).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_timing.h"
#include "kernels/cuda/gemm_sm90.h"
#include "kernels/kernels.h"

namespace loom::cuda {  // kernels/cuda/matmul.cu's candidate ranking (no header: bench only)
void gemm_set_candidate(int rank);  // matmul.cu: the heuristic's rank-th algorithm for new plans
long gemm_candidate_missing();
std::string gemm_last_algo();
}  // namespace loom::cuda

namespace cu = loom::cuda;
using loom::bf16;

namespace {

bf16* random_buffer(size_t n, uint64_t seed) {
  const size_t block = std::min<size_t>(n, 1 << 20);
  std::vector<bf16> h(block);
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  for (auto& x : h) x = bf16(d(g));
  bf16* p = static_cast<bf16*>(cu::device_malloc(n * sizeof(bf16)));
  for (size_t off = 0; off < n; off += block)
    cu::memcpy_h2d(p + off, h.data(), std::min(block, n - off) * sizeof(bf16), cu::default_stream());
  return p;
}

// LOOM_BENCH_SUSTAIN_MS (header): f back to back for that long, synchronized every 16 calls;
// g_sustain holds the last product's figures (calls 0: not measured, or no energy counter).
struct Sustained {
  long calls = 0;
  double ms_per_call = 0, j = 0;
} g_sustain;

void sustain(const std::function<void()>& f) {
  g_sustain = Sustained{};
  const char* e = std::getenv("LOOM_BENCH_SUSTAIN_MS");
  const double want_ms = e ? std::atof(e) : 0;
  if (want_ms <= 0) return;
  cu::synchronize();
  const double e0 = cu::device_energy_joules();
  if (e0 < 0) return;
  const auto t0 = std::chrono::steady_clock::now();
  long calls = 0;
  double ms = 0;
  while (ms < want_ms) {
    for (int i = 0; i < 16; i++) f();
    calls += 16;
    cu::synchronize();
    ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
  const double e1 = cu::device_energy_joules();
  if (e1 < e0) return;
  g_sustain = Sustained{calls, ms / double(calls), (e1 - e0) / double(calls)};
}

// the line's sustained fields (empty when not measured), `flop` a call
std::string sustained_fields(double flop) {
  if (g_sustain.calls == 0) return "";
  char buf[160];
  std::snprintf(buf, sizeof buf, ",\"sustained_ms\":%.4f,\"mj_per_call\":%.3f,\"pj_per_flop\":%.3f",
                g_sustain.ms_per_call, g_sustain.j * 1e3, g_sustain.j / flop * 1e12);
  return buf;
}

// bench_timing.h's median of 20 event-timed runs after 5 warm-ups, then the sustained stretch
double median_ms(const std::function<void()>& f) {
  const double ms = loom::bench::median_ms([&](int) { f(); }, 5, 20);
  sustain(f);
  return ms;
}

// One linear layer of a step: M rows through I -> O, `count` times a step; `gelu`: the
// forward's GELU epilogue; `grad`: the step also runs its backward (not the EMA target).
struct Shape {
  const char* workload;
  const char* layer;
  int64_t M;
  int I, O, count;
  bool gelu, grad, bias;
};

}  // namespace

int main() {
  if (!cu::available()) {
    std::fprintf(stderr, "no CUDA device\n");
    return 4;
  }
  cudaStream_t s = cu::default_stream();
  // MIM: B 128, 196 patches, 49 kept; ViT-B/16 (12 blocks) and the 384-wide predictor (4 blocks).
  // VLM: SmolLM2-135M on 8 x 2048 tokens (30 layers), ViT-B/16 on 56 images (the SPEC batch's
  // mean), the projector on their 49 tokens each.
  const int64_t enc = 128 * 49, all = 128 * 196, lm = 16384, vit = 56 * 196;
  std::vector<Shape> shapes = {
      {"mim", "enc.patch", enc, 768, 768, 1, false, true, true},
      {"mim", "enc.qkv", enc, 768, 2304, 12, false, true, true},
      {"mim", "enc.proj", enc, 768, 768, 12, false, true, true},
      {"mim", "enc.fc1", enc, 768, 3072, 12, true, true, true},
      {"mim", "enc.fc2", enc, 3072, 768, 12, false, true, true},
      {"mim", "pred_in", enc, 768, 384, 1, false, true, true},
      {"mim", "pred.qkv", all, 384, 1152, 4, false, true, true},
      {"mim", "pred.proj", all, 384, 384, 4, false, true, true},
      {"mim", "pred.fc1", all, 384, 1536, 4, true, true, true},
      {"mim", "pred.fc2", all, 1536, 384, 4, false, true, true},
      {"mim", "pred_out", all, 384, 768, 1, false, true, true},
      {"mim", "target.patch", all, 768, 768, 1, false, false, true},
      {"mim", "target.qkv", all, 768, 2304, 12, false, false, true},
      {"mim", "target.proj", all, 768, 768, 12, false, false, true},
      {"mim", "target.fc1", all, 768, 3072, 12, true, false, true},
      {"mim", "target.fc2", all, 3072, 768, 12, false, false, true},
      {"vlm", "vit.patch", vit, 768, 768, 1, false, true, true},
      {"vlm", "vit.qkv", vit, 768, 2304, 12, false, true, true},
      {"vlm", "vit.proj", vit, 768, 768, 12, false, true, true},
      {"vlm", "vit.fc1", vit, 768, 3072, 12, true, true, true},
      {"vlm", "vit.fc2", vit, 3072, 768, 12, false, true, true},
      {"vlm", "projector", 56 * 49, 3072, 576, 1, false, true, false},
      {"vlm", "lm.q", lm, 576, 576, 30, false, true, false},
      {"vlm", "lm.k", lm, 576, 192, 30, false, true, false},
      {"vlm", "lm.v", lm, 576, 192, 30, false, true, false},
      {"vlm", "lm.o", lm, 576, 576, 30, false, true, false},
      {"vlm", "lm.gate", lm, 576, 1536, 30, false, true, false},
      {"vlm", "lm.up", lm, 576, 1536, 30, false, true, false},
      {"vlm", "lm.down", lm, 1536, 576, 30, false, true, false},
      // not run by the step: q, k, v as one product and gate, up as one (weights side by side)
      {"vlm_joined", "lm.qkv", lm, 576, 960, 30, false, true, false},
      {"vlm_joined", "lm.gate_up", lm, 576, 3072, 30, false, true, false},
  };
  // mim_contrastive: the MIM shapes at twice the rows (both views in one batch, nn/mim.cpp);
  // LOOM_BENCH_GEMM_WORKLOADS (a comma list, e.g. "mim_contrastive") keeps only those workloads
  const size_t n_mim = size_t(std::count_if(shapes.begin(), shapes.end(), [](const Shape& sh) {
    return std::string(sh.workload) == "mim";
  }));
  for (size_t i = 0; i < n_mim; i++) {
    Shape sh = shapes[i];
    sh.workload = "mim_contrastive";
    sh.M *= 2;
    shapes.push_back(sh);
  }
  if (const char* only = std::getenv("LOOM_BENCH_GEMM_WORKLOADS")) {
    const std::string list = "," + std::string(only) + ",";
    shapes.erase(std::remove_if(shapes.begin(), shapes.end(), [&](const Shape& sh) {
                   return list.find("," + std::string(sh.workload) + ",") == std::string::npos;
                 }), shapes.end());
  }
  std::map<std::string, double> sum_ms, sum_flop;
  for (const Shape& sh : shapes) {
    const size_t in = size_t(sh.M) * sh.I, out = size_t(sh.M) * sh.O, w = size_t(sh.I) * sh.O;
    bf16 *x = random_buffer(in, 1), *y = random_buffer(out, 2), *dy = random_buffer(out, 3),
         *dx = random_buffer(in, 4), *W = random_buffer(w, 5), *dW = random_buffer(w, 6),
         *b = random_buffer(size_t(sh.O), 7), *pre = sh.gelu ? random_buffer(out, 8) : nullptr;
    const double flop = 2.0 * double(sh.M) * sh.I * sh.O;
    // impl "loom": matmul.cu's path (cuBLASLt unless LOOM_GEMM90 routes the call); "sm90":
    // gemm_sm90.cu's kernel called directly
    // LOOM_BENCH_GEMM_RANKS (header): the product again at each of the heuristic's first n
    // algorithms; a rank the heuristic does not offer (or whose fallback throws) is skipped
    auto ranks = [&](const char* op, const std::function<void()>& f, double flop) {
      const char* e = std::getenv("LOOM_BENCH_GEMM_RANKS");
      const int n = e ? std::atoi(e) : 0;
      for (int r = 0; r < n; r++) {
        cu::gemm_set_candidate(r);
        const long missing = cu::gemm_candidate_missing();
        bool ok = true;
        try {
          f();
          cu::synchronize();
        } catch (const std::exception&) {
          ok = false;
        }
        if (ok && cu::gemm_candidate_missing() == missing) {
          const std::string algo = cu::gemm_last_algo();
          const double ms = median_ms(f);
          std::printf("{\"impl\":\"cublaslt\",\"kernel\":\"gemm_rank\",\"workload\":\"%s\",\"layer\":\"%s\","
                      "\"op\":\"%s\",\"count\":%d,\"rank\":%d,\"plan\":\"%s\",\"ms\":%.4f,\"tflops\":%.1f%s}\n",
                      sh.workload, sh.layer, op, sh.count, r, algo.c_str(), ms, flop / ms / 1e9,
                      sustained_fields(flop).c_str());
          std::fflush(stdout);
        }
        cu::gemm_set_candidate(-1);
      }
    };
    auto one = [&](const char* op, const std::function<void()>& f, const char* impl = "loom") {
      double ms = median_ms(f);
      std::printf(
          "{\"impl\":\"%s\",\"kernel\":\"gemm_shape\",\"workload\":\"%s\",\"layer\":\"%s\",\"op\":\"%s\","
          "\"M\":%lld,\"I\":%d,\"O\":%d,\"count\":%d,\"ms\":%.4f,\"tflops\":%.1f%s}\n",
          impl, sh.workload, sh.layer, op, (long long)sh.M, sh.I, sh.O, sh.count, ms, flop / ms / 1e9,
          sustained_fields(flop).c_str());
      std::fflush(stdout);
      std::string k = std::string(sh.workload) + " " + op;
      if (std::string(impl) != "loom") k += " " + std::string(impl);
      sum_ms[k] += ms * sh.count;
      sum_flop[k] += flop * sh.count;
      if (std::string(impl) == "loom") ranks(op, f, flop);
    };
    auto dev = [](bf16* p) { return reinterpret_cast<__nv_bfloat16*>(p); };
    if (sh.gelu)
      one("fwd", [&] { cu::linear_gelu_forward(y, sh.grad ? pre : nullptr, x, W, b, sh.M, sh.I, sh.O, s); });
    else
      one("fwd", [&] { cu::linear_forward(y, x, W, sh.bias ? b : nullptr, sh.M, sh.I, sh.O, s); });
    // the forward through gemm_sm90.cu's kernel
    if (cu::gemm90::supported(y, pre, nullptr, x, W, b, sh.M, sh.I, sh.O))
      one("fwd", [&] {
        cu::gemm90::linear_forward(dev(y), sh.gelu && sh.grad ? dev(pre) : nullptr, dev(x), dev(W),
                                   sh.bias ? dev(b) : nullptr, nullptr, sh.M, sh.I, sh.O, sh.gelu, s);
      }, "sm90");
    // the LM's joined gate | up with its SwiGLU: the product then swiglu_forward_joined (two
    // passes), and linear_swiglu_forward (gemm_sm90.cu's epilogue 13 on Hopper)
    if (std::string(sh.layer) == "lm.gate_up") {
      const int Ih = sh.O / 2;
      setenv("LOOM_GEMM90", "0", 1);
      one("fwd_swiglu_2pass", [&] { cu::linear_swiglu_forward(y, dy, x, W, sh.M, sh.I, Ih, s); });
      unsetenv("LOOM_GEMM90");
      one("fwd_swiglu", [&] { cu::linear_swiglu_forward(y, dy, x, W, sh.M, sh.I, Ih, s); });
      // four and five stages (epilogues 3 and 8) instead of six (13)
      setenv("LOOM_GEMM90_SWF", "4", 1);
      one("fwd_swiglu_4stage", [&] { cu::linear_swiglu_forward(y, dy, x, W, sh.M, sh.I, Ih, s); });
      setenv("LOOM_GEMM90_SWF", "5", 1);
      one("fwd_swiglu_5stage", [&] { cu::linear_swiglu_forward(y, dy, x, W, sh.M, sh.I, Ih, s); });
      unsetenv("LOOM_GEMM90_SWF");
      // its backward behind the down projection (dh = dout wd, wd [576, 1536]; half the FLOPs the
      // row's tflops assume): the product then swiglu_backward_joined (two passes), and
      // linear_swiglu_backward (gemm_sm90.cu's epilogue 7 on Hopper, I % 128 == 0); dgu into y,
      // h into dy
      bf16* gu = random_buffer(out, 9);
      setenv("LOOM_GEMM90", "0", 1);
      one("bwd_swiglu_2pass", [&] { cu::linear_swiglu_backward(y, dy, dx, W, gu, sh.M, sh.I, Ih, s); });
      unsetenv("LOOM_GEMM90");
      one("bwd_swiglu", [&] { cu::linear_swiglu_backward(y, dy, dx, W, gu, sh.M, sh.I, Ih, s); });
      setenv("LOOM_GEMM90_SWB", "0", 1);  // 128 x 64 tiles (epilogue 4) instead of 64 x 128 (7)
      one("bwd_swiglu_128x64", [&] { cu::linear_swiglu_backward(y, dy, dx, W, gu, sh.M, sh.I, Ih, s); });
      unsetenv("LOOM_GEMM90_SWB");
      cu::device_free(gu);
    }
    // the LM's joined q | k | v with RoPE: the product then rope_qkv_split (two passes), and
    // linear_qkv_rope (RoPE in the epilogue of gemm_sm90.cu on Hopper); positions 0 .. 2047
    if (std::string(sh.layer) == "lm.qkv") {
      const int hd = 64, H = 9, KV = 3;
      std::vector<int32_t> hp(size_t(sh.M));
      for (int64_t n = 0; n < sh.M; n++) hp[size_t(n)] = int32_t(n % 2048);
      auto* pos = static_cast<int32_t*>(cu::device_malloc(hp.size() * sizeof(int32_t)));
      cu::memcpy_h2d(pos, hp.data(), hp.size() * sizeof(int32_t), s);
      bf16 *q = y, *k = y + sh.M * H * hd, *v = k + sh.M * KV * hd;  // q, k, v side by side in y
      setenv("LOOM_GEMM90_QKV", "0", 1);
      one("fwd_qkv_rope_2pass", [&] { cu::linear_qkv_rope(q, k, v, x, W, pos, sh.M, sh.I, H, KV, hd, 100000.0, s); });
      unsetenv("LOOM_GEMM90_QKV");
      one("fwd_qkv_rope", [&] { cu::linear_qkv_rope(q, k, v, x, W, pos, sh.M, sh.I, H, KV, hd, 100000.0, s); });
      cu::device_free(pos);
    }
    // a block's output projections add the residual in their epilogue (linear_forward_add)
    const std::string layer = sh.layer;
    const bool resid_layer = layer.size() > 5 && (layer.substr(layer.size() - 5) == ".proj" ||
                                                  layer.substr(layer.size() - 4) == ".fc2" || layer == "lm.o" ||
                                                  layer == "lm.down");
    if (resid_layer) {
      one("fwd_add", [&] { cu::linear_forward_add(y, x, W, sh.bias ? b : nullptr, dy, sh.M, sh.I, sh.O, s); });
      if (cu::gemm90::supported(y, nullptr, dy, x, W, b, sh.M, sh.I, sh.O))
        one("fwd_add", [&] {
          cu::gemm90::linear_forward(dev(y), nullptr, dev(x), dev(W), sh.bias ? dev(b) : nullptr, dev(dy), sh.M, sh.I,
                                     sh.O, false, s);
        }, "sm90");
    }
    // fc1's pre-activation gradient behind fc2's input gradient (linear_dgelu_backward, no bias
    // gradient): dpre [M, O] = (g [M, I] W'[I, O]) * gelu'(pre), i.e. fc2's product with this
    // fc1's shape read backwards; cuBLASLt's DGELU epilogue, and gemm_sm90.cu's epilogue 5
    if (sh.gelu && sh.grad) {
      one("dgelu", [&] { cu::linear_dgelu_backward(y, (bf16*)nullptr, dx, W, pre, sh.M, sh.O, sh.I, s); });
      if (cu::gemm90::dgelu_supported(y, dx, W, pre, sh.M, sh.O, sh.I))
        one("dgelu", [&] { cu::gemm90::linear_dgelu(dev(y), dev(dx), dev(W), dev(pre), sh.M, sh.O, sh.I, s); },
            "sm90");
    }
    if (sh.grad) {
      one("dx", [&] { cu::gemm(dx, dy, W, int(sh.M), sh.I, sh.O, false, false, 1.0, 0.0, 1, 0, 0, 0, s); });
      one("dw", [&] { cu::gemm(dW, dy, x, sh.O, sh.I, int(sh.M), true, false, 1.0, 1.0, 1, 0, 0, 0, s); });
    }
    // a ViT's q, k, v (three D x D parts of qkv): as the step runs them (three GEMMs) and as one
    // strided-batched GEMM whose input has batch stride 0 (the outputs stay three [M, D] blocks)
    if (std::string(sh.layer).find(".qkv") != std::string::npos && sh.O == 3 * sh.I) {
      const int D = sh.I;
      const double f3 = flop;
      auto extra = [&](const char* op, const std::function<void()>& f) {
        try {
          double ms = median_ms(f);
          std::printf("{\"impl\":\"loom\",\"kernel\":\"gemm_shape_qkv\",\"workload\":\"%s\",\"layer\":\"%s\",\"op\":\"%s\","
                      "\"M\":%lld,\"D\":%d,\"ms\":%.4f,\"tflops\":%.1f%s}\n",
                      sh.workload, sh.layer, op, (long long)sh.M, D, ms, f3 / ms / 1e9,
                      sustained_fields(f3).c_str());
        } catch (const std::exception& e) {
          std::printf("{\"kernel\":\"gemm_shape_qkv\",\"layer\":\"%s\",\"op\":\"%s\",\"error\":\"%s\"}\n", sh.layer, op, e.what());
        }
        std::fflush(stdout);
      };
      extra("fwd_3", [&] {
        for (int p = 0; p < 3; p++) cu::linear_forward(y + p * sh.M * D, x, W + p * D * D, b + p * D, sh.M, D, D, s);
      });
      extra("fwd_batched", [&] {
        cu::gemm(y, x, W, int(sh.M), D, D, false, true, 1.0, 0.0, 3, 0, int64_t(D) * D, sh.M * D, s);
      });
      if (sh.grad) {
        extra("dw_3", [&] {
          for (int p = 0; p < 3; p++)
            cu::gemm(dW + p * D * D, dy + p * sh.M * D, x, D, D, int(sh.M), true, false, 1.0, 1.0, 1, 0, 0, 0, s);
        });
        extra("dw_batched", [&] {
          cu::gemm(dW, dy, x, D, D, int(sh.M), true, false, 1.0, 1.0, 3, sh.M * D, 0, int64_t(D) * D, s);
        });
        extra("dx_3", [&] {
          for (int p = 0; p < 3; p++)
            cu::gemm(dx, dy + p * sh.M * D, W + p * D * D, int(sh.M), D, D, false, false, 1.0, p ? 1.0 : 0.0, 1, 0, 0, 0, s);
        });
      }
    }
    for (bf16* p : {x, y, dy, dx, W, dW, b, pre})
      if (p) cu::device_free(p);
  }
  for (auto& kv : sum_ms)
    std::printf("{\"impl\":\"loom\",\"kernel\":\"gemm_shape_sum\",\"what\":\"%s\",\"ms\":%.3f,\"tflops\":%.1f}\n",
                kv.first.c_str(), kv.second, sum_flop[kv.first] / kv.second / 1e9);
  return 0;
}
