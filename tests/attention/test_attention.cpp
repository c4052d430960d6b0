// scaled_dot_product_attention (Backend::Reference and Backend::Auto) against the float64
// oracle: odd sizes, Nq != Nk, Dk != Dv, ranks 2-4, grouped-query heads, every mask kind and
// their combinations, custom scales, with and without weights, contiguous and strided inputs.
// Every element of every output is compared, so an element left unwritten cannot pass.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "harness/oracle.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::AttentionResult;
using qkv::Backend;
using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;
using qkv_test::Bias;
using qkv_test::kInf;
using qkv_test::OracleResult;
using qkv_test::Random;

constexpr double kTolerance = 1e-4;

// ---------------------------------------------------------------------------------------------
// Test cases

enum class MaskKind {
  None,
  Causal,           // causal()
  CausalOffset,     // causal(offset > 0)
  Window,           // window(left)
  WindowRight,      // window(left, right > 0, offset)
  KeyLengths,       // key_lengths, 0 and Nk included at random
  Keep2D,           // keep (Nq, Nk)
  Keep2DRow,        // keep (1, Nk): broadcast over queries
  Keep3D,           // keep (B, Nq, Nk)
  Keep3DBroadcast,  // keep (B, 1, Nk)
  Keep4D,           // keep (B, Hq, Nq, Nk)
  Keep4DBatch,      // keep (B, 1, Nq, Nk)
  Keep4DHeads,      // keep (1, Hq, Nq, Nk)
  Padding,          // keep create_padding_mask(lengths, Nk): (B, 1, 1, Nk)
  Additive2D,       // additive (Nq, Nk), finite values and -inf
  Additive4D,       // additive (1, Hq, Nq, Nk), finite values and -inf
  Combined,         // causal(offset) & key_lengths & keep & additive
};

std::string to_string(MaskKind kind) {
  switch (kind) {
    case MaskKind::None: return "none";
    case MaskKind::Causal: return "causal";
    case MaskKind::CausalOffset: return "causal_offset";
    case MaskKind::Window: return "window";
    case MaskKind::WindowRight: return "window_right";
    case MaskKind::KeyLengths: return "key_lengths";
    case MaskKind::Keep2D: return "keep2d";
    case MaskKind::Keep2DRow: return "keep2d_row";
    case MaskKind::Keep3D: return "keep3d";
    case MaskKind::Keep3DBroadcast: return "keep3d_broadcast";
    case MaskKind::Keep4D: return "keep4d";
    case MaskKind::Keep4DBatch: return "keep4d_batch";
    case MaskKind::Keep4DHeads: return "keep4d_heads";
    case MaskKind::Padding: return "padding";
    case MaskKind::Additive2D: return "additive2d";
    case MaskKind::Additive4D: return "additive4d";
    case MaskKind::Combined: return "combined";
  }
  return "unknown";
}

struct Case {
  int rank;  // 4: (B, H, N, D); 3: (B, N, D), one head; 2: (N, D), one batch and head
  int64_t batch, q_heads, kv_heads, q_len, kv_len, qk_dim, v_dim;
  MaskKind mask = MaskKind::None;
  bool custom_scale = false;  // a random scale instead of 1 / sqrt(Dk)
  bool need_weights = true;
};

