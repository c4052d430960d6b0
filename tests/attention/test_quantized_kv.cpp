// Quantized keys and values (qkv/quantize.hpp): int8 per row and int4 per group of 32. The
// quantisation round trip within its documented bound; every kernel (decode dequantises a tile
// into scratch, flash a tile into scratch, the reference a widened copy) against the float64
// oracle evaluated on the dequantised values, on random odd shapes (int8 any D, int4 even D with a
// partial last group), grouped-query heads, every mask kind, modifiers and dropout, every SIMD
// target, 1 and 2 threads, outputs poisoned with NaN; the public entry point on strided views;
// the KV cache's quantising append; and the errors for bad scales and layouts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "attention/kernels.hpp"
#include "core/quantize.hpp"  // scales_valid
#include "harness/kernel_cases.hpp"
#include "harness/oracle.hpp"
#include "qkv/inference.hpp"
#include "qkv/quantize.hpp"

namespace {

using qkv::DType;
using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;
using qkv_test::Case;
using qkv_test::Random;
using qkv_test::Sizes;

constexpr DType kQuantTypes[] = {DType::I8, DType::I4};

// The gap from |x| (finite float32) to the next float32 above it.
double ulp(float x) { return std::nextafter(std::abs(x), std::numeric_limits<float>::infinity()) - std::abs(x); }

// The case with K and V quantized to `dtype` (the oracle reads the dequantised values).
Case quantized(Case c, DType dtype) {
  const qkv::QuantizedTensor k = qkv::quantize_kv(c.k, dtype), v = qkv::quantize_kv(c.v, dtype);
  c.k = k.values;
  c.k_scales = k.scales;
  c.v = v.values;
  c.v_scales = v.scales;
  c.name += " kv=" + std::string(qkv::to_string(dtype));
  return c;
}

// int4 packs two values a byte: its head dims are even (D mod 32 != 0 gives a partial last group).
Sizes for_dtype(Sizes s, DType dtype) {
  if (dtype == DType::I4) s.dk += s.dk % 2, s.dv += s.dv % 2;
  return s;
}

using qkv_test::kv_decode_sizes;
using qkv_test::kv_flash_sizes;

std::vector<Case> cases_for(Random& rng, Sizes (*sizes)(Random&)) {
  std::vector<Case> cases;
  for (DType dtype : kQuantTypes) {
    const auto dtype_sizes = [&](Random& r) { return for_dtype(sizes(r), dtype); };
    for (Case& c : qkv_test::kv_storage_cases(rng, dtype_sizes, [&](Case c) { return quantized(std::move(c), dtype); }))
      cases.push_back(std::move(c));
    // Every remainder of decode's int4 tiles at once: 15 rows per K/V head (5 heads x 3 queries:
    // row tiles of 4 and 3), D = 112 (value tiles of two groups and of one, a last group of 16
    // values read scalar), 301 keys (a last tile of 45, a last score tile of one key).
    cases.push_back(quantized(qkv_test::make_case(rng, {1, 10, 2, 3, 301, 112, 112}, qkv_test::MaskKind::None, 1.0, 0.0f),
                              dtype));
    // int4 scores in integers (AVX-512): two chunks of four groups, a group in floats, a last 16.
    cases.push_back(quantized(
        qkv_test::make_case(rng, {1, 10, 2, 3, 301, 304, 112}, qkv_test::MaskKind::Causal, 1.0, 0.0f), dtype));
    // The same with scale * q on the int8 grid of each group (scale 1/16; q = m / 8, m an integer
    // in [-127, 127], +-127 first in every group): quantising q is then exact, nothing is added to
    // the float tolerance, and any error of the integer sums shows; D = 304 also runs a group and
    // a last 16 in floats after the two integer chunks.
    Case exact = qkv_test::make_case(rng, {1, 4, 2, 2, 203, 304, 96}, qkv_test::MaskKind::Causal, 1.0, 0.0f);
    exact.scale = 1.0f / 16;
    float* q = exact.q.data();
    for (int64_t e = 0; e < exact.q.numel(); ++e) {
      const bool largest = e % exact.q.size(3) % qkv::kInt4Group == 0;  // the first of every group
      const auto m = largest ? 127 : static_cast<int64_t>(rng.next_u64() % 255) - 127;
      q[e] = static_cast<float>((rng.next_u64() % 2 == 0 ? m : -m)) / 8.0f;
    }
    cases.push_back(quantized(std::move(exact), dtype));
  }
  return cases;
}

// Decode's int4 scores take q quantised to int8 per group of 32 on the AVX-512 targets, for the
// groups of the whole chunks of 128 values of a row of D <= 512 (docs/inference.md; the other
// groups, and every other target, stay float): scale * q rounded in float32 as the kernel does it
// (qs = max|group| / 127, q8 = round(q * (127 / max))), so each score moves by exactly ds =
// sum_d (qs q8_d - scale q_d) k'_d over those groups. With E the largest |ds| over rows and keys
// (in float64 on the dequantised keys), softmax weights move by a factor within [e^-2E, e^2E],
// the output by at most (e^2E - 1) max|v'| / (1 - dropout) and lse by E, added to the float
// tolerance on those targets only. (The kernel's float roundings of these products stay in the
// float tolerance.)
void int4_query_quantisation(const Case& c, qkv_test::Expected& e) {
  if (!c.k_scales.defined() || c.k.size(3) * 2 != c.q.size(3)) return;  // int4 keys only (D / 2 bytes)
  const int64_t target = qkv::detail::flash_attention_target();
  if (target != HWY_AVX3 && target != HWY_AVX3_DL) return;
  const int64_t batch = c.q.size(0), hq = c.q.size(1), hkv = c.k.size(1), nq = c.q.size(2), nk = c.k.size(2);
  const int64_t dk = c.q.size(3), group = qkv::kInt4Group, chunk = 4 * group;
  const int64_t quantised = dk <= 4 * chunk ? dk / chunk * chunk : 0;  // values of the whole chunks
  if (quantised == 0) return;
  const std::vector<float> q = c.q.to_vector(), k = c.oracle_k().to_vector(), v = c.oracle_v().to_vector();
  double largest = 0;
  std::vector<double> dq(static_cast<size_t>(quantised));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < hq; ++h)
      for (int64_t i = 0; i < nq; ++i) {
        const float* q_row = q.data() + ((b * hq + h) * nq + i) * dk;
        for (int64_t g0 = 0; g0 < quantised; g0 += group) {
          float amax = 0;
          for (int64_t d = g0; d < g0 + group; ++d) amax = std::max(amax, std::abs(c.scale * q_row[d]));
          const float inv = amax > 0 ? 127.0f / amax : 0.0f, qs = amax / 127.0f;
          for (int64_t d = g0; d < g0 + group; ++d) {
            const float sq = c.scale * q_row[d];
            dq[static_cast<size_t>(d)] = double{qs} * std::nearbyint(sq * inv) - sq;
          }
        }
        for (int64_t j = 0; j < nk; ++j) {
          const float* k_row = k.data() + ((b * hkv + h / (hq / hkv)) * nk + j) * dk;
          double ds = 0;
          for (int64_t d = 0; d < quantised; ++d) ds += dq[static_cast<size_t>(d)] * k_row[d];
          largest = std::max(largest, std::abs(ds));
        }
      }
  double v_max = 0;
  for (float x : v) v_max = std::max(v_max, std::abs(static_cast<double>(x)));
  e.added_lse_error = largest;
  e.added_output_error = std::expm1(2 * largest) * v_max / (1 - c.dropout_p);
}

