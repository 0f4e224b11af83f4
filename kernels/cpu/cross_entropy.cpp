// cross_entropy.cpp: CPU reference of mean cross-entropy with ignored targets, and of the
// fused linear + cross-entropy that never materializes the [N, V] logits.
//
// Shape legend: N rows (tokens), V vocab, D model dim, chunk rows per fused step.
//
//   logits, dlogits [N, V]   targets [N] (int32; < 0 ignored, >= V an error)   lse [N]
//   h, dh [N, D]             W, dW [V, D]                 workspace [chunk, V] (fused only)
//
// Forward, over the `count` rows with target y_n >= 0:
//   lse_n  = log sum_v exp(x_nv)           (saved for every row, A precision)
//   loss   = (1/count) sum_n (lse_n - x_n,y_n)            (0 when count == 0)
// Backward:
//   dx_nv  = dloss/count * (softmax(x_n)_v - [v == y_n])   (=; ignored rows get 0)
//
// Fused linear + cross-entropy: logits = h W^T, one chunk of rows at a time:
//   x_c     = h_c W^T                      into the workspace (matmul.cpp's gemm, threads split)
//   loss   += sum over valid rows of (lse - x_y)
//   dx_c    = (softmax(x_c) - onehot) / count              written over x_c in place
//   dh_c    = dx_c W                       (=)
//   dW     += dx_c^T h_c                   (dW is `=` for the call: zeroed first)
// The extra memory is chunk * V elements instead of N * V; the count of valid rows is taken
// before the loop so every chunk is scaled by the final 1/count.
//
// The per-row work (log-sum-exp over V) runs in parallel; the sums over rows are added in a
// fixed order, so the loss is the same for any thread count.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/vec_exp.h"
#include "kernels/kernels.h"

