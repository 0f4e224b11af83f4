// test_cpu_matmul.cpp: the CPU reference kernels of kernels/cpu/matmul.cpp (gemm and linear forward
// / backward) against naive formulas and central differences in double (the method:
// tests/cpu_kernel_test_util.h); and the LOOM_GEMM_PICK tables CUDA's products read
// (kernels/gemm_pick.h), on made-up text.
#include <catch2/catch.hpp>

#include <random>
#include <sstream>

#include "kernels/cpu/parallel.h"
#include "kernels/gemm_pick.h"
#include "kernels/kernels.h"
#include "tests/tolerances.h"

#include "tests/cpu_kernel_test_util.h"

namespace {
// C[b] = alpha op(A) op(B) + beta C, long double, naive
vector<double> naive_gemm(const vector<double>& A, const vector<double>& B, const vector<double>& C0,
                          int M, int N, int K, bool tA, bool tB, double alpha, double beta,
                          int batch, int64_t sA, int64_t sB, int64_t sC) {
  vector<double> C = C0;
  for (int b = 0; b < batch; b++)
    for (int m = 0; m < M; m++)
      for (int n = 0; n < N; n++) {
        long double acc = 0;
        for (int k = 0; k < K; k++) {
          const double a = tA ? A[b * sA + int64_t(k) * M + m] : A[b * sA + int64_t(m) * K + k];
          const double bb = tB ? B[b * sB + int64_t(n) * K + k] : B[b * sB + int64_t(k) * N + n];
          acc += (long double)a * bb;
        }
        double& c = C[b * sC + int64_t(m) * N + n];
        c = double(alpha * acc + (beta == 0 ? 0.0L : (long double)beta * c));
      }
  return C;
}
}  // namespace

TEST_CASE("gemm: transposes, batch, alpha/beta, beta=0 ignores NaN", "[matmul]") {
  struct Shape { int M, N, K; };
  for (Shape sh : {Shape{5, 7, 9}, Shape{1, 3, 1}, Shape{4, 1, 6}}) {
    for (int batch : {1, 3}) {
      for (int tA = 0; tA < 2; tA++) {
        for (int tB = 0; tB < 2; tB++) {
          for (double beta : {0.0, 1.0, -1.3}) {
            const int M = sh.M, N = sh.N, K = sh.K;
            const int64_t sA = int64_t(M) * K + 3, sB = int64_t(K) * N + 1, sC = int64_t(M) * N + 2;
            vector<double> A = uniform(sA * batch), B = uniform(sB * batch);
            vector<double> C = beta == 0 ? vector<double>(sz(sC * batch), kNaN) : uniform(sC * batch);
            // the gaps between batch items must stay untouched: the reference keeps them too
            vector<double> ref = naive_gemm(A, B, C, M, N, K, tA, tB, 0.7, beta, batch, sA, sB, sC);
            cpu::gemm(C.data(), A.data(), B.data(), M, N, K, tA, tB, 0.7, beta, batch, sA, sB, sC, s0);
            INFO("M=" << M << " N=" << N << " K=" << K << " batch=" << batch << " tA=" << tA
                      << " tB=" << tB << " beta=" << beta);
            // compare only the written elements (the gaps hold NaN when beta = 0)
            vector<double> got_w, ref_w;
            for (int b = 0; b < batch; b++)
              for (int64_t i = 0; i < int64_t(M) * N; i++) {
                got_w.push_back(C[b * sC + i]);
                ref_w.push_back(ref[b * sC + i]);
              }
            LOOM_CHECK_CLOSE(tol::compare(got_w, ref_w, tol::kSameMathF64, "gemm"));
            for (int b = 0; b < batch; b++)  // gap elements unchanged
              for (int64_t i = int64_t(M) * N; i < sC; i++)
                CHECK((std::isnan(C[b * sC + i]) ? std::isnan(ref[b * sC + i])
                                                 : C[b * sC + i] == ref[b * sC + i]));
          }
        }
      }
    }
  }
}