TEST(QuantizedKv, DecodeMatchesTheOracleOnDequantisedValues) {
  Random rng;
  SCOPED_TRACE(rng.note());
  qkv_test::check_everywhere(qkv_test::decode_kernel, cases_for(rng, kv_decode_sizes), int4_query_quantisation);
}

TEST(QuantizedKv, FlashMatchesTheOracleOnDequantisedValues) {
  Random rng;
  SCOPED_TRACE(rng.note());
  qkv_test::check_everywhere(qkv::detail::flash_attention, cases_for(rng, kv_flash_sizes));
}

// The reference widens a copy: held to a fixed bound against the oracle (check_everywhere measures
// the fast kernels against the reference's own error, so it cannot judge the reference itself).
TEST(QuantizedKv, ReferenceMatchesTheOracleOnDequantisedValues) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const std::vector<Case> cases = cases_for(rng, kv_flash_sizes);
  std::vector<qkv_test::Expected> expected;
  for (const Case& c : cases) expected.push_back(qkv_test::expect(c));
  qkv_test::on_every_target_and_thread_count([&] {
    for (size_t n = 0; n < cases.size(); ++n) {
      qkv_test::KernelOutputs got;  // poisoned with NaN
      qkv::detail::reference_attention(qkv_test::problem_of(cases[n], got));
      const auto out = qkv_test::compare(got.output, expected[n].oracle.output, 1e-4);
      const auto lse = qkv_test::compare(got.lse, expected[n].oracle.lse, 1e-4);
      EXPECT_TRUE(out.ok) << cases[n].name << "\n" << out.detail;
      EXPECT_TRUE(lse.ok) << cases[n].name << "\n" << lse.detail;
    }
  });
}

