// ops_util.h: small helpers shared by the autograd/ops_*.cpp files (not a public header).
#pragma once
#include "autograd/ops.h"
#include "tensor/dispatch.h"

namespace loom {

// typed pointer, or null for an undefined tensor (optional kernel arguments)
template <class T> inline T* ptr(const Tensor& t) { return t.defined() ? t.data<T>() : nullptr; }

// out[N,O] = x W^T + b, plus resid when it is given (linear_forward_add: the residual read by
// the product) else linear_forward; inside a dispatch_float lambda
template <class T, class Dev>
void linear_out(Dev dev, T* out, const T* x, const T* w, const T* b, const T* resid, int64_t N, int I, int O) {
  if (resid) KERNEL(dev, linear_forward_add)(out, x, w, b, resid, N, I, O, stream_for(dev));
  else KERNEL(dev, linear_forward)(out, x, w, b, N, I, O, stream_for(dev));
}

// the common dtype and device of an op's floating inputs (undefined ones skipped)
inline void check_same(const char* op, std::initializer_list<Tensor> ts) {
  const Tensor* first = nullptr;
  for (auto& t : ts) {
    if (!t.defined()) continue;
    if (!first) { first = &t; continue; }
    LOOM_CHECK(t.dtype() == first->dtype() && t.device() == first->device(),
               "%s: mixed inputs %s and %s", op, first->desc().c_str(), t.desc().c_str());
  }
}

inline void check_index(const char* op, const Tensor& idx, const Tensor& like) {
  LOOM_CHECK(idx.dtype() == DType::I32, "%s: indices must be i32, got %s", op, idx.desc().c_str());
  LOOM_CHECK(idx.device() == like.device(), "%s: indices on %s, data on %s", op,
             device_name(idx.device()), device_name(like.device()));
}

// a fresh tensor of the accumulation dtype on t's device
inline Tensor acc_empty(const Shape& s, const Tensor& like) {
  return Tensor::empty(s, acc_dtype(like.dtype()), like.device());
}

// ops_joined.cpp: matrices one after another in memory as one [sum of rows, C] view (undefined
// when they are not), and mlp_swiglu's branch for gate and up stacked so (wgu)
Tensor stacked_view(const std::vector<Tensor>& ts);
Tensor mlp_swiglu_joined(const Tensor& x, const Tensor& w_gate, const Tensor& w_up, const Tensor& wgu,
                         const Tensor& w_down, const Tensor& residual, bool keep_product);

// ops_attention.cpp, for the ops that run the attention kernels (attention, qkv_rope_attention):
// out [Nq, H, hd] and lse [Nq, H] from contiguous q, k, v (attention_forward), and the backward's
// workspace for q's shape (delta [Nq, H]; on CUDA also the fp32 dq accumulator [Nq, H, hd])
struct AttentionOut {
  Tensor out, lse;
};
AttentionOut attention_rows(const Tensor& qc, const Tensor& kc, const Tensor& vc, const SeqInfo& seq, bool causal,
                            double scale);
Tensor attention_workspace(const Tensor& q);

}  // namespace loom
