// matmul.cpp: the CPU reference of the matrix products, on Eigen's GEMM.
//
// Shape legend: M, N, K the GEMM sizes (op(A) [M,K], op(B) [K,N], C [M,N]); N rows (tokens),
// I input features, O output features.
//   gemm             C[b] = alpha op(A[b]) op(B[b]) + beta C[b]          (row-major, batched)
//   linear_forward   out[N,O] = inp[N,I] weight[O,I]^T + bias[O]
//   linear_forward_add  out[N,O] = resid[N,O] + inp weight^T + bias[O]   (a residual block's add)
//   linear_backward  dinp[N,I] = dout[N,O] weight[O,I]            (=)
//   linear_gelu_forward / linear_dgelu_backward: the same products with the GELU of
//                    activations.cpp applied after (see kernels.inc); linear_swiglu_forward /
//                    linear_swiglu_backward likewise with the joined SwiGLU
//                    dweight[O,I] += dout^T inp                     (+=)
//                    dbias[O] += sum over rows of dout              (+=)
// Nothing is saved: linear's backward needs the forward's input, which the caller keeps.
//
// Eigen::Map views the row-major buffers without copying; `.noalias()` tells Eigen the
// destination does not overlap the operands, so the product is written straight into it
// instead of through a temporary. Eigen's GEMM is blocked for the cache.
//
// Threads: we split each product ourselves, one slab of C per thread of kernels/cpu/parallel.h
// (rows of C when C is tall, columns when it is wide), and Eigen runs single-threaded inside a
// slab (the library is built without OpenMP, so Eigen has no threads of its own). Eigen's own
// OpenMP split is tuned for large square products; on the skinny ones of a small model (2048
// tokens x 96 features x 256) it gave no speedup on 2 cores, and its spinning worker slowed
// the serial code between products (2026-11-23, 2-core KVM guest: a vlm_sft.cfg step 176 ms
// with Eigen's split, 105-125 ms with `split_product` below).
#include <Eigen/Core>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "kernels/kernels.h"

namespace loom::cpu {
namespace {

template <class T> using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T> using MapMat = Eigen::Map<RowMat<T>>;
template <class T> using CMapMat = Eigen::Map<const RowMat<T>>;
template <class T> using CMapRow = Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>;
template <class T> using MapRow = Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>>;

// C = alpha opA opB + beta C for one batch item. beta == 0 assigns, so whatever C held
// (NaN garbage from an uninitialized buffer) never reaches the result: 0 * NaN is NaN.
template <class T, class Dst, class OpA, class OpB>
void gemm_one(Dst&& C, const OpA& opA, const OpB& opB, T alpha, T beta) {
  if (beta == T(0)) {
    C.noalias() = alpha * (opA * opB);
  } else {
    if (beta != T(1)) C *= beta;
    C.noalias() += alpha * (opA * opB);
  }
}

// Below this many multiply-adds a product runs on one thread: a parallel region costs a few
// microseconds, about what 2 cores gain on 64^3.
constexpr int64_t kSplitMin = int64_t(1) << 18;

// C = alpha opA opB + beta C, C [M,N], split into one slab per thread: row slabs (C's rows
// with opA's rows) when M >= N, else column slabs (C's columns with opB's columns). Each
// element of C comes from one Eigen product over the whole K, so thread counts change only
// how Eigen blocks a slab (the summation order, within f32 rounding). Inside a parallel region
// (the batched gemm) it runs serially.
template <class T, class OpA, class OpB>
void split_product(MapMat<T> C, const OpA& opA, const OpB& opB, T alpha, T beta) {
  const int64_t M = C.rows(), N = C.cols(), K = opA.cols();
  const int threads = in_parallel() ? 1 : num_threads();
  if (threads == 1 || M * N * K < kSplitMin) {
    gemm_one(C, opA, opB, alpha, beta);
    return;
  }
  const bool by_rows = M >= N;
  const int64_t len = by_rows ? M : N;
  const int parts = int(std::min<int64_t>(threads, std::max<int64_t>(1, len / 16)));
  parallel_for_each(parts, [&](int64_t t) {
    const int64_t lo = len * t / parts, n = len * (t + 1) / parts - lo;
    if (by_rows) gemm_one(C.middleRows(lo, n), opA.middleRows(lo, n), opB, alpha, beta);
    else gemm_one(C.middleCols(lo, n), opA, opB.middleCols(lo, n), alpha, beta);
  });
}

}  // namespace

template <class T>
void gemm(T* C, const T* A, const T* B, int M, int N, int K, bool transA, bool transB,
          double alpha, double beta, int batch, int64_t strideA, int64_t strideB,
          int64_t strideC, Stream) {
  if (M < 0 || N < 0 || K < 0 || batch < 0)
    throw std::invalid_argument("gemm: expected non-negative sizes, got M=" + std::to_string(M) +
                                " N=" + std::to_string(N) + " K=" + std::to_string(K) +
                                " batch=" + std::to_string(batch));
  const T al = T(alpha), be = T(beta);
  // Stored shapes: A is [M,K] or, transposed, [K,M]; B is [K,N] or [N,K].
  const int a_rows = transA ? K : M, a_cols = transA ? M : K;
  const int b_rows = transB ? N : K, b_cols = transB ? K : N;
  // Several batch items: one thread per item (each product then runs on that thread alone).
  // One item: split_product cuts it into one slab per thread.
  const bool by_batch = batch > 1 && int64_t(batch) * M * N * K > 32768;
  parallel_for(batch, [&](int64_t b) {
    CMapMat<T> a(A + b * strideA, a_rows, a_cols);
    CMapMat<T> bm(B + b * strideB, b_rows, b_cols);
    MapMat<T> c(C + b * strideC, M, N);
    if (!transA && !transB) split_product(c, a, bm, al, be);
    else if (transA && !transB) split_product(c, a.transpose(), bm, al, be);
    else if (!transA && transB) split_product(c, a, bm.transpose(), al, be);
    else split_product(c, a.transpose(), bm.transpose(), al, be);
  }, by_batch);
}

template <class T>
void linear_forward(T* out, const T* inp, const T* weight, const T* bias, int64_t N, int I,
                    int O, Stream) {
  CMapMat<T> x(inp, N, I), w(weight, O, I);
  MapMat<T> y(out, N, O);
  split_product(y, x, w.transpose(), T(1), T(0));
  if (bias) y.rowwise() += CMapRow<T>(bias, O);
}

template <class T>
void linear_forward_add(T* out, const T* inp, const T* weight, const T* bias, const T* resid, int64_t N, int I,
                        int O, Stream) {
  CMapMat<T> x(inp, N, I), w(weight, O, I);
  MapMat<T> y(out, N, O);
  if (out != resid) y = CMapMat<T>(resid, N, O);
  split_product(y, x, w.transpose(), T(1), T(1));
  if (bias) y.rowwise() += CMapRow<T>(bias, O);
}

template <class T>
void linear_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp,
                     const T* weight, int64_t N, int I, int O, Stream) {
  CMapMat<T> dy(dout, N, O);
  if (dinp) split_product(MapMat<T>(dinp, N, I), dy, CMapMat<T>(weight, O, I), T(1), T(0));
  if (dweight) split_product(MapMat<T>(dweight, O, I), dy.transpose(), CMapMat<T>(inp, N, I), T(1), T(1));
  if (dbias) {
    MapRow<T> db(dbias, O);
    db += dy.colwise().sum();
  }
}

