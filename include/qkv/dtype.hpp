// qkv::DType: the element types a Tensor can hold. Arithmetic is float32 everywhere; the 16-bit
// types exist to halve the bytes of what is mostly read (the keys and values of a KV cache):
// scaled_dot_product_attention reads K and V in any of them, everything else asks for F32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <string_view>

namespace qkv {

enum class DType {
  F32,   // IEEE binary32
  BF16,  // bfloat16: float32's sign and 8-bit exponent, 7 mantissa bits (the top half of a float)
  F16,   // IEEE binary16: 5-bit exponent, 10 mantissa bits, max 65504
  // Quantized K/V (qkv/quantize.hpp): integers whose float scales live in a second tensor.
  I8,    // int8, one byte an element: x = q * scale, q in [-127, 127]
  I4,    // 4-bit pairs: each element is a byte holding two 4-bit values (the last dim is D / 2)
};

std::string_view to_string(DType dtype);  // "f32", "bf16", "f16", "int8", "int4"
std::ostream& operator<<(std::ostream& os, DType dtype);
// "f32"/"float32", "bf16"/"bfloat16", "f16"/"float16"/"half", "int8"/"i8", "int4"/"i4"; throws
// qkv::Error otherwise.
DType dtype_from_string(std::string_view name);
size_t element_size(DType dtype);  // bytes: 4, 2, 2, 1, 1 (an I4 element is a byte of two values)
bool is_quantized(DType dtype);    // I8 or I4

// Scalar conversions, exact to IEEE: float to 16 bits rounds to nearest, ties to even; NaN stays
// NaN (quiet, sign kept); F16 overflows to +-inf and keeps subnormals.
uint16_t bf16_from_float(float x);
float float_from_bf16(uint16_t bits);
uint16_t f16_from_float(float x);
float float_from_f16(uint16_t bits);

// Bulk conversions of `count` elements between packed arrays (SIMD where the CPU has it; the
// same bits as the scalar functions above). F32, BF16 and F16 only: quantized types need their
// scales (qkv::quantize_kv, dequantize_kv), and throw qkv::Error here.
void convert(const void* from, DType from_type, void* to, DType to_type, size_t count);

}  // namespace qkv