// Every element within half a scale of x (int8: max|row| / 254, int4: max|group| / 14), and the
// integer the one nearest to x / scale, the quotient rounded to float32 first as the library
// computes it (a float64 quotient within half a float32 ulp of k + 0.5 rounds to the other
// neighbour; seed 14795783769360743731 hit it). The half-a-scale bound is checked apart.
TEST(QuantizedKv, RoundTripWithinTheDocumentedBound) {
  Random rng;
  SCOPED_TRACE(rng.note());
  for (DType dtype : kQuantTypes) {
    for (int trial = 0; trial < 12; ++trial) {
      int64_t dim = rng.integer(1, 150);
      if (dtype == DType::I4) dim += dim % 2;
      const float magnitude = std::pow(10.0f, static_cast<float>(rng.integer(-3, 3)));
      Tensor x = rng.randn(Shape{3, 5, dim});
      float* data = x.data();
      for (int64_t e = 0; e < x.numel(); ++e) data[e] *= magnitude;
      if (trial == 0) std::fill_n(data, dim, 0.0f);  // an all-zero row: scale 0, zeros back
      const qkv::QuantizedTensor q = qkv::quantize_kv(x, dtype);
      const Tensor back = qkv::dequantize_kv(q);
      ASSERT_EQ(back.shape(), x.shape());
      const std::vector<float> scales = q.scales.to_vector();
      const int64_t groups = qkv::quantized_groups(dtype, dim), group = dtype == DType::I8 ? dim : qkv::kInt4Group;
      const double limit = dtype == DType::I8 ? 127 : 7;
      const float* y = back.data();
      for (int64_t r = 0; r < x.numel() / dim; ++r)
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t first = g * group, last = std::min(dim, first + group);
          double amax = 0;
          for (int64_t d = first; d < last; ++d) amax = std::max(amax, std::abs(double(data[r * dim + d])));
          const double scale = scales[static_cast<size_t>(r * groups + g)];
          ASSERT_NEAR(scale, amax / limit, 1e-6 * amax / limit) << "row " << r << " group " << g;
          for (int64_t d = first; d < last; ++d) {
            const float quotient = scale == 0 ? 0.0f : data[r * dim + d] / static_cast<float>(scale);
            const double want_q = std::clamp(double(std::nearbyint(quotient)), -limit, limit);
            const double got = y[r * dim + d];
            EXPECT_EQ(got, static_cast<float>(static_cast<float>(want_q) * static_cast<float>(scale)))
                << qkv::to_string(dtype) << " D=" << dim << " [" << r << ", " << d << "]";
            // Half a scale, plus the float32 roundings the header allows: half an ulp of the
            // quotient (it may round across k + 0.5) and an ulp of x' = q scale.
            const double bound = scale * (0.5 + ulp(quotient) / 2) + ulp(static_cast<float>(got));
            EXPECT_LE(std::abs(got - data[r * dim + d]), bound)
                << qkv::to_string(dtype) << " D=" << dim << " [" << r << ", " << d << "]";
          }
        }
    }
  }
}