template <class T>
void linear_forward_batched(T* out, const T* inp, const T* weight, const T* bias, int64_t N, int I, int O, int batch,
                            Stream s) {
  for (int b = 0; b < batch; b++)
    linear_forward(out + b * N * O, inp, weight + int64_t(b) * O * I, bias ? bias + int64_t(b) * O : nullptr, N, I, O, s);
}

template <class T>
void linear_gelu_forward(T* out, T* pre, const T* inp, const T* weight, const T* bias, int64_t N, int I, int O,
                         Stream s) {
  // pre null (no backward follows): the product goes to out and the GELU runs there in place;
  // the same roundings as through pre
  T* p = pre ? pre : out;
  linear_forward(p, inp, weight, bias, N, I, O, s);
  gelu_forward(out, p, N * O, s);
}

template <class T>
void linear_swiglu_forward(T* gu, T* h, const T* inp, const T* wgu, int64_t N, int C, int I, Stream s) {
  linear_forward(gu, inp, wgu, (const T*)nullptr, N, C, 2 * I, s);
  swiglu_forward_joined(h, gu, N, I, s);
}

template <class T>
void linear_swiglu_backward(T* dgu, T* prod, const T* dout, const T* wd, const T* gu, int64_t N, int C2, int I,
                            Stream s) {
  std::vector<T> dh(size_t(N) * I);
  linear_backward(dh.data(), (T*)nullptr, (T*)nullptr, dout, (const T*)nullptr, wd, N, I, C2, s);
  swiglu_backward_joined(dgu, prod, dh.data(), gu, N, I, s);
}

template <class T>
void linear_dgelu_backward(T* dpre, T* dbias, const T* dout, const T* weight, const T* pre, int64_t N, int I, int O,
                           Stream s) {
  linear_backward(dpre, (T*)nullptr, (T*)nullptr, dout, (const T*)nullptr, weight, N, I, O, s);  // dout @ W
  gelu_backward(dpre, dpre, pre, N * I, s);  // elementwise: in place is the same math
  if (dbias) {
    MapRow<T> db(dbias, I);
    db += CMapMat<T>(dpre, N, I).colwise().sum();
  }
}

#define LOOM_MATMUL(T)                                                                        \
  template void gemm<T>(T*, const T*, const T*, int, int, int, bool, bool, double, double, int, \
                        int64_t, int64_t, int64_t, Stream);                                   \
  template void linear_forward<T>(T*, const T*, const T*, const T*, int64_t, int, int, Stream); \
  template void linear_forward_add<T>(T*, const T*, const T*, const T*, const T*, int64_t, int, int, Stream); \
  template void linear_backward<T>(T*, T*, T*, const T*, const T*, const T*, int64_t, int, int, \
                                   Stream);                                                   \
  template void linear_forward_batched<T>(T*, const T*, const T*, const T*, int64_t, int, int, int, Stream); \
  template void linear_gelu_forward<T>(T*, T*, const T*, const T*, const T*, int64_t, int, int, Stream); \
  template void linear_dgelu_backward<T>(T*, T*, const T*, const T*, const T*, int64_t, int, int, Stream); \
  template void linear_swiglu_forward<T>(T*, T*, const T*, const T*, int64_t, int, int, Stream); \
  template void linear_swiglu_backward<T>(T*, T*, const T*, const T*, const T*, int64_t, int, int, Stream);
LOOM_MATMUL(float)
LOOM_MATMUL(double)
#undef LOOM_MATMUL

}  // namespace loom::cpu