std::vector<Case> all_cases() {
  using K = MaskKind;
  std::vector<Case> cases;
  const auto add = [&](Case base, std::initializer_list<MaskKind> kinds) {
    for (MaskKind kind : kinds) {
      base.mask = kind;
      cases.push_back(base);
    }
  };
  // Rank 4, Nq != Nk, Dk != Dv: every mask kind.
  add({4, 2, 3, 3, 7, 19, 16, 8},
      {K::None, K::Causal, K::CausalOffset, K::Window, K::WindowRight, K::KeyLengths, K::Keep2D,
       K::Keep2DRow, K::Keep3D, K::Keep3DBroadcast, K::Keep4D, K::Keep4DBatch, K::Keep4DHeads,
       K::Padding, K::Additive2D, K::Additive4D, K::Combined});
  // Grouped-query: 6 query heads over 2 key/value heads; multi-query: 4 over 1.
  add({4, 2, 6, 2, 5, 11, 8, 12},
      {K::None, K::Causal, K::KeyLengths, K::Keep4D, K::Keep4DHeads, K::Additive4D, K::Combined});
  add({4, 1, 4, 1, 17, 17, 3, 5}, {K::None, K::Causal, K::WindowRight, K::Keep3D, K::Combined});
  // Every size 1.
  add({4, 1, 1, 1, 1, 1, 1, 1}, {K::None, K::Causal, K::KeyLengths, K::Keep2D, K::Additive2D});
  // More queries than keys.
  add({4, 3, 2, 2, 17, 3, 5, 7}, {K::None, K::Causal, K::CausalOffset, K::Window, K::Keep4DBatch});
  // Decode: one query against 113 keys.
  add({4, 2, 2, 1, 1, 113, 16, 16}, {K::None, K::CausalOffset, K::KeyLengths, K::Padding});
  // 113 x 113.
  add({4, 1, 2, 2, 113, 113, 32, 32}, {K::None, K::Causal, K::Combined});
  // Rank 3 (B, N, D).
  add({3, 3, 1, 1, 17, 13, 5, 9},
      {K::None, K::Causal, K::CausalOffset, K::WindowRight, K::KeyLengths, K::Keep2D, K::Keep2DRow,
       K::Keep3D, K::Keep3DBroadcast, K::Padding, K::Additive2D, K::Combined});
  // Rank 2 (N, D).
  add({2, 1, 1, 1, 3, 17, 7, 1},
      {K::None, K::Causal, K::CausalOffset, K::Window, K::WindowRight, K::KeyLengths, K::Keep2D,
       K::Keep2DRow, K::Keep3D, K::Additive2D, K::Combined});
  add({2, 1, 1, 1, 113, 1, 4, 3}, {K::None, K::Keep2D});
  // Custom scales.
  Case scaled{4, 2, 3, 3, 7, 19, 16, 8};
  scaled.custom_scale = true;
  add(scaled, {K::None, K::Causal, K::Additive2D, K::Combined});
  scaled.rank = 3;
  add(scaled, {K::Keep3D});
  // Without weights.
  Case lean{4, 2, 6, 2, 13, 9, 8, 4};
  lean.need_weights = false;
  add(lean, {K::None, K::Causal, K::KeyLengths, K::Combined});
  lean.custom_scale = true;
  lean.rank = 2;
  add(lean, {K::Keep2D});
  return cases;
}

std::string case_name(const Case& c) {
  std::string name = "r" + std::to_string(c.rank) + "_b" + std::to_string(c.batch) + "_h" +
                     std::to_string(c.q_heads) + "x" + std::to_string(c.kv_heads) + "_q" +
                     std::to_string(c.q_len) + "_k" + std::to_string(c.kv_len) + "_d" +
                     std::to_string(c.qk_dim) + "x" + std::to_string(c.v_dim) + "_" +
                     to_string(c.mask);
  if (c.custom_scale) name += "_scaled";
  if (!c.need_weights) name += "_noweights";
  return name;
}

// How gtest shows a case (instead of its raw bytes).
void PrintTo(const Case& c, std::ostream* os) { *os << case_name(c); }

// q's, k's or v's shape at the case's rank.
Shape shape_of(const Case& c, int64_t heads, int64_t len, int64_t dim) {
  switch (c.rank) {
    case 4: return {c.batch, heads, len, dim};
    case 3: return {c.batch, len, dim};
    default: return {len, dim};
  }
}

// q's leading dims followed by `tail`: the shape of output, weights and lse.
Shape result_shape(const Case& c, std::initializer_list<int64_t> tail) {
  std::vector<int64_t> dims;
  if (c.rank >= 3) dims.push_back(c.batch);
  if (c.rank == 4) dims.push_back(c.q_heads);
  dims.insert(dims.end(), tail);
  return Shape(std::move(dims));
}

// ---------------------------------------------------------------------------------------------
// Masks, said twice: to the library, and element by element to the oracle.

struct MaskSpec {
  Mask mask;
  Bias bias;
};

