// test_cpu_kernels_a.cpp: the CPU reference kernels of part A (memory, matmul, norms,
// activations, indexing, rope).
//
// Every forward is checked against a naive formula written here independently (long double
// where rounding could matter) or, for data movement, exactly; every backward against central
// differences of its forward in double (loss = sum(out * R) for a fixed random R, eps 1e-6,
// tol::kGradcheckF64). `+=` outputs are prefilled with random values and the prefill is
// subtracted before comparing, so an `=` where `+=` was due fails. Outputs are poisoned with
// NaN before each call, so an element a kernel forgets to write fails. The float
// instantiations are checked against the double ones (tol::kCpuF32).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "kernels/kernels.h"
#include "tests/tolerances.h"

using namespace loom;
using std::vector;

namespace {

const Stream s0 = nullptr;
inline size_t sz(int64_t n) { return static_cast<size_t>(n); }
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::mt19937_64& rng() {
  static std::mt19937_64 gen(20240611);
  return gen;
}

vector<double> uniform(int64_t n, double lo = -1.0, double hi = 1.0) {
  std::uniform_real_distribution<double> dist(lo, hi);
  vector<double> v(sz(n > 0 ? n : 0));
  for (auto& x : v) x = dist(rng());
  return v;
}

vector<int32_t> randint(int64_t n, int lo, int hi) {  // [lo, hi)
  std::uniform_int_distribution<int> dist(lo, hi - 1);
  vector<int32_t> v(sz(n));
  for (auto& x : v) x = dist(rng());
  return v;
}

template <class T> vector<T> poisoned(int64_t n) { return vector<T>(sz(n), T(kNaN)); }

template <class To, class From> vector<To> cast_vec(const vector<From>& v) {
  vector<To> out(v.size());
  for (size_t i = 0; i < v.size(); i++) out[i] = To(v[i]);
  return out;
}

// d/dx of sum(f() * R) by central differences; f reads x, which is perturbed in place.
vector<double> numeric_grad(vector<double>& x, const vector<double>& R,
                            const std::function<vector<double>()>& f) {
  const double eps = 1e-6;
  vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); i++) {
    const double saved = x[i];
    x[i] = saved + eps;
    vector<double> up = f();
    x[i] = saved - eps;
    vector<double> down = f();
    x[i] = saved;
    long double acc = 0;
    for (size_t j = 0; j < R.size(); j++) acc += (long double)(up[j] - down[j]) * R[j];
    g[i] = double(acc / (2 * eps));
  }
  return g;
}

// got - prefill: what a `+=` output received
vector<double> minus(const vector<double>& a, const vector<double>& b) {
  vector<double> d(a.size());
  for (size_t i = 0; i < a.size(); i++) d[i] = a[i] - b[i];
  return d;
}

// naive row-major multi-index walk: offset of element `linear` of a layout
int64_t naive_offset(const Layout& l, int64_t linear) {
  vector<int64_t> idx(sz(l.ndim));
  for (int d = l.ndim - 1; d >= 0; d--) {
    idx[d] = linear % l.shape[d];
    linear /= l.shape[d];
  }
  int64_t off = 0;
  for (int d = 0; d < l.ndim; d++) off += idx[d] * l.stride[d];
  return off;
}

Layout make_layout(std::initializer_list<int64_t> shape, std::initializer_list<int64_t> stride) {
  Layout l;
  l.ndim = int(shape.size());
  int d = 0;
  for (int64_t x : shape) l.shape[d++] = x;
  d = 0;
  for (int64_t x : stride) l.stride[d++] = x;
  return l;
}

template <class T> double to_d(T x) { return double(x); }
template <> double to_d<bf16>(bf16 x) { return double(float(x)); }
template <class T> T from_d(double x) { return T(x); }
template <> bf16 from_d<bf16>(double x) { return bf16(float(x)); }

}  // namespace

// ====================================================================== memory
TEMPLATE_TEST_CASE("fill writes every element", "[memory]", float, double, bf16, int32_t, int64_t) {
  for (int64_t n : {1, 37, 40000}) {
    vector<TestType> out(sz(n), from_d<TestType>(-123.0));
    cpu::fill(out.data(), 2.0, n, s0);
    int64_t bad = 0;
    for (auto& x : out) bad += to_d(x) != 2.0;
    CHECK(bad == 0);
  }
  vector<float> f(5);
  cpu::fill(f.data(), 0.1, 5, s0);
  CHECK(f[4] == 0.1f);
}

namespace {
template <class To, class From> void check_convert() {
  const int n = 201;  // 0..200: exact in every type, uint8 and bf16 included
  vector<From> in(n);
  for (int i = 0; i < n; i++) in[sz(i)] = from_d<From>(double((i * 37) % 201));
  vector<To> out(n, from_d<To>(-1.0));
  cpu::convert(out.data(), in.data(), n, s0);
  int bad = 0;
  for (int i = 0; i < n; i++) bad += to_d(out[sz(i)]) != to_d(in[sz(i)]);
  INFO("convert " << sizeof(From) << "-byte -> " << sizeof(To) << "-byte");
  CHECK(bad == 0);
}
template <class From> void check_convert_from() {
  check_convert<float, From>();
  check_convert<double, From>();
  check_convert<bf16, From>();
  check_convert<int32_t, From>();
  check_convert<int64_t, From>();
}
}  // namespace

TEST_CASE("convert: every instantiated pair, exact on integers", "[memory]") {
  check_convert_from<float>();
  check_convert_from<double>();
  check_convert_from<bf16>();
  check_convert_from<int32_t>();
  check_convert_from<int64_t>();
  check_convert_from<uint8_t>();
}

TEST_CASE("convert: rounding and truncation", "[memory]") {
  vector<double> x = uniform(1000, -300, 300);
  vector<float> xf = cast_vec<float>(x);
  vector<bf16> b(1000);
  cpu::convert(b.data(), xf.data(), 1000, s0);
  vector<float> back(1000, NAN);
  cpu::convert(back.data(), b.data(), 1000, s0);
  int bad = 0;
  for (int i = 0; i < 1000; i++) {
    bad += b[sz(i)].bits != bf16(xf[sz(i)]).bits;           // round to nearest even
    bad += std::fabs(back[sz(i)] - xf[sz(i)]) > std::fabs(xf[sz(i)]) / 256;
  }
  CHECK(bad == 0);
  vector<double> t = {-2.7, 2.7, -0.5, 1e9};
  vector<int32_t> ti(4);
  cpu::convert(ti.data(), t.data(), 4, s0);
  CHECK(ti == vector<int32_t>{-2, 2, 0, 1000000000});  // C++ truncation, as torch .to(int)
}

