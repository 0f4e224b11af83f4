// test_cuda_gemm_sm90.cpp: kernels/cuda/gemm_sm90.cu (products of our own on Hopper) against the
// loom::cpu reference, bf16: ragged row counts (the TMA zero fill and the stores' clipping),
// widths and depths that are not whole tiles, bias or none, GELU with and without its
// pre-activation, the residual (in place too), DGELU, the SwiGLU forward and backward epilogues (bit
// for bit against the standalone SwiGLU kernels where their inputs are the same), RoPE of a
// joined q|k|v product (bit for bit against rope_qkv_split of the kernel's own product). Outputs start
// poisoned with NaN, so an element the kernel does not write fails. Skipped without a
// compute-capability 9.0 GPU.
//   bash tools/gpu-kernels.sh tests/cuda/test_cuda_gemm_sm90.cpp
#include <catch2/catch.hpp>

#include <cstdlib>
#include <cstring>

#include "kernels/cuda/gemm_sm90.h"
#include "kernels/cuda/rope_table.h"
#include "kernels/kernels.h"
#include "tests/tolerances.h"

#include "tests/cuda/cuda_kernel_test_util.h"

namespace {

void need_sm90() {
  need_gpu();
  if (!cu::gemm90::available()) {
    std::fprintf(stderr, "no sm_90a build or no compute-capability 9.0 device: skipping\n");
    std::exit(4);
  }
}

__nv_bfloat16* dev(bf16* p) { return reinterpret_cast<__nv_bfloat16*>(p); }

// How many elements of two equally long outputs differ in their bits (NaN payloads included).
size_t bits_differ(const std::vector<float>& a, const std::vector<float>& b) {
  size_t n = 0;
  for (size_t e = 0; e < a.size(); e++) n += std::memcmp(&a[e], &b[e], sizeof(float)) != 0;
  return n;
}

}  // namespace

