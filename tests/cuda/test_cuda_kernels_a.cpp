// test_cuda_kernels_a.cpp: every CUDA kernel of part A (runtime, memory, matmul, norms,
// activations, indexing, rope, optim) against its loom::cpu reference, forward and backward,
// in f32 and bf16. bf16 runs take inputs rounded to bf16 and compare with the f32 reference
// on those same rounded inputs. Every output is poisoned with NaN before the launch.
// Exits with code 4 (skipped) when no GPU is present.
//   bash tools/gpu-kernels.sh tests/cuda/test_cuda_kernels_a.cpp
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <random>
#include <type_traits>
#include <vector>

#include "kernels/kernels.h"
#include "tests/tolerances.h"

namespace {

using loom::bf16;
using loom::Layout;
namespace cu = loom::cuda;
namespace cpu = loom::cpu;
namespace tol = loom::tol;

void need_gpu() {
  if (!cu::available()) {
    std::fprintf(stderr, "no CUDA device: skipping\n");
    std::exit(4);
  }
}
loom::Stream S() { return cu::default_stream(); }

template <class T> constexpr bool kBF = std::is_same_v<T, bf16>;
template <class T> tol::Tol tol_of(bool gemm = false) {
  return kBF<T> ? tol::kCudaBF16 : gemm ? tol::kCudaF32Gemm : tol::kCudaF32;
}

std::vector<float> rnd(size_t n, uint64_t seed, float lo = -1.f, float hi = 1.f) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}
std::vector<int32_t> rnd_int(size_t n, uint64_t seed, int lo, int hi) {  // [lo, hi)
  std::mt19937_64 g(seed);
  std::uniform_int_distribution<int> d(lo, hi - 1);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

template <class T> T to_t(float x) { return T(x); }
template <class T> float to_f(T x) { return float(x); }

// the values a T buffer holds after storing `v`
template <class T> std::vector<float> rounded(std::vector<float> v) {
  for (auto& x : v) x = to_f(to_t<T>(x));
  return v;
}

// A device buffer of n T, poisoned with NaN (ints: -7777) on creation.
template <class T> struct DBuf {
  T* p = nullptr;
  size_t n = 0;
  explicit DBuf(size_t n_) : n(n_) {
    p = static_cast<T*>(cu::device_malloc(std::max<size_t>(1, n) * sizeof(T)));
    poison();
  }
  explicit DBuf(const std::vector<float>& h) : DBuf(h.size()) { put(h); }
  ~DBuf() { cu::device_free(p); }
  DBuf(const DBuf&) = delete;
  void put(const std::vector<float>& h) {
    std::vector<T> t(n);
    for (size_t i = 0; i < n; i++) t[i] = to_t<T>(h[i]);
    cu::memcpy_h2d(p, t.data(), n * sizeof(T), S());
  }
  void poison() {
    std::vector<T> t(n, to_t<T>(std::is_integral_v<T> ? -7777.f : NAN));
    cu::memcpy_h2d(p, t.data(), n * sizeof(T), S());
  }
  std::vector<float> get() const {
    std::vector<T> t(n);
    cu::memcpy_d2h(t.data(), p, n * sizeof(T), S());
    std::vector<float> f(n);
    for (size_t i = 0; i < n; i++) f[i] = to_f(t[i]);
    return f;
  }
};
struct IBuf {  // int32 index array on the device
  int32_t* p;
  explicit IBuf(const std::vector<int32_t>& h) {
    p = static_cast<int32_t*>(cu::device_malloc(std::max<size_t>(1, h.size()) * 4));
    cu::memcpy_h2d(p, h.data(), h.size() * 4, S());
  }
  ~IBuf() { cu::device_free(p); }
};

Layout make_layout(std::vector<int64_t> shape, std::vector<int64_t> stride = {}) {
  Layout l;
  l.ndim = int(shape.size());
  int64_t s = 1;
  for (int d = l.ndim - 1; d >= 0; d--) {
    l.shape[d] = shape[d];
    l.stride[d] = stride.empty() ? s : stride[d];
    s *= shape[d];
  }
  return l;
}

#define CHECK_CLOSE(got, ref, t, what) LOOM_CHECK_CLOSE(tol::compare(got, ref, t, what))

}  // namespace

// ------------------------------------------------------------------------------ runtime
TEST_CASE("runtime: caching allocator reuses blocks and counts bytes", "[runtime]") {
  need_gpu();
  CHECK(cu::device_count() >= 1);
  size_t base = cu::bytes_in_use();
  void* a = cu::device_malloc(1000);
  CHECK(cu::bytes_in_use() == base + 1024);  // 512-byte classes below 1 MiB
  cu::device_free(a);
  void* b = cu::device_malloc(900);  // same class: the cached block comes back
  CHECK(b == a);
  void* big = cu::device_malloc((3 << 20) + 5);  // 2 MiB classes above 1 MiB
  CHECK(cu::bytes_in_use() == base + 1024 + (4 << 20));
  CHECK(cu::peak_bytes_in_use() >= cu::bytes_in_use());
  cu::device_free(big);
  cu::device_free(b);
  CHECK(cu::bytes_in_use() == base);
  cu::reset_peak_bytes();
  CHECK(cu::peak_bytes_in_use() == base);
  REQUIRE_THROWS(cu::device_free(reinterpret_cast<void*>(0x1234)));

  // memcpy / memset round trip through pinned memory
  auto h = rnd(1000, 1);
  float* pin = static_cast<float*>(cu::pinned_malloc(4000));
  std::memcpy(pin, h.data(), 4000);
  float* d = static_cast<float*>(cu::device_malloc(4000));
  float* d2 = static_cast<float*>(cu::device_malloc(4000));
  cu::memcpy_h2d(d, pin, 4000, S());
  cu::memcpy_d2d(d2, d, 4000, S());
  std::vector<float> back(1000);
  cu::memcpy_d2h(back.data(), d2, 4000, S());
  CHECK(back == h);
  cu::memset_zero(d2, 4000, S());
  cu::memcpy_d2h(back.data(), d2, 4000, S());
  CHECK(back == std::vector<float>(1000, 0.f));
  cu::synchronize();
  cu::device_free(d);
  cu::device_free(d2);
  cu::pinned_free(pin);
}

