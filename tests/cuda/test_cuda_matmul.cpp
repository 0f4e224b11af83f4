// test_cuda_matmul.cpp: kernels/cuda/matmul.cu (gemm, linear, linear + GELU epilogue) against the
// loom::cpu reference, f32 and bf16 (tests/cuda/cuda_kernel_test_util.h). Skipped without a GPU.
//   bash tools/gpu-kernels.sh tests/cuda/test_cuda_matmul.cpp
#include <catch2/catch.hpp>

#include "kernels/kernels.h"
#include "tests/tolerances.h"

#include "tests/cuda/cuda_kernel_test_util.h"

TEMPLATE_TEST_CASE("matmul: gemm over shapes, transposes, batches, beta", "[matmul]", float, bf16, f16) {
  need_gpu();
  using T = TestType;
  struct Case { int M, N, K, batch; double alpha, beta; };
  for (Case c : {Case{1, 1, 1, 1, 1.0, 0.0}, Case{37, 53, 29, 1, 1.0, 0.0}, Case{64, 96, 128, 3, 0.5, 0.0},
                 Case{33, 17, 65, 2, 1.0, 1.0}, Case{128, 256, 72, 1, -1.5, 0.25}}) {
    for (int tr = 0; tr < 4; tr++) {
      bool ta = tr & 1, tb = tr & 2;
      int64_t sa = int64_t(c.M) * c.K, sb = int64_t(c.K) * c.N, sc = int64_t(c.M) * c.N;
      auto hA = rounded<T>(rnd(sa * c.batch, 10 + tr)), hB = rounded<T>(rnd(sb * c.batch, 20 + tr));
      auto hC = rounded<T>(rnd(sc * c.batch, 30 + tr));
      std::vector<float> ref = hC;
      cpu::gemm(ref.data(), hA.data(), hB.data(), c.M, c.N, c.K, ta, tb, c.alpha, c.beta, c.batch, sa, sb, sc,
                nullptr);
      DBuf<T> A(hA), B(hB), C(sc * c.batch);
      if (c.beta != 0) C.put(hC);  // beta == 0: C stays NaN, and must not be read
      cu::gemm(C.p, A.p, B.p, c.M, c.N, c.K, ta, tb, c.alpha, c.beta, c.batch, sa, sb, sc, S());
      INFO("M " << c.M << " N " << c.N << " K " << c.K << " batch " << c.batch << " ta " << ta << " tb " << tb);
      CHECK_CLOSE(C.get(), ref, tol_of<T>(true), "gemm");
    }
  }
}

TEMPLATE_TEST_CASE("matmul: linear forward and backward", "[matmul]", float, bf16, f16) {
  need_gpu();
  using T = TestType;
  struct Case { int64_t N; int I, O; };
  // N 4100 O 776: the wide column sums' (colsum.cuh v2) many splits and their 8-row steps; O 3
  // and 17 take v1 (O not a multiple of the 16-byte vector)
  for (Case c : {Case{1, 8, 3}, Case{37, 48, 40}, Case{300, 64, 200}, Case{1000, 33, 17}, Case{4100, 24, 776}}) {
    auto hx = rounded<T>(rnd(c.N * c.I, 40)), hw = rounded<T>(rnd(int64_t(c.O) * c.I, 41));
    auto hb = rounded<T>(rnd(c.O, 42)), hd = rounded<T>(rnd(c.N * c.O, 43));
    auto hdw = rounded<T>(rnd(int64_t(c.O) * c.I, 44)), hdb = rounded<T>(rnd(c.O, 45));
    DBuf<T> x(hx), w(hw), b(hb), dout(hd), out(c.N * c.O);
    INFO("N " << c.N << " I " << c.I << " O " << c.O);
    for (bool bias : {true, false}) {
      std::vector<float> ref(c.N * c.O);
      cpu::linear_forward(ref.data(), hx.data(), hw.data(), bias ? hb.data() : nullptr, c.N, c.I, c.O, nullptr);
      out.poison();
      cu::linear_forward(out.p, x.p, w.p, bias ? b.p : nullptr, c.N, c.I, c.O, S());
      CHECK_CLOSE(out.get(), ref, tol_of<T>(true), bias ? "linear_forward bias" : "linear_forward");
    }
    std::vector<float> rdx(c.N * c.I), rdw = hdw, rdb = hdb;
    cpu::linear_backward(rdx.data(), rdw.data(), rdb.data(), hd.data(), hx.data(), hw.data(), c.N, c.I, c.O, nullptr);
    DBuf<T> dx(c.N * c.I), dw(hdw), db(hdb);
    cu::linear_backward(dx.p, dw.p, db.p, dout.p, x.p, w.p, c.N, c.I, c.O, S());
    CHECK_CLOSE(dx.get(), rdx, tol_of<T>(true), "dinp");
    CHECK_CLOSE(dw.get(), rdw, tol_of<T>(true), "dweight (+=)");
    CHECK_CLOSE(db.get(), rdb, tol_of<T>(true), "dbias (+=)");
  }
}

