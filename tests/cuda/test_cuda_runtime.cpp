// test_cuda_runtime.cpp: kernels/cuda/allocator.cu and runtime.cu (the caching allocator, its
// side scope and side branch, streams, events) against the loom::cpu reference, f32 and bf16 (tests/cuda/cuda_kernel_test_util.h). Skipped without a
// GPU.
//   bash tools/gpu-kernels.sh tests/cuda/test_cuda_runtime.cpp
#include <catch2/catch.hpp>

#include <chrono>
#include <memory>

#include "kernels/kernels.h"
#include "tests/tolerances.h"

#include "tests/cuda/cuda_kernel_test_util.h"

TEST_CASE("runtime: caching allocator reuses blocks and counts bytes", "[runtime]") {
  need_gpu();
  CHECK(cu::device_count() >= 1);
  size_t base = cu::bytes_in_use();
  void* a = cu::device_malloc(1000);
  CHECK(cu::bytes_in_use() == base + 1024);  // 512-byte classes below 1 MiB
  cu::device_free(a);
  void* b = cu::device_malloc(900);  // same class: the cached block comes back
  CHECK(b == a);
  void* big = cu::device_malloc((3 << 20) + 5);  // large blocks are multiples of 512 B too
  CHECK(cu::bytes_in_use() == base + 1024 + (3 << 20) + 512);
  CHECK(cu::peak_bytes_in_use() >= cu::bytes_in_use());
  cu::device_free(big);
  cu::device_free(b);
  CHECK(cu::bytes_in_use() == base);
  cu::reset_peak_bytes();
  CHECK(cu::peak_bytes_in_use() == base);
  REQUIRE_THROWS(cu::device_free(reinterpret_cast<void*>(0x1234)));
  // above 8 KiB the small classes are eighths of a power of two: 9000 and 9200 bytes share the
  // 9 KiB class (a size that moves a little from step to step reuses its block), 9300 does not
  void* k9000 = cu::device_malloc(9000);
  CHECK(cu::bytes_in_use() == base + 9216);
  cu::device_free(k9000);
  void* k9200 = cu::device_malloc(9200);
  CHECK(k9200 == k9000);
  void* k9300 = cu::device_malloc(9300);
  CHECK(k9300 != k9000);
  CHECK(cu::bytes_in_use() == base + 9216 + 10240);
  cu::device_free(k9200);
  cu::device_free(k9300);
  CHECK(cu::bytes_in_use() == base);

  // memcpy / memset round trip through pinned memory
  auto h = rnd(1000, 1);
  float* pin = static_cast<float*>(cu::pinned_malloc(4000));
  std::memcpy(pin, h.data(), 4000);
  float* d = static_cast<float*>(cu::device_malloc(4000));
  float* d2 = static_cast<float*>(cu::device_malloc(4000));
  cu::memcpy_h2d(d, pin, 4000, S());
  cu::memcpy_d2d(d2, d, 4000, S());
  std::vector<float> back(1000);
  cu::memcpy_d2h(back.data(), d2, 4000, S());
  CHECK(back == h);
  cu::memset_zero(d2, 4000, S());
  cu::memcpy_d2h(back.data(), d2, 4000, S());
  CHECK(back == std::vector<float>(1000, 0.f));
  cu::synchronize();
  cu::device_free(d);
  cu::device_free(d2);
  cu::pinned_free(pin);
}

