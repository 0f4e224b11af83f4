// contrastive.cpp: CPU reference of the two LatentMIM losses (SPEC §1; torch_ref.py
// LatentMIM.view_loss and forward), forward and gradient in one pass for dloss = 1.
//
// Shape legend: B batch, M masked patches per sample, D feature dim, tau temperature.
//
// Patch discrimination, for each sample b (pred, dpred, target [B, M, D]):
//   rp_i   = 1 / max(||p_i||, 1e-12),  rt_j = 1 / max(||t_j||, 1e-12)   (F.normalize)
//   L_ij   = rp_i rt_j (p_i . t_j) / tau                                  [M, M]
//   loss   = 1/(B M) sum_b sum_i (lse_i(L) - L_ii)      (CE, the diagonal is the right class)
//   dL_ij  = (softmax_i(L)_j - [i == j]) / (B M)
//   dpn_i  = sum_j dL_ij rt_j t_j / tau                 (gradient w.r.t. normalize(p_i))
//   dp_i   = rp_i dpn_i - rp_i^3 (p_i . dpn_i) p_i      (normalize backward; when ||p_i|| <
//            1e-12 the max() is the constant branch and dp_i = rp_i dpn_i)
// The target gets no gradient (it comes from the EMA encoder under no_grad).
// workspace [B*M*M + 2*B*M]: L then dL in place [B, M, M], rp [B, M], rt [B, M].
//
// Symmetric InfoNCE between already-normalized a, b [B, D] (da, db [B, D]):
//   L_ij   = a_i . b_j / tau                                               [B, B]
//   loss   = ( 1/B sum_i (rowlse_i - L_ii) + 1/B sum_j (collse_j - L_jj) ) / 2
//   dL_ij  = ( softmax_row_i(L)_j - [i==j] + softmax_col_j(L)_i - [i==j] ) / (2B)
//   da     = dL b / tau,   db = dL^T a / tau
// The 0.1 contrastive weight is applied by the caller.
// workspace [B*B + 4*B]: L then dL in place [B, B], rowlse [B], collse [B]; the CPU version
// leaves the last 2*B unused (the CUDA version keeps per-row partial losses there).
//
// Products are Eigen GEMMs (InfoNCE's through matmul.cpp's gemm, which splits them over the
// threads); the per-sample loop of patch discrimination runs in parallel and
// its per-sample losses are added in sample order (same result for any thread count).
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/vec_exp.h"
#include "kernels/kernels.h"

