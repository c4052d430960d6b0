// qkv::quantize_kv and dequantize_kv (qkv/quantize.hpp): symmetric int8 per row and int4 per group
// of 32, scalar (quantisation runs once per appended token; the kernels' dequantisation is SIMD,
// simd/kv_load-inl.h, with the same arithmetic as dequantize_row here).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "core/quantize.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/highway.h"
#include "simd/kv_load-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
void DequantizeRowSimd(bool int4, const uint8_t* values, const float* scales, size_t dim, float* out) {
  kv::DequantizeRow(hwy::HWY_NAMESPACE::ScalableTag<float>(), int4, values, scales, dim, out);
}

// The largest of `count` 32-bit words (0 for none): a scale's bits read as an unsigned integer,
// so a negative or non-finite scale is a large one. A decode step scans every scale it reads
// once more, so this runs at the memory's rate rather than a compare and a branch a word.
uint32_t LargestBitsSimd(const uint32_t* HWY_RESTRICT bits, size_t count) {
  namespace hn = hwy::HWY_NAMESPACE;
  const hn::ScalableTag<uint32_t> d;
  const size_t lanes = hn::Lanes(d);
  auto m0 = hn::Zero(d), m1 = hn::Zero(d), m2 = hn::Zero(d), m3 = hn::Zero(d);
  size_t e = 0;
  for (; e + 4 * lanes <= count; e += 4 * lanes) {
    m0 = hn::Max(m0, hn::LoadU(d, bits + e));
    m1 = hn::Max(m1, hn::LoadU(d, bits + e + lanes));
    m2 = hn::Max(m2, hn::LoadU(d, bits + e + 2 * lanes));
    m3 = hn::Max(m3, hn::LoadU(d, bits + e + 3 * lanes));
  }
  for (; e + lanes <= count; e += lanes) m0 = hn::Max(m0, hn::LoadU(d, bits + e));
  uint32_t largest = hn::GetLane(hn::MaxOfLanes(d, hn::Max(hn::Max(m0, m1), hn::Max(m2, m3))));
  for (; e < count; ++e) largest = std::max(largest, bits[e]);
  return largest;
}
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "core/quantize.hpp"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "qkv/error.hpp"
#include "simd/item_shares.hpp"

namespace qkv {

namespace {
constexpr float kInt8Max = 127;
constexpr float kInt4Max = 7;
constexpr int kInt4Offset = 8;  // a 4-bit value is stored as q + 8 in [1, 15]

// The dims of x with the last replaced by `last`.
Shape with_last(const Shape& shape, int64_t last) {
  std::vector<int64_t> dims = shape.dims();
  dims.back() = last;
  return Shape(std::move(dims));
}

// One group of n floats to integers in [-limit, limit] and its scale max|x| / limit. The quotient
// x / scale is a float32 division, rounded to the nearest integer (ties to even).
float quantize_group(const float* x, int64_t n, float limit, int* q) {
  float amax = 0;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::abs(x[i]));
  const float scale = amax / limit;
  for (int64_t i = 0; i < n; ++i)
    q[i] = scale == 0 ? 0 : static_cast<int>(std::clamp(std::nearbyint(x[i] / scale), -limit, limit));
  return scale;
}

// The int4 group [first, first + n) of a row: n / 2 bytes, byte j = element j (low 4 bits) and
// element j + n / 2 (high 4 bits).
void pack_int4(const int* q, int64_t n, uint8_t* to) {
  for (int64_t j = 0; j < n / 2; ++j)
    to[j] = static_cast<uint8_t>((q[j] + kInt4Offset) | ((q[j + n / 2] + kInt4Offset) << 4));
}

}  // namespace

namespace detail {
bool quantize_row(DType dtype, const float* x, int64_t dim, uint8_t* values, float* scales) {
  for (int64_t d = 0; d < dim; ++d)
    if (!std::isfinite(x[d])) return false;
  std::vector<int> q(static_cast<size_t>(dim));
  if (dtype == DType::I8) {
    scales[0] = quantize_group(x, dim, kInt8Max, q.data());
    for (int64_t d = 0; d < dim; ++d) values[d] = static_cast<uint8_t>(static_cast<int8_t>(q[static_cast<size_t>(d)]));
    return true;
  }
  for (int64_t first = 0, group = 0; first < dim; first += kInt4Group, ++group) {
    const int64_t n = std::min(kInt4Group, dim - first);
    scales[group] = quantize_group(x + first, n, kInt4Max, q.data());
    pack_int4(q.data(), n, values + first / 2);
  }
  return true;
}

double kv_row_bytes(DType dtype, int64_t dim) {
  const double d = static_cast<double>(dim);
  if (!is_quantized(dtype)) return d * static_cast<double>(element_size(dtype));
  return (dtype == DType::I4 ? d / 2 : d) + 4.0 * static_cast<double>(quantized_groups(dtype, dim));
}

}  // namespace detail

