// test_ops_gradcheck.cpp: an f64 gradient check of every differentiable op in autograd/ops.h.
//
// gradcheck (autograd/gradcheck.h) compares the tape's gradients with central differences
// (eps 1e-6) of sum(f(x) * R) for a fixed random R, element by element, with the tolerance
// row tol::kGradcheckF64. Inputs are fresh seeded random values (never zeros), kept in the
// domain where the op is smooth (log/sqrt positive, |x| away from 0, divisors away from 0).
// Shapes are small (a check costs two forwards per input element) but reach the branches:
// odd sizes, N = 1, broadcasting on both sides, C = 3 / 37 / 1030 for the norms, ragged
// packed sequences with trailing padding rows and GQA for attention, ignored targets and a
// chunk that does not divide N for the losses.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "autograd/gradcheck.h"
#include "autograd/ops.h"
#include "tests/tolerances.h"

using namespace loom;
using std::vector;

namespace {

using Fn = std::function<Tensor(const vector<Tensor>&)>;

Rng& rng() {
  static Rng r(20250101);
  return r;
}

// differentiable f64 input, normal(0, std)
Tensor P(const Shape& s, double std = 1.0) { return Tensor::randn(s, rng(), std, DType::F64).requires_grad_(); }
// differentiable f64 input, uniform in [lo, hi)
Tensor U(const Shape& s, double lo, double hi) { return Tensor::rand(s, rng(), lo, hi, DType::F64).requires_grad_(); }
// uniform magnitude in [lo, hi) with a random sign (away from 0)
Tensor away_from_zero(const Shape& s, double lo, double hi) {
  vector<double> v(size_t(shape_numel(s)));
  for (auto& x : v) x = (rng().uniform() < 0.5 ? -1 : 1) * (lo + (hi - lo) * rng().uniform());
  return Tensor::from_vector(v, s).requires_grad_();
}
Tensor ids(const vector<int32_t>& v, const Shape& s) { return Tensor::from_vector(v, s); }

void check(const std::string& what, const Fn& f, const vector<Tensor>& in, double eps = 1e-6) {
  GradcheckResult r = gradcheck(f, in, eps, tol::kGradcheckF64.atol, tol::kGradcheckF64.rtol);
  INFO(what << "\n" << r.report);
  CHECK(r.ok);
  CHECK(tape_size() == 0);
}

}  // namespace

TEST_CASE("gradcheck: views and shape ops", "[gradcheck]") {
  check("reshape [3,4,5] -> [5,-1]", [](auto& in) { return reshape(in[0], {5, -1}); }, {P({3, 4, 5})});
  check("reshape of a permuted (strided) tensor",
        [](auto& in) { return reshape(permute(in[0], {1, 0, 2}), {4, 15}); }, {P({3, 4, 5})});
  check("permute (2,0,1)", [](auto& in) { return permute(in[0], {2, 0, 1}); }, {P({2, 3, 4})});
  check("permute with a negative dim", [](auto& in) { return permute(in[0], {-1, 1, 0}); }, {P({2, 3, 4})});
  check("transpose (0,2)", [](auto& in) { return transpose(in[0], 0, 2); }, {P({2, 3, 5})});
  check("transpose (-1,-2)", [](auto& in) { return transpose(in[0], -1, -2); }, {P({2, 3, 5})});
  check("narrow (1, 1, 2)", [](auto& in) { return narrow(in[0], 1, 1, 2); }, {P({3, 5, 2})});
  check("narrow of narrow, last dim",
        [](auto& in) { return narrow(narrow(in[0], 2, 1, 4), 0, 2, 1); }, {P({3, 2, 6})});
  check("contiguous of a transpose", [](auto& in) { return contiguous(transpose(in[0], 0, 1)); }, {P({4, 3})});
  check("expand [3,1,5] -> [2,3,4,5]", [](auto& in) { return expand(in[0], {2, 3, 4, 5}); }, {P({3, 1, 5})});
  check("expand [1] -> [7]", [](auto& in) { return expand(in[0], {7}); }, {P({1})});
  // cast f64 -> f32 -> f64 is the identity up to f32 rounding (6e-8 relative): with eps 1e-6
  // that rounding would dominate the difference quotient, so this linear composition is
  // checked with eps 1e-2 (central differences of a linear map have no truncation error; the
  // rounding then contributes ~1e-7 / 1e-2 = 1e-5 relative).
  check("cast f64 -> f32 -> f64", [](auto& in) { return cast(cast(in[0], DType::F32), DType::F64); },
        {P({3, 5})}, 1e-2);
  check("cast inside a composition (f32 round trip, then a product)",
        [](auto& in) { return mul(cast(cast(in[0], DType::F32), DType::F64), in[1]); }, {P({4, 3}), P({4, 3})},
        1e-2);
}

