// attention.cpp: CPU reference of softmax attention over packed variable-length sequences,
// with grouped-query heads and an optional bottom-right aligned causal mask. This file is the
// specification the flash kernel (kernels/cuda/attention.cu) is checked against.
//
// Shape legend: Nq query rows and Nk key rows (every sequence packed back to back), H query
// heads, KV key/value heads (H % KV == 0), hd head dim, nseq sequences, Lq / Lk the query /
// key count of one sequence (both <= max_seqlen).
//
//   q, out, dout, dq [Nq, H, hd]      k, v, dk, dv [Nk, KV, hd]      lse, delta [Nq, H]
//   cu_q, cu_k [nseq + 1]: sequence i owns query rows cu_q[i]..cu_q[i+1] and key rows
//   cu_k[i]..cu_k[i+1] (int32 offsets into the flattened token rows).
//
// Forward, for sequence i, query head h (it reads kv head g = h / (H/KV)), query t < Lq:
//   visible keys  j < Lk, and when causal  j <= t + (Lk - Lq)     (bottom-right aligned:
//                 equal lengths give the usual mask, Lq = 1 is one decode step over Lk keys)
//   s_j    = scale * q_t . k_j
//   lse_t  = log sum_j exp(s_j)                          saved for backward, A precision
//   p_j    = exp(s_j - lse_t)
//   out_t  = sum_j p_j v_j                               (=)
// Backward (p is recomputed from lse; nothing but lse is saved):
//   delta_t = dout_t . out_t            (= sum_j p_j dp_j; kept in the workspace)
//   dp_j    = dout_t . v_j
//   ds_j    = p_j (dp_j - delta_t)      (softmax backward)
//   dq_t    = scale sum_j ds_j k_j                       (=)
//   dk_j    = scale sum_{h in group g} sum_t ds_j q_t    (=)
//   dv_j    = sum_{h in group g} sum_t p_j dout_t        (=)
//
// Rows that attend to nothing (rows outside every sequence, and causal queries with
// t + Lk - Lq < 0) get out = 0, dq = 0 and lse = +inf; +inf (as flash-attention stores) makes
// any recomputation exp(s - lse) = 0, so a kernel needs no special case for them. Key rows
// outside every sequence get dk = dv = 0.
//
// Work split: forward over (sequence, query head) pairs; backward over (sequence, kv head)
// pairs, so that every dk/dv row is written by exactly one thread (deterministic, no atomics)
// and the H/KV query heads of a group are walked in order inside it. Inside a work item the
// queries go in tiles of kQueryTile rows against all the keys the tile's last row sees
// (causal rows see a prefix that grows with t, so the last row sees the most); entries a row
// may not see are set to p = 0. The products are Eigen GEMMs on strided maps of q, k, v.
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cpu/lane_sum.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/vec_exp.h"
#include "kernels/kernels.h"