TEMPLATE_TEST_CASE("copy_strided: permuted, expanded, offset views", "[memory]", float, double,
                   bf16, int32_t, int64_t, uint8_t) {
  // source buffer: 5x3x4 contiguous values 0..59 (+ slack), exact in every type
  vector<TestType> src(64);
  for (int i = 0; i < 64; i++) src[sz(i)] = from_d<TestType>(double(i));
  struct Case { Layout l; int64_t base; const char* what; };
  vector<Case> cases = {
      {make_layout({5, 3, 4}, {12, 4, 1}), 0, "contiguous"},
      {make_layout({4, 5, 3}, {1, 12, 4}), 0, "permute(2,0,1)"},
      {make_layout({2, 4, 5, 3}, {0, 1, 12, 4}), 0, "expand + permute"},
      {make_layout({3, 2, 3}, {-4, 1, 12}), 8, "negative stride, offset"},
      {make_layout({7}, {9}), 1, "1-d strided"},
      {make_layout({}, {}), 5, "0-d"},
      {make_layout({3, 0, 2}, {1, 1, 1}), 0, "empty"},
      {make_layout({1, 1, 3, 1}, {0, 7, 2, 0}), 3, "size-1 dims"},
  };
  for (auto& c : cases) {
    const int64_t n = c.l.numel();
    vector<TestType> out(sz(n) + 1, from_d<TestType>(99.0));  // one sentinel past the end
    cpu::copy_strided(out.data(), src.data() + c.base, c.l, s0);
    int bad = 0;
    for (int64_t i = 0; i < n; i++)
      bad += to_d(out[sz(i)]) != to_d(src[sz(c.base + naive_offset(c.l, i))]);
    INFO(c.what);
    CHECK(bad == 0);
    CHECK(to_d(out[sz(n)]) == 99.0);
  }
}

TEMPLATE_TEST_CASE("binary: broadcast and strided operands, every op", "[memory]", float, double) {
  using T = TestType;
  // a [3,1,5] broadcast over dim 1; b [1,4,5] over dim 0; out [3,4,5]
  vector<T> a = cast_vec<T>(uniform(15)), b = cast_vec<T>(uniform(20, 0.5, 2.0));
  // a transposed: stored [5,3], read as [3,5] with strides [1,3]; b a [5] row broadcast
  vector<T> at = cast_vec<T>(uniform(15)), brow = cast_vec<T>(uniform(5, 0.5, 2.0));
  struct Case { const T* a; Layout la; const T* b; Layout lb; };
  vector<Case> cases = {
      {a.data(), make_layout({3, 4, 5}, {5, 0, 1}), b.data(), make_layout({3, 4, 5}, {0, 5, 1})},
      {at.data(), make_layout({3, 5}, {1, 3}), brow.data(), make_layout({3, 5}, {0, 1})},
      {b.data(), make_layout({20}, {1}), b.data() + 7, make_layout({20}, {0})},  // scalar b
      {a.data(), make_layout({1}, {1}), a.data() + 1, make_layout({1}, {1})},    // n = 1
  };
  for (auto op : {BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div}) {
    for (auto& c : cases) {
      const int64_t n = c.la.numel();
      vector<T> out = poisoned<T>(n), ref(sz(n));
      cpu::binary(out.data(), c.a, c.la, c.b, c.lb, op, s0);
      for (int64_t i = 0; i < n; i++) {
        const T x = c.a[naive_offset(c.la, i)], y = c.b[naive_offset(c.lb, i)];
        ref[sz(i)] = op == BinaryOp::Add ? x + y
                       : op == BinaryOp::Sub ? x - y
                       : op == BinaryOp::Mul ? x * y
                                             : x / y;
      }
      LOOM_CHECK_CLOSE(tol::compare(out, ref, tol::kSameMathF64, "binary"));
    }
  }
  Layout bad_b = make_layout({3, 5, 4}, {0, 1, 5});
  vector<T> out(60);
  CHECK_THROWS_AS(cpu::binary(out.data(), a.data(), make_layout({3, 4, 5}, {5, 0, 1}), b.data(),
                              bad_b, BinaryOp::Add, s0),
                  std::invalid_argument);
}

TEMPLATE_TEST_CASE("unary: every op", "[memory]", float, double) {
  using T = TestType;
  const int64_t n = 1001;
  vector<T> in = cast_vec<T>(uniform(n, 0.05, 3.0));  // positive: log and sqrt are defined
  vector<T> neg = cast_vec<T>(uniform(n, -3.0, 3.0));
  for (auto op : {UnaryOp::Neg, UnaryOp::Exp, UnaryOp::Log, UnaryOp::Sqrt, UnaryOp::Square,
                  UnaryOp::Abs}) {
    const vector<T>& x = (op == UnaryOp::Log || op == UnaryOp::Sqrt) ? in : neg;
    vector<T> out = poisoned<T>(n);
    vector<double> ref(sz(n));
    cpu::unary(out.data(), x.data(), op, n, s0);
    for (int64_t i = 0; i < n; i++) {
      const long double v = x[sz(i)];
      ref[sz(i)] = double(op == UnaryOp::Neg ? -v
                             : op == UnaryOp::Exp ? std::exp(v)
                             : op == UnaryOp::Log ? std::log(v)
                             : op == UnaryOp::Sqrt ? std::sqrt(v)
                             : op == UnaryOp::Square ? v * v
                                                     : std::fabs(v));
    }
    // one rounding in T: 1 ulp of float (6e-8) or double
    const tol::Tol t = sizeof(T) == 4 ? tol::kCpuF32 : tol::kSameMathF64;
    LOOM_CHECK_CLOSE(tol::compare(out, ref, t, "unary"));
  }
}

TEMPLATE_TEST_CASE("axpby and axpy_dev", "[memory]", float, double) {
  using T = TestType;
  const tol::Tol t = sizeof(T) == 4 ? tol::kCpuF32 : tol::kSameMathF64;
  for (int64_t n : {1, 999, 40001}) {
    vector<double> a = uniform(n), b = uniform(n);
    vector<T> at = cast_vec<T>(a), bt = cast_vec<T>(b), out = poisoned<T>(n);
    vector<double> ref(sz(n));
    cpu::axpby(out.data(), at.data(), 0.75, bt.data(), -1.5, n, s0);
    for (int64_t i = 0; i < n; i++) ref[sz(i)] = 0.75 * double(at[i]) - 1.5 * double(bt[i]);
    LOOM_CHECK_CLOSE(tol::compare(out, ref, t, "axpby"));
    out = poisoned<T>(n);
    cpu::axpby(out.data(), at.data(), -2.5, static_cast<const T*>(nullptr), 3.0, n, s0);
    for (int64_t i = 0; i < n; i++) ref[sz(i)] = -2.5 * double(at[i]);
    LOOM_CHECK_CLOSE(tol::compare(out, ref, t, "axpby b=null"));
    // in place: out aliases a
    vector<T> inplace = at;
    cpu::axpby(inplace.data(), inplace.data(), 2.0, bt.data(), 1.0, n, s0);
    for (int64_t i = 0; i < n; i++) ref[sz(i)] = 2.0 * double(at[i]) + double(bt[i]);
    LOOM_CHECK_CLOSE(tol::compare(inplace, ref, t, "axpby in place"));
    // axpy_dev: y += alpha x
    vector<T> y = at;
    const acc_t<T> alpha = acc_t<T>(0.3);
    cpu::axpy_dev(y.data(), &alpha, bt.data(), n, s0);
    for (int64_t i = 0; i < n; i++) ref[sz(i)] = double(at[i]) + double(alpha) * double(bt[i]);
    LOOM_CHECK_CLOSE(tol::compare(y, ref, t, "axpy_dev"));
  }
}

