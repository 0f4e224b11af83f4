// ops.h: the differentiable ops, each a forward that calls one kernel of kernels.inc and
// records its backward beside it (autograd/ops_*.cpp). Shapes in brackets; every op checks
// its inputs and throws with the shapes in the message.
//
// dtypes: floating inputs of one op share a dtype (f32/f64 on the CPU, f32/bf16 on CUDA);
// losses and statistics come out in the accumulation dtype (f64 for f64, else f32).
#pragma once
#include <vector>

#include "autograd/autograd.h"

namespace loom {

DType acc_dtype(DType t);  // F64 -> F64, else F32

// ---- views and shape (ops_basic.cpp)
Tensor reshape(const Tensor& x, const Shape& shape);
Tensor permute(const Tensor& x, const std::vector<int>& dims);
Tensor transpose(const Tensor& x, int a, int b);
Tensor narrow(const Tensor& x, int dim, int64_t start, int64_t length);
Tensor contiguous(const Tensor& x);
Tensor expand(const Tensor& x, const Shape& shape);  // broadcast, materialized
Tensor cast(const Tensor& x, DType dtype);           // differentiable dtype change

// ---- elementwise with numpy broadcasting (ops_basic.cpp)
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor scale(const Tensor& x, double s);
Tensor unary(const Tensor& x, UnaryOp op);  // neg, exp, log, sqrt, square, abs
inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator*(const Tensor& a, double s) { return scale(a, s); }
inline Tensor operator*(double s, const Tensor& a) { return scale(a, s); }

// ---- reductions (ops_basic.cpp)
Tensor sum(const Tensor& x);                      // scalar [1], accumulation dtype
Tensor mean(const Tensor& x);                     // scalar [1]
Tensor sum_to(const Tensor& x, const Shape& shape);  // sum over broadcast dims (non-differentiable helper)
Tensor mean_pool(const Tensor& x);                // [B, K, C] -> [B, C]

// ---- dense layers (ops_nn.cpp; qkv_rope and the joined branch of mlp_swiglu: ops_joined.cpp)
// x [..., I], weight [O, I], bias [O] or undefined -> [..., O]; with `residual` [..., O]:
// residual + x W^T + b, the residual block's add carried by the product (cuBLASLt's C with
// beta = 1: no separate add pass, the sum rounded once)
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(), const Tensor& residual = Tensor());
// x [..., I], weight [P*O, I], bias [P*O] or undefined -> P tensors [..., O], part p = x W_p^T
// + b_p with W_p rows [p*O, (p+1)*O): the fused QKV projection, split without copies (each
// part its own GEMM with the bias in the epilogue, each output contiguous).
std::vector<Tensor> linear_split(const Tensor& x, const Tensor& weight, const Tensor& bias, int parts);
// Several linears of one input (q/k/v projections, gate/up): outputs [..., O_i]. The backward
// sums the input gradient inside the GEMMs (beta = 1) instead of with add kernels.
std::vector<Tensor> linear_many(const Tensor& x, const std::vector<Tensor>& weights, const std::vector<Tensor>& biases = {});
// The transformer MLP fc2(gelu(fc1(x))): x [..., C], w1 [H, C], b1 [H], w2 [C2, H], b2 [C2]
// (biases may be undefined) -> [..., C2]. The GELU runs in fc1's GEMM epilogue and its backward
// in the epilogue of fc2's input-gradient GEMM; only x and the pre-activation are saved (the
// activation is recomputed in backward: one elementwise pass instead of N*H kept), unless
// keep_activation: then the activation fc1's GEMM wrote is kept for fc2's weight gradient
// (N*H more memory until the backward, one pass less; the GEMM epilogue's GELU and
// gelu_forward's may differ in the last bit).
// With `residual` [..., C2]: residual + fc2(gelu(fc1(x))), the add in fc2's product (linear).
Tensor mlp_gelu(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
                const Tensor& residual = Tensor(), bool keep_activation = false);
// The Llama MLP down(silu(gate(x)) * up(x)): x [..., C], w_gate and w_up [I, C], w_down
// [C2, I] (no biases) -> [..., C2]. Saves x, gate(x) and up(x) but not their product: the
// backward recomputes it (one elementwise pass) for w_down's gradient, so a layer keeps N*I
// fewer elements between forward and backward than swiglu + linear would, unless
// keep_product: then the product the forward made is kept for w_down's gradient (N*I more
// memory until the backward; the backward's SwiGLU gradient writes dgate | dup only).
// When w_gate and w_up lie side by side in memory (the optimizer's flat buffers place them so)
// both run as one GEMM against [w_gate; w_up] (and one each in the backward).
// With `residual` [..., C2]: residual + down(...), the add in down's product (as linear's).
Tensor mlp_swiglu(const Tensor& x, const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down,
                  const Tensor& residual = Tensor(), bool keep_product = false);
// A Llama layer's attention inputs: q = rope(x Wq^T), k = rope(x Wk^T), v = x Wv^T, as
// [N, H, hd], [N, KV, hd], [N, KV, hd] (x [N, C], pos int32 [N]). When Wq, Wk, Wv lie side by
// side in memory, one GEMM writes q|k|v per row and one pass splits the rows into q, k rotated
// and v (rope_qkv_split); the backward joins dq, dk, dv into that layout in one pass
// (rope_qkv_join) and runs one GEMM for dx and one for the weights. Else linear_many + rope.
// The same values either way up to the GEMMs' summation order.
std::vector<Tensor> qkv_rope(const Tensor& x, const Tensor& wq, const Tensor& wk, const Tensor& wv, const Tensor& pos,
                             int heads, int kv_heads, int head_dim, double theta);