// A keep tensor: about a quarter zeros; the rest mostly 1, sometimes another nonzero value.
Tensor random_keep(Random& rng, const Shape& shape) {
  std::vector<float> values(static_cast<size_t>(shape.numel()));
  for (float& x : values) {
    if (rng.chance(0.25)) x = 0.0f;
    else if (rng.chance(0.8)) x = 1.0f;
    else x = rng.chance(0.5) ? static_cast<float>(rng.uniform(0.1, 3)) : -static_cast<float>(rng.uniform(0.1, 3));
  }
  return Tensor::from(std::move(values), shape);
}

// An additive tensor: finite values in [-3, 3), about a fifth -inf.
Tensor random_additive(Random& rng, const Shape& shape) {
  std::vector<float> values(static_cast<size_t>(shape.numel()));
  for (float& x : values) x = rng.chance(0.2) ? -INFINITY : static_cast<float>(rng.uniform(-3, 3));
  return Tensor::from(std::move(values), shape);
}

std::vector<int64_t> random_lengths(Random& rng, int64_t batch, int64_t kv_len) {
  std::vector<int64_t> lengths;
  for (int64_t b = 0; b < batch; ++b) lengths.push_back(rng.integer(0, kv_len));
  return lengths;
}

MaskSpec make_mask(const Case& c, Random& rng) {
  const int64_t B = c.batch, H = c.q_heads, Nq = c.q_len, Nk = c.kv_len;
  const auto keep = [](const Tensor& t) { return MaskSpec{Mask::keep(t), qkv_test::keep_bias(t)}; };
  const auto additive = [](const Tensor& t) {
    return MaskSpec{Mask::additive(t), qkv_test::additive_bias(t)};
  };
  switch (c.mask) {
    case MaskKind::None: return {Mask(), {}};
    case MaskKind::Causal: return {Mask::causal(), qkv_test::causal_bias()};
    case MaskKind::CausalOffset: {
      const int64_t offset = rng.integer(1, std::max<int64_t>(1, Nk));
      return {Mask::causal(offset), qkv_test::causal_bias(offset)};
    }
    case MaskKind::Window: {
      const int64_t left = rng.integer(0, Nk);
      return {Mask::window(left), qkv_test::window_bias(left)};
    }
    case MaskKind::WindowRight: {
      const int64_t left = rng.integer(0, Nk), right = rng.integer(1, Nk), offset = rng.integer(0, Nk);
      return {Mask::window(left, right, offset), qkv_test::window_bias(left, right, offset)};
    }
    case MaskKind::KeyLengths: {
      const std::vector<int64_t> lengths = random_lengths(rng, B, Nk);
      return {Mask::key_lengths(lengths), qkv_test::key_lengths_bias(lengths)};
    }
    case MaskKind::Keep2D: return keep(random_keep(rng, {Nq, Nk}));
    case MaskKind::Keep2DRow: return keep(random_keep(rng, {1, Nk}));
    case MaskKind::Keep3D: return keep(random_keep(rng, {B, Nq, Nk}));
    case MaskKind::Keep3DBroadcast: return keep(random_keep(rng, {B, 1, Nk}));
    case MaskKind::Keep4D: return keep(random_keep(rng, {B, H, Nq, Nk}));
    case MaskKind::Keep4DBatch: return keep(random_keep(rng, {B, 1, Nq, Nk}));
    case MaskKind::Keep4DHeads: return keep(random_keep(rng, {1, H, Nq, Nk}));
    case MaskKind::Padding: {
      // The oracle hears key_lengths, so a wrong padding tensor cannot agree with itself.
      const std::vector<int64_t> lengths = random_lengths(rng, B, Nk);
      return {Mask::keep(qkv::create_padding_mask(lengths, Nk)), qkv_test::key_lengths_bias(lengths)};
    }
    case MaskKind::Additive2D: return additive(random_additive(rng, {Nq, Nk}));
    case MaskKind::Additive4D: return additive(random_additive(rng, {1, H, Nq, Nk}));
    case MaskKind::Combined: {
      const int64_t offset = rng.integer(0, 3);
      const std::vector<int64_t> lengths = random_lengths(rng, B, Nk);
      const Tensor keep_tensor = random_keep(rng, c.rank == 2 ? Shape{Nq, Nk} : Shape{B, Nq, Nk});
      const Tensor add_tensor = random_additive(rng, {Nq, Nk});
      return {Mask::causal(offset) & Mask::key_lengths(lengths) & Mask::keep(keep_tensor) &
                  Mask::additive(add_tensor),
              qkv_test::all_of({qkv_test::causal_bias(offset), qkv_test::key_lengths_bias(lengths),
                                qkv_test::keep_bias(keep_tensor), qkv_test::additive_bias(add_tensor)})};
    }
  }
  return {};
}

