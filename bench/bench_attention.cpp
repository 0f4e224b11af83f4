// bench_attention.cpp: flash attention forward and forward+backward at the shapes,
// bf16, packed varlen layout [B*T, H, D] with equal-length sequences. cudaEvent timings,
// median of 20 after 3 warm-up runs; one JSON line per measurement, FLOPs as
// torch_ref.py bench_kernels counts them: forward 4 B H T^2 D (x 0.5 causal), fwd+bwd 3.5x.
// fwd+bwd is timed with the default single-pass backward (atomic dq) and with the
// deterministic two-pass one (attention_fwd_bwd_deterministic); then the same calls on the
// cuDNN backend (attention_fwd[cudnn], attention_fwd_bwd[cudnn]) and with train.attention =
// auto (attention_fwd[auto], ...: per shape the faster of the two, chosen by its probe).
// LOOM_BENCH_ATTN_PACKED times SPEC §3's packed VLM batch instead (bench_packed below).
//   ./bench_attention            (run beside: python3 ../shared/reference/torch_ref.py bench --workload kernels)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <random>
#include <utility>
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

static bf16* rand_dev(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<bf16> h(n);
  for (auto& x : h) x = bf16(d(rng));
  auto* p = static_cast<bf16*>(cu::device_malloc(n * sizeof(bf16)));
  cu::memcpy_h2d(p, h.data(), n * sizeof(bf16), cu::default_stream());
  return p;
}

// SPEC §3's packed VLM batch: samples of 49 image tokens + lognormal(median 200, sigma 0.7)
// text tokens clipped to [24, 1500], laid into rows of T tokens in arrival order (a sample that
// does not fit starts the next row; the loader's best-fit packing, data/packing.cpp, leaves
// shorter tails), each row's unused tail one more segment as the loader lays it out. Returns
// cu_seqlens over rows x T tokens; fixed seed, so every call times the same batch.
static std::vector<int32_t> spec_packed_cu(int rows, int T, uint32_t seed) {
  std::mt19937 rng(seed);
  std::lognormal_distribution<double> text(std::log(200.0), 0.7);
  std::vector<int32_t> cu{0};
  int row = 0, off = 0;
  while (row < rows) {
    const int L = std::min(T, 49 + std::max(24, std::min(1500, int(text(rng)))));
    if (off + L > T) {  // close the row: its tail is a segment of its own
      if (off < T) cu.push_back(row * T + T);
      row++, off = 0;
      continue;
    }
    off += L;
    cu.push_back(row * T + off);
  }
  return cu;
}

// LOOM_BENCH_ATTN_ROWS=FILE: the batch's rows from a data.synth_rows file instead (one line of
// sample lengths per row, '#' comments; tools/ref_vlm_rows.py writes the PyTorch reference's
// batch), each row's unused tail a segment of its own, as spec_packed_cu lays them out.
static std::vector<int32_t> rows_file_cu(const char* path, int T, int* rows) {
  FILE* f = std::fopen(path, "r");
  if (!f) {
    std::fprintf(stderr, "LOOM_BENCH_ATTN_ROWS: cannot open %s\n", path);
    std::exit(2);
  }
  std::vector<int32_t> cu{0};
  char line[65536];
  int row = 0, lineno = 0;
  while (std::fgets(line, sizeof line, f)) {
    lineno++;
    if (line[0] == '#') continue;
    int off = 0, n = 0, L = 0;
    for (char* p = line; std::sscanf(p, "%d%n", &L, &n) == 1; p += n) {
      if (L <= 0 || off + L > T) {
        std::fprintf(stderr, "%s:%d: sample length %d does not fit a row of %d tokens\n", path, lineno, L, T);
        std::exit(2);
      }
      off += L;
      cu.push_back(row * T + off);
    }
    if (off == 0) continue;
    if (off < T) cu.push_back(row * T + T);
    row++;
  }
  std::fclose(f);
  *rows = row;
  return cu;
}

