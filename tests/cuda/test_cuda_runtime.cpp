// test_cuda_runtime.cpp: kernels/cuda/runtime.cu (the caching allocator, streams, events) against
// the loom::cpu reference, f32 and bf16 (tests/cuda/cuda_kernel_test_util.h). Skipped without a
// GPU.
//   bash tools/gpu-kernels.sh tests/cuda/test_cuda_runtime.cpp
#include <catch2/catch.hpp>

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
  void* big = cu::device_malloc((3 << 20) + 5);  // 2 MiB classes above 1 MiB
  CHECK(cu::bytes_in_use() == base + 1024 + (4 << 20));
  CHECK(cu::peak_bytes_in_use() >= cu::bytes_in_use());
  cu::device_free(big);
  cu::device_free(b);
  CHECK(cu::bytes_in_use() == base);
  cu::reset_peak_bytes();
  CHECK(cu::peak_bytes_in_use() == base);
  REQUIRE_THROWS(cu::device_free(reinterpret_cast<void*>(0x1234)));

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
