// test_cuda_attention_cudnn.cpp: the cuDNN attention backend (kernels/cuda/attention_cudnn.cu)
// and the train.attention choice against the loom::cpu reference, forward and backward.
//
// bf16 runs round random f32 data to bf16, give the rounded values to the CPU (f32) and compare
// with tol::kCudaBF16; every output (out, lse, dq, dk, dv) and the workspace are poisoned with
// NaN before each launch, so an unwritten row fails. Shapes reach every branch of the backend:
// ragged cu_seqlens with rows outside every sequence (before the first and after the last),
// GQA (H/KV 3 and 4) and H == KV, Lq != Lk both ways, a decode step (Lq = 1 against a KV cache),
// causal (bottom-right) and not, head dims 64 and 128 (16, the fixtures' head dim; 32), batches
// that share a plan bucket, dense batches (the graph without ragged offsets; a count not a
// multiple of 8 as two calls), f32 inputs through `cudnn`, `auto`, and the errors of `cudnn`.
// Exits with code 4 (ctest: skipped) when no GPU is present.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "tests/cuda/vec_test_util.h"

namespace {

struct Case {
  std::vector<int> lq, lk;
  int lead_q, lead_k;  // rows before the first sequence (cu[0] > 0)
  int pad_q, pad_k;    // rows after the last sequence
  int H, KV, hd;
  bool causal;
};

std::string describe(const Case& c) {
  std::string s = "H" + std::to_string(c.H) + " KV" + std::to_string(c.KV) + " hd" + std::to_string(c.hd) +
                  (c.causal ? " causal" : " full") + " Lq";
  for (int x : c.lq) s += " " + std::to_string(x);
  s += " Lk";
  for (int x : c.lk) s += " " + std::to_string(x);
  return s;
}

// One forward + backward through the current backend setting; T = bf16 or float (float runs
// through cuDNN in bf16: the reference sees bf16-rounded inputs either way).
// one_cu: queries and keys share one cu_seqlens array (self-attention as the models call it;
// with every sequence max_seqlen long that is the dense bucket of the backend)
template <class T>
void run_case(const Case& c, uint32_t seed, bool one_cu = false) {
  std::mt19937 rng(seed);
  const int nseq = int(c.lq.size());
  std::vector<int32_t> cu_q{c.lead_q}, cu_k{c.lead_k};
  int max_seqlen = 0;
  for (int i = 0; i < nseq; i++) {
    cu_q.push_back(cu_q.back() + c.lq[i]);
    cu_k.push_back(cu_k.back() + c.lk[i]);
    max_seqlen = std::max({max_seqlen, c.lq[i], c.lk[i]});
  }
  const int64_t Nq = cu_q.back() + c.pad_q, Nk = cu_k.back() + c.pad_k;
  const int H = c.H, KV = c.KV, hd = c.hd;
  const double scale = 1.0 / std::sqrt(double(hd));
  const size_t nq = size_t(Nq) * H * hd, nk = size_t(Nk) * KV * hd;
  auto q = seen<bf16>(randn(nq, rng)), k = seen<bf16>(randn(nk, rng)), v = seen<bf16>(randn(nk, rng)),
       dout = seen<bf16>(randn(nq, rng));
  INFO(describe(c) + (std::is_same<T, float>::value ? " f32" : " bf16") + " backend " +
       cu::attention_backend_name(cu::attention_backend()));

  std::vector<float> out_ref(nq), lse_ref(size_t(Nq) * H), dq_ref(nq), dk_ref(nk), dv_ref(nk), ws(size_t(Nq) * H);
  loom::cpu::attention_forward<float>(out_ref.data(), lse_ref.data(), q.data(), k.data(), v.data(), cu_q.data(),
                                      cu_k.data(), nseq, max_seqlen, Nq, Nk, H, KV, hd, c.causal, scale, nullptr);
  Dev<T> dq_in(to_t<T>(q)), dk_in(to_t<T>(k)), dv_in(to_t<T>(v)), ddo(to_t<T>(dout));
  Dev<int32_t> dcq(cu_q), dck_own(cu_k);
  REQUIRE((!one_cu || cu_q == cu_k));
  const int32_t* cuk = one_cu ? dcq.p : dck_own.p;
  Dev<T> dout_(nq), ddq(nq), ddk(nk), ddv(nk);
  Dev<float> dlse(size_t(Nq) * H), dws(size_t(Nq) * H * (hd + 1));
  dout_.poison();
  dlse.poison();
  cu::attention_forward<T>(dout_.p, dlse.p, dq_in.p, dk_in.p, dv_in.p, dcq.p, cuk, nseq, max_seqlen, Nq, Nk, H,
                           KV, hd, c.causal, scale, cu::default_stream());
  LOOM_CHECK_CLOSE(tol::compare(to_f(dout_.down()), out_ref, tol::kCudaBF16, "attention out"));
  LOOM_CHECK_CLOSE(tol::compare(inf_to_big(dlse.down()), inf_to_big(lse_ref), tol::kCudaF32Gemm, "attention lse"));

  // backward from the reference's saved tensors (out rounded to the device type)
  auto out_seen = seen<bf16>(out_ref);
  Dev<T> dsaved(to_t<T>(out_seen));
  Dev<float> dlse_saved(lse_ref);
  loom::cpu::attention_backward<float>(dq_ref.data(), dk_ref.data(), dv_ref.data(), dout.data(), q.data(), k.data(),
                                       v.data(), out_seen.data(), lse_ref.data(), ws.data(), cu_q.data(), cu_k.data(),
                                       nseq, max_seqlen, Nq, Nk, H, KV, hd, c.causal, scale, nullptr);
  for (int run = 0; run < 2; run++) {  // the second over a dirty workspace
    ddq.poison();
    ddk.poison();
    ddv.poison();
    if (run == 0) dws.poison();
    cu::attention_backward<T>(ddq.p, ddk.p, ddv.p, ddo.p, dq_in.p, dk_in.p, dv_in.p, dsaved.p, dlse_saved.p, dws.p,
                              dcq.p, cuk, nseq, max_seqlen, Nq, Nk, H, KV, hd, c.causal, scale,
                              cu::default_stream());
    LOOM_CHECK_CLOSE(tol::compare(to_f(ddq.down()), dq_ref, tol::kCudaBF16, "attention dq"));
    LOOM_CHECK_CLOSE(tol::compare(to_f(ddk.down()), dk_ref, tol::kCudaBF16, "attention dk"));
    LOOM_CHECK_CLOSE(tol::compare(to_f(ddv.down()), dv_ref, tol::kCudaBF16, "attention dv"));
  }
}

const std::vector<Case>& cases() {
  static const std::vector<Case> cs = {
      // ragged lengths, rows outside before and after, GQA 3:1, hd 64
      {{7, 1, 130, 65}, {7, 1, 130, 65}, 2, 2, 3, 1, 6, 2, 64, false},
      {{7, 1, 130, 65}, {7, 1, 130, 65}, 0, 0, 0, 4, 6, 2, 64, true},
      // hd 128, GQA 4:1, several tiles; the second batch has 3 sequences in the same bucket (B 4)
      {{300, 129, 1}, {300, 129, 1}, 0, 0, 2, 1, 4, 1, 128, true},
      {{300, 129, 1, 64}, {300, 129, 1, 64}, 1, 1, 0, 0, 4, 1, 128, false},
      // H == KV
      {{200, 33}, {200, 33}, 0, 0, 0, 0, 4, 4, 64, true},
      // decode: one query against a KV cache (bottom-right causal), and Lq = 3 over 10 keys
      {{1, 1, 1, 3}, {9, 77, 130, 10}, 0, 0, 1, 2, 8, 2, 64, true},
      {{1, 1, 1, 3}, {9, 77, 130, 10}, 0, 0, 1, 2, 8, 2, 128, true},
      // Lq != Lk, bidirectional and causal with Lq < Lk
      {{100, 20}, {290, 200}, 0, 0, 1, 1, 4, 2, 128, false},
      {{100, 20}, {290, 200}, 0, 0, 0, 2, 4, 4, 64, true},
  };
  return cs;
}

struct BackendScope {  // restores the setting and auto's choices
  cu::AttentionBackend was = cu::attention_backend();
  explicit BackendScope(cu::AttentionBackend b) {
    cu::set_attention_backend(b);
    cu::reset_attention_choices();
  }
  ~BackendScope() {
    cu::set_attention_backend(was);
    cu::reset_attention_choices();
  }
};

}  // namespace

