// Properties attention must have whatever the numbers: softmax rows sum to 1, causality,
// permutation equivariance, keep == additive -inf, grouped-query == repeated heads, and a NaN
// stays in its row. Each runs on fresh random data for both Reference and Auto.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "harness/oracle.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::AttentionResult;
using qkv::Backend;
using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;
using qkv_test::Random;

AttentionResult attend(const Tensor& q, const Tensor& k, const Tensor& v, Backend backend,
                       const Mask& mask = {}, bool need_weights = true) {
  AttentionOptions options;
  options.mask = mask;
  options.need_weights = need_weights && (backend == Backend::Reference || backend == Backend::Auto);  // fused: none
  options.backend = backend;
  return qkv::scaled_dot_product_attention(q, k, v, options);
}

// The rows of a (B, H, N, D) tensor reordered along N: result row n = t row order[n].
Tensor permute_rows(const Tensor& t, const std::vector<int64_t>& order) {
  const int64_t outer = t.size(0) * t.size(1), N = t.size(2), D = t.size(3);
  const std::vector<float> src = t.to_vector();
  std::vector<float> dst(src.size());
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t d = 0; d < D; ++d)
        dst[static_cast<size_t>((o * N + n) * D + d)] = src[static_cast<size_t>((o * N + order[static_cast<size_t>(n)]) * D + d)];
  return Tensor::from(std::move(dst), t.shape());
}

// The last dim of a (B, H, Nq, Nk) tensor reordered: result column j = t column order[j].
Tensor permute_columns(const Tensor& t, const std::vector<int64_t>& order) {
  const int64_t rows = t.numel() / t.size(-1), cols = t.size(-1);
  const std::vector<float> src = t.to_vector();
  std::vector<float> dst(src.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j)
      dst[static_cast<size_t>(r * cols + j)] = src[static_cast<size_t>(r * cols + order[static_cast<size_t>(j)])];
  return Tensor::from(std::move(dst), t.shape());
}

class AttentionProperties : public ::testing::TestWithParam<Backend> {};

// Where a row sees at least one key its weights are in [0, 1] and sum to 1; hidden keys weigh
// exactly 0; a row that sees nothing sums to 0.
TEST_P(AttentionProperties, WeightRowsSumToOne) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t B = 2, H = 3, Nq = 13, Nk = 21;
  const Tensor q = rng.randn({B, H, Nq, 16}, 2.0), k = rng.randn({B, H, Nk, 16}), v = rng.randn({B, H, Nk, 5});
  std::vector<float> keep_values(static_cast<size_t>(B * H * Nq * Nk));
  for (float& x : keep_values) x = rng.chance(0.15) ? 1.0f : 0.0f;  // sparse: some rows empty
  for (int64_t j = 0; j < Nk; ++j) keep_values[static_cast<size_t>(j)] = 0.0f;  // row (0, 0, 0) surely
  const Tensor keep = Tensor::from(keep_values, {B, H, Nq, Nk});
  const std::vector<int64_t> lengths{rng.integer(1, Nk), Nk};
  const Mask mask = Mask::keep(keep) & Mask::key_lengths(lengths);
  if (GetParam() == Backend::Flash || GetParam() == Backend::Decode) GTEST_SKIP() << "fused kernels return no weights";
  const std::vector<float> weights = attend(q, k, v, GetParam(), mask).weights.to_vector();
  ASSERT_EQ(weights.size(), keep_values.size());
  int64_t empty_rows = 0, full_rows = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < Nq; ++i) {
        const int64_t row = (b * H + h) * Nq + i;
        double sum = 0;
        bool any_visible = false;
        for (int64_t j = 0; j < Nk; ++j) {
          const size_t n = static_cast<size_t>(row * Nk + j);
          const bool visible = keep_values[n] != 0.0f && j < lengths[static_cast<size_t>(b)];
          any_visible = any_visible || visible;
          EXPECT_GE(weights[n], 0.0f);
          EXPECT_LE(weights[n], 1.0f);
          if (!visible) {
            EXPECT_EQ(weights[n], 0.0f) << "hidden key " << j << " of row " << row;
          }
          sum += weights[n];
        }
        EXPECT_NEAR(sum, any_visible ? 1.0 : 0.0, 1e-5) << "row " << row;
        (any_visible ? full_rows : empty_rows) += 1;
      }
  EXPECT_GT(full_rows, 0);
  EXPECT_GT(empty_rows, 0);
}

