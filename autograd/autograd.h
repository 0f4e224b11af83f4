// autograd.h: tape-based reverse-mode differentiation.
//
// While grad mode is on, every differentiable op whose inputs require grad appends one Node to
// the tape: a closure holding exactly what its backward needs. The recording order is a
// topological order, so backward() walks the tape in reverse: no graph search.
//
// Gradients: parameters (leaves) accumulate (`+=`) across backward calls until zeroed, which
// is what gradient accumulation over micro-batches needs. Activation gradients are created by
// the first consumer that contributes and added to by the rest, and are freed as soon as
// their producer's backward has run.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace loom {

bool grad_enabled();
// Disables recording in a scope (EMA target forward, evaluation, generation).
struct NoGradGuard {
  NoGradGuard();
  ~NoGradGuard();
  bool prev;
};

// True when grad mode is on and any of the inputs requires grad: the op must record.
bool any_requires_grad(std::initializer_list<Tensor> inputs);

// Appends a node producing `outputs` (they become requires_grad non-leaves) with its backward.
void record(const char* name, std::initializer_list<Tensor> outputs, std::function<void()> backward);
void record(const char* name, const std::vector<Tensor>& outputs, std::function<void()> backward);

// Gradient checkpointing: runs fn(x) without recording and records one node whose backward
// runs fn again with recording on (on a tape of its own) and back-propagates through it, so
// the activations inside fn are not kept from the forward to the backward. fn must compute the
// same function both times (no randomness of its own); its parameters get their gradients.
Tensor checkpoint(const std::function<Tensor(const Tensor&)>& fn, const Tensor& x);

// Runs backward from a scalar loss (seed 1) or from `seed` (same shape as `root`), then
// clears the tape.
void backward(const Tensor& root, const Tensor& seed = Tensor());
// Loss scaling (fp16 training): the trainer seeds backward with its loss scale S (a device f32
// [1], never read on the host) and sets it here, so ops that compute a gradient in their
// forward pass (the fused linear cross-entropy) store it for dloss = S, above f16's underflow,
// and multiply by dloss / S in backward. Undefined (the default): they store it for dloss = 1.
void set_loss_scale(const Tensor& scale);
const Tensor& loss_scale();
// Drops the tape without running backward (evaluation forwards that recorded, errors).
void clear_tape();
size_t tape_size();

// ---- for backward closures
// The gradient that flowed into x (undefined when none did: the op may skip work).
Tensor grad_of(const Tensor& x);
// x.grad += g, or x.grad = g when x has none yet. `fresh` says g is a new buffer nobody else
// holds, which x may then take over; otherwise it is copied (a gradient passed through to two
// inputs must not become one shared buffer).
void accumulate_grad(const Tensor& x, const Tensor& g, bool fresh = false);
// For a backward kernel that can add a gradient into its output (the norms' dresid): x's
// gradient so far when x is an activation whose gradient the kernel may fold in (contiguous,
// x's dtype), else undefined. The caller then hands its output to x with replace_grad, which
// holds that sum: one pass instead of the output plus an add (a residual stream's two
// gradients, the pass-through of the next residual add and the norm's own).
Tensor pending_grad(const Tensor& x);
void replace_grad(const Tensor& x, const Tensor& g);
// x's gradient buffer for a `+=` kernel, created as zeros when absent. Undefined when x does
// not require grad (the kernel then skips that output: pass a null pointer). With `is_new`
// given, an absent buffer is created uninitialized and *is_new says so: the caller's kernel
// must then write (`=`) every element instead of adding (one pass over memory less).
Tensor grad_buffer(const Tensor& x, bool* is_new = nullptr);

