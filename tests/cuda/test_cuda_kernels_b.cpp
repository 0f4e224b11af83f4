// test_cuda_kernels_b.cpp: the CUDA attention, cross-entropy, fused linear cross-entropy and
// contrastive losses against the loom::cpu references, forward and backward, f32 and bf16.
//
// f32 runs compare with the CPU in f32; bf16 runs round the same random f32 data to bf16,
// give the rounded values (as f32) to the CPU, and compare the CUDA bf16 outputs with
// tol::kCudaBF16. Every output is poisoned with NaN before the launch. Shapes reach every
// branch: ragged cu_seqlens with padding rows outside every sequence, GQA, causal and not,
// decode (Lq = 1), queries that see no key (Lq > Lk, causal), hd 16/32/40/64/128, N = 1,
// V > 1024, chunks that do not divide N.
// Exits with code 4 (ctest: skipped) when no GPU is present.
#include <catch2/catch.hpp>

#include <algorithm>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/kernels.h"
#include "tests/tolerances.h"

using loom::bf16;
using loom::f16;
namespace tol = loom::tol;
namespace cu = loom::cuda;

namespace {

void need_gpu() {
  if (!cu::available()) {
    std::fprintf(stderr, "no CUDA device: skipping\n");
    std::exit(4);
  }
}

// A device array that uploads from / downloads to host vectors.
template <class T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t n_) : n(n_) { p = static_cast<T*>(cu::device_malloc(sizeof(T) * (n ? n : 1))); }
  explicit Dev(const std::vector<T>& h) : Dev(h.size()) { up(h); }
  ~Dev() { cu::device_free(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  void up(const std::vector<T>& h) {
    if (n) cu::memcpy_h2d(p, h.data(), sizeof(T) * n, cu::default_stream());
  }
  std::vector<T> down() const {
    std::vector<T> h(n);
    if (n) cu::memcpy_d2h(h.data(), p, sizeof(T) * n, cu::default_stream());
    return h;
  }
  void poison() { up(std::vector<T>(n, T(std::numeric_limits<float>::quiet_NaN()))); }
};

std::vector<float> randn(size_t n, std::mt19937& rng, float sd = 1.f) {
  std::normal_distribution<float> d(0.f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Device-type copy of f32 data, and the f32 values the device actually sees (bf16-rounded).
template <class T>
std::vector<T> to_t(const std::vector<float>& v) {
  std::vector<T> r(v.size());
  for (size_t i = 0; i < v.size(); i++) r[i] = T(v[i]);
  return r;
}
template <class T>
std::vector<float> seen(const std::vector<float>& v) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); i++) r[i] = float(T(v[i]));
  return r;
}
template <class T>
std::vector<float> to_f(const std::vector<T>& v) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); i++) r[i] = float(v[i]);
  return r;
}
// +inf on both sides is a match (rows that see nothing); map it to a large finite value.
std::vector<float> inf_to_big(std::vector<float> v) {
  for (auto& x : v)
    if (std::isinf(x) && x > 0) x = 1e30f;
  return v;
}

template <class T> tol::Tol out_tol() {
  return std::is_same<T, float>::value ? tol::kCudaF32 : std::is_same<T, f16>::value ? tol::kCudaF16 : tol::kCudaBF16;
}
template <class T> tol::Tol gemm_tol() {
  return std::is_same<T, float>::value ? tol::kCudaF32Gemm : std::is_same<T, f16>::value ? tol::kCudaF16 : tol::kCudaBF16;
}
template <class T> const char* tname() {
  return std::is_same<T, float>::value ? "f32" : std::is_same<T, f16>::value ? "f16" : "bf16";
}

// ---------------------------------------------------------------------------- attention
struct AttnCase {
  std::vector<int> lq, lk;
  int pad_q, pad_k;  // rows after the last sequence (outside every sequence)
  int H, KV, hd;
  bool causal;
  int max_seqlen_at_least = 0;  // a looser bound than the longest sequence (a rounded batch shape)
};

