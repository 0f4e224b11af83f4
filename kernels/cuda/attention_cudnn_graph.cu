/*
 * attention_cudnn_graph.cu: the SDPA graph of the cuDNN attention backend, built tensor by
 * tensor with cuDNN 9's backend descriptor API, its plans (one per bucket, cached for the
 * process) and their execution. The calls, the checks and the auto choice are in
 * attention_cudnn.cu (read its header first); shapes and conventions are attention.cu's.
 *
 * The graph is the one the cuDNN frontend assembles for SDPA (its composite node), built here
 * tensor by tensor: the fused-attention engines recognise that pattern.
 *   Layout THD: every tensor is 4-d [B, heads, S, hd] with strides [-, hd, heads * hd, 1] and
 *   a ragged offset tensor [B + 1] (int32, in elements: cu[b] * heads * hd; lse: cu[b] * H),
 *   so cuDNN reads and writes our packed rows in place. B = nseq rounded up to a power of two
 *   and S = max_seqlen rounded up to a power of two (>= 64): the extra sequences have length 0;
 *   one plan serves every batch of a bucket (packed batches vary nseq and max_seqlen).
 *   seq_len_q / seq_len_kv [B] int32 give each sequence's Lq, Lk (the padding mask).
 *   Dense buckets (Key::dense: every sequence max_seqlen long, as in a ViT batch or a padded
 *   benchmark) drop the offsets, the lengths and the padding mask, B and S are exact, and the
 *   causal mask is row >= col: the plain graph cuDNN's SDPA engines see from PyTorch.
 *   forward:  S = Q K^T (m, n overridden by seq_len_q / seq_len_kv) * scale
 *             -> padding mask (row < Lq and col < Lk, else -inf)
 *             -> causal: keep row + Lk - Lq >= col, else -inf (bottom right)
 *             -> softmax: M = max, E = exp(S - M), L = sum E, lse = M + log L (saved), P = E / L (bf16)
 *             -> O = P V
 *   backward: delta = rowsum(dO * O) (fp32, in our workspace [Nq, H] after dq_acc, ragged like lse)
 *             S as above, minus lse, masks, E = exp (= P); dV = P^T dO (GQA: per query head, then
 *             summed over the group by a reduction); dP = dO V^T; dS = E (dP - delta) scale;
 *             dK = dS^T Q (GQA likewise); dq_acc = dS K (fp32, our workspace [Nq, H, hd], ragged
 *             like dq; cuDNN zeroes it) -> dQ = identity(dq_acc) in bf16.
 *   Joined rows (a dense backward with Key::ld): dQ, dK, dV strided [-, hd, ld, 1], i.e. written
 *   straight into the column blocks of one [N, ld] gradient (a ViT block's q | k | v product's).
 * Plans: built the first time a (direction, B, S, H, KV, hd, causal, ld) bucket is seen (get_plan),
 *   with a small device buffer for the per-call sequence lengths and offsets; one workspace
 *   serves every plan, grown at plan building; execute() keeps the variant pack while the
 *   call's pointers stay the same.
 * Test: tests/cuda/test_cuda_attention_cudnn.cpp.
 */
#include <array>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/cuda/attention_cudnn.cuh"

#if LOOM_HAVE_CUDNN

namespace loom::cuda {

[[noreturn]] void cudnn_fail(const char* expr, cudnnStatus_t s, const char* file, int line) {
  char detail[1024] = "";
  cudnnGetLastErrorString(detail, sizeof detail);
  std::string msg = cudnnGetErrorString(s);
  if (detail[0]) msg += std::string("; ") + detail;
  fail("cuDNN", expr, msg.c_str(), file, line);
}

namespace cudnn_sdpa {
namespace {

using Dims = std::array<int64_t, 4>;

// ---------------------------------------------------------------------------- graph builder
class GraphBuilder {
 public:
  GraphBuilder(cudnnHandle_t h, Descs* keep) : handle_(h), keep_(keep) {}

