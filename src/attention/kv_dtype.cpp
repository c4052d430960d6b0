// 16-bit and quantized keys and values for the reference kernel, which reads only float K/V: one
// packed float copy of K and V per call, then the kernel on the same problem. Decode and flash
// widen a tile at a time (decode/chunk-inl.h, flash/operands-inl.h).
#include <algorithm>

#include "attention/problem.hpp"
#include "core/allocator.hpp"
#include "core/quantize.hpp"
#include "qkv/dtype.hpp"

namespace qkv::detail {

namespace {
// Rows (B, H, N, D) of K or V (16-bit bits, or quantized values and scales) widened into a packed
// float array `to`.
void widen_rows(const AttentionProblem& p, bool keys, int64_t dim, float* to) {
  const Rows<const uint16_t>& bits = keys ? p.k_bits : p.v_bits;
  const Rows<const uint8_t>& quant = keys ? p.k_quant : p.v_quant;
  const Rows<const float>& scales = keys ? p.k_scales : p.v_scales;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.kv_heads; ++h)
      for (int64_t i = 0; i < p.kv_len; ++i) {
        float* row = to + ((b * p.kv_heads + h) * p.kv_len + i) * dim;
        if (is_quantized(p.kv_dtype)) {
          dequantize_row(p.kv_dtype, quant.row(b, h, i), scales.row(b, h, i), dim, row);
        } else {
          convert(bits.row(b, h, i), p.kv_dtype, row, DType::F32, static_cast<size_t>(dim));
        }
      }
}
}  // namespace

void with_float_kv(const AttentionProblem& problem, void (*kernel)(const AttentionProblem&)) {
  if (problem.kv_dtype == DType::F32) return kernel(problem);
  const AttentionProblem& p = problem;
  const int64_t k_count = p.batch * p.kv_heads * p.kv_len * p.head_dim;
  const int64_t v_count = p.batch * p.kv_heads * p.kv_len * p.value_dim;
  const Tensor k = Tensor::empty(Shape{std::max<int64_t>(k_count, 1)});
  const Tensor v = Tensor::empty(Shape{std::max<int64_t>(v_count, 1)});
  widen_rows(p, true, p.head_dim, k.data());
  widen_rows(p, false, p.value_dim, v.data());
  AttentionProblem wide = problem;
  wide.kv_dtype = DType::F32;
  wide.k_bits = wide.v_bits = {};
  wide.k_quant = wide.v_quant = {};
  wide.k_scales = wide.v_scales = {};
  wide.k = {k.data(), p.kv_heads * p.kv_len * p.head_dim, p.kv_len * p.head_dim, std::max<int64_t>(p.head_dim, 1)};
  wide.v = {v.data(), p.kv_heads * p.kv_len * p.value_dim, p.kv_len * p.value_dim, std::max<int64_t>(p.value_dim, 1)};
  kernel(wide);
}

}  // namespace qkv::detail