// The public entry point on (B, N, H, D) quantized views read through their strides (values and
// scales transposed alike), every backend, into NaN-poisoned outputs, against the oracle on the
// dequantised values.
TEST(QuantizedKv, EveryBackendOnStridedViews) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t batch = 2, hq = 6, hkv = 2, nq = 3, nk = 77, d = 72;  // int4: groups 32, 32, 8
  for (DType dtype : kQuantTypes) {
    const Tensor q = rng.randn(Shape{batch, hq, nq, d});
    const qkv::QuantizedTensor k = qkv::quantize_kv(rng.randn(Shape{batch, nk, hkv, d}), dtype);
    const qkv::QuantizedTensor v = qkv::quantize_kv(rng.randn(Shape{batch, nk, hkv, d}), dtype);
    const qkv::QuantizedTensor k_view{k.values.transpose(1, 2), k.scales.transpose(1, 2)};
    const qkv::QuantizedTensor v_view{v.values.transpose(1, 2), v.scales.transpose(1, 2)};
    ASSERT_FALSE(k_view.values.is_contiguous());
    const double scale = 1.0 / std::sqrt(double(d));
    const auto oracle = qkv_test::attention_oracle(q, qkv::dequantize_kv(k_view), qkv::dequantize_kv(v_view), scale,
                                                   qkv_test::causal_bias(nk - nq));
    for (qkv::Backend backend : {qkv::Backend::Reference, qkv::Backend::Flash, qkv::Backend::Decode, qkv::Backend::Auto}) {
      SCOPED_TRACE(std::string(qkv::to_string(backend)) + " " + std::string(qkv::to_string(dtype)));
      qkv::AttentionOptions options;
      options.mask = Mask::causal(nk - nq);
      options.backend = backend;
      options.k_scales = k_view.scales;
      options.v_scales = v_view.scales;
      qkv::AttentionResult result;
      result.output = Tensor::full(Shape{batch, hq, nq, d}, NAN);
      result.lse = Tensor::full(Shape{batch, hq, nq}, NAN);
      qkv::scaled_dot_product_attention_into(q, k_view.values, v_view.values, result, options);
      const auto out = qkv_test::compare(result.output, oracle.output, 1e-4);
      const auto lse = qkv_test::compare(result.lse, oracle.lse, 1e-4);
      EXPECT_TRUE(out.ok) << out.detail;
      EXPECT_TRUE(lse.ok) << lse.detail;
    }
  }
}