// ---- weight gradients beside the backward (train.side_weight_grads)
// A layer's backward computes its input's gradient, which the next node waits for, and its
// weights' gradients, which only the optimizer reads. While this is on (CUDA, outside a side
// scope, not profiling), weight_grads(keep, fn) runs fn, the products that add into weight
// gradient buffers, as a side branch (kernels.h: side_branch_fork .. side_branch_end) on the
// side stream, beside the main stream's next nodes. What a branch reads, `keep`, is released
// once the main stream has waited for it: for all but the last two branches when the next one
// starts, for all of them every 8 branches, before a main-stream write to gradient bytes a
// branch writes, and at the end of backward() (weight_grads_join). fn must read only what its
// closure holds in `keep` and write only buffers taken with weight_grad_buffer(). Off (until
// set_side_weight_grads(true); the trainers follow train.side_weight_grads, on by default), on
// the CPU and everywhere else, fn runs in place: the same kernels in the same order, so the
// same bits.
void set_side_weight_grads(bool on);
bool side_weight_grads();
// The open branches the main stream lets run before it waits for the older ones (default 2;
// train.side_weight_grads_lag): a larger lag overlaps more and holds what more branches read.
void set_side_weight_grads_lag(int lag);
void weight_grads(const std::vector<Tensor>& keep, const std::function<void()>& fn);
// grad_buffer for a weight whose gradient a weight_grads() branch writes. A plain grad_buffer()
// or accumulate_grad() of such a leaf (the main stream writing it) joins the branches first.
Tensor weight_grad_buffer(const Tensor& x);
void weight_grads_join();  // the main stream waits for every branch so far (no-op when none)
// Stream s waits for every branch so far (no-op when none), the main stream does not: for a
// reader of weight gradients on a stream of its own while the backward goes on (data parallel's
// bucket averages, trainer/grad_buckets.h wait_for_gradient_writes). A gradient whose last write
// is in a branch is complete on the host (its node is done) before it is on the device.
void weight_grads_wait(Stream s);

// ---- watching the backward (data parallel's gradient buckets, trainer/grad_buckets.h)
// While set (on this thread), leaf_written(x) is called whenever a backward closure is about
// to write or add to the gradient of leaf x (grad_buffer, accumulate_grad), and node_done()
// after each node's backward has run (the nested tapes of checkpoint() included). A leaf's
// gradient is complete after the node_done() that follows its last leaf_written() on the host;
// on the device its last write may still be running in a weight-gradient branch (CUDA,
// train.side_weight_grads): a reader on another stream waits for them with weight_grads_wait.
class BackwardObserver {
 public:
  virtual ~BackwardObserver() = default;
  virtual void leaf_written(const Tensor& leaf) = 0;
  virtual void node_done() = 0;
};
void set_backward_observer(BackwardObserver* o);  // nullptr: none
BackwardObserver* backward_observer();

// ---- profiling (--train.profile=1)
// While on, the GPU work of a step is cut at every recorded op, after every backward node and
// at every profile_phase(), by CUDA events on the default stream (nothing waits inside the
// step). Each interval is charged to the op's category (forward or backward column: attention,
// linear, norms, activations, loss, other) or to the named phase, and profile_step_end() waits
// once for the step and adds them up, so the table sums to the GPU time of the steps. Work
// that records no op (a no-grad forward such as the EMA target's) is charged to the next op.
// On the CPU, host clocks at the same points. profile_add() adds host time (loader waits).
void profile_enable(bool on);
bool profile_enabled();
void profile_mark();                                       // a step starts here
void profile_phase(const std::string& category);           // the work since the last cut was this
void profile_add(const std::string& category, double ms);  // host time, e.g. waiting for the loader
void profile_step_end();
std::string profile_report();  // the table, ms per step (the first 2 steps, warm-up, left out)
void profile_reset();

// A named span on an nsys timeline (NVTX; nothing without CUDA).
struct ProfileRange {
  explicit ProfileRange(const char* name);
  ~ProfileRange();
  ProfileRange(const ProfileRange&) = delete;
  ProfileRange& operator=(const ProfileRange&) = delete;
};

}  // namespace loom
