// qkv::DType: names, exact scalar conversions, and the bulk conversions Tensor::to uses.
// Widening (16 bits to float) runs per SIMD target through Highway; narrowing uses the scalar
// rounding below, written so the compiler vectorises it (integer ops only).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "core/dtype.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/highway.h"
#include "simd/kv_load-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// to[i] = float(from[i]) for 16-bit `from` of type T (hwy::bfloat16_t or hwy::float16_t).
template <class T>
void WidenTo(const T* HWY_RESTRICT from, float* HWY_RESTRICT to, size_t count) {
  const hn::ScalableTag<float> df;
  const size_t lanes = hn::Lanes(df);
  size_t i = 0;
  for (; i + lanes <= count; i += lanes) hn::StoreU(kv::LoadWide(df, from + i), df, to + i);
  for (; i < count; ++i) to[i] = kv::ToFloat(from[i]);
}

void WidenBF16(const void* from, float* to, size_t count) {
  WidenTo(static_cast<const hwy::bfloat16_t*>(from), to, count);
}
void WidenF16(const void* from, float* to, size_t count) {
  WidenTo(static_cast<const hwy::float16_t*>(from), to, count);
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <cstring>
#include <ostream>
#include <string>

#include "qkv/dtype.hpp"
#include "qkv/error.hpp"

namespace qkv {

namespace detail {
HWY_EXPORT(WidenBF16);
HWY_EXPORT(WidenF16);
// The dispatches, from this namespace: HWY_DYNAMIC_DISPATCH of a qualified name does not compile
// when a single SIMD target is built (-march=native: Highway then dispatches statically).
namespace {
void widen_bf16(const void* from, float* to, size_t count) { HWY_DYNAMIC_DISPATCH(WidenBF16)(from, to, count); }
void widen_f16(const void* from, float* to, size_t count) { HWY_DYNAMIC_DISPATCH(WidenF16)(from, to, count); }
}  // namespace
}  // namespace detail

std::string_view to_string(DType dtype) {
  switch (dtype) {
    case DType::F32: return "f32";
    case DType::BF16: return "bf16";
    case DType::F16: return "f16";
    case DType::I8: return "int8";
    case DType::I4: return "int4";
  }
  return "unknown";
}

std::ostream& operator<<(std::ostream& os, DType dtype) { return os << to_string(dtype); }

DType dtype_from_string(std::string_view name) {
  if (name == "f32" || name == "float32" || name == "float") return DType::F32;
  if (name == "bf16" || name == "bfloat16") return DType::BF16;
  if (name == "f16" || name == "float16" || name == "half") return DType::F16;
  if (name == "int8" || name == "i8") return DType::I8;
  if (name == "int4" || name == "i4") return DType::I4;
  throw Error("unknown dtype '" + std::string(name) + "': expected f32, bf16, f16, int8 or int4");
}

size_t element_size(DType dtype) {
  switch (dtype) {
    case DType::F32: return 4;
    case DType::BF16:
    case DType::F16: return 2;
    case DType::I8:
    case DType::I4: return 1;
  }
  return 4;
}

bool is_quantized(DType dtype) { return dtype == DType::I8 || dtype == DType::I4; }

namespace {
uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
}  // namespace

uint16_t bf16_from_float(float x) {
  const uint32_t u = bits_of(x);
  // NaN: keep the sign and the top mantissa bits, force the quiet bit (never rounds into inf).
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  // Round to nearest even: add 0x7fff plus the lowest kept bit; a carry into the exponent is
  // the correct rounding up (to the next binade, or to inf past the largest bf16).
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float float_from_bf16(uint16_t bits) { return float_of(static_cast<uint32_t>(bits) << 16); }

uint16_t f16_from_float(float x) {
  const uint32_t u = bits_of(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN, quiet
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  const int exponent = static_cast<int>(a >> 23) - 127;
  if (exponent >= -14) {  // normal f16: drop 13 mantissa bits, ties to even (a carry is correct)
    const uint32_t rebased = a - (112u << 23);  // exponent bias 127 -> 15
    return static_cast<uint16_t>(sign | ((rebased + 0xfffu + ((rebased >> 13) & 1u)) >> 13));
  }
  if (exponent < -25) return sign;  // below half the smallest subnormal (2^-25): +-0
  // Subnormal f16: the value in units of 2^-24, the implicit bit made explicit, rounded to even.
  const uint32_t mantissa = (a & 0x7fffffu) | 0x800000u;
  const int shift = -exponent - 1;  // 14 .. 24: mantissa * 2^(exponent - 23) / 2^-24
  const uint32_t kept = mantissa >> shift, rest = mantissa & ((1u << shift) - 1), half = 1u << (shift - 1);
  const uint32_t rounded = kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
  return static_cast<uint16_t>(sign | rounded);  // rounded may reach 0x400: the smallest normal
}

float float_from_f16(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu, mantissa = bits & 0x3ffu;
  if (exponent == 0x1f) return float_of(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  if (exponent != 0) return float_of(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // Zero or subnormal: mantissa * 2^-24, exact in float.
  const float magnitude = static_cast<float>(mantissa) * float_of(0x33800000u);  // 2^-24
  return sign ? -magnitude : magnitude;
}

void convert(const void* from, DType from_type, void* to, DType to_type, size_t count) {
  if (count == 0) return;
  if (is_quantized(from_type) != is_quantized(to_type) || (is_quantized(from_type) && from_type != to_type))
    throw Error("convert: " + std::string(to_string(from_type)) + " to " + std::string(to_string(to_type)) +
                ": int8 and int4 values need their scales (qkv::quantize_kv, qkv::dequantize_kv)");
  if (from_type == to_type) {
    std::memcpy(to, from, count * element_size(from_type));
    return;
  }
  if (from_type != DType::F32 && to_type != DType::F32) {  // 16 to 16 bits: through float
    float buffer[256];
    const auto* source = static_cast<const uint16_t*>(from);
    auto* destination = static_cast<uint16_t*>(to);
    for (size_t i = 0; i < count; i += 256) {
      const size_t n = count - i < 256 ? count - i : 256;
      convert(source + i, from_type, buffer, DType::F32, n);
      convert(buffer, DType::F32, destination + i, to_type, n);
    }
    return;
  }
  if (from_type == DType::BF16) return detail::widen_bf16(from, static_cast<float*>(to), count);
  if (from_type == DType::F16) return detail::widen_f16(from, static_cast<float*>(to), count);
  const auto* source = static_cast<const float*>(from);
  auto* destination = static_cast<uint16_t*>(to);
  if (to_type == DType::BF16) {
    for (size_t i = 0; i < count; ++i) destination[i] = bf16_from_float(source[i]);
  } else {
    for (size_t i = 0; i < count; ++i) destination[i] = f16_from_float(source[i]);
  }
}

}  // namespace qkv
#endif  // HWY_ONCE