// deterministic: the bf16 backward's two-pass kernels (bitwise reproducible); otherwise the
// single pass with atomic dq (hd 64/128), whose dq may differ between runs in the last bits.
template <class T>
void run_attention(const AttnCase& c, uint32_t seed, bool deterministic) {
  cu::set_deterministic_attention(deterministic);
  std::mt19937 rng(seed);
  const int nseq = int(c.lq.size());
  std::vector<int32_t> cu_q{0}, cu_k{0};
  int max_seqlen = 0;
  for (int i = 0; i < nseq; i++) {
    cu_q.push_back(cu_q.back() + c.lq[i]);
    cu_k.push_back(cu_k.back() + c.lk[i]);
    max_seqlen = std::max({max_seqlen, c.lq[i], c.lk[i]});
  }
  max_seqlen = std::max(max_seqlen, c.max_seqlen_at_least);
  const int64_t Nq = cu_q.back() + c.pad_q, Nk = cu_k.back() + c.pad_k;
  // A dense batch (equal lengths, no rows outside) goes in with one cu_seqlens for queries and
  // keys, as the models pass it: the wgmma kernels then take the bounds from the sequence index
  // (attention_tiles.cuh, dense_seqlen), cuDNN its dense graph.
  const bool dense = Nq == Nk && Nq == int64_t(nseq) * max_seqlen && c.lq == c.lk;
  const int H = c.H, KV = c.KV, hd = c.hd;
  const double scale = 1.0 / std::sqrt(double(hd));
  const size_t nq = size_t(Nq) * H * hd, nk = size_t(Nk) * KV * hd;
  auto q = randn(nq, rng), k = randn(nk, rng), v = randn(nk, rng), dout = randn(nq, rng);
  auto qs = seen<T>(q), ks = seen<T>(k), vs = seen<T>(v), dos = seen<T>(dout);

  // CPU reference in f32 on the values the device sees
  const size_t nws = size_t(Nq) * H * (hd + 1);  // CUDA workspace: delta and the dq accumulator
  std::vector<float> out_ref(nq), lse_ref(Nq * H), dq_ref(nq), dk_ref(nk), dv_ref(nk), ws(Nq * H);
  loom::cpu::attention_forward<float>(out_ref.data(), lse_ref.data(), qs.data(), ks.data(), vs.data(),
                                      cu_q.data(), dense ? cu_q.data() : cu_k.data(), nseq, max_seqlen, Nq,
                                      Nk, H, KV, hd, c.causal, scale, nullptr);
  // the backward reference reads the device's own out (rounded), like autograd would
  Dev<T> dq_(to_t<T>(q)), dk_(to_t<T>(k)), dv_(to_t<T>(v)), ddo(to_t<T>(dout));
  Dev<int32_t> dcq(cu_q), dck_own(cu_k);
  const Dev<int32_t>& dck = dense ? dcq : dck_own;
  Dev<T> dout_(nq), ddq(nq), ddk(nk), ddv(nk);
  Dev<float> dlse(Nq * H), dws(nws);
  dout_.poison();
  dlse.poison();
  cu::attention_forward<T>(dout_.p, dlse.p, dq_.p, dk_.p, dv_.p, dcq.p, dck.p, nseq, max_seqlen, Nq, Nk,
                           H, KV, hd, c.causal, scale, cu::default_stream());
  auto out_got = to_f(dout_.down());
  auto lse_got = dlse.down();
  std::string what = std::string(tname<T>()) + " hd" + std::to_string(hd) + " H" + std::to_string(H) +
                     " KV" + std::to_string(KV) + (c.causal ? " causal" : " full") +
                     (deterministic ? " deterministic" : " fast") + (dense ? " dense" : "");
  INFO(what);
  LOOM_CHECK_CLOSE(tol::compare(out_got, out_ref, out_tol<T>(), "attention out"));
  LOOM_CHECK_CLOSE(tol::compare(inf_to_big(lse_got), inf_to_big(lse_ref), tol::kCudaF32Gemm, "attention lse"));

  // backward: both sides use the CPU reference's out and lse (the saved tensors)
  auto out_seen = seen<T>(out_ref);
  Dev<T> dout_saved(to_t<T>(out_ref));
  Dev<float> dlse_saved(lse_ref);
  loom::cpu::attention_backward<float>(dq_ref.data(), dk_ref.data(), dv_ref.data(), dos.data(), qs.data(),
                                       ks.data(), vs.data(), out_seen.data(), lse_ref.data(), ws.data(),
                                       cu_q.data(), dense ? cu_q.data() : cu_k.data(), nseq, max_seqlen, Nq,
                                       Nk, H, KV, hd, c.causal, scale, nullptr);
  ddq.poison();
  ddk.poison();
  ddv.poison();
  dws.poison();
  cu::attention_backward<T>(ddq.p, ddk.p, ddv.p, ddo.p, dq_.p, dk_.p, dv_.p, dout_saved.p, dlse_saved.p,
                            dws.p, dcq.p, dck.p, nseq, max_seqlen, Nq, Nk, H, KV, hd, c.causal, scale,
                            cu::default_stream());
  LOOM_CHECK_CLOSE(tol::compare(to_f(ddq.down()), dq_ref, gemm_tol<T>(), "attention dq"));
  LOOM_CHECK_CLOSE(tol::compare(to_f(ddk.down()), dk_ref, gemm_tol<T>(), "attention dk"));
  LOOM_CHECK_CLOSE(tol::compare(to_f(ddv.down()), dv_ref, gemm_tol<T>(), "attention dv"));

  // A second backward over the same (dirty) workspace. dk and dv are written by one block per
  // row in both settings: the same bits. dq too when deterministic; with atomic dq it must
  // still match the reference.
  auto dq1 = ddq.down(), dk1 = ddk.down(), dv1 = ddv.down();
  ddq.poison();
  ddk.poison();
  ddv.poison();
  cu::attention_backward<T>(ddq.p, ddk.p, ddv.p, ddo.p, dq_.p, dk_.p, dv_.p, dout_saved.p, dlse_saved.p,
                            dws.p, dcq.p, dck.p, nseq, max_seqlen, Nq, Nk, H, KV, hd, c.causal, scale,
                            cu::default_stream());
  auto dq2 = ddq.down(), dk2 = ddk.down(), dv2 = ddv.down();
  if (deterministic)
    CHECK(std::memcmp(dq1.data(), dq2.data(), sizeof(T) * dq1.size()) == 0);
  else
    LOOM_CHECK_CLOSE(tol::compare(to_f(dq2), dq_ref, gemm_tol<T>(), "attention dq (second run)"));
  CHECK(std::memcmp(dk1.data(), dk2.data(), sizeof(T) * dk1.size()) == 0);
  CHECK(std::memcmp(dv1.data(), dv2.data(), sizeof(T) * dv1.size()) == 0);
}

