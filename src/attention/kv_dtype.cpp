// 16-bit keys and values for the reference kernel, which reads only float K/V: one packed float
// copy of K and V per call, then the kernel on the same problem. Decode reads 16-bit K/V in
// place (decode/tiles-inl.h), flash widens one tile at a time into its scratch (flash/forward.cpp).
#include <algorithm>

#include "attention/problem.hpp"
#include "core/allocator.hpp"
#include "qkv/dtype.hpp"

namespace qkv::detail {

namespace {
// Rows (B, H, N, D) of 16-bit `from` widened into a packed float array `to`.
void widen_rows(const Rows<const uint16_t>& from, DType dtype, int64_t batch, int64_t heads, int64_t len,
                int64_t dim, float* to) {
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < len; ++i)
        convert(from.row(b, h, i), dtype, to + ((b * heads + h) * len + i) * dim, DType::F32, static_cast<size_t>(dim));
}
}  // namespace

void with_float_kv(const AttentionProblem& problem, void (*kernel)(const AttentionProblem&)) {
  if (problem.kv_dtype == DType::F32) return kernel(problem);
  const AttentionProblem& p = problem;
  const int64_t k_count = p.batch * p.kv_heads * p.kv_len * p.head_dim;
  const int64_t v_count = p.batch * p.kv_heads * p.kv_len * p.value_dim;
  const Tensor k = Tensor::empty(Shape{std::max<int64_t>(k_count, 1)});
  const Tensor v = Tensor::empty(Shape{std::max<int64_t>(v_count, 1)});
  widen_rows(p.k_bits, p.kv_dtype, p.batch, p.kv_heads, p.kv_len, p.head_dim, k.data());
  widen_rows(p.v_bits, p.kv_dtype, p.batch, p.kv_heads, p.kv_len, p.value_dim, v.data());
  AttentionProblem wide = problem;
  wide.kv_dtype = DType::F32;
  wide.k_bits = wide.v_bits = {};
  wide.k = {k.data(), p.kv_heads * p.kv_len * p.head_dim, p.kv_len * p.head_dim, std::max<int64_t>(p.head_dim, 1)};
  wide.v = {v.data(), p.kv_heads * p.kv_len * p.value_dim, p.kv_len * p.value_dim, std::max<int64_t>(p.value_dim, 1)};
  kernel(wide);
}

}  // namespace qkv::detail
