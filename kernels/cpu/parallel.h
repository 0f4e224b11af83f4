// parallel.h: the CPU kernels' threads. `parallel_for(n, body)` runs body(i) for every i in
// [0, n) on a small pool of worker threads and the calling thread, as `#pragma omp parallel
// for` would, with one difference that matters on a machine whose cores are not all ours:
//
//   the loop is cut into chunks, and every thread, the caller included, claims the next
//   chunk from one atomic counter. A worker that is not running (its core is busy with another
//   program, or it is still waking up) claims nothing, and the caller does its share instead
//   of waiting for it. The call returns when every chunk is done; it waits only for chunks a
//   worker has claimed and not finished.
//
// OpenMP's static loops give each thread its fixed share and end at a barrier that waits for
// every thread of the team: on 2 cores with one of them busy, a `vlm_sft.cfg` step took 0.48 s
// with 2 OpenMP threads against 0.16 s with 1 (2026-12-05), since each of the step's thousands
// of loops waited for the thread the scheduler had put aside. With the pool the same step
// takes about what one thread takes when a core is busy, and what two take when none is
// (kernels/README.md, "CPU threads").
//
// Threads: OMP_NUM_THREADS when set (the variable OpenMP programs read, and what `train
// --train.procs` and `make test` set for their processes), else the cores this process may
// run on. Calls from inside a loop body, and calls from a second thread while one loop runs
// (a loader thread), run serially on the calling thread. An exception thrown by the body
// stops the chunks not yet started and is rethrown by parallel_for, the first one if several.
//
// Which index runs on which thread is not defined, so a body must not depend on it: each
// index writes its own outputs, and sums over indices are cut into a fixed number of parts
// added in order afterwards (kernels/cpu/optim.cpp, cross_entropy.cpp). The results then do
// not depend on the thread count, the chunks or the timing.
#pragma once
#include <cstdint>
#include <utility>

namespace loom::cpu {

// The pool's thread count (the caller included), >= 1.
int num_threads();
// Sets it (the pool is rebuilt); n < 1 goes back to the default. Not while a loop runs.
void set_num_threads(int n);
// True inside a parallel_for body (nested loops run serially there).
bool in_parallel();

namespace detail {
// body(lo, hi) for `chunks` consecutive ranges of [0, n), spread over the pool.
using RangeFn = void (*)(void* ctx, int64_t lo, int64_t hi);
void run_chunks(int64_t n, int64_t chunks, RangeFn fn, void* ctx);
}  // namespace detail

// body(lo, hi) over consecutive ranges covering [0, n), at most `max_chunks` of them (for
// loops whose body wants scratch memory per range). Serial (one range) when `parallel` is
// false or n < 2.
template <class F>
void parallel_ranges(int64_t n, int64_t max_chunks, F&& body, bool parallel = true) {
  if (n <= 0) return;
  if (!parallel || n < 2 || max_chunks < 2 || num_threads() == 1 || in_parallel()) {
    body(int64_t(0), n);
    return;
  }
  auto call = [](void* ctx, int64_t lo, int64_t hi) { (*static_cast<F*>(ctx))(lo, hi); };
  detail::run_chunks(n, max_chunks < n ? max_chunks : n, call, &body);
}

// The chunks a loop is cut into: a few per thread, so that the threads that run take over the
// share of one that does not.
inline int64_t default_chunks() { return 4 * int64_t(num_threads()); }

// body(i) for every i in [0, n); serial when `parallel` is false (small loops: a pool call
// costs a few microseconds).
template <class F>
void parallel_for(int64_t n, F&& body, bool parallel = true) {
  parallel_ranges(
      n, default_chunks(),
      [&body](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; i++) body(i);
      },
      parallel);
}

// body(i) with one index per chunk, for loops of few, long or unequal items (a sequence and
// head of attention, an image to decode): as `schedule(dynamic)` would.
template <class F>
void parallel_for_each(int64_t n, F&& body, bool parallel = true) {
  parallel_ranges(
      n, n,
      [&body](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; i++) body(i);
      },
      parallel);
}

}  // namespace loom::cpu