TEST_CASE("gradcheck: broadcasting elementwise ops, scale, unary", "[gradcheck]") {
  struct Bin {
    const char* name;
    Tensor (*op)(const Tensor&, const Tensor&);
  };
  vector<Bin> ops = {{"add", add}, {"sub", sub}, {"mul", mul}, {"div", div}};
  for (auto& o : ops) {
    auto op = o.op;
    bool is_div = std::string(o.name) == "div";
    auto rhs = [&](const Shape& s) { return is_div ? away_from_zero(s, 0.5, 2.0) : P(s); };
    check(std::string(o.name) + " [3,1,5] with [4,5]", [op](auto& in) { return op(in[0], in[1]); },
          {P({3, 1, 5}), rhs({4, 5})});
    check(std::string(o.name) + " [4,5] with [3,1,5]", [op](auto& in) { return op(in[0], in[1]); },
          {P({4, 5}), rhs({3, 1, 5})});
    check(std::string(o.name) + " same shape [2,7]", [op](auto& in) { return op(in[0], in[1]); },
          {P({2, 7}), rhs({2, 7})});
    check(std::string(o.name) + " [2,3] with a scalar [1]", [op](auto& in) { return op(in[0], in[1]); },
          {P({2, 3}), rhs({1})});
    check(std::string(o.name) + " [5,1] with [1,4]", [op](auto& in) { return op(in[0], in[1]); },
          {P({5, 1}), rhs({1, 4})});
    // only one side differentiable
    Tensor c = rhs({4, 5});
    c.requires_grad_(false);
    check(std::string(o.name) + " with a constant rhs", [op, c](auto& in) { return op(in[0], c); }, {P({3, 1, 5})});
  }
  check("scale -1.7", [](auto& in) { return scale(in[0], -1.7); }, {P({3, 4})});
  check("operator* and operator-", [](auto& in) { return (in[0] * 0.5) - (in[1] * in[0]); }, {P({3}), P({2, 3})});

  check("unary neg", [](auto& in) { return unary(in[0], UnaryOp::Neg); }, {P({3, 5})});
  check("unary exp", [](auto& in) { return unary(in[0], UnaryOp::Exp); }, {P({3, 5})});
  check("unary log", [](auto& in) { return unary(in[0], UnaryOp::Log); }, {U({3, 5}, 0.3, 3.0)});
  check("unary sqrt", [](auto& in) { return unary(in[0], UnaryOp::Sqrt); }, {U({3, 5}, 0.3, 3.0)});
  check("unary square", [](auto& in) { return unary(in[0], UnaryOp::Square); }, {P({3, 5})});
  check("unary abs", [](auto& in) { return unary(in[0], UnaryOp::Abs); }, {away_from_zero({3, 5}, 0.1, 2.0)});
  check("unary of a strided input", [](auto& in) { return unary(transpose(in[0], 0, 1), UnaryOp::Exp); },
        {P({3, 4})});
}

TEST_CASE("gradcheck: reductions", "[gradcheck]") {
  check("sum [3,7]", [](auto& in) { return sum(in[0]); }, {P({3, 7})});
  check("sum of a strided view", [](auto& in) { return sum(narrow(in[0], 1, 2, 3)); }, {P({3, 7})});
  check("mean [3,7]", [](auto& in) { return mean(in[0]); }, {P({3, 7})});
  check("mean of a product (non-linear)", [](auto& in) { return mean(mul(in[0], in[0])); }, {P({2, 5})});
  check("mean_pool [2,5,3]", [](auto& in) { return mean_pool(in[0]); }, {P({2, 5, 3})});
  check("mean_pool [1,1,4]", [](auto& in) { return mean_pool(in[0]); }, {P({1, 1, 4})});
}