// A quantized KV cache: append quantizes each row as quantize_kv does (the stored values and
// scales are its bits), over two appends with ragged counts; decode over the cache equals
// attention on the dequantised f32 cache; and a ring buffer quantizes into its slots alike.
TEST(QuantizedKv, CacheAppendQuantizesAndDecodeReadsIt) {
  Random rng;
  SCOPED_TRACE(rng.note());
  for (DType dtype : kQuantTypes) {
    SCOPED_TRACE(std::string(qkv::to_string(dtype)));
    const int64_t batch = 2, hkv = 2, hq = 4, d = 48, capacity = 300;
    qkv::nn::KVCache cache(batch, hkv, capacity, d, dtype);
    const Tensor k1 = rng.randn(Shape{batch, hkv, 200, d}), v1 = rng.randn(Shape{batch, hkv, 200, d});
    const Tensor k2 = rng.randn(Shape{batch, hkv, 1, d}), v2 = rng.randn(Shape{batch, hkv, 1, d});
    cache.append(k1, v1, {200, 150});
    cache.append(k2, v2);
    ASSERT_EQ(cache.lengths(), (std::vector<int64_t>{201, 151}));
    // The stored rows are quantize_kv's, bit for bit.
    const qkv::QuantizedTensor want = qkv::quantize_kv(k1.narrow(2, 0, 150), dtype);
    const Tensor stored = qkv::dequantize_kv({cache.keys(150), cache.key_scales(150)});
    EXPECT_EQ(stored.contiguous().to_vector(), qkv::dequantize_kv(want).to_vector());
    // Decode over the cache (key lengths per batch element) against the oracle on the dequantised cache.
    const int64_t len = cache.length();
    const Tensor q = rng.randn(Shape{batch, hq, 1, d});
    qkv::AttentionOptions options;
    options.mask = Mask::key_lengths(cache.lengths());
    options.k_scales = cache.key_scales(len);
    options.v_scales = cache.value_scales(len);
    options.backend = qkv::Backend::Decode;
    const auto got = qkv::scaled_dot_product_attention(q, cache.keys(len), cache.values(len), options);
    qkv::AttentionOptions wide;
    wide.mask = options.mask;
    wide.backend = qkv::Backend::Reference;
    const auto want_out = qkv::scaled_dot_product_attention(
        q, qkv::dequantize_kv({cache.keys(len), cache.key_scales(len)}),
        qkv::dequantize_kv({cache.values(len), cache.value_scales(len)}), wide);
    const std::vector<float> expected = want_out.output.to_vector();
    const auto out = qkv_test::compare(got.output, std::vector<double>(expected.begin(), expected.end()), 1e-5);
    EXPECT_TRUE(out.ok) << out.detail;
    // A non-finite row is refused, the cache left as it was.
    Tensor bad = rng.randn(Shape{batch, hkv, 1, d});
    bad.at({1, 0, 0, 3}) = NAN;
    EXPECT_THROW(cache.append(bad, v2), qkv::Error);
    EXPECT_EQ(cache.lengths(), (std::vector<int64_t>{201, 151}));
  }
}

