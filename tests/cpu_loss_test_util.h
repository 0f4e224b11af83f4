// cpu_loss_test_util.h: what the CPU tests of attention, the losses and the optimizer kernels
// share (tests/test_cpu_{attention,cross_entropy,contrastive,optim}.cpp).
//
// Every reference in those tests is the plainest possible version of the math: materialized
// masks and score matrices, explicit normalize / log-softmax, torch's optimizer formulas.
// Inputs are fresh seeded random numbers; outputs are poisoned with NaN before each call.
// For test files only (it opens namespace loom and std::vector to them).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "tests/tolerances.h"

using namespace loom;
using std::vector;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();
const Stream s0 = nullptr;

inline vector<double> randn(size_t n, uint64_t seed, double scale = 1.0) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> d(0.0, scale);
  vector<double> x(n);
  for (auto& e : x) e = d(gen);
  return x;
}

template <class T> vector<T> cast(const vector<double>& x) { return vector<T>(x.begin(), x.end()); }
template <class T> vector<T> poisoned(size_t n) { return vector<T>(n, T(kNaN)); }

// Central differences of a scalar function f with respect to every element of x.
// With stride > 1 only every stride-th element is differentiated (the others are left 0).
inline vector<double> numeric_grad(const std::function<double()>& f, vector<double>& x, double eps = 1e-6,
                            size_t stride = 1) {
  vector<double> g(x.size(), 0.0);
  for (size_t i = 0; i < x.size(); i += stride) {
    const double keep = x[i];
    x[i] = keep + eps;
    const double up = f();
    x[i] = keep - eps;
    const double down = f();
    x[i] = keep;
    g[i] = (up - down) / (2 * eps);
  }
  return g;
}

// The compute copy must be the master exactly (same type here: no rounding allowed).
template <class T>
inline void check_same(const vector<T>& got, const vector<T>& ref, const std::string& what) {
  REQUIRE(got.size() == ref.size());
  for (size_t i = 0; i < got.size(); i++) {
    INFO(what << "[" << i << "]: got " << got[i] << " expected " << ref[i]);
    REQUIRE(got[i] == ref[i]);
  }
}

}  // namespace
