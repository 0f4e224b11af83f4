// test_tensor.cpp: the tensor core (tensor/tensor.h): view shapes and strides, contiguous()
// against a naive strided copy, dtype round trips and bf16 rounding, the seeded Rng, item(),
// and error messages that carry the shapes.
//
// Values that could hide a bug (zeros, constants) are avoided: inputs come from a seeded Rng,
// and destination buffers are poisoned with NaN before a copy writes them.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <set>
#include <vector>

#include "tensor/tensor.h"
#include "tests/tolerances.h"

using namespace loom;
using Catch::Contains;
using std::vector;

namespace {

const double kNaN = std::numeric_limits<double>::quiet_NaN();

// f64 tensor with distinct random values
Tensor random_f64(const Shape& s, uint64_t seed) {
  Rng rng(seed);
  return Tensor::randn(s, rng, 1.0, DType::F64);
}

// The element of t at a multi-index, read through t's own strides and offset from the
// storage base (the definition of a strided view, written out).
double at(const Tensor& t, const vector<int64_t>& idx) {
  const double* base = static_cast<const double*>(t.impl()->storage->data);
  int64_t off = t.offset();
  for (size_t k = 0; k < idx.size(); k++) off += idx[k] * t.strides()[k];
  return base[off];
}

// Every element of a strided tensor in row-major order, by walking multi-indices.
vector<double> naive_copy(const Tensor& t) {
  vector<double> out;
  vector<int64_t> idx(size_t(t.dim()), 0);
  for (int64_t i = 0; i < t.numel(); i++) {
    out.push_back(at(t, idx));
    for (int k = t.dim() - 1; k >= 0; k--) {
      if (++idx[size_t(k)] < t.shape()[size_t(k)]) break;
      idx[size_t(k)] = 0;
    }
  }
  return out;
}

bool shares_storage(const Tensor& a, const Tensor& b) { return a.impl()->storage == b.impl()->storage; }

float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

TEST_CASE("views: shapes, strides, offsets and shared storage", "[tensor]") {
  Tensor x = random_f64({3, 4, 5}, 1);
  REQUIRE(x.strides() == Shape{20, 5, 1});
  REQUIRE(x.is_contiguous());

  SECTION("reshape of a contiguous tensor is a view; -1 is inferred") {
    Tensor r = x.reshape({6, -1});
    CHECK(r.shape() == Shape{6, 10});
    CHECK(r.strides() == Shape{10, 1});
    CHECK(shares_storage(r, x));
    CHECK(naive_copy(r) == naive_copy(x));
  }
  SECTION("permute") {
    Tensor p = x.permute({2, 0, 1});
    CHECK(p.shape() == Shape{5, 3, 4});
    CHECK(p.strides() == Shape{1, 20, 5});
    CHECK_FALSE(p.is_contiguous());
    CHECK(shares_storage(p, x));
    CHECK(at(p, {3, 2, 1}) == at(x, {2, 1, 3}));
    // negative dims count from the end
    CHECK(x.permute({-1, 0, 1}).strides() == p.strides());
  }
  SECTION("transpose") {
    Tensor t = x.transpose(0, 2);
    CHECK(t.shape() == Shape{5, 4, 3});
    CHECK(t.strides() == Shape{1, 5, 20});
    CHECK(x.transpose(-1, -2).shape() == Shape{3, 5, 4});
    CHECK(at(t, {4, 1, 2}) == at(x, {2, 1, 4}));
  }
  SECTION("narrow moves the offset and keeps the strides") {
    Tensor n = x.narrow(1, 1, 2);
    CHECK(n.shape() == Shape{3, 2, 5});
    CHECK(n.strides() == Shape{20, 5, 1});
    CHECK(n.offset() == 5);
    CHECK_FALSE(n.is_contiguous());
    Tensor nn = n.narrow(2, 3, 2);  // a narrow of a narrow adds both offsets
    CHECK(nn.offset() == 5 + 3);
    CHECK(at(nn, {2, 1, 1}) == at(x, {2, 2, 4}));
    // narrow over the first dim of a contiguous tensor stays contiguous
    CHECK(x.narrow(0, 1, 2).is_contiguous());
  }
  SECTION("expand gives stride 0 to broadcast dims") {
    Tensor y = random_f64({3, 1, 5}, 2);
    Tensor e = y.expand({2, 3, 4, 5});
    CHECK(e.shape() == Shape{2, 3, 4, 5});
    CHECK(e.strides() == Shape{0, 5, 0, 1});
    CHECK(at(e, {1, 2, 3, 4}) == at(y, {2, 0, 4}));
  }
  SECTION("reshape of a strided view copies") {
    Tensor p = x.permute({2, 0, 1});
    Tensor r = p.reshape({5, 12});
    CHECK(r.is_contiguous());
    CHECK_FALSE(shares_storage(r, x));
    CHECK(naive_copy(r) == naive_copy(p));
  }
}

TEST_CASE("contiguous() of strided views equals a naive copy", "[tensor]") {
  Tensor x = random_f64({4, 5, 6}, 3);
  struct Case {
    const char* what;
    Tensor view;
  };
  vector<Case> cases = {
      {"permute(2,0,1)", x.permute({2, 0, 1})},
      {"transpose(0,1)", x.transpose(0, 1)},
      {"narrow(2,1,4)", x.narrow(2, 1, 4)},
      {"narrow(1,2,3).permute(2,1,0)", x.narrow(1, 2, 3).permute({2, 1, 0})},
      {"transpose(0,2).narrow(0,3,2)", x.transpose(0, 2).narrow(0, 3, 2)},
      {"expand [5,1,6] -> [2,5,7,6]", random_f64({5, 1, 6}, 4).expand({2, 5, 7, 6})},
      {"one column narrow(2,5,1)", x.narrow(2, 5, 1)},
  };
  for (auto& c : cases) {
    INFO(c.what << " shape " << shape_str(c.view.shape()) << " strides " << shape_str(c.view.strides()));
    Tensor got = c.view.contiguous();
    CHECK(got.is_contiguous());
    CHECK(got.shape() == c.view.shape());
    auto ref = naive_copy(c.view);
    auto g = got.to_vector<double>();
    CHECK(g == ref);
    // copy_ into a poisoned contiguous destination, and into a strided destination
    Tensor dst = Tensor::full(c.view.shape(), kNaN, DType::F64);
    dst.copy_(c.view);
    CHECK(dst.to_vector<double>() == ref);
  }
  SECTION("copy_ from a view of the destination's own storage reads it all before writing") {
    // an in-place transpose: the source overlaps the destination, so it must go through a
    // temporary (a strided source of another storage is copied in one pass)
    Tensor sq = random_f64({5, 5}, 6);
    auto before = naive_copy(sq.transpose(0, 1));
    sq.copy_(sq.transpose(0, 1));
    CHECK(sq.to_vector<double>() == before);
  }
  SECTION("copy_ into a strided destination writes through its strides only") {
    Tensor big = Tensor::full({6, 5}, kNaN, DType::F64);
    Tensor src = random_f64({5, 3}, 5);
    Tensor dst = big.narrow(1, 1, 3).transpose(0, 1).narrow(1, 0, 5);  // [3, 5] view, strided
    dst.copy_(src.transpose(0, 1));
    auto b = big.to_vector<double>();
    auto s = src.to_vector<double>();
    for (int r = 0; r < 6; r++)
      for (int c = 0; c < 5; c++) {
        double v = b[size_t(r * 5 + c)];
        if (r < 5 && c >= 1 && c <= 3) CHECK(v == s[size_t(r * 3 + (c - 1))]);
        else CHECK(std::isnan(v));  // untouched
      }
  }
}

TEST_CASE("to(dtype) round trips", "[tensor]") {
  Rng rng(7);
  SECTION("f32 -> f64 -> f32 is exact; f64 -> f32 rounds to nearest") {
    Tensor f = Tensor::randn({3, 17}, rng, 3.0, DType::F32);
    Tensor d = f.to(DType::F64);
    CHECK(d.dtype() == DType::F64);
    CHECK(d.to(DType::F32).to_vector<float>() == f.to_vector<float>());
    Tensor d2 = Tensor::randn({101}, rng, 1.0, DType::F64);
    auto back = d2.to(DType::F32).to_vector<float>();
    auto src = d2.to_vector<double>();
    for (size_t i = 0; i < src.size(); i++) CHECK(back[i] == float(src[i]));
  }
  SECTION("integers survive float conversions") {
    vector<int32_t> iv = {0, -1, 7, -123456, 16777216, 2147483647 / 1024};
    Tensor i = Tensor::from_vector(iv, {int64_t(iv.size())});
    CHECK(i.to(DType::F64).to(DType::I32).to_vector<int32_t>() == iv);
    CHECK(i.to(DType::F32).to(DType::I32).to_vector<int32_t>() == iv);  // all below 2^24
    CHECK(i.to(DType::I64).to(DType::I32).to_vector<int32_t>() == iv);
    vector<int64_t> lv = {-5, 0, (int64_t(1) << 40) + 3, 9007199254740993LL};
    Tensor l = Tensor::from_vector(lv, {4});
    CHECK(l.to(DType::I32).to(DType::I64).to_vector<int64_t>()[0] == -5);
    auto viad = l.to(DType::F64).to_vector<double>();
    CHECK(viad[2] == double((int64_t(1) << 40) + 3));
    // floats to integers truncate toward zero
    Tensor fl = Tensor::from_vector(vector<double>{2.7, -2.7, 0.5, -0.5}, {4});
    CHECK(fl.to(DType::I32).to_vector<int32_t>() == vector<int32_t>{2, -2, 0, 0});
  }
  SECTION("u8 widens exactly") {
    vector<uint8_t> u = {0, 1, 127, 128, 200, 255};
    Tensor t = Tensor::from_vector(u, {6});
    CHECK(t.to(DType::F32).to_vector<float>() == vector<float>{0, 1, 127, 128, 200, 255});
    CHECK(t.to(DType::I64).to_vector<int64_t>() == vector<int64_t>{0, 1, 127, 128, 200, 255});
    CHECK(t.to(DType::F64).to_vector<double>() == vector<double>{0, 1, 127, 128, 200, 255});
  }
  SECTION("bf16 values round trip through f32 and f64 exactly") {
    // random f32 values already representable in bf16 (low 16 bits cleared)
    vector<float> v(64);
    for (auto& x : v) {
      float f = float(rng.normal() * 10.0);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      x = bits_to_float(u & 0xffff0000u);
    }
    Tensor t = Tensor::from_vector(v, {8, 8});
    Tensor b = t.to(DType::BF16);
    CHECK(b.dtype() == DType::BF16);
    CHECK(b.nbytes() == 128);
    CHECK(b.to(DType::F32).to_vector<float>() == v);
    CHECK(b.to(DType::F64).to(DType::BF16).to(DType::F32).to_vector<float>() == v);
  }
  SECTION("f32 -> bf16 rounds to nearest, ties to even") {
    struct Case {
      float in, want;
      const char* why;
    };
    const float u7 = std::ldexp(1.0f, -7);  // one bf16 ulp at 1.0 (7 stored mantissa bits)
    vector<Case> cases = {
        {1.0f, 1.0f, "exact"},
        {1.0f + u7 / 2, 1.0f, "tie between 1 and 1+ulp: even (1) wins"},
        {1.0f + 3 * u7 / 2, 1.0f + 2 * u7, "tie between 1+ulp (odd) and 1+2ulp (even): up"},
        {1.0f + u7 / 2 + std::ldexp(1.0f, -20), 1.0f + u7, "just above the tie: up"},
        {1.0f + u7 / 2 - std::ldexp(1.0f, -20), 1.0f, "just below the tie: down"},
        {-(1.0f + 3 * u7 / 2), -(1.0f + 2 * u7), "sign is kept"},
        {3.14159265f, 3.140625f, "pi to 8 bits"},
        {bits_to_float(0x7f7fffffu), INFINITY, "f32 max rounds up to infinity"},
        {bits_to_float(0x00010000u), bits_to_float(0x00010000u), "a subnormal that fits"},
        {INFINITY, INFINITY, "infinity stays"},
    };
    for (auto& c : cases) {
      INFO(c.why << ": in " << c.in);
      float got = float(bf16(c.in));
      CHECK(got == c.want);
      // the tensor conversion agrees with the scalar one
      CHECK(Tensor::from_vector(vector<float>{c.in}, {1}).to(DType::BF16).to_vector<float>()[0] == c.want);
    }
    CHECK(std::isnan(float(bf16(std::numeric_limits<float>::quiet_NaN()))));
    // a signalling-looking NaN whose payload sits only in the low bits must not become inf
    CHECK(std::isnan(float(bf16(bits_to_float(0x7f800001u)))));
  }
  SECTION("f32 -> f16 rounds to nearest even over f16's range; the tensor conversion agrees") {
    struct Case {
      float in, want;
      const char* why;
    };
    const float u10 = std::ldexp(1.0f, -10);  // one f16 ulp at 1.0 (10 stored mantissa bits)
    vector<Case> cases = {
        {1.0f, 1.0f, "exact"},
        {1.0f + u10 / 2, 1.0f, "tie: even (1) wins"},
        {1.0f + 3 * u10 / 2, 1.0f + 2 * u10, "tie between odd and even: up"},
        {-(1.0f + 3 * u10 / 2), -(1.0f + 2 * u10), "sign is kept"},
        {3.14159265f, 3.140625f, "pi to 11 bits"},
        {65504.f, 65504.f, "the largest finite f16"},
        {65519.f, 65504.f, "just under the overflow tie: down"},
        {65520.f, INFINITY, "the overflow tie rounds to infinity"},
        {std::ldexp(1.0f, -24), std::ldexp(1.0f, -24), "the smallest subnormal"},
        {std::ldexp(1.0f, -25), 0.0f, "half the smallest subnormal: tie to even (0)"},
        {std::ldexp(3.0f, -26), std::ldexp(1.0f, -24), "above the half: up to the smallest subnormal"},
        {std::ldexp(1.0f, -14), std::ldexp(1.0f, -14), "the smallest normal"},
        {INFINITY, INFINITY, "infinity stays"},
    };
    for (auto& c : cases) {
      INFO(c.why << ": in " << c.in);
      CHECK(float(loom::f16(c.in)) == c.want);
      Tensor h = Tensor::from_vector(vector<float>{c.in}, {1}).to(DType::F16);
      CHECK(h.dtype() == DType::F16);
      CHECK(h.to_vector<float>()[0] == c.want);
      CHECK(h.to(DType::F64).to_vector<double>()[0] == double(c.want));
    }
    CHECK(std::isnan(float(loom::f16(std::numeric_limits<float>::quiet_NaN()))));
    // every one of the 63488 finite f16 values survives f16 -> f32 -> f16
    for (uint32_t b = 0; b < 0x10000u; b++) {
      if ((b & 0x7c00u) == 0x7c00u) continue;
      loom::f16 x;
      x.bits = uint16_t(b);
      if (loom::f16(float(x)).bits != x.bits) FAIL("f16 bits " << b << " do not round trip");
    }
    CHECK(Tensor::from_vector(vector<float>{1.5f, -2.f}, {2}).to(DType::F16).to(DType::BF16).to_vector<float>() ==
          vector<float>{1.5f, -2.f});
  }
  SECTION("to(same dtype) is the same tensor; clone is not") {
    Tensor t = random_f64({2, 3}, 8);
    CHECK(t.to(DType::F64).same(t));
    Tensor c = t.clone();
    CHECK_FALSE(shares_storage(c, t));
    CHECK(c.to_vector<double>() == t.to_vector<double>());
  }
}

TEST_CASE("Rng: reproducible, pinned values, valid permutations", "[tensor][rng]") {
  SECTION("the generator is splitmix64 (reference first output for state 0)") {
    Rng r;
    r.state = 0;
    CHECK(r.next_u64() == 0xE220A8397B1DCDAFull);
    CHECK(r.next_u64() == 0x6E789E6AA1B965F4ull);
  }
  SECTION("same seed, same numbers; different seed, different numbers") {
    Rng a(42), b(42), c(43);
    for (int i = 0; i < 100; i++) {
      uint64_t x = a.next_u64();
      CHECK(x == b.next_u64());
      CHECK(x != c.next_u64());
    }
    Rng d(5), e(5);
    Tensor t1 = Tensor::randn({9, 11}, d, 1.0, DType::F32);
    Tensor t2 = Tensor::randn({9, 11}, e, 1.0, DType::F32);
    CHECK(t1.to_vector<float>() == t2.to_vector<float>());
    // a checkpointed state resumes the same stream
    Rng f(9);
    f.uniform();
    Rng g(0);
    g.state = f.state;
    CHECK(f.normal() == g.normal());
  }
  SECTION("pinned first values (a change in the generator fails here)") {
    // Computed independently from the splitmix64 definition and the seeding rule in
    // tensor.h (state = seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019).
    Rng r(1234);
    CHECK(r.next_u64() == 0xA1E1C02DDAB5B031ull);
    CHECK(r.next_u64() == 0xC8DBBF9169710BC5ull);
    CHECK(r.next_u64() == 0xF54EDC07FBDD8905ull);
    Rng u(2024);  // uniform = top 53 bits / 2^53: exact
    CHECK(u.uniform() == 0.21845614760207377);
    CHECK(u.uniform() == 0.4511952062009632);
    CHECK(u.uniform() == 0.48360025468125134);
    Rng z(2024);  // Box-Muller on consecutive pairs; libm may differ in the last bit
    CHECK(z.normal() == Approx(-1.6628626547646277).epsilon(1e-14));
    CHECK(z.normal() == Approx(1.1126144869247123).epsilon(1e-14));
  }
  SECTION("uniform in [0, 1), normal has the right moments, randint in range") {
    Rng r(11);
    double s = 0, s2 = 0;
    const int n = 20000;
    int out_of_range = 0;
    for (int i = 0; i < n; i++) {
      double u = r.uniform();
      out_of_range += !(u >= 0.0 && u < 1.0);
      double z = r.normal();
      s += z;
      s2 += z * z;
      int64_t k = r.randint(7);
      out_of_range += !(k >= 0 && k < 7);
    }
    CHECK(out_of_range == 0);
    CHECK(std::fabs(s / n) < 0.05);          // 7 sigma of the mean's 1/sqrt(n)
    CHECK(std::fabs(s2 / n - 1.0) < 0.07);   // var of z^2 is 2: 5 sigma of sqrt(2/n)
  }
  SECTION("permutation: every index exactly once, seeded") {
    for (int n : {0, 1, 2, 17, 1000}) {
      Rng r(n + 3);
      auto p = r.permutation(n);
      REQUIRE(int(p.size()) == n);
      std::set<int32_t> seen(p.begin(), p.end());
      CHECK(int(seen.size()) == n);
      if (n) {
        CHECK(*seen.begin() == 0);
        CHECK(*seen.rbegin() == n - 1);
      }
      Rng r2(n + 3);
      CHECK(r2.permutation(n) == p);
    }
    Rng r(99);
    auto p = r.permutation(1000);
    int fixed = 0;
    for (int i = 0; i < 1000; i++) fixed += p[size_t(i)] == i;
    CHECK(fixed < 10);  // a shuffle, not the identity (expected number of fixed points: 1)
  }
}

TEST_CASE("item()", "[tensor]") {
  CHECK(Tensor::from_vector(vector<double>{-2.5}, {1}).item() == -2.5);
  CHECK(Tensor::from_vector(vector<float>{0.125f}, {1, 1}).item() == 0.125);
  CHECK(Tensor::from_vector(vector<int32_t>{-7}, {1}).item() == -7.0);
  Tensor x = random_f64({3, 4}, 12);
  CHECK(x.narrow(0, 2, 1).narrow(1, 3, 1).item() == x.to_vector<double>()[11]);
  CHECK(Tensor::empty({}, DType::F64).numel() == 1);
  REQUIRE_THROWS_WITH(x.item(), Contains("[3, 4]"));
}

TEST_CASE("errors carry the shapes", "[tensor]") {
  Tensor x = Tensor::zeros({4, 7}, DType::F32);
  REQUIRE_THROWS_WITH(x.view({5, 6}), Contains("[5, 6]") && Contains("[4, 7]"));
  REQUIRE_THROWS_WITH(x.reshape({3, -1}), Contains("[3, -1]"));
  REQUIRE_THROWS_WITH(x.reshape({-1, -1}), Contains("more than one -1"));
  REQUIRE_THROWS_WITH(x.transpose(0, 1).view({28}), Contains("non-contiguous") && Contains("[7, 4]"));
  REQUIRE_THROWS_WITH(x.narrow(1, 5, 3), Contains("[4, 7]") && Contains("start 5"));
  REQUIRE_THROWS_WITH(x.narrow(0, 0, -1), Contains("[4, 7]"));
  REQUIRE_THROWS_WITH(x.expand({4, 8}), Contains("[4, 7]") && Contains("[4, 8]"));
  REQUIRE_THROWS_WITH(x.permute({0}), Contains("[4, 7]"));
  REQUIRE_THROWS_WITH(x.permute({1, 1}), Contains("[4, 7]"));
  REQUIRE_THROWS_WITH(x.size(2), Contains("[4, 7]"));
  REQUIRE_THROWS_WITH(x.data<double>(), Contains("f32[4, 7]"));
  REQUIRE_THROWS_WITH(x.copy_(Tensor::zeros({7, 4})), Contains("[7, 4]") && Contains("[4, 7]"));
  REQUIRE_THROWS_WITH(broadcast_shapes({4, 7}, {3, 1, 6}), Contains("[4, 7]") && Contains("[3, 1, 6]"));
  REQUIRE_THROWS_WITH(Tensor::from_vector(vector<float>(27), {4, 7}), Contains("[4, 7]") && Contains("27"));
  REQUIRE_THROWS_WITH(Tensor::empty({4, -7}), Contains("[4, -7]"));
  CHECK(x.desc() == "f32[4, 7] cpu");
  CHECK(broadcast_shapes({4, 1, 7}, {3, 1}) == Shape{4, 3, 7});
}