// ---------------------------------------------------------------------------------------------
// Strided views holding the same logical values as a packed tensor.

// Storage (..., D, N) viewed through transpose(-1, -2) as (..., N, D).
Tensor as_transposed_view(const Tensor& t) {
  const int64_t rows = t.size(-2), cols = t.size(-1);
  const int64_t outer = t.numel() / std::max<int64_t>(1, rows * cols);
  const float* src = t.data();
  std::vector<float> swapped(static_cast<size_t>(t.numel()));
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        swapped[static_cast<size_t>((o * cols + c) * rows + r)] = src[(o * rows + r) * cols + c];
  std::vector<int64_t> dims = t.shape().dims();
  std::swap(dims[dims.size() - 1], dims[dims.size() - 2]);
  return Tensor::from(std::move(swapped), Shape(dims)).transpose(-1, -2);
}

// Storage (B, N, H, D) viewed through transpose(1, 2) as (B, H, N, D): the layout
// MultiHeadAttention splits heads into.
Tensor as_head_split_view(const Tensor& t) {
  const int64_t B = t.size(0), H = t.size(1), N = t.size(2), D = t.size(3);
  const float* src = t.data();
  std::vector<float> interleaved(static_cast<size_t>(t.numel()));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t d = 0; d < D; ++d)
          interleaved[static_cast<size_t>(((b * N + n) * H + h) * D + d)] = src[((b * H + h) * N + n) * D + d];
  return Tensor::from(std::move(interleaved), {B, N, H, D}).transpose(1, 2);
}

// ---------------------------------------------------------------------------------------------
// Checks

void expect_matches(const Tensor& got, const std::vector<double>& want, const Shape& shape,
                    const char* what, double tolerance = kTolerance) {
  ASSERT_TRUE(got.defined()) << what << " is undefined";
  EXPECT_EQ(got.shape(), shape) << what;
  const qkv_test::Comparison c = qkv_test::compare(got, want, tolerance);
  EXPECT_TRUE(c.ok) << what << ": " << c.detail;
}

// output, weights (when asked for) and lse against the oracle, shapes included.
void expect_result_matches(const Case& c, const AttentionResult& got, const OracleResult& want,
                           double tolerance = kTolerance) {
  expect_matches(got.output, want.output, result_shape(c, {c.q_len, c.v_dim}), "output", tolerance);
  if (c.need_weights) {
    expect_matches(got.weights, want.weights, result_shape(c, {c.q_len, c.kv_len}), "weights",
                   tolerance);
  } else {
    EXPECT_FALSE(got.weights.defined()) << "weights were not asked for";
  }
  expect_matches(got.lse, want.lse, result_shape(c, {c.q_len}), "lse", tolerance);
}

class AttentionVsOracle : public ::testing::TestWithParam<std::tuple<Backend, Case>> {
 protected:
  Backend backend() const { return std::get<0>(GetParam()); }
  const Case& test_case() const { return std::get<1>(GetParam()); }
};

