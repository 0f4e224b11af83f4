// grad_buckets.h: data parallel's gradient average overlapped with the backward, as PyTorch's
// DistributedDataParallel does with its gradient buckets.
//
// The optimizer keeps each parameter group's gradients in one flat buffer (optim/optimizer.h).
// GradBuckets cuts every buffer into buckets of whole parameters, about cap_bytes each, the
// group's last parameters first (the backward reaches them first). While a backward runs it
// watches which parameter gradients are written (autograd's BackwardObserver); once every
// parameter of a bucket has had its last write of this backward, the bucket is handed to
// `launch` (an average over the ranks on a side stream or thread) while the backward goes on.
//
// "Last write": the first backward only counts the writes of each parameter (a weight used
// twice, a tied embedding, a recomputed block: two or more) and launches every bucket at its
// end. From the second on, a parameter is complete when its count reaches the first's; a
// parameter written more often than in the first backward means the step's graph changed, which
// is an error (its bucket may already be on its way), never a silently wrong average. Buckets
// whose parameters are written less often (unused this step) go at the end.
//
//   begin()   before a backward: counts to zero, this object observes it
//   finish()  after it: launches what is left, stops observing; the caller then waits for the
//             launched averages (its `join`) before anything reads the gradients
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "autograd/autograd.h"

namespace loom {

class GradBuckets : public BackwardObserver {
 public:
  struct Bucket {
    int buffer = 0;                  // index into the buffers
    int64_t offset = 0, numel = 0;   // elements of that buffer
  };
  // buffers: the flat gradient buffers (Optimizer::grad_buffers()); slices[b]: the element
  // offsets at which buffer b's parameters start (ascending, the first 0). cap_bytes > 0.
  using Launch = std::function<void(const Tensor& buffer, const Bucket& bucket)>;
  GradBuckets(std::vector<Tensor> buffers, const std::vector<std::vector<int64_t>>& slices, size_t cap_bytes,
              Launch launch);
  ~GradBuckets() override;

  void begin();
  void finish();
  const std::vector<Bucket>& buckets() const { return buckets_; }
  // Buckets launched during the last backward before its end (0 in the first one).
  int launched_early() const { return early_; }
  bool learned() const { return learned_; }

  void leaf_written(const Tensor& leaf) override;
  void node_done() override;

 private:
  struct Param {
    int64_t begin, end;  // elements of its buffer
    int bucket;
    int64_t expected = 0, count = 0;
  };
  Param* find_param(const Tensor& leaf);  // nullptr: not one of the buffers' parameters
  void launch_bucket(int b);

  std::vector<Tensor> buffers_;
  std::vector<std::vector<Param>> params_;  // per buffer, by offset
  std::vector<Bucket> buckets_;
  std::vector<int> left_;                   // per bucket: parameters not yet complete
  std::vector<bool> sent_;
  std::vector<int> done_now_;               // buckets of the parameters completed in the running node
  Launch launch_;
  bool active_ = false, learned_ = false;
  int early_ = 0;
};

}  // namespace loom