const std::vector<AttnCase>& attn_cases() {
  static const std::vector<AttnCase> cases = {
      // ragged lengths, padding rows after the last sequence, GQA 3:1, the tiny-model head dim
      {{7, 1, 13, 5}, {7, 1, 13, 5}, 3, 2, 6, 2, 16, false},
      {{7, 1, 13, 5}, {7, 1, 13, 5}, 3, 2, 6, 2, 16, true},
      // a CUDA run's rounded batch shapes (trainer.cpp, round_batch_shapes): empty sequences at
      // the end of cu_seqlens and max_seqlen above the longest; the LM's heads (9:3, hd 64)
      {{7, 1, 13, 5, 0, 0, 0}, {7, 1, 13, 5, 0, 0, 0}, 3, 3, 6, 2, 16, true, 256},
      {{700, 300, 90, 0, 0, 0}, {700, 300, 90, 0, 0, 0}, 48, 48, 9, 3, 64, true, 1024},
      // tile boundaries (64 / 128 rows), several K tiles, H == KV
      {{130, 67, 1}, {130, 67, 1}, 5, 0, 4, 4, 64, false},
      {{130, 67, 1}, {130, 67, 1}, 0, 5, 4, 4, 64, true},
      // hd 128, GQA 4:1, two query tiles in dk/dv and dq
      {{200, 33}, {200, 33}, 2, 1, 4, 1, 128, true},
      {{200, 33}, {200, 33}, 0, 0, 4, 1, 128, false},
      // decode: one query over many keys (bottom-right causal), and Lq = 3 over 10 keys
      {{1, 1, 1, 3}, {9, 77, 130, 10}, 1, 2, 8, 2, 64, true},
      // more queries than keys, causal: the first queries see nothing (out 0, lse +inf)
      {{5, 70}, {3, 66}, 0, 0, 2, 1, 32, true},
      // N = 1; and a head dim v2 does not cover (v1 for bf16 too)
      {{1}, {1}, 0, 0, 1, 1, 32, false},
      {{19, 8}, {19, 8}, 2, 0, 3, 3, 40, true},
      // several key tiles and several query tiles per block (128 / 64 at hd 128 and 64), ragged,
      // GQA, padding rows: every dq row gets additions from several blocks
      {{300, 129, 1}, {300, 129, 1}, 3, 2, 4, 2, 128, true},
      {{300, 129, 1}, {300, 129, 1}, 0, 0, 4, 2, 128, false},
      {{300, 129, 1}, {300, 129, 1}, 2, 3, 6, 2, 64, true},
      {{300, 129, 1}, {300, 129, 1}, 0, 1, 6, 2, 64, false},
      // Lq != Lk across tiles, causal: shift 190 and -60 (the first 60 queries see nothing)
      {{100, 260}, {290, 200}, 1, 1, 4, 2, 128, true},
      {{100, 260}, {290, 200}, 0, 2, 4, 4, 64, true},
      // long sequences: the warp-specialized forward's K/V ring (2 buffers at hd 128, 3 at
      // hd 64) wraps several times; a chunk of 150 queries at the end of 1000 keys
      {{900, 40}, {900, 40}, 0, 1, 2, 1, 128, false},
      {{1100, 7}, {1100, 7}, 1, 0, 3, 1, 64, true},
      {{150, 9}, {1000, 9}, 0, 0, 2, 2, 128, true},
      // dense batches (one cu_seqlens, every sequence max_seqlen long): the MIM ViT's 196
      // tokens (a partial last tile), several tiles with GQA, hd 128, and 800 tokens (the
      // warp-specialized forward by default at hd 64)
      {{196, 196}, {196, 196}, 0, 0, 4, 4, 64, false},
      {{256, 256, 256}, {256, 256, 256}, 0, 0, 6, 2, 64, true},
      {{300, 300}, {300, 300}, 0, 0, 4, 2, 128, true},
      {{800, 800}, {800, 800}, 0, 0, 2, 1, 64, false},
      // sequences of at most 64 rows at hd 64: one warpgroup a forward block; dense, the
      // backward stores dq from its block (50 tokens, near the MIM encoder's 49 kept patches;
      // causal with GQA, each block walking its group's three heads), ragged with padding rows
      // through dq_acc
      {{50, 50, 50}, {50, 50, 50}, 0, 0, 4, 4, 64, false},
      {{64, 64}, {64, 64}, 0, 0, 6, 2, 64, true},
      {{33, 64, 5}, {33, 64, 5}, 2, 1, 4, 2, 64, true},
      // 65-256 rows at hd 64: one forward block a sequence and head (attn_fwd_whole); all four
      // query and key tiles beside sequences of one and two tiles, GQA 3:1, padding rows; causal
      // with more queries than keys (shift -50 and -4: the first queries see nothing)
      {{256, 65, 1}, {256, 65, 1}, 0, 2, 3, 1, 64, false},
      {{200, 70}, {150, 66}, 1, 1, 6, 2, 64, true},
      // the whole-sequence forward's last key tile of 26 keys (m64n32 products) and of 48 (whole);
      // the cases above give it 4, 1, 22, 2 and 9 keys (m64n16, m64n32) and last query tiles of
      // 1, 8 and 6 rows (tail_key_tile: four warps, partial softmaxes merged; causal, keys above
      // the diagonal, rows that see nothing); here 15 rows (79) and 16 (144) beside 26 (90)
      {{90, 112}, {90, 112}, 0, 3, 4, 4, 64, false},
      {{79, 144, 90}, {79, 144, 90}, 0, 1, 6, 3, 64, true},
      // a sequence with no keys at all beside one with keys: its rows get out 0, lse +inf
      {{70, 5}, {0, 9}, 0, 1, 4, 2, 64, false},
  };
  return cases;
}

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

