// kernels.h: the one declaration of every op, shared by both backends.
//
// kernels/ knows nothing of Tensor or autograd: plain pointers, sizes and a stream.
// Argument order: outputs first, then inputs, then sizes, then the stream.
//
// The op list lives in kernels.inc and is included twice, into namespace loom::cpu and
// loom::cuda, so the CPU reference and the CUDA launcher have the same name and arguments by
// construction. Each backend explicitly instantiates the scalar types it supports:
//   cpu:  float, double          (double is what gradient checks and fixtures run in)
//   cuda: float, bf16            (bf16 activations with fp32 accumulation, or f32 end to end)
// Calling a combination that a backend does not instantiate is a link error, never a
// runtime surprise.
//
// Conventions used by every op:
//   T        activation / weight type; A = acc_t<T> is the statistics and loss type
//   `=`      an output that is overwritten      `+=`  an output that is accumulated into
//   Parameter gradients are `+=` (gradient accumulation across micro-batches and tied
//   weights); activation gradients are `=`.
//   Index arrays are int32 on every device. A target < 0 is ignored (the -100 convention).
//   Scalars that live on the device (loss, dloss, grad-norm scale) are `const A*` so that a
//   training step never waits on the host.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/scalar.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*; CPU kernels ignore the stream

namespace loom {

using Stream = CUstream_st*;

// A strided view of up to 8 dims, strides in elements. Used by the generic copy, broadcast
// and reduction kernels (contiguous(), permute, expand and their backward).
struct Layout {
  static constexpr int kMaxDims = 8;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t stride[kMaxDims] = {};
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    return n;
  }
};

enum class BinaryOp : uint8_t { Add, Sub, Mul, Div };
enum class UnaryOp : uint8_t { Neg, Exp, Log, Sqrt, Square, Abs };

// One tensor of a multi-tensor EMA update (ema_update_many): target = decay * target +
// (1 - decay) * source over n elements; copy (nullable) gets the new target in the copy's type.
template <class M, class G>
struct EmaTensor {
  M* target;
  G* copy;
  const M* source;
  int64_t n;
};

// The EMA adamw_ema_update runs in AdamW's pass: the group's elements [lo, hi) are its source;
// target [hi - lo] in M, copy (nullable) the new target in G.
template <class M, class G>
struct EmaRange {
  M* target;
  G* copy;
  int64_t lo, hi;
  double decay;
};
// adamw_ema_update's precondition, one error for both backends: [lo, hi) inside the n elements
template <class M, class G>
inline void check_ema_range(const EmaRange<M, G>& e, int64_t n) {
  if (!(0 <= e.lo && e.lo <= e.hi && e.hi <= n))
    throw std::runtime_error("adamw_ema_update: EMA range [" + std::to_string(e.lo) + ", " + std::to_string(e.hi) +
                             ") outside the group's " + std::to_string(n) + " elements");
}

// AdamW hyper-parameters for one parameter group; bias corrections come from `step` (1-based).
struct AdamWHyper {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.0f;
  int64_t step = 1;
};

namespace cpu {
#include "kernels/kernels.inc"
}  // namespace cpu

namespace cuda {
#include "kernels/kernels.inc"

// Runtime (kernels/cuda/runtime.cu; kernels/cuda_stub.cpp in CPU-only builds, where every
// call throws "built without CUDA").
bool available();                       // a device is present and usable
int device_count();
void* device_malloc(size_t bytes);      // caching allocator: no cudaMalloc in a training loop
void device_free(void* p);
void memcpy_h2d(void* dst, const void* src, size_t bytes, Stream s);
void memcpy_d2h(void* dst, const void* src, size_t bytes, Stream s);  // synchronizes s
void memcpy_d2d(void* dst, const void* src, size_t bytes, Stream s);
void memset_zero(void* dst, size_t bytes, Stream s);
// rows x width_bytes from src (row pitch spitch) to dst (row pitch dpitch), on the device:
// writes a narrow()ed window of a contiguous tensor (autograd's narrow backward)
void memcpy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width_bytes, size_t rows, Stream s);
void* pinned_malloc(size_t bytes);
void pinned_free(void* p);
void synchronize();
Stream default_stream();                // the stream loom's ops run on: main_stream(), or
                                        // side_stream() inside a side scope (this thread)
