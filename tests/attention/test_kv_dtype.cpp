// Attention with keys and values in bf16 or f16 (q, output and lse in f32): every kernel against
// the float64 oracle evaluated on the rounded K/V (the exact values the kernels read), on random
// odd shapes, grouped-query heads, every mask kind, modifiers and dropout, on every SIMD target
// and on 1 and 2 threads (harness/kernel_cases.hpp, outputs poisoned with NaN). Decode reads the 16-bit
// elements in place, flash widens a tile at a time, the reference widens a copy. Then the public entry point: strided
// 16-bit views, every backend, and the errors for mixed or unsupported dtypes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "attention/kernels.hpp"
#include "harness/kernel_cases.hpp"
#include "harness/oracle.hpp"

namespace {

using qkv::DType;
using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;
using qkv_test::Case;
using qkv_test::Random;
using qkv_test::Sizes;

constexpr DType kHalfTypes[] = {DType::BF16, DType::F16};

// The case with its K and V rounded to `dtype` (the oracle then reads the rounded values).
Case with_kv(Case c, DType dtype) {
  c.k = c.k.to(dtype);
  c.v = c.v.to(dtype);
  c.name += " kv=" + std::string(qkv::to_string(dtype));
  return c;
}

using qkv_test::kv_decode_sizes;
using qkv_test::kv_flash_sizes;

std::vector<Case> cases_for(Random& rng, Sizes (*sizes)(Random&)) {
  std::vector<Case> cases;
  for (DType dtype : kHalfTypes)
    for (Case& c : qkv_test::kv_storage_cases(rng, sizes, [&](Case c) { return with_kv(std::move(c), dtype); }))
      cases.push_back(std::move(c));
  return cases;
}

TEST(KvDtype, DecodeReads16BitKeysAndValues) {
  Random rng;
  SCOPED_TRACE(rng.note());
  qkv_test::check_everywhere(qkv_test::decode_kernel, cases_for(rng, kv_decode_sizes));
}

TEST(KvDtype, FlashReads16BitKeysAndValues) {
  Random rng;
  SCOPED_TRACE(rng.note());
  qkv_test::check_everywhere(qkv::detail::flash_attention, cases_for(rng, kv_flash_sizes));
}

// NaN or inf in the 16-bit keys and values of hidden keys never reaches a query: unwritten
// cache slots (past key_lengths, never read) and keys inside the read range that a keep mask
// hides from every query (decode widens such a V tile to check it and skips their zero weights).
// Every backend gives the clean run's output and lse: the same bits, or, where skipping the
// hidden keys changed the order of a sum, within 1e-5.
TEST(KvDtype, NonFiniteValuesOfHiddenKeys) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t B = 2, H = 2, Nq = 3, Nk = 300, D = 40;
  const Tensor q = rng.randn(Shape{B, H, Nq, D}), k = rng.randn(Shape{B, H, Nk, D}), v = rng.randn(Shape{B, H, Nk, D});
  const std::vector<int64_t> lengths = {250, 77};
  const Tensor keep = Tensor::full(Shape{B, 1, 1, Nk}, 1.0f);
  const Tensor k_dirty = k.clone(), v_dirty = v.clone();
  auto dirty = [&](int64_t b, int64_t h, int64_t j) {
    k_dirty.at({b, h, j, rng.integer(0, D - 1)}) = rng.chance(0.5) ? NAN : INFINITY;
    v_dirty.at({b, h, j, rng.integer(0, D - 1)}) = rng.chance(0.5) ? NAN : -INFINITY;
  };
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t n = 0; n < 5; ++n) {  // hidden inside the range
      const int64_t j = rng.integer(0, lengths[static_cast<size_t>(b)] - 1);
      keep.at({b, 0, 0, j}) = 0.0f;
      for (int64_t h = 0; h < H; ++h) dirty(b, h, j);
    }
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = lengths[static_cast<size_t>(b)]; j < Nk; ++j) dirty(b, h, j);
  }
  for (DType dtype : kHalfTypes) {
    for (qkv::Backend backend : {qkv::Backend::Reference, qkv::Backend::Flash, qkv::Backend::Decode}) {
      SCOPED_TRACE(std::string(qkv::to_string(backend)) + " " + std::string(qkv::to_string(dtype)));
      qkv::AttentionOptions options;
      options.mask = Mask::key_lengths(lengths) & Mask::keep(keep);
      options.backend = backend;
      const auto clean = qkv::scaled_dot_product_attention(q, k.to(dtype), v.to(dtype), options);
      const auto dirty_result = qkv::scaled_dot_product_attention(q, k_dirty.to(dtype), v_dirty.to(dtype), options);
      for (float x : dirty_result.output.to_vector()) ASSERT_TRUE(std::isfinite(x));
      const std::vector<float> want = clean.output.to_vector();
      const auto out = qkv_test::compare(dirty_result.output, std::vector<double>(want.begin(), want.end()), 1e-5);
      EXPECT_TRUE(out.ok) << out.detail;
      EXPECT_EQ(dirty_result.lse.to_vector(), clean.lse.to_vector());
    }
  }
}