TEST_CASE("attention forward/backward f32 (v1) against the CPU reference", "[cuda][attention]") {
  need_gpu();
  const bool was = cu::deterministic_attention();
  uint32_t seed = 100;
  for (const auto& c : attn_cases()) {  // v1: one path, deterministic; f16 runs the same kernel
    run_attention<float>(c, seed, true);
    run_attention<f16>(c, seed++, true);
  }
  cu::set_deterministic_attention(was);
}

// On an H100/H200 build for sm_90a the bf16 forward at hd 64/128 is the warp-specialized wgmma
// kernel (attention_sm90_ws.cu) from 768 tokens (hd 64) / 256 (hd 128) and the lock-step one (attention_sm90.cu)
// below (one warpgroup a block for sequences of at most 64 rows at hd 64, one block a sequence
// and head for 65-256 rows, its last key tile as m64n16 / m64n32 products when it holds at most 16 / 32 keys and
// a last query tile of at most 16 rows on mma.sync, a warp a key tile, and the last two key tiles as one of 80 keys
// when the last holds at most 16: the default and last sections (the one before them with the two key tiles apart,
// LOOM_ATTN_JOIN_LAST=0), and every tile whole with LOOM_ATTN_SHORT_TILE=0 LOOM_ATTN_TAIL=0; LOOM_ATTN_WHOLE=0
// turns it off), except causal hd 64
// batches of short sequences (< 512 rows a sequence on average), which
// run the lock-step one with 2 x 64-key tiles (the default and last sections below, the only ones
// that run that configuration with the causal mask); the case below runs everything again with
// the warp-specialized kernel on every shape (LOOM_ATTN_WS_MIN=0), with the lock-step one (LOOM_ATTN_SM90=1) and with both turned off, so
// the mma.sync forward (v2) stays tested on the machine that has all three. The backward there is
// the warp-specialized wgmma one (attention_sm90_bwd.cu) from 128 tokens (512 for causal hd 64)
// and the mma.sync single pass below; the last section runs the wgmma backward on every case
// (LOOM_ATTN_BWD_WS_MIN=0); LOOM_ATTN_SM90=0 turns it off with the wgmma forwards. The sections
// other than the default one also put the blocks in chunks of 2 or 3 pairs (LOOM_ATTN_CHUNK_PAIRS;
// the test shapes fit one chunk by default), so that the block -> tile mappings of the
// warp-specialized forward and of both single-pass backwards run with several chunks and a
// short last one. The dense cases take their bounds from the sequence index in the wgmma
// kernels (attention_tiles.cuh, dense_seqlen) except in the second section, which reads them
// from cu_seqlens (LOOM_ATTN_DENSE=0). The wgmma backward takes the blocks of batches of unequal
// sequences longest first (BwdOrder, attention_tiles.cuh) in every section but the one with
// LOOM_ATTN_BWD_ORDER=0, which keeps block_tile's chunked order for them.
TEST_CASE("attention forward/backward bf16 (v2 tensor cores) against the CPU reference", "[cuda][attention]") {
  need_gpu();
  const char* before = std::getenv("LOOM_ATTN_SM90");
  const std::string saved = before ? before : "";
  const char* before_min = std::getenv("LOOM_ATTN_WS_MIN");
  const std::string saved_min = before_min ? before_min : "";
  const char* before_bwd = std::getenv("LOOM_ATTN_BWD_WS_MIN");
  const std::string saved_bwd = before_bwd ? before_bwd : "";
  const char* before_chunk = std::getenv("LOOM_ATTN_CHUNK_PAIRS");
  const std::string saved_chunk = before_chunk ? before_chunk : "";
  const char* before_dense = std::getenv("LOOM_ATTN_DENSE");
  const std::string saved_dense = before_dense ? before_dense : "";
  const char* before_ws64 = std::getenv("LOOM_ATTN_WS64");
  const std::string saved_ws64 = before_ws64 ? before_ws64 : "";
  const char* before_order = std::getenv("LOOM_ATTN_BWD_ORDER");
  const std::string saved_order = before_order ? before_order : "";
  const char* before_short = std::getenv("LOOM_ATTN_SHORT_TILE");
  const std::string saved_short = before_short ? before_short : "";
  const char* before_tail = std::getenv("LOOM_ATTN_TAIL");
  const std::string saved_tail = before_tail ? before_tail : "";
  const char* before_join = std::getenv("LOOM_ATTN_JOIN_LAST");
  const std::string saved_join = before_join ? before_join : "";
  SECTION("the default forward (on sm_90a: warp-specialized from 768 / 256 tokens, lock-step below and for "
          "causal hd 64 batches of short sequences)") {}
  SECTION("the warp-specialized wgmma forward on every shape (LOOM_ATTN_WS_MIN=0), chunks of 2 pairs, "
          "dense batches through their offsets (LOOM_ATTN_DENSE=0)") {
    setenv("LOOM_ATTN_WS_MIN", "0", 1);
    setenv("LOOM_ATTN_CHUNK_PAIRS", "2", 1);
    setenv("LOOM_ATTN_DENSE", "0", 1);
  }
  SECTION("the warp-specialized forward at hd 64 with four consumers and 64-key tiles on every shape "
          "(LOOM_ATTN_WS_MIN=0, LOOM_ATTN_WS64=4)") {
    setenv("LOOM_ATTN_WS_MIN", "0", 1);
    setenv("LOOM_ATTN_WS64", "4", 1);
  }
  SECTION("the whole-sequence forward with every key tile and every last query tile computed whole "
          "(LOOM_ATTN_SHORT_TILE=0, LOOM_ATTN_TAIL=0)") {
    setenv("LOOM_ATTN_SHORT_TILE", "0", 1);
    setenv("LOOM_ATTN_TAIL", "0", 1);
  }
  SECTION("the lock-step wgmma forward (LOOM_ATTN_SM90=1), chunks of 3 pairs") {
    setenv("LOOM_ATTN_SM90", "1", 1);
    setenv("LOOM_ATTN_CHUNK_PAIRS", "3", 1);
  }
  SECTION("the mma.sync forward and backward (LOOM_ATTN_SM90=0), chunks of 2 pairs") {
    setenv("LOOM_ATTN_SM90", "0", 1);
    setenv("LOOM_ATTN_CHUNK_PAIRS", "2", 1);
  }
  SECTION("the warp-specialized wgmma backward on every shape in block_tile's order (LOOM_ATTN_BWD_WS_MIN=0, "
          "LOOM_ATTN_BWD_ORDER=0), chunks of 3 pairs; the whole-sequence forward's last two key tiles apart "
          "(LOOM_ATTN_JOIN_LAST=0)") {
    setenv("LOOM_ATTN_JOIN_LAST", "0", 1);
    setenv("LOOM_ATTN_BWD_WS_MIN", "0", 1);
    setenv("LOOM_ATTN_BWD_ORDER", "0", 1);
    setenv("LOOM_ATTN_CHUNK_PAIRS", "3", 1);
  }
  SECTION("the warp-specialized wgmma backward on every shape (LOOM_ATTN_BWD_WS_MIN=0), chunks of 3 pairs") {
    setenv("LOOM_ATTN_BWD_WS_MIN", "0", 1);
    setenv("LOOM_ATTN_CHUNK_PAIRS", "3", 1);
  }
  const bool was = cu::deterministic_attention();
  uint32_t seed = 200;
  for (const auto& c : attn_cases()) {
    run_attention<bf16>(c, seed, false);  // single pass, atomic dq
    run_attention<bf16>(c, seed, true);   // two passes, bitwise reproducible
    seed++;
  }
  cu::set_deterministic_attention(was);
  if (before) setenv("LOOM_ATTN_SM90", saved.c_str(), 1);
  else unsetenv("LOOM_ATTN_SM90");
  if (before_min) setenv("LOOM_ATTN_WS_MIN", saved_min.c_str(), 1);
  else unsetenv("LOOM_ATTN_WS_MIN");
  if (before_bwd) setenv("LOOM_ATTN_BWD_WS_MIN", saved_bwd.c_str(), 1);
  else unsetenv("LOOM_ATTN_BWD_WS_MIN");
  if (before_chunk) setenv("LOOM_ATTN_CHUNK_PAIRS", saved_chunk.c_str(), 1);
  else unsetenv("LOOM_ATTN_CHUNK_PAIRS");
  if (before_dense) setenv("LOOM_ATTN_DENSE", saved_dense.c_str(), 1);
  else unsetenv("LOOM_ATTN_DENSE");
  if (before_ws64) setenv("LOOM_ATTN_WS64", saved_ws64.c_str(), 1);
  else unsetenv("LOOM_ATTN_WS64");
  if (before_order) setenv("LOOM_ATTN_BWD_ORDER", saved_order.c_str(), 1);
  else unsetenv("LOOM_ATTN_BWD_ORDER");
  if (before_short) setenv("LOOM_ATTN_SHORT_TILE", saved_short.c_str(), 1);
  else unsetenv("LOOM_ATTN_SHORT_TILE");
  if (before_tail) setenv("LOOM_ATTN_TAIL", saved_tail.c_str(), 1);
  else unsetenv("LOOM_ATTN_TAIL");
  if (before_join) setenv("LOOM_ATTN_JOIN_LAST", saved_join.c_str(), 1);
  else unsetenv("LOOM_ATTN_JOIN_LAST");
}