TEMPLATE_TEST_CASE("reduce_sum_to: reduced dims anywhere, strided input", "[memory]", float, double) {
  using T = TestType;
  const tol::Tol t = sizeof(T) == 4 ? tol::kCpuF32 : tol::kSameMathF64;
  vector<T> in = cast_vec<T>(uniform(3 * 4 * 5 + 7));
  const Layout contig = make_layout({3, 4, 5}, {20, 5, 1});
  const Layout permuted = make_layout({4, 3, 5}, {5, 20, 1});  // a permute(1,0,2) view
  const Layout expanded = make_layout({2, 3, 5}, {0, 7, 1});   // reads overlap
  struct Case { Layout in_l; Layout out_l; int64_t out_n; const char* what; };
  vector<Case> cases = {
      {contig, make_layout({3, 4, 5}, {0, 1, 0}), 4, "keep dim 1"},
      {contig, make_layout({3, 4, 5}, {5, 0, 1}), 15, "reduce dim 1"},
      {contig, make_layout({3, 4, 5}, {0, 0, 0}), 1, "everything"},
      {contig, make_layout({3, 4, 5}, {20, 5, 1}), 60, "nothing"},
      {contig, make_layout({3, 4, 5}, {4, 1, 0}), 12, "last dim"},
      {permuted, make_layout({4, 3, 5}, {0, 5, 1}), 15, "permuted input"},
      {expanded, make_layout({2, 3, 5}, {0, 5, 1}), 15, "expanded input"},
  };
  for (auto& c : cases) {
    vector<T> out = poisoned<T>(c.out_n);
    cpu::reduce_sum_to(out.data(), c.out_l, in.data(), c.in_l, s0);
    vector<long double> acc(sz(c.out_n), 0.0L);
    for (int64_t i = 0; i < c.in_l.numel(); i++)
      acc[sz(naive_offset(c.out_l, i))] += in[sz(naive_offset(c.in_l, i))];
    vector<double> ref(acc.begin(), acc.end());
    INFO(c.what);
    LOOM_CHECK_CLOSE(tol::compare(out, ref, t, "reduce_sum_to"));
  }
}

TEST_CASE("sum_all: double exact-ish, float against double", "[memory]") {
  for (int64_t n : {1, 1023, 1025, 100003}) {
    vector<double> x = uniform(n);
    long double ref = 0;
    for (double v : x) ref += v;
    double got = kNaN;
    cpu::sum_all(&got, x.data(), n, s0);
    double r = double(ref);
    LOOM_CHECK_CLOSE(tol::compare(&got, &r, 1, tol::kSameMathF64, "sum_all f64"));
    vector<float> xf = cast_vec<float>(x);
    long double reff = 0;
    for (float v : xf) reff += v;
    float gotf = NAN;
    cpu::sum_all(&gotf, xf.data(), n, s0);
    r = double(reff);
    LOOM_CHECK_CLOSE(tol::compare(&gotf, &r, 1, tol::kCpuF32, "sum_all f32"));
  }
}

// ====================================================================== matmul
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

// ====================================================================== norms
namespace {
struct NC { int64_t N; int C; };
const NC kNormShapes[] = {{1, 1}, {3, 3}, {5, 37}, {1, 64}, {3, 1030}};

// naive LayerNorm in long double with the one-pass variance (a different formula from the
// kernel's two-pass one)
void naive_layernorm(vector<double>& out, vector<double>& mean, vector<double>& rstd,
                     const vector<double>& x, const vector<double>& w, const double* b, int64_t N,
                     int C, double eps) {
  for (int64_t n = 0; n < N; n++) {
    long double s = 0, ss = 0;
    for (int c = 0; c < C; c++) {
      s += x[n * C + c];
      ss += (long double)x[n * C + c] * x[n * C + c];
    }
    const long double mu = s / C, var = ss / C - mu * mu, r = 1 / std::sqrt(var + eps);
    for (int c = 0; c < C; c++)
      out[n * C + c] = double((x[n * C + c] - mu) * r * w[c] + (b ? b[c] : 0.0));
    mean[n] = double(mu);
    rstd[n] = double(r);
  }
}
}  // namespace

TEST_CASE("layernorm_forward against a naive formula; mean/rstd saved", "[norms]") {
  for (NC sh : kNormShapes) {
    for (bool with_bias : {true, false}) {
      const int64_t N = sh.N;
      const int C = sh.C;
      vector<double> x = uniform(N * C, -2, 3), w = uniform(C), b = uniform(C);
      vector<double> out = poisoned<double>(N * C), mean = poisoned<double>(N), rstd = poisoned<double>(N);
      vector<double> ro(sz(N * C)), rm(sz(N)), rr(sz(N));
      cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(),
                             with_bias ? b.data() : nullptr, N, C, 1e-6, s0);
      naive_layernorm(ro, rm, rr, x, w, with_bias ? b.data() : nullptr, N, C, 1e-6);
      INFO("N=" << N << " C=" << C << " bias=" << with_bias);
      // the naive one-pass variance loses ~1e-16 * mean^2 / var relative: allow 1e-10
      LOOM_CHECK_CLOSE(tol::compare(out, ro, tol::kSameMathF64, "out"));
      LOOM_CHECK_CLOSE(tol::compare(mean, rm, tol::kSameMathF64, "mean"));
      LOOM_CHECK_CLOSE(tol::compare(rstd, rr, tol::kSameMathF64, "rstd"));
    }
  }
}

TEST_CASE("layernorm_backward: gradcheck of inp, weight, bias (+=)", "[norms]") {
  for (NC sh : kNormShapes) {
    for (bool with_bias : {true, false}) {
      const int64_t N = sh.N;
      const int C = sh.C;
      vector<double> x = uniform(N * C, -2, 3), w = uniform(C), b = uniform(C), R = uniform(N * C);
      auto fwd = [&] {
        vector<double> out(sz(N * C)), m(sz(N)), r(sz(N));
        cpu::layernorm_forward(out.data(), m.data(), r.data(), x.data(), w.data(),
                               with_bias ? b.data() : nullptr, N, C, 1e-6, s0);
        return out;
      };
      vector<double> out(sz(N * C)), mean(sz(N)), rstd(sz(N));
      cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(),
                             with_bias ? b.data() : nullptr, N, C, 1e-6, s0);
      vector<double> dx = poisoned<double>(N * C), dw0 = uniform(C), db0 = uniform(C);
      vector<double> dw = dw0, db = db0;
      cpu::layernorm_backward(dx.data(), dw.data(), with_bias ? db.data() : nullptr, R.data(),
                              x.data(), w.data(), mean.data(), rstd.data(), N, C, s0);
      INFO("N=" << N << " C=" << C << " bias=" << with_bias);
      LOOM_CHECK_CLOSE(tol::compare(dx, numeric_grad(x, R, fwd), tol::kGradcheckF64, "dinp"));
      LOOM_CHECK_CLOSE(tol::compare(minus(dw, dw0), numeric_grad(w, R, fwd), tol::kGradcheckF64, "dweight"));
      if (with_bias)
        LOOM_CHECK_CLOSE(tol::compare(minus(db, db0), numeric_grad(b, R, fwd), tol::kGradcheckF64, "dbias"));
      else
        CHECK(db == db0);
    }
  }
}

