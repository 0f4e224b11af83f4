// parallel.cpp: the pool behind parallel.h.
//
// One loop at a time runs on the pool (a mutex, tried: a second caller runs its loop alone).
// Everything hangs on one 64-bit word, `state`: a loop number in the high 32 bits and the next
// unclaimed chunk in the low 32. A thread claims chunk c by a compare-and-swap of (loop, c)
// to (loop, c + 1), runs it and adds 1 to `done`. The caller publishes a loop as a seqlock
// writer does: state = (odd number, nothing to claim), then the loop's fields (function,
// context, size, chunk count), then state = (next even number, chunk 0). A worker reads the
// state, then the fields, and every claim it makes is a swap that checks the loop number: a
// worker that read the fields while the next loop was being written (a late worker of the
// loop before) fails its swap, since the word has moved on, and touches nothing. While one
// of a loop's chunks is claimed and not done, its caller is still waiting, so the fields stay.
//
// Workers spin for a while after a loop (the next loop of a training step usually follows
// within microseconds), then sleep on a condition variable; the caller wakes the sleepers
// only when there are some. The caller, done with the chunks it could claim, waits for the
// ones still running: spinning first, then yielding its core (the worker it waits for may
// need that core on a busy machine), then in naps of 20 us.
#include "kernels/cpu/parallel.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace loom::cpu {
namespace {

// Spins (each a pause instruction) of a thread that waits, before it sleeps (workers) or
// yields (the caller): the count libgomp was set to for these steps, GOMP_SPINCOUNT = 20000,
// the best of 1000 / 5000 / 20000 / 100000 on 2 cores (2026-11-23).
constexpr int kSpins = 20000;
constexpr uint64_t kNothing = 0xffffffffu;  // a chunk index past every loop's chunks

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

thread_local bool tl_in_parallel = false;

int default_threads() {
  if (const char* s = std::getenv("OMP_NUM_THREADS")) {
    char* end = nullptr;
    long n = std::strtol(s, &end, 10);  // "4" or the first entry of a list ("4,2")
    if (end != s && n >= 1) return int(std::min<long>(n, 1024));
  }
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

class Pool {
 public:
  explicit Pool(int threads) : threads_(threads) {
    for (int i = 1; i < threads; i++) workers_.emplace_back([this] { work(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(sleep_mu_);
      stop_.store(true);
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }
  int threads() const { return threads_; }

  // false: another loop holds the pool (the caller runs its loop alone)
  bool run(int64_t n, int64_t chunks, detail::RangeFn fn, void* ctx) {
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    // the previous loop's number is even; odd while this one's fields are written
    const uint32_t odd = uint32_t(state_.load(std::memory_order_relaxed) >> 32) + 1;
    const uint32_t loop = odd + 1 == 0 ? 2 : odd + 1;  // 0 is "none yet" for the workers
    state_.store(uint64_t(odd) << 32 | kNothing);
    std::atomic_thread_fence(std::memory_order_release);
    fn_.store(fn, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    n_.store(n, std::memory_order_relaxed);
    chunks_.store(chunks, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    failed_.store(false, std::memory_order_relaxed);
    error_ = nullptr;
    state_.store(uint64_t(loop) << 32);  // seq_cst: before sleepers_ is read (see work())
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lk(sleep_mu_);
      wake_.notify_all();
    }
    claim_and_run(loop);
    // wait for the chunks the workers claimed: spin, then yield the core, then sleep in short
    // naps (a chunk that runs for milliseconds more)
    for (int round = 0; done_.load(std::memory_order_acquire) < chunks;) {
      if (round < kSpins) cpu_relax();
      else if (round < kSpins + 100) sched_yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(20));
      if (round < kSpins + 100) round++;
    }
    if (error_) std::rethrow_exception(error_);
    return true;
  }

 private:
  // Claims chunks of loop `loop` until none is left (or the loop is over); runs each.
  void claim_and_run(uint32_t loop) {
    uint64_t s = state_.load(std::memory_order_acquire);
    if (uint32_t(s >> 32) != loop) return;
    const detail::RangeFn fn = fn_.load(std::memory_order_relaxed);
    void* const ctx = ctx_.load(std::memory_order_relaxed);
    const int64_t n = n_.load(std::memory_order_relaxed), chunks = chunks_.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);  // the fields before any swap (seqlock reader)
    for (;;) {
      if (uint32_t(s >> 32) != loop || int64_t(s & 0xffffffffu) >= chunks) return;
      if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      const int64_t c = int64_t(s & 0xffffffffu);
      if (!failed_.load(std::memory_order_relaxed)) {
        tl_in_parallel = true;
        try {
          fn(ctx, n * c / chunks, n * (c + 1) / chunks);
        } catch (...) {
          std::lock_guard<std::mutex> lk(error_mu_);
          if (!error_) error_ = std::current_exception();
          failed_.store(true, std::memory_order_relaxed);
        }
        tl_in_parallel = false;
      }
      done_.fetch_add(1, std::memory_order_release);
      s = state_.load(std::memory_order_acquire);
    }
  }

  void work() {
    uint32_t seen = 0;
    for (;;) {
      // a new loop: a number other than the last one run, and even (published)
      auto fresh = [&](uint64_t st) { return uint32_t(st >> 32) != seen && (st >> 32) % 2 == 0; };
      uint64_t s = state_.load(std::memory_order_acquire);
      for (int spin = 0; !fresh(s) && spin < kSpins; spin++) {
        cpu_relax();
        s = state_.load(std::memory_order_acquire);
      }
      if (!fresh(s)) {
        std::unique_lock<std::mutex> lk(sleep_mu_);
        sleepers_.fetch_add(1);  // seq_cst: before the predicate's read of state_
        wake_.wait(lk, [&] { return stop_.load() || fresh(state_.load()); });
        sleepers_.fetch_sub(1);
        if (stop_.load()) return;
        continue;
      }
      seen = uint32_t(s >> 32);
      claim_and_run(seen);
    }
  }

  const int threads_;
  std::vector<std::thread> workers_;
  std::mutex run_mu_;  // one loop at a time
  // the loop being run (written by the caller before state_, read by whoever claims a chunk)
  std::atomic<detail::RangeFn> fn_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<int64_t> n_{0}, chunks_{0}, done_{0};
  std::atomic<uint64_t> state_{0};  // loop number << 32 | next chunk
  std::atomic<bool> failed_{false};
  std::mutex error_mu_;
  std::exception_ptr error_;
  // sleeping workers
  std::mutex sleep_mu_;
  std::condition_variable wake_;
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
};

std::mutex g_pool_mu;  // guards g_pool's creation and replacement
// Never destroyed (a worker may still be spinning while the process exits); set_num_threads
// replaces it, joining the old workers.
std::atomic<Pool*> g_pool{nullptr};

Pool& pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p) return *p;
  std::lock_guard<std::mutex> lk(g_pool_mu);
  if (!g_pool.load()) g_pool.store(new Pool(default_threads()), std::memory_order_release);
  return *g_pool.load();
}

}  // namespace

int num_threads() { return pool().threads(); }

void set_num_threads(int n) {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  delete g_pool.exchange(nullptr);  // joins the old workers
  g_pool.store(new Pool(n >= 1 ? n : default_threads()), std::memory_order_release);
}

bool in_parallel() { return tl_in_parallel; }

namespace detail {
void run_chunks(int64_t n, int64_t chunks, RangeFn fn, void* ctx) {
  chunks = std::min<int64_t>(std::max<int64_t>(chunks, 1), int64_t(1) << 30);
  if (!pool().run(n, chunks, fn, ctx)) {
    tl_in_parallel = true;  // as inside the pool: nested loops stay serial
    try {
      fn(ctx, 0, n);
    } catch (...) {
      tl_in_parallel = false;
      throw;
    }
    tl_in_parallel = false;
  }
}
}  // namespace detail

}  // namespace loom::cpu
