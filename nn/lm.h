// lm.h: the Llama / SmolLM2-shaped decoder of SPEC §1: RMSNorm, grouped-query attention with
// RoPE (rotate-half), SwiGLU MLP, tied output head. Tokens are a flat packed stream [Ntok]
// with per-token positions and cu_seqlens: attention never crosses a document.
#pragma once
#include <memory>

#include "nn/module.h"

namespace loom {

struct LMConfig {
  int vocab = 49152, dim = 576, depth = 30, heads = 9, kv_heads = 3, hidden = 1536;
  double rope_theta = 100000.0, eps = 1e-5;
  int head_dim() const { return dim / heads; }
};

// Keys and values of earlier tokens, per layer, for generation: [cap, KV, hd] each.
struct KVCache {
  std::vector<Tensor> k, v;
  int64_t len = 0, cap = 0;
};

class LMBlock : public Module {
 public:
  LMBlock(const LMConfig& c, const Init& init);
  // x [Ntok, D], pos int32 [Ntok] -> [Ntok, D]
  Tensor forward(const Tensor& x, const Tensor& pos, const SeqInfo& seq) const;
  // Inside the stack: h = input_layernorm(x) from the layer before, and the layer ends with
  // the next norm (the next layer's input_layernorm or the final norm): -> {x_out,
  // next(x_out)} (next null: {x_out}, which is forward()). Both residual adds run inside the
  // products (linear's and mlp_swiglu's residual).
  std::vector<Tensor> forward_fused(const Tensor& x, const Tensor& h, const Tensor& pos, const SeqInfo& seq,
                                    const RMSNorm* next) const;
  // one sequence: x [n, D] are the tokens after the cache->len cached ones; appends their
  // keys/values into k_cache/v_cache rows [len, len + n) and attends over all len + n
  Tensor forward_cached(const Tensor& x, const Tensor& pos, Tensor& k_cache, Tensor& v_cache, int64_t len) const;
  LMConfig cfg;
  bool keep_swiglu = false;  // train.keep_swiglu: the MLP keeps silu(gate) up for the backward (mlp_swiglu)
  RMSNorm input_layernorm, post_attention_layernorm;
  Linear q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj;
};

class LM : public Module {
 public:
  LM(const LMConfig& c, const Init& init);
  // final hidden states [Ntok, D] from input embeddings x [Ntok, D]
  Tensor hidden(const Tensor& x, const Tensor& pos, const SeqInfo& seq) const;
  // mean next-token loss over targets >= 0, through the tied head without [Ntok, V] logits
  Tensor loss(const Tensor& h, const Tensor& targets) const;
  Tensor logits(const Tensor& h) const { return linear(h, embed_tokens); }
  KVCache make_cache(int64_t cap) const;
  // generation (no grad): hidden states [n, D] of n new tokens of one sequence, given the cache
  Tensor hidden_cached(const Tensor& x, KVCache& cache) const;
  LMConfig cfg;
  Tensor embed_tokens;  // [V, D]; state-dict name embed_tokens.weight
  std::vector<std::unique_ptr<LMBlock>> layers;
  bool checkpoint_blocks = false;  // gradient checkpointing: recompute each block in backward
  RMSNorm norm;
  // rows of the fused linear cross-entropy per chunk: its workspace, loss_chunk x V logits
  // (fp32; bf16 / f16 on CUDA), lives at the end of the forward, where the activations peak.
  // 4096 x 49152 bf16 = 0.4 GB, what 2048 rows held with fp32 logits (the default until
  // 2026-11-27); against 2048 the SPEC VLM step ran 58.45 / 58.12 -> 58.15 / 57.83 ms for
  // +192 MB of peak (H100, same call). Batches of <= 2048 rows (vlm_sft.cfg) are one chunk
  // either way.
  int64_t loss_chunk = 4096;

 private:
  Module embed_, layers_;
};

}  // namespace loom
