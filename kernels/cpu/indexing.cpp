// indexing.cpp: the CPU reference of the data-movement ops (embedding, row gather/scatter,
// patchify, pixel shuffle), the mean pool, L2 normalization and argmax.
//
// Shape legend: N rows (tokens), C channels, V vocab, B batch, K kept rows / pooled rows,
// Ch image channels, H x W image, p patch side, G x G patch grid, D feature width, s shuffle.
//   embedding    out[N,C] = table[ids[N], :];  dtable[V,C] += dout rows scattered by ids
//   gather_rows  out[B,K,C] = inp[b, idx[b,k], :]                     inp [B,N,C], idx [B,K]
//   scatter_rows out[b, idx[b,k], :] (= or +=) src[b,k,:]; zero_rows sets those rows to 0
//   patchify     img[B,Ch,H,W] -> out[B, (H/p)(W/p), p p Ch]: element (c, i p+u, j p+v)
//                goes to patch i (W/p) + j, feature (u p + v) Ch + c   (SPEC §1)
//   pixel_shuffle inp[B, G G, D] -> out[B, (G/s)^2, s s D]: token (I, J) of the coarse grid
//                holds the s x s block at rows I s.., cols J s.. in row-major order, each a
//                full D vector: out[b, I (G/s) + J, (u s + v) D + d] = inp[b, (I s+u) G + J s+v, d]
//   mean_pool    out[B,C] = mean over k of inp[B,K,C];  dinp = dout / K broadcast over k
//   l2norm       out = x rnorm, rnorm = 1 / max(||x||, eps) saved [N] (torch F.normalize);
//                dinp = rnorm (dout - x rnorm^2 (x . dout)) where ||x|| > eps,
//                dinp = rnorm dout where the norm was clamped to eps (a constant divisor)
//   argmax_rows  out[N] = first index of the largest value of each row (a NaN counts as largest)
// Backward outputs are `=` except dtable (`+=`, a parameter gradient).
//
// Index arguments are checked on the host before any thread starts, so that an id outside its
// range throws std::out_of_range naming it before any output is written.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/cpu/parallel.h"
#include "kernels/kernels.h"