// ------------------------------------------------------------------------------ memory
TEMPLATE_TEST_CASE("memory: fill, copy_strided, convert", "[memory]", float, bf16, int32_t, int64_t) {
  need_gpu();
  using T = TestType;
  DBuf<T> out(1001);
  cu::fill(out.p, 3.0, 1001, S());
  CHECK(out.get() == std::vector<float>(1001, 3.f));
  // a [5, 7, 3] view of a [3, 5, 7] tensor (permute 1, 2, 0)
  auto h = rnd_int(105, 2, -50, 50);
  std::vector<float> hf(h.begin(), h.end());
  DBuf<T> in(hf);
  Layout l = make_layout({5, 7, 3}, {7, 1, 35});
  DBuf<T> dst(105);
  cu::copy_strided(dst.p, in.p, l, S());
  std::vector<float> ref(105);
  for (int a = 0; a < 5; a++)
    for (int b = 0; b < 7; b++)
      for (int c = 0; c < 3; c++) ref[(a * 7 + b) * 3 + c] = hf[a * 7 + b + c * 35];
  CHECK(dst.get() == ref);
  // convert to every other type and back
  DBuf<float> f(105);
  cu::convert(f.p, in.p, 105, S());
  CHECK(f.get() == hf);
  DBuf<bf16> b16(105);
  cu::convert(b16.p, in.p, 105, S());
  CHECK(b16.get() == hf);  // small integers are exact in bf16
  DBuf<int32_t> i32(105);
  cu::convert(i32.p, in.p, 105, S());
  CHECK(i32.get() == hf);
  DBuf<int64_t> i64(105);
  cu::convert(i64.p, in.p, 105, S());
  CHECK(i64.get() == hf);
}

TEST_CASE("memory: convert float<->double and float->bf16 rounding", "[memory]") {
  need_gpu();
  auto h = rnd(777, 3, -100, 100);
  DBuf<float> f(h);
  double* d = static_cast<double*>(cu::device_malloc(777 * 8));
  cu::convert(d, f.p, 777, S());
  DBuf<float> back(777);
  cu::convert(back.p, static_cast<const double*>(d), 777, S());
  CHECK(back.get() == h);
  std::vector<double> hd(777);
  cu::memcpy_d2h(hd.data(), d, 777 * 8, S());
  for (int i = 0; i < 777; i++) CHECK(hd[i] == double(h[i]));
  cu::device_free(d);
  DBuf<bf16> b(777);
  cu::convert(b.p, f.p, 777, S());
  CHECK(b.get() == rounded<bf16>(h));  // device rounding = host round-to-nearest-even
}

