// norms.cpp: the CPU reference of LayerNorm and RMSNorm, forward and backward.
//
// Shape legend: N rows (tokens), C channels. inp/out/dout/dinp [N,C], weight/bias [C],
// mean/rstd [N] in A = acc_t<T> (float for float, double for double).
//
// LayerNorm (per row x of C values):
//   mean = sum(x) / C,  var = sum((x - mean)^2) / C,  rstd = 1 / sqrt(var + eps)
//   xhat = (x - mean) rstd,  out = xhat * weight + bias
// Backward, with g = dout * weight:
//   dinp = rstd (g - mean(g) - xhat mean(g xhat))                          (=)
//   dweight += sum over rows of dout xhat,  dbias += sum over rows of dout (+=)
// RMSNorm:
//   rstd = 1 / sqrt(sum(x^2) / C + eps),  out = x rstd weight
//   dinp = rstd (g - xhat mean(g xhat)) with xhat = x rstd                 (=)
//   dweight += sum over rows of dout xhat                                  (+=)
// Forward saves mean (LayerNorm only) and rstd; backward recomputes xhat from them.
// The residual variants also write resid_out = resid + x and normalize that; their backward
// is the plain backward plus the caller adding the gradient of resid_out.
//
// Threads: the forward and dinp run over rows. The parameter gradients are sums over rows: the
// rows are cut into splits (their count depends on N only), each summed into a partial row of
// its own, and the partial rows added in split order, as the CUDA kernels do (colsum.cuh): the
// same bits on every run and thread count. The rows' own sums (mean, var, mean(g xhat)) run in
// eight lanes (lane_sum.h), so that they vectorize.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cpu/lane_sum.h"
#include "kernels/cpu/parallel.h"
#include "kernels/kernels.h"