int64_t quantized_groups(DType dtype, int64_t dim) {
  return dtype == DType::I4 ? (dim + kInt4Group - 1) / kInt4Group : 1;
}

QuantizedTensor quantize_kv(const Tensor& x, DType dtype) {
  const char* who = "quantize_kv: ";
  if (!is_quantized(dtype))
    throw Error(std::string(who) + "dtype " + std::string(to_string(dtype)) + ": expected int8 or int4");
  if (!x.defined() || x.dim() < 1) throw Error(std::string(who) + "x must be a tensor of rank >= 1");
  if (x.dtype() != DType::F32)
    throw Error(std::string(who) + "x " + x.shape().str() + " is " + std::string(to_string(x.dtype())) + ", not f32");
  const int64_t dim = x.size(-1);
  if (dtype == DType::I4 && dim % 2 != 0)
    throw Error(std::string(who) + "x " + x.shape().str() + ": int4 packs two values a byte, so the last dim (" +
                std::to_string(dim) + ") must be even");
  const Tensor packed = x.contiguous();
  const float* data = packed.data();
  for (int64_t e = 0; e < packed.numel(); ++e)
    if (!std::isfinite(data[e]))
      throw Error(std::string(who) + "x " + x.shape().str() + " has a non-finite value " + std::to_string(data[e]) +
                  " at flat index " + std::to_string(e));
  const int64_t groups = quantized_groups(dtype, dim);
  const int64_t row_bytes = dtype == DType::I8 ? dim : dim / 2;
  QuantizedTensor q{Tensor::empty(with_last(x.shape(), row_bytes), dtype),
                    Tensor::empty(with_last(x.shape(), groups))};
  auto* values = static_cast<uint8_t*>(q.values.raw_data());
  float* scales = q.scales.data();
  const int64_t rows = dim == 0 ? 0 : packed.numel() / dim;
  for (int64_t r = 0; r < rows; ++r)
    detail::quantize_row(dtype, data + r * dim, dim, values + r * row_bytes, scales + r * groups);  // checked finite
  return q;
}

Tensor dequantize_kv(const QuantizedTensor& q) {
  const char* who = "dequantize_kv: ";
  if (!q.values.defined() || !is_quantized(q.values.dtype()) || q.values.dim() < 1)
    throw Error(std::string(who) + "values must be an int8 or int4 tensor of rank >= 1");
  const DType dtype = q.values.dtype();
  const int64_t dim = dtype == DType::I4 ? 2 * q.values.size(-1) : q.values.size(-1);
  detail::check_quantized(who, "values", q.values, q.scales, dim);
  const Tensor values = q.values.contiguous(), scales = q.scales.contiguous();
  Tensor x = Tensor::empty(with_last(q.values.shape(), dim));
  const int64_t rows = q.values.size(-1) == 0 ? 0 : values.numel() / q.values.size(-1);
  const int64_t groups = quantized_groups(dtype, dim);
  for (int64_t r = 0; r < rows; ++r)
    detail::dequantize_row(dtype, static_cast<const uint8_t*>(values.raw_data()) + r * values.size(-1),
                           scales.data() + r * groups, dim, x.data() + r * dim);
  return x;
}

