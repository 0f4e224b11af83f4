// test_cuda_kernels_b.cpp: the CUDA attention against the loom::cpu reference, forward and
// backward, f32 and bf16 (the losses: test_cuda_losses.cpp).
//
// f32 runs compare with the CPU in f32; bf16 runs round the same random f32 data to bf16,
// give the rounded values (as f32) to the CPU, and compare the CUDA bf16 outputs with
// tol::kCudaBF16. Every output is poisoned with NaN before the launch. Shapes reach every
// branch: ragged cu_seqlens with padding rows outside every sequence, GQA, causal and not,
// decode (Lq = 1), queries that see no key (Lq > Lk, causal), hd 16/32/40/64/128.
// Exits with code 4 (ctest: skipped) when no GPU is present.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tests/cuda/vec_test_util.h"

namespace {

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
      // causal batches of short sequences (more than 256 rows, under 512 a sequence on average:
      // the lock-step forward's 2 x 64 blocks) with 2 and 4 query heads a K / V head, last key
      // tiles of 44, 24 and 8 keys; with 4, more queries than keys and fewer (shift -190 and 10)
      {{300, 24, 520}, {300, 24, 520}, 1, 2, 8, 4, 64, true},
      {{290, 300}, {100, 310}, 1, 1, 8, 2, 64, true},
  };
  return cases;
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
