// memory.cpp: the CPU reference of the memory and elementwise ops.
//
// Shape legend: n elements; a Layout is up to 8 dims with strides in elements.
//   fill           out[n] = value
//   convert        out[n] = To(in[n])          (bf16 goes through float; float -> int truncates)
//   copy_strided   out[shape] = in read through in_layout's strides (out contiguous)
//   binary         out[shape] = a op b, a and b read through broadcast strides (0 = broadcast)
//   unary          out[n] = f(in[n])
//   axpby          out[n] = alpha a + beta b   (b nullable)
//   axpy_dev       y[n] += alpha * x (accumulate) or y[n] = alpha * x, alpha read from memory
//                  (a device scalar on CUDA)
//   reduce_sum_to  out = sum of in over the dims where out_bcast.stride is 0
//   sum_all        out[1] = sum(in[n]) in A precision
//
// Strided walks split the index space into "rows" (every dim but the last) and an inner loop
// over the last dim, so the hot loop is a plain strided loop and a row's start offset is
// computed once. parallel_for (kernels/cpu/parallel.h) runs over rows when the work is large.
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/cpu/parallel.h"
#include "kernels/kernels.h"

namespace loom::cpu {
namespace {

constexpr int64_t kParallelMin = 32768;  // below this many elements threads cost more than they save

// Scalar conversion that knows about bf16 (which only converts to and from float).
// Storage conversion; the 16-bit float types (bf16, f16) go through float both ways.
template <class T> constexpr bool kHalf = std::is_same_v<T, bf16> || std::is_same_v<T, f16>;
template <class To, class From> inline To cast(From x) {
  if constexpr (std::is_same_v<To, From>) return x;
  else if constexpr (kHalf<From>) return cast<To>(float(x));
  else if constexpr (kHalf<To>) return To(float(x));
  else return static_cast<To>(x);
}

void check_layout(const Layout& l, const char* op) {
  if (l.ndim < 0 || l.ndim > Layout::kMaxDims)
    throw std::invalid_argument(std::string(op) + ": layout has " + std::to_string(l.ndim) +
                                " dims, expected 0.." + std::to_string(Layout::kMaxDims));
}

// Element offset, through `l`'s strides, of the start of row `row`, where rows enumerate the
// first ndim-1 dims in row-major order.
inline int64_t row_offset(const Layout& l, int64_t row) {
  int64_t off = 0;
  for (int d = l.ndim - 2; d >= 0; d--) {
    off += (row % l.shape[d]) * l.stride[d];
    row /= l.shape[d];
  }
  return off;
}

// Rows and row length of a layout's index space (a 0-dim layout is one element).
inline void rows_and_len(const Layout& l, int64_t* rows, int64_t* len) {
  *len = l.ndim == 0 ? 1 : l.shape[l.ndim - 1];
  *rows = *len == 0 ? 0 : l.numel() / *len;
}

inline int64_t last_stride(const Layout& l) { return l.ndim == 0 ? 0 : l.stride[l.ndim - 1]; }

template <class T, class F>
void binary_rows(T* out, const T* a, const Layout& la, const T* b, const Layout& lb, F f) {
  int64_t rows, len;
  rows_and_len(la, &rows, &len);
  const int64_t sa = last_stride(la), sb = last_stride(lb);
  parallel_for(rows, [&](int64_t r) {
    const T* ar = a + row_offset(la, r);
    const T* br = b + row_offset(lb, r);
    T* o = out + r * len;
    for (int64_t i = 0; i < len; i++) o[i] = f(ar[i * sa], br[i * sb]);
  }, rows * len > kParallelMin);
}

template <class T, class F> void unary_map(T* out, const T* in, int64_t n, F f) {
  parallel_for(n, [&](int64_t i) { out[i] = f(in[i]); }, n > kParallelMin);
}

}  // namespace

template <class T> void fill(T* out, double value, int64_t n, Stream) {
  const T v = cast<T>(value);
  parallel_for(n, [&](int64_t i) { out[i] = v; }, n > kParallelMin);
}

template <class To, class From> void convert(To* out, const From* in, int64_t n, Stream) {
  parallel_for(n, [&](int64_t i) { out[i] = cast<To>(in[i]); }, n > kParallelMin);
}

template <class T> void copy_strided(T* out, const T* in, Layout in_layout, Stream) {
  check_layout(in_layout, "copy_strided");
  int64_t rows, len;
  rows_and_len(in_layout, &rows, &len);
  const int64_t s = last_stride(in_layout);
  parallel_for(rows, [&](int64_t r) {
    const T* src = in + row_offset(in_layout, r);
    T* dst = out + r * len;
    for (int64_t i = 0; i < len; i++) dst[i] = src[i * s];
  }, rows * len > kParallelMin);
}

template <class T>
void binary(T* out, const T* a, Layout la, const T* b, Layout lb, BinaryOp op, Stream) {
  check_layout(la, "binary");
  check_layout(lb, "binary");
  if (la.ndim != lb.ndim)
    throw std::invalid_argument("binary: a has " + std::to_string(la.ndim) + " dims, b has " +
                                std::to_string(lb.ndim));
  for (int d = 0; d < la.ndim; d++)
    if (la.shape[d] != lb.shape[d])
      throw std::invalid_argument("binary: broadcast shapes differ at dim " + std::to_string(d) +
                                  ": " + std::to_string(la.shape[d]) + " vs " +
                                  std::to_string(lb.shape[d]));
  switch (op) {
    case BinaryOp::Add: binary_rows(out, a, la, b, lb, [](T x, T y) { return x + y; }); break;
    case BinaryOp::Sub: binary_rows(out, a, la, b, lb, [](T x, T y) { return x - y; }); break;
    case BinaryOp::Mul: binary_rows(out, a, la, b, lb, [](T x, T y) { return x * y; }); break;
    case BinaryOp::Div: binary_rows(out, a, la, b, lb, [](T x, T y) { return x / y; }); break;
  }
}

template <class T> void unary(T* out, const T* in, UnaryOp op, int64_t n, Stream) {
  switch (op) {
    case UnaryOp::Neg: unary_map(out, in, n, [](T x) { return -x; }); break;
    case UnaryOp::Exp: unary_map(out, in, n, [](T x) { return std::exp(x); }); break;
    case UnaryOp::Log: unary_map(out, in, n, [](T x) { return std::log(x); }); break;
    case UnaryOp::Sqrt: unary_map(out, in, n, [](T x) { return std::sqrt(x); }); break;
    case UnaryOp::Square: unary_map(out, in, n, [](T x) { return x * x; }); break;
    case UnaryOp::Abs: unary_map(out, in, n, [](T x) { return std::fabs(x); }); break;
  }
}

template <class T>
void axpby(T* out, const T* a, double alpha, const T* b, double beta, int64_t n, Stream) {
  using A = acc_t<T>;
  const A al = A(alpha), be = A(beta);
  if (b == nullptr) {
    parallel_for(n, [&](int64_t i) { out[i] = T(al * A(a[i])); }, n > kParallelMin);
  } else {
    parallel_for(n, [&](int64_t i) { out[i] = T(al * A(a[i]) + be * A(b[i])); }, n > kParallelMin);
  }
}

template <class T> void axpy_dev(T* y, const acc_t<T>* alpha_dev, const T* x, int64_t n, bool accumulate, Stream) {
  using A = acc_t<T>;
  const A alpha = *alpha_dev;  // on the CPU the "device" scalar is host memory
  parallel_for(n, [&](int64_t i) {
    y[i] = T((accumulate ? A(y[i]) : A(0)) + alpha * A(x[i]));
  }, n > kParallelMin);
}

// Serial on purpose: threads over rows would race on `out` wherever a reduced dim is not the
// last one, and per-thread copies of `out` cost more than this pass (bias gradients have their
// own fused reduction in linear_backward). The walk follows `in` row by row, so reads stream.
template <class T> void reduce_sum_to(T* out, Layout out_bcast, const T* in, Layout in_layout, Stream) {
  check_layout(out_bcast, "reduce_sum_to");
  check_layout(in_layout, "reduce_sum_to");
  if (out_bcast.ndim != in_layout.ndim)
    throw std::invalid_argument("reduce_sum_to: out has " + std::to_string(out_bcast.ndim) +
                                " dims, in has " + std::to_string(in_layout.ndim));
  // out is contiguous: its size is one past the largest offset its broadcast strides reach.
  int64_t out_n = 1;
  for (int d = 0; d < out_bcast.ndim; d++) {
    if (out_bcast.shape[d] != in_layout.shape[d])
      throw std::invalid_argument("reduce_sum_to: shapes differ at dim " + std::to_string(d));
    if (out_bcast.shape[d] == 0) out_n = 0;
    else out_n += (out_bcast.shape[d] - 1) * out_bcast.stride[d];
  }
  for (int64_t i = 0; i < out_n; i++) out[i] = T(0);
  int64_t rows, len;
  rows_and_len(in_layout, &rows, &len);
  const int64_t si = last_stride(in_layout), so = last_stride(out_bcast);
  for (int64_t r = 0; r < rows; r++) {
    const T* src = in + row_offset(in_layout, r);
    T* dst = out + row_offset(out_bcast, r);
    if (so == 0) {  // the last dim is reduced: a row collapses to one element
      T row_sum = T(0);
      for (int64_t i = 0; i < len; i++) row_sum += src[i * si];
      dst[0] += row_sum;
    } else {
      for (int64_t i = 0; i < len; i++) dst[i * so] += src[i * si];
    }
  }
}

// Blocked summation: partial sums of kBlock terms are added to the total, so the rounding
// error grows like (n / kBlock + kBlock) ulps instead of n ulps, with no extra memory.
template <class T> void sum_all(acc_t<T>* out, const T* in, int64_t n, Stream) {
  using A = acc_t<T>;
  constexpr int64_t kBlock = 1024;
  A total = 0;
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t end = start + kBlock < n ? start + kBlock : n;
    A block_sum = 0;
    for (int64_t i = start; i < end; i++) block_sum += A(in[i]);
    total += block_sum;
  }
  out[0] = total;
}