namespace loom::cpu {
namespace {

constexpr int64_t kParallelMin = 32768;  // elements; smaller problems stay on one thread
constexpr int64_t kSplitRows = 64;       // rows per split of the parameter-gradient pass,
constexpr int64_t kMaxSplits = 64;       // and at most this many splits

// LayerNorm of one row; returns nothing, writes out and (when given) mean/rstd.
template <class T>
inline void layernorm_row(T* out, acc_t<T>* mean_out, acc_t<T>* rstd_out, const T* x,
                          const T* weight, const T* bias, int C, double eps) {
  using A = acc_t<T>;
  const A mean = lane_sum<A>(C, [&](int c) { return A(x[c]); }) / A(C);
  // two passes: the one-pass E[x^2] - mean^2 cancels badly when |mean| >> std
  const A var = lane_sum<A>(C, [&](int c) { const A d = A(x[c]) - mean; return d * d; }) / A(C);
  const A rstd = A(1) / std::sqrt(var + A(eps));
  if (bias)
    for (int c = 0; c < C; c++) out[c] = T((A(x[c]) - mean) * rstd * A(weight[c]) + A(bias[c]));
  else
    for (int c = 0; c < C; c++) out[c] = T((A(x[c]) - mean) * rstd * A(weight[c]) + A(0));
  if (mean_out) *mean_out = mean;
  if (rstd_out) *rstd_out = rstd;
}

template <class T>
inline void rmsnorm_row(T* out, acc_t<T>* rstd_out, const T* x, const T* weight, int C, double eps) {
  using A = acc_t<T>;
  const A sumsq = lane_sum<A>(C, [&](int c) { return A(x[c]) * A(x[c]); });
  const A rstd = A(1) / std::sqrt(sumsq / A(C) + A(eps));
  for (int c = 0; c < C; c++) out[c] = T(A(x[c]) * rstd * A(weight[c]));
  if (rstd_out) *rstd_out = rstd;
}

// dweight[c] += sum_n dout[n,c] xhat[n,c] and dbias[c] += sum_n dout[n,c] (either nullable),
// xhat = (x - mean) rstd (mean null: RMSNorm, xhat = x rstd). The rows are cut into splits whose
// count depends on N only; each split sums its rows into a partial row of its own (the loop over
// the columns vectorizes), and the partial rows are added in split order.
template <class T>
void norm_param_grads(T* dweight, T* dbias, const T* dout, const T* inp, const acc_t<T>* mean,
                      const acc_t<T>* rstd, int64_t N, int C) {
  using A = acc_t<T>;
  if ((!dweight && !dbias) || N == 0) return;
  const int64_t splits = std::min<int64_t>(kMaxSplits, (N + kSplitRows - 1) / kSplitRows);
  std::vector<A> pw(dweight ? splits * C : 0), pb(dbias ? splits * C : 0);
  parallel_for_each(splits, [&](int64_t s) {
    A* w = dweight ? &pw[s * C] : nullptr;
    A* b = dbias ? &pb[s * C] : nullptr;
    for (int64_t n = N * s / splits; n < N * (s + 1) / splits; n++) {
      const T* x = inp + n * C;
      const T* dy = dout + n * C;
      const A mu = mean ? mean[n] : A(0), r = rstd[n];
      if (w)
        for (int c = 0; c < C; c++) w[c] += A(dy[c]) * ((A(x[c]) - mu) * r);
      if (b)
        for (int c = 0; c < C; c++) b[c] += A(dy[c]);
    }
  }, N * C > kParallelMin);
  auto finish = [&](T* out, const std::vector<A>& part) {
    if (!out) return;
    std::vector<A> sum(part.begin(), part.begin() + C);
    for (int64_t s = 1; s < splits; s++)
      for (int c = 0; c < C; c++) sum[c] += part[s * C + c];
    for (int c = 0; c < C; c++) out[c] = T(A(out[c]) + sum[c]);
  };
  finish(dweight, pw);
  finish(dbias, pb);
}

}  // namespace

template <class T>
void layernorm_forward(T* out, acc_t<T>* mean, acc_t<T>* rstd, const T* inp, const T* weight,
                       const T* bias, int64_t N, int C, double eps, Stream) {
  parallel_for(N, [&](int64_t n) {
    layernorm_row(out + n * C, mean ? mean + n : nullptr, rstd ? rstd + n : nullptr,
                  inp + n * C, weight, bias, C, eps);
  }, N * C > kParallelMin);
}

template <class T>
void layernorm_backward(T* dinp, const T* dresid, T* dweight, T* dbias, const T* dout, const T* inp,
                        const T* weight, const acc_t<T>* mean, const acc_t<T>* rstd, int64_t N,
                        int C, Stream) {
  using A = acc_t<T>;
  if (dinp) {
    parallel_for(N, [&](int64_t n) {
      const T* x = inp + n * C;
      const T* dy = dout + n * C;
      T* dx = dinp + n * C;
      // the two row means the formula needs: mean(g) and mean(g xhat), g = dout * weight
      const A mu = mean[n], r = rstd[n];
      const A mean_g = lane_sum<A>(C, [&](int c) { return A(dy[c]) * A(weight[c]); }) / A(C);
      const A mean_gxhat = lane_sum<A>(C, [&](int c) { return A(dy[c]) * A(weight[c]) * ((A(x[c]) - mu) * r); }) / A(C);
      auto dx_of = [&](int c) { return T(r * (A(dy[c]) * A(weight[c]) - mean_g - (A(x[c]) - mu) * r * mean_gxhat)); };
      for (int c = 0; c < C; c++) dx[c] = dx_of(c);
      // rounded twice, as a separate add: a loop of its own (in one expression the compiler
      // would fuse the product above and this add into one FMA, rounded once)
      if (dresid)
        for (int c = 0; c < C; c++) dx[c] = T(A(dx[c]) + A(dresid[n * C + c]));
    }, N * C > kParallelMin);
  }
  norm_param_grads(dweight, dbias, dout, inp, mean, rstd, N, C);
}

template <class T>
void residual_layernorm_forward(T* resid_out, T* out, acc_t<T>* mean, acc_t<T>* rstd,
                                const T* resid, const T* x, const T* weight, const T* bias,
                                int64_t N, int C, double eps, Stream) {
  parallel_for(N, [&](int64_t n) {
    T* r = resid_out + n * C;
    for (int c = 0; c < C; c++) r[c] = resid[n * C + c] + x[n * C + c];
    // normalize the stored sum (what backward will read back as its input)
    layernorm_row(out + n * C, mean ? mean + n : nullptr, rstd ? rstd + n : nullptr, r, weight,
                  bias, C, eps);
  }, N * C > kParallelMin);
}

template <class T>
void rmsnorm_forward(T* out, acc_t<T>* rstd, const T* inp, const T* weight, int64_t N, int C,
                     double eps, Stream) {
  parallel_for(N, [&](int64_t n) {
    rmsnorm_row(out + n * C, rstd ? rstd + n : nullptr, inp + n * C, weight, C, eps);
  }, N * C > kParallelMin);
}

template <class T>
void rmsnorm_backward(T* dinp, const T* dresid, T* dweight, const T* dout, const T* inp, const T* weight,
                      const acc_t<T>* rstd, int64_t N, int C, Stream) {
  using A = acc_t<T>;
  if (dinp) {
    parallel_for(N, [&](int64_t n) {
      const T* x = inp + n * C;
      const T* dy = dout + n * C;
      T* dx = dinp + n * C;
      const A r = rstd[n];
      const A mean_gxhat = lane_sum<A>(C, [&](int c) { return A(dy[c]) * A(weight[c]) * A(x[c]) * r; }) / A(C);
      auto dx_of = [&](int c) { return T(r * (A(dy[c]) * A(weight[c]) - A(x[c]) * r * mean_gxhat)); };
      for (int c = 0; c < C; c++) dx[c] = dx_of(c);
      if (dresid)  // rounded twice, as layernorm_backward's
        for (int c = 0; c < C; c++) dx[c] = T(A(dx[c]) + A(dresid[n * C + c]));
    }, N * C > kParallelMin);
  }
  norm_param_grads<T>(dweight, nullptr, dout, inp, nullptr, rstd, N, C);
}

template <class T>
void residual_rmsnorm_forward(T* resid_out, T* out, acc_t<T>* rstd, const T* resid, const T* x,
                              const T* weight, int64_t N, int C, double eps, Stream) {
  parallel_for(N, [&](int64_t n) {
    T* r = resid_out + n * C;
    for (int c = 0; c < C; c++) r[c] = resid[n * C + c] + x[n * C + c];
    rmsnorm_row(out + n * C, rstd ? rstd + n : nullptr, r, weight, C, eps);
  }, N * C > kParallelMin);
}

#define LOOM_NORMS(T)                                                                          \
  template void layernorm_forward<T>(T*, acc_t<T>*, acc_t<T>*, const T*, const T*, const T*,    \
                                     int64_t, int, double, Stream);                             \
  template void layernorm_backward<T>(T*, const T*, T*, T*, const T*, const T*, const T*,       \
                                      const acc_t<T>*, const acc_t<T>*, int64_t, int, Stream);  \
  template void residual_layernorm_forward<T>(T*, T*, acc_t<T>*, acc_t<T>*, const T*, const T*, \
                                              const T*, const T*, int64_t, int, double, Stream); \
  template void rmsnorm_forward<T>(T*, acc_t<T>*, const T*, const T*, int64_t, int, double,     \
                                   Stream);                                                     \
  template void rmsnorm_backward<T>(T*, const T*, T*, const T*, const T*, const T*, const acc_t<T>*, \
                                    int64_t, int, Stream);                                      \
  template void residual_rmsnorm_forward<T>(T*, T*, acc_t<T>*, const T*, const T*, const T*,    \
                                            int64_t, int, double, Stream);
LOOM_NORMS(float)
LOOM_NORMS(double)
#undef LOOM_NORMS

}  // namespace loom::cpu
