// staging.cpp: page-locked batch slabs, the double-buffered upload and the step readback
// (see staging.h).
#include "trainer/staging.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

namespace loom {

namespace {
constexpr size_t kAlign = 256;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
double wall_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

// ------------------------------------------------------------------ PinnedPool
PinnedPool::~PinnedPool() {
  for (Slab* s : all_) {
    if (s->pending) {
      cuda::event_synchronize(s->copied);
    }
    if (device_ == Device::CUDA) {
      cuda::pinned_free(s->data);
      cuda::event_destroy(s->copied);
    } else {
      std::free(s->data);
    }
    delete s;
  }
}

std::shared_ptr<PinnedPool::Slab> PinnedPool::acquire(size_t bytes) {
  bytes = std::max(align_up(bytes), kAlign);
  Slab* got = nullptr;
  {
    std::lock_guard<std::mutex> l(mu_);
    size_t best = 0;
    for (size_t i = 0; i < free_.size(); i++)  // the smallest free slab that fits
      if (free_[i]->bytes >= bytes && (!got || free_[i]->bytes < got->bytes)) {
        got = free_[i];
        best = i;
      }
    if (got) free_.erase(free_.begin() + long(best));
  }
  if (!got) {
    got = new Slab();
    // room for the next, slightly larger batch; a multiple of kAlign (aligned_alloc's rule)
    got->bytes = align_up(bytes + bytes / 4);
    if (device_ == Device::CUDA) {
      got->data = cuda::pinned_malloc(got->bytes);
      got->copied = cuda::event_create();
    } else {
      got->data = std::aligned_alloc(kAlign, got->bytes);
      LOOM_CHECK(got->data, "out of host memory for a %zu-byte batch", got->bytes);
    }
    std::lock_guard<std::mutex> l(mu_);
    all_.push_back(got);
  }
  if (got->pending) {  // the DMA that read it last must be over before it is written again
    cuda::event_synchronize(got->copied);
    got->pending = false;
  }
  return std::shared_ptr<Slab>(got, [this](Slab* s) { release(s); });
}

void PinnedPool::release(Slab* s) {
  std::lock_guard<std::mutex> l(mu_);
  free_.push_back(s);
}

size_t PinnedPool::bytes_held() const {
  std::lock_guard<std::mutex> l(mu_);
  size_t n = 0;
  for (Slab* s : all_) n += s->bytes;
  return n;
}

// ------------------------------------------------------------------ StagedBatch
StagedBatch::StagedBatch(const std::shared_ptr<PinnedPool>& pool, size_t capacity_bytes)
    : slab_(pool->acquire(capacity_bytes)) {}

size_t StagedBatch::bytes_for(const std::vector<std::pair<DType, int64_t>>& fields) {
  size_t n = 0;
  for (auto& [dt, numel] : fields) n += align_up(size_t(numel) * dtype_size(dt));
  return n;
}

void* StagedBatch::add(const std::string& name, DType dtype, const Shape& shape) {
  LOOM_CHECK(slab_, "staged field '%s': the batch has no memory", name.c_str());
  size_t bytes = size_t(shape_numel(shape)) * dtype_size(dtype);
  LOOM_CHECK(used_ + bytes <= slab_->bytes, "staged field '%s' %s %s: %zu bytes do not fit the batch's %zu (%zu used)",
             name.c_str(), dtype_name(dtype), shape_str(shape).c_str(), bytes, slab_->bytes, used_);
  fields_.push_back({name, dtype, shape, used_});
  void* p = static_cast<char*>(slab_->data) + used_;
  used_ += align_up(bytes);
  return p;
}

// ------------------------------------------------------------------ Uploader
Uploader::Uploader(Device device) : device_(device) {
  if (device_ != Device::CUDA) return;
  for (int k = 0; k < 2; k++) {
    uploaded_[k] = cuda::event_create();
    consumed_[k] = cuda::event_create();
  }
}

Uploader::~Uploader() {
  if (device_ != Device::CUDA) return;
  cuda::synchronize();  // nothing may still read or write the slots
  for (int k = 0; k < 2; k++) {
    if (slot_[k]) cuda::device_free(slot_[k]);
    cuda::event_destroy(uploaded_[k]);
    cuda::event_destroy(consumed_[k]);
  }
}

std::map<std::string, Tensor> Uploader::upload(const StagedBatch& b) {
  std::map<std::string, Tensor> out;
  if (device_ != Device::CUDA) {  // CPU: the slab is the batch
    std::shared_ptr<void> owner = b.slab();
    for (auto& f : b.fields())
      out[f.name] = Tensor::wrap(static_cast<char*>(b.slab()->data) + f.offset, f.shape, f.dtype, Device::CPU, owner);
    return out;
  }
  LOOM_CHECK(outstanding_.size() < 2, "Uploader: two batches uploaded and not yet done; call step_done() first");
  int k = next_;
  next_ = 1 - next_;
  Stream cs = cuda::copy_stream(), ds = cuda::default_stream();
  if (cap_[k] < b.used()) {
    // Grow (the first batches only). A block from the caching allocator is safe in the default
    // stream's order only, and the copy stream writes this one: synchronize first, so that no
    // earlier work can still touch it. The slots are then held for the run.
    cuda::synchronize();
    if (slot_[k]) cuda::device_free(slot_[k]);
    cap_[k] = b.used() + b.used() / 4;
    slot_[k] = cuda::device_malloc(cap_[k]);
    consumed_recorded_[k] = false;
  }
  if (consumed_recorded_[k]) cuda::stream_wait_event(cs, consumed_[k]);  // the step that read slot k is over
  cuda::memcpy_h2d_async(slot_[k], b.slab()->data, b.used(), cs);
  cuda::event_record(uploaded_[k], cs);
  cuda::event_record(b.slab()->copied, cs);
  b.slab()->pending = true;
  cuda::stream_wait_event(ds, uploaded_[k]);  // the step reads the batch only once it has arrived
  outstanding_.push_back(k);
  for (auto& f : b.fields())
    out[f.name] = Tensor::wrap(static_cast<char*>(slot_[k]) + f.offset, f.shape, f.dtype, Device::CUDA, nullptr);
  return out;
}

void Uploader::step_done() {
  if (device_ != Device::CUDA || outstanding_.empty()) return;
  const int k = outstanding_.front();
  outstanding_.erase(outstanding_.begin());
  cuda::event_record(consumed_[k], cuda::main_stream());
  consumed_recorded_[k] = true;
}

// ------------------------------------------------------------------ StepReadback
StepReadback::StepReadback(Device device, int nvalues) : device_(device), n_(nvalues) {
  if (device_ != Device::CUDA) return;
  for (auto& e : ring_) {
    e.host = static_cast<float*>(cuda::pinned_malloc(sizeof(float) * size_t(n_)));
    e.start = cuda::event_create(true);
    e.end = cuda::event_create(true);
  }
}

StepReadback::~StepReadback() {
  if (device_ != Device::CUDA) return;
  for (auto& e : ring_) {
    if (count_ > 0) cuda::event_synchronize(e.end);
    cuda::pinned_free(e.host);
    cuda::event_destroy(e.start);
    cuda::event_destroy(e.end);
  }
}

void StepReadback::begin_step() {
  t_begin_ = wall_ms();
  if (device_ == Device::CUDA) cuda::event_record(ring_[head_].start, cuda::default_stream());
}

void StepReadback::post(int64_t step, const std::vector<Tensor>& scalars) {
  LOOM_CHECK(int(scalars.size()) == n_, "readback: %zu values posted, %d expected", scalars.size(), n_);
  LOOM_CHECK(count_ < kRing - 1, "readback: take() the posted steps first");
  Entry& e = ring_[head_];
  e.step = step;
  e.host_ms = wall_ms() - t_begin_;
  if (device_ != Device::CUDA) {  // the step ran synchronously: the values are there
    e.cpu_values.clear();
    for (auto& t : scalars) e.cpu_values.push_back(t.defined() ? t.narrow(0, 0, 1).item() : 0.0);
  } else {
    Stream s = cuda::default_stream();
    for (int i = 0; i < n_; i++) {
      const Tensor& t = scalars[size_t(i)];
      LOOM_CHECK(!t.defined() || (t.is_cuda() && t.dtype() == DType::F32), "readback: value %d is %s, not f32 on cuda", i,
                 t.desc().c_str());
      if (t.defined()) cuda::memcpy_d2h_async(e.host + i, t.raw(), sizeof(float), s);
      else e.host[i] = 0.f;
    }
    cuda::event_record(e.end, s);
    e.timed_from_prev = have_prev_end_;
    have_prev_end_ = true;
  }
  head_ = (head_ + 1) % kRing;
  count_++;
}

std::vector<double> StepReadback::take(int64_t* step, double* gpu_ms) {
  LOOM_CHECK(count_ > 0, "readback: nothing posted");
  int idx = (head_ - count_ + kRing) % kRing;
  Entry& e = ring_[idx];
  count_--;
  *step = e.step;
  if (device_ != Device::CUDA) {
    *gpu_ms = e.host_ms;
    return e.cpu_values;
  }
  cuda::event_synchronize(e.end);
  std::vector<double> v(e.host, e.host + n_);
  const Entry& prev = ring_[(idx - 1 + kRing) % kRing];
  *gpu_ms = e.timed_from_prev ? cuda::event_elapsed_ms(prev.end, e.end) : cuda::event_elapsed_ms(e.start, e.end);
  return v;
}

}  // namespace loom

namespace loom {

// ------------------------------------------------------------------ StepGraph
StepGraph::~StepGraph() { cuda::graph_destroy(exec_); }

std::map<std::string, Tensor>& StepGraph::static_inputs(const std::map<std::string, Tensor>& like) {
  if (inputs_.empty())
    for (auto& [name, t] : like) inputs_[name] = Tensor::empty(t.shape(), t.dtype(), t.device());
  return inputs_;
}

void StepGraph::load(const std::map<std::string, Tensor>& batch) {
  for (auto& [name, t] : batch) {
    auto it = inputs_.find(name);
    LOOM_CHECK(it != inputs_.end() && it->second.shape() == t.shape() && it->second.dtype() == t.dtype(),
               "captured step: input '%s' %s does not match the captured %s", name.c_str(), t.desc().c_str(),
               it == inputs_.end() ? "(none)" : it->second.desc().c_str());
    cuda::memcpy_d2d(it->second.raw(), t.raw(), t.nbytes(), cuda::default_stream());
  }
}

void StepGraph::capture(const std::function<std::vector<Tensor>()>& body) {
  LOOM_CHECK(!exec_, "captured step: already captured");
  cuda::synchronize();
  cuda::release_cached();  // the eager steps' cache is not kept beside the graph's own pool
  cuda::graph_pool_begin();
  Stream s = cuda::default_stream();
  cuda::graph_capture_begin(s);
  try {
    outputs_ = body();
  } catch (...) {
    void* g = nullptr;
    try { g = cuda::graph_capture_end(s); } catch (...) {}
    cuda::graph_destroy(g);
    cuda::graph_pool_end();
    throw;
  }
  exec_ = cuda::graph_capture_end(s);
  cuda::graph_pool_end();
}

void StepGraph::launch() {
  LOOM_CHECK(exec_, "captured step: launch before capture");
  cuda::graph_launch(exec_, cuda::default_stream());
}

// ------------------------------------------------------------------ StepGraphCache
std::string shape_key(const StagedBatch& b, const std::vector<std::string>& meta) {
  std::string k;
  for (const auto& f : b.fields()) {
    k += f.name + ':' + dtype_name(f.dtype);
    for (int64_t x : f.shape) k += ',' + std::to_string(x);
    k += ';';
  }
  for (const auto& m : meta) {
    auto it = b.meta.find(m);
    LOOM_CHECK(it != b.meta.end(), "shape_key: the batch has no meta value '%s'", m.c_str());
    k += m + '=' + std::to_string(it->second) + ';';
  }
  return k;
}

StepGraph* StepGraphCache::find(const std::string& key, bool may_capture) {
  recent_.push_back(key);
  if (recent_.size() > window_) recent_.pop_front();
  auto it = graphs_.find(key);
  if (it != graphs_.end()) {
    replays_++;
    return it->second.get();
  }
  if (!may_capture || graphs_.size() >= cap_ ||
      size_t(std::count(recent_.begin(), recent_.end(), key)) < min_sights_)
    return nullptr;
  replays_++;
  return (graphs_[key] = std::make_unique<StepGraph>()).get();
}

}  // namespace loom