TEST_CASE("gemm_sm90: linear forward, bias and GELU epilogues", "[gemm_sm90]") {
  need_sm90();
  struct Case { int64_t N; int I, O; };
  // N: one row, a partial tile, several tiles with a ragged last one; I: under one K tile, not a
  // multiple of 64, the ViT's 768; O: under one 128-column tile, ragged last column tiles (200 =
  // 128 + 72, 1032 = 8 x 128 + 8), whole tiles. The last two cases have 576 and 297 tiles: more
  // than two per block on a GPU of up to 144 multiprocessors, so both consumers take several
  // tiles each and the ring of 5 stages wraps within and across tiles (3 and 13 K tiles a tile).
  const Case cases[] = {Case{1, 8, 16},     Case{37, 72, 200},    Case{300, 768, 320},  Case{257, 200, 512},
                        Case{1000, 64, 136}, Case{8192, 136, 1032}, Case{4100, 776, 1032}};
  uint64_t seed = 100;
  for (const Case& c : cases) {
    INFO("N " << c.N << " I " << c.I << " O " << c.O);
    auto hx = rounded<bf16>(rnd(c.N * c.I, seed++)), hw = rounded<bf16>(rnd(int64_t(c.O) * c.I, seed++, -0.3f, 0.3f));
    auto hb = rounded<bf16>(rnd(c.O, seed++));
    DBuf<bf16> x(hx), w(hw), b(hb), out(c.N * c.O), pre(c.N * c.O);
    REQUIRE(cu::gemm90::supported(out.p, pre.p, nullptr, x.p, w.p, b.p, c.N, c.I, c.O));
    for (bool bias : {true, false}) {
      std::vector<float> ref(c.N * c.O);
      cpu::linear_forward(ref.data(), hx.data(), hw.data(), bias ? hb.data() : nullptr, c.N, c.I, c.O, nullptr);
      out.poison();
      cu::gemm90::linear_forward(dev(out.p), nullptr, dev(x.p), dev(w.p), bias ? dev(b.p) : nullptr, nullptr, c.N, c.I,
                                 c.O, false,
                                 cu::default_stream());
      CHECK_CLOSE(out.get(), ref, tol_of<bf16>(true), bias ? "linear bias" : "linear");
    }
    std::vector<float> rout(c.N * c.O), rpre(c.N * c.O);
    cpu::linear_gelu_forward(rout.data(), rpre.data(), hx.data(), hw.data(), hb.data(), c.N, c.I, c.O, nullptr);
    out.poison();
    pre.poison();
    cu::gemm90::linear_forward(dev(out.p), dev(pre.p), dev(x.p), dev(w.p), dev(b.p), nullptr, c.N, c.I, c.O, true,
                               cu::default_stream());
    CHECK_CLOSE(pre.get(), rpre, tol_of<bf16>(true), "linear GELU pre");
    CHECK_CLOSE(out.get(), rout, tol_of<bf16>(true), "linear GELU out");
    out.poison();
    pre.poison();
    cu::gemm90::linear_forward(dev(out.p), nullptr, dev(x.p), dev(w.p), dev(b.p), nullptr, c.N, c.I, c.O, true,
                               cu::default_stream());
    CHECK_CLOSE(out.get(), rout, tol_of<bf16>(true), "linear GELU out, no pre");
    CHECK(std::isnan(pre.get()[0]));  // not written without a pre pointer
    // the residual in the epilogue: into another buffer, and in place (out == resid)
    auto hr = rounded<bf16>(rnd(c.N * c.O, seed++, -2.f, 2.f));
    std::vector<float> radd(c.N * c.O);
    cpu::linear_forward(radd.data(), hx.data(), hw.data(), hb.data(), c.N, c.I, c.O, nullptr);
    for (size_t e = 0; e < radd.size(); e++) radd[e] += hr[e];
    DBuf<bf16> res(hr);
    out.poison();
    cu::gemm90::linear_forward(dev(out.p), nullptr, dev(x.p), dev(w.p), dev(b.p), dev(res.p), c.N, c.I, c.O, false,
                               cu::default_stream());
    CHECK_CLOSE(out.get(), radd, tol_of<bf16>(true), "linear + residual");
    cu::gemm90::linear_forward(dev(res.p), nullptr, dev(x.p), dev(w.p), dev(b.p), dev(res.p), c.N, c.I, c.O, false,
                               cu::default_stream());
    CHECK_CLOSE(res.get(), radd, tol_of<bf16>(true), "linear + residual, in place");
  }
}

TEST_CASE("gemm_sm90: the SwiGLU epilogue, bit for bit swiglu_forward_joined of its gu", "[gemm_sm90]") {
  need_sm90();
  struct Case { int64_t N; int C, I; };
  // I a multiple of 64 (the kernel's contract); 16384 x 576 -> 2 x 1536 is the SPEC LM's, with
  // 1536 tiles (several per block); C 200 is not a whole K tile
  for (Case c : {Case{1, 64, 64}, Case{300, 200, 128}, Case{1000, 576, 1536}, Case{16384, 576, 1536}}) {
    INFO("N " << c.N << " C " << c.C << " I " << c.I);
    auto hx = rounded<bf16>(rnd(c.N * c.C, 300 + c.I));
    auto hw = rounded<bf16>(rnd(int64_t(2) * c.I * c.C, 301, -0.2f, 0.2f));
    DBuf<bf16> x(hx), w(hw), gu(c.N * 2 * c.I), h(c.N * c.I), h2(c.N * c.I);
    REQUIRE(cu::gemm90::swiglu_supported(gu.p, h.p, x.p, w.p, c.N, c.C, c.I));
    cu::gemm90::linear_swiglu_forward(dev(gu.p), dev(h.p), dev(x.p), dev(w.p), c.N, c.C, c.I, cu::default_stream());
    std::vector<float> rgu(c.N * 2 * c.I), rh(c.N * c.I);
    cpu::linear_swiglu_forward(rgu.data(), rh.data(), hx.data(), hw.data(), c.N, c.C, c.I, nullptr);
    CHECK_CLOSE(gu.get(), rgu, tol_of<bf16>(true), "swiglu epilogue gu");
    CHECK_CLOSE(h.get(), rh, tol_of<bf16>(true), "swiglu epilogue h");
    // h from the kernel's own gu through the standalone kernel: the same bits
    cu::swiglu_forward_joined(h2.p, gu.p, c.N, c.I, S());
    CHECK(bits_differ(h.get(), h2.get()) == 0);
    // LOOM_GEMM90_SWF=4 / 5: the four- and five-stage forms (epilogues 3 and 8: three and two
    // boxes in the output tile) give the same bits as the default six-stage one (13: one box)
    for (const char* swf : {"4", "5"}) {
      INFO("LOOM_GEMM90_SWF=" << swf);
      DBuf<bf16> gu3(c.N * 2 * c.I), h3(c.N * c.I);
      setenv("LOOM_GEMM90_SWF", swf, 1);
      cu::gemm90::linear_swiglu_forward(dev(gu3.p), dev(h3.p), dev(x.p), dev(w.p), c.N, c.C, c.I,
                                        cu::default_stream());
      unsetenv("LOOM_GEMM90_SWF");
      CHECK(bits_differ(gu.get(), gu3.get()) == 0);
      CHECK(bits_differ(h.get(), h3.get()) == 0);
    }
  }
}

