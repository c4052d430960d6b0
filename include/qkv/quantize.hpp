// Quantized keys and values: int8 and 4-bit K/V for the KV cache and attention, a quarter and an
// eighth of float32's bytes (decode reads every byte of K and V once per step).
//
// A quantized operand is two tensors: `values` (DType::I8 or DType::I4) and `scales` (f32), where
// scaled_dot_product_attention takes k and v (AttentionOptions::k_scales, v_scales). For x of shape
// L + (D):
//   int8  values L + (D) int8, scales L + (1): one scale per row (per token and head in a cache),
//         scale = max|x_row| / 127, q = round(x / scale) in [-127, 127], x' = q scale.
//         |x - x'| <= scale / 2 = max|x_row| / 254 per element.
//   int4  values L + (D / 2) bytes, scales L + (ceil(D / 32)): one scale per group of 32 along D
//         (the last group holds D mod 32 when D is not a multiple of 32; D must be even),
//         scale = max|x_group| / 7, q = round(x / scale) in [-7, 7], x' = q scale.
//         |x - x'| <= scale / 2 = max|x_group| / 14 per element.
//         A group of n elements is n / 2 bytes: byte j holds element j in its low 4 bits and
//         element j + n / 2 in its high 4 bits, each stored as q + 8 (ggml's q4_0 layout, with a
//         symmetric scale: q4_0 maps the signed largest value to -8).
// (Bounds in exact arithmetic; float32 adds half an ulp of x / scale times scale, an ulp of x'.)
// A scale of 0 (an all-zero row or group) dequantises to zeros.
#pragma once

#include <cstdint>

#include "qkv/dtype.hpp"
#include "qkv/tensor.hpp"

namespace qkv {

constexpr int64_t kInt4Group = 32;  // elements per scale of DType::I4, along the last dim

struct QuantizedTensor {
  Tensor values;  // I8: the shape of x; I4: x's with the last dim halved
  Tensor scales;  // f32: x's shape with the last dim replaced by the number of groups
  DType dtype() const { return values.dtype(); }
};

// x (f32, finite, rank >= 1, any strides) quantized as above; dtype I8 or I4. Throws qkv::Error for
// another dtype, a non-finite element (naming its index) or, for I4, an odd last dim.
QuantizedTensor quantize_kv(const Tensor& x, DType dtype);

// The f32 values a quantized tensor stands for (shape L + (D)), exactly as the kernels dequantise
// them: x' = q * scale in float32. Throws qkv::Error when the scales' shape does not match.
Tensor dequantize_kv(const QuantizedTensor& q);

// Scales per row of D elements: 1 for I8, ceil(D / 32) for I4.
int64_t quantized_groups(DType dtype, int64_t dim);

}  // namespace qkv