// With a causal mask, changing key/value j leaves every query i < j bit-identical (output and
// lse), and does change query j.
TEST_P(AttentionProperties, CausalityChangingAFutureKeyLeavesEarlierQueries) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t B = 2, H = 2, N = 17, Dk = 8, Dv = 6;
  const Tensor q = rng.randn({B, H, N, Dk}), k = rng.randn({B, H, N, Dk}), v = rng.randn({B, H, N, Dv});
  const int64_t j = rng.integer(1, N - 1);
  SCOPED_TRACE("changed key " + std::to_string(j));
  const Tensor k2 = k.clone(), v2 = v.clone();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t d = 0; d < Dk; ++d) k2.at({b, h, j, d}) = static_cast<float>(rng.normal() * 3);
      for (int64_t d = 0; d < Dv; ++d) v2.at({b, h, j, d}) = static_cast<float>(rng.normal() * 3);
    }
  const AttentionResult before = attend(q, k, v, GetParam(), Mask::causal());
  const AttentionResult after = attend(q, k2, v2, GetParam(), Mask::causal());
  bool row_j_changed = false;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < j; ++i) {
        for (int64_t d = 0; d < Dv; ++d)
          EXPECT_EQ(after.output.at({b, h, i, d}), before.output.at({b, h, i, d})) << b << h << i << d;
        EXPECT_EQ(after.lse.at({b, h, i}), before.lse.at({b, h, i}));
      }
      for (int64_t d = 0; d < Dv; ++d)
        row_j_changed = row_j_changed || after.output.at({b, h, j, d}) != before.output.at({b, h, j, d});
    }
  EXPECT_TRUE(row_j_changed);
}

// Without a mask, permuting the queries permutes the output rows (and lse), and permuting keys
// and values together leaves the output unchanged and permutes the weight columns.
TEST_P(AttentionProperties, PermutationEquivariance) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t B = 2, H = 3, Nq = 11, Nk = 17;
  const Tensor q = rng.randn({B, H, Nq, 8}), k = rng.randn({B, H, Nk, 8}), v = rng.randn({B, H, Nk, 5});
  const AttentionResult base = attend(q, k, v, GetParam());

  const std::vector<int64_t> q_order = rng.permutation(Nq);
  const AttentionResult by_query = attend(permute_rows(q, q_order), k, v, GetParam());
  EXPECT_LE(qkv_test::max_rel_diff(by_query.output, permute_rows(base.output, q_order)), 1e-5);
  EXPECT_LE(qkv_test::max_rel_diff(by_query.lse.unsqueeze(3), permute_rows(base.lse.unsqueeze(3), q_order)), 1e-5);

  const std::vector<int64_t> k_order = rng.permutation(Nk);
  const AttentionResult by_key = attend(q, permute_rows(k, k_order), permute_rows(v, k_order), GetParam());
  EXPECT_LE(qkv_test::max_rel_diff(by_key.output, base.output), 1e-5);
  EXPECT_LE(qkv_test::max_rel_diff(by_key.lse, base.lse), 1e-5);
  if (GetParam() == Backend::Reference || GetParam() == Backend::Auto)
    EXPECT_LE(qkv_test::max_rel_diff(by_key.weights, permute_columns(base.weights, k_order)), 1e-5);
}