TEST_CASE("gradcheck: linear and matmul", "[gradcheck]") {
  auto lin_b = [](auto& in) { return linear(in[0], in[1], in[2]); };
  auto lin = [](auto& in) { return linear(in[0], in[1]); };
  check("linear with bias [5,7] x [3,7]", lin_b, {P({5, 7}), P({3, 7}), P({3})});
  check("linear without bias [5,7] x [3,7]", lin, {P({5, 7}), P({3, 7})});
  check("linear N=1", lin_b, {P({1, 7}), P({3, 7}), P({3})});
  check("linear 3-D input [2,3,5] x [4,5]", lin_b, {P({2, 3, 5}), P({4, 5}), P({4})});
  check("linear O=1, I=1", lin_b, {P({3, 1}), P({1, 1}), P({1})});
  {
    Tensor w = P({3, 7});
    w.requires_grad_(false);
    check("linear, constant weight", [w](auto& in) { return linear(in[0], w, in[1]); }, {P({4, 7}), P({3})});
  }

  auto mm = [](bool ta, bool tb) {
    return [ta, tb](const vector<Tensor>& in) { return matmul(in[0], in[1], ta, tb); };
  };
  const int B = 2, M = 3, K = 4, N = 5;
  for (int ta = 0; ta < 2; ta++)
    for (int tb = 0; tb < 2; tb++) {
      Shape as = ta ? Shape{B, K, M} : Shape{B, M, K};
      Shape bs = tb ? Shape{B, N, K} : Shape{B, K, N};
      check("batched matmul ta=" + std::to_string(ta) + " tb=" + std::to_string(tb), mm(ta, tb), {P(as), P(bs)});
      Shape as2 = ta ? Shape{K, M} : Shape{M, K};
      Shape bs2 = tb ? Shape{N, K} : Shape{K, N};
      check("2-D matmul ta=" + std::to_string(ta) + " tb=" + std::to_string(tb), mm(ta, tb), {P(as2), P(bs2)});
    }
  check("matmul with a shared 2-D b", mm(false, false), {P({B, M, K}), P({K, N})});
  check("matmul with a shared 2-D b^T", mm(false, true), {P({B, M, K}), P({N, K})});
  check("matmul 4-D batch [2,2,3,4] @ [2,2,4,1]", mm(false, false), {P({2, 2, 3, 4}), P({2, 2, 4, 1})});
  check("matmul M=1 K=1", mm(false, false), {P({2, 1, 1}), P({2, 1, 3})});
  // linear_split: the parts combined with different weights, so each part's gradient differs;
  // one part unused (its gradient never arrives) must still leave the others right
  auto split3 = [](auto& in) {
    auto p = linear_split(in[0], in[1], in[2], 3);
    return add(add(p[0], scale(p[1], 2.0)), mul(p[2], p[0]));
  };
  check("linear_split 3 parts [5,7] x [3*4,7]", split3, {P({5, 7}), P({12, 7}), P({12})});
  check("linear_split 3-D input, 2 parts, one unused",
        [](auto& in) { return linear_split(in[0], in[1], Tensor(), 2)[1]; }, {P({2, 3, 5}), P({8, 5})});
  {
    auto a = linear_split(P({4, 7}), P({12, 7}), P({12}), 3);
    CHECK(a[1].shape() == Shape({4, 4}));
    CHECK(a[2].is_contiguous());
    clear_tape();
  }
  REQUIRE_THROWS_WITH(linear_split(P({5, 7}), P({10, 7}), Tensor(), 3), Catch::Contains("3 parts"));
  check("linear_many: three weights of different widths (GQA q/k/v), with biases",
        [](auto& in) {
          auto p = linear_many(in[0], {in[1], in[2], in[3]}, {in[4], in[5], in[6]});
          return add(sum(mul(p[0], p[0])), add(sum(p[1]), scale(sum(p[2]), 3.0)));
        },
        {P({4, 6}), P({6, 6}), P({2, 6}), P({2, 6}), P({6}), P({2}), P({2})});
  // mlp_gelu = linear(gelu(linear(x))) with the GELU in the GEMMs' epilogues
  auto mlp = [](auto& in) { return mlp_gelu(in[0], in[1], in[2], in[3], in[4]); };
  check("mlp_gelu [5,6] -> 9 -> 4", mlp, {P({5, 6}), P({9, 6}), P({9}), P({4, 9}), P({4})});
  check("mlp_gelu 3-D input, no biases", [](auto& in) { return mlp_gelu(in[0], in[1], Tensor(), in[2], Tensor()); },
        {P({2, 3, 5}), P({7, 5}), P({3, 7})});
  {  // the same function as the unfused ops
    Tensor x = P({6, 5}), w1 = P({8, 5}), b1 = P({8}), w2 = P({3, 8}), b2 = P({3});
    NoGradGuard ng;
    auto a = mlp_gelu(x, w1, b1, w2, b2).to_vector<double>();
    auto b = linear(gelu(linear(x, w1, b1)), w2, b2).to_vector<double>();
    for (size_t i = 0; i < a.size(); i++) CHECK(std::abs(a[i] - b[i]) <= 1e-12 * (1 + std::abs(b[i])));
  }
  {  // no gradient wanted: fc1 keeps no pre-activation (the GELU runs on its output in place),
     // the same bits as the forward that keeps it (f32: every rounding shows)
    Tensor x = P({7, 5}).to(DType::F32), w1 = P({9, 5}).to(DType::F32).requires_grad_(),
           b1 = P({9}).to(DType::F32), w2 = P({4, 9}).to(DType::F32), b2 = P({4}).to(DType::F32);
    auto a = mlp_gelu(x, w1, b1, w2, b2).to_vector<double>();
    std::vector<double> b;
    {
      NoGradGuard ng;
      b = mlp_gelu(x, w1, b1, w2, b2).to_vector<double>();
    }
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); i++) CHECK(a[i] == b[i]);
  }
  // The residual adds carried by the products (linear's and mlp_gelu's residual), and a block
  // as the ViT runs it: h = r + proj(x), o = h + mlp(norm(h)). h's two gradients (the second
  // add's pass-through and the norm's) meet in the norm's backward kernel (pending_grad), and
  // so do o's before the RMSNorm; a norm that dropped or doubled the pending one fails here.
  check("linear with residual [5,6] -> 4", [](auto& in) { return linear(in[0], in[1], in[2], in[3]); },
        {P({5, 6}), P({4, 6}), P({4}), P({5, 4})});
  check("linear with residual, 3-D, no bias", [](auto& in) { return linear(in[0], in[1], Tensor(), in[2]); },
        {P({2, 3, 5}), P({4, 5}), P({2, 3, 4})});
  check("mlp_gelu with residual", [](auto& in) { return mlp_gelu(in[0], in[1], in[2], in[3], in[4], in[5]); },
        {P({5, 6}), P({9, 6}), P({9}), P({4, 9}), P({4}), P({5, 4})});
  check("mlp_gelu with residual, keeping its activation (train.keep_gelu)",
        [](auto& in) { return mlp_gelu(in[0], in[1], in[2], in[3], in[4], in[5], true); },
        {P({5, 6}), P({9, 6}), P({9}), P({4, 9}), P({4}), P({5, 4})});
  check("a residual block: the norms fold the residual stream's other gradient",
        [](auto& in) {
          Tensor h = linear(in[0], in[1], in[2], in[3]);
          Tensor o = mlp_gelu(layernorm(h, in[4], in[5], 1e-5), in[6], in[7], in[8], in[9], h);
          return mul(o, rmsnorm(o, in[10], 1e-5));
        },
        {P({5, 6}), P({4, 6}), P({4}), P({5, 4}), U({4}, 0.5, 1.5), P({4}), P({7, 4}), P({7}), P({4, 7}), P({4}),
         U({4}, 0.5, 1.5)});
  check("mlp_swiglu with residual", [](auto& in) { return mlp_swiglu(in[0], in[1], in[2], in[3], in[4]); },
        {P({5, 6}), P({9, 6}, 2.0), P({9, 6}), P({4, 9}), P({5, 4})});
  check("mlp_swiglu with residual, keeping its product (train.keep_swiglu)",
        [](auto& in) { return mlp_swiglu(in[0], in[1], in[2], in[3], in[4], true); },
        {P({5, 6}), P({9, 6}, 2.0), P({9, 6}), P({4, 9}), P({5, 4})});
  {  // the same values as the add done apart
    Tensor x = P({6, 5}), w = P({3, 5}), b = P({3}), r = P({6, 3}), w1 = P({8, 3}), w2 = P({3, 8});
    NoGradGuard ng;
    auto a = linear(x, w, b, r).to_vector<double>(), a2 = add(r, linear(x, w, b)).to_vector<double>();
    auto m = mlp_gelu(r, w1, Tensor(), w2, Tensor(), r).to_vector<double>();
    auto m2 = add(r, mlp_gelu(r, w1, Tensor(), w2, Tensor())).to_vector<double>();
    for (size_t i = 0; i < a.size(); i++) CHECK(std::abs(a[i] - a2[i]) <= 1e-12 * (1 + std::abs(a2[i])));
    for (size_t i = 0; i < m.size(); i++) CHECK(std::abs(m[i] - m2[i]) <= 1e-12 * (1 + std::abs(m2[i])));
  }
  REQUIRE_THROWS_WITH(linear(P({5, 6}), P({4, 6}), Tensor(), P({5, 3})), Catch::Contains("residual"));
  clear_tape();
  // mlp_swiglu = linear(swiglu(linear(x), linear(x))), the product recomputed in backward
  check("mlp_swiglu [5,6] -> 9 -> 4", [](auto& in) { return mlp_swiglu(in[0], in[1], in[2], in[3]); },
        {P({5, 6}), P({9, 6}, 2.0), P({9, 6}), P({4, 9})});
  check("mlp_swiglu 3-D input", [](auto& in) { return mlp_swiglu(in[0], in[1], in[2], in[3]); },
        {P({2, 3, 5}), P({7, 5}), P({7, 5}), P({3, 7})});
  {  // the same function and gradients as the unfused ops
    Tensor x = P({6, 5}), wg = P({8, 5}), wu = P({8, 5}), wd = P({3, 8});
    Tensor x2 = P({6, 5}), wg2 = P({8, 5}), wu2 = P({8, 5}), wd2 = P({3, 8});
    for (auto [d, s] : {std::pair<Tensor, Tensor>{x2, x}, {wg2, wg}, {wu2, wu}, {wd2, wd}}) d.copy_(s);
    backward(sum(mlp_swiglu(x, wg, wu, wd)));
    backward(sum(linear(swiglu(linear(x2, wg2), linear(x2, wu2)), wd2)));
    for (auto [a, b] : {std::pair<Tensor, Tensor>{x, x2}, {wg, wg2}, {wu, wu2}, {wd, wd2}}) {
      auto ga = a.grad().to_vector<double>(), gb = b.grad().to_vector<double>();
      for (size_t i = 0; i < ga.size(); i++) CHECK(std::abs(ga[i] - gb[i]) <= 1e-12 * (1 + std::abs(gb[i])));
    }
    CHECK_THROWS_WITH(mlp_swiglu(x, wg, wu, P({3, 7})), Catch::Contains("do not chain"));
  }
  // gradient checkpointing: the same gradients, for the input and for parameters inside fn
  {
    Tensor w = P({6, 6}), b = P({6});
    auto block = [w, b](const Tensor& x) { return add(x, gelu(linear(x, w, b))); };
    check("checkpoint of a residual block (input and captured parameters)",
          [block](auto& in) { return mul(checkpoint(block, in[0]), checkpoint(block, in[0])); }, {P({3, 6})});
    Tensor x = P({3, 6});
    w.impl()->grad.reset();  // the check above accumulated into them
    b.impl()->grad.reset();
    backward(sum(checkpoint(block, x)));
    auto gw = w.grad().to_vector<double>(), gx = x.grad().to_vector<double>();
    w.impl()->grad.reset();
    b.impl()->grad.reset();
    x.impl()->grad.reset();
    backward(sum(block(x)));
    CHECK(w.grad().to_vector<double>() == gw);
    CHECK(x.grad().to_vector<double>() == gx);
  }
  REQUIRE_THROWS_WITH(matmul(P({B, K, M}), P({K, N}), true, false), Catch::Contains("shared 2-D b"));
  REQUIRE_THROWS_WITH(matmul(P({B, M, K}), P({B, 3, N})), Catch::Contains("[2, 3, 4]"));
  clear_tape();
}

