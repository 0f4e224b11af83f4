// ops_attention.cpp: packed (varlen), grouped-query, causal or bidirectional attention.
#include <map>
#include <mutex>
#include <tuple>

#include "autograd/ops_util.h"

namespace loom {

SeqInfo SeqInfo::dense(int B, int T, Device device) {
  // Cached per (B, T, device): the offsets are uploaded once, not at every forward (an upload
  // from pageable memory waits for the GPU), and a captured step finds them in place.
  static std::mutex mu;
  static std::map<std::tuple<int, int, int>, SeqInfo> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_tuple(B, T, int(device));
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  std::vector<int32_t> cu(size_t(B) + 1);
  for (int b = 0; b <= B; b++) cu[size_t(b)] = b * T;
  SeqInfo s = packed(cu, device);
  cache.emplace(key, s);
  return s;
}

SeqInfo SeqInfo::packed(const std::vector<int32_t>& cu, Device device) {
  LOOM_CHECK(cu.size() >= 2 && cu[0] == 0, "cu_seqlens must start at 0 and hold at least one sequence");
  SeqInfo s;
  s.nseq = int(cu.size()) - 1;
  for (size_t i = 1; i < cu.size(); i++) {
    LOOM_CHECK(cu[i] >= cu[i - 1], "cu_seqlens must be non-decreasing (entry %zu: %d < %d)", i, cu[i], cu[i - 1]);
    s.max_seqlen = std::max(s.max_seqlen, cu[i] - cu[i - 1]);
  }
  s.cu_q = Tensor::from_vector(cu, {int64_t(cu.size())}, device);
  s.cu_k = s.cu_q;
  return s;
}

AttentionOut attention_rows(const Tensor& qc, const Tensor& kc, const Tensor& vc, const SeqInfo& seq, bool causal,
                            double scale) {
  const int64_t Nq = qc.size(0), Nk = kc.size(0);
  const int H = int(qc.size(1)), KV = int(kc.size(1)), hd = int(qc.size(2));
  AttentionOut r{Tensor::empty_like(qc), acc_empty({Nq, H}, qc)};
  dispatch_float(qc, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, attention_forward)(r.out.data<T>(), r.lse.data<acc_t<T>>(), qc.data<T>(), kc.data<T>(), vc.data<T>(),
                                   seq.cu_q.data<int32_t>(), seq.cu_k.data<int32_t>(), seq.nseq, seq.max_seqlen, Nq,
                                   Nk, H, KV, hd, causal, scale, stream_for(dev));
  });
  return r;
}

Tensor attention_workspace(const Tensor& q) {
  return acc_empty({q.size(0), q.size(1), q.is_cuda() ? q.size(2) + 1 : 1}, q);
}

Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const SeqInfo& seq, bool causal, double scale) {
  check_same("attention", {q, k, v});
  LOOM_CHECK(q.dim() == 3 && k.dim() == 3 && v.shape() == k.shape() && q.size(2) == k.size(2) &&
                 k.size(1) > 0 && q.size(1) % k.size(1) == 0,
             "attention: expected q [Nq, H, hd], k and v [Nk, KV, hd] with H %% KV == 0, got %s, %s, %s",
             q.desc().c_str(), k.desc().c_str(), v.desc().c_str());
  check_index("attention", seq.cu_q, q);
  check_index("attention", seq.cu_k, q);
  int64_t Nq = q.size(0), Nk = k.size(0);
  int H = int(q.size(1)), KV = int(k.size(1)), hd = int(q.size(2));
  Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  AttentionOut fwd = attention_rows(qc, kc, vc, seq, causal, scale);
  Tensor out = fwd.out, lse = fwd.lse;
  if (any_requires_grad({q, k, v}))
    record("attention", {out}, [q, k, v, qc, kc, vc, out, lse, seq, Nq, Nk, H, KV, hd, causal, scale]() {
      Tensor g = grad_of(out).contiguous();
      // q, k and v of one shape (a ViT's): their gradients one after another in one buffer, so
      // that the qkv projection's backward takes its three weight gradients in one batched GEMM
      // (linear_parts)
      Tensor dq, dk, dv;
      if (qc.shape() == kc.shape()) {
        Tensor d3 = Tensor::empty({3, qc.numel()}, qc.dtype(), qc.device());
        dq = d3.narrow(0, 0, 1).view(qc.shape());
        dk = d3.narrow(0, 1, 1).view(qc.shape());
        dv = d3.narrow(0, 2, 1).view(qc.shape());
      } else {
        dq = Tensor::empty_like(qc), dk = Tensor::empty_like(kc), dv = Tensor::empty_like(vc);
      }
      Tensor ws = attention_workspace(qc);
      dispatch_float(g, [&](auto dev, auto zero) {
        using T = decltype(zero);
        using A = acc_t<T>;
        KERNEL(dev, attention_backward)(dq.data<T>(), dk.data<T>(), dv.data<T>(), g.data<T>(), qc.data<T>(),
                                        kc.data<T>(), vc.data<T>(), out.data<T>(), lse.data<A>(), ws.data<A>(),
                                        seq.cu_q.data<int32_t>(), seq.cu_k.data<int32_t>(), seq.nseq, seq.max_seqlen,
                                        Nq, Nk, H, KV, hd, causal, scale, stream_for(dev));
      });
      accumulate_grad(q, dq, true);
      accumulate_grad(k, dk, true);
      accumulate_grad(v, dv, true);
    });
  return out;
}

}  // namespace loom