// A keep mask and the additive mask with -inf where keep is 0 give bit-identical results.
TEST_P(AttentionProperties, KeepEqualsAdditiveMinusInf) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t B = 2, H = 3, Nq = 9, Nk = 14;
  const Tensor q = rng.randn({B, H, Nq, 8}), k = rng.randn({B, H, Nk, 8}), v = rng.randn({B, H, Nk, 7});
  std::vector<float> keep_values(static_cast<size_t>(B * Nq * Nk)), add_values(keep_values.size());
  for (size_t n = 0; n < keep_values.size(); ++n) {
    keep_values[n] = rng.chance(0.7) ? 1.0f : 0.0f;
    add_values[n] = keep_values[n] != 0.0f ? 0.0f : -INFINITY;
  }
  const AttentionResult with_keep = attend(q, k, v, GetParam(), Mask::keep(Tensor::from(keep_values, {B, 1, Nq, Nk})));
  const AttentionResult with_add = attend(q, k, v, GetParam(), Mask::additive(Tensor::from(add_values, {B, 1, Nq, Nk})));
  EXPECT_EQ(with_keep.output.to_vector(), with_add.output.to_vector());
  EXPECT_EQ(with_keep.weights.to_vector(), with_add.weights.to_vector());
  EXPECT_EQ(with_keep.lse.to_vector(), with_add.lse.to_vector());
}

// Grouped-query attention equals ordinary attention with each key/value head repeated for its
// group of query heads (6 over 2, and 4 over 1), masked or not.
TEST_P(AttentionProperties, GroupedQueryEqualsRepeatedHeads) {
  Random rng;
  SCOPED_TRACE(rng.note());
  for (const auto& [Hq, Hkv] : std::vector<std::pair<int64_t, int64_t>>{{6, 2}, {4, 1}}) {
    SCOPED_TRACE(std::to_string(Hq) + " query heads over " + std::to_string(Hkv));
    const int64_t B = 2, Nq = 9, Nk = 11, Dk = 8, Dv = 5, group = Hq / Hkv;
    const Tensor q = rng.randn({B, Hq, Nq, Dk}), k = rng.randn({B, Hkv, Nk, Dk}), v = rng.randn({B, Hkv, Nk, Dv});
    Tensor k_rep = Tensor::zeros({B, Hq, Nk, Dk}), v_rep = Tensor::zeros({B, Hq, Nk, Dv});
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t j = 0; j < Nk; ++j) {
          for (int64_t d = 0; d < Dk; ++d) k_rep.at({b, h, j, d}) = k.at({b, h / group, j, d});
          for (int64_t d = 0; d < Dv; ++d) v_rep.at({b, h, j, d}) = v.at({b, h / group, j, d});
        }
    for (const Mask& mask : {Mask(), Mask::causal(2) & Mask::key_lengths({Nk, 4})}) {
      const AttentionResult grouped = attend(q, k, v, GetParam(), mask);
      const AttentionResult repeated = attend(q, k_rep, v_rep, GetParam(), mask);
      EXPECT_LE(qkv_test::max_rel_diff(grouped.output, repeated.output), 1e-6) << mask.str();
      EXPECT_LE(qkv_test::max_rel_diff(grouped.weights, repeated.weights), 1e-6) << mask.str();
      EXPECT_LE(qkv_test::max_rel_diff(grouped.lse, repeated.lse), 1e-6) << mask.str();
    }
  }
}

// A NaN in one query row changes only that row: every other row is bit-identical and finite,
// and that row is NaN everywhere: output, lse and the row stats the backward reads.
TEST_P(AttentionProperties, NaNInOneQueryStaysInItsRow) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t B = 2, H = 2, Nq = 7, Nk = 10, Dk = 8, Dv = 4;
  const Tensor q = rng.randn({B, H, Nq, Dk}), k = rng.randn({B, H, Nk, Dk}), v = rng.randn({B, H, Nk, Dv});
  const int64_t nb = rng.integer(0, B - 1), nh = rng.integer(0, H - 1), ni = rng.integer(0, Nq - 1);
  const Tensor q_nan = q.clone();
  q_nan.at({nb, nh, ni, rng.integer(0, Dk - 1)}) = NAN;
  const AttentionResult clean = attend(q, k, v, GetParam());
  const AttentionResult dirty = attend(q_nan, k, v, GetParam());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < Nq; ++i) {
        if (b == nb && h == nh && i == ni) {
          for (int64_t d = 0; d < Dv; ++d) EXPECT_TRUE(std::isnan(dirty.output.at({b, h, i, d})));
          for (const Tensor* stat : {&dirty.lse, &dirty.row_max, &dirty.row_sum})
            EXPECT_TRUE(std::isnan(stat->at({b, h, i})));
          continue;
        }
        for (int64_t d = 0; d < Dv; ++d) {
          EXPECT_TRUE(std::isfinite(dirty.output.at({b, h, i, d})));
          EXPECT_EQ(dirty.output.at({b, h, i, d}), clean.output.at({b, h, i, d}));
        }
        EXPECT_EQ(dirty.lse.at({b, h, i}), clean.lse.at({b, h, i}));
      }
}