TEST(QuantizedKv, ClearErrors) {
  Random rng;
  const Tensor q = rng.randn(Shape{1, 2, 3, 64});
  const Tensor k = rng.randn(Shape{1, 2, 5, 64}), v = rng.randn(Shape{1, 2, 5, 64});
  auto expect_error = [](auto call, const std::string& part) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one containing '" << part << "'";
    } catch (const qkv::Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  const qkv::QuantizedTensor k8 = qkv::quantize_kv(k, DType::I8), v8 = qkv::quantize_kv(v, DType::I8);
  const qkv::QuantizedTensor k4 = qkv::quantize_kv(k, DType::I4), v4 = qkv::quantize_kv(v, DType::I4);
  auto with_scales = [](const Tensor& ks, const Tensor& vs) {
    qkv::AttentionOptions o;
    o.k_scales = ks;
    o.v_scales = vs;
    return o;
  };
  expect_error([&] { qkv::scaled_dot_product_attention(q, k8.values, v8.values); }, "needs k_scales");
  expect_error([&] { qkv::scaled_dot_product_attention(q, k8.values, v8.values, with_scales(k4.scales, v8.scales)); },
               "k_scales is (1, 2, 5, 2) but should be (1, 2, 5, 1)");
  expect_error([&] { qkv::scaled_dot_product_attention(q, k4.values, v4.values, with_scales(k4.scales, v8.scales)); },
               "v_scales is (1, 2, 5, 1) but should be (1, 2, 5, 2)");
  Tensor nan_scales = k8.scales.clone();
  nan_scales.at({0, 1, 2, 0}) = NAN;
  expect_error([&] { qkv::scaled_dot_product_attention(q, k8.values, v8.values, with_scales(nan_scales, v8.scales)); },
               "scales must be finite");
  Tensor negative = v4.scales.clone();
  negative.at({0, 0, 4, 1}) = -1;
  expect_error([&] { qkv::scaled_dot_product_attention(q, k4.values, v4.values, with_scales(k4.scales, negative)); },
               "scales must be finite and >= 0");
  Tensor huge = v4.scales.clone();  // 7 x this overflows: a hidden key's 0 x inf would be NaN
  huge.at({0, 1, 2, 0}) = 1e38f;
  expect_error([&] { qkv::scaled_dot_product_attention(q, k4.values, v4.values, with_scales(k4.scales, huge)); },
               "at most");
  Tensor large8 = k8.scales.clone();  // fine for int4's bound, over int8's
  large8.at({0, 0, 1, 0}) = 1e37f;
  expect_error([&] { qkv::scaled_dot_product_attention(q, k8.values, v8.values, with_scales(large8, v8.scales)); },
               "(max float / 128)");
  expect_error([&] { qkv::scaled_dot_product_attention(q, k8.values, v4.values, with_scales(k8.scales, v4.scales)); },
               "k is int8 but v is int4");
  expect_error([&] { qkv::scaled_dot_product_attention(q, k, v, with_scales(k8.scales, v8.scales)); },
               "k_scales / v_scales are for int8 or int4");
  // int4 with its bytes not in rows: a transposed last dim, and a head dim that is not q's.
  expect_error(
      [&] {
        const Tensor odd = k4.values.transpose(2, 3).contiguous().transpose(2, 3);
        qkv::scaled_dot_product_attention(q, odd, v4.values, with_scales(k4.scales, v4.scales));
      },
      "the last dim must be contiguous");
  expect_error(
      [&] {
        qkv::scaled_dot_product_attention(rng.randn(Shape{1, 2, 3, 63}), k4.values, v4.values,
                                          with_scales(k4.scales, v4.scales));
      },
      "head dims differ");
  expect_error([&] { qkv::quantize_kv(rng.randn(Shape{2, 7}), DType::I4); }, "must be even");
  expect_error([&] { qkv::quantize_kv(k, DType::BF16); }, "expected int8 or int4");
  Tensor nan_x = k.clone();
  nan_x.at({0, 1, 1, 1}) = INFINITY;
  expect_error([&] { qkv::quantize_kv(nan_x, DType::I8); }, "non-finite");
  expect_error([&] { (void)k8.values.to(DType::F32); }, "need their scales");
  expect_error([&] { qkv::nn::KVCache(1, 1, 8, 7, DType::I4); }, "must be even");
  const qkv::AttentionResult forward = qkv::scaled_dot_product_attention(q, k8.values, v8.values,
                                                                         with_scales(k8.scales, v8.scales));
  expect_error(
      [&] {
        qkv::scaled_dot_product_attention_backward(forward.output, q, k8.values, v8.values, forward,
                                                   with_scales(k8.scales, v8.scales));
      },
      "the backward needs f32 k and v");
}

// Scales past 2^18 are checked in runs on every thread (core/quantize.cpp): a bad scale in the
// first, a middle or the last run is still found and named, and good scales pass.
TEST(QuantizedKv, ManyScalesAreCheckedInEveryRun) {
  Random rng;
  const int64_t keys = (int64_t{1} << 17) + 5;  // 2 heads: 2^18 + 10 int8 row scales
  const Tensor q = rng.randn(Shape{1, 2, 1, 2});
  const qkv::QuantizedTensor k = qkv::quantize_kv(rng.randn(Shape{1, 2, keys, 2}), DType::I8),
                             v = qkv::quantize_kv(rng.randn(Shape{1, 2, keys, 2}), DType::I8);
  qkv::AttentionOptions o;
  o.k_scales = k.scales;
  o.v_scales = v.scales;
  const Tensor good = qkv::scaled_dot_product_attention(q, k.values, v.values, o).output;
  EXPECT_TRUE(std::isfinite(good.data()[0]));
  for (const int64_t flat : {int64_t{3}, keys + 70000, 2 * keys - 1}) {
    Tensor bad = v.scales.clone();
    bad.data()[flat] = -2;
    o.v_scales = bad;
    try {
      (void)qkv::scaled_dot_product_attention(q, k.values, v.values, o);
      ADD_FAILURE() << "no error for a negative scale at flat index " << flat;
    } catch (const qkv::Error& e) {
      EXPECT_NE(std::string(e.what()).find("at flat index " + std::to_string(flat)), std::string::npos) << e.what();
    }
  }
}