TEST_CASE("cudnn attention bf16 forward/backward against the CPU reference", "[cuda][attention][cudnn]") {
  need_gpu();
  BackendScope scope(cu::AttentionBackend::Cudnn);
  uint32_t seed = 900;
  for (const auto& c : cases()) run_case<bf16>(c, seed++);
}

TEST_CASE("cudnn attention: dense batches run the graph without offsets or padding mask", "[cuda][attention][cudnn]") {
  need_gpu();
  BackendScope scope(cu::AttentionBackend::Cudnn);
  const int before = cu::attention_cudnn_dense_plans();
  // every sequence max_seqlen long, one cu_seqlens: S not a power of two, GQA 2:1, causal;
  // hd 128 bidirectional with H == KV; one sequence of hd 16 (the ViT fixtures' head dim)
  run_case<bf16>({{96, 96, 96}, {96, 96, 96}, 0, 0, 0, 0, 4, 2, 64, true}, 990, true);
  run_case<bf16>({{128, 128}, {128, 128}, 0, 0, 0, 0, 3, 3, 128, false}, 991, true);
  run_case<float>({{50}, {50}, 0, 0, 0, 0, 2, 1, 16, true}, 992, true);
  CHECK(cu::attention_cudnn_dense_plans() - before == 6);  // forward and backward of each: none fell back
  // the same lengths with separate arrays, or one sequence shorter: the ragged graph
  run_case<bf16>({{96, 96, 96}, {96, 96, 96}, 0, 0, 0, 0, 4, 2, 64, true}, 993);
  run_case<bf16>({{96, 95, 96}, {96, 95, 96}, 0, 0, 0, 1, 4, 2, 64, true}, 994, true);
  CHECK(cu::attention_cudnn_dense_plans() - before == 6);
}

