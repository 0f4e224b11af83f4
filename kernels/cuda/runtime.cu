/*
 * runtime.cu: the CUDA runtime of loom: device discovery, a caching device allocator, the
 * default stream, pinned host buffers, memcpy/memset wrappers and the shared cuBLAS(Lt)
 * handles declared in common.cuh.
 *
 * Caching allocator
 *   A request is rounded up to a size class:
 *     < 1 MiB   -> multiple of 512 B      (activations of small models, statistics, scalars)
 *     >= 1 MiB  -> multiple of 2 MiB, and of 1/16 of the power of two below the size past
 *                  32 MiB (weights, activations, optimizer states: at most ~6% rounding)
 *   Each class keeps a free list. device_free() never calls cudaFree: the block goes back to
 *   its free list and a later request reuses it, so a steady-state training step does no
 *   cudaMalloc and no cudaFree (both synchronize the device). A large request takes the
 *   smallest cached block that fits it with at most 1/8 (or 2 MiB) to spare (best fit), so
 *   shapes that vary a little between steps do not grow the cache step after step.
 *   Reuse is stream-ordered: every loom kernel runs on default_stream(), so a block freed
 *   after a launch and handed out again is only touched by later work in the same stream.
 *   When cudaMalloc runs out of memory, the cached blocks are released (after a device
 *   synchronize) and the request is tried once more.
 *   Statistics: bytes_in_use() counts the rounded sizes of live blocks; peak_bytes_in_use()
 *   their maximum since reset_peak_bytes().
 *
 * Graph pool: while a training step is captured into a CUDA graph (graph_pool_begin/end), the
 *   allocations come from a second set of free lists, and every block handed out then stays
 *   the graph pool's for good (freed later, it returns there): a graph writes its addresses at
 *   every replay, so they must never be given to other code. release_cached() (synchronizes)
 *   gives the unused blocks of the ordinary lists back to the driver before a capture, so the
 *   eager warm-up steps' cache and the graph's pool are not both reserved.
 *
 * Stream: default_stream() is one stream created on first use with default flags, so it
 *   also orders against the legacy stream 0 (safe for code that uses plain cudaMemcpy), and
 *   it can be captured into a CUDA graph (stream 0 cannot).
 *
 * Test: tests/cuda/test_cuda_runtime.cpp; on a CUDA machine:
 *   bash tools/gpu-kernels.sh tests/cuda/test_cuda_runtime.cpp
 */
#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <nvtx3/nvToolsExt.h>

#include "kernels/cuda/common.cuh"