// The residual read as cuBLASLt's C (beta = 1), into a separate output (poisoned first, so an
// output that skipped the residual or the product shows) and in place (out == resid); N 1000 O
// 17 has rows of an odd width.
TEMPLATE_TEST_CASE("matmul: linear_forward_add (the residual in the product)", "[matmul]", float, bf16, f16) {
  need_gpu();
  using T = TestType;
  struct Case { int64_t N; int I, O; };
  for (Case c : {Case{1, 8, 3}, Case{37, 48, 40}, Case{300, 64, 200}, Case{1000, 33, 17}}) {
    auto hx = rounded<T>(rnd(c.N * c.I, 60)), hw = rounded<T>(rnd(int64_t(c.O) * c.I, 61));
    auto hb = rounded<T>(rnd(c.O, 62)), hr = rounded<T>(rnd(c.N * c.O, 63, -4.f, 4.f));
    DBuf<T> x(hx), w(hw), b(hb), r(hr), out(c.N * c.O);
    for (bool bias : {true, false})
      for (bool in_place : {false, true}) {
        INFO("N " << c.N << " I " << c.I << " O " << c.O << (bias ? " bias" : "") << (in_place ? " in place" : ""));
        std::vector<float> ref(c.N * c.O);
        cpu::linear_forward_add(ref.data(), hx.data(), hw.data(), bias ? hb.data() : nullptr, hr.data(), c.N, c.I, c.O,
                                nullptr);
        if (in_place) {
          out.put(hr);
          cu::linear_forward_add(out.p, x.p, w.p, bias ? b.p : nullptr, out.p, c.N, c.I, c.O, S());
        } else {
          out.poison();
          cu::linear_forward_add(out.p, x.p, w.p, bias ? b.p : nullptr, r.p, c.N, c.I, c.O, S());
        }
        CHECK_CLOSE(out.get(), ref, tol_of<T>(true), "linear_forward_add");
        CHECK(r.get() == hr);  // the residual is only read
      }
  }
}

TEMPLATE_TEST_CASE("matmul: linear_forward_batched (parts of one weight, input batch stride 0)", "[matmul]", float, bf16,
                   f16) {
  need_gpu();
  using T = TestType;
  struct Case { int64_t N; int I, O, batch; };
  for (Case c : {Case{1, 8, 16, 3}, Case{37, 48, 64, 3}, Case{300, 64, 40, 2}, Case{129, 24, 8, 1}}) {
    INFO("N " << c.N << " I " << c.I << " O " << c.O << " batch " << c.batch);
    const int64_t per = c.N * c.O;
    auto hx = rounded<T>(rnd(c.N * c.I, 56)), hw = rounded<T>(rnd(int64_t(c.batch) * c.O * c.I, 57, -0.3f, 0.3f));
    auto hb = rounded<T>(rnd(int64_t(c.batch) * c.O, 58));
    DBuf<T> x(hx), w(hw), b(hb), out(c.batch * per);
    for (bool bias : {true, false}) {
      // the reference: one CPU linear per part
      std::vector<float> ref(size_t(c.batch * per));
      for (int p = 0; p < c.batch; p++)
        cpu::linear_forward(ref.data() + p * per, hx.data(), hw.data() + int64_t(p) * c.O * c.I,
                            bias ? hb.data() + int64_t(p) * c.O : nullptr, c.N, c.I, c.O, nullptr);
      out.poison();
      cu::linear_forward_batched(out.p, x.p, w.p, bias ? b.p : nullptr, c.N, c.I, c.O, c.batch, S());
      CHECK_CLOSE(out.get(), ref, tol_of<T>(true), bias ? "linear_forward_batched bias" : "linear_forward_batched");
    }
  }
}

