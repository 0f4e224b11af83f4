// gemm_sm90.h: the host entry points of gemm_sm90.cu, products of our own on Hopper (TMA + wgmma;
// bias, GELU, a residual add, DGELU, the SwiGLU or its gradient, RoPE of a joined q|k|v in the
// epilogue). matmul.cu's cuBLASLt path is the reference contract and the fallback; the .cu's
// header says what it takes and why.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace loom::cuda::gemm90 {

// Built with sm_90a code and running on a compute-capability 9.0 device.
bool available();
// available(), and the call meets the kernel's contract: I % 8 == 0, O % 8 == 0, inp, weight, out
// pre and resid 16-byte aligned, bias 4-byte aligned (null pointers pass).
bool supported(const void* out, const void* pre, const void* resid, const void* inp, const void* weight,
               const void* bias, int64_t N, int I, int O);
// out[N,O] = inp[N,I] weight[O,I]^T + bias[O] (bias nullable) + resid[N,O] (nullable; may be
// out itself); gelu (without resid): pre = the product + bias (nullable: not written) and out =
// gelu(pre), the tanh approximation. Every element of out is written.
void linear_forward(__nv_bfloat16* out, __nv_bfloat16* pre, const __nv_bfloat16* inp, const __nv_bfloat16* weight,
                    const __nv_bfloat16* bias, const __nv_bfloat16* resid, int64_t N, int I, int O, bool gelu,
                    cudaStream_t s);
// The joined gate | up product of a SwiGLU MLP with the activation in its epilogue:
// gu[N, 2I] = inp[N, C] wgu[2I, C]^T (rows [0, I) of wgu the gate's weight, [I, 2I) up's) and
// h[N, I] = silu(gu[:, :I]) gu[:, I:], bit for bit what swiglu_forward_joined makes of gu.
// swiglu_supported: available(), C % 8 == 0, I % 64 == 0, all four pointers 16-byte aligned.
bool swiglu_supported(const void* gu, const void* h, const void* inp, const void* wgu, int64_t N, int C, int I);
void linear_swiglu_forward(__nv_bfloat16* gu, __nv_bfloat16* h, const __nv_bfloat16* inp, const __nv_bfloat16* wgu,
                           int64_t N, int C, int I, cudaStream_t s);
// dpre[N, I] = (dout[N, O] weight[O, I]) * gelu'(pre[N, I]) (linear_dgelu_backward's product; the
// bias gradient is not taken). dgelu_supported: available(), I % 8 == 0, O % 8 == 0, every
// pointer 16-byte aligned.
bool dgelu_supported(const void* dpre, const void* dout, const void* weight, const void* pre, int64_t N, int I, int O);
void linear_dgelu(__nv_bfloat16* dpre, const __nv_bfloat16* dout, const __nv_bfloat16* weight,
                  const __nv_bfloat16* pre, int64_t N, int I, int O, cudaStream_t s);
// Its backward through the down projection, the SwiGLU's gradient in the epilogue:
// dh = dout[N, C2] wd[C2, I] (not written), dgu[N, 2I] = (dgate | dup) of dh, and prod[N, I] =
// silu(gate) up (nullable), bit for bit what swiglu_backward_joined makes of dh rounded to bf16.
// swiglu_bwd_supported: available(), C2 % 8 == 0, I % 64 == 0, every pointer 16-byte aligned.
bool swiglu_bwd_supported(const void* dgu, const void* prod, const void* dout, const void* wd, const void* gu,
                          int64_t N, int C2, int I);
void linear_swiglu_backward(__nv_bfloat16* dgu, __nv_bfloat16* prod, const __nv_bfloat16* dout,
                            const __nv_bfloat16* wd, const __nv_bfloat16* gu, int64_t N, int C2, int I, cudaStream_t s);

// A joined q | k | v product with RoPE in its epilogue (head dim 64): the product of inp[N, C]
// and w[(H + 2 KV) 64, C]^T (rows of w: q's H heads, then k's KV, then v's KV) goes out as
// q[N, H, 64] and k[N, KV, 64] rotated by the positions pos[N] and v[N, KV, 64] as is, bit for bit
// what rope_qkv_split makes of the product rounded to bf16 (this kernel's product: its sums may
// differ from cuBLASLt's in the last bit). table / table_rows: rope_table's (cos, sin) of head
// dim 64 and this theta (rope_table.h); positions outside [0, table_rows) (or every position, with
// a null table) form their angles in double as rope.cu's kernels do.
// qkv_rope_supported: available(), hd == 64, C % 8 == 0, all five pointers 16-byte aligned.
bool qkv_rope_supported(const void* q, const void* k, const void* v, const void* inp, const void* w, int64_t N, int C,
                        int H, int KV, int hd);
void linear_qkv_rope(__nv_bfloat16* q, __nv_bfloat16* k, __nv_bfloat16* v, const __nv_bfloat16* inp,
                     const __nv_bfloat16* w, const int32_t* pos, const float2* table, int table_rows, int64_t N, int C,
                     int H, int KV, int hd, double theta, cudaStream_t s);

}  // namespace loom::cuda::gemm90