TEMPLATE_TEST_CASE("memory: binary, unary, axpby, axpy_dev, reduce_sum_to, sum_all", "[memory]", float, bf16) {
  need_gpu();
  using T = TestType;
  const auto t = tol_of<T>();
  // binary with broadcast: a [4, 33, 5] + b [33, 1] broadcast
  Layout la = make_layout({4, 33, 5});
  Layout lb = make_layout({4, 33, 5}, {0, 1, 0});
  auto ha = rounded<T>(rnd(660, 4)), hb = rounded<T>(rnd(33, 5, 0.5f, 2.f));
  DBuf<T> a(ha), b(hb), out(660);
  for (auto op : {loom::BinaryOp::Add, loom::BinaryOp::Sub, loom::BinaryOp::Mul, loom::BinaryOp::Div}) {
    std::vector<float> ref(660);
    cpu::binary(ref.data(), ha.data(), la, hb.data(), lb, op, nullptr);
    out.poison();
    cu::binary(out.p, a.p, la, b.p, lb, op, S());
    CHECK_CLOSE(out.get(), ref, t, "binary broadcast");
  }
  {  // contiguous fast path
    auto hc = rounded<T>(rnd(660, 6));
    DBuf<T> c(hc);
    std::vector<float> ref(660);
    cpu::binary(ref.data(), ha.data(), la, hc.data(), la, loom::BinaryOp::Mul, nullptr);
    out.poison();
    cu::binary(out.p, a.p, la, c.p, la, loom::BinaryOp::Mul, S());
    CHECK_CLOSE(out.get(), ref, t, "binary contiguous");
  }
  auto hp = rounded<T>(rnd(660, 7, 0.1f, 3.f));
  DBuf<T> pos(hp);
  for (auto op : {loom::UnaryOp::Neg, loom::UnaryOp::Exp, loom::UnaryOp::Log, loom::UnaryOp::Sqrt,
                  loom::UnaryOp::Square, loom::UnaryOp::Abs}) {
    std::vector<float> ref(660);
    cpu::unary(ref.data(), hp.data(), op, 660, nullptr);
    out.poison();
    cu::unary(out.p, pos.p, op, 660, S());
    CHECK_CLOSE(out.get(), ref, t, "unary");
  }
  {
    std::vector<float> ref(660);
    cpu::axpby(ref.data(), ha.data(), 0.7, hp.data(), -1.3, 660, nullptr);
    out.poison();
    cu::axpby(out.p, a.p, 0.7, pos.p, -1.3, 660, S());
    CHECK_CLOSE(out.get(), ref, t, "axpby");
    cpu::axpby(ref.data(), ha.data(), 2.5, (const float*)nullptr, 0.0, 660, nullptr);
    out.poison();
    cu::axpby(out.p, a.p, 2.5, (const T*)nullptr, 0.0, 660, S());
    CHECK_CLOSE(out.get(), ref, t, "axpby b=null");
  }
  {
    std::vector<float> y = hp, alpha = {-0.37f};
    cpu::axpy_dev(y.data(), alpha.data(), ha.data(), 660, nullptr);
    DBuf<T> dy(hp);
    DBuf<float> dal(alpha);
    cu::axpy_dev(dy.p, dal.p, a.p, 660, S());
    CHECK_CLOSE(dy.get(), y, t, "axpy_dev");
  }
  // reduce_sum_to: [4, 33, 5] -> [1, 33, 1], -> [4, 1, 5], -> [1,1,1]; a strided input too
  for (int pattern = 0; pattern < 4; pattern++) {
    Layout ob = make_layout({4, 33, 5}), il = make_layout({4, 33, 5});
    int64_t nout = 1;
    std::vector<int64_t> os;
    if (pattern == 0) os = {0, 1, 0};
    if (pattern == 1) os = {5, 0, 1};
    if (pattern == 2) os = {0, 0, 0};
    if (pattern == 3) { os = {0, 1, 0}; il = make_layout({4, 33, 5}, {1, 20, 4}); }
    for (int d = 0; d < 3; d++) {
      ob.stride[d] = os[d];
      if (os[d]) nout *= ob.shape[d];
    }
    std::vector<float> ref(nout);
    cpu::reduce_sum_to(ref.data(), ob, ha.data(), il, nullptr);
    DBuf<T> o(nout);
    cu::reduce_sum_to(o.p, ob, a.p, il, S());
    CHECK_CLOSE(o.get(), ref, t, "reduce_sum_to");
  }
  {  // long reduction to few outputs: the block-per-output path
    auto hl = rounded<T>(rnd(3 * 5000, 8));
    DBuf<T> l(hl);
    Layout il = make_layout({3, 5000}), ob = make_layout({3, 5000}, {1, 0});
    std::vector<float> ref(3);
    cpu::reduce_sum_to(ref.data(), ob, hl.data(), il, nullptr);
    DBuf<T> o(3);
    cu::reduce_sum_to(o.p, ob, l.p, il, S());
    CHECK_CLOSE(o.get(), ref, t, "reduce_sum_to long");
  }
  for (int64_t n : {1, 1000, 300001}) {
    auto hs = rounded<T>(rnd(n, 9 + n));
    DBuf<T> in(hs);
    float ref = 0;
    cpu::sum_all(&ref, hs.data(), n, nullptr);
    DBuf<float> o(1);
    cu::sum_all(o.p, in.p, n, S());
    // the sum is in f32 for both types (same rounded inputs): a long-sum row, not bf16's
    CHECK_CLOSE(o.get(), std::vector<float>{ref}, tol::kCudaSumF32, "sum_all");
  }
}