// LOOM_BENCH_ATTN_PACKED="rows,T,H,KV,D,causal": our kernels and cuDNN on the SPEC packed batch
// (grouped heads), forward and forward+backward; FLOPs counted per segment (4 H D L^2, x 0.5
// causal), so TFLOP/s compare with the dense rows. Returns false when the variable is unset.
static bool bench_packed() {
  const char* e = std::getenv("LOOM_BENCH_ATTN_PACKED");
  if (!e) return false;
  int rows = 0, T = 0, H = 0, KV = 0, D = 0, c = 0;
  if (std::sscanf(e, "%d,%d,%d,%d,%d,%d", &rows, &T, &H, &KV, &D, &c) != 6 || rows <= 0 || T <= 0 || H <= 0 ||
      KV <= 0 || H % KV != 0 || D <= 0) {
    std::fprintf(stderr, "LOOM_BENCH_ATTN_PACKED: '%s' is not rows,T,H,KV,D,causal (H a multiple of KV)\n", e);
    std::exit(2);
  }
  const bool causal = c != 0;
  const char* rows_path = std::getenv("LOOM_BENCH_ATTN_ROWS");
  const std::vector<int32_t> cu_h = rows_path ? rows_file_cu(rows_path, T, &rows) : spec_packed_cu(rows, T, 0);
  const int nseq = int(cu_h.size()) - 1;
  int max_len = 0;
  double sq = 0;
  for (int i = 0; i < nseq; i++) {
    const int L = cu_h[i + 1] - cu_h[i];
    max_len = std::max(max_len, L);
    sq += double(L) * L;
  }
  // LOOM_BENCH_ATTN_MAXLEN (>= the batch's longest segment) passes a larger max_seqlen to the
  // kernels: their grids grow by blocks that find no rows of their sequence and leave, which
  // prices those blocks
  if (const char* m = std::getenv("LOOM_BENCH_ATTN_MAXLEN")) max_len = std::max(max_len, std::atoi(m));
  const int64_t N = int64_t(rows) * T;
  std::mt19937 rng(1);
  const size_t nq = size_t(N) * H * D, nk = size_t(N) * KV * D;
  bf16 *q = rand_dev(nq, rng), *k = rand_dev(nk, rng), *v = rand_dev(nk, rng), *go = rand_dev(nq, rng);
  auto* out = static_cast<bf16*>(cu::device_malloc(nq * sizeof(bf16)));
  auto* dq = static_cast<bf16*>(cu::device_malloc(nq * sizeof(bf16)));
  auto* dk = static_cast<bf16*>(cu::device_malloc(nk * sizeof(bf16)));
  auto* dv = static_cast<bf16*>(cu::device_malloc(nk * sizeof(bf16)));
  auto* lse = static_cast<float*>(cu::device_malloc(N * H * sizeof(float)));
  auto* ws = static_cast<float*>(cu::device_malloc(N * H * (D + 1) * sizeof(float)));
  auto* cu_d = static_cast<int32_t*>(cu::device_malloc(cu_h.size() * sizeof(int32_t)));
  cu::memcpy_h2d(cu_d, cu_h.data(), cu_h.size() * sizeof(int32_t), cu::default_stream());
  const double scale = 1.0 / std::sqrt(double(D));
  auto fwd = [&] {
    cu::attention_forward<bf16>(out, lse, q, k, v, cu_d, cu_d, nseq, max_len, N, N, H, KV, D, causal, scale,
                                cu::default_stream());
  };
  auto fb = [&] {
    fwd();
    cu::attention_backward<bf16>(dq, dk, dv, go, q, k, v, out, lse, ws, cu_d, cu_d, nseq, max_len, N, N, H, KV, D,
                                 causal, scale, cu::default_stream());
  };
  const double f = 4.0 * H * D * sq * (causal ? 0.5 : 1.0);
  char shape[128];
  std::snprintf(shape, sizeof shape, "packed rows%d T%d H%d KV%d D%d causal=%s nseq%d max%d", rows, T, H, KV, D,
                causal ? "True" : "False", nseq, max_len);
  const bool was = cu::deterministic_attention();
  cu::set_deterministic_attention(false);
  const cu::AttentionBackend before = cu::attention_backend();
  for (auto b : {cu::AttentionBackend::Loom, cu::AttentionBackend::Cudnn}) {
    cu::set_attention_backend(b);
    cu::reset_attention_choices();
    try {
      const float ms = median_ms(fwd), ms_fb = median_ms(fb);
      std::printf("{\"impl\":\"loom\",\"kernel\":\"attention_fwd[%s]\",\"ms\":%.4f,\"tflops\":%.1f,\"shape\":\"%s\"}\n",
                  cu::attention_backend_name(b), ms, f / ms / 1e9, shape);
      std::printf("{\"impl\":\"loom\",\"kernel\":\"attention_fwd_bwd[%s]\",\"ms\":%.4f,\"tflops\":%.1f,"
                  "\"shape\":\"%s\"}\n", cu::attention_backend_name(b), ms_fb, 3.5 * f / ms_fb / 1e9, shape);
      // sums of out and dq over the batch (stderr): two kernel choices on the same inputs give
      // the same values to a few bf16 roundings
      auto sums = [&](const bf16* d, size_t n) {
        std::vector<bf16> h(n);
        cu::memcpy_d2h(h.data(), d, n * sizeof(bf16), cu::default_stream());
        double a = 0, a2 = 0;
        for (const bf16& x : h) a += double(float(x)), a2 += double(float(x)) * double(float(x));
        return std::make_pair(a, a2);
      };
      const auto so = sums(out, nq), sq_ = sums(dq, nq), sk = sums(dk, nk);
      std::fprintf(stderr, "%s: out sum %.6e sumsq %.6e, dq sum %.6e sumsq %.6e, dk sumsq %.6e\n",
                   cu::attention_backend_name(b), so.first, so.second, sq_.first, sq_.second, sk.second);
    } catch (const std::exception& ex) {
      std::fprintf(stderr, "%s: %s\n", cu::attention_backend_name(b), ex.what());
    }
  }
  cu::set_attention_backend(before);
  cu::set_deterministic_attention(was);
  for (void* p : {(void*)q, (void*)k, (void*)v, (void*)go, (void*)out, (void*)dq, (void*)dk, (void*)dv, (void*)lse,
                  (void*)ws, (void*)cu_d})
    cu::device_free(p);
  return true;
}