// Decode checks each work item's scales as it reads them (ScaleValues::Kernel, decode/chunk-inl.h)
// rather than in a scan before the kernel: a bad scale of K or V in the first key, a middle chunk
// or the last (partial) chunk of either batch element is still named by its flat index, hidden by
// the key lengths or not, under Backend::Decode and Auto; -0 and good scales pass, with the
// output of the scan-first flash path; an empty q still gets its scales checked.
TEST(QuantizedKv, DecodeNamesABadScaleInAnyChunk) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t keys = 2 * 2048 + 37, dim = 64;  // int8 and int4 chunks hold 2048 keys: three chunks
  const Tensor q = rng.randn(Shape{2, 4, 1, dim});
  for (DType dtype : {DType::I8, DType::I4}) {
    SCOPED_TRACE(std::string(qkv::to_string(dtype)));
    const qkv::QuantizedTensor k = qkv::quantize_kv(rng.randn(Shape{2, 2, keys, dim}), dtype),
                               v = qkv::quantize_kv(rng.randn(Shape{2, 2, keys, dim}), dtype);
    const int64_t groups = k.scales.size(-1), per_batch = 2 * keys * groups;
    for (qkv::Backend backend : {qkv::Backend::Decode, qkv::Backend::Auto}) {
      qkv::AttentionOptions o;
      o.k_scales = k.scales;
      o.v_scales = v.scales;
      o.backend = backend;
      o.mask = Mask::key_lengths({keys, 3000});  // batch 1's keys past 3000 are read by no row
      Tensor signed_zero = k.scales.clone();
      signed_zero.data()[5] = -0.0f;
      o.k_scales = signed_zero;
      const Tensor decoded = qkv::scaled_dot_product_attention(q, k.values, v.values, o).output;
      qkv::AttentionOptions flash = o;
      flash.backend = qkv::Backend::Flash;
      const Tensor flashed = qkv::scaled_dot_product_attention(q, k.values, v.values, flash).output;
      for (int64_t e = 0; e < decoded.numel(); ++e)
        ASSERT_NEAR(decoded.data()[e], flashed.data()[e], 1e-4f) << "element " << e;
      for (const bool on_k : {true, false}) {
        for (const int64_t flat : {int64_t{0}, 2100 * groups + 1, keys * groups - 1, per_batch + keys * groups + 3500 * groups,
                                   2 * per_batch - 1}) {
          for (const float bad : {std::nanf(""), -1.0f, INFINITY}) {
            Tensor scales = (on_k ? k.scales : v.scales).clone();
            scales.data()[flat] = bad;
            qkv::AttentionOptions with_bad = o;
            (on_k ? with_bad.k_scales : with_bad.v_scales) = scales;
            (on_k ? with_bad.v_scales : with_bad.k_scales) = on_k ? v.scales : k.scales;
            try {
              (void)qkv::scaled_dot_product_attention(q, k.values, v.values, with_bad);
              ADD_FAILURE() << (on_k ? "k" : "v") << " scale " << bad << " at flat index " << flat << ": no error";
            } catch (const qkv::Error& e) {
              const std::string what = e.what();
              EXPECT_NE(what.find(std::string(on_k ? "k_scales" : "v_scales") + " has"), std::string::npos) << what;
              EXPECT_NE(what.find("at flat index " + std::to_string(flat)), std::string::npos) << what;
            }
          }
        }
      }
      // Scales in a wider buffer (rows groups + 1 apart): decode checks them row by row.
      Tensor wide = Tensor::zeros(Shape{2, 2, keys, groups + 1});
      Tensor view = wide.narrow(3, 0, groups);
      for (int64_t row = 0; row < 2 * 2 * keys; ++row)
        std::copy_n(v.scales.data() + row * groups, groups, wide.data() + row * (groups + 1));
      const int64_t bad_at = per_batch + 4000 * groups + groups - 1;  // batch 1, head 0, key 4000
      wide.data()[bad_at / groups * (groups + 1) + bad_at % groups] = INFINITY;
      qkv::AttentionOptions strided = o;
      strided.v_scales = view;
      try {
        (void)qkv::scaled_dot_product_attention(q, k.values, v.values, strided);
        ADD_FAILURE() << "no error for an infinite scale in a strided view";
      } catch (const qkv::Error& e) {
        EXPECT_NE(std::string(e.what()).find("at flat index " + std::to_string(bad_at)), std::string::npos) << e.what();
      }
      qkv::AttentionOptions empty_q = o;
      Tensor nan_scale = v.scales.clone();
      nan_scale.data()[7] = std::nanf("");
      empty_q.v_scales = nan_scale;
      try {
        (void)qkv::scaled_dot_product_attention(q.narrow(2, 0, 0), k.values, v.values, empty_q);
        ADD_FAILURE() << "no error for a NaN scale under an empty q";
      } catch (const qkv::Error& e) {
        EXPECT_NE(std::string(e.what()).find("v_scales has nan at flat index 7"), std::string::npos) << e.what();
      }
    }
  }
}