Stream main_stream();
// A second compute stream for work beside the step (a frozen vision tower's forward for the
// next batch). Between side_scope_begin() and side_scope_end() this thread's ops run on it and
// allocate from a pool of their own (allocator.cu's header): make side_stream() wait for an event
// recorded on main_stream() before the scope's work, and main_stream() for one recorded on
// side_stream() after it, before it reads what the scope made.
Stream side_stream();
void side_scope_begin();
void side_scope_end();
bool side_scope_active();
// A side branch within one step (allocator.cu's header): fork records `fork` on the main stream,
// makes the side stream wait for it and opens a side scope; end records `join` on the side
// stream and closes the scope; join makes the main stream wait for `join` and hands the memory
// the branch freed to the main stream's pool. Keep every tensor the branch reads alive until
// the join.
void side_branch_fork(void* fork);
void side_branch_end(void* join);
void side_branch_join(void* join);
size_t bytes_in_use();                  // allocator statistics for logs
size_t peak_bytes_in_use();
void reset_peak_bytes();
size_t bytes_reserved();                // held from the driver: in use + cached free blocks
size_t peak_bytes_reserved();           // since reset_peak_bytes()
// The GPU's energy counter (NVML's total energy of this process's device, J since the driver
// loaded), read through dlopen: loom neither links nor needs libnvidia-ml. -1 where there is no
// counter (no NVML on the machine, a GPU without one, a CPU-only build). Energy per step = the
// difference between two readings over the steps between them (metrics.jsonl's energy_j).
double device_energy_joules();
// A second stream for host-to-device uploads of the next batch while the default stream
// computes (created with cudaStreamNonBlocking: no implicit ordering with stream 0).
Stream copy_stream();
// A stream for data parallel's collectives beside the backward (trainer/grad_buckets.h): NCCL
// averages a bucket of gradients there once an event says the backward has written it.
Stream comm_stream();
// Events (opaque handles): order work between streams and time it without a host sync.
void* event_create(bool timing = false);
void event_destroy(void* e);
void event_record(void* e, Stream s);
void stream_wait_event(Stream s, void* e);   // later work on s waits for e (no host wait)
void event_synchronize(void* e);             // the host waits for e
bool event_done(void* e);                    // has e completed? (never waits)
float event_elapsed_ms(void* start, void* end);
// NVTX ranges (named spans on an nsys timeline): forward, backward, optimizer, each block.
void range_push(const char* name);
void range_pop();
// CUDA graphs of a whole training step. While the graph pool is on, the allocator serves
// allocations from (and returns frees to) a pool of its own: the addresses a captured graph
// uses stay the graph's, never handed to other code (a block the graph wrote once stays its
// own). release_cached() returns every unused cached block to the driver (synchronizes).
void graph_pool_begin();
void graph_pool_end();
void release_cached();
void graph_capture_begin(Stream s);   // records s's work (this thread) instead of running it
void* graph_capture_end(Stream s);    // -> an executable graph of what was recorded
void graph_launch(void* graph, Stream s);
void graph_destroy(void* graph);
// host -> device from page-locked memory: returns at once, the copy runs in stream order
void memcpy_h2d_async(void* dst, const void* src, size_t bytes, Stream s);
// device -> page-locked host memory: returns at once; read dst after an event on s
void memcpy_d2h_async(void* dst, const void* src, size_t bytes, Stream s);

// Attention backward (kernels/cuda/attention_bwd*.cu), bf16 at hd 64/128: by default one pass over
// the key tiles that adds dq with fp32 atomics (fast; dq differs from run to run in the last
// bits). Deterministic: the two-pass kernels, every output row written by one block, bitwise
// reproducible. LOOM_DETERMINISTIC=1 in the environment turns it on at start.
void set_deterministic_attention(bool on);
bool deterministic_attention();

// Which implementation runs attention_forward / attention_backward on CUDA (train.attention;
// kernels/cuda/attention_cudnn.cu): Loom, our kernels (the default; LOOM_ATTENTION=auto|loom|cudnn
// in the environment sets the start value); Cudnn, cuDNN's fused attention (bf16, head dims
// multiple of 16 up to 128, compute capability 9.0+; f32 inputs run through it in bf16; an
// unsupported case throws with the reason); Auto, per shape the faster of the two by a short
// timed probe the first time a shape is seen (cached for the process, logged once on stderr;
// unsupported cases and f32 stay on ours).
enum class AttentionBackend : uint8_t { Auto, Loom, Cudnn };
void set_attention_backend(AttentionBackend b);
AttentionBackend attention_backend();
const char* attention_backend_name(AttentionBackend b);
void reset_attention_choices();  // forget auto's per-shape choices (tests, benchmarks)
// cuDNN plans built for dense batches (every sequence max_seqlen long, one cu_seqlens for
// queries and keys), which run a graph without ragged offsets or padding mask (tests)
int attention_cudnn_dense_plans();
}  // namespace cuda

}  // namespace loom