namespace loom::cpu {
namespace {

template <class T> using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T> using Vec = Eigen::Matrix<T, Eigen::Dynamic, 1>;
// The rows of one kv head inside one sequence: [Lk, hd] with a row stride of KV * hd.
template <class T> using HeadRows = Eigen::Map<RowMat<T>, 0, Eigen::OuterStride<>>;
template <class T> using ConstHeadRows = Eigen::Map<const RowMat<T>, 0, Eigen::OuterStride<>>;

// Host preconditions, with the offending values in the message.
void check_attention_args(const char* op, const int32_t* cu_q, const int32_t* cu_k, int nseq,
                          int max_seqlen, int64_t Nq, int64_t Nk, int H, int KV, int hd) {
  auto fail = [&](const std::string& what) {
    throw std::invalid_argument(std::string(op) + ": " + what);
  };
  if (H <= 0 || KV <= 0 || H % KV != 0)
    fail("expected H % KV == 0 with H, KV > 0, got H=" + std::to_string(H) + " KV=" + std::to_string(KV));
  if (hd <= 0) fail("expected hd > 0, got " + std::to_string(hd));
  if (nseq < 0) fail("expected nseq >= 0, got " + std::to_string(nseq));
  for (int i = 0; i < nseq; i++) {
    const int64_t q0 = cu_q[i], q1 = cu_q[i + 1], k0 = cu_k[i], k1 = cu_k[i + 1];
    if (q0 < 0 || q1 < q0 || q1 > Nq)
      fail("cu_q[" + std::to_string(i) + ".." + std::to_string(i + 1) + "] = " + std::to_string(q0) +
           ".." + std::to_string(q1) + " is not a non-decreasing range inside Nq=" + std::to_string(Nq));
    if (k0 < 0 || k1 < k0 || k1 > Nk)
      fail("cu_k[" + std::to_string(i) + ".." + std::to_string(i + 1) + "] = " + std::to_string(k0) +
           ".." + std::to_string(k1) + " is not a non-decreasing range inside Nk=" + std::to_string(Nk));
    if (q1 - q0 > max_seqlen || k1 - k0 > max_seqlen)
      fail("sequence " + std::to_string(i) + " has Lq=" + std::to_string(q1 - q0) + " Lk=" +
           std::to_string(k1 - k0) + ", more than max_seqlen=" + std::to_string(max_seqlen));
  }
  // One cu_seqlens for queries and keys with Nq = Nk = nseq * max_seqlen declares a dense batch
  // (kernels.inc): the CUDA kernels and cuDNN's dense graph read no offsets for it.
  if (cu_q == cu_k && Nq == Nk && Nq == int64_t(nseq) * max_seqlen)
    for (int i = 0; i <= nseq; i++)
      if (cu_q[i] != int64_t(i) * max_seqlen)
        fail("one cu_seqlens with Nq=Nk=" + std::to_string(Nq) + " = nseq * max_seqlen (" + std::to_string(nseq) +
             " * " + std::to_string(max_seqlen) + ") is a dense batch, but cu_seqlens[" + std::to_string(i) +
             "] = " + std::to_string(cu_q[i]) + ", not " + std::to_string(int64_t(i) * max_seqlen) +
             " (give a max_seqlen equal to the longest sequence, or rows outside the sequences their own count)");
}

// Queries are processed in tiles of this many rows, so that the score block S = Q K^T and the
// products P V, dS K, dS^T Q, P^T dO are matrix-matrix (the structure of the flash kernel).
// Measured at B4 H12 T1024 hd64 f32, bidirectional, on 2 shared (busy) cores: one query row
// at a time (matrix-vector products and rank-1 dk/dv updates) ran 3.4-5.4 GFLOP/s forward and
// 2.0-4.7 backward; 64-row tiles 9.4-17.8 forward and 13-23 backward. 32 and 128 were not
// distinguishable from 64 under that load.
constexpr int kQueryTile = 64;

// How many keys query t sees: all Lk, or with the bottom-right causal mask the first
// t + Lk - Lq + 1 of them (clamped to [0, Lk]).
inline int visible_keys(int t, int Lq, int Lk, bool causal) {
  if (!causal) return Lk;
  return std::clamp(t + Lk - Lq + 1, 0, Lk);
}

}  // namespace

template <class T>
void attention_forward(T* out, acc_t<T>* lse, const T* q, const T* k, const T* v,
                       const int32_t* cu_q, const int32_t* cu_k, int nseq, int max_seqlen,
                       int64_t Nq, int64_t Nk, int H, int KV, int hd, bool causal, double scale,
                       Stream) {
  using A = acc_t<T>;
  static_assert(std::is_same<T, A>::value, "the CPU reference computes in T = acc_t<T>");
  check_attention_args("attention_forward", cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV, hd);
  const int group = H / KV;  // query heads per kv head
  const int64_t q_row = int64_t(H) * hd, kv_row = int64_t(KV) * hd;  // token strides

  // Rows outside every sequence keep these values; rows inside are overwritten below.
  std::fill(out, out + Nq * q_row, T(0));
  std::fill(lse, lse + Nq * H, std::numeric_limits<A>::infinity());

  // one (sequence, head) per work item, a few items per range; S, then P, per range
  const int64_t items = int64_t(nseq) * H;
  parallel_ranges(items, 4 * default_chunks(), [&](int64_t item0, int64_t item1) {
    std::vector<A> p_buf(int64_t(kQueryTile) * std::max(max_seqlen, 1));
    for (int64_t item = item0; item < item1; item++) {
      const int i = int(item / H), h = int(item % H), g = h / group;
      const int Lq = cu_q[i + 1] - cu_q[i], Lk = cu_k[i + 1] - cu_k[i];
      const int64_t kv_off = int64_t(cu_k[i]) * kv_row + int64_t(g) * hd;
      ConstHeadRows<T> K(k + kv_off, Lk, hd, Eigen::OuterStride<>(kv_row));
      ConstHeadRows<T> V(v + kv_off, Lk, hd, Eigen::OuterStride<>(kv_row));

      for (int t0 = 0; t0 < Lq; t0 += kQueryTile) {
        const int rows = std::min(kQueryTile, Lq - t0);
        const int n = visible_keys(t0 + rows - 1, Lq, Lk, causal);  // the tile's last row sees most
        if (n == 0) continue;  // no row of the tile sees a key: out = 0, lse = +inf (the fill)
        const int64_t q_off = (int64_t(cu_q[i]) + t0) * q_row + int64_t(h) * hd;
        ConstHeadRows<T> Q(q + q_off, rows, hd, Eigen::OuterStride<>(q_row));
        HeadRows<T> O(out + q_off, rows, hd, Eigen::OuterStride<>(q_row));
        Eigen::Map<RowMat<A>> P(p_buf.data(), rows, n);

        P.noalias() = Q * K.topRows(n).transpose();
        P *= A(scale);  // s_tj = scale * q_t . k_j
        for (int r = 0; r < rows; r++) {
          const int t = t0 + r, n_t = visible_keys(t, Lq, Lk, causal);
          A* p = &P(r, 0);
          if (n_t == 0) {  // sees nothing: a zero row of P gives out_t = 0; lse stays +inf
            std::fill(p, p + n, A(0));
            continue;
          }
          A m = p[0];  // subtract the row max: exp never overflows
          for (int j = 1; j < n_t; j++) m = std::max(m, p[j]);
          for (int j = 0; j < n_t; j++) p[j] = exp_acc(p[j] - m);  // vectorizes (vec_exp.h); the sum apart
          const A l = lane_sum<A>(n_t, [&](int j) { return p[j]; });  // eight lanes (lane_sum.h)
          for (int j = 0; j < n_t; j++) p[j] /= l;               // p_tj
          for (int j = n_t; j < n; j++) p[j] = A(0);             // masked keys
          lse[(int64_t(cu_q[i]) + t) * H + h] = m + std::log(l);
        }
        O.noalias() = P * V.topRows(n);  // out_t = sum_j p_tj v_j
      }
    }
  });
}

template <class T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                        const T* out, const acc_t<T>* lse, acc_t<T>* workspace,
                        const int32_t* cu_q, const int32_t* cu_k, int nseq, int max_seqlen,
                        int64_t Nq, int64_t Nk, int H, int KV, int hd, bool causal, double scale,
                        Stream) {
  using A = acc_t<T>;
  static_assert(std::is_same<T, A>::value, "the CPU reference computes in T = acc_t<T>");
  check_attention_args("attention_backward", cu_q, cu_k, nseq, max_seqlen, Nq, Nk, H, KV, hd);
  const int group = H / KV;
  const int64_t q_row = int64_t(H) * hd, kv_row = int64_t(KV) * hd;
  A* delta = workspace;  // [Nq, H]

  // All three gradients are `=`: rows outside every sequence stay 0, the rest accumulate below.
  std::fill(dq, dq + Nq * q_row, T(0));
  std::fill(dk, dk + Nk * kv_row, T(0));
  std::fill(dv, dv + Nk * kv_row, T(0));

  // Pass 1: delta_t = dout_t . out_t for every query row of every sequence and head.
  for (int i = 0; i < nseq; i++) {
    parallel_for(cu_q[i + 1] - cu_q[i], [&](int64_t r) {
      const int64_t row = cu_q[i] + r;
      for (int h = 0; h < H; h++) {
        Eigen::Map<const Vec<T>> dout_t(dout + row * q_row + int64_t(h) * hd, hd);
        Eigen::Map<const Vec<T>> out_t(out + row * q_row + int64_t(h) * hd, hd);
        delta[row * H + h] = dout_t.dot(out_t);
      }
    });
  }

  // Pass 2: one (sequence, kv head) per work item; it owns dk/dv of that head's key rows.
  const int64_t kv_items = int64_t(nseq) * KV;
  parallel_ranges(kv_items, 4 * default_chunks(), [&](int64_t item0, int64_t item1) {
    const int64_t tile_elems = int64_t(kQueryTile) * std::max(max_seqlen, 1);
    std::vector<A> p_buf(tile_elems), ds_buf(tile_elems);  // P and dP/dS of one tile, per range
    for (int64_t item = item0; item < item1; item++) {
      const int i = int(item / KV), g = int(item % KV);
      const int Lq = cu_q[i + 1] - cu_q[i], Lk = cu_k[i + 1] - cu_k[i];
      const int64_t kv_off = int64_t(cu_k[i]) * kv_row + int64_t(g) * hd;
      ConstHeadRows<T> K(k + kv_off, Lk, hd, Eigen::OuterStride<>(kv_row));
      ConstHeadRows<T> V(v + kv_off, Lk, hd, Eigen::OuterStride<>(kv_row));
      HeadRows<T> dK(dk + kv_off, Lk, hd, Eigen::OuterStride<>(kv_row));
      HeadRows<T> dV(dv + kv_off, Lk, hd, Eigen::OuterStride<>(kv_row));

      for (int h = g * group; h < (g + 1) * group; h++) {
        for (int t0 = 0; t0 < Lq; t0 += kQueryTile) {
          const int rows = std::min(kQueryTile, Lq - t0);
          const int n = visible_keys(t0 + rows - 1, Lq, Lk, causal);
          if (n == 0) continue;  // nothing attended: dq stays 0
          const int64_t q_off = (int64_t(cu_q[i]) + t0) * q_row + int64_t(h) * hd;
          ConstHeadRows<T> Q(q + q_off, rows, hd, Eigen::OuterStride<>(q_row));
          ConstHeadRows<T> dO(dout + q_off, rows, hd, Eigen::OuterStride<>(q_row));
          HeadRows<T> dQ(dq + q_off, rows, hd, Eigen::OuterStride<>(q_row));
          Eigen::Map<RowMat<A>> P(p_buf.data(), rows, n), dS(ds_buf.data(), rows, n);

          // p_tj = exp(scale * q_t . k_j - lse_t), recomputed from the saved lse; 0 if masked
          P.noalias() = Q * K.topRows(n).transpose();
          // dp_tj = dout_t . v_j
          dS.noalias() = dO * V.topRows(n).transpose();
          for (int r = 0; r < rows; r++) {
            const int64_t row = int64_t(cu_q[i]) + t0 + r;
            const int n_t = visible_keys(t0 + r, Lq, Lk, causal);
            const A lse_t = lse[row * H + h], delta_t = delta[row * H + h];
            for (int j = 0; j < n; j++) {
              const A p = j < n_t ? exp_acc(A(scale) * P(r, j) - lse_t) : A(0);
              P(r, j) = p;
              dS(r, j) = p * (dS(r, j) - delta_t);  // ds_tj = p_tj (dp_tj - delta_t)
            }
          }
          dQ.noalias() = A(scale) * (dS * K.topRows(n));                 // dq_t  = scale sum_j ds_tj k_j
          dK.topRows(n).noalias() += A(scale) * (dS.transpose() * Q);    // dk_j += scale sum_t ds_tj q_t
          dV.topRows(n).noalias() += P.transpose() * dO;                 // dv_j += sum_t p_tj dout_t
        }
      }
    }
  });
}