namespace loom::cpu {
namespace {

constexpr int64_t kParallelMin = 32768;
constexpr int kColBlock = 64;  // columns per thread in embedding_backward

void check_ids(const int32_t* ids, int64_t n, int64_t limit, const char* op, const char* what) {
  for (int64_t i = 0; i < n; i++)
    if (ids[i] < 0 || ids[i] >= limit)
      throw std::out_of_range(std::string(op) + ": " + what + " " + std::to_string(ids[i]) +
                              " at position " + std::to_string(i) + " is outside [0, " +
                              std::to_string(limit) + ")");
}

void check_divisible(int64_t size, int64_t by, const char* op, const char* what) {
  if (by <= 0 || size % by != 0)
    throw std::invalid_argument(std::string(op) + ": expected " + what + " (" +
                                std::to_string(size) + ") divisible by " + std::to_string(by));
}

}  // namespace

template <class T>
void embedding_forward(T* out, const int32_t* ids, const T* table, int64_t N, int C, int V, Stream) {
  check_ids(ids, N, V, "embedding_forward", "id");
  parallel_for(N, [&](int64_t n) {
    std::memcpy(out + n * C, table + int64_t(ids[n]) * C, sizeof(T) * C);
  }, N * C > kParallelMin);
}

// Deterministic without atomics: each thread owns a block of columns and adds the rows in
// token order, so a repeated id always sums in the same order.
template <class T>
void embedding_backward(T* dtable, const T* dout, const int32_t* ids, int64_t N, int C, int V, Stream) {
  check_ids(ids, N, V, "embedding_backward", "id");
  const int nblocks = (C + kColBlock - 1) / kColBlock;
  parallel_for(nblocks, [&](int64_t blk) {
    const int c0 = blk * kColBlock, c1 = c0 + kColBlock < C ? c0 + kColBlock : C;
    for (int64_t n = 0; n < N; n++) {
      T* row = dtable + int64_t(ids[n]) * C;
      const T* g = dout + n * C;
      for (int c = c0; c < c1; c++) row[c] += g[c];
    }
  }, N * C > kParallelMin);
}

template <class T>
void gather_rows(T* out, const T* inp, const int32_t* idx, int B, int N, int K, int C, Stream) {
  check_ids(idx, int64_t(B) * K, N, "gather_rows", "index");
  parallel_for(int64_t(B) * K, [&](int64_t bk) {
    const int64_t b = bk / K;
    std::memcpy(out + bk * C, inp + (b * N + idx[bk]) * C, sizeof(T) * C);
  }, int64_t(B) * K * C > kParallelMin);
}

// Threads over b only: rows of different batch items never collide, and within one item the
// k order is kept, so accumulating repeated indices is deterministic.
template <class T>
void scatter_rows(T* out, const int32_t* idx, const T* src, int B, int N, int K, int C,
                  bool accumulate, Stream) {
  check_ids(idx, int64_t(B) * K, N, "scatter_rows", "index");
  parallel_for(B, [&](int64_t b) {
    for (int k = 0; k < K; k++) {
      const int64_t bk = int64_t(b) * K + k;
      T* dst = out + (int64_t(b) * N + idx[bk]) * C;
      const T* row = src + bk * C;
      if (accumulate)
        for (int c = 0; c < C; c++) dst[c] += row[c];
      else
        std::memcpy(dst, row, sizeof(T) * C);
    }
  }, int64_t(B) * K * C > kParallelMin);
}

template <class T> void zero_rows(T* out, const int32_t* idx, int B, int N, int K, int C, Stream) {
  check_ids(idx, int64_t(B) * K, N, "zero_rows", "index");
  for (int64_t bk = 0; bk < int64_t(B) * K; bk++) {
    T* dst = out + (bk / K * N + idx[bk]) * C;
    for (int c = 0; c < C; c++) dst[c] = T(0);
  }
}

namespace {

// patchify and its backward walk the same index map; `Forward` picks the direction:
// forward dst = patches, src = image; backward dst = image, src = patches.
template <bool Forward, class T>
void patch_permute(T* dst, const T* src, int B, int Ch, int H, int W, int p) {
  const int gh = H / p, gw = W / p;
  const int64_t P = int64_t(p) * p * Ch;  // features per patch
  parallel_for(int64_t(B) * gh, [&](int64_t bi) {  // (image, patch row i)
    const int64_t b = bi / gh;
    const int i = int(bi % gh);
    for (int j = 0; j < gw; j++) {
      const int64_t patch = (b * gh * gw + int64_t(i) * gw + j) * P;
      for (int u = 0; u < p; u++)
        for (int v = 0; v < p; v++)
          for (int c = 0; c < Ch; c++) {
            const int64_t pix = ((b * Ch + c) * H + (i * p + u)) * W + (j * p + v);
            const int64_t feat = patch + (u * p + v) * Ch + c;
            if (Forward) dst[feat] = src[pix];
            else dst[pix] = src[feat];
          }
    }
  }, int64_t(B) * Ch * H * W > kParallelMin);
}

// pixel_shuffle's index map, moved a D vector at a time; forward dst = coarse tokens,
// src = fine grid; backward the other way.
template <bool Forward, class T>
void shuffle_permute(T* dst, const T* src, int B, int G, int D, int s) {
  const int g = G / s;                   // coarse grid side
  const int64_t W = int64_t(s) * s * D;  // coarse token width
  parallel_for(int64_t(B) * g, [&](int64_t bI) {  // (image, coarse row I)
    const int64_t b = bI / g;
    const int I = int(bI % g);
    for (int J = 0; J < g; J++) {
      const int64_t tok = (b * g * g + int64_t(I) * g + J) * W;
      for (int u = 0; u < s; u++)
        for (int v = 0; v < s; v++) {
          const int64_t cell = (b * G * G + int64_t(I * s + u) * G + (J * s + v)) * D;
          const int64_t slot = tok + int64_t(u * s + v) * D;
          if (Forward) std::memcpy(dst + slot, src + cell, sizeof(T) * D);
          else std::memcpy(dst + cell, src + slot, sizeof(T) * D);
        }
    }
  }, int64_t(B) * G * G * D > kParallelMin);
}

}  // namespace

template <class T>
void patchify(T* out, const T* img, int B, int Ch, int H, int W, int p, Stream) {
  check_divisible(H, p, "patchify", "image height H");
  check_divisible(W, p, "patchify", "image width W");
  patch_permute<true>(out, img, B, Ch, H, W, p);
}

template <class T>
void patchify_backward(T* dimg, const T* dout, int B, int Ch, int H, int W, int p, Stream) {
  check_divisible(H, p, "patchify_backward", "image height H");
  check_divisible(W, p, "patchify_backward", "image width W");
  patch_permute<false>(dimg, dout, B, Ch, H, W, p);
}

template <class T> void pixel_shuffle(T* out, const T* inp, int B, int G, int D, int s, Stream) {
  check_divisible(G, s, "pixel_shuffle", "grid side G");
  shuffle_permute<true>(out, inp, B, G, D, s);
}

template <class T>
void pixel_shuffle_backward(T* dinp, const T* dout, int B, int G, int D, int s, Stream) {
  check_divisible(G, s, "pixel_shuffle_backward", "grid side G");
  shuffle_permute<false>(dinp, dout, B, G, D, s);
}

template <class T> void mean_pool_forward(T* out, const T* inp, int B, int K, int C, Stream) {
  using A = acc_t<T>;
  parallel_for(B, [&](int64_t b) {
    T* o = out + int64_t(b) * C;
    for (int c = 0; c < C; c++) {
      A sum = 0;
      for (int k = 0; k < K; k++) sum += A(inp[(int64_t(b) * K + k) * C + c]);
      o[c] = T(sum / A(K));
    }
  }, int64_t(B) * K * C > kParallelMin);
}

template <class T> void mean_pool_backward(T* dinp, const T* dout, int B, int K, int C, Stream) {
  using A = acc_t<T>;
  parallel_for(B, [&](int64_t b) {
    for (int k = 0; k < K; k++)
      for (int c = 0; c < C; c++)
        dinp[(int64_t(b) * K + k) * C + c] = T(A(dout[int64_t(b) * C + c]) / A(K));
  }, int64_t(B) * K * C > kParallelMin);
}

template <class T>
void l2norm_forward(T* out, acc_t<T>* rnorm, const T* inp, int64_t N, int C, double eps, Stream) {
  using A = acc_t<T>;
  parallel_for(N, [&](int64_t n) {
    const T* x = inp + n * C;
    A sumsq = 0;
    for (int c = 0; c < C; c++) sumsq += A(x[c]) * A(x[c]);
    const A r = A(1) / std::fmax(std::sqrt(sumsq), A(eps));
    for (int c = 0; c < C; c++) out[n * C + c] = T(A(x[c]) * r);
    if (rnorm) rnorm[n] = r;
  }, N * C > kParallelMin);
}

// The backward is not given eps, so it tells a clamped row by recomputing ||x||: unclamped,
// ||x|| rnorm is 1 up to rounding; clamped, it is ||x|| / eps < 1. Rows within 1e-4 relative
// of the boundary take the unclamped branch (the two branches agree to that order there).
template <class T>
void l2norm_backward(T* dinp, const T* dout, const T* inp, const acc_t<T>* rnorm, int64_t N,
                     int C, Stream) {
  using A = acc_t<T>;
  parallel_for(N, [&](int64_t n) {
    const T* x = inp + n * C;
    const T* dy = dout + n * C;
    A sumsq = 0, x_dot_dy = 0;
    for (int c = 0; c < C; c++) {
      sumsq += A(x[c]) * A(x[c]);
      x_dot_dy += A(x[c]) * A(dy[c]);
    }
    const A r = rnorm[n];
    const bool clamped = std::sqrt(sumsq) * r < A(1) - A(1e-4);
    const A proj = clamped ? A(0) : r * r * x_dot_dy;  // component of dout along x
    for (int c = 0; c < C; c++) dinp[n * C + c] = T(r * (A(dy[c]) - A(x[c]) * proj));
  }, N * C > kParallelMin);
}

template <class T> void argmax_rows(int32_t* out, const T* inp, int64_t N, int C, Stream) {
  parallel_for(N, [&](int64_t n) {
    const T* x = inp + n * C;
    int best = 0;
    for (int c = 1; c < C; c++) {
      if (std::isnan(x[best])) break;  // the first NaN wins, as in torch.argmax
      if (x[c] > x[best] || std::isnan(x[c])) best = c;
    }
    out[n] = best;
  }, N * C > kParallelMin);
}

#define LOOM_INDEXING(T)                                                                        \
  template void embedding_forward<T>(T*, const int32_t*, const T*, int64_t, int, int, Stream);  \
  template void embedding_backward<T>(T*, const T*, const int32_t*, int64_t, int, int, Stream); \
  template void gather_rows<T>(T*, const T*, const int32_t*, int, int, int, int, Stream);       \
  template void scatter_rows<T>(T*, const int32_t*, const T*, int, int, int, int, bool, Stream); \
  template void zero_rows<T>(T*, const int32_t*, int, int, int, int, Stream);                   \
  template void patchify<T>(T*, const T*, int, int, int, int, int, Stream);                     \
  template void patchify_backward<T>(T*, const T*, int, int, int, int, int, Stream);            \
  template void pixel_shuffle<T>(T*, const T*, int, int, int, int, Stream);                     \
  template void pixel_shuffle_backward<T>(T*, const T*, int, int, int, int, Stream);            \
  template void mean_pool_forward<T>(T*, const T*, int, int, int, Stream);                      \
  template void mean_pool_backward<T>(T*, const T*, int, int, int, Stream);                     \
  template void l2norm_forward<T>(T*, acc_t<T>*, const T*, int64_t, int, double, Stream);       \
  template void l2norm_backward<T>(T*, const T*, const T*, const acc_t<T>*, int64_t, int,       \
                                   Stream);                                                     \
  template void argmax_rows<T>(int32_t*, const T*, int64_t, int, Stream);
LOOM_INDEXING(float)
LOOM_INDEXING(double)
#undef LOOM_INDEXING

}  // namespace loom::cpu
