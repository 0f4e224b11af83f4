// test_cuda_memory.cpp: kernels/cuda/memory.cu (fill, copy_strided, convert, binary, unary, axpby,
// reductions) against the loom::cpu reference, f32, bf16 and f16 (tests/cuda/cuda_kernel_test_util.h).
// Skipped without a GPU.
//   bash tools/gpu-kernels.sh tests/cuda/test_cuda_memory.cpp
#include <cmath>
#include <catch2/catch.hpp>

#include "kernels/kernels.h"
#include "tests/tolerances.h"

#include "tests/cuda/cuda_kernel_test_util.h"

TEMPLATE_TEST_CASE("memory: fill, copy_strided, convert", "[memory]", float, bf16, f16, int32_t, int64_t) {
  need_gpu();
  using T = TestType;
  DBuf<T> out(1001);
  cu::fill(out.p, 3.0, 1001, S());
  CHECK(out.get() == std::vector<float>(1001, 3.f));
  DBuf<T> out16(1024);  // 16-byte stores (1024 elements of any width fill whole words)
  cu::fill(out16.p, -5.0, 1024, S());
  CHECK(out16.get() == std::vector<float>(1024, -5.f));
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
  // a table broadcast over leading dims ([3, 5, 16] from [16], and [4, 6, 8] from [6, 8]): the
  // 16-byte path where the period's bytes allow it, the per-dim one otherwise
  for (auto [shape, stride] : {std::pair{std::vector<int64_t>{3, 5, 16}, std::vector<int64_t>{0, 0, 1}},
                               std::pair{std::vector<int64_t>{4, 6, 8}, std::vector<int64_t>{0, 8, 1}},
                               std::pair{std::vector<int64_t>{4, 3, 5}, std::vector<int64_t>{0, 5, 1}}}) {
    Layout lb = make_layout(shape, stride);
    const int64_t n = lb.numel();
    DBuf<T> bd(n);
    cu::copy_strided(bd.p, in.p, lb, S());
    std::vector<float> rb(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; i++) {
      int64_t off = 0, r = i;
      for (int d = 2; d >= 0; d--) { off += (r % shape[d]) * stride[d]; r /= shape[d]; }
      rb[size_t(i)] = hf[size_t(off)];
    }
    CHECK(bd.get() == rb);
  }
  // convert to every other type and back
  DBuf<float> f(105);
  cu::convert(f.p, in.p, 105, S());
  CHECK(f.get() == hf);
  DBuf<bf16> b16(105);
  cu::convert(b16.p, in.p, 105, S());
  CHECK(b16.get() == hf);  // small integers are exact in bf16
  DBuf<f16> h16(105);
  cu::convert(h16.p, in.p, 105, S());
  CHECK(h16.get() == hf);  // and in f16
  DBuf<int32_t> i32(105);
  cu::convert(i32.p, in.p, 105, S());
  CHECK(i32.get() == hf);
  DBuf<int64_t> i64(105);
  cu::convert(i64.p, in.p, 105, S());
  CHECK(i64.get() == hf);
}

TEST_CASE("memory: convert float<->double and float->bf16 / f16 rounding", "[memory]") {
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
  // f16: the same, over its whole range: subnormals, the largest finite value, overflow to inf
  std::vector<float> hh = rnd(777, 4, -70000, 70000);
  hh[0] = 6.0e-8f, hh[1] = -3.0e-6f, hh[2] = 65504.f, hh[3] = 65520.f, hh[4] = 1e-9f, hh[5] = 0.1f;
  DBuf<float> fh(hh);
  DBuf<f16> hb(777);
  cu::convert(hb.p, fh.p, 777, S());
  CHECK(hb.get() == rounded<f16>(hh));
  CHECK(std::isinf(hb.get()[3]));  // 65520 rounds up past 65504
}