template <class T>
void attention_backward_qkv(T* dqkv, const T* dout, const T* q, const T* k, const T* v, const T* out,
                            const acc_t<T>* lse, acc_t<T>* workspace, const int32_t* cu, const int32_t* pos,
                            int nseq, int max_seqlen, int64_t N, int H, int KV, int hd, bool causal,
                            double scale, double theta, Stream s) {
  std::vector<T> dq(size_t(N) * H * hd), dk(size_t(N) * KV * hd), dv(size_t(N) * KV * hd);
  attention_backward(dq.data(), dk.data(), dv.data(), dout, q, k, v, out, lse, workspace, cu, cu, nseq, max_seqlen, N,
                     N, H, KV, hd, causal, scale, s);
  if (pos) {
    rope_qkv_join(dqkv, dq.data(), dk.data(), dv.data(), pos, N, H, KV, hd, theta, s);
    return;
  }
  const int64_t W = int64_t(H + 2 * KV) * hd, qw = int64_t(H) * hd, kw = int64_t(KV) * hd;
  for (int64_t n = 0; n < N; n++) {  // no RoPE: the rows dq | dk | dv as they are
    std::copy_n(dq.data() + n * qw, qw, dqkv + n * W);
    std::copy_n(dk.data() + n * kw, kw, dqkv + n * W + qw);
    std::copy_n(dv.data() + n * kw, kw, dqkv + n * W + qw + kw);
  }
}

#define LOOM_INSTANTIATE(T)                                                                      \
  template void attention_forward<T>(T*, acc_t<T>*, const T*, const T*, const T*, const int32_t*, \
                                     const int32_t*, int, int, int64_t, int64_t, int, int, int,   \
                                     bool, double, Stream);                                       \
  template void attention_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*,          \
                                      const T*, const acc_t<T>*, acc_t<T>*, const int32_t*,        \
                                      const int32_t*, int, int, int64_t, int64_t, int, int, int,  \
                                      bool, double, Stream);                                       \
  template void attention_backward_qkv<T>(T*, const T*, const T*, const T*, const T*, const T*,    \
                                          const acc_t<T>*, acc_t<T>*, const int32_t*,              \
                                          const int32_t*, int, int, int64_t, int, int, int, bool,  \
                                          double, double, Stream);
LOOM_INSTANTIATE(float)
LOOM_INSTANTIATE(double)
#undef LOOM_INSTANTIATE

}  // namespace loom::cpu
