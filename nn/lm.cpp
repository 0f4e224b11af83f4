// lm.cpp: decoder blocks and the language model (SPEC §1).
#include "nn/lm.h"

#include <cmath>

namespace loom {

LMBlock::LMBlock(const LMConfig& c, const Init& init)
    : cfg(c), input_layernorm(c.dim, c.eps, init), post_attention_layernorm(c.dim, c.eps, init),
      q_proj(c.dim, c.heads * c.head_dim(), false, init), k_proj(c.dim, c.kv_heads * c.head_dim(), false, init),
      v_proj(c.dim, c.kv_heads * c.head_dim(), false, init), o_proj(c.heads * c.head_dim(), c.dim, false, init),
      gate_proj(c.dim, c.hidden, false, init), up_proj(c.dim, c.hidden, false, init),
      down_proj(c.hidden, c.dim, false, init) {
  LOOM_CHECK(c.dim % c.heads == 0 && c.heads % c.kv_heads == 0,
             "LM block: dim %d, heads %d, kv_heads %d must divide evenly", c.dim, c.heads, c.kv_heads);
  child("input_layernorm", input_layernorm);
  child("q_proj", q_proj);
  child("k_proj", k_proj);
  child("v_proj", v_proj);
  child("o_proj", o_proj);
  child("post_attention_layernorm", post_attention_layernorm);
  child("gate_proj", gate_proj);
  child("up_proj", up_proj);
  child("down_proj", down_proj);
}

Tensor LMBlock::forward(const Tensor& x, const Tensor& pos, const SeqInfo& seq) const {
  return forward_fused(x, input_layernorm.forward(x), pos, seq, nullptr)[0];
}

std::vector<Tensor> LMBlock::forward_fused(const Tensor& x, const Tensor& h, const Tensor& pos, const SeqInfo& seq,
                                           const RMSNorm* next) const {
  int hd = cfg.head_dim();
  // q, k, v from one input, RoPE on q and k, causal attention: one GEMM when the three weights
  // lie side by side (the optimizer's flat buffer), else three; the backward writes the joined
  // product's gradient rows itself (qkv_rope_attention)
  Tensor a = qkv_rope_attention(h, q_proj.weight, k_proj.weight, v_proj.weight, pos, seq, cfg.heads, cfg.kv_heads, hd,
                                cfg.rope_theta, 1.0 / std::sqrt(double(hd)));
  // r = x + o_proj(a) with the residual read by the product (cuBLASLt's C, beta = 1), then its
  // RMSNorm; out = r + down(...) likewise. The MLP's backward recomputes silu(gate) * up instead
  // of keeping it, unless keep_swiglu (mlp_swiglu); each norm's backward adds the residual
  // stream's other gradient.
  Tensor r = linear(a, o_proj.weight, o_proj.bias, x);
  Tensor out = mlp_swiglu(rmsnorm(r, post_attention_layernorm.weight, post_attention_layernorm.eps), gate_proj.weight,
                          up_proj.weight, down_proj.weight, r, keep_swiglu);
  if (!next) return {out};
  return {out, rmsnorm(out, next->weight, next->eps)};
}

Tensor LMBlock::forward_cached(const Tensor& x, const Tensor& pos, Tensor& k_cache, Tensor& v_cache,
                               int64_t len) const {
  int64_t n = x.size(0);
  int hd = cfg.head_dim();
  LOOM_CHECK(len + n <= k_cache.size(0), "KV cache of %lld tokens is full (%lld + %lld)", (long long)k_cache.size(0),
             (long long)len, (long long)n);
  Tensor h = input_layernorm.forward(x);
  Tensor q = rope(reshape(q_proj.forward(h), {n, cfg.heads, hd}), pos, cfg.rope_theta);
  Tensor k = rope(reshape(k_proj.forward(h), {n, cfg.kv_heads, hd}), pos, cfg.rope_theta);
  Tensor v = reshape(v_proj.forward(h), {n, cfg.kv_heads, hd});
  k_cache.narrow(0, len, n).copy_(k);
  v_cache.narrow(0, len, n).copy_(v);
  SeqInfo s;
  s.nseq = 1;
  s.max_seqlen = int(len + n);
  s.cu_q = Tensor::from_vector(std::vector<int32_t>{0, int32_t(n)}, {2}, x.device());
  s.cu_k = Tensor::from_vector(std::vector<int32_t>{0, int32_t(len + n)}, {2}, x.device());
  // causal attention is bottom-right aligned: new token t sees the cache and new tokens <= t
  Tensor a = attention(q, k_cache.narrow(0, 0, len + n), v_cache.narrow(0, 0, len + n), s, true,
                       1.0 / std::sqrt(double(hd)));
  Tensor r = add(x, o_proj.forward(reshape(a, {n, cfg.heads * hd})));
  Tensor m = post_attention_layernorm.forward(r);
  return add(r, down_proj.forward(swiglu(gate_proj.forward(m), up_proj.forward(m))));
}

KVCache LM::make_cache(int64_t cap) const {
  KVCache c;
  c.cap = cap;
  for (size_t i = 0; i < layers.size(); i++) {
    c.k.push_back(Tensor::zeros({cap, cfg.kv_heads, cfg.head_dim()}, embed_tokens.dtype(), embed_tokens.device()));
    c.v.push_back(Tensor::zeros({cap, cfg.kv_heads, cfg.head_dim()}, embed_tokens.dtype(), embed_tokens.device()));
  }
  return c;
}

Tensor LM::hidden_cached(const Tensor& x, KVCache& cache) const {
  NoGradGuard ng;
  int64_t n = x.size(0);
  std::vector<int32_t> pos(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; i++) pos[size_t(i)] = int32_t(cache.len + i);
  Tensor p = Tensor::from_vector(pos, {n}, x.device());
  Tensor h = x;
  for (size_t l = 0; l < layers.size(); l++) h = layers[l]->forward_cached(h, p, cache.k[l], cache.v[l], cache.len);
  cache.len += n;
  return norm.forward(h);
}

LM::LM(const LMConfig& c, const Init& init) : cfg(c), norm(c.dim, c.eps, init) {
  embed_tokens = init.normal({c.vocab, c.dim}, 0.02);
  embed_.param("weight", embed_tokens);
  child("embed_tokens", embed_);
  for (int i = 0; i < c.depth; i++) {
    layers.push_back(std::make_unique<LMBlock>(c, init));
    layers_.child(std::to_string(i), *layers.back());
  }
  child("layers", layers_);
  child("norm", norm);
}

Tensor LM::hidden(const Tensor& x, const Tensor& pos, const SeqInfo& seq) const {
  LOOM_CHECK(x.dim() == 2 && x.size(1) == cfg.dim && pos.numel() == x.size(0),
             "LM: expected x [Ntok, %d] and pos [Ntok], got %s and %s", cfg.dim, x.desc().c_str(), pos.desc().c_str());
  if (layers.empty()) return norm.forward(x);
  if (checkpoint_blocks) {  // a checkpointed layer keeps one tensor in and one out
    Tensor h = x;
    for (auto& l : layers) {
      ProfileRange r("lm block");
      const LMBlock* blk = l.get();
      h = checkpoint([blk, pos, seq](const Tensor& in) { return blk->forward(in, pos, seq); }, h);
    }
    return norm.forward(h);
  }
  // each layer hands the next its normed input (forward_fused): the same values
  std::vector<Tensor> h = {x, layers[0]->input_layernorm.forward(x)};
  for (size_t i = 0; i < layers.size(); i++) {
    ProfileRange r("lm block");
    h = layers[i]->forward_fused(h[0], h[1], pos, seq, i + 1 < layers.size() ? &layers[i + 1]->input_layernorm : &norm);
  }
  return h[1];
}

Tensor LM::loss(const Tensor& h, const Tensor& targets) const {
  return fused_linear_cross_entropy(h, embed_tokens, targets, loss_chunk);
}

}  // namespace loom