TEST_CASE("gemm: float (Eigen f32) against the double path", "[matmul]") {
  const int M = 67, N = 33, K = 129, batch = 2;
  for (int tA = 0; tA < 2; tA++)
    for (int tB = 0; tB < 2; tB++) {
      vector<double> A = uniform(int64_t(M) * K * batch), B = uniform(int64_t(K) * N * batch);
      vector<double> C = uniform(int64_t(M) * N * batch);
      vector<float> Af = cast_vec<float>(A), Bf = cast_vec<float>(B), Cf = cast_vec<float>(C);
      cpu::gemm(C.data(), A.data(), B.data(), M, N, K, tA, tB, 1.1, 0.5, batch,
                int64_t(M) * K, int64_t(K) * N, int64_t(M) * N, s0);
      cpu::gemm(Cf.data(), Af.data(), Bf.data(), M, N, K, tA, tB, 1.1, 0.5, batch,
                int64_t(M) * K, int64_t(K) * N, int64_t(M) * N, s0);
      LOOM_CHECK_CLOSE(tol::compare(Cf, C, tol::kCpuF32, "gemm f32 vs f64"));
    }
}

TEST_CASE("linear_forward against a naive product, bias or none", "[matmul]") {
  struct Shape { int64_t N; int I, O; };
  for (Shape sh : {Shape{7, 5, 3}, Shape{1, 1, 1}, Shape{1, 9, 4}, Shape{33, 17, 65}}) {
    for (bool with_bias : {true, false}) {
      vector<double> x = uniform(sh.N * sh.I), w = uniform(int64_t(sh.O) * sh.I), bias = uniform(sh.O);
      vector<double> out = poisoned<double>(sh.N * sh.O), ref(sz(sh.N * sh.O));
      cpu::linear_forward(out.data(), x.data(), w.data(), with_bias ? bias.data() : nullptr, sh.N,
                          sh.I, sh.O, s0);
      for (int64_t n = 0; n < sh.N; n++)
        for (int o = 0; o < sh.O; o++) {
          long double acc = with_bias ? bias[sz(o)] : 0.0;
          for (int i = 0; i < sh.I; i++) acc += (long double)x[n * sh.I + i] * w[int64_t(o) * sh.I + i];
          ref[sz(n * sh.O + o)] = double(acc);
        }
      LOOM_CHECK_CLOSE(tol::compare(out, ref, tol::kSameMathF64, "linear_forward"));
    }
  }
}

TEST_CASE("linear_backward: gradcheck, += into dweight/dbias, nullable outputs", "[matmul]") {
  struct Shape { int64_t N; int I, O; };
  for (Shape sh : {Shape{5, 3, 7}, Shape{1, 1, 1}, Shape{4, 11, 2}}) {
    const int64_t N = sh.N;
    const int I = sh.I, O = sh.O;
    vector<double> x = uniform(N * I), w = uniform(int64_t(O) * I), bias = uniform(O);
    vector<double> R = uniform(N * O);
    auto fwd = [&] {
      vector<double> out(sz(N * O));
      cpu::linear_forward(out.data(), x.data(), w.data(), bias.data(), N, I, O, s0);
      return out;
    };
    vector<double> dx = poisoned<double>(N * I);
    vector<double> dw0 = uniform(int64_t(O) * I), db0 = uniform(O);
    vector<double> dw = dw0, db = db0;
    cpu::linear_backward(dx.data(), dw.data(), db.data(), R.data(), x.data(), w.data(), N, I, O, s0);
    LOOM_CHECK_CLOSE(tol::compare(dx, numeric_grad(x, R, fwd), tol::kGradcheckF64, "dinp"));
    LOOM_CHECK_CLOSE(tol::compare(minus(dw, dw0), numeric_grad(w, R, fwd), tol::kGradcheckF64, "dweight"));
    LOOM_CHECK_CLOSE(tol::compare(minus(db, db0), numeric_grad(bias, R, fwd), tol::kGradcheckF64, "dbias"));
    // each output alone (the others null) gives the same numbers
    vector<double> dx2 = poisoned<double>(N * I), dw2 = dw0, db2 = db0;
    cpu::linear_backward(dx2.data(), (double*)nullptr, (double*)nullptr, R.data(), x.data(), w.data(), N, I, O, s0);
    cpu::linear_backward((double*)nullptr, dw2.data(), (double*)nullptr, R.data(), x.data(), w.data(), N, I, O, s0);
    cpu::linear_backward((double*)nullptr, (double*)nullptr, db2.data(), R.data(), x.data(), w.data(), N, I, O, s0);
    LOOM_CHECK_CLOSE(tol::compare(dx2, dx, tol::kSameMathF64, "dinp alone"));
    LOOM_CHECK_CLOSE(tol::compare(dw2, dw, tol::kSameMathF64, "dweight alone"));
    LOOM_CHECK_CLOSE(tol::compare(db2, db, tol::kSameMathF64, "dbias alone"));
  }
}