namespace loom::cuda {

bool available() {
  // No driver or no device: report false instead of throwing, and clear the sticky error so
  // that later runtime calls do not see it.
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

namespace {

constexpr size_t kSmallLimit = size_t(1) << 20;   // 1 MiB
constexpr size_t kSmallRound = 512;
constexpr size_t kLargeRound = size_t(2) << 20;   // 2 MiB

size_t round_size(size_t bytes) {
  if (bytes == 0) bytes = 1;
  size_t r = kSmallRound;
  if (bytes >= kSmallLimit) {  // 2 MiB steps, coarser above 32 MiB: 1/16 of the power of two below
    size_t p = size_t(1) << (63 - __builtin_clzll(bytes));
    r = std::max(kLargeRound, p / 16);
  }
  return (bytes + r - 1) / r * r;
}

struct Allocator {
  std::mutex mu;
  std::map<size_t, std::vector<void*>> free_lists;   // size class -> cached blocks
  std::unordered_map<void*, size_t> live;            // block -> size class
  // the graph pool (graph_pool_begin): its blocks are served and returned apart
  bool pool_mode = false;
  std::unordered_map<void*, bool> graph_owned;
  std::map<size_t, std::vector<void*>> graph_free;
  size_t in_use = 0, peak = 0, cached = 0, peak_reserved = 0;

  void release_cache() {  // caller holds mu
    CUDA_CHECK(cudaDeviceSynchronize());
    for (auto& kv : free_lists)
      for (void* p : kv.second) {
        CUDA_CHECK(cudaFree(p));
        cached -= kv.first;
      }
    free_lists.clear();  // the graph pool's blocks stay: a graph may still use them
  }

  void* alloc(size_t bytes) {
    size_t sz = round_size(bytes);
    std::lock_guard<std::mutex> lock(mu);
    void* p = nullptr;
    auto& lists = pool_mode ? graph_free : free_lists;
    // Best fit: the smallest cached block that holds the request, if it wastes at most an
    // eighth (and 2 MiB past the class size for large blocks). Batches whose shapes change a
    // little from step to step (a VLM batch's image count) then reuse blocks instead of
    // adding new ones to the cache.
    auto it = lists.lower_bound(sz);
    while (it != lists.end() && it->second.empty()) ++it;
    const size_t slack = sz < kSmallLimit ? 0 : std::max(sz / 8, kLargeRound);
    if (it != lists.end() && it->first <= sz + slack) {
      p = it->second.back();
      it->second.pop_back();
      sz = it->first;  // the block keeps its size
      cached -= sz;
    } else {
      cudaError_t e = cudaMalloc(&p, sz);
      if (e == cudaErrorMemoryAllocation && cached > 0) {
        cudaGetLastError();
        release_cache();
        e = cudaMalloc(&p, sz);
      }
      if (e != cudaSuccess) {
        cudaGetLastError();
        char buf[256];
        std::snprintf(buf, sizeof buf,
                      "device_malloc(%zu bytes) failed: %s (in use %zu bytes, peak %zu)", bytes,
                      cudaGetErrorString(e), in_use, peak);
        throw std::runtime_error(buf);
      }
    }
    live[p] = sz;
    if (pool_mode) graph_owned[p] = true;
    in_use += sz;
    if (in_use > peak) peak = in_use;
    if (in_use + cached > peak_reserved) peak_reserved = in_use + cached;
    return p;
  }

  void free(void* p) {
    if (!p) return;
    std::lock_guard<std::mutex> lock(mu);
    auto it = live.find(p);
    if (it == live.end()) throw std::runtime_error("device_free: pointer was not allocated by device_malloc");
    size_t sz = it->second;
    live.erase(it);
    in_use -= sz;
    (graph_owned.count(p) ? graph_free : free_lists)[sz].push_back(p);
    cached += sz;
  }
};

Allocator& allocator() {
  // Leaked on purpose: freeing device memory during static destruction races the driver's
  // own teardown.
  static Allocator* a = new Allocator();
  return *a;
}

}  // namespace

void* device_malloc(size_t bytes) { return allocator().alloc(bytes); }
void device_free(void* p) { allocator().free(p); }

size_t bytes_in_use() {
  std::lock_guard<std::mutex> lock(allocator().mu);
  return allocator().in_use;
}
size_t peak_bytes_in_use() {
  std::lock_guard<std::mutex> lock(allocator().mu);
  return allocator().peak;
}
void reset_peak_bytes() {
  std::lock_guard<std::mutex> lock(allocator().mu);
  allocator().peak = allocator().in_use;
  allocator().peak_reserved = allocator().in_use + allocator().cached;
}
size_t bytes_reserved() {
  std::lock_guard<std::mutex> lock(allocator().mu);
  return allocator().in_use + allocator().cached;
}
size_t peak_bytes_reserved() {
  std::lock_guard<std::mutex> lock(allocator().mu);
  return allocator().peak_reserved;
}

void range_push(const char* name) { nvtxRangePushA(name); }
void range_pop() { nvtxRangePop(); }

void graph_pool_begin() {
  std::lock_guard<std::mutex> lock(allocator().mu);
  allocator().pool_mode = true;
}
void graph_pool_end() {
  std::lock_guard<std::mutex> lock(allocator().mu);
  allocator().pool_mode = false;
}
void release_cached() {
  std::lock_guard<std::mutex> lock(allocator().mu);
  allocator().release_cache();
}

void graph_capture_begin(Stream s) {
  // Relaxed: the graph pool may cudaMalloc a new block during the capture (the stricter modes
  // refuse it), and the loader threads go on with their own CUDA calls meanwhile.
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
}
void* graph_capture_end(Stream s) {
  cudaGraph_t g = nullptr;
  CUDA_CHECK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
  CUDA_CHECK(cudaGraphDestroy(g));
  return exec;
}
void graph_launch(void* g, Stream s) { CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(g), s)); }
void graph_destroy(void* g) {
  if (g) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(g));
}

