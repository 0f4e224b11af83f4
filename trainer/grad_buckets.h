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
// end, in index order. From the second on, a parameter is complete when its count reaches the
// first's; a parameter written more often than in the first backward means the step's graph
// changed, which is an error (its bucket may already be on its way), never a silently wrong
// average.
//
// Launch order: every rank must start the same collectives in the same order (NCCL matches
// them by position; a rank that launched bucket 5 while its peer launched bucket 6 hangs or
// averages the wrong data). So buckets never go in the order they happen to complete on one
// rank: the first backward also notes at which node each bucket had its last write, and from
// the second on the buckets launch in that order (`order()`), each once it and every bucket
// before it are complete, as DistributedDataParallel's buckets do. A bucket whose parameters
// are written less often this time (unused this step: a micro-batch without images) holds
// the ones after it until finish(), which launches the rest in the same order. The ranks
// compare order_fingerprint() after the first backward (DataParallel::reduce) and fall back to
// the index order on every rank (use_index_order) where their first backwards differed.
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
  // The launch order learned in the first backward (bucket indices), and a hash of it that the
  // ranks compare (exact in a double: 52 bits); use_index_order() replaces it with 0, 1, ...
  const std::vector<int>& order() const { return order_; }
  double order_fingerprint() const;
  void use_index_order();

  void leaf_written(const Tensor& leaf) override;
  void node_done() override;

 private:
  struct Param {
    int64_t begin, end;  // elements of its buffer
    int bucket;
    int64_t expected = 0, count = 0;
    int64_t last_node = -1;  // the first backward: the node of its last write
  };
  Param* find_param(const Tensor& leaf);  // nullptr: not one of the buffers' parameters
  void launch_bucket(int b);

  std::vector<Tensor> buffers_;
  std::vector<std::vector<Param>> params_;  // per buffer, by offset
  std::vector<Bucket> buckets_;
  std::vector<int> left_;                   // per bucket: parameters not yet complete
  std::vector<bool> ready_;                 // complete in this backward, maybe not launched yet
  std::vector<int> order_;                  // the launch order (learned in the first backward)
  size_t next_ = 0;                         // order_[next_] is the next bucket to launch
  int64_t node_ = 0;                        // nodes done in this backward
  std::vector<int> done_now_;               // buckets of the parameters completed in the running node
  Launch launch_;
  bool active_ = false, learned_ = false;
  int early_ = 0;
};

// CUDA: makes stream s (the one a launched bucket's average runs on) wait for every write of
// gradients the backward has enqueued so far: the compute stream's, through `event` (recorded
// there), and the weight-gradient branches' on the side stream (train.side_weight_grads,
// autograd.h weight_grads), which the compute stream itself waits for only later. A bucket is
// complete on the host once its parameters' last nodes are done; its last writes may still be
// running in such a branch.
void wait_for_gradient_writes(Stream s, void* event);

}  // namespace loom