TEST_CASE("residual_layernorm_forward = add, then layernorm_forward", "[norms]") {
  for (NC sh : kNormShapes) {
    const int64_t N = sh.N;
    const int C = sh.C;
    vector<double> resid = uniform(N * C), x = uniform(N * C), w = uniform(C), b = uniform(C);
    vector<double> ro = poisoned<double>(N * C), out = poisoned<double>(N * C);
    vector<double> mean = poisoned<double>(N), rstd = poisoned<double>(N);
    cpu::residual_layernorm_forward(ro.data(), out.data(), mean.data(), rstd.data(), resid.data(),
                                    x.data(), w.data(), b.data(), N, C, 1e-6, s0);
    vector<double> sum(sz(N * C));
    for (size_t i = 0; i < sum.size(); i++) sum[i] = resid[i] + x[i];
    vector<double> out2(sz(N * C)), m2(sz(N)), r2(sz(N));
    cpu::layernorm_forward(out2.data(), m2.data(), r2.data(), sum.data(), w.data(), b.data(), N, C, 1e-6, s0);
    CHECK(ro == sum);
    CHECK(out == out2);
    CHECK(mean == m2);
    CHECK(rstd == r2);
  }
}

TEST_CASE("rmsnorm_forward against a naive formula; rstd saved", "[norms]") {
  for (NC sh : kNormShapes) {
    const int64_t N = sh.N;
    const int C = sh.C;
    vector<double> x = uniform(N * C, -2, 3), w = uniform(C);
    vector<double> out = poisoned<double>(N * C), rstd = poisoned<double>(N);
    vector<double> ro(sz(N * C)), rr(sz(N));
    cpu::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5, s0);
    for (int64_t n = 0; n < N; n++) {
      long double ss = 0;
      for (int c = 0; c < C; c++) ss += (long double)x[n * C + c] * x[n * C + c];
      const long double r = 1 / std::sqrt(ss / C + 1e-5L);
      for (int c = 0; c < C; c++) ro[sz(n * C + c)] = double(x[n * C + c] * r * w[c]);
      rr[sz(n)] = double(r);
    }
    INFO("N=" << N << " C=" << C);
    LOOM_CHECK_CLOSE(tol::compare(out, ro, tol::kSameMathF64, "out"));
    LOOM_CHECK_CLOSE(tol::compare(rstd, rr, tol::kSameMathF64, "rstd"));
  }
}

TEST_CASE("rmsnorm_backward: gradcheck of inp and weight (+=)", "[norms]") {
  for (NC sh : kNormShapes) {
    const int64_t N = sh.N;
    const int C = sh.C;
    vector<double> x = uniform(N * C, -2, 3), w = uniform(C), R = uniform(N * C);
    auto fwd = [&] {
      vector<double> out(sz(N * C)), r(sz(N));
      cpu::rmsnorm_forward(out.data(), r.data(), x.data(), w.data(), N, C, 1e-5, s0);
      return out;
    };
    vector<double> out(sz(N * C)), rstd(sz(N));
    cpu::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5, s0);
    vector<double> dx = poisoned<double>(N * C), dw0 = uniform(C), dw = dw0;
    cpu::rmsnorm_backward(dx.data(), dw.data(), R.data(), x.data(), w.data(), rstd.data(), N, C, s0);
    INFO("N=" << N << " C=" << C);
    LOOM_CHECK_CLOSE(tol::compare(dx, numeric_grad(x, R, fwd), tol::kGradcheckF64, "dinp"));
    LOOM_CHECK_CLOSE(tol::compare(minus(dw, dw0), numeric_grad(w, R, fwd), tol::kGradcheckF64, "dweight"));
  }
}

TEST_CASE("residual_rmsnorm_forward = add, then rmsnorm_forward", "[norms]") {
  for (NC sh : kNormShapes) {
    const int64_t N = sh.N;
    const int C = sh.C;
    vector<double> resid = uniform(N * C), x = uniform(N * C), w = uniform(C);
    vector<double> ro = poisoned<double>(N * C), out = poisoned<double>(N * C), rstd = poisoned<double>(N);
    cpu::residual_rmsnorm_forward(ro.data(), out.data(), rstd.data(), resid.data(), x.data(),
                                  w.data(), N, C, 1e-5, s0);
    vector<double> sum(sz(N * C));
    for (size_t i = 0; i < sum.size(); i++) sum[i] = resid[i] + x[i];
    vector<double> out2(sz(N * C)), r2(sz(N));
    cpu::rmsnorm_forward(out2.data(), r2.data(), sum.data(), w.data(), N, C, 1e-5, s0);
    CHECK(ro == sum);
    CHECK(out == out2);
    CHECK(rstd == r2);
  }
}

TEST_CASE("norms: float against double, large enough to take the threaded paths", "[norms]") {
  const int64_t N = 41;
  const int C = 1030;  // N*C > 32768: rows and column blocks run on threads
  vector<double> x = uniform(N * C, -2, 3), w = uniform(C), b = uniform(C), dy = uniform(N * C);
  vector<float> xf = cast_vec<float>(x), wf = cast_vec<float>(w), bf = cast_vec<float>(b),
                dyf = cast_vec<float>(dy);
  vector<double> out(sz(N * C)), mean(sz(N)), rstd(sz(N)), dx(sz(N * C)),
      dw(sz(C), 0.0), db(sz(C), 0.0);
  vector<float> outf = poisoned<float>(N * C), meanf = poisoned<float>(N), rstdf = poisoned<float>(N),
                dxf = poisoned<float>(N * C), dwf(sz(C), 0.f), dbf(sz(C), 0.f);
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, 1e-6, s0);
  cpu::layernorm_forward(outf.data(), meanf.data(), rstdf.data(), xf.data(), wf.data(), bf.data(), N, C, 1e-6, s0);
  cpu::layernorm_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), mean.data(),
                          rstd.data(), N, C, s0);
  cpu::layernorm_backward(dxf.data(), dwf.data(), dbf.data(), dyf.data(), xf.data(), wf.data(),
                          meanf.data(), rstdf.data(), N, C, s0);
  LOOM_CHECK_CLOSE(tol::compare(outf, out, tol::kCpuF32, "layernorm out f32"));
  LOOM_CHECK_CLOSE(tol::compare(dxf, dx, tol::kCpuF32, "layernorm dinp f32"));
  LOOM_CHECK_CLOSE(tol::compare(dwf, dw, tol::kCpuF32, "layernorm dweight f32"));
  LOOM_CHECK_CLOSE(tol::compare(dbf, db, tol::kCpuF32, "layernorm dbias f32"));
  // and the threaded double path against the naive formula
  vector<double> ro(sz(N * C)), rm(sz(N)), rr(sz(N));
  naive_layernorm(ro, rm, rr, x, w, b.data(), N, C, 1e-6);
  LOOM_CHECK_CLOSE(tol::compare(out, ro, tol::kSameMathF64, "layernorm threaded f64"));

  vector<double> rs(sz(N)), dw2(sz(C), 0.0);
  vector<float> rsf = poisoned<float>(N), dw2f(sz(C), 0.f);
  cpu::rmsnorm_forward(out.data(), rs.data(), x.data(), w.data(), N, C, 1e-5, s0);
  cpu::rmsnorm_forward(outf.data(), rsf.data(), xf.data(), wf.data(), N, C, 1e-5, s0);
  cpu::rmsnorm_backward(dx.data(), dw2.data(), dy.data(), x.data(), w.data(), rs.data(), N, C, s0);
  cpu::rmsnorm_backward(dxf.data(), dw2f.data(), dyf.data(), xf.data(), wf.data(), rsf.data(), N, C, s0);
  LOOM_CHECK_CLOSE(tol::compare(outf, out, tol::kCpuF32, "rmsnorm out f32"));
  LOOM_CHECK_CLOSE(tol::compare(dxf, dx, tol::kCpuF32, "rmsnorm dinp f32"));
  LOOM_CHECK_CLOSE(tol::compare(dw2f, dw2, tol::kCpuF32, "rmsnorm dweight f32"));
}