TEST_CASE("cudnn attention: a dense batch of a count not a multiple of 8 runs as two calls", "[cuda][attention][cudnn]") {
  need_gpu();
  auto dense = [](int n, int S, int H, int KV, bool causal) {
    return Case{std::vector<int>(size_t(n), S), std::vector<int>(size_t(n), S), 0, 0, 0, 0, H, KV, 64, causal};
  };
  {
    BackendScope scope(cu::AttentionBackend::Cudnn);
    const int before = cu::attention_cudnn_dense_plans();
    run_case<bf16>(dense(11, 70, 3, 3, false), 995, true);  // 8 + 3: two plans a direction
    CHECK(cu::attention_cudnn_dense_plans() - before == 4);
    run_case<bf16>(dense(13, 70, 3, 3, false), 996, true);  // 8 (planned) + 5
    CHECK(cu::attention_cudnn_dense_plans() - before == 6);
    run_case<bf16>(dense(8, 70, 3, 3, false), 997, true);   // one call, planned
    CHECK(cu::attention_cudnn_dense_plans() - before == 6);
    run_case<bf16>(dense(17, 50, 4, 2, true), 998, true);   // 16 + 1, causal, GQA
    run_case<float>(dense(10, 33, 2, 1, false), 999, true);  // f32 through bf16: 8 + 2
  }
  {
    BackendScope scope(cu::AttentionBackend::Auto);
    run_case<bf16>(dense(11, 70, 3, 3, false), 1000, true);  // the probes of both parts
    run_case<bf16>(dense(11, 70, 3, 3, false), 1001, true);  // the cached choices
    run_case<float>(dense(11, 70, 3, 3, false), 1002, true);  // f32 under auto: ours, one call
  }
}