// ------------------------------------------------------------------------------ matmul
TEMPLATE_TEST_CASE("matmul: gemm over shapes, transposes, batches, beta", "[matmul]", float, bf16) {
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

TEMPLATE_TEST_CASE("matmul: linear forward and backward", "[matmul]", float, bf16) {
  need_gpu();
  using T = TestType;
  struct Case { int64_t N; int I, O; };
  for (Case c : {Case{1, 8, 3}, Case{37, 48, 40}, Case{300, 64, 200}, Case{1000, 33, 17}}) {
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

TEMPLATE_TEST_CASE("matmul: linear + GELU in the GEMM epilogue, forward and backward", "[matmul]", float, bf16) {
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

// ------------------------------------------------------------------------------ norms
TEMPLATE_TEST_CASE("norms: layernorm / rmsnorm (+residual) forward and backward", "[norms]", float, bf16) {
  need_gpu();
  using T = TestType;
  const auto t = tol_of<T>();
  struct Case { int64_t N; int C; };
  // C covers: tiny, < 32, warp paths, not a multiple of the vector (scalar), 128-thread and
  // 1024-thread groups, and the generic block-per-row kernel (5001 scalar, 40000 bf16 vectors)
  for (Case c : {Case{1, 1}, Case{7, 31}, Case{33, 64}, Case{5, 200}, Case{65, 576}, Case{9, 768}, Case{4, 1030},
                 Case{3, 3000}, Case{2, 5001}, Case{2, 20000}, Case{1, 40000}}) {
    INFO("N " << c.N << " C " << c.C);
    const int64_t n = c.N * c.C;
    auto hx = rounded<T>(rnd(n, 50, -2.f, 3.f)), hr = rounded<T>(rnd(n, 51));
    auto hw = rounded<T>(rnd(c.C, 52, 0.5f, 1.5f)), hb = rounded<T>(rnd(c.C, 53));
    auto hd = rounded<T>(rnd(n, 54));
    DBuf<T> x(hx), r(hr), w(hw), b(hb), dout(hd);
    for (bool rms : {false, true}) {
      for (bool resid : {false, true}) {
        INFO((rms ? "rmsnorm" : "layernorm") << (resid ? " residual" : ""));
        std::vector<float> rout(n), rres(n), rmean(c.N), rrstd(c.N);
        DBuf<T> out(n), ro(n);
        DBuf<float> mean(c.N), rstd(c.N);
        if (!resid) {
          if (rms) cpu::rmsnorm_forward(rout.data(), rrstd.data(), hx.data(), hw.data(), c.N, c.C, 1e-5, nullptr);
          else cpu::layernorm_forward(rout.data(), rmean.data(), rrstd.data(), hx.data(), hw.data(), hb.data(), c.N, c.C, 1e-6, nullptr);
          if (rms) cu::rmsnorm_forward(out.p, rstd.p, x.p, w.p, c.N, c.C, 1e-5, S());
          else cu::layernorm_forward(out.p, mean.p, rstd.p, x.p, w.p, b.p, c.N, c.C, 1e-6, S());
        } else {
          // the reference normalizes resid + x rounded to T, as the kernel does
          std::vector<float> sum(n);
          for (int64_t i = 0; i < n; i++) sum[i] = hr[i] + hx[i];
          sum = rounded<T>(sum);
          if (rms) cpu::rmsnorm_forward(rout.data(), rrstd.data(), sum.data(), hw.data(), c.N, c.C, 1e-5, nullptr);
          else cpu::layernorm_forward(rout.data(), rmean.data(), rrstd.data(), sum.data(), hw.data(), hb.data(), c.N, c.C, 1e-6, nullptr);
          if (rms) cu::residual_rmsnorm_forward(ro.p, out.p, rstd.p, r.p, x.p, w.p, c.N, c.C, 1e-5, S());
          else cu::residual_layernorm_forward(ro.p, out.p, mean.p, rstd.p, r.p, x.p, w.p, b.p, c.N, c.C, 1e-6, S());
          CHECK_CLOSE(ro.get(), sum, t, "resid_out");
        }
        CHECK_CLOSE(out.get(), rout, t, "out");
        CHECK_CLOSE(rstd.get(), rrstd, t, "rstd");
        if (!rms) CHECK_CLOSE(mean.get(), rmean, t, "mean");
        if (resid) continue;
        // backward from the reference's statistics (the same for both)
        DBuf<float> smean(rmean), srstd(rrstd);
        auto hdw = rounded<T>(rnd(c.C, 55)), hdb = rounded<T>(rnd(c.C, 56));
        std::vector<float> rdx(n), rdw = hdw, rdb = hdb;
        DBuf<T> dx(n), dw(hdw), db(hdb);
        if (rms) {
          cpu::rmsnorm_backward(rdx.data(), rdw.data(), hd.data(), hx.data(), hw.data(), rrstd.data(), c.N, c.C, nullptr);
          cu::rmsnorm_backward(dx.p, dw.p, dout.p, x.p, w.p, srstd.p, c.N, c.C, S());
        } else {
          cpu::layernorm_backward(rdx.data(), rdw.data(), rdb.data(), hd.data(), hx.data(), hw.data(), rmean.data(),
                                  rrstd.data(), c.N, c.C, nullptr);
          cu::layernorm_backward(dx.p, dw.p, db.p, dout.p, x.p, w.p, smean.p, srstd.p, c.N, c.C, S());
          CHECK_CLOSE(db.get(), rdb, t, "dbias (+=)");
        }
        CHECK_CLOSE(dx.get(), rdx, t, "dinp");
        CHECK_CLOSE(dw.get(), rdw, t, "dweight (+=)");
      }
    }
  }
}

TEST_CASE("norms: backward is deterministic at a large shape", "[norms]") {
  need_gpu();
  const int64_t N = 4099;
  const int C = 768;
  auto hx = rounded<bf16>(rnd(N * C, 57)), hd = rounded<bf16>(rnd(N * C, 58)), hw = rounded<bf16>(rnd(C, 59));
  std::vector<float> rm(N), rr(N), ro(N * C);
  cpu::layernorm_forward(ro.data(), rm.data(), rr.data(), hx.data(), hw.data(), hw.data(), N, C, 1e-6, nullptr);
  DBuf<bf16> x(hx), d(hd), w(hw), dx(N * C);
  DBuf<float> m(rm), r(rr);
  std::vector<float> first;
  for (int rep = 0; rep < 3; rep++) {
    DBuf<bf16> dw(std::vector<float>(C, 0.f)), db(std::vector<float>(C, 0.f));
    cu::layernorm_backward(dx.p, dw.p, db.p, d.p, x.p, w.p, m.p, r.p, N, C, S());
    auto g = dw.get();
    auto gb = db.get();
    g.insert(g.end(), gb.begin(), gb.end());
    if (rep == 0) first = g;
    else CHECK(g == first);
  }
}

// ------------------------------------------------------------------------------ activations
TEMPLATE_TEST_CASE("activations: gelu, silu, swiglu forward and backward", "[activations]", float, bf16) {
  need_gpu();
  using T = TestType;
  const auto t = tol_of<T>();
  for (int64_t n : {1, 7, 1000, 4099}) {
    for (int off : {0, 1}) {  // off = 1: misaligned pointers take the scalar path
      INFO("n " << n << " offset " << off);
      auto hx = rounded<T>(rnd(n + off, 60, -4.f, 4.f)), hu = rounded<T>(rnd(n + off, 61));
      auto hd = rounded<T>(rnd(n + off, 62));
      DBuf<T> x(hx), u(hu), d(hd), o(n + off), o2(n + off);
      const float* X = hx.data() + off;
      const float* U = hu.data() + off;
      const float* D = hd.data() + off;
      auto tail = [&](const DBuf<T>& b) { auto v = b.get(); return std::vector<float>(v.begin() + off, v.end()); };
      std::vector<float> r(n), r2(n);
      cpu::gelu_forward(r.data(), X, n, nullptr);
      cu::gelu_forward(o.p + off, x.p + off, n, S());
      CHECK_CLOSE(tail(o), r, t, "gelu");
      cpu::gelu_backward(r.data(), D, X, n, nullptr);
      cu::gelu_backward(o.p + off, d.p + off, x.p + off, n, S());
      CHECK_CLOSE(tail(o), r, t, "gelu_backward");
      cpu::silu_forward(r.data(), X, n, nullptr);
      cu::silu_forward(o.p + off, x.p + off, n, S());
      CHECK_CLOSE(tail(o), r, t, "silu");
      cpu::silu_backward(r.data(), D, X, n, nullptr);
      cu::silu_backward(o.p + off, d.p + off, x.p + off, n, S());
      CHECK_CLOSE(tail(o), r, t, "silu_backward");
      cpu::swiglu_forward(r.data(), X, U, n, nullptr);
      cu::swiglu_forward(o.p + off, x.p + off, u.p + off, n, S());
      CHECK_CLOSE(tail(o), r, t, "swiglu");
      o.poison();
      cpu::swiglu_backward(r.data(), r2.data(), D, X, U, n, nullptr);
      cu::swiglu_backward(o.p + off, o2.p + off, d.p + off, x.p + off, u.p + off, n, S());
      CHECK_CLOSE(tail(o), r, t, "swiglu dgate");
      CHECK_CLOSE(tail(o2), r2, t, "swiglu dup");
    }
  }
}

TEMPLATE_TEST_CASE("activations: softmax forward and backward", "[activations]", float, bf16) {
  need_gpu();
  using T = TestType;
  const auto t = tol_of<T>();
  struct Case { int64_t N; int C; };
  for (Case c : {Case{1, 1}, Case{5, 17}, Case{9, 1024}, Case{3, 1500}, Case{2, 9000}}) {
    INFO("N " << c.N << " C " << c.C);
    int64_t n = c.N * c.C;
    auto hx = rounded<T>(rnd(n, 63, -6.f, 6.f)), hd = rounded<T>(rnd(n, 64));
    std::vector<float> ry(n), rdx(n);
    cpu::softmax_forward(ry.data(), hx.data(), c.N, c.C, nullptr);
    DBuf<T> x(hx), d(hd), y(n), dx(n);
    cu::softmax_forward(y.p, x.p, c.N, c.C, S());
    CHECK_CLOSE(y.get(), ry, t, "softmax");
    auto hy = rounded<T>(ry);
    DBuf<T> yin(hy);
    cpu::softmax_backward(rdx.data(), hd.data(), hy.data(), c.N, c.C, nullptr);
    cu::softmax_backward(dx.p, d.p, yin.p, c.N, c.C, S());
    CHECK_CLOSE(dx.get(), rdx, t, "softmax_backward");
  }
}

// ------------------------------------------------------------------------------ indexing
TEMPLATE_TEST_CASE("indexing: embedding forward and deterministic backward", "[indexing]", float, bf16) {
  need_gpu();
  using T = TestType;
  const auto t = tol_of<T>();
  struct Case { int64_t N; int C, V; };
  for (Case c : {Case{1, 1, 1}, Case{37, 33, 11}, Case{500, 64, 7}, Case{2049, 130, 1000}, Case{4099, 70, 300}}) {
    INFO("N " << c.N << " C " << c.C << " V " << c.V);
    auto ids = rnd_int(c.N, 70, 0, c.V);
    if (c.N == 4099) {  // long runs (the image placeholder of a VLM batch): 1500, 200, 65 and 64 repeats
      int at = 0;
      for (auto [id, count] : {std::pair{5, 1500}, std::pair{17, 200}, std::pair{3, 65}, std::pair{9, 64}})
        for (int k = 0; k < count; k++) ids[size_t(at++)] = id;
      std::shuffle(ids.begin(), ids.end(), std::mt19937(71));
    }
    auto ht = rounded<T>(rnd(int64_t(c.V) * c.C, 71)), hd = rounded<T>(rnd(c.N * c.C, 72));
    IBuf di(ids);
    DBuf<T> table(ht), out(c.N * c.C), dout(hd);
    std::vector<float> r(c.N * c.C);
    cpu::embedding_forward(r.data(), ids.data(), ht.data(), c.N, c.C, c.V, nullptr);
    cu::embedding_forward(out.p, di.p, table.p, c.N, c.C, c.V, S());
    CHECK_CLOSE(out.get(), r, t, "embedding_forward");
    std::vector<float> rdt = ht;  // += into a non-zero table
    cpu::embedding_backward(rdt.data(), hd.data(), ids.data(), c.N, c.C, c.V, nullptr);
    std::vector<float> first;
    for (int rep = 0; rep < 2; rep++) {
      DBuf<T> dt(ht);
      cu::embedding_backward(dt.p, dout.p, di.p, c.N, c.C, c.V, S());
      auto g = dt.get();
      CHECK_CLOSE(g, rdt, t, "embedding_backward");
      if (rep == 0) first = g;
      else CHECK(g == first);
    }
  }
}

TEMPLATE_TEST_CASE("indexing: gather, scatter, zero rows; patchify; pixel shuffle; mean pool", "[indexing]", float, bf16) {
  need_gpu();
  using T = TestType;
  const auto t = tol_of<T>();
  {
    const int B = 3, N = 13, K = 5, C = 7;
    std::vector<int32_t> idx;
    for (int b = 0; b < B; b++) {  // distinct indices per b
      auto perm = rnd_int(N, 80 + b, 0, 1000);
      std::vector<int32_t> order(N);
      for (int i = 0; i < N; i++) order[i] = i;
      std::sort(order.begin(), order.end(), [&](int a, int c) { return perm[a] < perm[c] || (perm[a] == perm[c] && a < c); });
      idx.insert(idx.end(), order.begin(), order.begin() + K);
    }
    auto hin = rounded<T>(rnd(B * N * C, 81)), hsrc = rounded<T>(rnd(B * K * C, 82));
    IBuf di(idx);
    DBuf<T> in(hin), src(hsrc), out(B * K * C);
    std::vector<float> r(B * K * C);
    cpu::gather_rows(r.data(), hin.data(), idx.data(), B, N, K, C, nullptr);
    cu::gather_rows(out.p, in.p, di.p, B, N, K, C, S());
    CHECK_CLOSE(out.get(), r, t, "gather_rows");
    for (bool acc : {false, true}) {
      std::vector<float> rs = hin;
      cpu::scatter_rows(rs.data(), idx.data(), hsrc.data(), B, N, K, C, acc, nullptr);
      DBuf<T> o(hin);
      cu::scatter_rows(o.p, di.p, src.p, B, N, K, C, acc, S());
      CHECK_CLOSE(o.get(), rs, t, acc ? "scatter_rows +=" : "scatter_rows =");
    }
    {  // repeated indices accumulate
      auto rep = rnd_int(B * K, 83, 0, 3);
      IBuf dr(rep);
      std::vector<float> rs = hin;
      cpu::scatter_rows(rs.data(), rep.data(), hsrc.data(), B, N, K, C, true, nullptr);
      DBuf<T> o(hin);
      cu::scatter_rows(o.p, dr.p, src.p, B, N, K, C, true, S());
      CHECK_CLOSE(o.get(), rs, t, "scatter_rows += repeated");
    }
    std::vector<float> rz = hin;
    cpu::zero_rows(rz.data(), idx.data(), B, N, K, C, nullptr);
    DBuf<T> z(hin);
    cu::zero_rows(z.p, di.p, B, N, K, C, S());
    CHECK_CLOSE(z.get(), rz, t, "zero_rows");
  }
  {
    const int B = 2, Ch = 3, H = 8, W = 12, p = 4;
    const int64_t n = int64_t(B) * Ch * H * W;
    auto himg = rounded<T>(rnd(n, 84));
    DBuf<T> img(himg), out(n), back(n);
    std::vector<float> r(n), rb(n);
    cpu::patchify(r.data(), himg.data(), B, Ch, H, W, p, nullptr);
    cu::patchify(out.p, img.p, B, Ch, H, W, p, S());
    CHECK_CLOSE(out.get(), r, t, "patchify");
    cpu::patchify_backward(rb.data(), r.data(), B, Ch, H, W, p, nullptr);
    cu::patchify_backward(back.p, out.p, B, Ch, H, W, p, S());
    CHECK_CLOSE(back.get(), rb, t, "patchify_backward");
    CHECK(back.get() == himg);
    REQUIRE_THROWS(cu::patchify(out.p, img.p, B, Ch, H, W, 5, S()));
  }
  for (int s : {2, 3}) {
    const int B = 2, G = 6, D = 5;
    const int64_t n = int64_t(B) * G * G * D;
    auto h = rounded<T>(rnd(n, 85));
    DBuf<T> in(h), out(n), back(n);
    std::vector<float> r(n), rb(n);
    cpu::pixel_shuffle(r.data(), h.data(), B, G, D, s, nullptr);
    cu::pixel_shuffle(out.p, in.p, B, G, D, s, S());
    CHECK_CLOSE(out.get(), r, t, "pixel_shuffle");
    cpu::pixel_shuffle_backward(rb.data(), r.data(), B, G, D, s, nullptr);
    cu::pixel_shuffle_backward(back.p, out.p, B, G, D, s, S());
    CHECK_CLOSE(back.get(), rb, t, "pixel_shuffle_backward");
  }
  {
    const int B = 3, K = 11, C = 37;
    auto h = rounded<T>(rnd(B * K * C, 86)), hd = rounded<T>(rnd(B * C, 87));
    DBuf<T> in(h), out(B * C), d(hd), dx(B * K * C);
    std::vector<float> r(B * C), rdx(B * K * C);
    cpu::mean_pool_forward(r.data(), h.data(), B, K, C, nullptr);
    cu::mean_pool_forward(out.p, in.p, B, K, C, S());
    CHECK_CLOSE(out.get(), r, t, "mean_pool_forward");
    cpu::mean_pool_backward(rdx.data(), hd.data(), B, K, C, nullptr);
    cu::mean_pool_backward(dx.p, d.p, B, K, C, S());
    CHECK_CLOSE(dx.get(), rdx, t, "mean_pool_backward");
  }
}

TEMPLATE_TEST_CASE("indexing: l2norm forward/backward, argmax", "[indexing]", float, bf16) {
  need_gpu();
  using T = TestType;
  const auto t = tol_of<T>();
  struct Case { int64_t N; int C; };
  for (Case c : {Case{1, 1}, Case{6, 31}, Case{17, 384}}) {
    INFO("N " << c.N << " C " << c.C);
    int64_t n = c.N * c.C;
    auto hx = rounded<T>(rnd(n, 88)), hd = rounded<T>(rnd(n, 89));
    // row 0 tiny: its norm is clamped to eps
    for (int i = 0; i < c.C; i++) hx[i] = to_f(to_t<T>(hx[i] * 1e-9f));
    DBuf<T> x(hx), d(hd), y(n), dx(n);
    DBuf<float> rn(c.N);
    std::vector<float> ry(n), rr(c.N), rdx(n);
    cpu::l2norm_forward(ry.data(), rr.data(), hx.data(), c.N, c.C, 1e-6, nullptr);
    cu::l2norm_forward(y.p, rn.p, x.p, c.N, c.C, 1e-6, S());
    CHECK_CLOSE(y.get(), ry, t, "l2norm_forward");
    CHECK_CLOSE(rn.get(), rr, t, "rnorm");
    DBuf<float> srn(rr);
    cpu::l2norm_backward(rdx.data(), hd.data(), hx.data(), rr.data(), c.N, c.C, nullptr);
    cu::l2norm_backward(dx.p, d.p, x.p, srn.p, c.N, c.C, S());
    CHECK_CLOSE(dx.get(), rdx, t, "l2norm_backward");
  }
  for (int C : {1, 5, 100, 3000}) {
    const int64_t N = 9;
    // few distinct values so that ties happen: the first index must win
    auto v = rnd_int(N * C, 90 + C, 0, 7);
    std::vector<float> h(v.begin(), v.end());
    DBuf<T> x(h);
    DBuf<int32_t> out(N);
    std::vector<int32_t> r(N);
    cpu::argmax_rows(r.data(), h.data(), N, C, nullptr);
    cu::argmax_rows(reinterpret_cast<int32_t*>(out.p), x.p, N, C, S());
    auto g = out.get();
    for (int64_t i = 0; i < N; i++) CHECK(int(g[i]) == r[i]);
  }
}

// ------------------------------------------------------------------------------ rope
TEMPLATE_TEST_CASE("rope: forward and backward against the f64 reference", "[rope]", float, bf16) {
  need_gpu();
  using T = TestType;
  // The CUDA kernel forms the angle in double; the CPU f32 path rounds it in float like the
  // PyTorch reference (~pos * 2^-24 rad), so the f64 CPU path is the reference here.
  const auto t = tol_of<T>();
  struct Case { int64_t N; int H, hd; };
  for (Case c : {Case{1, 1, 2}, Case{13, 3, 8}, Case{29, 9, 64}, Case{5, 2, 130}}) {
    INFO("N " << c.N << " H " << c.H << " hd " << c.hd);
    int64_t n = c.N * c.H * c.hd;
    auto pos = rnd_int(c.N, 100, 0, 4096);
    auto hx = rounded<T>(rnd(n, 101)), hd = rounded<T>(rnd(n, 102));
    std::vector<double> x64(hx.begin(), hx.end()), d64(hd.begin(), hd.end()), r(n), rb(n);
    cpu::rope_forward(r.data(), x64.data(), pos.data(), c.N, c.H, c.hd, 100000.0, nullptr);
    cpu::rope_backward(rb.data(), d64.data(), pos.data(), c.N, c.H, c.hd, 100000.0, nullptr);
    IBuf dp(pos);
    DBuf<T> x(hx), d(hd), o(n), dx(n);
    cu::rope_forward(o.p, x.p, dp.p, c.N, c.H, c.hd, 100000.0, S());
    cu::rope_backward(dx.p, d.p, dp.p, c.N, c.H, c.hd, 100000.0, S());
    CHECK_CLOSE(o.get(), r, t, "rope_forward");
    CHECK_CLOSE(dx.get(), rb, t, "rope_backward");
  }
}

// ------------------------------------------------------------------------------ optim
TEMPLATE_TEST_CASE("optim: adamw, sgd, ema with f32 and bf16 gradients/copies", "[optim]", float, bf16) {
  need_gpu();
  using G = TestType;
  for (int64_t n : {1, 1001, 4096}) {
    for (bool scaled : {false, true}) {
      INFO("n " << n << " step control " << scaled);
      auto hp = rnd(n, 110), hm = rnd(n, 111, -0.1f, 0.1f), hv = rnd(n, 112, 0.f, 0.01f);
      auto hg = rounded<G>(rnd(n, 113));
      // step control: gradient scale, applied, t = 3, lr x 0.5 (h.lr is then the group factor)
      std::vector<float> scale = {0.37f, 1.f, 3.f, 0.5f};
      DBuf<float> p(hp), m(hm), v(hv), sc(scale);
      DBuf<G> g(hg), copy(n);
      loom::AdamWHyper h;
      h.lr = 1e-2f; h.beta1 = 0.9f; h.beta2 = 0.95f; h.eps = 1e-8f; h.weight_decay = 0.1f; h.step = 3;
      std::vector<float> rp = hp, rm = hm, rv = hv, rc(n);
      cpu::adamw_update(rp.data(), rc.data(), rm.data(), rv.data(), hg.data(), scaled ? scale.data() : nullptr, n, h, nullptr);
      cu::adamw_update(p.p, copy.p, m.p, v.p, g.p, scaled ? sc.p : nullptr, n, h, S());
      CHECK_CLOSE(p.get(), rp, tol::kCudaF32, "adamw master");
      CHECK_CLOSE(m.get(), rm, tol::kCudaF32, "adamw m");
      CHECK_CLOSE(v.get(), rv, tol::kCudaF32, "adamw v");
      CHECK_CLOSE(copy.get(), rc, tol_of<G>(), "adamw copy");

      DBuf<float> p2(hp), buf(hm);
      std::vector<float> rp2 = hp, rbuf = hm;
      cpu::sgd_update(rp2.data(), rc.data(), rbuf.data(), hg.data(), scaled ? scale.data() : nullptr, n, 0.05f, 0.9f, 0.01f, nullptr);
      copy.poison();
      cu::sgd_update(p2.p, copy.p, buf.p, g.p, scaled ? sc.p : nullptr, n, 0.05f, 0.9f, 0.01f, S());
      CHECK_CLOSE(p2.get(), rp2, tol::kCudaF32, "sgd master");
      CHECK_CLOSE(buf.get(), rbuf, tol::kCudaF32, "sgd buf");
      CHECK_CLOSE(copy.get(), rc, tol_of<G>(), "sgd copy");

      DBuf<float> tgt(hm), src(hp);
      std::vector<float> rt = hm;
      cpu::ema_update(rt.data(), rc.data(), hp.data(), scaled ? scale.data() : nullptr, n, 0.996, nullptr);
      copy.poison();
      cu::ema_update(tgt.p, copy.p, src.p, scaled ? sc.p : nullptr, n, 0.996, S());
      CHECK_CLOSE(tgt.get(), rt, tol::kCudaF32, "ema target");
      CHECK_CLOSE(copy.get(), rc, tol_of<G>(), "ema copy");

      // a skipped step (ctl[1] == 0) writes nothing, in every update
      DBuf<float> skip(std::vector<float>{1.f, 0.f, 3.f, 1.f});
      auto p_before = p.get(), p2_before = p2.get(), t_before = tgt.get();
      cu::adamw_update(p.p, copy.p, m.p, v.p, g.p, skip.p, n, h, S());
      cu::sgd_update(p2.p, copy.p, buf.p, g.p, skip.p, n, 0.05f, 0.9f, 0.01f, S());
      cu::ema_update(tgt.p, copy.p, src.p, skip.p, n, 0.996, S());
      CHECK(p.get() == p_before);
      CHECK(p2.get() == p2_before);
      CHECK(tgt.get() == t_before);
    }
  }
}

TEMPLATE_TEST_CASE("optim: grad norm (+=, deterministic) and step control", "[optim]", float, bf16) {
  need_gpu();
  using G = TestType;
  for (int64_t n : {1, 777, 1000003}) {
    auto hg = rounded<G>(rnd(n, 120 + n));
    DBuf<G> g(hg);
    double ref = 1.5;  // out starts at 1.5: the kernel adds
    for (float x : hg) ref += double(x) * x;
    std::vector<float> first;
    for (int rep = 0; rep < 2; rep++) {
      DBuf<float> out(std::vector<float>{1.5f});
      cu::grad_norm_squared(out.p, g.p, n, S());
      auto o = out.get();
      CHECK_CLOSE(o, std::vector<double>{ref}, tol::kCudaF32, "grad_norm_squared");
      if (rep == 0) first = o;
      else CHECK(o == first);
    }
  }
  for (float nsq : {0.25f, 4.f, 1e6f, NAN}) {
    for (float loss : {1.5f, INFINITY}) {
      DBuf<float> ctl(std::vector<float>{0.f, 0.f, 5.f, 0.1f}), norm(1), ns(std::vector<float>{nsq}),
          dl(std::vector<float>{loss});
      cu::step_control(ctl.p, norm.p, ns.p, dl.p, 1.0f, S());
      float rc[4] = {0.f, 0.f, 5.f, 0.1f}, rn = 0;
      cpu::step_control(rc, &rn, &nsq, &loss, 1.0f, nullptr);
      auto c = ctl.get();
      INFO("norm_sq " << nsq << " loss " << loss);
      CHECK(c[1] == rc[1]);
      CHECK(c[2] == rc[2]);
      CHECK(c[3] == rc[3]);
      if (std::isfinite(nsq)) {
        CHECK_CLOSE(std::vector<float>{c[0]}, std::vector<float>{rc[0]}, tol::kCudaF32, "clip scale");
        CHECK_CLOSE(norm.get(), std::vector<float>{rn}, tol::kCudaF32, "norm");
      }
    }
  }
}