// ====================================================================== activations
namespace {
long double naive_gelu(long double x) {
  const long double k = std::sqrt(2.0L / 3.14159265358979323846264338327950288L);
  return 0.5L * x * (1 + std::tanh(k * (x + 0.044715L * x * x * x)));
}
long double naive_silu(long double x) { return x / (1 + std::exp(-x)); }

vector<double> activation_inputs(int64_t n) {
  vector<double> x = uniform(n, -4, 4);
  if (n > 4) { x[0] = -12; x[1] = 12; x[2] = 0; x[3] = -30; }  // saturated tails and zero
  return x;
}
}  // namespace

TEST_CASE("gelu / silu forward against naive formulas", "[activations]") {
  for (int64_t n : {1, 7, 1001, 40000}) {
    vector<double> x = activation_inputs(n);
    vector<double> g = poisoned<double>(n), sl = poisoned<double>(n), rg(sz(n)), rs(sz(n));
    cpu::gelu_forward(g.data(), x.data(), n, s0);
    cpu::silu_forward(sl.data(), x.data(), n, s0);
    for (int64_t i = 0; i < n; i++) {
      rg[sz(i)] = double(naive_gelu(x[sz(i)]));
      rs[sz(i)] = double(naive_silu(x[sz(i)]));
    }
    LOOM_CHECK_CLOSE(tol::compare(g, rg, tol::kSameMathF64, "gelu"));
    LOOM_CHECK_CLOSE(tol::compare(sl, rs, tol::kSameMathF64, "silu"));
    vector<float> xf = cast_vec<float>(x), gf = poisoned<float>(n), sf = poisoned<float>(n);
    cpu::gelu_forward(gf.data(), xf.data(), n, s0);
    cpu::silu_forward(sf.data(), xf.data(), n, s0);
    LOOM_CHECK_CLOSE(tol::compare(gf, rg, tol::kCpuF32, "gelu f32"));
    LOOM_CHECK_CLOSE(tol::compare(sf, rs, tol::kCpuF32, "silu f32"));
  }
}

TEST_CASE("gelu / silu / swiglu backward: gradcheck", "[activations]") {
  const int64_t n = 301;
  vector<double> x = activation_inputs(n), up = uniform(n, -2, 2), R = uniform(n);
  auto gelu = [&] { vector<double> o(sz(n)); cpu::gelu_forward(o.data(), x.data(), n, s0); return o; };
  auto silu = [&] { vector<double> o(sz(n)); cpu::silu_forward(o.data(), x.data(), n, s0); return o; };
  auto swiglu = [&] {
    vector<double> o(sz(n));
    cpu::swiglu_forward(o.data(), x.data(), up.data(), n, s0);
    return o;
  };
  vector<double> d = poisoned<double>(n);
  cpu::gelu_backward(d.data(), R.data(), x.data(), n, s0);
  LOOM_CHECK_CLOSE(tol::compare(d, numeric_grad(x, R, gelu), tol::kGradcheckF64, "gelu dinp"));
  d = poisoned<double>(n);
  cpu::silu_backward(d.data(), R.data(), x.data(), n, s0);
  LOOM_CHECK_CLOSE(tol::compare(d, numeric_grad(x, R, silu), tol::kGradcheckF64, "silu dinp"));
  vector<double> dg = poisoned<double>(n), du = poisoned<double>(n);
  cpu::swiglu_backward(dg.data(), du.data(), R.data(), x.data(), up.data(), n, s0);
  LOOM_CHECK_CLOSE(tol::compare(dg, numeric_grad(x, R, swiglu), tol::kGradcheckF64, "swiglu dgate"));
  LOOM_CHECK_CLOSE(tol::compare(du, numeric_grad(up, R, swiglu), tol::kGradcheckF64, "swiglu dup"));
  // swiglu forward against the naive product
  vector<double> o = swiglu(), ro(sz(n));
  for (int64_t i = 0; i < n; i++) ro[sz(i)] = double(naive_silu(x[sz(i)]) * up[sz(i)]);
  LOOM_CHECK_CLOSE(tol::compare(o, ro, tol::kSameMathF64, "swiglu"));
}

TEST_CASE("activations: float backward against double", "[activations]") {
  const int64_t n = 40001;  // threaded
  vector<double> x = activation_inputs(n), up = uniform(n), dy = uniform(n);
  vector<float> xf = cast_vec<float>(x), upf = cast_vec<float>(up), dyf = cast_vec<float>(dy);
  vector<double> a(sz(n)), b(sz(n));
  vector<float> af = poisoned<float>(n), bf = poisoned<float>(n);
  cpu::gelu_backward(a.data(), dy.data(), x.data(), n, s0);
  cpu::gelu_backward(af.data(), dyf.data(), xf.data(), n, s0);
  LOOM_CHECK_CLOSE(tol::compare(af, a, tol::kCpuF32, "gelu_backward f32"));
  cpu::silu_backward(a.data(), dy.data(), x.data(), n, s0);
  cpu::silu_backward(af.data(), dyf.data(), xf.data(), n, s0);
  LOOM_CHECK_CLOSE(tol::compare(af, a, tol::kCpuF32, "silu_backward f32"));
  cpu::swiglu_backward(a.data(), b.data(), dy.data(), x.data(), up.data(), n, s0);
  cpu::swiglu_backward(af.data(), bf.data(), dyf.data(), xf.data(), upf.data(), n, s0);
  LOOM_CHECK_CLOSE(tol::compare(af, a, tol::kCpuF32, "swiglu dgate f32"));
  LOOM_CHECK_CLOSE(tol::compare(bf, b, tol::kCpuF32, "swiglu dup f32"));
}

