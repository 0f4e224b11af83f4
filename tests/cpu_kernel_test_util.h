// cpu_kernel_test_util.h: what the CPU kernel tests (tests/test_cpu_<family>.cpp) share:
// seeded random inputs, NaN-poisoned outputs, central differences in double, layouts.
//
// Every forward is checked against a naive formula written in the test independently (long
// double where rounding could matter) or, for data movement, exactly; every backward against
// central differences of its forward in double (loss = sum(out * R) for a fixed random R,
// eps 1e-6, tol::kGradcheckF64). `+=` outputs are prefilled with random values and the
// prefill is subtracted before comparing, so an `=` where `+=` was due fails. Outputs are
// poisoned with NaN before each call, so an element a kernel forgets to write fails. The
// float instantiations are checked against the double ones (tol::kCpuF32).
// For test files only (it opens namespace loom and std::vector to them).
#pragma once
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

inline std::mt19937_64& rng() {
  static std::mt19937_64 gen(20240611);
  return gen;
}

inline vector<double> uniform(int64_t n, double lo = -1.0, double hi = 1.0) {
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
inline vector<double> numeric_grad(vector<double>& x, const vector<double>& R,
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
inline vector<double> minus(const vector<double>& a, const vector<double>& b) {
  vector<double> d(a.size());
  for (size_t i = 0; i < a.size(); i++) d[i] = a[i] - b[i];
  return d;
}

// naive row-major multi-index walk: offset of element `linear` of a layout
inline int64_t naive_offset(const Layout& l, int64_t linear) {
  vector<int64_t> idx(sz(l.ndim));
  for (int d = l.ndim - 1; d >= 0; d--) {
    idx[d] = linear % l.shape[d];
    linear /= l.shape[d];
  }
  int64_t off = 0;
  for (int d = 0; d < l.ndim; d++) off += idx[d] * l.stride[d];
  return off;
}

inline Layout make_layout(std::initializer_list<int64_t> shape, std::initializer_list<int64_t> stride) {
  Layout l;
  l.ndim = int(shape.size());
  int d = 0;
  for (int64_t x : shape) l.shape[d++] = x;
  d = 0;
  for (int64_t x : stride) l.stride[d++] = x;
  return l;
}

struct NC { int64_t N; int C; };  // a [N, C] shape

template <class T> double to_d(T x) { return double(x); }
template <> double to_d<bf16>(bf16 x) { return double(float(x)); }
template <class T> T from_d(double x) { return T(x); }
template <> bf16 from_d<bf16>(double x) { return bf16(float(x)); }

}  // namespace