// ------------------------------------------------------------------ instantiations
#define LOOM_FILL(T) template void fill<T>(T*, double, int64_t, Stream);
LOOM_FILL(float)
LOOM_FILL(double)
LOOM_FILL(bf16)
LOOM_FILL(f16)
LOOM_FILL(int32_t)
LOOM_FILL(int64_t)
#undef LOOM_FILL

#define LOOM_CONVERT(To, From) template void convert<To, From>(To*, const From*, int64_t, Stream);
#define LOOM_CONVERT_FROM(From) \
  LOOM_CONVERT(float, From)     \
  LOOM_CONVERT(double, From)    \
  LOOM_CONVERT(bf16, From)      \
  LOOM_CONVERT(f16, From)       \
  LOOM_CONVERT(int32_t, From)   \
  LOOM_CONVERT(int64_t, From)
LOOM_CONVERT_FROM(float)
LOOM_CONVERT_FROM(double)
LOOM_CONVERT_FROM(bf16)
LOOM_CONVERT_FROM(f16)
LOOM_CONVERT_FROM(int32_t)
LOOM_CONVERT_FROM(int64_t)
LOOM_CONVERT_FROM(uint8_t)
#undef LOOM_CONVERT_FROM
#undef LOOM_CONVERT

#define LOOM_COPY(T) template void copy_strided<T>(T*, const T*, Layout, Stream);
LOOM_COPY(float)
LOOM_COPY(double)
LOOM_COPY(bf16)
LOOM_COPY(f16)
LOOM_COPY(int32_t)
LOOM_COPY(int64_t)
LOOM_COPY(uint8_t)
#undef LOOM_COPY

#define LOOM_FLOAT_OPS(T)                                                                   \
  template void binary<T>(T*, const T*, Layout, const T*, Layout, BinaryOp, Stream);      \
  template void unary<T>(T*, const T*, UnaryOp, int64_t, Stream);                          \
  template void axpby<T>(T*, const T*, double, const T*, double, int64_t, Stream);         \
  template void axpy_dev<T>(T*, const acc_t<T>*, const T*, int64_t, bool, Stream);         \
  template void reduce_sum_to<T>(T*, Layout, const T*, Layout, Stream);                    \
  template void sum_all<T>(acc_t<T>*, const T*, int64_t, Stream);
LOOM_FLOAT_OPS(float)
LOOM_FLOAT_OPS(double)
#undef LOOM_FLOAT_OPS

}  // namespace loom::cpu