TEST_CASE("softmax: stable forward, gradcheck backward", "[activations]") {
  for (NC sh : {NC{1, 1}, NC{3, 5}, NC{4, 33}, NC{2, 1030}, NC{40, 1030}}) {
    const int64_t N = sh.N;
    const int C = sh.C;
    vector<double> x = uniform(N * C, -5, 5);
    for (int c = 0; c < C; c++) x[sz(c)] += 1000;  // row 0 would overflow a naive exp
    vector<double> y = poisoned<double>(N * C), ref(sz(N * C));
    cpu::softmax_forward(y.data(), x.data(), N, C, s0);
    for (int64_t n = 0; n < N; n++) {
      long double mx = -INFINITY, sum = 0;
      for (int c = 0; c < C; c++) mx = std::max(mx, (long double)x[n * C + c]);
      for (int c = 0; c < C; c++) sum += std::exp(x[n * C + c] - mx);
      for (int c = 0; c < C; c++) ref[sz(n * C + c)] = double(std::exp(x[n * C + c] - mx) / sum);
    }
    INFO("N=" << N << " C=" << C);
    LOOM_CHECK_CLOSE(tol::compare(y, ref, tol::kSameMathF64, "softmax"));
    vector<float> xf = cast_vec<float>(x), yf = poisoned<float>(N * C);
    cpu::softmax_forward(yf.data(), xf.data(), N, C, s0);
    vector<double> ref_f(sz(N * C));  // the float input rounds x by up to 6e-5 at 1000
    for (int64_t n = 0; n < N; n++) {
      long double mx = -INFINITY, sum = 0;
      for (int c = 0; c < C; c++) mx = std::max(mx, (long double)xf[n * C + c]);
      for (int c = 0; c < C; c++) sum += std::exp(xf[n * C + c] - mx);
      for (int c = 0; c < C; c++) ref_f[sz(n * C + c)] = double(std::exp(xf[n * C + c] - mx) / sum);
    }
    LOOM_CHECK_CLOSE(tol::compare(yf, ref_f, tol::kCpuF32, "softmax f32"));
    if (N * C > 5000) continue;  // the gradcheck below is O((NC)^2)
    vector<double> R = uniform(N * C);
    auto fwd = [&] { vector<double> o(sz(N * C)); cpu::softmax_forward(o.data(), x.data(), N, C, s0); return o; };
    vector<double> dx = poisoned<double>(N * C);
    cpu::softmax_backward(dx.data(), R.data(), y.data(), N, C, s0);
    LOOM_CHECK_CLOSE(tol::compare(dx, numeric_grad(x, R, fwd), tol::kGradcheckF64, "softmax dinp"));
  }
}

// ====================================================================== indexing
TEST_CASE("embedding: forward exact, backward gradcheck (+=, repeated ids), bad ids throw", "[indexing]") {
  const int V = 11, C = 5;
  const int64_t N = 17;  // > V: ids repeat
  vector<int32_t> ids = randint(N, 0, V);
  vector<double> table = uniform(int64_t(V) * C), R = uniform(N * C);
  vector<double> out = poisoned<double>(N * C);
  cpu::embedding_forward(out.data(), ids.data(), table.data(), N, C, V, s0);
  int bad = 0;
  for (int64_t n = 0; n < N; n++)
    for (int c = 0; c < C; c++) bad += out[sz(n * C + c)] != table[sz(ids[sz(n)] * C + c)];
  CHECK(bad == 0);
  auto fwd = [&] {
    vector<double> o(sz(N * C));
    cpu::embedding_forward(o.data(), ids.data(), table.data(), N, C, V, s0);
    return o;
  };
  vector<double> dt0 = uniform(int64_t(V) * C), dt = dt0;
  cpu::embedding_backward(dt.data(), R.data(), ids.data(), N, C, V, s0);
  LOOM_CHECK_CLOSE(tol::compare(minus(dt, dt0), numeric_grad(table, R, fwd), tol::kGradcheckF64, "dtable"));

  vector<int32_t> bad_ids = {0, 3, V, 1};
  CHECK_THROWS_AS(cpu::embedding_forward(out.data(), bad_ids.data(), table.data(), 4, C, V, s0),
                  std::out_of_range);
  CHECK_THROWS_WITH(cpu::embedding_forward(out.data(), bad_ids.data(), table.data(), 4, C, V, s0),
                    Catch::Contains("11") && Catch::Contains("position 2"));
  bad_ids[2] = -1;
  CHECK_THROWS_AS(cpu::embedding_backward(dt.data(), R.data(), bad_ids.data(), 4, C, V, s0),
                  std::out_of_range);
}

TEST_CASE("embedding: threaded float backward is deterministic and matches double", "[indexing]") {
  const int V = 50, C = 1030;
  const int64_t N = 300;
  vector<int32_t> ids = randint(N, 0, V);
  vector<double> dy = uniform(N * C);
  vector<float> dyf = cast_vec<float>(dy);
  vector<double> dt(sz(V * C), 0.0);
  vector<float> a(sz(V * C), 0.f), b(sz(V * C), 0.f);
  cpu::embedding_backward(dt.data(), dy.data(), ids.data(), N, C, V, s0);
  cpu::embedding_backward(a.data(), dyf.data(), ids.data(), N, C, V, s0);
  cpu::embedding_backward(b.data(), dyf.data(), ids.data(), N, C, V, s0);
  CHECK(a == b);
  LOOM_CHECK_CLOSE(tol::compare(a, dt, tol::kCpuF32, "dtable f32"));
}

TEST_CASE("gather_rows / scatter_rows / zero_rows: exact", "[indexing]") {
  for (int B : {1, 3}) {
    const int N = 9, K = 4, C = 3;
    vector<double> inp = uniform(int64_t(B) * N * C), src = uniform(int64_t(B) * K * C);
    vector<int32_t> idx;  // distinct within each b (a random permutation prefix)
    for (int b = 0; b < B; b++) {
      vector<int32_t> perm(N);
      for (int i = 0; i < N; i++) perm[sz(i)] = i;
      std::shuffle(perm.begin(), perm.end(), rng());
      idx.insert(idx.end(), perm.begin(), perm.begin() + K);
    }
    vector<double> out = poisoned<double>(int64_t(B) * K * C);
    cpu::gather_rows(out.data(), inp.data(), idx.data(), B, N, K, C, s0);
    int bad = 0;
    for (int b = 0; b < B; b++)
      for (int k = 0; k < K; k++)
        for (int c = 0; c < C; c++)
          bad += out[sz((b * K + k) * C + c)] != inp[sz((b * N + idx[sz(b * K + k)]) * C + c)];
    CHECK(bad == 0);

    // scatter (=): the scattered rows hold src, every other row is untouched
    vector<double> base = uniform(int64_t(B) * N * C), sc = base;
    cpu::scatter_rows(sc.data(), idx.data(), src.data(), B, N, K, C, false, s0);
    vector<double> ref = base;
    for (int b = 0; b < B; b++)
      for (int k = 0; k < K; k++)
        for (int c = 0; c < C; c++)
          ref[sz((b * N + idx[sz(b * K + k)]) * C + c)] = src[sz((b * K + k) * C + c)];
    CHECK(sc == ref);

    // scatter (+=) with repeated indices
    vector<int32_t> rep = randint(int64_t(B) * K, 0, 3);
    vector<double> acc = base;
    cpu::scatter_rows(acc.data(), rep.data(), src.data(), B, N, K, C, true, s0);
    ref = base;
    for (int b = 0; b < B; b++)
      for (int k = 0; k < K; k++)
        for (int c = 0; c < C; c++)
          ref[sz((b * N + rep[sz(b * K + k)]) * C + c)] += src[sz((b * K + k) * C + c)];
    LOOM_CHECK_CLOSE(tol::compare(acc, ref, tol::kSameMathF64, "scatter +="));

    vector<double> z = base;
    cpu::zero_rows(z.data(), idx.data(), B, N, K, C, s0);
    ref = base;
    for (int b = 0; b < B; b++)
      for (int k = 0; k < K; k++)
        for (int c = 0; c < C; c++) ref[sz((b * N + idx[sz(b * K + k)]) * C + c)] = 0;
    CHECK(z == ref);
  }
  vector<int32_t> bad = {0, 9};
  vector<double> inp(27), out(6);
  CHECK_THROWS_AS(cpu::gather_rows(out.data(), inp.data(), bad.data(), 1, 9, 2, 3, s0), std::out_of_range);
}

