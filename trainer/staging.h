// staging.h: a batch's way from a loader thread to the GPU, and the logged scalars' way back,
// without the training step ever waiting on the host.
//
//   loader thread                 main thread                      GPU
//   StagedBatch b(pool, bytes)    up.upload(b): tensors on the     copy stream: slot k <- b (DMA)
//   b.add<bf16>("images", ...)    device, at once                  default stream waits for it
//   (fill the page-locked slab)   ... enqueue the step ...         step s reads slot k while
//                                 up.step_done()                   batch s+1 goes to slot 1-k
//                                 readback.post(s, {loss, norm})   loss, norm -> page-locked
//                                 readback.take(): step s-1's      (the host reads them one
//                                 values (its GPU work is done)     step later)
//
// Host memory: page-locked slabs from a pool (allocated once, reused), so the copy is a true
// asynchronous DMA on its own stream. A slab goes back to the pool when its batch is
// destroyed and is handed out again only once the copy that read it has completed (an event).
// Device memory: two input slots held for the run (double buffering): batch s+1 is copied
// into one while step s reads the other; the copy into a slot waits (on the GPU, an event)
// for the step that read it last.
// On the CPU the same calls work: the "device" tensors are views of the host slab.
#pragma once
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace loom {

// Host memory for batches: page-locked on CUDA runs, plain on CPU runs.
class PinnedPool {
 public:
  struct Slab {
    void* data = nullptr;
    size_t bytes = 0;
    void* copied = nullptr;  // event recorded after the last copy that read this slab
    bool pending = false;
  };
  explicit PinnedPool(Device device) : device_(device) {}
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;
  // A slab of at least `bytes` (reused when one is free), returned to the pool by the deleter.
  std::shared_ptr<Slab> acquire(size_t bytes);
  Device device() const { return device_; }
  size_t bytes_held() const;

 private:
  void release(Slab* s);
  Device device_;
  mutable std::mutex mu_;
  std::vector<Slab*> free_;
  std::vector<Slab*> all_;
};

// One batch as named arrays in one slab (each field 256-byte aligned).
class StagedBatch {
 public:
  struct Field {
    std::string name;
    DType dtype;
    Shape shape;
    size_t offset = 0;
  };
  StagedBatch() = default;
  StagedBatch(const std::shared_ptr<PinnedPool>& pool, size_t capacity_bytes);
  // Appends a field and returns where to write it (host memory, uninitialized).
  void* add(const std::string& name, DType dtype, const Shape& shape);
  template <class T> T* add_as(const std::string& name, DType dtype, const Shape& shape) {
    LOOM_CHECK(dtype_size(dtype) == sizeof(T), "staged field '%s': %s is not %zu bytes", name.c_str(),
               dtype_name(dtype), sizeof(T));
    return static_cast<T*>(add(name, dtype, shape));
  }
  // Bytes a batch of these fields needs (the sum of their aligned sizes).
  static size_t bytes_for(const std::vector<std::pair<DType, int64_t>>& fields);
  const std::vector<Field>& fields() const { return fields_; }
  size_t used() const { return used_; }
  const std::shared_ptr<PinnedPool::Slab>& slab() const { return slab_; }
  bool defined() const { return bool(slab_); }
  // host-side values the step needs besides the arrays (sequence count, token count, ...)
  std::map<std::string, int64_t> meta;

 private:
  std::shared_ptr<PinnedPool::Slab> slab_;
  size_t used_ = 0;
  std::vector<Field> fields_;
};

// Uploads staged batches into two device slots on the copy stream.
class Uploader {
 public:
  explicit Uploader(Device device);
  ~Uploader();
  Uploader(const Uploader&) = delete;
  Uploader& operator=(const Uploader&) = delete;
  // Enqueues the copy of b into the next slot and makes the default stream (this thread's:
  // the side stream in a side scope) wait for it; returns b's fields as tensors on the device
  // (valid until the step after the next one).
  std::map<std::string, Tensor> upload(const StagedBatch& b);
  // The step that read the oldest upload not yet done is enqueued (on the main stream): its slot
  // may be overwritten after it. At most two uploads are outstanding (one per slot), so that a
  // batch can be uploaded one step ahead (the frozen vision tower's next batch).
  void step_done();
  size_t bytes_held() const { return cap_[0] + cap_[1]; }

 private:
  Device device_;
  void* slot_[2] = {nullptr, nullptr};
  size_t cap_[2] = {0, 0};
  void* uploaded_[2] = {nullptr, nullptr};  // copy stream: slot k written
  void* consumed_[2] = {nullptr, nullptr};  // default stream: the step that read slot k ran
  bool consumed_recorded_[2] = {false, false};
  int next_ = 0;
  std::vector<int> outstanding_;  // slots uploaded and not yet step_done(), oldest first
};

// Scalars of a step (loss, grad norm, skipped flag, ...) copied to page-locked memory after the
// step, and read by the host one step later: logging every step costs no synchronization.
// Also times the step on the GPU: from the end of the previous step (or this step's start,
// after restart_timing()) to this step's end, with events.
class StepReadback {
 public:
  StepReadback(Device device, int nvalues);
  ~StepReadback();
  StepReadback(const StepReadback&) = delete;
  StepReadback& operator=(const StepReadback&) = delete;
  void begin_step();  // before the step's first kernel
  // After the step: copies each scalar's first element (f32 or f64 tensors) out.
  void post(int64_t step, const std::vector<Tensor>& scalars);
  bool pending() const { return count_ > 0; }
  // The oldest posted step's values (waits for its GPU work); gpu_ms < 0 on the CPU.
  std::vector<double> take(int64_t* step, double* gpu_ms);
  void restart_timing() { have_prev_end_ = false; }

 private:
  struct Entry {
    float* host = nullptr;
    void* start = nullptr;
    void* end = nullptr;
    int64_t step = 0;
    double host_ms = 0;
    std::vector<double> cpu_values;
    bool timed_from_prev = false;
  };
  Device device_;
  int n_;
  static constexpr int kRing = 3;  // posted, being posted, and the previous end event intact
  Entry ring_[kRing];
  int head_ = 0, count_ = 0;
  bool have_prev_end_ = false;
  double t_begin_ = 0;
};

}  // namespace loom