TEST_CASE("gradcheck: norms and activations", "[gradcheck]") {
  // add_layernorm: both outputs reach the loss (the residual stream and the normed branch)
  check("add_layernorm [4,37]",
        [](auto& in) {
          auto hn = add_layernorm(in[0], in[1], in[2], in[3], 1e-5);
          return add(scale(hn[0], 0.5), mul(hn[1], hn[1]));
        },
        {P({4, 37}), P({4, 37}), P({37}), P({37})});
  check("add_rmsnorm [3,37]",
        [](auto& in) {
          auto hn = add_rmsnorm(in[0], in[1], in[2], 1e-6);
          return add(hn[0], scale(hn[1], 3.0));
        },
        {P({3, 37}), P({3, 37}), P({37})});
  check("add_layernorm, only the normed output used",
        [](auto& in) { return add_layernorm(in[0], in[1], in[2], Tensor(), 1e-5)[1]; }, {P({3, 5}), P({3, 5}), P({5})});
  auto ln = [](auto& in) { return layernorm(in[0], in[1], in[2], 1e-5); };
  auto ln_nobias = [](auto& in) { return layernorm(in[0], in[1], Tensor(), 1e-5); };
  auto rms = [](auto& in) { return rmsnorm(in[0], in[1], 1e-5); };
  struct NC {
    int N, C;
  };
  for (NC s : {NC{5, 3}, NC{3, 37}, NC{2, 1030}}) {
    std::string sh = "[" + std::to_string(s.N) + ", " + std::to_string(s.C) + "]";
    // weights around 1 with spread, biases random: every term of the backward matters
    check("layernorm " + sh, ln, {P({s.N, s.C}, 2.0), U({s.C}, 0.5, 1.5), P({s.C})});
    check("rmsnorm " + sh, rms, {P({s.N, s.C}, 2.0), U({s.C}, 0.5, 1.5)});
  }
  check("layernorm without bias, 3-D input", ln_nobias, {P({2, 3, 5}), U({5}, 0.5, 1.5)});
  check("layernorm N=1 C=37", ln, {P({1, 37}), U({37}, 0.5, 1.5), P({37})});
  check("rmsnorm N=1 C=37", rms, {P({1, 37}), U({37}, 0.5, 1.5)});

  check("gelu", [](auto& in) { return gelu(in[0]); }, {P({4, 7}, 2.0)});
  check("silu", [](auto& in) { return silu(in[0]); }, {P({4, 7}, 2.0)});
  check("swiglu", [](auto& in) { return swiglu(in[0], in[1]); }, {P({3, 5}, 2.0), P({3, 5})});
  check("softmax [4,7]", [](auto& in) { return softmax(in[0]); }, {P({4, 7}, 2.0)});
  check("softmax N=1 C=1030", [](auto& in) { return softmax(in[0]); }, {P({1, 1030}, 2.0)});
  check("softmax C=1", [](auto& in) { return softmax(in[0]); }, {P({3, 1})});
}