// attention_backward_qkv without RoPE (a ViT block's joined q | k | v product) where cuDNN runs
// the backward: a dense batch cuDNN takes in one call has a plan with strided gradients write
// dq | dk | dv into the rows [N, (H + 2 KV) hd] (one more dense plan); a count cuDNN takes as
// two calls (11) and LOOM_ATTN_QKV_JOIN=0 go through the packed gradients and copies. Each
// against the CPU reference on poisoned rows; then under auto (the probe, then the choice).
TEST_CASE("cudnn attention: the joined q|k|v gradient rows of attention_backward_qkv", "[cuda][attention][cudnn]") {
  need_gpu();
  const char* before = std::getenv("LOOM_ATTN_QKV_JOIN");
  const std::string saved = before ? before : "";
  struct QCase { int nseq, S, H, KV; bool causal, one_call; };
  const QCase cases_qkv[] = {{16, 196, 4, 4, false, true}, {8, 96, 4, 2, true, true}, {11, 70, 3, 3, false, false}};
  uint32_t seed = 1100;
  for (const QCase& c : cases_qkv) {
    std::mt19937 rng(seed++);
    const int hd = 64, H = c.H, KV = c.KV;
    std::vector<int32_t> cu{0};
    for (int i = 0; i < c.nseq; i++) cu.push_back(cu.back() + c.S);
    const int64_t N = cu.back(), W = int64_t(H + 2 * KV) * hd;
    const double scale = 1.0 / std::sqrt(double(hd));
    const size_t nq = size_t(N) * H * hd, nk = size_t(N) * KV * hd;
    auto q = seen<bf16>(randn(nq, rng)), k = seen<bf16>(randn(nk, rng)), v = seen<bf16>(randn(nk, rng)),
         dout = seen<bf16>(randn(nq, rng));
    std::vector<float> out(nq), lse(size_t(N) * H), ws(size_t(N) * H), ref(size_t(N) * W);
    loom::cpu::attention_forward<float>(out.data(), lse.data(), q.data(), k.data(), v.data(), cu.data(), cu.data(),
                                        c.nseq, c.S, N, N, H, KV, hd, c.causal, scale, nullptr);
    out = seen<bf16>(out);
    loom::cpu::attention_backward_qkv<float>(ref.data(), dout.data(), q.data(), k.data(), v.data(), out.data(),
                                             lse.data(), ws.data(), cu.data(), nullptr, c.nseq, c.S, N, H, KV, hd,
                                             c.causal, scale, 10000.0, nullptr);
    Dev<bf16> dq(to_t<bf16>(q)), dk(to_t<bf16>(k)), dv(to_t<bf16>(v)), ddo(to_t<bf16>(dout)), dout_(to_t<bf16>(out));
    Dev<float> dlse(lse), dws(size_t(N) * H * (hd + 1));
    Dev<int32_t> dcu(cu);
    auto rows = [&](const std::string& how) {
      INFO(c.nseq << " x " << c.S << " H" << H << " KV" << KV << (c.causal ? " causal " : " full ") << how);
      Dev<bf16> dqkv(size_t(N) * W);
      dqkv.poison();
      dws.poison();
      cu::attention_backward_qkv<bf16>(dqkv.p, ddo.p, dq.p, dk.p, dv.p, dout_.p, dlse.p, dws.p, dcu.p, nullptr,
                                       c.nseq, c.S, N, H, KV, hd, c.causal, scale, 10000.0, cu::default_stream());
      LOOM_CHECK_CLOSE(tol::compare(to_f(dqkv.down()), ref, tol::kCudaBF16, "dqkv rows"));
    };
    {
      BackendScope scope(cu::AttentionBackend::Cudnn);
      setenv("LOOM_ATTN_QKV_JOIN", "1", 1);
      const int plans = cu::attention_cudnn_dense_plans();
      rows("cudnn, joined");
      if (c.one_call) CHECK(cu::attention_cudnn_dense_plans() - plans == 1);  // the strided plan
      rows("cudnn, joined again");
      setenv("LOOM_ATTN_QKV_JOIN", "0", 1);
      rows("cudnn, packed gradients and copies");
    }
    {
      BackendScope scope(cu::AttentionBackend::Auto);
      setenv("LOOM_ATTN_QKV_JOIN", "1", 1);
      rows("auto, the probe");
      rows("auto, the choice");
    }
  }
  if (before) setenv("LOOM_ATTN_QKV_JOIN", saved.c_str(), 1);
  else unsetenv("LOOM_ATTN_QKV_JOIN");
}

