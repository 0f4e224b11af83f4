// autograd.cpp: the tape (see autograd.h).
#include "autograd/autograd.h"

#include <chrono>
#include <cstdlib>
#include <deque>
#include <map>

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
// A branch the main stream has not waited for yet: its end event, what it reads (held until
// the main stream waits for it) and the gradient bytes it writes.
struct Branch {
  void* done = nullptr;
  std::vector<Tensor> keep;
  std::vector<ByteRange> writes;
};
struct WeightGrads {
  bool on = false;
  void* fork = nullptr;                // reused: a wait takes the latest record
  std::deque<Branch> open;             // not waited for by the main stream, oldest first
  std::vector<void*> spare;            // end events no open branch uses
  int since_join = 0;                  // branches since the last join (the memory they freed
                                       // is still the side pool's)
  std::vector<ByteRange> staged;       // taken by weight_grad_buffer in the running node
  bool in_branch = false;
};
thread_local WeightGrads g_wg;
// Two bounds on how far the side stream may trail. Every `join_every` branches the main stream
// joins: it waits for them all and takes over the memory they freed (side_branch_join). And
// with more than `lag` branches open it waits for the older ones (an event each, no memory
// handed over) and releases what they read: a branch holds its output gradient and input,
// which one stream would have freed after the node, so the lag is what bounds the memory the
// branches add to the step's peak. Keyed by bytes (join_if_branch_writes below) a ViT block
// joins only by these counts. Measured (H100, 2026-12-06 "bytes", bench/RESULTS.md): join_every 8 with
// no lag, the contrastive MIM step 0.46 ms faster than one stream and its peak 470 MB higher;
// 32 no faster than 8; with the lag of 2, 0.35 ms faster and 13 MB higher (MIM: 0.14, 28 MB);
// a lag of 1 kept the peak and gave 0.14 ms. The lag is train.side_weight_grads_lag (the
// reference's VLM batch: 8, 0.2 ms faster and the same peak, H100, 2026-12-06).
// LOOM_WGRAD_JOIN and LOOM_WGRAD_LAG override them (measurement).
int env_count(const char* name, int dflt) {
  const char* e = std::getenv(name);
  return e && std::atoi(e) > 0 ? std::atoi(e) : dflt;
}
int join_every() {
  static const int n = env_count("LOOM_WGRAD_JOIN", 8);
  return n;
}
int g_lag = 2;  // set_side_weight_grads_lag (train.side_weight_grads_lag)
int join_lag() {
  static const int env = env_count("LOOM_WGRAD_LAG", 0);
  return env > 0 ? env : g_lag;
}
}  // namespace

void set_side_weight_grads(bool on) {
  if (!on) weight_grads_join();
  g_wg.on = on;
}
bool side_weight_grads() { return g_wg.on; }
void set_side_weight_grads_lag(int lag) {
  LOOM_CHECK(lag >= 1, "set_side_weight_grads_lag: %d (at least 1)", lag);
  g_lag = lag;
}

// the main stream waits for the open branches older than the newest `newest`, and drops what
// they read (released on the host after the wait is enqueued: later main-stream reuse waits too)
static void wait_open_branches(size_t newest) {
  if (g_wg.open.size() <= newest) return;
  const size_t n = g_wg.open.size() - newest;
  cuda::stream_wait_event(cuda::main_stream(), g_wg.open[n - 1].done);
  for (size_t i = 0; i < n; i++) {
    g_wg.spare.push_back(g_wg.open.front().done);
    g_wg.open.pop_front();
  }
}

void weight_grads(const std::vector<Tensor>& keep, const std::function<void()>& fn) {
  bool on_cuda = false;
  for (auto& t : keep) on_cuda = on_cuda || (t.defined() && t.device() == Device::CUDA);
  if (!g_wg.on || !on_cuda || g_wg.in_branch || g_profile || cuda::side_scope_active()) {
    fn();
    return;
  }
  if (g_wg.since_join >= join_every()) weight_grads_join();
  wait_open_branches(size_t(join_lag()) - 1);  // room for this one
  if (!g_wg.fork) g_wg.fork = cuda::event_create();
  Branch br;
  if (g_wg.spare.empty()) g_wg.spare.push_back(cuda::event_create());
  br.done = g_wg.spare.back();
  g_wg.spare.pop_back();
  // every buffer the node took so far: one taken for a later branch of the node stays marked
  br.writes = g_wg.staged;
  cuda::side_branch_fork(g_wg.fork);
  g_wg.in_branch = true;
  auto end = [&br] {
    g_wg.in_branch = false;
    cuda::side_branch_end(br.done);
    g_wg.since_join++;
  };
  try {
    fn();
  } catch (...) {
    end();
    g_wg.open.push_back(std::move(br));
    throw;
  }
  end();
  for (auto& t : keep)
    if (t.defined()) br.keep.push_back(t);
  g_wg.open.push_back(std::move(br));
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
  if (!g_wg.open.empty()) cuda::side_branch_join(g_wg.open.back().done);  // the latest branch
  g_wg.since_join = 0;
  for (auto& b : g_wg.open) g_wg.spare.push_back(b.done);
  g_wg.open.clear();  // on the host after the wait is enqueued: later main-stream reuse waits too
}

void weight_grads_wait(Stream s) {
  if (!g_wg.open.empty()) cuda::stream_wait_event(s, g_wg.open.back().done);  // branches run in order on one stream
}

// the main stream is about to write x's gradient: join first when a pending branch writes it.
// Keyed by the gradient's bytes, not its storage: the optimizer's flat buffers hold a group's
// gradients in one storage (trainer/params.cpp: the 1-D group has the linears' biases and the
// norms' gains), and keyed by storage every norm's backward joined, and a ViT MLP's (its DGELU
// product adds fc1's bias gradient on the main stream): three joins a ViT block. Two writers
// of disjoint bytes of one buffer need no order.
static void join_if_branch_writes(const Tensor& x) {
  if (g_wg.open.empty() || g_wg.in_branch || !x.grad().defined()) return;
  const ByteRange r = byte_range(x.grad());
  for (auto& b : g_wg.open)
    for (auto& w : b.writes)
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
      // a gradient bucket complete here may have its last writes in an open weight-gradient
      // branch: its reader waits for them (weight_grads_wait), the main stream goes on
      if (g_observer) g_observer->node_done();
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