TEST_CASE("gradcheck: embedding and indexing", "[gradcheck]") {
  Tensor id = ids({0, 5, 2, 5, 5, 1, 3, 0, 2, 4}, {2, 5});  // repeats; id 5 is the last row
  check("embedding table gradient (ids with repeats)", [id](auto& in) { return embedding(id, in[0]); },
        {P({6, 3})});
  Tensor id1 = ids({4}, {1});
  check("embedding of one id", [id1](auto& in) { return embedding(id1, in[0]); }, {P({6, 3})});

  Tensor gi = ids({5, 0, 5, 2, 1, 1, 3, 4}, {2, 4});  // repeats within a batch row
  check("gather_rows [2,6,3] by [2,4]", [gi](auto& in) { return gather_rows(in[0], gi); }, {P({2, 6, 3})});

  Tensor si = ids({4, 0, 2, 1, 5, 3}, {2, 3});  // distinct within each batch row
  check("scatter_rows base and src", [si](auto& in) { return scatter_rows(in[0], si, in[1]); },
        {P({2, 6, 3}), P({2, 3, 3})});
  {
    Tensor base = P({2, 6, 3});
    base.requires_grad_(false);
    check("scatter_rows src only", [si, base](auto& in) { return scatter_rows(base, si, in[0]); }, {P({2, 3, 3})});
  }

  check("patchify [2,3,4,6] p=2 (H != W)", [](auto& in) { return patchify(in[0], 2); }, {P({2, 3, 4, 6})});
  check("patchify [1,2,6,3] p=3", [](auto& in) { return patchify(in[0], 3); }, {P({1, 2, 6, 3})});
  check("pixel_shuffle [2,16,3] s=2", [](auto& in) { return pixel_shuffle(in[0], 2); }, {P({2, 16, 3})});
  check("pixel_shuffle [1,36,2] s=3", [](auto& in) { return pixel_shuffle(in[0], 3); }, {P({1, 36, 2})});

  Tensor pos = ids({0, 1, 2, 3, 0, 1, 2, 0, 17}, {9});  // positions restart per document
  check("rope theta 10000, hd 6", [pos](auto& in) { return rope(in[0], pos, 10000.0); }, {P({9, 2, 6})});
  check("rope theta 100, hd 2", [pos](auto& in) { return rope(in[0], pos, 100.0); }, {P({9, 3, 2})});

  check("l2_normalize [4,5]", [](auto& in) { return l2_normalize(in[0]); }, {P({4, 5})});
  check("l2_normalize [3,1]", [](auto& in) { return l2_normalize(in[0]); }, {away_from_zero({3, 1}, 0.5, 2.0)});
}