TEST_CASE("gemm_sm90: the DGELU epilogue (linear_dgelu_backward's product)", "[gemm_sm90]") {
  need_sm90();
  struct Case { int64_t N; int I, O; };
  // dpre [N, I] = (dout [N, O] W [O, I]) gelu'(pre): W read along its rows (MN-major B, two
  // 64-column boxes a stage); I 200 leaves a ragged column tile, O 72 a partial K tile; 6272 x
  // 3072 <- 768 is the SPEC MIM encoder's fc1 (several tiles per block)
  for (Case c : {Case{1, 64, 64}, Case{300, 200, 72}, Case{1000, 1032, 384}, Case{6272, 3072, 768}}) {
    INFO("N " << c.N << " I " << c.I << " O " << c.O);
    auto hd = rounded<bf16>(rnd(c.N * c.O, 600 + c.I)), hw = rounded<bf16>(rnd(int64_t(c.O) * c.I, 601, -0.2f, 0.2f));
    auto hp = rounded<bf16>(rnd(c.N * c.I, 602, -3.f, 3.f));
    DBuf<bf16> dout(hd), w(hw), pre(hp), dpre(c.N * c.I);
    REQUIRE(cu::gemm90::dgelu_supported(dpre.p, dout.p, w.p, pre.p, c.N, c.I, c.O));
    cu::gemm90::linear_dgelu(dev(dpre.p), dev(dout.p), dev(w.p), dev(pre.p), c.N, c.I, c.O, cu::default_stream());
    std::vector<float> ref(c.N * c.I);
    cpu::linear_dgelu_backward(ref.data(), (float*)nullptr, hd.data(), hw.data(), hp.data(), c.N, c.I, c.O, nullptr);
    CHECK_CLOSE(dpre.get(), ref, tol_of<bf16>(true), "DGELU epilogue dpre");
    // through matmul.cu (LOOM_GEMM90=1 sends it here) with the bias gradient (+=, the column sums
    // of dpre)
    auto hb = rnd(c.I, 603);
    DBuf<bf16> db(rounded<bf16>(hb));
    std::vector<float> rdb = rounded<bf16>(hb);
    dpre.poison();
    setenv("LOOM_GEMM90", "1", 1);
    cu::linear_dgelu_backward(dpre.p, db.p, dout.p, w.p, pre.p, c.N, c.I, c.O, S());
    unsetenv("LOOM_GEMM90");
    const std::vector<float> got = dpre.get();
    CHECK_CLOSE(got, ref, tol_of<bf16>(true), "linear_dgelu_backward dpre");
    for (int64_t r = 0; r < c.N; r++)
      for (int k = 0; k < c.I; k++) rdb[k] += got[r * c.I + k];
    CHECK_CLOSE(db.get(), rdb, tol_of<bf16>(true), "linear_dgelu_backward dbias");
  }
}

