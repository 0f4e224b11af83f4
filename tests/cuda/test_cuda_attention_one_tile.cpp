// test_cuda_attention_one_tile.cpp: the attention backward of a dense bf16 batch at hd 64 whose
// sequences fit one 64-key tile (the MIM encoder's 49 kept patches; kernels/cuda/
// attention_bwd_single.cu). By default it runs attn_bwd_one_tile, persistent blocks that take
// several (sequence, kv head) pairs each and load the next tile while computing this one;
// LOOM_ATTN_BWD_ONE=0 keeps attn_bwd_v2_atomic_dq's one block a pair. The two do the same
// operations in the same order, so dq, dk and dv must be bit for bit the same both ways, and within
// bf16 tolerance of the CPU reference (tests/cuda/cuda_kernel_test_util.h). The attention tests of
// test_cuda_kernels_b run the default form on their shapes too. Skipped without a GPU.
//   bash tools/gpu-kernels.sh tests/cuda/test_cuda_attention_one_tile.cpp
#include <catch2/catch.hpp>

#include <string>

#include "kernels/kernels.h"
#include "tests/tolerances.h"

#include "tests/cuda/cuda_kernel_test_util.h"

// Enough pairs that each block takes two or more on a 132-multiprocessor GPU (2 blocks a
// multiprocessor): 49 tokens (full), 64 with GQA 3:1 and causal (the group's three heads a pair:
// both K / V and both Q / dO buffers), 17 causal and 1 (rows past the sequence in every tile).
// Outputs and workspace poisoned before each run.
TEST_CASE("attention backward of one key tile a sequence: persistent blocks, the same bits as one block a pair",
          "[cuda][attention]") {
  need_gpu();
  const char* before = std::getenv("LOOM_ATTN_BWD_ONE");
  const std::string saved = before ? before : "";
  const bool was = cu::deterministic_attention();
  cu::set_deterministic_attention(false);
  struct Case { int len, nseq, H, KV; bool causal; };
  const Case cases[] = {{49, 300, 2, 2, false}, {64, 150, 6, 2, true}, {17, 700, 1, 1, true}, {1, 600, 2, 2, false}};
  uint64_t seed = 950;
  for (const Case& c : cases) {
    const int hd = 64, H = c.H, KV = c.KV, nseq = c.nseq, L = c.len;
    const int64_t N = int64_t(nseq) * L;
    std::vector<int32_t> cu_s{0};
    for (int i = 0; i < nseq; i++) cu_s.push_back(cu_s.back() + L);
    const double scale = 1.0 / std::sqrt(double(hd));
    const size_t nq = size_t(N) * H * hd, nk = size_t(N) * KV * hd;
    const auto q = rounded<bf16>(rnd(nq, seed++)), k = rounded<bf16>(rnd(nk, seed++)),
               v = rounded<bf16>(rnd(nk, seed++)), dout = rounded<bf16>(rnd(nq, seed++));
    std::vector<float> out(nq), lse(N * H), ws(N * H), dq_ref(nq), dk_ref(nk), dv_ref(nk);
    cpu::attention_forward<float>(out.data(), lse.data(), q.data(), k.data(), v.data(), cu_s.data(), cu_s.data(), nseq,
                                  L, N, N, H, KV, hd, c.causal, scale, nullptr);
    out = rounded<bf16>(out);  // the backward reads the forward's stored (rounded) output
    cpu::attention_backward<float>(dq_ref.data(), dk_ref.data(), dv_ref.data(), dout.data(), q.data(), k.data(),
                                   v.data(), out.data(), lse.data(), ws.data(), cu_s.data(), cu_s.data(), nseq, L, N,
                                   N, H, KV, hd, c.causal, scale, nullptr);
    DBuf<bf16> dq_(q), dk_(k), dv_(v), ddo(dout), dout_(out), ddq(nq), ddk(nk), ddv(nk);
    DBuf<float> dlse(lse), dws(size_t(N) * H * (hd + 1));
    IBuf dcu(cu_s);
    auto run = [&](const char* one) {
      if (one) setenv("LOOM_ATTN_BWD_ONE", one, 1);
      else unsetenv("LOOM_ATTN_BWD_ONE");
      ddq.poison();
      ddk.poison();
      ddv.poison();
      dws.poison();
      cu::attention_backward<bf16>(ddq.p, ddk.p, ddv.p, ddo.p, dq_.p, dk_.p, dv_.p, dout_.p, dlse.p, dws.p, dcu.p, dcu.p,
                                   nseq, L, N, N, H, KV, hd, c.causal, scale, S());
      return std::vector<std::vector<float>>{ddq.get(), ddk.get(), ddv.get()};
    };
    INFO("length " << L << " x " << nseq << " H" << H << " KV" << KV << (c.causal ? " causal" : " full"));
    const auto persistent = run(nullptr), per_pair = run("0");
    CHECK_CLOSE(persistent[0], dq_ref, tol::kCudaBF16, "dq, persistent blocks");
    CHECK_CLOSE(persistent[1], dk_ref, tol::kCudaBF16, "dk, persistent blocks");
    CHECK_CLOSE(persistent[2], dv_ref, tol::kCudaBF16, "dv, persistent blocks");
    for (int i = 0; i < 3; i++)  // bf16 values widened to float: equal bits iff equal floats' bits
      CHECK(std::memcmp(persistent[i].data(), per_pair[i].data(), sizeof(float) * persistent[i].size()) == 0);
  }
  cu::set_deterministic_attention(was);
  if (before) setenv("LOOM_ATTN_BWD_ONE", saved.c_str(), 1);
  else unsetenv("LOOM_ATTN_BWD_ONE");
}