Stream copy_stream() {
  static cudaStream_t s = [] {
    cudaStream_t st;
    CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    return st;
  }();
  return s;
}

void* event_create(bool timing) {
  cudaEvent_t e;
  CUDA_CHECK(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
  return e;
}
void event_destroy(void* e) {
  if (e) cudaEventDestroy(static_cast<cudaEvent_t>(e));  // no throw: called from destructors
}
void event_record(void* e, Stream s) { CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(e), s)); }
void stream_wait_event(Stream s, void* e) { CUDA_CHECK(cudaStreamWaitEvent(s, static_cast<cudaEvent_t>(e), 0)); }
void event_synchronize(void* e) { CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(e))); }
bool event_done(void* e) {
  cudaError_t r = cudaEventQuery(static_cast<cudaEvent_t>(e));
  if (r == cudaErrorNotReady) return false;
  CUDA_CHECK(r);
  return true;
}
float event_elapsed_ms(void* a, void* b) {
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(a), static_cast<cudaEvent_t>(b)));
  return ms;
}
void memcpy_h2d_async(void* dst, const void* src, size_t bytes, Stream s) {
  if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
}
void memcpy_d2h_async(void* dst, const void* src, size_t bytes, Stream s) {
  if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
}

Stream default_stream() {
  static cudaStream_t s = [] {
    cudaStream_t st;
    CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamDefault));
    return st;
  }();
  return s;
}

void memcpy_h2d(void* dst, const void* src, size_t bytes, Stream s) {
  if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
}
void memcpy_d2h(void* dst, const void* src, size_t bytes, Stream s) {
  if (!bytes) return;
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));  // the caller reads dst next
}
void memcpy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width_bytes, size_t rows, Stream s) {
  if (rows == 0 || width_bytes == 0) return;
  CUDA_CHECK(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width_bytes, rows, cudaMemcpyDefault, s));
}

void memcpy_d2d(void* dst, const void* src, size_t bytes, Stream s) {
  if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
}
void memset_zero(void* dst, size_t bytes, Stream s) {
  if (bytes) CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, s));
}

void* pinned_malloc(size_t bytes) {
  void* p = nullptr;
  CUDA_CHECK(cudaMallocHost(&p, bytes ? bytes : 1));
  return p;
}
void pinned_free(void* p) {
  if (p) CUDA_CHECK(cudaFreeHost(p));
}

void synchronize() { CUDA_CHECK(cudaDeviceSynchronize()); }

cublasLtHandle_t cublaslt_handle() {
  static cublasLtHandle_t h = [] {
    cublasLtHandle_t x;
    CUBLAS_CHECK(cublasLtCreate(&x));
    return x;
  }();
  return h;
}

cublasHandle_t cublas_handle() {
  static cublasHandle_t h = [] {
    cublasHandle_t x;
    CUBLAS_CHECK(cublasCreate(&x));
    // fp32 GEMMs stay exact fp32: no TF32 unless a caller asks for it
    CUBLAS_CHECK(cublasSetMathMode(x, CUBLAS_DEFAULT_MATH));
    return x;
  }();
  return h;
}

void* cublaslt_workspace(size_t* bytes) {
  constexpr size_t kBytes = size_t(32) << 20;  // 32 MiB: what cuBLASLt asks for on Hopper
  static void* w = device_malloc(kBytes);
  if (bytes) *bytes = kBytes;
  return w;
}

}  // namespace loom::cuda