// a [..., M, K] @ b [..., K, N] (b may be 2-D and shared); transposes read a^T / b^T.
Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a = false, bool trans_b = false);
// The norms' backward adds a gradient already waiting on x (a residual stream's other one:
// pending_grad) inside its own pass.
Tensor layernorm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps);
Tensor rmsnorm(const Tensor& x, const Tensor& weight, double eps);
// A residual add and the next norm in one pass: {h = x + y, layernorm(h)} and {h = x + y,
// rmsnorm(h)}, for a y that no product makes (the ViT and Llama blocks add inside their
// products instead: linear's residual).
std::vector<Tensor> add_layernorm(const Tensor& x, const Tensor& y, const Tensor& weight, const Tensor& bias, double eps);
std::vector<Tensor> add_rmsnorm(const Tensor& x, const Tensor& y, const Tensor& weight, double eps);
Tensor gelu(const Tensor& x);   // tanh approximation
Tensor silu(const Tensor& x);
Tensor swiglu(const Tensor& gate, const Tensor& up);  // silu(gate) * up
Tensor softmax(const Tensor& x);  // over the last dim
// ids int32 [...], table [V, C] -> [..., C]
Tensor embedding(const Tensor& ids, const Tensor& table);

// ---- indexing and layout (ops_index.cpp)
// x [B, N, C], idx int32 [B, K] -> [B, K, C]. distinct: the caller promises no index repeats
// within a b (then the backward sets rows instead of adding them in k order: one thread per
// element instead of one per (b, c) column)
Tensor gather_rows(const Tensor& x, const Tensor& idx, bool distinct = false);
// base [B, N, C] with rows idx [B, K] replaced by src [B, K, C] (indices distinct per b)
Tensor scatter_rows(const Tensor& base, const Tensor& idx, const Tensor& src);
// images [B, Ch, H, W] -> [B, (H/p)(W/p), p*p*Ch]   (SPEC §1 order)
Tensor patchify(const Tensor& images, int p);
// [B, G*G, D] -> [B, (G/s)^2, s*s*D]                 (SPEC §1 order)
Tensor pixel_shuffle(const Tensor& x, int s);
// x [N, H, hd], pos int32 [N]
Tensor rope(const Tensor& x, const Tensor& pos, double theta);
Tensor l2_normalize(const Tensor& x, double eps = 1e-12);  // over the last dim

// ---- attention (ops_attention.cpp)
// Packed sequences: cu_q / cu_k int32 [nseq + 1] offsets into the token rows (on the device
// of q), with host-side nseq and max_seqlen (so no launch waits on the device).
struct SeqInfo {
  Tensor cu_q, cu_k;
  int nseq = 0, max_seqlen = 0;
  // B rows of T tokens each, one sequence per row
  static SeqInfo dense(int B, int T, Device device);
  // from host offsets (the same for queries and keys)
  static SeqInfo packed(const std::vector<int32_t>& cu_seqlens, Device device);
};
// q [Nq, H, hd], k, v [Nk, KV, hd] -> [Nq, H, hd]
Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const SeqInfo& seq, bool causal,
                 double scale);
// A Llama layer's causal self-attention from its input: attention(qkv_rope(x, ...), seq, causal,
// scale) as [N, H hd], one node (ops_joined.cpp). With the three weights side by side and one
// cu_seqlens for queries and keys, the backward writes the gradient of the joined product's rows
// (rope^-1(dq) | rope^-1(dk) | dv) in the attention backward itself (attention_backward_qkv)
// instead of dq, dk, dv and a pass that joins them; else the two ops.
Tensor qkv_rope_attention(const Tensor& x, const Tensor& wq, const Tensor& wk, const Tensor& wv, const Tensor& pos,
                          const SeqInfo& seq, int heads, int kv_heads, int head_dim, double theta, double scale);
// A ViT block's bidirectional self-attention from its normed input: q, k, v = linear_split(x,
// weight, bias, 3) (weight [3 H hd, C]: q's rows, k's, v's), then attention(q, k, v, seq,
// causal = false, scale) as [N, H hd], one node (ops_joined.cpp). Forward as the two ops; the
// backward writes dq | dk | dv as the rows of one [N, 3 H hd] gradient (attention_backward_qkv
// without RoPE), so that the projection's dx is one product over K = 3 H hd (not three that
// accumulate), its dweight one product and its dbias one column sum. LOOM_QKV_ATTENTION=0: the
// two ops.
Tensor qkv_attention(const Tensor& x, const Tensor& weight, const Tensor& bias, const SeqInfo& seq, int heads,
                     double scale);

// ---- losses (ops_loss.cpp): scalars [1] in the accumulation dtype
// logits [N, V], targets int32 [N] (< 0 ignored): mean CE over valid rows
Tensor cross_entropy(const Tensor& logits, const Tensor& targets);
// h [N, D], W [V, D]: cross_entropy(h W^T, targets) without ever holding [N, V]
Tensor fused_linear_cross_entropy(const Tensor& h, const Tensor& W, const Tensor& targets,
                                  int64_t chunk = 4096);
// pred, target [B, M, D] (target gets no gradient)
Tensor patch_disc_loss(const Tensor& pred, const Tensor& target, double tau);
// a, b [B, D] already normalized; symmetric InfoNCE
Tensor infonce_loss(const Tensor& a, const Tensor& b, double tau);

}  // namespace loom
