// dtype.h: element types, devices and the bf16 storage type shared by every layer.
//
// bf16 here is a plain 16-bit struct with the same layout as CUDA's __nv_bfloat16, so host
// code (and CPU-only builds) can hold, convert and save bf16 data without CUDA headers.
// CUDA kernels reinterpret_cast `bf16*` to `__nv_bfloat16*`.
#pragma once
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace loom {

enum class DType : uint8_t { F32, BF16, F64, I32, I64, U8, F16 };
enum class Device : uint8_t { CPU, CUDA };

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

// IEEE half, storage only (safetensors F16 load/save); converted to f32 on load.
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);

// The accumulation / statistics type of an activation type: double stays double (gradient
// checks), everything else accumulates in float.
template <class T> struct acc { using type = float; };
template <> struct acc<double> { using type = double; };
template <class T> using acc_t = typename acc<T>::type;

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::F64: return 8;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::U8: return 1;
    case DType::F16: return 2;
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::BF16: return "bf16";
    case DType::F64: return "f64";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::U8: return "u8";
    case DType::F16: return "f16";
  }
  return "?";
}

inline bool dtype_is_float(DType t) {
  return t == DType::F32 || t == DType::BF16 || t == DType::F64 || t == DType::F16;
}

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<double>() { return DType::F64; }
template <> constexpr DType dtype_of<bf16>() { return DType::BF16; }
template <> constexpr DType dtype_of<int32_t>() { return DType::I32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::I64; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::U8; }

inline const char* device_name(Device d) { return d == Device::CPU ? "cpu" : "cuda"; }

}  // namespace loom