TEST_CASE("gradcheck: attention (packed ragged, GQA, padding rows)", "[gradcheck]") {
  // documents of 7, 1, 13 and 5 tokens, then 3 padding rows outside every sequence
  const vector<int32_t> cu = {0, 7, 8, 21, 26};
  const int Ntok = 29, H = 4, KV = 2, hd = 8;
  SeqInfo seq = SeqInfo::packed(cu, Device::CPU);
  REQUIRE(seq.max_seqlen == 13);
  for (bool causal : {true, false}) {
    auto f = [seq, causal](const vector<Tensor>& in) {
      return attention(in[0], in[1], in[2], seq, causal, 0.35);
    };
    check(std::string("attention ") + (causal ? "causal" : "bidirectional") + " H=4 KV=2 hd=8", f,
          {P({Ntok, H, hd}), P({Ntok, KV, hd}), P({Ntok, KV, hd})});
  }
  // padding rows produce zeros
  {
    Rng r(9);
    Tensor q = Tensor::randn({Ntok, H, hd}, r, 1.0, DType::F64), k = Tensor::randn({Ntok, KV, hd}, r, 1.0, DType::F64);
    Tensor v = Tensor::randn({Ntok, KV, hd}, r, 1.0, DType::F64);
    auto o = attention(q, k, v, seq, true, 0.35).to_vector<double>();
    for (int i = 26 * H * hd; i < Ntok * H * hd; i++) CHECK(o[size_t(i)] == 0.0);
  }
  // queries and keys of different lengths (decode: one query over a cache), MQA (KV = 1)
  {
    SeqInfo dec;
    dec.cu_q = ids({0, 1, 3}, {3});
    dec.cu_k = ids({0, 5, 9}, {3});
    dec.nseq = 2;
    dec.max_seqlen = 5;
    for (bool causal : {true, false}) {
      auto f = [dec, causal](const vector<Tensor>& in) { return attention(in[0], in[1], in[2], dec, causal, 0.5); };
      check(std::string("attention Lq != Lk, KV=1 ") + (causal ? "causal" : "bidirectional"), f,
            {P({3, 2, 4}), P({9, 1, 4}), P({9, 1, 4})});
    }
  }
  // dense rows (the ViT layout), H = KV
  {
    SeqInfo d = SeqInfo::dense(2, 5, Device::CPU);
    check("attention dense 2x5, H=KV=3, hd=2",
          [d](auto& in) { return attention(in[0], in[1], in[2], d, false, 0.7); },
          {P({10, 3, 2}), P({10, 3, 2}), P({10, 3, 2})});
  }
}

