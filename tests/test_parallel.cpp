// test_parallel.cpp: the CPU kernels' thread pool (kernels/cpu/parallel.h). Every index runs
// exactly once for any size, chunk count and thread count; loops inside a loop body, and loops
// from other threads while one runs, run serially and still cover their range; an exception
// from the body comes out of parallel_for; a thread that never comes to claim its share is
// not waited for.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "kernels/cpu/parallel.h"

namespace cpu = loom::cpu;

namespace {
// Restores the thread count a test changed.
struct KeepThreads {
  int before = cpu::num_threads();
  ~KeepThreads() { cpu::set_num_threads(before); }
};
}  // namespace

TEST_CASE("parallel_for runs every index once, any size, chunking and thread count", "[parallel]") {
  KeepThreads keep;
  std::mt19937 rng(std::random_device{}());
  for (int threads : {1, 2, 3, 5}) {
    cpu::set_num_threads(threads);
    REQUIRE(cpu::num_threads() == threads);
    for (int64_t n : {int64_t(0), int64_t(1), int64_t(2), int64_t(7), int64_t(64), int64_t(1000),
                      int64_t(std::uniform_int_distribution<int>(1, 100000)(rng))}) {
      INFO("threads " << threads << " n " << n);
      std::vector<std::atomic<int>> hits(size_t(n) + 1);  // one past the end: must stay 0
      for (auto& h : hits) h = 0;
      cpu::parallel_for(n, [&](int64_t i) { hits[size_t(i)]++; });
      cpu::parallel_for_each(n, [&](int64_t i) { hits[size_t(i)] += 10; });
      std::atomic<int> bad_ranges{0};  // (Catch's assertions are for the test's own thread)
      for (int64_t chunks : {int64_t(1), int64_t(3), n + 5}) {
        cpu::parallel_ranges(n, chunks, [&](int64_t lo, int64_t hi) {
          if (lo < 0 || lo >= hi || hi > n) bad_ranges++;
          for (int64_t i = lo; i < hi; i++) hits[size_t(i)] += 100;
        });
      }
      CHECK(bad_ranges == 0);
      cpu::parallel_for(n, [&](int64_t i) { hits[size_t(i)] += 1000; }, /*parallel=*/false);
      for (int64_t i = 0; i < n; i++) {
        if (hits[size_t(i)] != 1311) FAIL("index " << i << " ran " << hits[size_t(i)] << " (want 1311)");
      }
      CHECK(hits[size_t(n)] == 0);
    }
  }
}

TEST_CASE("parallel_for: many short loops in a row, as a training step runs them", "[parallel]") {
  KeepThreads keep;
  cpu::set_num_threads(3);
  std::vector<int64_t> v(4096, 0);
  for (int round = 0; round < 3000; round++) cpu::parallel_for(int64_t(v.size()), [&](int64_t i) { v[size_t(i)] += i; });
  for (size_t i = 0; i < v.size(); i++) REQUIRE(v[i] == 3000 * int64_t(i));
}

TEST_CASE("parallel_for: nested loops and loops from other threads run serially and complete", "[parallel]") {
  KeepThreads keep;
  cpu::set_num_threads(4);
  CHECK_FALSE(cpu::in_parallel());
  const int64_t n = 200, m = 50;
  std::vector<std::atomic<int>> hits(size_t(n * m));
  for (auto& h : hits) h = 0;
  std::atomic<int> nested_parallel{0};
  cpu::parallel_for(n, [&](int64_t i) {
    if (!cpu::in_parallel()) nested_parallel++;
    cpu::parallel_for(m, [&](int64_t j) { hits[size_t(i * m + j)]++; });
  });
  CHECK(nested_parallel == 0);
  CHECK_FALSE(cpu::in_parallel());
  for (auto& h : hits) REQUIRE(h == 1);

  // four threads each run loops at once: one holds the pool, the others run alone
  std::vector<std::vector<int64_t>> sums(4, std::vector<int64_t>(1000, 0));
  std::vector<std::thread> callers;
  for (int t = 0; t < 4; t++)
    callers.emplace_back([&, t] {
      for (int round = 0; round < 200; round++)
        cpu::parallel_for(1000, [&](int64_t i) { sums[size_t(t)][size_t(i)] += i + t; });
    });
  for (auto& c : callers) c.join();
  for (int t = 0; t < 4; t++)
    for (int64_t i = 0; i < 1000; i++) REQUIRE(sums[size_t(t)][size_t(i)] == 200 * (i + t));
}

TEST_CASE("parallel_for: an exception in the body is rethrown and the pool stays usable", "[parallel]") {
  KeepThreads keep;
  for (int threads : {1, 3}) {
    cpu::set_num_threads(threads);
    std::atomic<int> ran{0};
    CHECK_THROWS_WITH(cpu::parallel_for_each(100,
                                             [&](int64_t i) {
                                               ran++;
                                               if (i == 37) throw std::out_of_range("index 37 is bad");
                                             }),
                      "index 37 is bad");
    CHECK(ran >= 1);
    CHECK(ran <= 100);
    CHECK_FALSE(cpu::in_parallel());
    std::atomic<int64_t> sum{0};
    cpu::parallel_for(1000, [&](int64_t i) { sum += i; });
    CHECK(sum == 999 * 1000 / 2);
  }
}

TEST_CASE("parallel_for: the caller does the share of a worker that does not come", "[parallel]") {
  // Index 0 blocks until every other index has run. Whoever claims it, the other thread must
  // run the seven others: when the worker holds index 0, the caller runs them all (it does not
  // wait for the worker's share); when the caller holds it, the worker must wake and run them.
  // A pool that waited for each thread's fixed share would hang here until the timeout.
  KeepThreads keep;
  cpu::set_num_threads(2);
  for (int round = 0; round < 50; round++) {
    std::atomic<int> others{0};
    std::atomic<bool> timed_out{false};
    cpu::parallel_for_each(8, [&](int64_t i) {
      if (i != 0) {
        others++;
        return;
      }
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (others.load() < 7)
        if (std::chrono::steady_clock::now() > until) {
          timed_out = true;
          break;
        } else {
          std::this_thread::yield();
        }
    });
    REQUIRE_FALSE(timed_out);
    REQUIRE(others == 7);
  }
}