// Large blocks are cut from segments and merged again when freed (allocator.cu's header): the
// pieces of one 20 MiB segment are adjacent, a freed run of neighbours serves a larger request
// from the same bytes, and a run of varying sizes does not grow the cache past its peak need.
TEST_CASE("runtime: large blocks split from segments and coalesce", "[runtime]") {
  need_gpu();
  const size_t MiB = size_t(1) << 20;
  cu::release_cached();  // a clean start: no free segment from earlier tests
  const size_t reserved0 = cu::bytes_reserved();
  char* a = static_cast<char*>(cu::device_malloc(4 * MiB));
  char* b = static_cast<char*>(cu::device_malloc(4 * MiB));
  char* c = static_cast<char*>(cu::device_malloc(4 * MiB));
  CHECK(cu::bytes_reserved() == reserved0 + 20 * MiB);  // one shared segment for all three
  CHECK(b == a + 4 * MiB);
  CHECK(c == b + 4 * MiB);
  cu::device_free(b);
  cu::device_free(a);  // merges with b
  const size_t used = cu::bytes_in_use();
  char* d = static_cast<char*>(cu::device_malloc(7 * MiB + MiB / 2));  // fits the merged 8 MiB at a
  CHECK(d == a);
  CHECK(cu::bytes_in_use() == used + 8 * MiB);  // a remainder under 1 MiB is not cut off
  CHECK(cu::bytes_reserved() == reserved0 + 20 * MiB);
  char* e = static_cast<char*>(cu::device_malloc(8 * MiB + 512));  // the segment's free tail (8 MiB) is too small
  CHECK(cu::bytes_reserved() == reserved0 + 40 * MiB);
  // the data written through the pieces is each piece's own
  std::vector<float> h(size_t(7 * MiB) / 4);  // 7 of d's 7.5 MiB
  for (size_t i = 0; i < h.size(); i++) h[i] = float(i % 977);
  cu::memcpy_h2d(d, h.data(), 7 * MiB, S());
  cu::memset_zero(c, 4 * MiB, S());
  std::vector<float> back(h.size());
  cu::memcpy_d2h(back.data(), d, 7 * MiB, S());
  CHECK(back == h);
  for (void* p : {static_cast<void*>(c), static_cast<void*>(d), static_cast<void*>(e)}) cu::device_free(p);
  cu::release_cached();  // wholly free segments go back to the driver
  CHECK(cu::bytes_reserved() == reserved0);

  // varying sizes, as a packed batch's activations from step to step: the cache stays within
  // a few segments of the largest live total
  std::mt19937 rng(3);
  size_t peak_live = 0;
  for (int step = 0; step < 200; step++) {
    std::vector<void*> live;
    size_t total = 0;
    for (int t = 0; t < 12; t++) {
      size_t n = MiB + size_t(rng() % (40 * MiB));
      live.push_back(cu::device_malloc(n));
      total += n;
    }
    peak_live = std::max(peak_live, total);
    for (void* p : live) cu::device_free(p);
  }
  INFO("reserved " << (cu::bytes_reserved() - reserved0) / MiB << " MiB for at most " << peak_live / MiB
                   << " MiB live");
  CHECK(cu::bytes_reserved() - reserved0 <= peak_live + 12 * 22 * MiB);
  cu::release_cached();
  CHECK(cu::bytes_reserved() == reserved0);
}

TEST_CASE("runtime: a side scope runs on its own stream and allocates from its own pool", "[runtime]") {
  need_gpu();
  const size_t MiB = size_t(1) << 20;
  CHECK_FALSE(cu::side_scope_active());
  CHECK(cu::default_stream() == cu::main_stream());
  REQUIRE_THROWS(cu::side_scope_end());
  cu::side_scope_begin();
  CHECK(cu::side_scope_active());
  CHECK(cu::default_stream() == cu::side_stream());
  CHECK(cu::side_stream() != cu::main_stream());
  REQUIRE_THROWS(cu::side_scope_begin());
  void* small = cu::device_malloc(3000);
  void* large = cu::device_malloc(3 * MiB);
  cu::device_free(small);
  cu::device_free(large);
  cu::side_scope_end();
  CHECK(cu::default_stream() == cu::main_stream());
  // the blocks the side scope freed are not handed to the default stream's work ...
  void* small2 = cu::device_malloc(3000);
  void* large2 = cu::device_malloc(3 * MiB);
  CHECK(small2 != small);
  CHECK(large2 != large);
  // ... and come back in the next side scope
  cu::side_scope_begin();
  void* small3 = cu::device_malloc(3000);
  void* large3 = cu::device_malloc(3 * MiB);
  CHECK(small3 == small);
  CHECK(large3 == large);
  cu::device_free(small3);
  cu::device_free(large3);
  cu::side_scope_end();
  cu::device_free(small2);  // back to the ordinary pool, freed outside the scope or in it
  cu::device_free(large2);

  // GEMMs enqueued on both streams at once (each stream with its own cuBLASLt workspace) give
  // the reference results; inputs fresh, outputs poisoned
  const int M = 192, N = 320, K = 448, R = 8;
  auto hA = rnd(size_t(M) * K, 101), hB = rnd(size_t(K) * N, 102);
  auto hA2 = rnd(size_t(M) * K, 103), hB2 = rnd(size_t(K) * N, 104);
  std::vector<float> ref(size_t(M) * N), ref2(size_t(M) * N);
  cpu::gemm(ref.data(), hA.data(), hB.data(), M, N, K, false, true, 1.0, 0.0, 1, 0, 0, 0, nullptr);
  cpu::gemm(ref2.data(), hA2.data(), hB2.data(), M, N, K, false, true, 1.0, 0.0, 1, 0, 0, 0, nullptr);
  DBuf<float> A(hA), B(hB), C(size_t(M) * N);
  cu::side_scope_begin();
  auto A2 = std::make_unique<DBuf<float>>(hA2), B2 = std::make_unique<DBuf<float>>(hB2);
  auto C2 = std::make_unique<DBuf<float>>(size_t(M) * N);
  for (int r = 0; r < R; r++) cu::gemm(C2->p, A2->p, B2->p, M, N, K, false, true, 1.0, 0.0, 1, 0, 0, 0, S());
  cu::side_scope_end();
  for (int r = 0; r < R; r++) cu::gemm(C.p, A.p, B.p, M, N, K, false, true, 1.0, 0.0, 1, 0, 0, 0, S());
  CHECK_CLOSE(C.get(), ref, tol_of<float>(true), "gemm on the main stream");
  cu::side_scope_begin();
  CHECK_CLOSE(C2->get(), ref2, tol_of<float>(true), "gemm on the side stream");
  A2.reset();
  B2.reset();
  C2.reset();
  cu::side_scope_end();
}