TEST_CASE("gradcheck: losses", "[gradcheck]") {
  Tensor t = ids({2, -1, 0, 4, -1, 3}, {6});
  check("cross_entropy with ignored rows", [t](auto& in) { return cross_entropy(in[0], t); }, {P({6, 5}, 2.0)});
  Tensor none = ids({-1, -1}, {2});
  check("cross_entropy, every row ignored", [none](auto& in) { return cross_entropy(in[0], none); }, {P({2, 5})});
  Tensor t1 = ids({1}, {1});
  check("cross_entropy N=1 V=1030", [t1](auto& in) { return cross_entropy(in[0], t1); }, {P({1, 1030})});
  // scaled downstream: the loss's backward must use the incoming dloss, not 1
  check("3 * cross_entropy", [t](auto& in) { return scale(cross_entropy(in[0], t), 3.0); }, {P({6, 5})});

  Tensor ft = ids({3, -1, 0, 4, 4, -1, 1}, {7});
  for (int64_t chunk : {3, 7, 64}) {
    check("fused_linear_cross_entropy N=7, chunk " + std::to_string(chunk),
          [ft, chunk](auto& in) { return fused_linear_cross_entropy(in[0], in[1], ft, chunk); },
          {P({7, 4}), P({5, 4})});
  }
  check("-2.5 * fused_linear_cross_entropy (dloss != 1)",
        [ft](auto& in) { return scale(fused_linear_cross_entropy(in[0], in[1], ft, 3), -2.5); },
        {P({7, 4}), P({5, 4})});

  {
    Tensor target = Tensor::randn({2, 3, 4}, rng(), 1.0, DType::F64);  // no gradient by contract
    check("patch_disc_loss B=2 M=3 D=4 tau=0.2",
          [target](auto& in) { return patch_disc_loss(in[0], target, 0.2); }, {P({2, 3, 4})});
    check("2 * patch_disc_loss B=1 M=5 D=3 tau=0.5",
          [](auto& in) { return scale(patch_disc_loss(in[0], in[1], 0.5), 2.0); },
          {P({1, 5, 3}), Tensor::randn({1, 5, 3}, rng(), 1.0, DType::F64)});
  }
  check("infonce_loss B=3 D=4 tau=0.3 (raw inputs)",
        [](auto& in) { return infonce_loss(in[0], in[1], 0.3); }, {P({3, 4}, 0.5), P({3, 4}, 0.5)});
  check("infonce_loss through l2_normalize, B=4 D=5 tau=0.1",
        [](auto& in) { return scale(infonce_loss(l2_normalize(in[0]), l2_normalize(in[1]), 0.1), 0.7); },
        {P({4, 5}), P({4, 5})});
  check("infonce_loss B=1", [](auto& in) { return infonce_loss(in[0], in[1], 0.3); }, {P({1, 4}), P({1, 4})});
}

TEST_CASE("gradcheck fails on a wrong backward (the harness can fail)", "[gradcheck]") {
  // y = 2x, recorded with a backward that is off by 0.5%: beyond rtol 1e-3
  auto wrong = [](const vector<Tensor>& in) {
    Tensor x = in[0], y;
    {
      NoGradGuard ng;
      y = scale(x, 2.0);
    }
    record("wrong", {y}, [x, y]() { accumulate_grad(x, scale(grad_of(y), 2.01)); });
    return y;
  };
  GradcheckResult r = gradcheck(wrong, {P({3, 4})}, 1e-6, tol::kGradcheckF64.atol, tol::kGradcheckF64.rtol);
  INFO(r.report);
  CHECK_FALSE(r.ok);
  CHECK(r.worst > 1.0);
  // and a missing gradient (an input the backward forgets) fails too
  auto forgets = [](const vector<Tensor>& in) {
    Tensor b;
    {
      NoGradGuard ng;
      b = mul(in[0], in[1]);
    }
    record("forgets", {b}, [a = in[0], b, c = in[1]]() { accumulate_grad(a, mul(grad_of(b), c)); });
    return b;
  };
  GradcheckResult r2 = gradcheck(forgets, {P({2, 3}), P({2, 3})}, 1e-6, tol::kGradcheckF64.atol,
                                 tol::kGradcheckF64.rtol);
  INFO(r2.report);
  CHECK_FALSE(r2.ok);
  CHECK(r2.report.find("input 1") != std::string::npos);
}

