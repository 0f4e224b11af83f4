// scalar.h: the scalar types kernels compute in, below every other layer: the bf16 storage
// type and acc_t<T>, the type statistics and losses accumulate in. kernels/kernels.h includes
// it; tensor/dtype.h adds the element-type tags (DType) and devices on top of it.
//
// bf16 here is a plain 16-bit struct with the same layout as CUDA's __nv_bfloat16, so host
// code (and CPU-only builds) can hold, convert and save bf16 data without CUDA headers.
// CUDA kernels reinterpret_cast `bf16*` to `__nv_bfloat16*` (kernels/cuda/common.cuh, dptr).
#pragma once
#include <cstdint>
#include <cstring>

namespace loom {

struct bf16 {
  uint16_t bits = 0;
  bf16() = default;
  // round to nearest even; NaN stays NaN (quiet bit forced)
  explicit bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) { bits = uint16_t((u >> 16) | 0x40); return; }
    u += 0x7fffu + ((u >> 16) & 1u);
    bits = uint16_t(u >> 16);
  }
  explicit operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

// The accumulation / statistics type of an activation type: double stays double (gradient
// checks), everything else accumulates in float.
template <class T> struct acc { using type = float; };
template <> struct acc<double> { using type = double; };
template <class T> using acc_t = typename acc<T>::type;

}  // namespace loom