TEMPLATE_TEST_CASE("matmul: linear + GELU in the GEMM epilogue, forward and backward", "[matmul]", float, bf16, f16) {
  need_gpu();
  using T = TestType;
  struct Case { int64_t N; int I, O; };
  // O (the GELU width) multiples of 8 take the cuBLASLt epilogues; 33 takes the fallback
  for (Case c : {Case{1, 8, 16}, Case{37, 48, 64}, Case{300, 64, 256}, Case{1000, 40, 33}}) {
    INFO("N " << c.N << " I " << c.I << " O " << c.O);
    auto hx = rounded<T>(rnd(c.N * c.I, 50)), hw = rounded<T>(rnd(int64_t(c.O) * c.I, 51, -0.3f, 0.3f));
    auto hb = rounded<T>(rnd(c.O, 52));
    DBuf<T> x(hx), w(hw), b(hb), out(c.N * c.O), pre(c.N * c.O);
    std::vector<float> rout(c.N * c.O), rpre(c.N * c.O);
    cpu::linear_gelu_forward(rout.data(), rpre.data(), hx.data(), hw.data(), hb.data(), c.N, c.I, c.O, nullptr);
    out.poison();
    pre.poison();
    cu::linear_gelu_forward(out.p, pre.p, x.p, w.p, b.p, c.N, c.I, c.O, S());
    CHECK_CLOSE(pre.get(), rpre, tol_of<T>(true), "linear_gelu_forward pre");
    CHECK_CLOSE(out.get(), rout, tol_of<T>(true), "linear_gelu_forward out");
    // without pre (no backward follows): GELU_BIAS writes out alone, the same values
    out.poison();
    cu::linear_gelu_forward(out.p, (T*)nullptr, x.p, w.p, b.p, c.N, c.I, c.O, S());
    CHECK_CLOSE(out.get(), rout, tol_of<T>(true), "linear_gelu_forward out, no pre");
    // backward of the next layer (C2 outputs) through this GELU: dpre[N,O] = (dout[N,C2] W2[C2,O]) gelu'(pre)
    const int C2 = 24;
    auto hd = rounded<T>(rnd(c.N * C2, 53)), hw2 = rounded<T>(rnd(int64_t(C2) * c.O, 54, -0.3f, 0.3f));
    auto hpre = rounded<T>(rpre), hdb = rounded<T>(rnd(c.O, 55));
    DBuf<T> dout(hd), w2(hw2), dpre(c.N * c.O), pre_in(hpre), db(hdb);
    std::vector<float> rdpre(c.N * c.O), rdb = hdb;
    cpu::linear_dgelu_backward(rdpre.data(), (float*)nullptr, hd.data(), hw2.data(), hpre.data(), c.N, c.O, C2, nullptr);

    dpre.poison();
    cu::linear_dgelu_backward(dpre.p, db.p, dout.p, w2.p, pre_in.p, c.N, c.O, C2, S());
    auto got = dpre.get();
    CHECK_CLOSE(got, rdpre, tol_of<T>(true), "linear_dgelu_backward dpre");
    // dbias (+=) is the column sum of dpre as stored: summed from the kernel's own dpre, so that
    // the N bf16 roundings of dpre (checked above) do not add up in the comparison
    for (int64_t n = 0; n < c.N; n++)
      for (int o = 0; o < c.O; o++) rdb[size_t(o)] += got[size_t(n * c.O + o)];
    CHECK_CLOSE(db.get(), rdb, tol_of<T>(true), "linear_dgelu_backward dbias (+=)");
  }
}