namespace loom::cpu {
namespace {

// Number of rows whose target counts; throws on a target >= V (naming the row and the value).
int64_t count_valid_targets(const char* op, const int32_t* targets, int64_t N, int V) {
  int64_t count = 0;
  for (int64_t n = 0; n < N; n++) {
    if (targets[n] >= V)
      throw std::invalid_argument(std::string(op) + ": target " + std::to_string(targets[n]) +
                                  " at row " + std::to_string(n) + " is out of range for vocab V=" +
                                  std::to_string(V));
    if (targets[n] >= 0) count++;
  }
  return count;
}

// log sum_v exp(x_v) of one row, shifted by the row max so that exp never overflows.
template <class T>
acc_t<T> row_logsumexp(const T* x, int V) {
  using A = acc_t<T>;
  A m = A(x[0]);
  for (int j = 1; j < V; j++) m = std::max(m, A(x[j]));
  A sum = 0;
  for (int j = 0; j < V; j++) sum += exp_acc(A(x[j]) - m);
  return m + std::log(sum);
}

// dx_v = g * (exp(x_v - lse) - [v == y]) for one row of a valid target (g = dloss / count).
template <class T>
void row_softmax_grad(T* dx, const T* x, acc_t<T> lse, int32_t y, acc_t<T> g, int V) {
  using A = acc_t<T>;
  for (int j = 0; j < V; j++) dx[j] = T(g * (exp_acc(A(x[j]) - lse) - A(j == y)));
}

}  // namespace

template <class T>
void cross_entropy_forward(acc_t<T>* loss, acc_t<T>* lse, const T* logits, const int32_t* targets,
                           int64_t N, int V, Stream) {
  using A = acc_t<T>;
  if (V <= 0) throw std::invalid_argument("cross_entropy_forward: expected V > 0, got " + std::to_string(V));
  const int64_t count = count_valid_targets("cross_entropy_forward", targets, N, V);

  parallel_for(N, [&](int64_t n) { lse[n] = row_logsumexp(logits + n * V, V); });

  A sum = 0;  // in row order: deterministic
  for (int64_t n = 0; n < N; n++)
    if (targets[n] >= 0) sum += lse[n] - A(logits[n * V + targets[n]]);
  loss[0] = count > 0 ? sum / A(count) : A(0);
}

template <class T>
void cross_entropy_backward(T* dlogits, const acc_t<T>* dloss, const T* logits, const acc_t<T>* lse,
                            const int32_t* targets, int64_t N, int V, Stream) {
  using A = acc_t<T>;
  const int64_t count = count_valid_targets("cross_entropy_backward", targets, N, V);
  const A g = count > 0 ? dloss[0] / A(count) : A(0);

  parallel_for(N, [&](int64_t n) {
    if (targets[n] < 0) {
      std::fill(dlogits + n * V, dlogits + (n + 1) * V, T(0));
    } else {
      row_softmax_grad(dlogits + n * V, logits + n * V, lse[n], targets[n], g, V);
    }
  });
}

template <class T>
void fused_linear_cross_entropy(acc_t<T>* loss, T* dh, T* dW, const T* h, const T* W,
                                const int32_t* targets, int64_t N, int V, int D, int64_t chunk,
                                acc_t<T>* workspace, const acc_t<T>* grad_scale, Stream s) {
  using A = acc_t<T>;
  static_assert(std::is_same<T, A>::value, "the CPU reference computes in T = acc_t<T>");
  if (V <= 0 || D <= 0 || chunk <= 0)
    throw std::invalid_argument("fused_linear_cross_entropy: expected V, D, chunk > 0, got V=" +
                                std::to_string(V) + " D=" + std::to_string(D) + " chunk=" +
                                std::to_string(chunk));
  const int64_t count = count_valid_targets("fused_linear_cross_entropy", targets, N, V);
  const A inv_count = count > 0 ? A(1) / A(count) : A(0);  // ignored rows and count 0 give 0
  const A grad_mul = grad_scale ? inv_count * grad_scale[0] : inv_count;  // dlogits for dloss = *grad_scale

  std::fill(dW, dW + int64_t(V) * D, T(0));
  A sum = 0;

  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int rows = int(std::min(chunk, N - r0));
    const T* h_c = h + r0 * D;
    A* x_c = workspace;  // [rows, V]: logits, then dlogits in place
    gemm(x_c, h_c, W, rows, V, D, false, true, 1.0, 0.0, 1, 0, 0, 0, s);  // x_c = h_c W^T

    // Loss of each row, then its gradient over the same row of the workspace. The rows are
    // cut into a fixed number of blocks whose partial sums are added in order: the loss does
    // not depend on the thread count (a sum in finishing order would not).
    constexpr int kBlocks = 64;
    A partial[kBlocks] = {};
    parallel_for(kBlocks, [&](int64_t b) {
      for (int64_t r = rows * b / kBlocks; r < rows * (b + 1) / kBlocks; r++) {
        A* x = workspace + r * V;
        const int32_t y = targets[r0 + r];
        if (y < 0) {
          std::fill(x, x + V, A(0));
          continue;
        }
        const A lse = row_logsumexp(x, V);
        partial[b] += lse - x[y];
        row_softmax_grad(x, x, lse, y, grad_mul, V);  // elementwise, so in place is safe
      }
    });
    for (int b = 0; b < kBlocks; b++) sum += partial[b];

    gemm(dh + r0 * D, x_c, W, rows, D, V, false, false, 1.0, 0.0, 1, 0, 0, 0, s);  // dh_c = dx_c W    [rows, D]
    gemm(dW, x_c, h_c, V, D, rows, true, false, 1.0, 1.0, 1, 0, 0, 0, s);          // dW  += dx_c^T h_c [V, D]
  }
  loss[0] = sum * inv_count;
}

#define LOOM_INSTANTIATE(T)                                                                       \
  template void cross_entropy_forward<T>(acc_t<T>*, acc_t<T>*, const T*, const int32_t*, int64_t,  \
                                         int, Stream);                                            \
  template void cross_entropy_backward<T>(T*, const acc_t<T>*, const T*, const acc_t<T>*,          \
                                          const int32_t*, int64_t, int, Stream);                  \
  template void fused_linear_cross_entropy<T>(acc_t<T>*, T*, T*, const T*, const T*,               \
                                              const int32_t*, int64_t, int, int, int64_t,          \
                                              acc_t<T>*, const acc_t<T>*, Stream);
LOOM_INSTANTIATE(float)
LOOM_INSTANTIATE(double)
#undef LOOM_INSTANTIATE

}  // namespace loom::cpu