// Packed inputs: every output element equals the float64 oracle; the inputs are left as they
// were; the outputs are fresh storage; a second call gives the same bits.
TEST_P(AttentionVsOracle, PackedInputs) {
  const Case& c = test_case();
  Random rng;
  SCOPED_TRACE(rng.note());
  const Tensor q = rng.randn(shape_of(c, c.q_heads, c.q_len, c.qk_dim));
  const Tensor k = rng.randn(shape_of(c, c.kv_heads, c.kv_len, c.qk_dim));
  const Tensor v = rng.randn(shape_of(c, c.kv_heads, c.kv_len, c.v_dim));
  const MaskSpec mask = make_mask(c, rng);
  AttentionOptions options;
  options.mask = mask.mask;
  options.need_weights = c.need_weights;
  options.backend = backend();
  double scale = 1.0 / std::sqrt(static_cast<double>(c.qk_dim));
  if (c.custom_scale) {
    options.scale = static_cast<float>(rng.uniform(0.05, 2.0));
    scale = *options.scale;
  }
  SCOPED_TRACE("scale " + std::to_string(scale));
  const std::vector<float> q_before = q.to_vector(), k_before = k.to_vector(), v_before = v.to_vector();

  const AttentionResult got = qkv::scaled_dot_product_attention(q, k, v, options);
  const OracleResult want = qkv_test::attention_oracle(q, k, v, scale, mask.bias);
  expect_result_matches(c, got, want);

  EXPECT_EQ(q.to_vector(), q_before);
  EXPECT_EQ(k.to_vector(), k_before);
  EXPECT_EQ(v.to_vector(), v_before);
  for (const Tensor* input : {&q, &k, &v}) {
    EXPECT_FALSE(got.output.shares_storage_with(*input));
    EXPECT_FALSE(got.lse.shares_storage_with(*input));
  }
  const AttentionResult again = qkv::scaled_dot_product_attention(q, k, v, options);
  EXPECT_EQ(again.output.to_vector(), got.output.to_vector());
  EXPECT_EQ(again.lse.to_vector(), got.lse.to_vector());
  if (c.need_weights) {
    EXPECT_EQ(again.weights.to_vector(), got.weights.to_vector());
  }
}

// Strided views (transposed storage, and for rank 4 the (B, N, H, D) head-split layout) are read
// by their logical index: the results still equal the oracle on the packed values.
TEST_P(AttentionVsOracle, StridedViewInputs) {
  const Case& c = test_case();
  Random rng;
  SCOPED_TRACE(rng.note());
  const Tensor q = rng.randn(shape_of(c, c.q_heads, c.q_len, c.qk_dim));
  const Tensor k = rng.randn(shape_of(c, c.kv_heads, c.kv_len, c.qk_dim));
  const Tensor v = rng.randn(shape_of(c, c.kv_heads, c.kv_len, c.v_dim));
  const Tensor q_view = c.rank == 4 ? as_head_split_view(q) : as_transposed_view(q);
  const Tensor k_view = as_transposed_view(k);
  const Tensor v_view = c.rank == 4 ? as_head_split_view(v) : as_transposed_view(v);
  ASSERT_EQ(q_view.shape(), q.shape());
  ASSERT_EQ(k_view.shape(), k.shape());
  ASSERT_EQ(v_view.shape(), v.shape());
  if (c.kv_len > 1 && c.qk_dim > 1) {
    EXPECT_FALSE(k_view.is_contiguous());
  }

  const MaskSpec mask = make_mask(c, rng);
  AttentionOptions options;
  options.mask = mask.mask;
  options.need_weights = c.need_weights;
  options.backend = backend();
  double scale = 1.0 / std::sqrt(static_cast<double>(c.qk_dim));
  if (c.custom_scale) {
    options.scale = static_cast<float>(rng.uniform(0.05, 2.0));
    scale = *options.scale;
  }
  const AttentionResult got = qkv::scaled_dot_product_attention(q_view, k_view, v_view, options);
  expect_result_matches(c, got, qkv_test::attention_oracle(q, k, v, scale, mask.bias));
}

