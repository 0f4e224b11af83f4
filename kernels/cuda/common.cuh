// common.cuh: what every CUDA kernel file includes: error checks, bf16 <-> float, the
// launch check, small reductions. Host-side error macros stringify the expression, file and
// line, and throw (so a test can REQUIRE_THROWS and a run can say where it died).
#pragma once
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "kernels/kernels.h"

namespace loom::cuda {

[[noreturn]] inline void fail(const char* what, const char* expr, const char* msg, const char* file,
                              int line) {
  char buf[1024];
  std::snprintf(buf, sizeof buf, "%s failed: %s (%s) at %s:%d", what, expr, msg, file, line);
  throw std::runtime_error(buf);
}

#define CUDA_CHECK(expr)                                                                   \
  do {                                                                                     \
    cudaError_t _e = (expr);                                                               \
    if (_e != cudaSuccess) ::loom::cuda::fail("CUDA", #expr, cudaGetErrorString(_e), __FILE__, __LINE__); \
  } while (0)
#define CUBLAS_CHECK(expr)                                                                 \
  do {                                                                                     \
    cublasStatus_t _s = (expr);                                                            \
    if (_s != CUBLAS_STATUS_SUCCESS)                                                       \
      ::loom::cuda::fail("cuBLAS", #expr, cublasGetStatusString(_s), __FILE__, __LINE__);  \
  } while (0)
// after every launch: catches bad launch configurations at the launch site
#define LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())

// Programmatic dependent launch (sm_90+). A kernel launched by launch_kernel() below may be scheduled
// while the kernel before it in its stream is still finishing, instead of after it has fully
// drained: the launch latency and the block scheduling overlap the previous kernel's last wave.
// The price is a rule every kernel of kernels/cuda keeps: its first statement is pdl_entry(),
// which waits (griddepcontrol.wait) until the previous kernel has completed and its writes are
// visible, before this kernel reads or writes any global memory; then it lets the kernel after
// it be scheduled (griddepcontrol.launch_dependents; that one waits in its own pdl_entry()).
// Kernels launched without the attribute (<<<>>>, cuBLAS, cuDNN) and copies and memsets keep
// the full stream order, and so does a kernel whose predecessor is not a kernel. The wait
// returns at once when the launch had no programmatic dependency. Under CUDA graph capture the
// attribute becomes a programmatic edge of the graph. LOOM_PDL=0 turns it off (A/B timings).
__device__ __forceinline__ void pdl_entry() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// On when the device is sm_90 or newer and LOOM_PDL is not "0"; asked once per process.
inline bool pdl_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("LOOM_PDL");
    if (e && std::strcmp(e, "0") == 0) return false;
    int dev = 0, major = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    return major >= 9;
  }();
  return on;
}

// The current device is compute capability 9.0 (sm_90a code runs there: the wgmma attention
// kernels and gemm_sm90.cu's products); asked once per process, false when no device answers.
inline bool device_is_sm90() {
  static const bool ok = [] {
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    return major == 9 && minor == 0;
  }();
  return ok;
}

// kernel<<<grid, block, smem, s>>>(args...) with programmatic dependent launch allowed. The
// arguments are converted to the kernel's parameter types, as <<<>>> converts them. A bad
// configuration throws here with the grid, block and shared-memory size in the message (the
// error is cleared first, as LAUNCH_CHECK's cudaGetLastError would clear it).
template <class... KArgs, class... Args>
inline void launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                   Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 1 : 0;
  cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    char what[160];
    std::snprintf(what, sizeof what, "kernel launch, grid (%u, %u, %u), block (%u, %u, %u), %zu B shared",
                  grid.x, grid.y, grid.z, block.x, block.y, block.z, smem);
    fail("CUDA", what, cudaGetErrorString(e), __FILE__, __LINE__);
  }
}

// bf16 is layout-compatible with __nv_bfloat16, f16 with __half
template <class T> struct device_type { using type = T; };
template <> struct device_type<bf16> { using type = __nv_bfloat16; };
template <> struct device_type<f16> { using type = __half; };
template <class T> using dev_t = typename device_type<T>::type;
template <class T> inline dev_t<T>* dptr(T* p) { return reinterpret_cast<dev_t<T>*>(p); }
template <class T> inline const dev_t<T>* dptr(const T* p) { return reinterpret_cast<const dev_t<T>*>(p); }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// Shared-memory address of a generic pointer, and 16-byte asynchronous copies global -> shared
// (cp.async, sm_80+): a thread's copies since its last commit form one group; wait_group N
// returns when at most N of its groups are still in flight, and makes the landed bytes visible
// to that thread (other threads need a barrier). !valid zero-fills the 16 bytes, reading nothing.
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");  // no shared load hoisted above it
}

// The logistic sigmoid as the SiLU / SwiGLU kernels compute it (activations.cu), and gemm_sm90.cu's
// SwiGLU epilogues, which must give the same bits: ex2.approx-based __expf and a fast divide
// (an SFU reciprocal and a multiply; 0 once 1 + e^-x passes 2^126). Against 1 / (1 + expf(-x))
// it differs by a few ulp and is ~30 instructions shorter per element.
__device__ __forceinline__ float sigmoid_f(float x) { return __fdividef(1.f, 1.f + __expf(-x)); }
// GELU (tanh approximation) and its derivative, as activations.cu's kernels and gemm_sm90.cu's
// DGELU epilogue compute them
__device__ __forceinline__ float gelu_f(float x) {
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.f + tanhf(u));
}
__device__ __forceinline__ float gelu_df(float x) {
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x), t = tanhf(u);
  return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * 0.7978845608028654f * (1.f + 3.f * 0.044715f * x * x);
}
// SwiGLU of one element and its gradients, as activations.cu's kernels and gemm_sm90.cu's
// epilogues compute them (one definition, so both give the same bits):
//   swiglu_f: silu(g) u;  swiglu_b: dg = d u s (1 + g (1 - s)), du = d g s, s = sigmoid(g)
__device__ __forceinline__ float swiglu_f(float g, float u) { return g * sigmoid_f(g) * u; }
__device__ __forceinline__ void swiglu_b(float& dg, float& du, float d, float g, float u) {
  const float s = sigmoid_f(g);
  dg = d * u * s * (1.f + g * (1.f - s));
  du = d * g * s;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// VEC elements moved as one aligned access (16 bytes for VEC = 16 / sizeof(DT)).
template <class DT, int VEC>
struct alignas(sizeof(DT) * VEC) Pack {
  DT v[VEC];
};
inline bool aligned(const void* p, size_t a) { return (reinterpret_cast<uintptr_t>(p) % a) == 0; }

inline int ceil_div(long long a, long long b) { return int((a + b - 1) / b); }
// Multiprocessors of the current device, asked once (launch-grid heuristics).
inline int sm_count() {
  static const int n = [] {
    int dev = 0, v = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return v;
  }();
  return n;
}

// Shared handles (created once per process, on first use).
cublasLtHandle_t cublaslt_handle();
cublasHandle_t cublas_handle();
// A workspace for cuBLASLt (32 MiB, allocated once).
void* cublaslt_workspace(size_t* bytes);

}  // namespace loom::cuda
