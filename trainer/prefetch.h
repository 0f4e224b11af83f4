// prefetch.h: a loader that never stalls the step. Worker threads build the batches of steps
// start, start+1, ... (each a pure function of its step, so a resumed run sees the same data)
// into a bounded queue; the training loop takes them in order and measures how long it
// waited.
#pragma once
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

namespace loom {

template <class Batch>
class Prefetcher {
 public:
  Prefetcher(std::function<Batch(int64_t)> make, int64_t start, int64_t end, int workers, int depth)
      : make_(std::move(make)), next_(start), take_(start), end_(end), depth_(std::max(1, depth)) {
    for (int i = 0; i < std::max(1, workers); i++) threads_.emplace_back([this] { work(); });
  }
  ~Prefetcher() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  // the batch of the next step, in order
  Batch next() {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return ready_.count(take_) || error_; });
    if (error_) std::rethrow_exception(error_);
    Batch b = std::move(ready_[take_]);
    ready_.erase(take_++);
    cv_.notify_all();
    return b;
  }

 private:
  void work() {
    for (;;) {
      int64_t s;
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return stop_ || (next_ < end_ && next_ < take_ + depth_); });
        if (stop_) return;
        s = next_++;
      }
      try {
        Batch b = make_(s);
        std::lock_guard<std::mutex> l(mu_);
        ready_[s] = std::move(b);
      } catch (...) {
        std::lock_guard<std::mutex> l(mu_);
        error_ = std::current_exception();
      }
      cv_.notify_all();
    }
  }
  std::function<Batch(int64_t)> make_;
  int64_t next_, take_, end_;
  int depth_;
  bool stop_ = false;
  std::exception_ptr error_;
  std::map<int64_t, Batch> ready_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::thread> threads_;
};

}  // namespace loom