// The public entry point on (B, N, H, D) 16-bit views (read in place through their strides), on
// every backend, into NaN-poisoned outputs; error bound from the issue: relative 1e-2 for bf16
// and 2e-3 for f16 against the oracle on the rounded values (in practice float32's error).
TEST(KvDtype, EveryBackendOnStridedViews) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t batch = 2, hq = 6, hkv = 2, nq = 3, nk = 77, d = 40;
  for (DType dtype : kHalfTypes) {
    const Tensor q = rng.randn(Shape{batch, hq, nq, d});
    const Tensor k = rng.randn(Shape{batch, nk, hkv, d}).to(dtype).transpose(1, 2);  // a strided view
    const Tensor v = rng.randn(Shape{batch, nk, hkv, d}).to(dtype).transpose(1, 2);
    ASSERT_FALSE(k.is_contiguous());
    const double scale = 1.0 / std::sqrt(double(d));
    const auto oracle = qkv_test::attention_oracle(q, k.contiguous(), v.contiguous(), scale, qkv_test::causal_bias(nk - nq));
    for (qkv::Backend backend : {qkv::Backend::Reference, qkv::Backend::Flash, qkv::Backend::Decode, qkv::Backend::Auto}) {
      SCOPED_TRACE(std::string(qkv::to_string(backend)) + " " + std::string(qkv::to_string(dtype)));
      qkv::AttentionOptions options;
      options.mask = Mask::causal(nk - nq);
      options.backend = backend;
      qkv::AttentionResult result;
      result.output = Tensor::full(Shape{batch, hq, nq, d}, NAN);
      result.lse = Tensor::full(Shape{batch, hq, nq}, NAN);
      qkv::scaled_dot_product_attention_into(q, k, v, result, options);
      const double tolerance = dtype == DType::BF16 ? 1e-2 : 2e-3;
      const auto out = qkv_test::compare(result.output, oracle.output, tolerance);
      const auto lse = qkv_test::compare(result.lse, oracle.lse, tolerance);
      EXPECT_TRUE(out.ok) << out.detail;
      EXPECT_TRUE(lse.ok) << lse.detail;
      EXPECT_LT(out.max_rel_diff, 1e-4);  // the kernels read the rounded values exactly
    }
  }
}

TEST(KvDtype, ClearErrors) {
  Random rng;
  const Tensor q = rng.randn(Shape{1, 2, 3, 8});
  const Tensor k = rng.randn(Shape{1, 2, 5, 8});
  const Tensor v = rng.randn(Shape{1, 2, 5, 8});
  auto expect_error = [](auto call, const std::string& part) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one containing '" << part << "'";
    } catch (const qkv::Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  expect_error([&] { qkv::scaled_dot_product_attention(q.to(DType::BF16), k, v); }, "needs q in f32");
  expect_error([&] { qkv::scaled_dot_product_attention(q, k.to(DType::BF16), v.to(DType::F16)); },
               "k is bf16 but v is f16");
  expect_error([&] { qkv::scaled_dot_product_attention(q, k.to(DType::BF16), v); }, "k is bf16 but v is f32");
  const qkv::AttentionResult forward = qkv::scaled_dot_product_attention(q, k.to(DType::F16), v.to(DType::F16));
  expect_error(
      [&] {
        qkv::scaled_dot_product_attention_backward(forward.output, q, k.to(DType::F16), v.to(DType::F16), forward);
      },
      "the backward needs f32 k and v");
}

}  // namespace
