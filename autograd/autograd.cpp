// autograd.cpp: the tape (see autograd.h).
#include "autograd/autograd.h"

#include <chrono>
#include <cstdlib>
#include <map>
#include <unordered_set>

#include "tensor/dispatch.h"

namespace loom {

namespace {
struct Node {
  const char* name;
  std::vector<std::shared_ptr<TensorImpl>> outputs;
  std::function<void()> backward;
};
thread_local std::vector<Node> g_tape;
thread_local bool g_grad_enabled = true;
thread_local BackwardObserver* g_observer = nullptr;
}  // namespace

void set_backward_observer(BackwardObserver* o) { g_observer = o; }
BackwardObserver* backward_observer() { return g_observer; }

// ------------------------------------------------------------------ profiling
namespace {
struct Cut {
  std::string category;
  int column;  // 0 forward (or a phase), 1 backward
  void* start;
  void* end;
};
bool g_profile = false;
bool g_profile_gpu = false;
double g_mark = 0;                 // CPU: host clock of the last cut
void* g_last_event = nullptr;      // CUDA: event of the last cut
std::vector<void*> g_events;       // pool, reused every step
size_t g_next_event = 0;
std::vector<Cut> g_cuts;
std::map<std::string, std::pair<double, double>> g_prof;  // category -> (forward ms, backward ms)
int64_t g_prof_steps = 0;          // steps ended, warm-up included
constexpr int64_t kProfileWarmup = 2;  // the first steps (allocations, plans, first launches) are left out
double host_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
std::string category_of(const std::string& op) {
  if (op == "attention") return "attention";
  // the joined nodes: one q|k|v product and the attention (and RoPE) as one op (ops_joined.cpp)
  if (op == "qkv_attention" || op == "qkv_rope_attention") return "attention with its q|k|v product";
  if (op == "linear" || op == "matmul" || op == "qkv_rope") return "linear (MLP, projections)";
  if (op == "layernorm" || op == "rmsnorm" || op == "l2_normalize") return "norms";
  if (op == "gelu" || op == "silu" || op == "swiglu" || op == "softmax") return "activations";
  if (op.find("cross_entropy") != std::string::npos || op == "patch_disc_loss" || op == "infonce_loss") return "loss";
  if (op == "checkpoint") return "recomputed blocks (checkpointing)";
  return "other (views, adds, indexing, rope)";
}
void* next_event() {
  if (g_next_event == g_events.size()) g_events.push_back(cuda::event_create(true));
  return g_events[g_next_event++];
}
void cut(const std::string& category, int column) {
  if (g_prof_steps < kProfileWarmup && !g_profile_gpu) {  // CPU warm-up: advance the clock only
    g_mark = host_ms();
    return;
  }
  if (g_profile_gpu) {
    void* e = next_event();
    cuda::event_record(e, cuda::default_stream());
    if (g_last_event) g_cuts.push_back({category, column, g_last_event, e});
    g_last_event = e;
  } else {
    double t = host_ms();
    auto& slot = g_prof[category];
    (column ? slot.second : slot.first) += t - g_mark;
    g_mark = t;
  }
}
}  // namespace

void profile_enable(bool on) {
  g_profile = on;
  g_profile_gpu = on && cuda::available();
}
bool profile_enabled() { return g_profile; }
void profile_mark() {
  if (!g_profile) return;
  if (g_profile_gpu) {
    g_last_event = next_event();
    cuda::event_record(g_last_event, cuda::default_stream());
  } else {
    g_mark = host_ms();
  }
}
void profile_phase(const std::string& category) {
  if (g_profile) cut(category, 0);
}
void profile_add(const std::string& category, double ms) {
  if (g_profile && g_prof_steps >= kProfileWarmup) g_prof[category].first += ms;
}
void profile_step_end() {
  if (!g_profile) return;
  g_prof_steps++;
  if (!g_profile_gpu) return;
  if (g_last_event) cuda::event_synchronize(g_last_event);
  if (g_prof_steps <= kProfileWarmup) g_cuts.clear();
  for (auto& c : g_cuts) {
    auto& slot = g_prof[c.category];
    (c.column ? slot.second : slot.first) += cuda::event_elapsed_ms(c.start, c.end);
  }
  g_cuts.clear();
  g_next_event = 0;
  g_last_event = nullptr;
}
void profile_reset() {
  g_prof.clear();
  g_prof_steps = 0;
}
std::string profile_report() {
  double total = 0;
  for (auto& [k, v] : g_prof) total += v.first + v.second;
  const int64_t counted = std::max<int64_t>(g_prof_steps - kProfileWarmup, 1);
  const double n = double(counted);
  std::string s = strformat("profile (ms per step over %lld steps after %lld of warm-up; forward | backward | share; %s):\n",
                            (long long)counted, (long long)kProfileWarmup,
                            g_profile_gpu ? "GPU time between CUDA events" : "host time");
  char b[200];
  for (auto& [k, v] : g_prof) {
    std::snprintf(b, sizeof b, "  %-38s %9.2f | %9.2f | %5.1f%%\n", k.c_str(), v.first / n, v.second / n,
                  100 * (v.first + v.second) / std::max(total, 1e-9));
    s += b;
  }
  std::snprintf(b, sizeof b, "  %-38s %9.2f\n", "total", total / n);
  return s + b;
}

ProfileRange::ProfileRange(const char* name) { cuda::range_push(name); }
ProfileRange::~ProfileRange() { cuda::range_pop(); }

// ------------------------------------------------------------------ weight gradients beside
namespace {
// The bytes a tensor view covers: its storage and [lo, hi) in bytes from the storage's start
// (the first and one past the last element it can address; a strided view covers its gaps).
struct ByteRange {
  const void* storage = nullptr;
  int64_t lo = 0, hi = 0;
  bool overlaps(const ByteRange& o) const { return storage == o.storage && lo < o.hi && o.lo < hi; }
};
ByteRange byte_range(const Tensor& t) {
  ByteRange r;
  if (!t.defined() || t.numel() == 0) return r;
  const TensorImpl& m = *t.impl();
  int64_t last = m.offset;
  for (size_t d = 0; d < m.shape.size(); d++) last += (m.shape[d] - 1) * m.strides[d];
  const int64_t es = int64_t(dtype_size(m.dtype));
  r.storage = m.storage.get();
  r.lo = m.offset * es;
  r.hi = (last + 1) * es;
  return r;
}
struct WeightGrads {
  bool on = false;
  int pending = 0;                     // branches since the last join
  void* fork = nullptr;                // events, reused: a wait takes the latest record
  void* join = nullptr;
  std::vector<Tensor> keep;            // what the pending branches read, released at the join
  std::vector<ByteRange> written;      // gradient bytes the pending branches write
  std::vector<ByteRange> staged;       // ... taken by weight_grad_buffer in the running node
  bool in_branch = false;
};
thread_local WeightGrads g_wg;
// Branches between joins. Each join makes the main stream wait for every branch so far; a
// larger count lets the side stream trail further behind, and holds what the branches read
// (their output gradients and inputs) that much longer. In a ViT block the norms' and the MLP's
// main-stream bias writes join first (join_if_branch_writes below), so the count matters for
// the Llama blocks (3 branches; their products have no biases, so the norms do not join): the VLM step
// on the reference's batch 0.19 ms faster than one stream with 2, 0.05 with 8, both within its
// noise (H200, 2026-12-06, bench/RESULTS.md). LOOM_WGRAD_JOIN overrides it (measurement).
int join_every() {
  static const int n = [] {
    const char* e = std::getenv("LOOM_WGRAD_JOIN");
    return e && std::atoi(e) > 0 ? std::atoi(e) : 8;
  }();
  return n;
}
}  // namespace

void set_side_weight_grads(bool on) {
  if (!on) weight_grads_join();
  g_wg.on = on;
}
bool side_weight_grads() { return g_wg.on; }

void weight_grads(const std::vector<Tensor>& keep, const std::function<void()>& fn) {
  bool on_cuda = false;
  for (auto& t : keep) on_cuda = on_cuda || (t.defined() && t.device() == Device::CUDA);
  if (!g_wg.on || !on_cuda || g_wg.in_branch || g_profile || cuda::side_scope_active()) {
    fn();
    return;
  }
  if (g_wg.pending >= join_every()) weight_grads_join();
  // after that join: the buffers the node's branches write stay marked until the next one
  g_wg.written.insert(g_wg.written.end(), g_wg.staged.begin(), g_wg.staged.end());
  if (!g_wg.fork) {
    g_wg.fork = cuda::event_create();
    g_wg.join = cuda::event_create();
  }
  cuda::side_branch_fork(g_wg.fork);
  g_wg.in_branch = true;
  auto end = [] {
    g_wg.in_branch = false;
    cuda::side_branch_end(g_wg.join);
    g_wg.pending++;
  };
  try {
    fn();
  } catch (...) {
    end();
    throw;
  }
  end();
  for (auto& t : keep)
    if (t.defined()) g_wg.keep.push_back(t);
}

Tensor weight_grad_buffer(const Tensor& x) {
  struct NoJoin {  // grad_buffer joins for nothing: a branch, not the main stream, writes it
    bool was = g_wg.in_branch;
    NoJoin() { g_wg.in_branch = true; }
    ~NoJoin() { g_wg.in_branch = was; }
  };
  Tensor b;
  {
    NoJoin guard;
    b = grad_buffer(x);
  }
  if (b.defined() && g_wg.on && b.device() == Device::CUDA) g_wg.staged.push_back(byte_range(b));
  return b;
}

void weight_grads_join() {
  if (g_wg.pending > 0) cuda::side_branch_join(g_wg.join);
  g_wg.pending = 0;
  g_wg.keep.clear();  // on the host after the wait is enqueued: later main-stream reuse waits too
  g_wg.written.clear();
}

// the main stream is about to write x's gradient: join first when a pending branch writes it.
// Keyed by the gradient's bytes, not its storage: the optimizer's flat buffers hold a group's
// gradients in one storage (trainer/params.cpp: the 1-D group has the linears' biases and the
// norms' gains), and keyed by storage every norm's backward joined, and a ViT MLP's (its DGELU
// product adds fc1's bias gradient on the main stream): three joins a ViT block. Two writers
// of disjoint bytes of one buffer need no order.
static void join_if_branch_writes(const Tensor& x) {
  if (g_wg.pending == 0 || g_wg.in_branch || !x.grad().defined()) return;
  const ByteRange r = byte_range(x.grad());
  for (auto& w : g_wg.written)
    if (w.overlaps(r)) {
      weight_grads_join();
      return;
    }
}

bool grad_enabled() { return g_grad_enabled; }
NoGradGuard::NoGradGuard() : prev(g_grad_enabled) { g_grad_enabled = false; }
NoGradGuard::~NoGradGuard() { g_grad_enabled = prev; }

bool any_requires_grad(std::initializer_list<Tensor> inputs) {
  if (!g_grad_enabled) return false;
  for (auto& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

void record(const char* name, std::initializer_list<Tensor> outputs, std::function<void()> backward) {
  record(name, std::vector<Tensor>(outputs), std::move(backward));
}

void record(const char* name, const std::vector<Tensor>& outputs, std::function<void()> backward) {
  if (g_profile) cut(category_of(name), 0);  // this op's forward ran since the previous cut
  Node n{name, {}, std::move(backward)};
  for (auto& t : outputs) {
    t.impl()->requires_grad = true;
    t.impl()->tape_id = int64_t(g_tape.size());
    n.outputs.push_back(t.impl());
  }
  g_tape.push_back(std::move(n));
}

size_t tape_size() { return g_tape.size(); }

void clear_tape() {
  for (auto& n : g_tape)
    for (auto& o : n.outputs) o->tape_id = -1;
  g_tape.clear();
}

Tensor grad_of(const Tensor& x) { return x.grad(); }

// A norm's backward folds the gradient already waiting on its input into its own output
// (autograd.h): pending_grad hands it over, replace_grad installs the sum.
Tensor pending_grad(const Tensor& x) {
  if (!x.defined() || !x.requires_grad() || x.impl()->tape_id < 0) return Tensor();  // leaves: the caller's buffer
  Tensor cur = x.grad();
  if (!cur.defined() || !cur.is_contiguous() || cur.dtype() != x.dtype() || cur.shape() != x.shape()) return Tensor();
  return cur;
}

void replace_grad(const Tensor& x, const Tensor& g) {
  LOOM_CHECK(x.impl()->tape_id >= 0 && g.shape() == x.shape() && g.dtype() == x.dtype() && g.is_contiguous(),
             "replace_grad: gradient %s for tensor %s", g.desc().c_str(), x.desc().c_str());
  x.impl()->grad = g.impl();  // a new buffer holding the old gradient plus this node's: owned
}

// Gradients are passed on without copies where possible. A gradient handed to an input is
// either taken over (`fresh`: the caller's new buffer, or the output's gradient that dies right
// after this node) or aliased (the same buffer also reaches another input, as in add). An
// aliased buffer is marked grad_shared on its storage and never updated in place: the next
// contribution to it is added out of place into a new buffer (copy on write). In a residual
// block this replaces a copy per add with nothing. Leaves (parameters, inputs) never alias:
// their .grad belongs to the caller.
void accumulate_grad(const Tensor& x, const Tensor& g, bool fresh) {
  if (!x.defined() || !x.requires_grad() || !g.defined()) return;
  LOOM_CHECK(g.shape() == x.shape(), "gradient %s for tensor %s", g.desc().c_str(), x.desc().c_str());
  if (g_observer && x.impl()->tape_id < 0) g_observer->leaf_written(x);
  if (x.impl()->tape_id < 0) join_if_branch_writes(x);
  Tensor cur = x.grad();
  Tensor gg = g.dtype() == x.dtype() ? g : g.to(x.dtype());
  if (!cur.defined()) {
    const bool owned = fresh && gg.same(g);
    if (!gg.is_contiguous()) {
      x.impl()->grad = gg.contiguous().impl();  // a new buffer: owned
    } else if (x.impl()->tape_id < 0) {
      // a leaf: its .grad is the caller's to read and write, so it never aliases another
      x.impl()->grad = (owned && !gg.impl()->storage->grad_shared ? gg : gg.clone()).impl();
    } else {
      if (!owned) gg.impl()->storage->grad_shared = true;  // an activation: aliased, not copied
      x.impl()->grad = gg.impl();
    }
    return;
  }
  Tensor gc = gg.contiguous();
  if (cur.impl()->storage->grad_shared || !cur.is_contiguous()) {  // copy on write
    Tensor sum = Tensor::empty(cur.shape(), cur.dtype(), cur.device());
    Tensor cc = cur.contiguous();
    dispatch_float(cur, [&](auto dev, auto zero) {
      using T = decltype(zero);
      KERNEL(dev, axpby)(sum.data<T>(), cc.data<T>(), 1.0, gc.data<T>(), 1.0, cur.numel(), stream_for(dev));
    });
    x.impl()->grad = sum.impl();
    return;
  }
  dispatch_float(cur, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, axpby)(cur.data<T>(), cur.data<T>(), 1.0, gc.data<T>(), 1.0, cur.numel(), stream_for(dev));
  });
}

Tensor grad_buffer(const Tensor& x, bool* is_new) {
  if (is_new) *is_new = false;
  if (!x.defined() || !x.requires_grad()) return Tensor();
  join_if_branch_writes(x);
  if (!x.grad().defined() && is_new) {
    x.impl()->grad = Tensor::empty(x.shape(), x.dtype(), x.device()).impl();
    *is_new = true;
  } else if (!x.grad().defined()) x.impl()->grad = Tensor::zeros_like(x).impl();
  else if (x.grad().impl()->storage->grad_shared) x.impl()->grad = x.grad().clone().impl();  // about to be written
  if (g_observer && x.impl()->tape_id < 0) g_observer->leaf_written(x);
  return x.grad();
}

Tensor checkpoint(const std::function<Tensor(const Tensor&)>& fn, const Tensor& x) {
  if (!g_grad_enabled) return fn(x);
  Tensor out;
  {
    NoGradGuard ng;
    out = fn(x);
  }
  record("checkpoint", {out}, [fn, x, out]() {
    Tensor g = grad_of(out);
    // a leaf sharing x's storage: where the recomputation's gradient for x collects
    auto d = std::make_shared<TensorImpl>(*x.impl());
    d->grad.reset();
    d->tape_id = -1;
    d->requires_grad = x.requires_grad();
    Tensor xd(d);
    std::vector<Node> outer;
    std::swap(outer, g_tape);  // the recomputation records on a tape of its own
    try {
      Tensor o2 = fn(xd);
      if (o2.requires_grad()) backward(o2, g);
      else clear_tape();
    } catch (...) {
      clear_tape();
      std::swap(outer, g_tape);
      throw;
    }
    std::swap(outer, g_tape);
    if (x.requires_grad() && xd.grad().defined()) accumulate_grad(x, xd.grad(), true);
  });
  return out;
}

static Tensor g_loss_scale;
void set_loss_scale(const Tensor& scale) {
  LOOM_CHECK(!scale.defined() || (scale.numel() == 1 && scale.dtype() == DType::F32),
             "set_loss_scale: expected one f32 value, got %s", scale.desc().c_str());
  g_loss_scale = scale;
}
const Tensor& loss_scale() { return g_loss_scale; }

void backward(const Tensor& root, const Tensor& seed) {
  LOOM_CHECK(root.requires_grad(), "backward: %s does not require grad (nothing recorded it)",
             root.desc().c_str());
  if (seed.defined()) {
    LOOM_CHECK(seed.shape() == root.shape(), "backward: seed %s for root %s", seed.desc().c_str(),
               root.desc().c_str());
    accumulate_grad(root, seed);
  } else {
    LOOM_CHECK(root.numel() == 1, "backward: root %s is not a scalar; pass a seed", root.desc().c_str());
    accumulate_grad(root, Tensor::full(root.shape(), 1.0, root.dtype(), root.device()), true);
  }
  for (int64_t i = int64_t(g_tape.size()) - 1; i >= 0; i--) {
    Node& n = g_tape[size_t(i)];
    bool any = false;
    for (auto& o : n.outputs) any |= bool(o->grad);
    if (any) {
      g_wg.staged.clear();
      n.backward();
      if (g_profile) cut(category_of(n.name), 1);
      if (g_observer) {
        weight_grads_join();  // the buckets' events are recorded on the main stream
        g_observer->node_done();
      }
    }
    n.backward = nullptr;  // frees what the node saved
    for (auto& o : n.outputs) {
      o->grad.reset();  // activation gradients live only until their producer has run
      o->tape_id = -1;
    }
  }
  g_tape.clear();
  weight_grads_join();  // every gradient complete on the main stream when backward() returns
  g_wg.staged.clear();
}

}  // namespace loom
