// scalar.h: the scalar types kernels compute in, below every other layer: the bf16 and f16
// storage types and acc_t<T>, the type statistics and losses accumulate in. kernels/kernels.h includes
// it; tensor/dtype.h adds the element-type tags (DType) and devices on top of it.
//
// bf16 here is a plain 16-bit struct with the same layout as CUDA's __nv_bfloat16, so host
// code (and CPU-only builds) can hold, convert and save bf16 data without CUDA headers.
// CUDA kernels reinterpret_cast `bf16*` to `__nv_bfloat16*` (kernels/cuda/common.cuh, dptr).
// f16 is IEEE binary16 the same way (CUDA's __half): 5 exponent bits instead of bf16's 8, so it
// keeps 3 more mantissa bits but overflows past 65504 and flushes below 6e-8 (why fp16
// training scales the loss, docs/DESIGN.md "fp16").
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

// IEEE binary16 <-> float, round to nearest even (subnormals kept, overflow to inf, NaN kept).
inline float half_bits_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) u = sign;
    else {  // subnormal: renormalize
      int e = -1;
      do { man <<= 1; e++; } while (!(man & 0x400));
      u = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else if (exp == 31) u = sign | 0x7f800000u | man << 13;
  else u = sign | (exp + 112) << 23 | man << 13;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_half_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t sign = uint16_t((u >> 16) & 0x8000);
  int32_t exp = int32_t((u >> 23) & 0xff) - 127 + 15;
  uint32_t man = u & 0x7fffff;
  if (((u >> 23) & 0xff) == 0xff) return uint16_t(sign | 0x7c00 | (man ? 0x200 : 0));
  if (exp >= 31) return uint16_t(sign | 0x7c00);
  if (exp <= 0) {
    if (exp < -10) return sign;
    man |= 0x800000;
    uint32_t shift = uint32_t(14 - exp);
    uint32_t half_man = man >> shift, rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half_man & 1))) half_man++;
    return uint16_t(sign | half_man);
  }
  uint32_t half = uint32_t(sign) | uint32_t(exp) << 10 | man >> 13;
  uint32_t rem = man & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) half++;  // a carry into the exponent is right
  return uint16_t(half);
}

struct f16 {
  uint16_t bits = 0;
  f16() = default;
  explicit f16(float f) : bits(float_to_half_bits(f)) {}
  explicit operator float() const { return half_bits_to_float(bits); }
};

// The accumulation / statistics type of an activation type: double stays double (gradient
// checks), everything else accumulates in float.
template <class T> struct acc { using type = float; };
template <> struct acc<double> { using type = double; };
template <class T> using acc_t = typename acc<T>::type;

}  // namespace loom