std::string param_name(const ::testing::TestParamInfo<std::tuple<Backend, Case>>& info) {
  return std::string(qkv::to_string(std::get<0>(info.param))) + "_" + case_name(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(AllCases, AttentionVsOracle,
                         ::testing::Combine(::testing::Values(Backend::Reference, Backend::Auto),
                                            ::testing::ValuesIn(all_cases())),
                         param_name);

// ---------------------------------------------------------------------------------------------
// Edge cases, for both backends.

class AttentionEdgeCases : public ::testing::TestWithParam<Backend> {};

// Rows that see no key (key_lengths 0, a keep row of zeros, an additive row of -inf, a window
// past the end) give output 0, weights 0 and lse -inf exactly, never NaN; the other rows still
// match the oracle.
TEST_P(AttentionEdgeCases, FullyMaskedRowsAreZeroNotNaN) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t B = 2, H = 3, Nq = 5, Nk = 7, Dk = 8, Dv = 6;
  const Tensor q = rng.randn({B, H, Nq, Dk}), k = rng.randn({B, H, Nk, Dk}), v = rng.randn({B, H, Nk, Dv});
  std::vector<float> keep_values(Nq * Nk, 1.0f), add_values(H * Nq * Nk, 0.0f);
  for (int64_t j = 0; j < Nk; ++j) keep_values[2 * Nk + j] = 0.0f;                  // query 2
  for (int64_t j = 0; j < Nk; ++j) add_values[(1 * Nq + 4) * Nk + j] = -INFINITY;  // head 1, query 4
  for (size_t n = 0; n < add_values.size(); ++n)
    if (add_values[n] == 0.0f) add_values[n] = static_cast<float>(rng.uniform(-1, 1));
  const Tensor keep = Tensor::from(keep_values, {Nq, Nk});
  const Tensor add = Tensor::from(add_values, {1, H, Nq, Nk});

  struct Variant {
    Mask mask;
    Bias bias;
  };
  const std::vector<Variant> variants = {
      {Mask::key_lengths({0, Nk}) & Mask::keep(keep) & Mask::additive(add),
       qkv_test::all_of({qkv_test::key_lengths_bias({0, Nk}), qkv_test::keep_bias(keep),
                         qkv_test::additive_bias(add)})},
      {Mask::window(0, 0, Nk), qkv_test::window_bias(0, 0, Nk)},  // every row empty
      {Mask::key_lengths({0, 0}), qkv_test::key_lengths_bias({0, 0})},
  };
  for (const Variant& variant : variants) {
    SCOPED_TRACE(variant.mask.str());
    AttentionOptions options;
    options.mask = variant.mask;
    options.need_weights = true;
    options.backend = GetParam();
    const AttentionResult got = qkv::scaled_dot_product_attention(q, k, v, options);
    const OracleResult want = qkv_test::attention_oracle(q, k, v, 1.0 / std::sqrt(double{Dk}), variant.bias);
    expect_matches(got.output, want.output, {B, H, Nq, Dv}, "output");
    expect_matches(got.weights, want.weights, {B, H, Nq, Nk}, "weights");
    expect_matches(got.lse, want.lse, {B, H, Nq}, "lse");

    const std::vector<float> output = got.output.to_vector(), weights = got.weights.to_vector(),
                             lse = got.lse.to_vector();
    int64_t empty_rows = 0;
    for (int64_t row = 0; row < B * H * Nq; ++row) {
      if (want.lse[static_cast<size_t>(row)] != -kInf) continue;
      ++empty_rows;
      EXPECT_EQ(lse[static_cast<size_t>(row)], -INFINITY) << "row " << row;
      for (int64_t c = 0; c < Dv; ++c) EXPECT_EQ(output[static_cast<size_t>(row * Dv + c)], 0.0f) << "row " << row;
      for (int64_t j = 0; j < Nk; ++j) EXPECT_EQ(weights[static_cast<size_t>(row * Nk + j)], 0.0f) << "row " << row;
    }
    EXPECT_GT(empty_rows, 0);  // the variant really hides whole rows
    for (float x : output) EXPECT_FALSE(std::isnan(x));
    for (float x : weights) EXPECT_FALSE(std::isnan(x));
    for (float x : lse) EXPECT_FALSE(std::isnan(x));
  }
}

// Logits in the hundreds (q and k scaled by 30) overflow a naive exp; the result stays finite and
// matches the oracle. The tolerance is 1e-3: a float32 score of size ~1000 carries an error of
// ~1e-4, which the softmax passes on.
TEST_P(AttentionEdgeCases, LargeLogitsStayFinite) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const Case c{4, 2, 2, 2, 17, 33, 16, 8};
  const Tensor q = rng.randn({2, 2, 17, 16}, 30.0), k = rng.randn({2, 2, 33, 16}, 30.0), v = rng.randn({2, 2, 33, 8});
  const std::vector<int64_t> lengths{33, 5};
  for (const auto& [mask, bias] : std::vector<std::pair<Mask, Bias>>{
           {Mask(), {}},
           {Mask::causal(), qkv_test::causal_bias()},
           {Mask::key_lengths(lengths), qkv_test::key_lengths_bias(lengths)}}) {
    SCOPED_TRACE(mask.str());
    AttentionOptions options;
    options.mask = mask;
    options.need_weights = true;
    options.backend = GetParam();
    const AttentionResult got = qkv::scaled_dot_product_attention(q, k, v, options);
    for (float x : got.output.to_vector()) ASSERT_TRUE(std::isfinite(x));
    for (float x : got.weights.to_vector()) ASSERT_TRUE(std::isfinite(x));
    for (float x : got.lse.to_vector()) ASSERT_TRUE(std::isfinite(x));
    expect_result_matches(c, got, qkv_test::attention_oracle(q, k, v, 0.25, bias), 1e-3);
  }
}

