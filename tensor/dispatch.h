// dispatch.h: from a tensor's (device, dtype) to the one kernel declaration.
//
//   dispatch_float(x, [&](auto dev, auto zero) {
//     using T = decltype(zero);
//     KERNEL(dev, layernorm_forward)(out.data<T>(), ..., stream_for(dev));
//   });
//
// The CPU backend is instantiated for float and double, CUDA for float, bf16 and f16; the
// generic lambda is only ever instantiated with those pairs, so cuda::op<double> is never
// referenced (and a CPU-only build never references any cuda:: kernel).
#pragma once
#include <type_traits>

#include "tensor/tensor.h"

namespace loom {

struct CpuTag {};
struct CudaTag {};

template <class Dev> inline Stream stream_for(Dev) {
  if constexpr (std::is_same_v<Dev, CudaTag>) return cuda::default_stream();
  else return nullptr;
}

// KERNEL(dev, name) names loom::cpu::name or loom::cuda::name by the tag's type.
#define KERNEL(dev, name)                                                               \
  [&](auto&&... args) {                                                                 \
    if constexpr (std::is_same_v<std::decay_t<decltype(dev)>, ::loom::CudaTag>)        \
      ::loom::cuda::name(std::forward<decltype(args)>(args)...);                        \
    else                                                                                \
      ::loom::cpu::name(std::forward<decltype(args)>(args)...);                         \
  }

[[noreturn]] void throw_no_kernel(const char* what, const Tensor& t);

// Floating activations: cpu {f32, f64}, cuda {f32, bf16, f16}.
template <class F> void dispatch_float(const Tensor& t, F&& f) {
  if (t.device() == Device::CPU) {
    if (t.dtype() == DType::F32) return f(CpuTag{}, float{});
    if (t.dtype() == DType::F64) return f(CpuTag{}, double{});
  } else {
#ifdef LOOM_CUDA
    if (t.dtype() == DType::F32) return f(CudaTag{}, float{});
    if (t.dtype() == DType::BF16) return f(CudaTag{}, bf16{});
    if (t.dtype() == DType::F16) return f(CudaTag{}, f16{});
#endif
  }
  throw_no_kernel("floating op", t);
}

// Storage-level ops (copy, fill, convert) that exist for every dtype on both devices.
template <class F> void dispatch_any(const Tensor& t, F&& f) {
  auto go = [&](auto dev) {
    switch (t.dtype()) {
      case DType::F32: return f(dev, float{});
      case DType::F64: return f(dev, double{});
      case DType::BF16: return f(dev, bf16{});
      case DType::F16: return f(dev, f16{});
      case DType::I32: return f(dev, int32_t{});
      case DType::I64: return f(dev, int64_t{});
      case DType::U8: return f(dev, uint8_t{});
      default: throw_no_kernel("storage op", t);
    }
  };
  if (t.device() == Device::CPU) return go(CpuTag{});
#ifdef LOOM_CUDA
  return go(CudaTag{});
#else
  throw_no_kernel("storage op", t);
#endif
}

}  // namespace loom