// A NaN in one key's row reaches exactly the queries that see that key: those rows are NaN
// everywhere (output, lse, row_max and row_sum: a kernel whose running max skips NaN must still
// poison its stats), the others equal a clean run bit for bit. Under a causal mask (the key at a
// random row, anywhere in a flash key tile) and under window | strided(64), which flash computes
// by strided residues first and carries their softmax state into the window's tiles.
TEST_P(AttentionProperties, NaNInOneKeyReachesTheRowsThatSeeIt) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t B = 1, H = 2, N = 150, D = 16, S = 64;
  const Tensor q = rng.randn({B, H, N, D}), k = rng.randn({B, H, N, D}), v = rng.randn({B, H, N, D});
  const int64_t nh = rng.integer(0, H - 1), nj = rng.integer(1, N - 2);
  const Tensor k_nan = k.clone();
  k_nan.at({0, nh, nj, rng.integer(0, D - 1)}) = NAN;
  const std::vector<std::pair<Mask, std::function<bool(int64_t, int64_t)>>> masks = {
      {Mask::causal(), [](int64_t i, int64_t j) { return j <= i; }},
      {Mask::window(7, 0) | Mask::strided(S),
       [](int64_t i, int64_t j) { return (j <= i && i - j <= 7) || ((i - j) % S + S) % S == 0; }}};
  for (const auto& [mask, sees] : masks) {
    SCOPED_TRACE(mask.str() + ", NaN key " + std::to_string(nj) + " of head " + std::to_string(nh));
    const AttentionResult clean = attend(q, k, v, GetParam(), mask);
    const AttentionResult dirty = attend(q, k_nan, v, GetParam(), mask);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < N; ++i) {
        if (h == nh && sees(i, nj)) {
          for (int64_t d = 0; d < D; ++d) EXPECT_TRUE(std::isnan(dirty.output.at({0, h, i, d}))) << "row " << i;
          for (const Tensor* stat : {&dirty.lse, &dirty.row_max, &dirty.row_sum})
            EXPECT_TRUE(std::isnan(stat->at({0, h, i}))) << "row " << i;
          continue;
        }
        for (int64_t d = 0; d < D; ++d) EXPECT_EQ(dirty.output.at({0, h, i, d}), clean.output.at({0, h, i, d}));
        for (const auto stat : {&AttentionResult::lse, &AttentionResult::row_max, &AttentionResult::row_sum})
          EXPECT_EQ((dirty.*stat).at({0, h, i}), (clean.*stat).at({0, h, i})) << "row " << i;
      }
  }
}