namespace detail {

uint32_t largest_bits(const uint32_t* bits, int64_t count);  // LargestBitsSimd on the best target

namespace {

// Whether any of `count` float bit patterns is above `limit`'s (a non-negative finite float's):
// negative (sign set, -0 included), inf, NaN or larger than limit, compared as integers. A large
// set (a long prefill's cache: decode checks its own chunks, ScaleValues::Kernel) is split into
// runs over the threads, each scanned by LargestBitsSimd.
bool any_above(const uint32_t* bits, int64_t count, uint32_t limit) {
  constexpr int64_t kRun = int64_t{1} << 16, kMinToThread = int64_t{1} << 18;
  const int64_t runs = (count + kRun - 1) / kRun;
  std::atomic<bool> any{false};
  for_each_item(count >= kMinToThread ? omp_get_max_threads() : 1, runs, [&](int64_t run) {
    const int64_t first = run * kRun, n = std::min(count, first + kRun) - first;
    if (largest_bits(bits + first, n) > limit) any.store(true, std::memory_order_relaxed);
  });
  return any.load(std::memory_order_relaxed);
}

}  // namespace

void check_quantized(const char* who, const char* name, const Tensor& values, const Tensor& scales, int64_t dim,
                     bool scale_values) {
  const std::string what = std::string(who) + name + " " + values.shape().str() + " " +
                           std::string(to_string(values.dtype()));
  const std::string scales_name = std::string(name) + "_scales";
  if (!scales.defined()) throw Error(what + " needs " + scales_name + " (f32, a scale per row or group)");
  if (scales.dtype() != DType::F32)
    throw Error(what + ": " + scales_name + " is " + std::string(to_string(scales.dtype())) + ", not f32");
  const Shape expected = with_last(values.shape(), quantized_groups(values.dtype(), dim));
  if (scales.shape() != expected)
    throw Error(what + ": " + scales_name + " is " + scales.shape().str() + " but should be " + expected.str() +
                (values.dtype() == DType::I8 ? " (one scale per row)"
                                             : " (one scale per group of " + std::to_string(kInt4Group) + " of " +
                                                   std::to_string(dim) + " values)"));
  if (values.dim() > 0 && values.strides().back() != 1 && values.size(-1) > 1)
    throw Error(what + ": the last dim must be contiguous (a row of packed values)");
  if (scales.dim() > 0 && scales.strides().back() != 1 && scales.size(-1) > 1)
    throw Error(what + ": " + scales_name + "'s last dim must be contiguous");
  if (scale_values) check_scale_values(what, scales_name, values.dtype(), scales);
}

namespace {
// The bits of the largest scale whose every dequantised value (|q| <= 128 for int8, 8 for int4)
// is finite: a hidden key's weight 0 times an infinite value would be NaN.
float largest_scale(DType dtype) { return std::numeric_limits<float>::max() / (dtype == DType::I8 ? 128.0f : 8.0f); }
uint32_t bits_of(float x) {
  uint32_t bits = 0;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}
}  // namespace

bool scales_valid(const float* scales, int64_t count, DType dtype) {
  const uint32_t limit = bits_of(largest_scale(dtype));
  if (largest_bits(reinterpret_cast<const uint32_t*>(scales), count) <= limit) return true;  // vector loads
  for (int64_t e = 0; e < count; ++e) {
    uint32_t bits = 0;
    std::memcpy(&bits, scales + e, sizeof bits);
    if (bits > limit && bits != 0x80000000u) return false;  // -0 is a zero scale
  }
  return true;
}

void check_scale_values(const std::string& what, const std::string& scales_name, DType dtype, const Tensor& scales) {
  // Every scale read in place (no copy, no allocation).
  // Finite and >= 0: the sign bit clear and the exponent not all ones, tested as integers so
  // the loop vectorises.
  const Tensor packed = scales.contiguous();
  const auto* bits = static_cast<const uint32_t*>(packed.raw_data());
  const int64_t count = packed.numel();
  const float largest = largest_scale(dtype);
  const uint32_t limit = bits_of(largest);
  char largest_text[32];
  std::snprintf(largest_text, sizeof largest_text, "%.4g", static_cast<double>(largest));
  if (any_above(bits, count, limit))
    for (int64_t e = 0; e < count; ++e)
      if (bits[e] > limit && bits[e] != 0x80000000u)  // -0 is a zero scale
        throw Error(what + ": " + scales_name + " has " + std::to_string(packed.data()[e]) + " at flat index " +
                    std::to_string(e) + ": scales must be finite and >= 0, and at most " + std::string(largest_text) +
                    " (max float / " + (dtype == DType::I8 ? "128" : "8") + ")");
}

HWY_EXPORT(DequantizeRowSimd);
HWY_EXPORT(LargestBitsSimd);

uint32_t largest_bits(const uint32_t* bits, int64_t count) {
  return HWY_DYNAMIC_DISPATCH(LargestBitsSimd)(bits, static_cast<size_t>(count));
}

void dequantize_row(DType dtype, const uint8_t* values, const float* scales, int64_t dim, float* out) {
  HWY_DYNAMIC_DISPATCH(DequantizeRowSimd)(dtype == DType::I4, values, scales, static_cast<size_t>(dim), out);
}

}  // namespace detail
}  // namespace qkv
#endif  // HWY_ONCE