// The scale scan (scales_valid, core/quantize.cpp's vector scan) on every target: one bad scale
// (NaN, inf, negative, just past the int4 limit) anywhere in runs of odd and vector-sized lengths
// is found; -0, the limit itself, an empty run and a clean run pass.
TEST(QuantizedKv, ScaleScanFindsEveryBadScaleOnEveryTarget) {
  const float limit = std::numeric_limits<float>::max() / 8;  // int4's largest scale
  const float bads[] = {std::nanf(""), INFINITY, -1.0f, std::nextafter(limit, INFINITY)};
  for (int64_t target : qkv_test::runnable_targets()) {
    qkv_test::ForcedTarget forced(target);
    SCOPED_TRACE(std::string("SIMD target ") + hwy::TargetName(target));
    EXPECT_TRUE(qkv::detail::scales_valid(nullptr, 0, DType::I4));
    for (int64_t count : {1, 7, 16, 17, 63, 64, 65, 131}) {
      std::vector<float> scales(static_cast<size_t>(count), 0.5f);
      EXPECT_TRUE(qkv::detail::scales_valid(scales.data(), count, DType::I4)) << count;
      for (int64_t at = 0; at < count; ++at) {
        for (float bad : bads) {
          scales[static_cast<size_t>(at)] = bad;
          EXPECT_FALSE(qkv::detail::scales_valid(scales.data(), count, DType::I4)) << count << " at " << at;
        }
        for (float fine : {-0.0f, limit}) {
          scales[static_cast<size_t>(at)] = fine;
          EXPECT_TRUE(qkv::detail::scales_valid(scales.data(), count, DType::I4)) << count << " " << fine << " at " << at;
        }
        scales[static_cast<size_t>(at)] = 0.5f;
      }
    }
  }
}

// A NaN in q reaches its own output row and no other, on every target: the integer int4 scores
// (AVX-512) would clamp it away when quantising q, so such a block keeps the float path.
TEST(QuantizedKv, ANaNQueryReachesItsRowOnEveryTarget) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const qkv::QuantizedTensor k = qkv::quantize_kv(rng.randn(Shape{1, 2, 40, 128}), DType::I4),
                             v = qkv::quantize_kv(rng.randn(Shape{1, 2, 40, 128}), DType::I4);
  Tensor q = rng.randn(Shape{1, 2, 3, 128});
  q.at({0, 1, 1, 5}) = std::nanf("");
  qkv::AttentionOptions o;
  o.k_scales = k.scales;
  o.v_scales = v.scales;
  o.backend = qkv::Backend::Decode;
  for (int64_t target : qkv_test::runnable_targets()) {
    qkv_test::ForcedTarget forced(target);
    SCOPED_TRACE(std::string("SIMD target ") + hwy::TargetName(target));
    const Tensor out = qkv::scaled_dot_product_attention(q, k.values, v.values, o).output;
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t i = 0; i < 3; ++i)
        for (int64_t d = 0; d < 128; ++d) {
          const bool nan_row = h == 1 && i == 1;
          ASSERT_EQ(std::isnan(out.at({0, h, i, d})), nan_row) << "row " << h << ", " << i << " column " << d;
        }
  }
}

}  // namespace
