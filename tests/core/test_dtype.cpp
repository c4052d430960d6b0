// qkv::DType and Tensor's element types: the conversions against the IEEE definitions (computed
// here in float64, not with the library's code): every 16-bit pattern round-trips, random floats
// round to the nearest representable value with ties to even, subnormals, overflow, infinities
// and NaN; Tensor::to on views and on every SIMD target; creation and printing; and the clear
// error of everything that needs float32 when given another dtype.
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "harness/kernel_cases.hpp"
#include "harness/oracle.hpp"
#include "qkv/nn.hpp"

namespace {

using qkv::DType;
using qkv::Shape;
using qkv::Tensor;
using qkv_test::value_of_bits;

float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Every non-negative finite 16-bit pattern in increasing value (both formats order like integers).
std::vector<uint16_t> finite_patterns(DType dtype) {
  std::vector<uint16_t> patterns;
  const uint16_t inf = dtype == DType::BF16 ? 0x7f80 : 0x7c00;
  for (uint32_t b = 0; b < inf; ++b) patterns.push_back(static_cast<uint16_t>(b));
  return patterns;
}

// The expected rounding of x (finite) from the definition: the nearest representable value,
// ties to the even pattern, beyond the largest finite value by half an ulp or more: inf.
uint16_t expected_bits(float x, DType dtype, const std::vector<uint16_t>& patterns) {
  const double a = std::abs(static_cast<double>(x));
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double largest = value_of_bits(patterns.back(), dtype);
  const double ulp_top = largest - value_of_bits(static_cast<uint16_t>(patterns.back() - 1), dtype);
  if (a >= largest + ulp_top / 2) return sign | (dtype == DType::BF16 ? 0x7f80 : 0x7c00);
  auto above = std::lower_bound(patterns.begin(), patterns.end(), a,
                                [&](uint16_t p, double value) { return value_of_bits(p, dtype) < value; });
  if (above == patterns.end()) return sign | patterns.back();
  if (value_of_bits(*above, dtype) == a || above == patterns.begin()) return sign | *above;
  const uint16_t hi = *above, lo = static_cast<uint16_t>(hi - 1);
  const double d_lo = a - value_of_bits(lo, dtype), d_hi = value_of_bits(hi, dtype) - a;
  if (d_lo < d_hi) return sign | lo;
  if (d_hi < d_lo) return sign | hi;
  return sign | ((lo & 1) ? hi : lo);
}

uint16_t to_bits(float x, DType dtype) {
  return dtype == DType::BF16 ? qkv::bf16_from_float(x) : qkv::f16_from_float(x);
}
bool is_nan_bits(uint16_t b, DType dtype) {
  return dtype == DType::BF16 ? ((b & 0x7f80) == 0x7f80 && (b & 0x7f)) : ((b & 0x7c00) == 0x7c00 && (b & 0x3ff));
}

constexpr DType kHalfTypes[] = {DType::BF16, DType::F16};

TEST(DType, NamesAndSizes) {
  EXPECT_EQ(qkv::to_string(DType::BF16), "bf16");
  EXPECT_EQ(qkv::dtype_from_string("float16"), DType::F16);
  EXPECT_EQ(qkv::dtype_from_string("bfloat16"), DType::BF16);
  EXPECT_EQ(qkv::element_size(DType::F32), 4u);
  EXPECT_EQ(qkv::element_size(DType::F16), 2u);
  EXPECT_EQ(qkv::dtype_from_string("int8"), DType::I8);
  EXPECT_EQ(qkv::dtype_from_string("int4"), DType::I4);
  EXPECT_EQ(qkv::to_string(DType::I4), "int4");
  EXPECT_EQ(qkv::element_size(DType::I8), 1u);
  EXPECT_EQ(qkv::element_size(DType::I4), 1u);  // a byte of two 4-bit values
  EXPECT_THROW(qkv::dtype_from_string("int2"), qkv::Error);
}

// Every pattern widens to its exact value and narrows back to itself; NaNs stay NaN.
TEST(DType, EveryPatternRoundTrips) {
  for (DType dtype : kHalfTypes) {
    SCOPED_TRACE(std::string(qkv::to_string(dtype)));
    for (uint32_t b = 0; b < 65536; ++b) {
      const auto bits = static_cast<uint16_t>(b);
      const float x = dtype == DType::BF16 ? qkv::float_from_bf16(bits) : qkv::float_from_f16(bits);
      if (is_nan_bits(bits, dtype)) {
        ASSERT_TRUE(std::isnan(x)) << b;
        ASSERT_TRUE(is_nan_bits(to_bits(x, dtype), dtype)) << b;
        continue;
      }
      ASSERT_EQ(static_cast<double>(x), value_of_bits(bits, dtype)) << b;
      ASSERT_EQ(to_bits(x, dtype), bits) << b;
    }
  }
}

// Every pattern through Tensor::to(F32), the SIMD widening of attention's loads, on every target.
TEST(DType, EveryPatternWidensOnEveryTarget) {
  auto patterns = std::make_shared<std::vector<uint16_t>>(65536);
  for (uint32_t b = 0; b < 65536; ++b) (*patterns)[b] = static_cast<uint16_t>(b);
  for (int64_t target : qkv_test::runnable_targets()) {
    qkv_test::ForcedTarget forced(target);
    SCOPED_TRACE(hwy::TargetName(target));
    for (DType dtype : kHalfTypes) {
      const Tensor bits = Tensor::from_blob(patterns->data(), Shape{65536}, dtype, patterns);
      const std::vector<float> wide = bits.to(DType::F32).to_vector();
      for (uint32_t b = 0; b < 65536; ++b) {
        const double want = value_of_bits(static_cast<uint16_t>(b), dtype);
        if (std::isnan(want)) {
          ASSERT_TRUE(std::isnan(wide[b])) << qkv::to_string(dtype) << " " << b;
        } else {
          ASSERT_EQ(static_cast<double>(wide[b]), want) << qkv::to_string(dtype) << " " << b;
          ASSERT_EQ(std::signbit(wide[b]), (b & 0x8000) != 0) << b;
        }
      }
    }
  }
}

// Random floats of every magnitude (and the midpoints between neighbours: exact ties) round as
// the definition says.
TEST(DType, RoundsToNearestEven) {
  qkv_test::Random rng;
  SCOPED_TRACE(rng.note());
  for (DType dtype : kHalfTypes) {
    SCOPED_TRACE(std::string(qkv::to_string(dtype)));
    const std::vector<uint16_t> patterns = finite_patterns(dtype);
    for (int n = 0; n < 200000; ++n) {
      // Random bit patterns cover every exponent; keep the finite ones.
      const float x = float_of(static_cast<uint32_t>(rng.next_u64()));
      if (!std::isfinite(x)) continue;
      ASSERT_EQ(to_bits(x, dtype), expected_bits(x, dtype, patterns)) << x;
    }
    for (size_t p = 0; p + 1 < patterns.size(); p += 7) {  // ties: midpoints, exact in float
      const double mid = (value_of_bits(patterns[p], dtype) + value_of_bits(patterns[p + 1], dtype)) / 2;
      const float x = static_cast<float>(mid);
      if (static_cast<double>(x) != mid) continue;
      const uint16_t even = (patterns[p] & 1) ? patterns[p + 1] : patterns[p];
      ASSERT_EQ(to_bits(x, dtype), even) << mid;
      ASSERT_EQ(to_bits(-x, dtype), even | 0x8000) << mid;
    }
  }
}

TEST(DType, TiesSubnormalsInfinitiesAndNaN) {
  // Ties to even, by hand.
  EXPECT_EQ(qkv::bf16_from_float(1.0f + 0x1p-8f), 0x3f80);                 // 1 + half ulp -> 1
  EXPECT_EQ(qkv::bf16_from_float(1.0f + 3 * 0x1p-8f), 0x3f82);             // 1 + 1.5 ulp -> 1 + 2 ulp
  EXPECT_EQ(qkv::f16_from_float(1.0f + 0x1p-11f), 0x3c00);
  EXPECT_EQ(qkv::f16_from_float(1.0f + 3 * 0x1p-11f), 0x3c02);
  // f16 overflow: 65519 -> 65504, 65520 (the tie with 65536) -> inf.
  EXPECT_EQ(qkv::f16_from_float(65519.0f), 0x7bff);
  EXPECT_EQ(qkv::f16_from_float(65520.0f), 0x7c00);
  EXPECT_EQ(qkv::f16_from_float(-1e10f), 0xfc00);
  EXPECT_EQ(qkv::bf16_from_float(std::numeric_limits<float>::max()), 0x7f80);  // rounds past the top
  // f16 subnormals: 2^-24 is the smallest; 2^-25 ties to 0; 1.5 x 2^-24 ties to 2 x 2^-24;
  // 1023.5 x 2^-24 ties up to the smallest normal.
  EXPECT_EQ(qkv::f16_from_float(0x1p-24f), 0x0001);
  EXPECT_EQ(qkv::f16_from_float(0x1p-25f), 0x0000);
  EXPECT_EQ(qkv::f16_from_float(0x1.000002p-25f), 0x0001);
  EXPECT_EQ(qkv::f16_from_float(1.5f * 0x1p-24f), 0x0002);
  EXPECT_EQ(qkv::f16_from_float(1023.5f * 0x1p-24f), 0x0400);
  EXPECT_EQ(qkv::float_from_f16(0x0001), 0x1p-24f);
  EXPECT_EQ(qkv::float_from_f16(0x03ff), 1023 * 0x1p-24f);
  // bf16 keeps float's subnormals to 7 bits: 2^-133 is its smallest; 2^-149 rounds to 0.
  EXPECT_EQ(qkv::bf16_from_float(0x1p-133f), 0x0001);
  EXPECT_EQ(qkv::bf16_from_float(0x1p-149f), 0x0000);
  EXPECT_EQ(qkv::float_from_bf16(0x0001), 0x1p-133f);
  // Signed zeros and infinities.
  for (DType dtype : kHalfTypes) {
    EXPECT_EQ(to_bits(-0.0f, dtype), 0x8000);
    EXPECT_EQ(to_bits(INFINITY, dtype), dtype == DType::BF16 ? 0x7f80 : 0x7c00);
    EXPECT_EQ(to_bits(-INFINITY, dtype), dtype == DType::BF16 ? 0xff80 : 0xfc00);
    // NaN stays NaN, even one whose payload is only in the bits that are dropped.
    for (uint32_t nan : {0x7fc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu}) {
      const uint16_t b = to_bits(float_of(nan), dtype);
      EXPECT_TRUE(is_nan_bits(b, dtype)) << std::hex << nan << " -> " << b;
      EXPECT_EQ(b & 0x8000, (nan >> 16) & 0x8000);
    }
  }
}

// Tensor::to: the same bits as the scalar conversions, on every SIMD target (widening is SIMD),
// from strided views, and back.
TEST(DType, TensorToOnEveryTarget) {
  qkv_test::Random rng;
  SCOPED_TRACE(rng.note());
  std::vector<float> values = rng.randn(Shape{7, 37}).to_vector();
  values[3] = NAN;
  values[4] = INFINITY;
  values[5] = -0.0f;
  values[6] = 1e-30f;
  values[7] = 70000.0f;
  const Tensor t = Tensor::from(values, Shape{7, 37});
  for (int64_t target : qkv_test::runnable_targets()) {
    qkv_test::ForcedTarget forced(target);
    SCOPED_TRACE(hwy::TargetName(target));
    for (DType dtype : kHalfTypes) {
      const Tensor half = t.to(dtype);
      EXPECT_EQ(half.dtype(), dtype);
      EXPECT_EQ(half.shape(), t.shape());
      const auto* bits = static_cast<const uint16_t*>(half.raw_data());
      for (size_t i = 0; i < values.size(); ++i) ASSERT_EQ(bits[i], to_bits(values[i], dtype)) << i;
      const std::vector<float> back = half.to(DType::F32).to_vector();
      const std::vector<float> widened = half.to_vector();
      ASSERT_EQ(std::memcmp(back.data(), widened.data(), back.size() * sizeof(float)), 0);
      for (size_t i = 0; i < values.size(); ++i) {
        const double want = value_of_bits(bits[i], dtype);
        if (std::isnan(want)) {
          ASSERT_TRUE(std::isnan(back[i])) << i << " bits " << bits[i] << " got " << back[i];
        } else {
          ASSERT_EQ(static_cast<double>(back[i]), want) << i;
        }
      }
      // A transposed view converts element by element in row-major order of the view.
      const Tensor view = t.transpose(0, 1);
      const Tensor half_view = view.to(dtype);
      EXPECT_TRUE(half_view.is_contiguous());
      const std::vector<float> view_values = view.to_vector();
      const auto* view_bits = static_cast<const uint16_t*>(half_view.raw_data());
      for (size_t i = 0; i < view_values.size(); ++i) ASSERT_EQ(view_bits[i], to_bits(view_values[i], dtype));
      // And a 16-bit view (transposed, narrowed) reads back the same elements as the f32 one.
      const Tensor half_narrow = half.transpose(0, 1).narrow(0, 2, 5);
      const std::vector<float> narrow_half = half_narrow.to_vector(), narrow_f32 = half.to(DType::F32).transpose(0, 1).narrow(0, 2, 5).to_vector();
      ASSERT_EQ(narrow_half.size(), narrow_f32.size());
      EXPECT_EQ(std::memcmp(narrow_half.data(), narrow_f32.data(), narrow_half.size() * sizeof(float)), 0);
      EXPECT_EQ(half_narrow.clone().dtype(), dtype);
      // bf16 -> f16 goes through float, exactly.
      const Tensor other = half.to(dtype == DType::BF16 ? DType::F16 : DType::BF16);
      const Tensor other_direct = half.to(DType::F32).to(other.dtype());
      EXPECT_EQ(std::memcmp(other.raw_data(), other_direct.raw_data(), values.size() * 2), 0);
    }
  }
  EXPECT_TRUE(t.to(DType::F32).shares_storage_with(t));  // same dtype: the tensor itself
}

TEST(DType, CreationAndPrinting) {
  for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
    const Tensor z = Tensor::zeros(Shape{2, 3}, dtype);
    EXPECT_EQ(z.dtype(), dtype);
    EXPECT_EQ(z.to_vector(), std::vector<float>(6, 0.0f));
    EXPECT_EQ(z.str(1), "[[0.0 0.0 0.0]\n [0.0 0.0 0.0]]");
    const Tensor e = Tensor::empty(Shape{0, 4}, dtype);
    EXPECT_EQ(e.numel(), 0);
  }
  const Tensor x = Tensor::from({1.0f, -2.5f, 0.1f, 1000.0f}, Shape{2, 2});
  EXPECT_EQ(x.to(DType::BF16).str(4), "[[   1.0000   -2.5000]\n [   0.1001 1000.0000]]");
  EXPECT_EQ(x.to(DType::F16).str(4), "[[   1.0000   -2.5000]\n [   0.1000 1000.0000]]");
  // from_blob over 16-bit memory (a numpy float16 array, say) reads the same bits.
  auto memory = std::make_shared<std::vector<uint16_t>>(std::vector<uint16_t>{0x3c00, 0xc000, 0x7c00});
  const Tensor blob = Tensor::from_blob(memory->data(), Shape{3}, DType::F16, memory);
  EXPECT_EQ(blob.to_vector(), (std::vector<float>{1.0f, -2.0f, INFINITY}));
}

// Everything that computes on floats says it needs f32 and names what it got.
TEST(DType, ArithmeticNeedsF32) {
  const Tensor x = Tensor::zeros(Shape{2, 4}, DType::BF16);
  auto expect_error = [](auto call, const std::string& part) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one containing '" << part << "'";
    } catch (const qkv::Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  expect_error([&] { (void)x.data(); }, "needs an f32 tensor, got bf16 (2, 4)");
  expect_error([&] { (void)x.at({0, 0}); }, "needs an f32 tensor, got bf16");
  qkv::nn::Linear linear(4, 3, true, 1);
  expect_error([&] { (void)linear.forward(x.to(DType::F16)); }, "needs an f32 tensor, got f16");
  qkv::nn::LayerNorm norm(4);
  expect_error([&] { (void)norm.forward(x); }, "needs an f32 tensor, got bf16");
}

}  // namespace