TEST_CASE("gemm_sm90: the SwiGLU backward epilogue, bit for bit swiglu_backward_joined of dh", "[gemm_sm90]") {
  need_sm90();
  struct Case { int64_t N; int C2, I; };
  // dh = dout [N, C2] wd [C2, I] with wd read along its rows (the MN-major B path); C2 200 is not a
  // whole K tile; 16384 x 576 -> 1536 is the SPEC LM's down projection (several tiles per block)
  for (Case c : {Case{1, 64, 64}, Case{300, 200, 128}, Case{1000, 576, 1536}, Case{16384, 576, 1536}}) {
    INFO("N " << c.N << " C2 " << c.C2 << " I " << c.I);
    auto hd = rounded<bf16>(rnd(c.N * c.C2, 500 + c.I)), hw = rounded<bf16>(rnd(int64_t(c.C2) * c.I, 501, -0.2f, 0.2f));
    auto hgu = rounded<bf16>(rnd(c.N * 2 * c.I, 502, -3.f, 3.f));
    DBuf<bf16> dout(hd), wd(hw), gu(hgu), dgu(c.N * 2 * c.I), prod(c.N * c.I);
    REQUIRE(cu::gemm90::swiglu_bwd_supported(dgu.p, prod.p, dout.p, wd.p, gu.p, c.N, c.C2, c.I));
    cu::gemm90::linear_swiglu_backward(dev(dgu.p), dev(prod.p), dev(dout.p), dev(wd.p), dev(gu.p), c.N, c.C2, c.I,
                                       cu::default_stream());
    std::vector<float> rdgu(c.N * 2 * c.I), rprod(c.N * c.I);
    cpu::linear_swiglu_backward(rdgu.data(), rprod.data(), hd.data(), hw.data(), hgu.data(), c.N, c.C2, c.I, nullptr);
    CHECK_CLOSE(dgu.get(), rdgu, tol_of<bf16>(true), "swiglu backward epilogue dgu");
    CHECK_CLOSE(prod.get(), rprod, tol_of<bf16>(true), "swiglu backward epilogue prod");
    // I % 128 == 0 takes the 64 x 128 tiles (epilogue 7); LOOM_GEMM90_SWB=0 the 128 x 64 ones
    // (epilogue 4): h comes from gu alone (the same bits), dh from m64n128 against m64n64 products
    {
      DBuf<bf16> dgu4(c.N * 2 * c.I), prod4(c.N * c.I);
      setenv("LOOM_GEMM90_SWB", "0", 1);
      cu::gemm90::linear_swiglu_backward(dev(dgu4.p), dev(prod4.p), dev(dout.p), dev(wd.p), dev(gu.p), c.N, c.C2,
                                         c.I, cu::default_stream());
      unsetenv("LOOM_GEMM90_SWB");
      CHECK(bits_differ(prod.get(), prod4.get()) == 0);
      CHECK_CLOSE(dgu4.get(), rdgu, tol_of<bf16>(true), "swiglu backward epilogue 4 dgu");
      WARN("dgu values that differ between the two tilings: " << bits_differ(dgu.get(), dgu4.get()));
    }
    // the two-pass CUDA path on the same inputs (cuBLASLt's dh, then swiglu_backward_joined): its
    // dh may round differently, so bit equality is asked of prod (from gu alone) and closeness of dgu
    DBuf<bf16> dgu2(c.N * 2 * c.I), prod2(c.N * c.I);
    setenv("LOOM_GEMM90", "0", 1);
    cu::linear_swiglu_backward(dgu2.p, prod2.p, dout.p, wd.p, gu.p, c.N, c.C2, c.I, S());
    unsetenv("LOOM_GEMM90");
    CHECK_CLOSE(dgu.get(), dgu2.get(), tol_of<bf16>(true), "swiglu backward epilogue dgu vs two passes");
    CHECK(bits_differ(prod.get(), prod2.get()) == 0);
    // without prod: dgu the same, prod untouched
    DBuf<bf16> dgu3(c.N * 2 * c.I);
    prod.poison();
    cu::gemm90::linear_swiglu_backward(dev(dgu3.p), nullptr, dev(dout.p), dev(wd.p), dev(gu.p), c.N, c.C2, c.I,
                                       cu::default_stream());
    CHECK(bits_differ(dgu.get(), dgu3.get()) == 0);
    CHECK(std::isnan(prod.get()[0]));
  }
}

