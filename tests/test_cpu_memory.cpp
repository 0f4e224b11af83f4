// test_cpu_memory.cpp: the CPU reference kernels of kernels/cpu/memory.cpp (fill, convert,
// copy_strided, binary, unary, axpby, reduce_sum_to, sum_all) against naive formulas and central
// differences in double (the method: tests/cpu_kernel_test_util.h).
#include <algorithm>
#include <limits>
#include <catch2/catch.hpp>

#include "kernels/kernels.h"
#include "tests/tolerances.h"

#include "tests/cpu_kernel_test_util.h"

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
    cpu::axpy_dev(y.data(), &alpha, bt.data(), n, true, s0);
    for (int64_t i = 0; i < n; i++) ref[sz(i)] = double(at[i]) + double(alpha) * double(bt[i]);
    LOOM_CHECK_CLOSE(tol::compare(y, ref, t, "axpy_dev"));
    // axpy_dev without accumulation: y = alpha x, y (poisoned) never read
    std::fill(y.begin(), y.end(), std::numeric_limits<T>::quiet_NaN());
    cpu::axpy_dev(y.data(), &alpha, bt.data(), n, false, s0);
    for (int64_t i = 0; i < n; i++) ref[sz(i)] = double(alpha) * double(bt[i]);
    LOOM_CHECK_CLOSE(tol::compare(y, ref, t, "axpy_dev ="));
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