// NaN or Inf in the keys and values of a KV cache's unwritten slots (past key_lengths), or at
// keys a mask hides, never reaches a query that cannot see them; the other rows equal a clean
// run bit for bit.
TEST_P(AttentionProperties, NonFiniteHiddenKeysDoNotLeak) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t B = 2, H = 2, Nq = 53, Nk = 131, Dk = 16, Dv = 8;
  const Tensor q = rng.randn({B, H, Nq, Dk}), k = rng.randn({B, H, Nk, Dk}), v = rng.randn({B, H, Nk, Dv});
  const std::vector<int64_t> lengths = {rng.integer(1, Nk - 1), rng.integer(1, Nk - 1)};
  const Tensor k_dirty = k.clone(), v_dirty = v.clone();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = lengths[b]; j < Nk; ++j) {  // the unwritten cache slots
        k_dirty.at({b, h, j, rng.integer(0, Dk - 1)}) = rng.chance(0.5) ? NAN : INFINITY;
        v_dirty.at({b, h, j, rng.integer(0, Dv - 1)}) = rng.chance(0.5) ? NAN : -INFINITY;
      }
  Tensor additive = Tensor::zeros({Nq, Nk});
  for (int64_t i = 0; i < Nq; ++i) additive.at({i, rng.integer(0, Nk - 1)}) = -INFINITY;
  for (const Mask& mask : {Mask::key_lengths(lengths), Mask::key_lengths(lengths) & Mask::causal(Nk - Nq),
                           Mask::key_lengths(lengths) & Mask::additive(additive)}) {
    const AttentionResult clean = attend(q, k, v, GetParam(), mask);
    const AttentionResult dirty = attend(q, k_dirty, v_dirty, GetParam(), mask);
    EXPECT_EQ(dirty.output.to_vector(), clean.output.to_vector()) << mask.str();
    EXPECT_EQ(dirty.lse.to_vector(), clean.lse.to_vector()) << mask.str();
  }
  // Inside the cache, a NaN value at key j under a causal mask reaches exactly the queries
  // that see j.
  const int64_t j_nan = rng.integer(Nk - Nq, Nk - 1);
  const Tensor v_nan = v.clone();
  v_nan.at({0, 0, j_nan, 0}) = NAN;
  const AttentionResult clean = attend(q, k, v, GetParam(), Mask::causal(Nk - Nq));
  const AttentionResult dirty = attend(q, k, v_nan, GetParam(), Mask::causal(Nk - Nq));
  for (int64_t i = 0; i < Nq; ++i) {
    const bool sees = Nk - Nq + i >= j_nan;
    EXPECT_EQ(std::isnan(dirty.output.at({0, 0, i, 0})), sees) << "query " << i << ", NaN at key " << j_nan;
    // (Not bit-identical: the NaN moves step 5 off the GEMM onto a loop that rounds differently.)
    if (!sees) EXPECT_NEAR(dirty.output.at({0, 0, i, 0}), clean.output.at({0, 0, i, 0}), 1e-5);
  }
  // Under a sliding window a NaN value is hidden from queries on both sides of a tile's band:
  // those before its key (as above) and those whose window has moved past it (some of each).
  const int64_t left = rng.integer(3, 20), offset = Nk - Nq;
  const int64_t j_window = rng.integer(offset + 1, offset + Nq - 2 - left);
  const Tensor v_window = v.clone();
  v_window.at({0, 0, j_window, 0}) = NAN;
  const AttentionResult slid = attend(q, k, v_window, GetParam(), Mask::window(left, 0, offset));
  for (int64_t i = 0; i < Nq; ++i) {
    const bool sees = offset + i - left <= j_window && j_window <= offset + i;
    EXPECT_EQ(std::isnan(slid.output.at({0, 0, i, 0})), sees) << "query " << i << ", NaN at key " << j_window
                                                              << ", window " << left;
  }
}

// A query row that is all NaN gives a NaN output row and lse, not the zeros of an empty row.
TEST_P(AttentionProperties, NaNQueryIsNotAnEmptyRow) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const Tensor q = rng.randn({1, 2, 9, 8}), k = rng.randn({1, 2, 11, 8}), v = rng.randn({1, 2, 11, 4});
  for (int64_t c = 0; c < 8; ++c) q.at({0, 1, 4, c}) = NAN;
  const AttentionResult r = attend(q, k, v, GetParam());
  for (int64_t c = 0; c < 4; ++c) EXPECT_TRUE(std::isnan(r.output.at({0, 1, 4, c})));
  EXPECT_TRUE(std::isnan(r.lse.at({0, 1, 4})));
}

INSTANTIATE_TEST_SUITE_P(Backends, AttentionProperties,
                         ::testing::Values(Backend::Reference, Backend::Auto, Backend::Flash, Backend::Decode),
                         [](const ::testing::TestParamInfo<Backend>& info) {
                           return std::string(qkv::to_string(info.param));
                         });

}  // namespace