TEST_CASE("gemm_sm90: matmul.cu's calls routed to it (LOOM_GEMM90=1) and the SwiGLU entry point", "[gemm_sm90]") {
  need_sm90();
  setenv("LOOM_GEMM90", "1", 1);
  const int64_t N = 515;
  const int I = 264, O = 392;
  auto hx = rounded<bf16>(rnd(N * I, 400)), hw = rounded<bf16>(rnd(int64_t(O) * I, 401, -0.3f, 0.3f));
  auto hb = rounded<bf16>(rnd(O, 402)), hr = rounded<bf16>(rnd(N * O, 403));
  DBuf<bf16> x(hx), w(hw), b(hb), out(N * O), pre(N * O), res(hr);
  std::vector<float> ref(N * O), rpre(N * O), rout(N * O);
  cpu::linear_forward(ref.data(), hx.data(), hw.data(), hb.data(), N, I, O, nullptr);
  cu::linear_forward(out.p, x.p, w.p, b.p, N, I, O, S());
  CHECK_CLOSE(out.get(), ref, tol_of<bf16>(true), "linear_forward");
  for (size_t e = 0; e < ref.size(); e++) ref[e] += hr[e];
  out.poison();
  cu::linear_forward_add(out.p, x.p, w.p, b.p, res.p, N, I, O, S());
  CHECK_CLOSE(out.get(), ref, tol_of<bf16>(true), "linear_forward_add");
  cpu::linear_gelu_forward(rout.data(), rpre.data(), hx.data(), hw.data(), hb.data(), N, I, O, nullptr);
  out.poison();
  cu::linear_gelu_forward(out.p, pre.p, x.p, w.p, b.p, N, I, O, S());
  CHECK_CLOSE(pre.get(), rpre, tol_of<bf16>(true), "linear_gelu_forward pre");
  CHECK_CLOSE(out.get(), rout, tol_of<bf16>(true), "linear_gelu_forward out");
  unsetenv("LOOM_GEMM90");
  // linear_swiglu_forward: the epilogue (bf16, I % 64 == 0) and the two-pass path (f32; bf16 with
  // an I the kernel does not take), each against the CPU reference
  for (int Ih : {128, 40}) {
    INFO("I " << Ih);
    const int C = 96;
    auto gx = rnd(N * C, 404), gw = rnd(int64_t(2) * Ih * C, 405, -0.3f, 0.3f);
    std::vector<float> rgu(N * 2 * Ih), rh(N * Ih);
    {
      auto bx = rounded<bf16>(gx), bw = rounded<bf16>(gw);
      cpu::linear_swiglu_forward(rgu.data(), rh.data(), bx.data(), bw.data(), N, C, Ih, nullptr);
      DBuf<bf16> dx(bx), dw(bw), gu(N * 2 * Ih), h(N * Ih);
      cu::linear_swiglu_forward(gu.p, h.p, dx.p, dw.p, N, C, Ih, S());
      CHECK_CLOSE(gu.get(), rgu, tol_of<bf16>(true), "linear_swiglu_forward bf16 gu");
      CHECK_CLOSE(h.get(), rh, tol_of<bf16>(true), "linear_swiglu_forward bf16 h");
    }
    cpu::linear_swiglu_forward(rgu.data(), rh.data(), gx.data(), gw.data(), N, C, Ih, nullptr);
    DBuf<float> dx(gx), dw(gw), gu(N * 2 * Ih), h(N * Ih);
    cu::linear_swiglu_forward(gu.p, h.p, dx.p, dw.p, N, C, Ih, S());
    CHECK_CLOSE(gu.get(), rgu, tol_of<float>(true), "linear_swiglu_forward f32 gu");
    CHECK_CLOSE(h.get(), rh, tol_of<float>(true), "linear_swiglu_forward f32 h");
    // linear_swiglu_backward through the down projection [C, Ih] (f32: the two-pass path)
    auto gd = rnd(N * C, 406);
    std::vector<float> rdgu(N * 2 * Ih), rprod(N * Ih), wdn(size_t(C) * Ih);
    for (size_t e = 0; e < wdn.size(); e++) wdn[e] = gw[e] * 0.5f;
    cpu::linear_swiglu_backward(rdgu.data(), rprod.data(), gd.data(), wdn.data(), rgu.data(), N, C, Ih, nullptr);
    DBuf<float> dd(gd), dwd(wdn), dgu(N * 2 * Ih), prod(N * Ih);
    cu::linear_swiglu_backward(dgu.p, prod.p, dd.p, dwd.p, gu.p, N, C, Ih, S());
    CHECK_CLOSE(dgu.get(), rdgu, tol_of<float>(true), "linear_swiglu_backward f32 dgu");
    CHECK_CLOSE(prod.get(), rprod, tol_of<float>(true), "linear_swiglu_backward f32 prod");
  }
}