TEST_CASE("cudnn attention: more queries than keys, causal (rows that see no key)", "[cuda][attention][cudnn]") {
  need_gpu();
  BackendScope scope(cu::AttentionBackend::Cudnn);
  run_case<bf16>({{100, 260}, {290, 200}, 0, 0, 1, 1, 4, 2, 128, true}, 950);
  run_case<bf16>({{5, 70}, {3, 66}, 0, 0, 0, 0, 2, 1, 64, true}, 951);
}

TEST_CASE("cudnn attention: head dims 16 and 32, f32 inputs (through bf16)", "[cuda][attention][cudnn]") {
  need_gpu();
  BackendScope scope(cu::AttentionBackend::Cudnn);
  run_case<bf16>({{7, 1, 13, 5}, {7, 1, 13, 5}, 0, 0, 3, 2, 6, 2, 16, true}, 960);
  run_case<float>({{7, 1, 13, 5}, {7, 1, 13, 5}, 0, 0, 3, 2, 6, 2, 16, true}, 961);
  run_case<float>({{130, 67}, {130, 67}, 1, 0, 0, 2, 4, 2, 64, false}, 962);
  run_case<bf16>({{19, 8}, {19, 8}, 0, 0, 2, 0, 3, 3, 32, true}, 963);
}

TEST_CASE("attention auto: either backend, the choice cached, unsupported cases on ours", "[cuda][attention][cudnn]") {
  need_gpu();
  BackendScope scope(cu::AttentionBackend::Auto);
  uint32_t seed = 970;
  for (const auto& c : cases()) {
    run_case<bf16>(c, seed);  // first sight: the probe
    run_case<bf16>(c, seed);  // the cached choice
    seed++;
  }
  run_case<bf16>({{19, 8}, {19, 8}, 0, 0, 2, 0, 3, 3, 40, true}, 980);  // hd 40: ours
  run_case<float>({{19, 8}, {19, 8}, 0, 0, 2, 0, 3, 3, 64, true}, 981);  // f32: ours
}

TEST_CASE("attention cudnn: unsupported cases throw with the reason", "[cuda][attention][cudnn]") {
  need_gpu();
  BackendScope scope(cu::AttentionBackend::Cudnn);
  Dev<bf16> q(size_t(8) * 2 * 40), out(size_t(8) * 2 * 40);
  Dev<float> lse(16);
  Dev<int32_t> cuq(std::vector<int32_t>{0, 8});
  REQUIRE_THROWS_WITH(cu::attention_forward<bf16>(out.p, lse.p, q.p, q.p, q.p, cuq.p, cuq.p, 1, 8, 8, 8, 2, 2, 40,
                                                  false, 0.1, cu::default_stream()),
                      Catch::Contains("head dim 40") && Catch::Contains("cudnn"));
  cu::set_deterministic_attention(true);
  Dev<bf16> q64(size_t(8) * 2 * 64), o64(size_t(8) * 2 * 64), g64(size_t(8) * 2 * 64);
  Dev<float> ws(size_t(8) * 2 * 65);
  CHECK_THROWS_WITH(cu::attention_backward<bf16>(g64.p, g64.p, g64.p, o64.p, q64.p, q64.p, q64.p, o64.p, lse.p, ws.p,
                                                 cuq.p, cuq.p, 1, 8, 8, 8, 2, 2, 64, false, 0.125,
                                                 cu::default_stream()),
                    Catch::Contains("deterministic"));
  cu::set_deterministic_attention(false);
}