TEMPLATE_TEST_CASE("memory: binary, unary, axpby, axpy_dev, reduce_sum_to, sum_all", "[memory]", float, bf16, f16) {
  need_gpu();
  using T = TestType;
  const auto t = tol_of<T>();
  // every op on one pair of operands against the CPU reference, output poisoned
  auto check_binary = [&](const std::vector<float>& ha, const DBuf<T>& a, Layout la, const std::vector<float>& hb,
                          const DBuf<T>& b, Layout lb, const char* what) {
    const int64_t n = la.numel();
    DBuf<T> out(n);
    for (auto op : {loom::BinaryOp::Add, loom::BinaryOp::Sub, loom::BinaryOp::Mul, loom::BinaryOp::Div}) {
      std::vector<float> ref(static_cast<size_t>(n));
      cpu::binary(ref.data(), ha.data(), la, hb.data(), lb, op, nullptr);
      out.poison();
      cu::binary(out.p, a.p, la, b.p, lb, op, S());
      CHECK_CLOSE(out.get(), ref, t, what);
    }
  };
  // broadcast inside: a [4, 33, 5] + b [33, 1] (the per-dim index path)
  Layout la = make_layout({4, 33, 5});
  Layout lb = make_layout({4, 33, 5}, {0, 1, 0});
  auto ha = rounded<T>(rnd(660, 4)), hb = rounded<T>(rnd(33, 5, 0.5f, 2.f)), hc = rounded<T>(rnd(660, 6));
  DBuf<T> a(ha), b(hb), c(hc), out(660);
  check_binary(ha, a, la, hb, b, lb, "binary broadcast");
  check_binary(ha, a, la, hc, c, la, "binary contiguous");  // n 660: 16-byte path for f32 only
  // the periodic path (16-byte accesses, one modulo each): a table broadcast over the leading
  // dims on either side ([6, 7, 16] op [7, 16], as a position table added to every image),
  // and both contiguous with n a multiple of 8
  Layout lf = make_layout({6, 7, 16});
  Layout lt = make_layout({6, 7, 16}, {0, 16, 1});
  auto hf = rounded<T>(rnd(672, 8)), ht = rounded<T>(rnd(112, 9, 0.5f, 2.f));
  DBuf<T> f(hf), tb(ht);
  check_binary(hf, f, lf, ht, tb, lt, "binary periodic b");
  check_binary(ht, tb, lt, hf, f, lf, "binary periodic a");
  check_binary(hf, f, lf, hf, f, lf, "binary contiguous, 16-byte accesses");
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
    // 16-byte path (n a multiple of 8, aligned), in place (out = a) as the gradient sums use it,
    // and the scalar path for an operand one element off its alignment
    auto hx = rounded<T>(rnd(672, 10)), hy = rounded<T>(rnd(673, 11));
    std::vector<float> r672(672), r671(671);
    cpu::axpby(r672.data(), hx.data(), 1.0, hy.data(), 1.0, 672, nullptr);
    cpu::axpby(r671.data(), hx.data(), 0.5, hy.data() + 1, 2.0, 671, nullptr);
    DBuf<T> x(hx), y(hy), o(672);
    cu::axpby(x.p, x.p, 1.0, y.p, 1.0, 672, S());
    CHECK_CLOSE(x.get(), r672, t, "axpby in place, 16-byte accesses");
    DBuf<T> x2(hx);
    o.poison();
    cu::axpby(o.p, x2.p, 0.5, y.p + 1, 2.0, 671, S());
    std::vector<float> got = o.get();
    got.resize(671);
    CHECK_CLOSE(got, r671, t, "axpby, unaligned operand");
  }
  for (int64_t n : {660, 656}) {  // 656: 16-byte accesses in every width; 660: f32 only
    std::vector<float> y = hp, alpha = {-0.37f};
    cpu::axpy_dev(y.data(), alpha.data(), ha.data(), n, true, nullptr);
    DBuf<T> dy(hp);
    DBuf<float> dal(alpha);
    cu::axpy_dev(dy.p, dal.p, a.p, n, true, S());
    INFO("n " << n);
    CHECK_CLOSE(dy.get(), y, t, "axpy_dev");
    // y = alpha x into a NaN-poisoned buffer: y must not be read
    std::vector<float> y2(hp.size(), std::nanf("")), p2 = y2;
    cpu::axpy_dev(y2.data(), alpha.data(), ha.data(), n, false, nullptr);
    DBuf<T> dy2(p2);
    cu::axpy_dev(dy2.p, dal.p, a.p, n, false, S());
    std::vector<float> got2 = dy2.get();
    got2.resize(size_t(n));
    y2.resize(size_t(n));
    CHECK_CLOSE(got2, y2, t, "axpy_dev =");
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
  // the reduced dims lead in a contiguous input: column sums ([37, 5, 48] -> [48] and -> [5, 48];
  // [300, 7] -> [7]; [2, 3000, 8] -> [8]: several row splits)
  for (auto [shape, keep] : {std::pair{std::vector<int64_t>{37, 5, 48}, 1}, std::pair{std::vector<int64_t>{37, 5, 48}, 2},
                             std::pair{std::vector<int64_t>{300, 7}, 1}, std::pair{std::vector<int64_t>{2, 3000, 8}, 1}}) {
    const int nd = int(shape.size());
    Layout il = make_layout(shape), ob = make_layout(shape);
    int64_t n = 1, nout = 1;
    for (int d = 0; d < nd; d++) {
      n *= shape[size_t(d)];
      if (d < nd - keep) ob.stride[d] = 0;
      else nout *= shape[size_t(d)];
    }
    auto hl = rounded<T>(rnd(n, 10 + n));
    DBuf<T> l(hl), o(nout);
    std::vector<float> ref(static_cast<size_t>(nout));
    cpu::reduce_sum_to(ref.data(), ob, hl.data(), il, nullptr);
    cu::reduce_sum_to(o.p, ob, l.p, il, S());
    INFO("n " << n << " -> " << nout);
    CHECK_CLOSE(o.get(), ref, t, "reduce_sum_to, leading dims");
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
