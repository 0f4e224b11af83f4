// grad_buckets.cpp: gradient buckets averaged while the backward runs (see grad_buckets.h).
#include "trainer/grad_buckets.h"

#include <algorithm>
#include <cstdint>

#include "kernels/kernels.h"

namespace loom {

GradBuckets::GradBuckets(std::vector<Tensor> buffers, const std::vector<std::vector<int64_t>>& slices,
                         size_t cap_bytes, Launch launch)
    : buffers_(std::move(buffers)), launch_(std::move(launch)) {
  LOOM_CHECK(slices.size() == buffers_.size() && cap_bytes > 0, "GradBuckets: %zu buffers, %zu slice lists, cap %zu",
             buffers_.size(), slices.size(), cap_bytes);
  params_.resize(buffers_.size());
  for (size_t b = 0; b < buffers_.size(); b++) {
    const Tensor& buf = buffers_[b];
    const auto& off = slices[b];
    LOOM_CHECK(buf.dim() == 1 && buf.is_contiguous() && !off.empty() && off[0] == 0,
               "GradBuckets: buffer %zu is %s with %zu parameters", b, buf.desc().c_str(), off.size());
    for (size_t i = 0; i < off.size(); i++) {
      const int64_t end = i + 1 < off.size() ? off[i + 1] : buf.numel();
      LOOM_CHECK(end > off[i], "GradBuckets: buffer %zu: parameter offsets not ascending", b);
      params_[b].push_back({off[i], end, -1});
    }
    // buckets from the buffer's end: its last parameters are the backward's first
    const int64_t cap = std::max<int64_t>(1, int64_t(cap_bytes / dtype_size(buf.dtype())));
    int64_t hi = buf.numel();
    for (int i = int(off.size()) - 1; i >= 0; i--) {
      Param& p = params_[b][size_t(i)];
      const bool full = hi - p.begin > cap && p.end != hi;  // p would overflow a bucket that has one already
      if (full) {
        buckets_.push_back({int(b), p.end, hi - p.end});
        hi = p.end;
      }
      p.bucket = int(buckets_.size());
      if (i == 0) buckets_.push_back({int(b), 0, hi});
    }
  }
  left_.assign(buckets_.size(), 0);
  ready_.assign(buckets_.size(), false);
  use_index_order();
}

void GradBuckets::use_index_order() {
  order_.resize(buckets_.size());
  for (size_t k = 0; k < order_.size(); k++) order_[k] = int(k);
}

double GradBuckets::order_fingerprint() const {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the indices
  for (int k : order_) {
    h ^= uint64_t(uint32_t(k));
    h *= 1099511628211ull;
  }
  return double(h >> 12);  // 52 bits: a double holds them exactly
}

GradBuckets::~GradBuckets() {
  if (backward_observer() == this) set_backward_observer(nullptr);
}

void GradBuckets::begin() {
  LOOM_CHECK(!active_, "GradBuckets::begin: the previous backward was not finished");
  std::fill(left_.begin(), left_.end(), 0);
  std::fill(ready_.begin(), ready_.end(), false);
  next_ = 0;
  node_ = 0;
  for (auto& ps : params_)
    for (Param& p : ps) {
      p.count = 0;
      if (p.expected > 0) left_[size_t(p.bucket)]++;
    }
  done_now_.clear();
  early_ = 0;
  active_ = true;
  set_backward_observer(this);
}

GradBuckets::Param* GradBuckets::find_param(const Tensor& leaf) {
  const Tensor& g = leaf.grad();
  if (!g.defined()) return nullptr;
  const char* p = static_cast<const char*>(g.raw());
  for (size_t b = 0; b < buffers_.size(); b++) {
    const char* base = static_cast<const char*>(buffers_[b].raw());
    const size_t es = dtype_size(buffers_[b].dtype());
    if (p < base || p >= base + size_t(buffers_[b].numel()) * es || g.dtype() != buffers_[b].dtype()) continue;
    const int64_t at = int64_t(p - base) / int64_t(es);
    auto& ps = params_[b];
    auto it = std::upper_bound(ps.begin(), ps.end(), at, [](int64_t x, const Param& q) { return x < q.begin; });
    if (it == ps.begin()) return nullptr;
    --it;
    if (it->begin != at || it->end - it->begin != g.numel()) return nullptr;  // not a whole parameter's gradient
    return &*it;
  }
  return nullptr;
}

void GradBuckets::leaf_written(const Tensor& leaf) {
  if (!active_) return;
  Param* p = find_param(leaf);
  if (!p) return;
  p->count++;
  if (!learned_) {
    p->last_node = node_;
    return;
  }
  LOOM_CHECK(p->count <= p->expected,
             "data parallel: a parameter (gradient buffer %d, elements %lld..%lld) was written %lld times in this "
             "backward, %lld in the first: the step's graph changed between steps, and its gradient bucket may "
             "already be averaging; train.dist_bucket_mb = 0 averages after the backward instead",
             buckets_[size_t(p->bucket)].buffer, (long long)p->begin, (long long)p->end, (long long)p->count,
             (long long)p->expected);
  if (p->count == p->expected) done_now_.push_back(p->bucket);
}

void GradBuckets::node_done() {
  if (!active_) return;
  node_++;
  if (done_now_.empty()) return;
  // the node that made these parameters complete has run (its kernels are enqueued before
  // anything launched here on the stream's order; on the CPU they have finished)
  for (int k : done_now_)
    if (--left_[size_t(k)] == 0) ready_[size_t(k)] = true;
  done_now_.clear();
  // in the agreed order only: the next bucket goes once it and all before it are complete
  while (next_ < order_.size() && ready_[size_t(order_[next_])]) {
    launch_bucket(order_[next_++]);
    early_++;
  }
}

void GradBuckets::launch_bucket(int k) {
  launch_(buffers_[size_t(buckets_[size_t(k)].buffer)], buckets_[size_t(k)]);
}

void GradBuckets::finish() {
  LOOM_CHECK(active_, "GradBuckets::finish without begin");
  set_backward_observer(nullptr);
  active_ = false;
  done_now_.clear();
  if (!learned_) {
    // every bucket at the end, in index order (the same on every rank); the order of later
    // backwards: by the node of each bucket's last write (a bucket none of whose parameters
    // was written goes last), ties in index order
    std::vector<int64_t> done_at(buckets_.size(), -1);
    for (auto& ps : params_)
      for (Param& p : ps) {
        p.expected = p.count;
        int64_t& d = done_at[size_t(p.bucket)];
        if (p.count > 0) d = std::max(d, p.last_node);
      }
    for (int64_t& d : done_at)
      if (d < 0) d = INT64_MAX;
    for (size_t k = 0; k < buckets_.size(); k++) launch_bucket(int(k));
    std::stable_sort(order_.begin(), order_.end(),
                     [&](int a, int b) { return done_at[size_t(a)] < done_at[size_t(b)]; });
    learned_ = true;
    return;
  }
  // in order: the buckets before next_ are on their way, none after it
  for (; next_ < order_.size(); next_++) launch_bucket(order_[next_]);
}

void wait_for_gradient_writes(Stream s, void* event) {
  cuda::event_record(event, cuda::default_stream());
  cuda::stream_wait_event(s, event);
  weight_grads_wait(s);
}

}  // namespace loom
