// What the attention builder and kernels need of qkv/quantize.hpp's formats: the check of a
// quantized operand and the scalar dequantisation of one row (the reference's widened copy; the
// kernels' SIMD dequantisation is simd/kv_load-inl.h's DequantizeRow, the same arithmetic).
#pragma once

#include <cstdint>
#include <string>

#include "qkv/quantize.hpp"

namespace qkv::detail {

// Throws qkv::Error unless `scales` (f32) belong to `values` (I8 or I4) whose logical last dim is
// `dim`: the same leading dims, quantized_groups(dtype, dim) scales a row, a contiguous last dim,
// every scale finite and >= 0. `who` and `name` ("k", "v") start the message.
// scale_values = false checks the layout only (paged K/V then checks the scale pages a call
// reaches, check_scale_values, rather than the whole pool).
void check_quantized(const char* who, const char* name, const Tensor& values, const Tensor& scales, int64_t dim,
                     bool scale_values = true);
// The scan of check_quantized: every scale finite, >= 0 and small enough that each dequantised
// value is finite; `what` and `scales_name` start the message.
void check_scale_values(const std::string& what, const std::string& scales_name, DType dtype, const Tensor& scales);
// The same test on `count` contiguous scales, without a message: true when all pass (a caller
// scanning many small runs, a paged call's pages, calls check_scale_values on a failure).
bool scales_valid(const float* scales, int64_t count, DType dtype);

// The row x[0, dim) (finite) quantized into `values` (I8: dim bytes, I4: dim / 2 bytes, dim even)
// and `scales` (quantized_groups(dtype, dim) floats). False, writing nothing defined, when an
// element of x is not finite.
bool quantize_row(DType dtype, const float* x, int64_t dim, uint8_t* values, float* scales);

// out[0, dim) = the row `values` (I8: dim bytes, I4: dim / 2 bytes) times its `scales`.
void dequantize_row(DType dtype, const uint8_t* values, const float* scales, int64_t dim, float* out);

// The bytes a cache holds for one K (or V) row of `dim` values in `dtype`, its scales included,
// in a double: what memory checks multiply by rows and heads without an overflow.
double kv_row_bytes(DType dtype, int64_t dim);

}  // namespace qkv::detail