namespace loom::cpu {
namespace {

template <class T> using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

constexpr double kNormalizeEps = 1e-12;  // F.normalize's default eps

// 1 / max(||x||, eps) of one row (F.normalize divides by the clamped norm).
template <class T>
acc_t<T> clamped_rnorm(const T* x, int D) {
  using A = acc_t<T>;
  A ss = 0;
  for (int d = 0; d < D; d++) ss += A(x[d]) * A(x[d]);
  return A(1) / std::max(std::sqrt(ss), A(kNormalizeEps));
}

void check_positive(const char* op, const char* what, double value) {
  if (!(value > 0)) throw std::invalid_argument(std::string(op) + ": expected " + what + " > 0, got " + std::to_string(value));
}

}  // namespace

template <class T>
void patch_disc_loss(acc_t<T>* loss, T* dpred, const T* pred, const T* target, int B, int M, int D,
                     double tau, acc_t<T>* workspace, Stream) {
  using A = acc_t<T>;
  static_assert(std::is_same<T, A>::value, "the CPU reference computes in T = acc_t<T>");
  check_positive("patch_disc_loss", "tau", tau);
  if (B <= 0 || M <= 0 || D <= 0)
    throw std::invalid_argument("patch_disc_loss: expected pred of shape [B, M, D] with B, M, D > 0, got [" +
                                std::to_string(B) + ", " + std::to_string(M) + ", " + std::to_string(D) + "]");
  const int64_t MM = int64_t(M) * M, MD = int64_t(M) * D;
  A* logits_all = workspace;            // [B, M, M]
  A* rp = workspace + int64_t(B) * MM;  // [B, M]
  A* rt = rp + int64_t(B) * M;          // [B, M]
  const A inv_tau = A(1) / A(tau), inv_BM = A(1) / (A(B) * A(M));
  std::vector<A> sample_loss(B);

  parallel_for_each(B, [&](int64_t b) {
    const T* p = pred + b * MD;
    const T* t = target + b * MD;
    T* dp = dpred + b * MD;
    A* rp_b = rp + int64_t(b) * M;
    A* rt_b = rt + int64_t(b) * M;
    for (int i = 0; i < M; i++) {
      rp_b[i] = clamped_rnorm(p + int64_t(i) * D, D);
      rt_b[i] = clamped_rnorm(t + int64_t(i) * D, D);
    }
    Eigen::Map<const RowMat<T>> P(p, M, D), Tg(t, M, D);
    Eigen::Map<RowMat<A>> L(logits_all + b * MM, M, M);

    L.noalias() = P * Tg.transpose();  // p_i . t_j, then scaled to the cosine / tau
    for (int i = 0; i < M; i++)
      for (int j = 0; j < M; j++) L(i, j) *= rp_b[i] * rt_b[j] * inv_tau;

    // Cross-entropy of each row against its own index; dL written over L.
    A loss_b = 0;
    for (int i = 0; i < M; i++) {
      A m = L(i, 0);
      for (int j = 1; j < M; j++) m = std::max(m, L(i, j));
      A sum = 0;
      for (int j = 0; j < M; j++) sum += exp_acc(L(i, j) - m);
      const A lse = m + std::log(sum);
      loss_b += lse - L(i, i);
      for (int j = 0; j < M; j++) L(i, j) = (exp_acc(L(i, j) - lse) - A(i == j)) * inv_BM;
    }
    sample_loss[b] = loss_b;

    // dpn_i = sum_j dL_ij rt_j t_j / tau: fold rt_j / tau into dL, then one GEMM into dpred.
    for (int i = 0; i < M; i++)
      for (int j = 0; j < M; j++) L(i, j) *= rt_b[j] * inv_tau;
    Eigen::Map<RowMat<T>> dP(dp, M, D);
    dP.noalias() = L * Tg;

    // Back through normalize: dp_i = rp_i dpn_i - rp_i^3 (p_i . dpn_i) p_i.
    for (int i = 0; i < M; i++) {
      // ||p_i|| < eps: the clamped norm is the constant eps (torch's clamp_min passes the
      // gradient only where norm >= eps)
      const bool clamped = P.row(i).norm() < A(kNormalizeEps);
      const A r = rp_b[i];
      const A proj = clamped ? A(0) : r * r * r * P.row(i).dot(dP.row(i));
      dP.row(i) = r * dP.row(i) - proj * P.row(i);
    }
  });

  A total = 0;  // in sample order
  for (int b = 0; b < B; b++) total += sample_loss[b];
  loss[0] = total * inv_BM;
}

template <class T>
void infonce_loss(acc_t<T>* loss, T* da, T* db, const T* a, const T* b, int B, int D, double tau,
                  acc_t<T>* workspace, Stream s) {
  using A = acc_t<T>;
  static_assert(std::is_same<T, A>::value, "the CPU reference computes in T = acc_t<T>");
  check_positive("infonce_loss", "tau", tau);
  if (B <= 0 || D <= 0)
    throw std::invalid_argument("infonce_loss: expected a, b of shape [B, D] with B, D > 0, got [" +
                                std::to_string(B) + ", " + std::to_string(D) + "]");
  Eigen::Map<RowMat<A>> L(workspace, B, B);
  A* row_lse = workspace + int64_t(B) * B;  // [B]
  A* col_lse = row_lse + B;                 // [B]
  const A inv_tau = A(1) / A(tau);

  gemm(workspace, a, b, B, B, D, false, true, 1.0, 0.0, 1, 0, 0, 0, s);  // L_ij = a_i . b_j / tau
  L *= inv_tau;

  // log-sum-exp of every row (a_i against all b) and every column (b_j against all a)
  for (int i = 0; i < B; i++) {
    A m = L.row(i).maxCoeff();
    row_lse[i] = m + std::log((L.row(i).array() - m).exp().sum());
  }
  for (int j = 0; j < B; j++) {
    A m = L.col(j).maxCoeff();
    col_lse[j] = m + std::log((L.col(j).array() - m).exp().sum());
  }

  A row_loss = 0, col_loss = 0;
  for (int i = 0; i < B; i++) {
    row_loss += row_lse[i] - L(i, i);
    col_loss += col_lse[i] - L(i, i);
  }
  loss[0] = (row_loss / A(B) + col_loss / A(B)) / A(2);

  // dL_ij = (softmax_row + softmax_col - 2 [i == j]) / (2B), in place
  const A g = A(1) / (A(2) * A(B));
  for (int i = 0; i < B; i++)
    for (int j = 0; j < B; j++)
      L(i, j) = (exp_acc(L(i, j) - row_lse[i]) + exp_acc(L(i, j) - col_lse[j]) - A(2) * A(i == j)) * g;

  gemm(da, workspace, b, B, D, B, false, false, double(inv_tau), 0.0, 1, 0, 0, 0, s);  // da = dL b / tau
  gemm(db, workspace, a, B, D, B, true, false, double(inv_tau), 0.0, 1, 0, 0, 0, s);   // db = dL^T a / tau
}

#define LOOM_INSTANTIATE(T)                                                                      \
  template void patch_disc_loss<T>(acc_t<T>*, T*, const T*, const T*, int, int, int, double,     \
                                   acc_t<T>*, Stream);                                           \
  template void infonce_loss<T>(acc_t<T>*, T*, T*, const T*, const T*, int, int, double,          \
                                acc_t<T>*, Stream);
LOOM_INSTANTIATE(float)
LOOM_INSTANTIATE(double)
#undef LOOM_INSTANTIATE

}  // namespace loom::cpu
