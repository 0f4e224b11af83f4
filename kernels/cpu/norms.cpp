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
// Threads: the forward and dinp run over rows. The parameter gradients are sums over rows, so
// threads over rows would race; instead each thread owns a block of columns and walks every
// row for it, in row order, which is race-free and gives the same bits on every run.
#include <cmath>
#include <cstdint>

#include "kernels/cpu/parallel.h"
#include "kernels/kernels.h"

namespace loom::cpu {
namespace {

constexpr int64_t kParallelMin = 32768;  // elements; smaller problems stay on one thread
constexpr int kColBlock = 64;            // columns per thread in the parameter-gradient pass

// LayerNorm of one row; returns nothing, writes out and (when given) mean/rstd.
template <class T>
inline void layernorm_row(T* out, acc_t<T>* mean_out, acc_t<T>* rstd_out, const T* x,
                          const T* weight, const T* bias, int C, double eps) {
  using A = acc_t<T>;
  A mean = 0;
  for (int c = 0; c < C; c++) mean += A(x[c]);
  mean /= A(C);
  A var = 0;  // two passes: the one-pass E[x^2] - mean^2 cancels badly when |mean| >> std
  for (int c = 0; c < C; c++) {
    const A d = A(x[c]) - mean;
    var += d * d;
  }
  var /= A(C);
  const A rstd = A(1) / std::sqrt(var + A(eps));
  for (int c = 0; c < C; c++) {
    const A xhat = (A(x[c]) - mean) * rstd;
    out[c] = T(xhat * A(weight[c]) + (bias ? A(bias[c]) : A(0)));
  }
  if (mean_out) *mean_out = mean;
  if (rstd_out) *rstd_out = rstd;
}

template <class T>
inline void rmsnorm_row(T* out, acc_t<T>* rstd_out, const T* x, const T* weight, int C, double eps) {
  using A = acc_t<T>;
  A sumsq = 0;
  for (int c = 0; c < C; c++) sumsq += A(x[c]) * A(x[c]);
  const A rstd = A(1) / std::sqrt(sumsq / A(C) + A(eps));
  for (int c = 0; c < C; c++) out[c] = T(A(x[c]) * rstd * A(weight[c]));
  if (rstd_out) *rstd_out = rstd;
}

// dweight[c] += sum_n dout[n,c] xhat[n,c] and dbias[c] += sum_n dout[n,c] (either nullable),
// xhat = (x - mean) rstd (mean null: RMSNorm, xhat = x rstd). Column blocks per thread.
template <class T>
void norm_param_grads(T* dweight, T* dbias, const T* dout, const T* inp, const acc_t<T>* mean,
                      const acc_t<T>* rstd, int64_t N, int C) {
  using A = acc_t<T>;
  if (!dweight && !dbias) return;
  const int nblocks = (C + kColBlock - 1) / kColBlock;
  parallel_for(nblocks, [&](int64_t blk) {
    const int c0 = blk * kColBlock, c1 = c0 + kColBlock < C ? c0 + kColBlock : C;
    A dw[kColBlock] = {}, db[kColBlock] = {};
    for (int64_t n = 0; n < N; n++) {
      const T* x = inp + n * C;
      const T* dy = dout + n * C;
      const A mu = mean ? mean[n] : A(0);
      for (int c = c0; c < c1; c++) {
        const A xhat = (A(x[c]) - mu) * rstd[n];
        dw[c - c0] += A(dy[c]) * xhat;
        db[c - c0] += A(dy[c]);
      }
    }
    for (int c = c0; c < c1; c++) {
      if (dweight) dweight[c] = T(A(dweight[c]) + dw[c - c0]);
      if (dbias) dbias[c] = T(A(dbias[c]) + db[c - c0]);
    }
  }, N * C > kParallelMin);
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
      A mean_g = 0, mean_gxhat = 0;
      for (int c = 0; c < C; c++) {
        const A xhat = (A(x[c]) - mean[n]) * rstd[n];
        const A g = A(dy[c]) * A(weight[c]);
        mean_g += g;
        mean_gxhat += g * xhat;
      }
      mean_g /= A(C);
      mean_gxhat /= A(C);
      for (int c = 0; c < C; c++) {
        const A xhat = (A(x[c]) - mean[n]) * rstd[n];
        const A g = A(dy[c]) * A(weight[c]);
        dx[c] = T(rstd[n] * (g - mean_g - xhat * mean_gxhat));
        if (dresid) dx[c] = T(A(dx[c]) + A(dresid[n * C + c]));  // rounded twice, as a separate add
      }
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
      A mean_gxhat = 0;
      for (int c = 0; c < C; c++) mean_gxhat += A(dy[c]) * A(weight[c]) * A(x[c]) * rstd[n];
      mean_gxhat /= A(C);
      for (int c = 0; c < C; c++) {
        const A xhat = A(x[c]) * rstd[n];
        const A g = A(dy[c]) * A(weight[c]);
        dx[c] = T(rstd[n] * (g - xhat * mean_gxhat));
        if (dresid) dx[c] = T(A(dx[c]) + A(dresid[n * C + c]));
      }
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