TEST_CASE("patchify: SPEC layout, H != W, exact inverse, gradcheck", "[indexing]") {
  struct Shape { int B, Ch, H, W, p; };
  for (Shape sh : {Shape{1, 3, 12, 8, 4}, Shape{3, 1, 6, 10, 2}, Shape{2, 3, 4, 4, 1}, Shape{1, 2, 5, 5, 5}}) {
    const int B = sh.B, Ch = sh.Ch, H = sh.H, W = sh.W, p = sh.p;
    const int64_t n = int64_t(B) * Ch * H * W;
    vector<double> img = uniform(n);
    vector<double> out = poisoned<double>(n);
    cpu::patchify(out.data(), img.data(), B, Ch, H, W, p, s0);
    // SPEC §1: element (c, i p + u, j p + v) goes to patch i (W/p) + j, feature (u p + v) Ch + c
    int bad = 0;
    for (int b = 0; b < B; b++)
      for (int c = 0; c < Ch; c++)
        for (int y = 0; y < H; y++)
          for (int x = 0; x < W; x++) {
            const int i = y / p, u = y % p, j = x / p, v = x % p;
            const int64_t patch = int64_t(b) * (H / p) * (W / p) + i * (W / p) + j;
            const int64_t feat = (u * p + v) * Ch + c;
            bad += out[sz(patch * p * p * Ch + feat)] != img[sz(((b * Ch + c) * H + y) * W + x)];
          }
    INFO("B=" << B << " Ch=" << Ch << " H=" << H << " W=" << W << " p=" << p);
    CHECK(bad == 0);
    vector<double> back = poisoned<double>(n);
    cpu::patchify_backward(back.data(), out.data(), B, Ch, H, W, p, s0);
    CHECK(back == img);
    vector<double> R = uniform(n);
    auto fwd = [&] { vector<double> o(sz(n)); cpu::patchify(o.data(), img.data(), B, Ch, H, W, p, s0); return o; };
    vector<double> dimg = poisoned<double>(n);
    cpu::patchify_backward(dimg.data(), R.data(), B, Ch, H, W, p, s0);
    LOOM_CHECK_CLOSE(tol::compare(dimg, numeric_grad(img, R, fwd), tol::kGradcheckF64, "dimg"));
  }
  vector<double> img(3 * 10 * 8), out(3 * 10 * 8);
  CHECK_THROWS_AS(cpu::patchify(out.data(), img.data(), 1, 3, 10, 8, 4, s0), std::invalid_argument);
}

TEST_CASE("pixel_shuffle: reference layout, exact inverse, gradcheck", "[indexing]") {
  const int s = 2;
  struct Shape { int B, G, D; };
  for (Shape sh : {Shape{1, 4, 3}, Shape{3, 6, 5}, Shape{2, 2, 1}}) {
    const int B = sh.B, G = sh.G, D = sh.D, g = G / s;
    const int64_t n = int64_t(B) * G * G * D;
    vector<double> inp = uniform(n), out = poisoned<double>(n);
    cpu::pixel_shuffle(out.data(), inp.data(), B, G, D, s, s0);
    // torch_ref.py: x.view(B, g, s, g, s, D).permute(0, 1, 3, 2, 4, 5).reshape(B, g*g, s*s*D):
    // out index (b, I, J, u, v, d) reads view index (b, I, u, J, v, d)
    int bad = 0;
    for (int b = 0; b < B; b++)
      for (int I = 0; I < g; I++)
        for (int J = 0; J < g; J++)
          for (int u = 0; u < s; u++)
            for (int v = 0; v < s; v++)
              for (int d = 0; d < D; d++) {
                const int64_t o = ((((int64_t(b) * g + I) * g + J) * s + u) * s + v) * D + d;
                const int64_t i = ((((int64_t(b) * g + I) * s + u) * g + J) * s + v) * D + d;
                bad += out[sz(o)] != inp[sz(i)];
              }
    INFO("B=" << B << " G=" << G << " D=" << D);
    CHECK(bad == 0);
    vector<double> back = poisoned<double>(n);
    cpu::pixel_shuffle_backward(back.data(), out.data(), B, G, D, s, s0);
    CHECK(back == inp);
    vector<double> R = uniform(n);
    auto fwd = [&] { vector<double> o(sz(n)); cpu::pixel_shuffle(o.data(), inp.data(), B, G, D, s, s0); return o; };
    vector<double> dinp = poisoned<double>(n);
    cpu::pixel_shuffle_backward(dinp.data(), R.data(), B, G, D, s, s0);
    LOOM_CHECK_CLOSE(tol::compare(dinp, numeric_grad(inp, R, fwd), tol::kGradcheckF64, "dinp"));
  }
  vector<double> x(5 * 5 * 2), y(5 * 5 * 2);
  CHECK_THROWS_AS(cpu::pixel_shuffle(y.data(), x.data(), 1, 5, 2, 2, s0), std::invalid_argument);
}

TEST_CASE("mean_pool: forward naive, backward gradcheck", "[indexing]") {
  struct Shape { int B, K, C; };
  for (Shape sh : {Shape{1, 1, 1}, Shape{3, 7, 5}, Shape{2, 16, 33}}) {
    const int B = sh.B, K = sh.K, C = sh.C;
    vector<double> x = uniform(int64_t(B) * K * C), out = poisoned<double>(int64_t(B) * C),
                   ref(sz(B * C)), R = uniform(int64_t(B) * C);
    cpu::mean_pool_forward(out.data(), x.data(), B, K, C, s0);
    for (int b = 0; b < B; b++)
      for (int c = 0; c < C; c++) {
        long double acc = 0;
        for (int k = 0; k < K; k++) acc += x[sz((b * K + k) * C + c)];
        ref[sz(b * C + c)] = double(acc / K);
      }
    LOOM_CHECK_CLOSE(tol::compare(out, ref, tol::kSameMathF64, "mean_pool"));
    auto fwd = [&] { vector<double> o(sz(B * C)); cpu::mean_pool_forward(o.data(), x.data(), B, K, C, s0); return o; };
    vector<double> dx = poisoned<double>(int64_t(B) * K * C);
    cpu::mean_pool_backward(dx.data(), R.data(), B, K, C, s0);
    LOOM_CHECK_CLOSE(tol::compare(dx, numeric_grad(x, R, fwd), tol::kGradcheckF64, "mean_pool dinp"));
  }
}

