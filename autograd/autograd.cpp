// autograd.cpp: the tape (see autograd.h).
#include "autograd/autograd.h"

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
}  // namespace

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

void accumulate_grad(const Tensor& x, const Tensor& g, bool fresh) {
  if (!x.defined() || !x.requires_grad() || !g.defined()) return;
  LOOM_CHECK(g.shape() == x.shape(), "gradient %s for tensor %s", g.desc().c_str(), x.desc().c_str());
  Tensor cur = x.grad();
  Tensor gg = g.dtype() == x.dtype() ? g : g.to(x.dtype());
  if (!cur.defined()) {
    bool own = fresh && gg.same(g) && g.is_contiguous();
    x.impl()->grad = (own ? gg : gg.clone()).impl();
    return;
  }
  Tensor gc = gg.contiguous();
  dispatch_float(cur, [&](auto dev, auto zero) {
    using T = decltype(zero);
    KERNEL(dev, axpby)(cur.data<T>(), cur.data<T>(), 1.0, gc.data<T>(), 1.0, cur.numel(), stream_for(dev));
  });
}

Tensor grad_buffer(const Tensor& x) {
  if (!x.defined() || !x.requires_grad()) return Tensor();
  if (!x.grad().defined()) x.impl()->grad = Tensor::zeros_like(x).impl();
  return x.grad();
}

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
    if (any) n.backward();
    n.backward = nullptr;  // frees what the node saved
    for (auto& o : n.outputs) {
      o->grad.reset();  // activation gradients live only until their producer has run
      o->tape_id = -1;
    }
  }
  g_tape.clear();
}

}  // namespace loom