TEST_CASE("linear: float against double, forward and backward", "[matmul]") {
  const int64_t N = 37;
  const int I = 129, O = 65;
  vector<double> x = uniform(N * I), w = uniform(int64_t(O) * I), b = uniform(O), dy = uniform(N * O);
  vector<float> xf = cast_vec<float>(x), wf = cast_vec<float>(w), bf = cast_vec<float>(b),
                dyf = cast_vec<float>(dy);
  vector<double> out(sz(N * O)), dx(sz(N * I)), dw(sz(O * I), 0.0), db(sz(O), 0.0);
  vector<float> outf = poisoned<float>(N * O), dxf = poisoned<float>(N * I), dwf(sz(O * I), 0.f),
                dbf(sz(O), 0.f);
  cpu::linear_forward(out.data(), x.data(), w.data(), b.data(), N, I, O, s0);
  cpu::linear_forward(outf.data(), xf.data(), wf.data(), bf.data(), N, I, O, s0);
  cpu::linear_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), N, I, O, s0);
  cpu::linear_backward(dxf.data(), dwf.data(), dbf.data(), dyf.data(), xf.data(), wf.data(), N, I, O, s0);
  LOOM_CHECK_CLOSE(tol::compare(outf, out, tol::kCpuF32, "out f32"));
  LOOM_CHECK_CLOSE(tol::compare(dxf, dx, tol::kCpuF32, "dinp f32"));
  LOOM_CHECK_CLOSE(tol::compare(dwf, dw, tol::kCpuF32, "dweight f32"));
  LOOM_CHECK_CLOSE(tol::compare(dbf, db, tol::kCpuF32, "dbias f32"));
}

// Products above the split threshold (kernels/cpu/matmul.cpp: 2^18 multiply-adds) run as one
// slab per thread: row slabs when C is tall, column slabs when it is wide. Both, every
// transpose and beta, against the naive product, on 1 and on 3 threads (3 does not divide the
// sizes, so the slabs are uneven); C starts as NaN where beta = 0.
TEST_CASE("gemm and linear above the split threshold: row and column slabs, any thread count", "[matmul]") {
  struct Shape { int M, N, K; };
  const int threads_before = cpu::num_threads();
  for (int threads : {1, 3}) {
    cpu::set_num_threads(threads);
    for (Shape sh : {Shape{301, 40, 70}, Shape{37, 290, 65}}) {  // tall, wide; M*N*K > 2^18
      const int M = sh.M, N = sh.N, K = sh.K;
      for (int tA = 0; tA < 2; tA++)
        for (int tB = 0; tB < 2; tB++)
          for (double beta : {0.0, 1.0, 0.5}) {
            INFO("threads=" << threads << " M=" << M << " N=" << N << " K=" << K << " tA=" << tA << " tB=" << tB
                            << " beta=" << beta);
            vector<double> A = uniform(int64_t(M) * K), B = uniform(int64_t(K) * N);
            vector<double> C = beta == 0 ? vector<double>(sz(int64_t(M) * N), kNaN) : uniform(int64_t(M) * N);
            vector<double> ref = naive_gemm(A, B, C, M, N, K, tA, tB, -0.9, beta, 1, 0, 0, 0);
            cpu::gemm(C.data(), A.data(), B.data(), M, N, K, tA, tB, -0.9, beta, 1, 0, 0, 0, s0);
            LOOM_CHECK_CLOSE(tol::compare(C, ref, tol::kSameMathF64, "split gemm"));
          }
      // linear: out = x W^T + b; dx = dy W; dW += dy^T x (C = dW [O, I] with K = rows)
      const int rows = M, I = K, O = N;
      vector<double> x = uniform(int64_t(rows) * I), w = uniform(int64_t(O) * I), b = uniform(O);
      vector<double> out(sz(int64_t(rows) * O), kNaN), dy = uniform(int64_t(rows) * O);
      vector<double> dx(sz(int64_t(rows) * I), kNaN), dw = uniform(int64_t(O) * I), dw0 = dw;
      cpu::linear_forward(out.data(), x.data(), w.data(), b.data(), rows, I, O, s0);
      vector<double> out_ref = naive_gemm(x, w, vector<double>(out.size(), 0.0), rows, O, I, false, true, 1, 0, 1, 0, 0, 0);
      for (int r = 0; r < rows; r++)
        for (int o = 0; o < O; o++) out_ref[sz(int64_t(r) * O + o)] += b[sz(o)];
      LOOM_CHECK_CLOSE(tol::compare(out, out_ref, tol::kSameMathF64, "split linear forward"));
      cpu::linear_backward(dx.data(), dw.data(), (double*)nullptr, dy.data(), x.data(), w.data(), rows, I, O, s0);
      LOOM_CHECK_CLOSE(tol::compare(dx, naive_gemm(dy, w, dx, rows, I, O, false, false, 1, 0, 1, 0, 0, 0),
                                    tol::kSameMathF64, "split linear dx"));
      LOOM_CHECK_CLOSE(tol::compare(dw, naive_gemm(dy, x, dw0, O, I, rows, true, false, 1, 1, 1, 0, 0, 0),
                                    tol::kSameMathF64, "split linear dweight"));
    }
  }
  cpu::set_num_threads(threads_before);
}