  D make(cudnnBackendDescriptorType_t t) {
    D d = nullptr;
    CUDNN_CHECK(cudnnBackendCreateDescriptor(t, &d));
    keep_->all.push_back(d);
    return d;
  }

  D tensor(int64_t uid, cudnnDataType_t dt, Dims dim, Dims stride, bool is_virtual, bool by_value = false,
           D ragged = nullptr) {
    D t = make(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t align = 16;
    const bool virt = is_virtual, byv = by_value;
    SET_ATTR(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    SET_ATTR(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt);
    SET_ATTR(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dim.data());
    SET_ATTR(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, stride.data());
    SET_ATTR(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align);
    SET_ATTR(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &virt);
    if (by_value) SET_ATTR(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &byv);
    if (ragged) SET_ATTR(t, CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &ragged);
    CUDNN_CHECK(cudnnBackendFinalize(t));
    return t;
  }
  D virt(cudnnDataType_t dt, Dims dim, Dims stride, D ragged = nullptr) {
    return tensor(next_uid_++, dt, dim, stride, true, false, ragged);
  }
  D scalar(int64_t uid, cudnnDataType_t dt) { return tensor(uid, dt, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true); }

  // y = mode(x[, b][, t]); axis >= 0 for GEN_INDEX and the index arithmetic of the masks
  D pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t comp, D x, D b, D t, D y, int64_t axis = -1) {
    D pw = make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    SET_ATTR(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    SET_ATTR(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &comp);
    if (axis >= 0) SET_ATTR(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    CUDNN_CHECK(cudnnBackendFinalize(pw));
    D op = make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    const float one = 1.f;
    SET_ATTR(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw);
    SET_ATTR(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    SET_ATTR(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one);
    SET_ATTR(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one);
    if (b) SET_ATTR(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
    if (t) SET_ATTR(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t);
    SET_ATTR(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    CUDNN_CHECK(cudnnBackendFinalize(op));
    ops_.push_back(op);
    return y;
  }

  // c = a b per batch and head; m/n/k overrides: the per-sequence row / column / inner counts
  D matmul(D a, D b, D c, D m_over, D n_over, D k_over, bool pad_zero = false) {
    D mm = make(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    SET_ATTR(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
    if (pad_zero) {
      const double pad = 0.0;
      SET_ATTR(mm, CUDNN_ATTR_MATMUL_PADDING_VALUE, CUDNN_TYPE_DOUBLE, 1, &pad);
    }
    CUDNN_CHECK(cudnnBackendFinalize(mm));
    D op = make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    SET_ATTR(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a);
    SET_ATTR(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
    SET_ATTR(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c);
    SET_ATTR(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &mm);
    if (m_over) SET_ATTR(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &m_over);
    if (n_over) SET_ATTR(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n_over);
    if (k_over) SET_ATTR(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &k_over);
    CUDNN_CHECK(cudnnBackendFinalize(op));
    ops_.push_back(op);
    return c;
  }

  D reduction(cudnnReduceTensorOp_t red, D x, D y) {
    D rd = make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    SET_ATTR(rd, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &red);
    SET_ATTR(rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
    CUDNN_CHECK(cudnnBackendFinalize(rd));
    D op = make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    SET_ATTR(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &rd);
    SET_ATTR(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    SET_ATTR(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    CUDNN_CHECK(cudnnBackendFinalize(op));
    ops_.push_back(op);
    return y;
  }

  D reshape(D x, D y) {
    D op = make(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    SET_ATTR(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    SET_ATTR(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    CUDNN_CHECK(cudnnBackendFinalize(op));
    ops_.push_back(op);
    return y;
  }

  // The operation graph, the heuristics' engine configs (mode A, then the fallback list) and
  // the first execution plan that finalizes. Returns nullptr (with the reason) when none does.
  D plan(int64_t* workspace, std::string* why) {
    D graph = make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    SET_ATTR(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, int64_t(ops_.size()), ops_.data());
    SET_ATTR(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle_);
    CUDNN_CHECK(cudnnBackendFinalize(graph));
    std::string tried;
    for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
      D heur = make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
      SET_ATTR(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph);
      SET_ATTR(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
      if (cudnnBackendFinalize(heur) != CUDNN_STATUS_SUCCESS) continue;
      int64_t count = 0;
      CUDNN_CHECK(cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0,
                                           &count, nullptr));
      std::vector<D> cfgs(size_t(std::max<int64_t>(count, 0)));
      for (auto& c : cfgs) c = make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
      int64_t got = 0;
      if (count > 0)
        CUDNN_CHECK(cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                             count, &got, cfgs.data()));
      for (int64_t i = 0; i < got; i++) {
        D p = make(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
        SET_ATTR(p, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle_);
        SET_ATTR(p, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfgs[size_t(i)]);
        const cudnnStatus_t st = cudnnBackendFinalize(p);
        if (st != CUDNN_STATUS_SUCCESS) {
          char detail[512] = "";
          cudnnGetLastErrorString(detail, sizeof detail);
          tried += std::string(" [") + cudnnGetErrorString(st) + (detail[0] ? std::string(": ") + detail : "") + "]";
          continue;
        }
        int64_t ws = 0;
        CUDNN_CHECK(cudnnBackendGetAttribute(p, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1,
                                             nullptr, &ws));
        *workspace = ws;
        return p;
      }
      tried += " (heuristics mode " + std::to_string(int(mode)) + ": " + std::to_string(got) + " configs)";
    }
    *why = "no cuDNN engine can run this attention graph:" + tried;
    return nullptr;
  }

 private:
  cudnnHandle_t handle_;
  Descs* keep_;
  std::vector<D> ops_;
  int64_t next_uid_ = kVirtual;
};

}  // namespace

cudnnHandle_t handle() {
  static cudnnHandle_t h = [] {
    cudnnHandle_t x = nullptr;
    CUDNN_CHECK(cudnnCreate(&x));
    return x;
  }();
  return h;
}

int pow2_at_least(int x, int lo) {
  int p = lo;
  while (p < x) p *= 2;
  return p;
}

namespace {

// ---------------------------------------------------------------------------- plans
// The SDPA graph of one bucket (see the header comment for the math and the layout).
void build_graph(Plan& P, const Key& k) {
  GraphBuilder g(handle(), &P.descs);
  const int64_t B = k.B, S = k.S, H = k.H, KV = k.KV, hd = k.hd;
  const cudnnDataType_t BF = CUDNN_DATA_BFLOAT16, F = CUDNN_DATA_FLOAT, I32 = CUDNN_DATA_INT32,
                        BOOL = CUDNN_DATA_BOOLEAN;
  // dense: the same strides without offsets (sequence b starts at row b S), no lengths
  auto ragged = [&](int64_t uid) {
    return k.dense ? nullptr : g.tensor(uid, I32, {B + 1, 1, 1, 1}, {1, 1, 1, 1}, false);
  };
  D off_q = ragged(kOffQ), off_k = ragged(kOffK), off_lse = ragged(kOffLse);
  D seq_q = k.dense ? nullptr : g.tensor(kSeqQ, I32, {B, 1, 1, 1}, {1, 1, 1, 1}, false);
  D seq_kv = k.dense ? nullptr : g.tensor(kSeqKV, I32, {B, 1, 1, 1}, {1, 1, 1, 1}, false);
  D scale = g.scalar(kScale, F), neg_inf = g.scalar(kNegInf, F);
  const Dims q_dim{B, H, S, hd}, q_str{S * H * hd, hd, H * hd, 1};
  const Dims kv_dim{B, KV, S, hd}, kv_str{S * KV * hd, hd, KV * hd, 1};
  const Dims kt_dim{B, KV, hd, S}, kt_str{S * KV * hd, hd, 1, KV * hd};  // K^T (and V^T) views
  const Dims lse_dim{B, H, S, 1}, lse_str{S * H, 1, H, 1};
  const Dims s_dim{B, H, S, S}, s_str{H * S * S, S * S, S, 1}, st_str{H * S * S, S * S, 1, S};
  const Dims row_dim{B, H, S, 1}, row_str{H * S, S, 1, 1};
  D q = g.tensor(kQ, BF, q_dim, q_str, false, false, off_q);
  D kt = g.tensor(kK, BF, kt_dim, kt_str, false, false, off_k);
  D lse = g.tensor(kLse, F, lse_dim, lse_str, false, false, off_lse);
  D o = g.tensor(kO, BF, q_dim, q_str, false, false, off_q);

  // scores, scale, padding mask, bottom-right causal mask: shared by both directions
  D s = g.matmul(q, kt, g.virt(F, s_dim, s_str), seq_q, seq_kv, nullptr, !k.backward && !k.dense);
  s = g.pointwise(CUDNN_POINTWISE_MUL, F, s, scale, nullptr, g.virt(F, s_dim, s_str));
  auto padding_mask = [&](D x) {
    D row = g.pointwise(CUDNN_POINTWISE_GEN_INDEX, I32, x, nullptr, nullptr, g.virt(I32, s_dim, s_str), 2);
    D col = g.pointwise(CUDNN_POINTWISE_GEN_INDEX, I32, x, nullptr, nullptr, g.virt(I32, s_dim, s_str), 3);
    D rm = g.pointwise(CUDNN_POINTWISE_CMP_LT, BOOL, row, seq_q, nullptr, g.virt(BOOL, s_dim, s_str));
    D cm = g.pointwise(CUDNN_POINTWISE_CMP_LT, BOOL, col, seq_kv, nullptr, g.virt(BOOL, s_dim, s_str));
    D m = g.pointwise(CUDNN_POINTWISE_LOGICAL_AND, BOOL, rm, cm, nullptr, g.virt(BOOL, s_dim, s_str));
    return g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, F, x, neg_inf, m, g.virt(F, s_dim, s_str));
  };
  auto causal_mask = [&](D x) {  // keep row + Lk - Lq >= col (dense: Lq = Lk, keep row >= col)
    if (k.dense) {
      D row = g.pointwise(CUDNN_POINTWISE_GEN_INDEX, F, x, nullptr, nullptr, g.virt(I32, s_dim, s_str), 2);
      D col = g.pointwise(CUDNN_POINTWISE_GEN_INDEX, F, x, nullptr, nullptr, g.virt(I32, s_dim, s_str), 3);
      D keep = g.pointwise(CUDNN_POINTWISE_CMP_GE, BOOL, row, col, nullptr, g.virt(BOOL, s_dim, s_str));
      return g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, F, x, neg_inf, keep, g.virt(F, s_dim, s_str));
    }
    D row = g.pointwise(CUDNN_POINTWISE_GEN_INDEX, F, x, nullptr, nullptr, g.virt(I32, s_dim, s_str), 2);
    D col = g.pointwise(CUDNN_POINTWISE_GEN_INDEX, F, x, nullptr, nullptr, g.virt(I32, s_dim, s_str), 3);
    row = g.pointwise(CUDNN_POINTWISE_ADD, I32, row, seq_kv, nullptr, g.virt(I32, s_dim, s_str), 3);
    row = g.pointwise(CUDNN_POINTWISE_SUB, I32, row, seq_q, nullptr, g.virt(I32, s_dim, s_str), 3);
    D keep = g.pointwise(CUDNN_POINTWISE_CMP_GE, BOOL, row, col, nullptr, g.virt(BOOL, s_dim, s_str));
    return g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, F, x, neg_inf, keep, g.virt(F, s_dim, s_str));
  };
  if (!k.dense) s = padding_mask(s);

  if (!k.backward) {
    if (k.causal) s = causal_mask(s);
    D v = g.tensor(kV, BF, kv_dim, kv_str, false, false, off_k);
    D mx = g.reduction(CUDNN_REDUCE_TENSOR_MAX, s, g.virt(F, row_dim, row_str));
    D z = g.pointwise(CUDNN_POINTWISE_SUB, F, s, mx, nullptr, g.virt(F, s_dim, s_str));
    D e = g.pointwise(CUDNN_POINTWISE_EXP, F, z, nullptr, nullptr, g.virt(F, s_dim, s_str));
    D l = g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, g.virt(F, row_dim, row_str));
    D lg = g.pointwise(CUDNN_POINTWISE_LOG, F, l, nullptr, nullptr, g.virt(F, row_dim, row_str));
    g.pointwise(CUDNN_POINTWISE_ADD, F, mx, lg, nullptr, lse);
    D p = g.pointwise(CUDNN_POINTWISE_DIV, F, e, l, nullptr, g.virt(BF, s_dim, s_str));
    g.matmul(p, v, o, seq_q, nullptr, seq_kv);
  } else {
    D vt = g.tensor(kV, BF, kt_dim, kt_str, false, false, off_k);
    D dout = g.tensor(kDO, BF, q_dim, q_str, false, false, off_q);
    // the gradients: packed like q, k, v, or (k.ld, dense only) column blocks of joined rows
    const int64_t ld = k.ld;
    const Dims joined{S * ld, hd, ld, 1}, dq_str = ld ? joined : q_str, dkv_str = ld ? joined : kv_str;
    D dq = g.tensor(kDQ, BF, q_dim, dq_str, false, false, off_q);
    D dk = g.tensor(kDK, BF, kv_dim, dkv_str, false, false, off_k);
    D dv = g.tensor(kDV, BF, kv_dim, dkv_str, false, false, off_k);
    D one = g.scalar(kOne, F);
    // delta = rowsum(dO * O), stored like lse (our workspace)
    D t = g.pointwise(CUDNN_POINTWISE_MUL, F, dout, o, nullptr, g.virt(F, q_dim, {H * S * hd, S * hd, H * hd, 1}));
    t = g.reduction(CUDNN_REDUCE_TENSOR_ADD, t, g.virt(F, row_dim, row_str));
    D delta = g.pointwise(CUDNN_POINTWISE_MUL, F, t, one, nullptr,
                          g.tensor(kDelta, F, lse_dim, lse_str, false, false, off_lse));
    // P = exp(S - lse) with the masks
    s = g.pointwise(CUDNN_POINTWISE_SUB, F, s, lse, nullptr, g.virt(F, s_dim, s_str));
    if (k.causal) s = causal_mask(s);
    D e = g.pointwise(CUDNN_POINTWISE_EXP, F, s, nullptr, nullptr, g.virt(F, s_dim, s_str));
    // dV = P^T dO (summed over the query heads of a group)
    const Dims full_dim{B, H, S, hd}, full_str{H * S * hd, S * hd, hd, 1};
    D pt = g.reshape(e, g.virt(BF, s_dim, st_str));
    if (H == KV) {
      g.matmul(pt, dout, dv, seq_kv, nullptr, seq_q);
    } else {
      D full = g.matmul(pt, dout, g.virt(BF, full_dim, full_str), seq_kv, nullptr, seq_q);
      g.reduction(CUDNN_REDUCE_TENSOR_ADD, full, dv);
    }
    // dS = E (dO V^T - delta) scale
    D dp = g.matmul(dout, vt, g.virt(F, s_dim, s_str), seq_q, seq_kv, nullptr);
    dp = g.pointwise(CUDNN_POINTWISE_SUB, F, dp, delta, nullptr, g.virt(F, s_dim, s_str));
    dp = g.pointwise(CUDNN_POINTWISE_MUL, F, dp, e, nullptr, g.virt(F, s_dim, s_str));
    D ds = g.pointwise(CUDNN_POINTWISE_MUL, F, dp, scale, nullptr, g.virt(F, s_dim, s_str));
    // dK = dS^T Q
    D dst = g.reshape(ds, g.virt(BF, s_dim, st_str));
    if (H == KV) {
      g.matmul(dst, q, dk, seq_kv, nullptr, seq_q);
    } else {
      D full = g.matmul(dst, q, g.virt(BF, full_dim, full_str), seq_kv, nullptr, seq_q);
      g.reduction(CUDNN_REDUCE_TENSOR_ADD, full, dk);
    }
    // dQ = dS K through the fp32 accumulator (our workspace)
    D kk = g.reshape(kt, g.virt(BF, kv_dim, kv_str, off_k));
    D acc = g.tensor(kDQAcc, F, q_dim, q_str, false, false, off_q);
    g.matmul(ds, kk, acc, seq_q, nullptr, seq_kv);
    g.pointwise(CUDNN_POINTWISE_IDENTITY, F, acc, nullptr, nullptr, dq);
  }
  std::string why;
  P.plan = g.plan(&P.workspace_bytes, &why);
  if (!P.plan) P.error = why;
}

std::mutex& plans_mu() {
  static std::mutex m;
  return m;
}
std::map<Key, std::unique_ptr<Plan>>& plans() {
  static auto* m = new std::map<Key, std::unique_ptr<Plan>>();  // leaked: outlives the driver teardown
  return *m;
}

// One workspace for every plan (calls run in stream order), grown to the largest plan's need.
// A grown-out workspace is kept, not freed: a captured CUDA graph (trainer/staging.h) holds
// the address it ran with, and a plan built later for a new shape (an eager step, an
// evaluation) must not hand that memory to other code while the graph still replays into it.
void*& workspace_ptr() {
  static void* p = nullptr;
  return p;
}
size_t& workspace_size() {
  static size_t n = 0;
  return n;
}
void grow_workspace(size_t bytes) {
  if (bytes <= workspace_size()) return;
  static std::vector<void*> retired;  // see above: never freed while the process runs
  if (workspace_ptr()) retired.push_back(workspace_ptr());
  workspace_ptr() = device_malloc(bytes);
  workspace_size() = bytes;
}

}  // namespace

// The plan of a bucket, built on first use. Throws on a cuDNN API error; a graph no engine
// supports comes back with P.error set.
Plan& get_plan(const Key& k) {
  std::lock_guard<std::mutex> lock(plans_mu());
  auto& slot = plans()[k];
  if (!slot) {
    auto P = std::make_unique<Plan>();
    build_graph(*P, k);
    if (P->plan) {
      grow_workspace(size_t(P->workspace_bytes));
      P->meta = static_cast<int32_t*>(device_malloc(sizeof(int32_t) * size_t(5 * k.B + 3)));
    }
    slot = std::move(P);
  }
  return *slot;
}

Plan* find_plan(const Key& k) {
  std::lock_guard<std::mutex> lock(plans_mu());
  auto it = plans().find(k);
  return it == plans().end() ? nullptr : it->second.get();
}

int dense_plans() {
  std::lock_guard<std::mutex> lock(plans_mu());
  int n = 0;
  for (auto& [k, P] : plans()) n += k.dense && P && P->plan;
  return n;
}

// ptrs: device pointers, and the plan's own scalars (by value) at stable addresses
void execute(Plan& P, const std::vector<int64_t>& uids, std::vector<void*> ptrs, cudaStream_t s) {
  CUDNN_CHECK(cudnnSetStream(handle(), s));
  ptrs.push_back(workspace_ptr());
  if (!P.pack || ptrs != P.pack_ptrs) {
    if (P.pack) {
      cudnnBackendDestroyDescriptor(P.pack);
      P.pack_desc.all.clear();
      P.pack = nullptr;
    }
    D pack = nullptr;
    CUDNN_CHECK(cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack));
    P.pack_desc.all.push_back(pack);
    void* ws = ptrs.back();
    SET_ATTR(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, int64_t(uids.size()), uids.data());
    SET_ATTR(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, int64_t(uids.size()), ptrs.data());
    SET_ATTR(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
    CUDNN_CHECK(cudnnBackendFinalize(pack));
    P.pack = pack;
    P.pack_ptrs = ptrs;
  }
  CUDNN_CHECK(cudnnBackendExecute(handle(), P.plan, P.pack));
}

}  // namespace cudnn_sdpa
}  // namespace loom::cuda

#endif  // LOOM_HAVE_CUDNN