TEST_CASE("l2norm: F.normalize semantics, clamped rows, gradcheck", "[indexing]") {
  for (NC sh : {NC{1, 1}, NC{4, 3}, NC{3, 37}, NC{2, 1030}}) {
    const int64_t N = sh.N;
    const int C = sh.C;
    vector<double> x = uniform(N * C, -2, 2), R = uniform(N * C);
    for (double eps : {1e-12, 0.0}) {
      vector<double> out = poisoned<double>(N * C), rn = poisoned<double>(N), ref(sz(N * C)), rref(sz(N));
      cpu::l2norm_forward(out.data(), rn.data(), x.data(), N, C, eps, s0);
      for (int64_t n = 0; n < N; n++) {
        long double ss = 0;
        for (int c = 0; c < C; c++) ss += (long double)x[n * C + c] * x[n * C + c];
        const long double norm = std::max(std::sqrt(ss), (long double)eps);
        for (int c = 0; c < C; c++) ref[sz(n * C + c)] = double(x[n * C + c] / norm);
        rref[sz(n)] = double(1 / norm);
      }
      INFO("N=" << N << " C=" << C);
      LOOM_CHECK_CLOSE(tol::compare(out, ref, tol::kSameMathF64, "l2norm"));
      LOOM_CHECK_CLOSE(tol::compare(rn, rref, tol::kSameMathF64, "rnorm"));
    }
    // gradcheck with some rows clamped: eps = 1 and row 0 scaled to norm ~0.3 (its
    // perturbations stay far from the boundary); other rows have norm > 1
    vector<double> xc = x;
    double ss0 = 0;
    for (int c = 0; c < C; c++) ss0 += xc[sz(c)] * xc[sz(c)];
    for (int c = 0; c < C; c++) xc[sz(c)] *= 0.3 / std::sqrt(ss0);
    for (int64_t n = 1; n < N; n++) {
      double ss = 0;
      for (int c = 0; c < C; c++) ss += xc[sz(n * C + c)] * xc[sz(n * C + c)];
      for (int c = 0; c < C; c++) xc[sz(n * C + c)] *= 2.5 / std::sqrt(ss);
    }
    for (double eps : {1e-12, 1.0}) {
      auto fwd = [&] {
        vector<double> o(sz(N * C)), r(sz(N));
        cpu::l2norm_forward(o.data(), r.data(), xc.data(), N, C, eps, s0);
        return o;
      };
      vector<double> out(sz(N * C)), rn(sz(N)), dx = poisoned<double>(N * C);
      cpu::l2norm_forward(out.data(), rn.data(), xc.data(), N, C, eps, s0);
      cpu::l2norm_backward(dx.data(), R.data(), xc.data(), rn.data(), N, C, s0);
      INFO("N=" << N << " C=" << C << " eps=" << eps);
      LOOM_CHECK_CLOSE(tol::compare(dx, numeric_grad(xc, R, fwd), tol::kGradcheckF64, "l2norm dinp"));
    }
  }
}

TEMPLATE_TEST_CASE("argmax_rows: first maximum wins", "[indexing]", float, double) {
  using T = TestType;
  for (NC sh : {NC{1, 1}, NC{5, 7}, NC{3, 1030}, NC{40, 1030}}) {
    const int64_t N = sh.N;
    const int C = sh.C;
    vector<T> x = cast_vec<T>(uniform(N * C));
    if (C > 3) {
      x[sz(C - 1)] = T(5);  // row 0: a tie at 2 and C-1, the first wins
      x[2] = T(5);
    }
    vector<int32_t> out(sz(N), -7), ref(sz(N));
    cpu::argmax_rows(out.data(), x.data(), N, C, s0);
    for (int64_t n = 0; n < N; n++) {
      int best = 0;
      for (int c = 0; c < C; c++)
        if (x[sz(n * C + c)] > x[sz(n * C + best)]) best = c;
      ref[sz(n)] = best;
    }
    CHECK(out == ref);
  }
}

// ====================================================================== rope
namespace {
vector<double> naive_rope(const vector<double>& x, const vector<int32_t>& pos, int64_t N, int H,
                          int hd, double theta) {
  vector<double> out(x.size());
  const int half = hd / 2;
  for (int64_t n = 0; n < N; n++)
    for (int h = 0; h < H; h++)
      for (int i = 0; i < half; i++) {
        const long double ang = pos[sz(n)] * std::pow((long double)theta, -2.0L * i / hd);
        const long double c = std::cos(ang), s = std::sin(ang);
        const size_t b = sz((n * H + h) * hd);
        out[b + i] = double(x[b + i] * c - x[b + i + half] * s);
        out[b + i + half] = double(x[b + i + half] * c + x[b + i] * s);
      }
  return out;
}
}  // namespace

TEST_CASE("rope: forward naive, float like the reference, backward gradcheck and inverse", "[rope]") {
  struct Shape { int64_t N; int H, hd; };
  for (Shape sh : {Shape{7, 3, 8}, Shape{1, 1, 2}, Shape{13, 4, 64}, Shape{80, 9, 64}}) {
    const int64_t N = sh.N;
    const int H = sh.H, hd = sh.hd;
    const int64_t n = N * H * hd;
    vector<double> x = uniform(n), R = uniform(n);
    // ragged documents: positions restart at 0
    vector<int32_t> pos(sz(N));
    for (int64_t t = 0; t < N; t++) pos[sz(t)] = int32_t(t < 5 ? t : t - 5);
    if (N > 2) pos[sz(N - 1)] = 300;
    const double theta = 100000.0;
    vector<double> out = poisoned<double>(n);
    cpu::rope_forward(out.data(), x.data(), pos.data(), N, H, hd, theta, s0);
    INFO("N=" << N << " H=" << H << " hd=" << hd);
    LOOM_CHECK_CLOSE(tol::compare(out, naive_rope(x, pos, N, H, hd, theta), tol::kSameMathF64, "rope"));

    // float: angles in float, exactly as torch_ref.py rope_cos_sin does in f32
    vector<float> xf = cast_vec<float>(x), of = poisoned<float>(n);
    cpu::rope_forward(of.data(), xf.data(), pos.data(), N, H, hd, theta, s0);
    vector<double> rf(sz(n));
    for (int64_t t = 0; t < N; t++)
      for (int h = 0; h < H; h++)
        for (int i = 0; i < hd / 2; i++) {
          const float inv = 1.0f / std::pow(float(theta), float(2 * i) / float(hd));
          const float ang = float(pos[sz(t)]) * inv;
          const double c = std::cos(ang), s = std::sin(ang);
          const size_t b = sz((t * H + h) * hd);
          rf[b + i] = double(xf[b + i]) * c - double(xf[b + i + hd / 2]) * s;
          rf[b + i + hd / 2] = double(xf[b + i + hd / 2]) * c + double(xf[b + i]) * s;
        }
    LOOM_CHECK_CLOSE(tol::compare(of, rf, tol::kCpuF32, "rope f32"));

    // a rotation's transpose is its inverse; in place (out aliases inp) too
    vector<double> back = out;
    cpu::rope_backward(back.data(), back.data(), pos.data(), N, H, hd, theta, s0);
    LOOM_CHECK_CLOSE(tol::compare(back, x, tol::kSameMathF64, "rope inverse"));
    if (n > 5000) continue;  // the gradcheck is O(n^2); 80x9x64 is there for the threaded path

    auto fwd = [&] {
      vector<double> o(sz(n));
      cpu::rope_forward(o.data(), x.data(), pos.data(), N, H, hd, theta, s0);
      return o;
    };
    vector<double> dx = poisoned<double>(n);
    cpu::rope_backward(dx.data(), R.data(), pos.data(), N, H, hd, theta, s0);
    LOOM_CHECK_CLOSE(tol::compare(dx, numeric_grad(x, R, fwd), tol::kGradcheckF64, "rope dinp"));
  }
  vector<double> x(6), y(6);
  vector<int32_t> pos = {0, 1};
  CHECK_THROWS_AS(cpu::rope_forward(y.data(), x.data(), pos.data(), 2, 1, 3, 1e4, s0), std::invalid_argument);
}