TEST_CASE("LOOM_GEMM_PICK tables: entries, comments, lookups, and errors naming file and line", "[matmul]") {
  // a fresh table of random products each run, written as bench/gemm_pick.py writes them
  std::mt19937 g(std::random_device{}());
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(g); };
  std::vector<loom::GemmPick> want;
  std::ostringstream text;
  text << "# LOOM_GEMM_PICK from made-up lines: M N K ta tb epilogue batch rank\n\n";
  const int n = pick(1, 12);
  for (int i = 0; i < n; i++) {
    loom::GemmPick p{1000 + i, pick(1, 5000), pick(1, 5000), pick(0, 1), pick(0, 1), pick(1, 200), pick(1, 3),
                     pick(0, 7)};
    want.push_back(p);
    text << p.M << " " << p.N << " " << p.K << " " << p.ta << " " << p.tb << " " << p.epilogue << " " << p.batch
         << "  " << p.rank << (i % 2 ? "  # layer" + std::to_string(i) + " fwd: 0.5 -> 0.4 ms a step\n" : "\n");
  }
  std::istringstream in(text.str());
  const auto table = loom::parse_gemm_picks(in, "made-up.txt");
  REQUIRE(table.size() == want.size());
  for (const auto& p : want) {
    CHECK(loom::find_gemm_pick(table, p.M, p.N, p.K, p.ta, p.tb, p.epilogue, p.batch) == p.rank);
    // one size or flag off: not this product
    CHECK(loom::find_gemm_pick(table, p.M, p.N + 1, p.K, p.ta, p.tb, p.epilogue, p.batch) == -1);
    CHECK(loom::find_gemm_pick(table, p.M, p.N, p.K, 1 - p.ta, p.tb, p.epilogue, p.batch) == -1);
    CHECK(loom::find_gemm_pick(table, p.M, p.N, p.K, p.ta, p.tb, p.epilogue + 1, p.batch) == -1);
  }
  // bad lines: each error names the file and the line (the good lines before it counted)
  const std::string head = "# comment\n6272 2304 768 0 1 4 1 4\n";
  const std::pair<std::string, std::string> bad[] = {
      {"6272 2304 768 0 1 4 1\n", "made-up.txt:3: 7 numbers, want 8"},
      {"6272 2304 768 0 1 4 1 2 9\n", "made-up.txt:3: 9 numbers, want 8"},
      {"6272 2304 768 0 1 four 1 2\n", "made-up.txt:3: 'four' is not a whole number"},
      {"6272 2304 768 0 1 4 1 2.5\n", "made-up.txt:3: '2.5' is not a whole number"},
      {"6272 2304 768 0 1 4 1 -1\n", "made-up.txt:3: a number out of range (-1)"},
      {"6272 2304 768 2 1 4 1 1\n", "made-up.txt:3: ta and tb are 0 or 1"},
      {"6272 2304 768 0 1 4 1 3 # again\n", "made-up.txt:3: the product of line 2 again"},
  };
  for (const auto& [line, msg] : bad) {
    std::istringstream b(head + line);
    CHECK_THROWS_WITH(loom::parse_gemm_picks(b, "made-up.txt"), Catch::Contains(msg));
  }
  CHECK_THROWS_WITH(loom::load_gemm_picks("tests/no_such_pick_table.txt"),
                    Catch::Contains("cannot open tests/no_such_pick_table.txt"));
}