TEST_CASE("joined products: q|k|v and gate|up as one GEMM when the weights lie side by side", "[gradcheck]") {
  const int N = 7, C = 5, H = 2, KV = 1, hd = 4, I = 3;
  const int R = (H + 2 * KV) * hd;  // rows of q|k|v, then gate and up
  const double theta = 1e4;
  Tensor pos = ids({0, 1, 2, 0, 1, 5, 3}, {N});
  // the weights as windows of one buffer, the layout the optimizer's flat buffer gives a layer
  Tensor buf = Tensor::randn({R + 2 * I, C}, rng(), 0.7, DType::F64);
  auto window = [&](int64_t r0, int64_t rows) { return buf.narrow(0, r0, rows).requires_grad_(); };
  Tensor wq = window(0, H * hd), wk = window(H * hd, KV * hd), wv = window((H + KV) * hd, KV * hd);
  Tensor wg = window(R, I), wu = window(R + I, I), wd = P({C, I}), x = P({N, C});
  auto attn_in = [&](const vector<Tensor>& in) {
    auto o = qkv_rope(in[0], in[1], in[2], in[3], pos, H, KV, hd, theta);
    return add(sum(mul(o[0], o[0])), add(sum(mul(o[1], o[2])), sum(scale(o[2], 3.0))));
  };
  auto mlp = [](const vector<Tensor>& in) { return mlp_swiglu(in[0], in[1], in[2], in[3]); };
  // the joined path itself (its weights' gradients in buffers of their own: one GEMM per part)
  check("qkv_rope, weights side by side", attn_in, {x, wq, wk, wv});
  // a Llama layer's attention from its input in one node: two sequences and a row outside both
  const SeqInfo seq = SeqInfo::packed({0, 3, 6}, Device::CPU);
  auto rope_attn = [&](const vector<Tensor>& in) {
    return qkv_rope_attention(in[0], in[1], in[2], in[3], pos, seq, H, KV, hd, theta, 0.6);
  };
  check("qkv_rope_attention, weights side by side", rope_attn, {x, wq, wk, wv});
  check("qkv_rope_attention, separate weights (qkv_rope and attention)", rope_attn,
        {x, wq.clone().requires_grad_(), wk.clone().requires_grad_(), wv.clone().requires_grad_()});
  // a ViT block's attention from its input in one node (qkv_attention: dq | dk | dv as rows of one
  // gradient), on two sequences and a row outside both, and against linear_split + attention
  {
    const int Hv = 2, D = Hv * hd;
    auto vit_attn = [&](const vector<Tensor>& in) { return qkv_attention(in[0], in[1], in[2], seq, Hv, 0.6); };
    auto vit_apart = [&](const vector<Tensor>& in) {
      auto p = linear_split(in[0], in[1], in[2], 3);
      return reshape(attention(reshape(p[0], {N, Hv, hd}), reshape(p[1], {N, Hv, hd}), reshape(p[2], {N, Hv, hd}), seq,
                               false, 0.6),
                     {N, D});
    };
    Tensor wv3 = P({3 * D, C}), bv3 = P({3 * D}), r = Tensor::randn({N, D}, rng(), 1.0, DType::F64);
    check("qkv_attention", vit_attn, {x, wv3, bv3});
    Tensor xa = x.clone().requires_grad_(), wa = wv3.clone().requires_grad_(), ba = bv3.clone().requires_grad_();
    Tensor xb = x.clone().requires_grad_(), wb = wv3.clone().requires_grad_(), bb = bv3.clone().requires_grad_();
    Tensor one = sum(mul(vit_attn({xa, wa, ba}), r));
    backward(one);
    Tensor two = sum(mul(vit_apart({xb, wb, bb}), r));
    backward(two);
    LOOM_CHECK_CLOSE(tol::compare(vector<double>{one.item()}, vector<double>{two.item()}, tol::kSameMathF64, "loss"));
    LOOM_CHECK_CLOSE(tol::compare(xa.grad().to_vector<double>(), xb.grad().to_vector<double>(), tol::kSameMathF64, "dx"));
    LOOM_CHECK_CLOSE(tol::compare(wa.grad().to_vector<double>(), wb.grad().to_vector<double>(), tol::kSameMathF64, "dW"));
    LOOM_CHECK_CLOSE(tol::compare(ba.grad().to_vector<double>(), bb.grad().to_vector<double>(), tol::kSameMathF64, "db"));
  }
  check("mlp_swiglu, gate and up side by side", mlp, {x, wg, wu, wd});
  check("mlp_swiglu, gate and up side by side, with residual",
        [](const vector<Tensor>& in) { return mlp_swiglu(in[0], in[1], in[2], in[3], in[4]); },
        {x, wg, wu, wd, P({N, C})});
  check("mlp_swiglu, gate and up side by side, with residual, keeping its product",
        [](const vector<Tensor>& in) { return mlp_swiglu(in[0], in[1], in[2], in[3], in[4], true); },
        {x, wg, wu, wd, P({N, C})});
  // against separate weights (linear_many + rope, two GEMMs), values and gradients, with the
  // joined weights' gradients side by side too (one GEMM for all parts)
  Tensor gbuf = Tensor::zeros({R + 2 * I, C}, DType::F64);
  int64_t r0 = 0;
  for (Tensor* w : {&wq, &wk, &wv, &wg, &wu}) {
    w->set_grad(gbuf.narrow(0, r0, w->size(0)));
    r0 += w->size(0);
  }
  vector<Tensor> sep;
  for (const Tensor& w : {wq, wk, wv, wg, wu}) sep.push_back(w.clone().requires_grad_());
  Tensor x2 = x.clone().requires_grad_();
  x.set_grad(Tensor());
  Tensor joined = add(attn_in({x, wq, wk, wv}), sum(mlp({x, wg, wu, wd})));
  backward(joined);  // (one tape at a time)
  Tensor apart = add(attn_in({x2, sep[0], sep[1], sep[2]}), sum(mlp({x2, sep[3], sep[4], wd.clone().requires_grad_()})));
  backward(apart);
  CHECK(std::abs(joined.item() - apart.item()) <= 1e-12 * (1 + std::abs(apart.item())));
  auto close = [](const Tensor& a, const Tensor& b, const char* what) {
    auto va = a.to_vector<double>(), vb = b.to_vector<double>();
    REQUIRE(va.size() == vb.size());
    double worst = 0;
    for (size_t i = 0; i < va.size(); i++) worst = std::max(worst, std::abs(va[i] - vb[i]) / (1 + std::abs(vb[i])));
    INFO(what);
    CHECK(worst <= 1e-12);
  };
  close(x.grad(), x2.grad(), "dx");
  const char* names[] = {"dWq", "dWk", "dWv", "dWgate", "dWup"};
  int i = 0;
  r0 = 0;
  for (const Tensor& w : {wq, wk, wv, wg, wu}) {
    // the gradient landed in the shared buffer (one GEMM), not in a copy
    close(gbuf.narrow(0, r0, w.size(0)), sep[size_t(i)].grad(), names[i]);
    r0 += w.size(0);
    i++;
  }
  CHECK(tape_size() == 0);
}