// No keys at all (Nk = 0): zeros, lse -inf, weights of shape (..., Nq, 0).
TEST_P(AttentionEdgeCases, NoKeysGivesZeros) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const Tensor q = rng.randn({2, 3, 4, 8}), k = Tensor::zeros({2, 3, 0, 8}), v = Tensor::zeros({2, 3, 0, 5});
  AttentionOptions options;
  options.need_weights = true;
  options.backend = GetParam();
  const AttentionResult got = qkv::scaled_dot_product_attention(q, k, v, options);
  ASSERT_EQ(got.output.shape(), (Shape{2, 3, 4, 5}));
  ASSERT_EQ(got.weights.shape(), (Shape{2, 3, 4, 0}));
  ASSERT_EQ(got.lse.shape(), (Shape{2, 3, 4}));
  for (float x : got.output.to_vector()) EXPECT_EQ(x, 0.0f);
  for (float x : got.lse.to_vector()) EXPECT_EQ(x, -INFINITY);
}

// No queries (Nq = 0): empty results of the right shapes.
TEST_P(AttentionEdgeCases, NoQueriesGivesEmptyResults) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const Tensor q = Tensor::zeros({2, 3, 0, 8}), k = rng.randn({2, 3, 6, 8}), v = rng.randn({2, 3, 6, 5});
  AttentionOptions options;
  options.need_weights = true;
  options.backend = GetParam();
  const AttentionResult got = qkv::scaled_dot_product_attention(q, k, v, options);
  EXPECT_EQ(got.output.shape(), (Shape{2, 3, 0, 5}));
  EXPECT_EQ(got.weights.shape(), (Shape{2, 3, 0, 6}));
  EXPECT_EQ(got.lse.shape(), (Shape{2, 3, 0}));
}

// Mask tensors given as strided views are read by their logical index.
TEST_P(AttentionEdgeCases, StridedMaskTensors) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t B = 2, H = 2, Nq = 9, Nk = 13;
  const Tensor q = rng.randn({B, H, Nq, 8}), k = rng.randn({B, H, Nk, 8}), v = rng.randn({B, H, Nk, 4});
  const Case c{4, B, H, H, Nq, Nk, 8, 4};
  Tensor keep = random_keep(rng, {B, Nq, Nk});
  Tensor add = random_additive(rng, {Nq, Nk});
  const Tensor keep_view = as_transposed_view(keep);
  const Tensor add_view = as_transposed_view(add);
  AttentionOptions options;
  options.mask = Mask::keep(keep_view) & Mask::additive(add_view);
  options.need_weights = true;
  options.backend = GetParam();
  const AttentionResult got = qkv::scaled_dot_product_attention(q, k, v, options);
  const Bias bias = qkv_test::all_of({qkv_test::keep_bias(keep), qkv_test::additive_bias(add)});
  expect_result_matches(c, got, qkv_test::attention_oracle(q, k, v, 1.0 / std::sqrt(8.0), bias));
}

INSTANTIATE_TEST_SUITE_P(Backends, AttentionEdgeCases,
                         ::testing::Values(Backend::Reference, Backend::Auto),
                         [](const ::testing::TestParamInfo<Backend>& info) {
                           return std::string(qkv::to_string(info.param));
                         });

}  // namespace