TEST_CASE("runtime: a side branch borrows the main pool's free blocks and returns them at the join", "[runtime]") {
  need_gpu();
  const size_t MiB = size_t(1) << 20, big = 37 * MiB + 512;  // a size no other test leaves free
  void* fork = cu::event_create(), *join = cu::event_create();
  REQUIRE_THROWS(cu::side_branch_end(join));  // no branch open
  void* m1 = cu::device_malloc(big);         // a segment of its own
  cu::device_free(m1);                       // now a free block of the main pool
  cu::side_branch_fork(fork);
  CHECK(cu::side_scope_active());
  CHECK(cu::default_stream() == cu::side_stream());
  REQUIRE_THROWS(cu::side_branch_fork(fork));
  REQUIRE_THROWS(cu::side_branch_join(join));  // joined from the main stream's side only
  void* b1 = cu::device_malloc(big);
  CHECK(b1 == m1);  // borrowed
  cu::device_free(b1);
  void* b2 = cu::device_malloc(big);
  CHECK(b2 == m1);  // freed in the branch: the branch's own again
  // work of the branch the main stream reads after the join: a GEMM on the side stream into a
  // block of the branch (inputs fresh, output poisoned)
  const int M = 160, N = 224, K = 320;
  auto hA = rnd(size_t(M) * K, 111), hB = rnd(size_t(K) * N, 112);
  std::vector<float> ref(size_t(M) * N);
  cpu::gemm(ref.data(), hA.data(), hB.data(), M, N, K, false, true, 1.0, 0.0, 1, 0, 0, 0, nullptr);
  auto A = std::make_unique<DBuf<float>>(hA), B = std::make_unique<DBuf<float>>(hB);
  auto C = std::make_unique<DBuf<float>>(size_t(M) * N);
  cu::gemm(C->p, A->p, B->p, M, N, K, false, true, 1.0, 0.0, 1, 0, 0, 0, S());
  A.reset();
  B.reset();
  cu::device_free(b2);
  cu::side_branch_end(join);
  CHECK_FALSE(cu::side_scope_active());
  CHECK(cu::default_stream() == cu::main_stream());
  // before the join the branch's free memory is not the main stream's ...
  void* m2 = cu::device_malloc(big);
  CHECK(m2 != m1);
  cu::side_branch_join(join);
  // ... after it, it is
  void* m3 = cu::device_malloc(big);
  CHECK(m3 == m1);
  CHECK_CLOSE(C->get(), ref, tol_of<float>(true), "gemm of the side branch, read after the join");
  C.reset();  // freed on the main side: an ordinary free
  cu::device_free(m2);
  cu::device_free(m3);
  cu::event_destroy(fork);
  cu::event_destroy(join);
}

// device_energy_joules (runtime.cu: NVML's total-energy counter through dlopen), which
// metrics.jsonl's energy_j and make bench-e2e's energy table read: over ~0.3 s of copies it must
// grow, at a mean power between an idle board's and twice the largest board limit (H100 / H200
// SXM: 700 W; the counter moves every ~100 ms, so 0.3 s reads 2-4 of its updates). A machine
// without the counter returns -1 and the case says so.
TEST_CASE("runtime: the GPU's energy counter grows with work at a board's power", "[runtime]") {
  need_gpu();
  const double e0 = cu::device_energy_joules();
  if (e0 < 0) {
    WARN("no NVML energy counter here: device_energy_joules() is -1, nothing to check");
    return;
  }
  CHECK(e0 > 0);
  const size_t bytes = size_t(256) << 20;
  void* a = cu::device_malloc(bytes);
  void* b = cu::device_malloc(bytes);
  cu::memset_zero(a, bytes, cu::default_stream());
  cu::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  const double start = cu::device_energy_joules();
  double secs = 0;
  while (secs < 0.3) {
    for (int i = 0; i < 20; i++) cu::memcpy_d2d(i % 2 ? a : b, i % 2 ? b : a, bytes, cu::default_stream());
    cu::synchronize();
    secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  const double joules = cu::device_energy_joules() - start;
  INFO("energy " << joules << " J over " << secs << " s");
  CHECK(joules > 0);
  CHECK(joules / secs > 20.0);
  CHECK(joules / secs < 1400.0);
  cu::device_free(a);
  cu::device_free(b);
}