// attention_backward_qkv (kernels.inc): the gradient of a joined q|k|v product's rows. bf16 at
// hd 64 with sequences of >= 512 tokens takes loom's warp-specialized backward writing the rows
// itself (dk rotated in its store, dq in the finish); LOOM_ATTN_QKV_JOIN=0 the two calls
// (attention_backward into a scratch, rope_qkv_join). Both against the CPU reference (those two
// calls in f32), and against each other: the k and v parts equal value for value (bit for bit but
// for the sign of zeros: the two calls rotate the zeroed rows outside every sequence, which can
// give -0), the q part within the atomic dq's run-to-run spread. Positions run past rope_table.h's table (the double formula
// there), rows outside every sequence get zeros in k and v, outputs start poisoned.
// Without RoPE (pos null: a ViT's joined product, qkv_attention) the rows are dq | dk | dv as they
// are: a dense batch of 49-token sequences takes the one-tile backward storing all three into the
// rows (dq bit for bit the two calls' too: the same kernel with other row strides), 196-token and
// packed batches of >= 128 tokens the warp-specialized one, short packed ones the two calls
// (attention_backward, three strided copies) either way.
TEST_CASE("attention_backward_qkv: the joined q|k|v gradient rows against the two calls", "[cuda][attention]") {
  need_gpu();
  const char* before = std::getenv("LOOM_ATTN_QKV_JOIN");
  const std::string saved = before ? before : "";
  struct Case { std::vector<int> len; int pad, H, KV; bool causal, rope = true, same_dq = false; };
  const Case cases[] = {{{700, 513, 64, 901}, 5, 9, 3, true},
                        {{530, 260}, 0, 4, 2, true},
                        {{600, 131}, 3, 2, 1, false},
                        {std::vector<int>(37, 49), 0, 12, 12, false, false, true},  // the MIM encoder's rows
                        {std::vector<int>(9, 196), 0, 6, 6, false, false},          // the predictor's / a tower's
                        {{130, 77, 196}, 3, 4, 2, false, false},
                        {{40, 33}, 2, 2, 2, false, false}};
  uint32_t seed = 900;
  for (const Case& c : cases) {
    std::mt19937 rng(seed++);
    const int nseq = int(c.len.size()), hd = 64, H = c.H, KV = c.KV;
    std::vector<int32_t> cu{0};
    int max_seqlen = 0;
    for (int l : c.len) {
      cu.push_back(cu.back() + l);
      max_seqlen = std::max(max_seqlen, l);
    }
    const int64_t N = cu.back() + c.pad, W = int64_t(H + 2 * KV) * hd;
    const double scale = 1.0 / std::sqrt(double(hd)), theta = 10000.0;
    // positions within each sequence, a stretch of them past the table (65536 rows at most)
    std::vector<int32_t> pos(N);
    for (int64_t i = 0; i < N; i++) pos[i] = int32_t(i % 977) + (i % 5 == 3 ? 70000 : 0);
    const size_t nq = size_t(N) * H * hd, nk = size_t(N) * KV * hd;
    auto q = randn(nq, rng), k = randn(nk, rng), v = randn(nk, rng), dout = randn(nq, rng);
    auto qs = seen<bf16>(q), ks = seen<bf16>(k), vs = seen<bf16>(v), dos = seen<bf16>(dout);
    std::vector<float> out(nq), lse(N * H), ws(N * H), ref(N * W);
    loom::cpu::attention_forward<float>(out.data(), lse.data(), qs.data(), ks.data(), vs.data(), cu.data(), cu.data(),
                                        nseq, max_seqlen, N, N, H, KV, hd, c.causal, scale, nullptr);
    auto outs = seen<bf16>(out);
    const int32_t* hpos = c.rope ? pos.data() : nullptr;
    loom::cpu::attention_backward_qkv<float>(ref.data(), dos.data(), qs.data(), ks.data(), vs.data(), outs.data(),
                                             lse.data(), ws.data(), cu.data(), hpos, nseq, max_seqlen, N, H, KV,
                                             hd, c.causal, scale, theta, nullptr);
    Dev<bf16> dq(to_t<bf16>(q)), dk(to_t<bf16>(k)), dv(to_t<bf16>(v)), ddo(to_t<bf16>(dout)), dout_(to_t<bf16>(out));
    Dev<float> dlse(lse), dws(size_t(N) * H * (hd + 1));
    Dev<int32_t> dcu(cu), dpos(pos);
    // one call on poisoned rows and workspace, checked against the reference; returns the rows
    auto rows = [&](const std::string& how) {
      INFO("lengths " << c.len.size() << " H" << H << " KV" << KV << (c.causal ? " causal" : " full")
                      << (c.rope ? " rope " : " no rope ") << how);
      Dev<bf16> dqkv(size_t(N) * W);
      dqkv.poison();
      dws.poison();
      cu::attention_backward_qkv<bf16>(dqkv.p, ddo.p, dq.p, dk.p, dv.p, dout_.p, dlse.p, dws.p, dcu.p,
                                       c.rope ? dpos.p : nullptr, nseq, max_seqlen, N, H, KV, hd, c.causal, scale,
                                       theta, cu::default_stream());
      std::vector<bf16> r = dqkv.down();
      LOOM_CHECK_CLOSE(tol::compare(to_f(r), ref, gemm_tol<bf16>(), "dqkv rows"));
      return r;
    };
    std::vector<std::vector<bf16>> got;
    for (const char* join : {"1", "0"}) {
      setenv("LOOM_ATTN_QKV_JOIN", join, 1);
      got.push_back(rows(std::string("LOOM_ATTN_QKV_JOIN=") + join));
    }
    std::vector<float> q0, q1;
    int64_t kv_differ = 0;
    for (int64_t n = 0; n < N; n++) {
      const bf16* a = got[0].data() + n * W;
      const bf16* b = got[1].data() + n * W;
      for (int64_t i = H * hd; i < W; i++) kv_differ += float(a[i]) != float(b[i]);  // k | v
      for (int i = 0; i < H * hd; i++) {
        q0.push_back(float(a[i]));
        q1.push_back(float(b[i]));
      }
    }
    CHECK(kv_differ == 0);
    LOOM_CHECK_CLOSE(tol::compare(q0, q1, gemm_tol<bf16>(), "dq rows, joined against the two calls"));
    if (c.same_dq) CHECK(q0 == q1);
    // train.attention = auto: the first call probes both backends on the two calls' scratch,
    // the second runs the cached choice (loom's kernels: the joined rows; cuDNN: its plan with
    // strided gradients for a dense batch it takes in one call, test_cuda_attention_cudnn.cpp)
    setenv("LOOM_ATTN_QKV_JOIN", "1", 1);
    const cu::AttentionBackend was = cu::attention_backend();
    cu::set_attention_backend(cu::AttentionBackend::Auto);
    cu::reset_attention_choices();
    for (int run = 0; run < 2; run++) rows("auto, call " + std::to_string(run));
    cu::set_attention_backend(was);
    cu::reset_attention_choices();
  }
  if (before) setenv("LOOM_ATTN_QKV_JOIN", saved.c_str(), 1);
  else unsetenv("LOOM_ATTN_QKV_JOIN");
}

TEST_CASE("attention: invalid head configuration throws with the sizes", "[cuda][attention]") {
  need_gpu();
  REQUIRE_THROWS_WITH(cu::attention_forward<float>(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                                   nullptr, 1, 4, 4, 4, 6, 4, 16, false, 0.25,
                                                   cu::default_stream()),
                      Catch::Contains("H=6 KV=4"));
}

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
