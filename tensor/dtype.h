// dtype.h: element types (DType) and devices, for tensors and everything above them. The
// scalar types themselves (bf16, acc_t) live one layer down, in kernels/scalar.h, because the
// kernels compute in them and may not include tensor/.
#pragma once
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/scalar.h"

namespace loom {

enum class DType : uint8_t { F32, BF16, F64, I32, I64, U8, F16 };
enum class Device : uint8_t { CPU, CUDA };

// IEEE half bits <-> float (the f16 type of kernels/scalar.h; safetensors F16 files load as f32).
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);

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
template <> constexpr DType dtype_of<f16>() { return DType::F16; }
template <> constexpr DType dtype_of<int32_t>() { return DType::I32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::I64; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::U8; }

inline const char* device_name(Device d) { return d == Device::CPU ? "cpu" : "cuda"; }

}  // namespace loom