int main() {
  if (!cu::available()) {
    std::printf("{\"error\":\"no CUDA device\"}\n");
    return 4;
  }
  if (bench_packed()) return 0;
  struct Shape { int B, H, T, D; bool causal; };
  std::vector<Shape> shapes = {{8, 12, 1024, 64, false}, {8, 16, 2048, 128, true}, {4, 9, 2048, 64, true}};
  // LOOM_BENCH_ATTN_SHAPES="B,H,T,D,causal;...": other shapes (our kernels only: forward and
  // forward+backward), e.g. to find the sequence length from which one kernel beats another;
  // with LOOM_BENCH_ATTN_ALL=1 every row (cuDNN and auto too)
  const char* env_shapes = std::getenv("LOOM_BENCH_ATTN_SHAPES");
  const char* env_all = std::getenv("LOOM_BENCH_ATTN_ALL");
  const bool ours_only = env_shapes != nullptr && !(env_all && env_all[0] == '1');
  if (env_shapes) {
    shapes.clear();
    std::string all = env_shapes;
    size_t a = 0;
    while (a < all.size()) {
      size_t b = all.find(';', a);
      if (b == std::string::npos) b = all.size();
      Shape sh{};
      int c = 0;
      if (std::sscanf(all.substr(a, b - a).c_str(), "%d,%d,%d,%d,%d", &sh.B, &sh.H, &sh.T, &sh.D, &c) == 5) {
        sh.causal = c != 0;
        shapes.push_back(sh);
      } else {
        std::fprintf(stderr, "LOOM_BENCH_ATTN_SHAPES: '%s' is not B,H,T,D,causal\n", all.substr(a, b - a).c_str());
        return 2;
      }
      a = b + 1;
    }
  }
  std::mt19937 rng(0);
  for (const Shape& s : shapes) {
    const int64_t N = int64_t(s.B) * s.T;
    const size_t n = size_t(N) * s.H * s.D;
    bf16 *q = rand_dev(n, rng), *k = rand_dev(n, rng), *v = rand_dev(n, rng), *go = rand_dev(n, rng);
    auto* out = static_cast<bf16*>(cu::device_malloc(n * sizeof(bf16)));
    auto* dq = static_cast<bf16*>(cu::device_malloc(n * sizeof(bf16)));
    auto* dk = static_cast<bf16*>(cu::device_malloc(n * sizeof(bf16)));
    auto* dv = static_cast<bf16*>(cu::device_malloc(n * sizeof(bf16)));
    auto* lse = static_cast<float*>(cu::device_malloc(N * s.H * sizeof(float)));
    auto* ws = static_cast<float*>(cu::device_malloc(N * s.H * (s.D + 1) * sizeof(float)));
    std::vector<int32_t> cu_h(s.B + 1);
    for (int b = 0; b <= s.B; b++) cu_h[b] = b * s.T;
    auto* cu_d = static_cast<int32_t*>(cu::device_malloc(cu_h.size() * sizeof(int32_t)));
    cu::memcpy_h2d(cu_d, cu_h.data(), cu_h.size() * sizeof(int32_t), cu::default_stream());
    const double scale = 1.0 / std::sqrt(double(s.D));
    auto fwd = [&] {
      cu::attention_forward<bf16>(out, lse, q, k, v, cu_d, cu_d, s.B, s.T, N, N, s.H, s.H, s.D, s.causal,
                                  scale, cu::default_stream());
    };
    auto fb = [&] {
      fwd();
      cu::attention_backward<bf16>(dq, dk, dv, go, q, k, v, out, lse, ws, cu_d, cu_d, s.B, s.T, N, N, s.H,
                                   s.H, s.D, s.causal, scale, cu::default_stream());
    };
    const double f = 4.0 * s.B * s.H * double(s.T) * s.T * s.D * (s.causal ? 0.5 : 1.0);
    const bool was = cu::deterministic_attention();
    cu::set_deterministic_attention(false);
    char shape[96];
    std::snprintf(shape, sizeof shape, "B%d H%d T%d D%d causal=%s", s.B, s.H, s.T, s.D, s.causal ? "True" : "False");
    if (ours_only) {
      const float ms = median_ms(fwd), ms_fb2 = median_ms(fb);
      std::printf("{\"impl\":\"loom\",\"kernel\":\"attention_fwd\",\"ms\":%.4f,\"tflops\":%.1f,\"shape\":\"%s\"}\n", ms,
                  f / ms / 1e9, shape);
      std::printf("{\"impl\":\"loom\",\"kernel\":\"attention_fwd_bwd\",\"ms\":%.4f,\"tflops\":%.1f,\"shape\":\"%s\"}\n",
                  ms_fb2, 3.5 * f / ms_fb2 / 1e9, shape);
      for (void* p : {(void*)q, (void*)k, (void*)v, (void*)go, (void*)out, (void*)dq, (void*)dk, (void*)dv,
                      (void*)lse, (void*)ws, (void*)cu_d})
        cu::device_free(p);
      continue;
    }
    const float ms_f = median_ms(fwd), ms_fb = median_ms(fb);
    cu::set_deterministic_attention(true);
    const float ms_fbd = median_ms(fb);
    // the cuDNN backend (kernels/cuda/attention_cudnn.cu) and auto (per shape the faster; the
    // warm-up's first call runs its probe); -1 when cuDNN cannot run here
    auto with = [&](cu::AttentionBackend b, const std::function<void()>& f) {
      const cu::AttentionBackend before = cu::attention_backend();
      cu::set_attention_backend(b);
      cu::reset_attention_choices();
      float ms = -1.f;
      try {
        ms = median_ms(f);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "%s: %s\n", cu::attention_backend_name(b), e.what());
      }
      cu::set_attention_backend(before);
      return ms;
    };
    cu::set_deterministic_attention(false);
    const float ms_fc = with(cu::AttentionBackend::Cudnn, fwd), ms_fbc = with(cu::AttentionBackend::Cudnn, fb);
    const float ms_fa = with(cu::AttentionBackend::Auto, fwd), ms_fba = with(cu::AttentionBackend::Auto, fb);
    cu::set_deterministic_attention(was);
    std::printf("{\"impl\":\"loom\",\"kernel\":\"attention_fwd\",\"ms\":%.4f,\"tflops\":%.1f,\"shape\":\"%s\"}\n",
                ms_f, f / ms_f / 1e9, shape);
    std::printf("{\"impl\":\"loom\",\"kernel\":\"attention_fwd_bwd\",\"ms\":%.4f,\"tflops\":%.1f,\"shape\":\"%s\"}\n",
                ms_fb, 3.5 * f / ms_fb / 1e9, shape);
    std::printf("{\"impl\":\"loom\",\"kernel\":\"attention_fwd_bwd_deterministic\",\"ms\":%.4f,\"tflops\":%.1f,\"shape\":\"%s\"}\n",
                ms_fbd, 3.5 * f / ms_fbd / 1e9, shape);
    const struct { const char* kernel; float ms; double flop; } more[] = {
        {"attention_fwd[cudnn]", ms_fc, f}, {"attention_fwd_bwd[cudnn]", ms_fbc, 3.5 * f},
        {"attention_fwd[auto]", ms_fa, f}, {"attention_fwd_bwd[auto]", ms_fba, 3.5 * f}};
    for (const auto& m : more)
      if (m.ms > 0)
        std::printf("{\"impl\":\"loom\",\"kernel\":\"%s\",\"ms\":%.4f,\"tflops\":%.1f,\"shape\":\"%s\"}\n", m.kernel,
                    m.ms, m.flop / m.ms / 1e9, shape);
    std::fflush(stdout);
    for (void* p : {(void*)q, (void*)k, (void*)v, (void*)go, (void*)out, (void*)dq, (void*)dk, (void*)dv,
                    (void*)lse, (void*)ws, (void*)cu_d})
      cu::device_free(p);
  }
  return 0;
}
#else
int main() {
  std::printf("{\"error\":\"loom was built without CUDA\"}\n");
  return 0;
}
#endif