TEST_CASE("gemm_sm90: RoPE in a joined q|k|v product's epilogue, bit for bit rope_qkv_split of its product",
          "[gemm_sm90]") {
  need_sm90();
  struct Case { int64_t N; int C, H, KV; };
  // hd 64 (the epilogue's); N: one row, a partial row tile, several tiles with a ragged last one,
  // the SPEC LM's 16384 x 576 with 9 q and 3 kv heads (1024 tiles, the last column tile half
  // past the joined width); C 200 is not a whole K tile; H == KV, and one head each
  const double theta = 100000.0;
  for (Case c : {Case{1, 64, 1, 1}, Case{300, 200, 4, 4}, Case{1000, 576, 9, 3}, Case{16384, 576, 9, 3}}) {
    INFO("N " << c.N << " C " << c.C << " H " << c.H << " KV " << c.KV);
    const int hd = 64, qw = c.H * hd, kw = c.KV * hd, W = qw + 2 * kw;
    auto hx = rounded<bf16>(rnd(c.N * c.C, 500 + c.C));
    auto hw = rounded<bf16>(rnd(int64_t(W) * c.C, 501, -0.2f, 0.2f));
    // positions: mostly in the table (2048 rows at least), some past it (formed in double)
    auto pos = rnd_int(c.N, 502, 0, 2048);
    for (int64_t n = 0; n < c.N; n += 7) pos[n] = 2048 + int32_t(n % 5000);
    IBuf dpos(pos);
    DBuf<bf16> x(hx), w(hw), qkv(c.N * W), q(c.N * qw), k(c.N * kw), v(c.N * kw);
    DBuf<bf16> rq(c.N * qw), rk(c.N * kw), rv(c.N * kw);
    REQUIRE(cu::gemm90::qkv_rope_supported(q.p, k.p, v.p, x.p, w.p, c.N, c.C, c.H, c.KV, hd));
    // the reference: this kernel's plain product, then the standalone split
    cu::gemm90::linear_forward(dev(qkv.p), nullptr, dev(x.p), dev(w.p), nullptr, nullptr, c.N, c.C, W, false, S());
    cu::rope_qkv_split(rq.p, rk.p, rv.p, qkv.p, dpos.p, c.N, c.H, c.KV, hd, theta, S());
    int rows = 0;
    const float2* table = cu::rope_table(hd, theta, 1, &rows, S());
    REQUIRE(table != nullptr);
    REQUIRE(rows >= 2048);
    for (bool with_table : {true, false}) {
      INFO((with_table ? "the table, positions past it in double" : "no table: every angle in double"));
      q.poison();
      k.poison();
      v.poison();
      cu::gemm90::linear_qkv_rope(dev(q.p), dev(k.p), dev(v.p), dev(x.p), dev(w.p), dpos.p, with_table ? table : nullptr,
                                  rows, c.N, c.C, c.H, c.KV, hd, theta, S());
      CHECK(bits_differ(q.get(), rq.get()) == 0);
      CHECK(bits_differ(k.get(), rk.get()) == 0);
      CHECK(bits_differ(v.get(), rv.get()) == 0);
    }
    // and against the CPU reference (the product in fp32, the split of its bf16 rounding)
    std::vector<float> cq(c.N * qw), ck(c.N * kw), cv(c.N * kw);
    cpu::linear_qkv_rope(cq.data(), ck.data(), cv.data(), hx.data(), hw.data(), pos.data(), c.N, c.C, c.H, c.KV, hd,
                         theta, nullptr);
    CHECK_CLOSE(q.get(), cq, tol_of<bf16>(true), "qkv rope q");
    CHECK_CLOSE(k.get(), ck, tol_of<bf16>(true), "qkv rope k");
    CHECK_CLOSE(v.get(), cv, tol_of<bf16>(true), "qkv rope v");
  }
  // linear_qkv_rope (kernels.inc): bf16 at hd 64 takes the epilogue (against the CPU reference),
  // bf16 at hd 32 and f32 the product and the split (bit for bit those two calls)
  auto two_calls = [&](auto zero, int hd, const std::vector<float>& hx, const std::vector<float>& hw,
                       const IBuf& dpos, int64_t N, int C, int H, int KV) {
    using T = decltype(zero);
    const int qw = H * hd, kw = KV * hd, W = qw + 2 * kw;
    DBuf<T> x(hx), w(hw), qkv(N * W), q(N * qw), k(N * kw), v(N * kw), rq(N * qw), rk(N * kw), rv(N * kw);
    cu::linear_forward(qkv.p, x.p, w.p, (const T*)nullptr, N, C, W, S());
    cu::rope_qkv_split(rq.p, rk.p, rv.p, qkv.p, dpos.p, N, H, KV, hd, theta, S());
    cu::linear_qkv_rope(q.p, k.p, v.p, x.p, w.p, dpos.p, N, C, H, KV, hd, theta, S());
    CHECK(bits_differ(q.get(), rq.get()) == 0);
    CHECK(bits_differ(k.get(), rk.get()) == 0);
    CHECK(bits_differ(v.get(), rv.get()) == 0);
  };
  for (int hd : {64, 32}) {
    const int64_t N = 130;
    const int C = 96, H = 3, KV = 1, qw = H * hd, kw = KV * hd, W = qw + 2 * kw;
    INFO("linear_qkv_rope, hd " << hd);
    auto hx = rounded<bf16>(rnd(N * C, 600 + hd)), hw = rounded<bf16>(rnd(int64_t(W) * C, 601, -0.2f, 0.2f));
    auto pos = rnd_int(N, 602, 0, 3000);
    IBuf dpos(pos);
    if (hd == 64) {
      std::vector<float> cq(N * qw), ck(N * kw), cv(N * kw);
      cpu::linear_qkv_rope(cq.data(), ck.data(), cv.data(), hx.data(), hw.data(), pos.data(), N, C, H, KV, hd, theta,
                           nullptr);
      DBuf<bf16> x(hx), w(hw), q(N * qw), k(N * kw), v(N * kw);
      cu::linear_qkv_rope(q.p, k.p, v.p, x.p, w.p, dpos.p, N, C, H, KV, hd, theta, S());
      CHECK_CLOSE(q.get(), cq, tol_of<bf16>(true), "linear_qkv_rope bf16 q");
      CHECK_CLOSE(k.get(), ck, tol_of<bf16>(true), "linear_qkv_rope bf16 k");
      CHECK_CLOSE(v.get(), cv, tol_of<bf16>(true), "linear_qkv_rope bf16 v");
    } else {
      two_calls(bf16{}, hd, hx, hw, dpos, N, C, H, KV);
    }
    two_calls(float{}, hd, hx, hw, dpos, N, C, H, KV);
  }
}
