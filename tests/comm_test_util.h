// comm_test_util.h: the CPU collectives' ranks as threads, for test_distributed.cpp and
// test_data_parallel.cpp.
#pragma once
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "trainer/comm.h"

// seconds on the steady clock
inline double secs() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// world ranks as threads: rank 0 listens, the rest connect with its payload (as after the rendezvous)
inline std::vector<loom::tcp::Comm> tcp_ranks(int world) {
  std::vector<loom::tcp::Comm> c(static_cast<size_t>(world));
  c[0] = loom::tcp::Comm::listen(world, 10);
  const std::string payload = c[0].payload();
  std::vector<std::thread> t;
  for (int r = 1; r < world; r++)
    t.emplace_back([&, r] { c[size_t(r)] = loom::tcp::Comm::connect("127.0.0.1", payload, r, world, 10); });
  c[0].accept_ranks();
  for (auto& th : t) th.join();
  return c;
}
