/*
 * runtime.cu: the CUDA runtime of loom: device discovery, the streams, events, CUDA graph
 * capture, pinned host buffers, memcpy/memset wrappers and the shared cuBLAS(Lt) handles
 * declared in common.cuh. The caching device allocator and its pools (the graph pool, the side
 * scope's and a side branch's) are in allocator.cu.
 *
 * Stream: default_stream() is one stream created on first use with default flags, so it
 *   also orders against the legacy stream 0 (safe for code that uses plain cudaMemcpy), and
 *   it can be captured into a CUDA graph (stream 0 cannot). It runs at the device's greatest
 *   priority and the side stream (below) at the least: only their order against each other
 *   changes (the copy stream moves bytes, no kernels).
 *
 * Side scope (side_scope_begin/end, allocator.cu): default_stream() returns side_stream() in it.
 *
 * Test: tests/cuda/test_cuda_runtime.cpp; on a CUDA machine:
 *   bash tools/gpu-kernels.sh tests/cuda/test_cuda_runtime.cpp
 */
#include <cstdlib>

#include <dlfcn.h>

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

void range_push(const char* name) { nvtxRangePushA(name); }
void range_pop() { nvtxRangePop(); }

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

// Priorities: the main stream at the device's greatest, the side stream at its least, so that
// where both have blocks waiting the step's go first and the side work (needed one step later)
// fills what the step leaves idle. LOOM_STREAM_PRIORITIES=0: both at the default (measurement).
int stream_priority(bool main) {
  static const bool on = [] {
    const char* e = std::getenv("LOOM_STREAM_PRIORITIES");
    return !(e && e[0] == '0');
  }();
  if (!on) return 0;
  int least = 0, greatest = 0;
  CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  return main ? greatest : least;
}
cudaStream_t create_stream(bool main) {
  cudaStream_t st;
  CUDA_CHECK(cudaStreamCreateWithPriority(&st, cudaStreamDefault, stream_priority(main)));
  return st;
}
// NVML through dlopen (kernels.h): its init, the handle of this process's device by PCI bus id
// (NVML's device order need not be CUDA's) and the total-energy counter (mJ), looked up once.
double device_energy_joules() {
  struct Nvml {
    int (*energy)(void*, unsigned long long*) = nullptr;  // nvmlDeviceGetTotalEnergyConsumption
    void* device = nullptr;                                // nvmlDevice_t
  };
  static const Nvml nvml = [] {
    Nvml n;
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return n;
    auto init = reinterpret_cast<int (*)()>(dlsym(lib, "nvmlInit_v2"));
    auto by_bus = reinterpret_cast<int (*)(const char*, void**)>(dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
    auto energy = reinterpret_cast<int (*)(void*, unsigned long long*)>(dlsym(lib, "nvmlDeviceGetTotalEnergyConsumption"));
    int dev = 0;
    char bus[32] = {};
    void* handle = nullptr;
    unsigned long long mj = 0;
    if (!init || !by_bus || !energy || init() != 0 || cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetPCIBusId(bus, int(sizeof bus), dev) != cudaSuccess || by_bus(bus, &handle) != 0 ||
        energy(handle, &mj) != 0)
      return n;  // the library stays loaded: a handful of pages, and nvmlShutdown would not matter
    n.energy = energy;
    n.device = handle;
    return n;
  }();
  unsigned long long mj = 0;
  if (!nvml.energy || nvml.energy(nvml.device, &mj) != 0) return -1.0;
  return double(mj) / 1e3;
}

Stream main_stream() {
  static cudaStream_t s = create_stream(true);
  return s;
}
Stream side_stream() {
  static cudaStream_t s = create_stream(false);
  return s;
}
Stream default_stream() { return side_scope_active() ? side_stream() : main_stream(); }
// Data parallel's averages beside the backward: non-blocking, at the main stream's priority, so
// that a bucket's few NCCL blocks start as soon as its event fires instead of queueing behind
// the backward's blocks
Stream comm_stream() {
  static cudaStream_t s = [] {
    cudaStream_t st;
    CUDA_CHECK(cudaStreamCreateWithPriority(&st, cudaStreamNonBlocking, stream_priority(true)));
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
  // one per stream: GEMMs of the side stream may run while the default stream's do
  static void* w[2] = {nullptr, nullptr};
  void*& mine = w[side_scope_active() ? 1 : 0];
  if (!mine) mine = device_malloc(kBytes);  // in the side scope: from the side pool
  if (bytes) *bytes = kBytes;
  return mine;
}

}  // namespace loom::cuda