namespace loom {

// A training step captured once into a CUDA graph and replayed: no launch overhead, no host
// work per kernel. The step's inputs are device tensors at fixed addresses (static_inputs():
// each batch is copied into them, on the GPU, right before a replay); what the step's body
// returns (the loss, the norm) lives at fixed addresses too and is rewritten by every replay.
// Its memory comes from the allocator's graph pool (kernels.h). Only for steps whose shapes
// and host-side decisions never change.
class StepGraph {
 public:
  StepGraph() = default;
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;
  bool ready() const { return exec_ != nullptr; }
  // Device tensors shaped like the batch's fields, allocated the first time.
  std::map<std::string, Tensor>& static_inputs(const std::map<std::string, Tensor>& like);
  // Copies a batch into the static inputs (default stream order).
  void load(const std::map<std::string, Tensor>& batch);
  // Records body() (not run: launch() runs it), keeps what it returns.
  void capture(const std::function<std::vector<Tensor>()>& body);
  void launch();
  const std::vector<Tensor>& outputs() const { return outputs_; }

 private:
  void* exec_ = nullptr;
  std::map<std::string, Tensor> inputs_;
  std::vector<Tensor> outputs_;
};

// A step's shape as a string: each field's name, dtype and shape, and the named meta values
// (the host-side numbers the step's body reads, e.g. a packed batch's sequence count).
std::string shape_key(const StagedBatch& b, const std::vector<std::string>& meta);

// CUDA graphs of a step whose shapes change from batch to batch (a packed VLM batch: its image,
// sequence and loss-row counts): one StepGraph per shape (shape_key), captured once the shape
// has come `min_sights` times among the last `window` steps, and replayed every time after. Its
// earlier steps run eager, which builds the shape's plans and times the attention backends for
// it (a capture could do neither). A run whose shapes seldom repeat (bench_vlm_sft's new batch
// per step: 6 shapes came twice in 60 steps) captures nothing: a capture costs a synchronize
// and ~10 ms, and eager steps beside graphs hold a second pool of scratch memory. At most `cap`
// graphs; other shapes run eager. The graphs share the allocator's graph pool: they replay one
// at a time on one stream, so one graph's scratch memory may be another's.
class StepGraphCache {
 public:
  explicit StepGraphCache(size_t cap, size_t window = 16, size_t min_sights = 4)
      : cap_(cap), window_(window), min_sights_(min_sights) {}
  // The shape's graph (ready, or new: capture it now), or nullptr: run this step eager (too few
  // recent sights, may_capture false, or the cache full). Counts the sight.
  StepGraph* find(const std::string& key, bool may_capture);
  size_t size() const { return graphs_.size(); }
  int64_t replays() const { return replays_; }  // steps that ran a graph (its capture included)

 private:
  size_t cap_, window_, min_sights_;
  int64_t replays_ = 0;
  std::deque<std::string> recent_;  // the last `window` steps' shapes
  std::map<std::string, std::unique_ptr<StepGraph>> graphs_;
};

}  // namespace loom
