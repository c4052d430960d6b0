// Dropout on the attention weights: reproducible from the seed, the elements dropout_keeps()
// names and no others, survivors scaled by 1 / (1 - p), the output made from the weights
// returned, and p = 0 exactly no dropout.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
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

AttentionResult attend(const Tensor& q, const Tensor& k, const Tensor& v, Backend backend, float p,
                       uint64_t seed, const Mask& mask = {}, bool need_weights = true) {
  AttentionOptions options;
  options.mask = mask;
  options.dropout_p = p;
  options.seed = seed;
  options.need_weights = need_weights;
  options.backend = backend;
  return qkv::scaled_dot_product_attention(q, k, v, options);
}

class Dropout : public ::testing::TestWithParam<Backend> {};

// The same seed drops the same weights (bit-identical results); another seed drops others.
TEST_P(Dropout, SeedDecides) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const Tensor q = rng.randn({2, 3, 9, 8}), k = rng.randn({2, 3, 13, 8}), v = rng.randn({2, 3, 13, 5});
  const uint64_t seed = rng.next_u64();
  const AttentionResult a = attend(q, k, v, GetParam(), 0.3f, seed);
  const AttentionResult b = attend(q, k, v, GetParam(), 0.3f, seed);
  const AttentionResult c = attend(q, k, v, GetParam(), 0.3f, seed + 1);
  EXPECT_EQ(a.output.to_vector(), b.output.to_vector());
  EXPECT_EQ(a.weights.to_vector(), b.weights.to_vector());
  EXPECT_NE(a.weights.to_vector(), c.weights.to_vector());
  EXPECT_NE(a.output.to_vector(), c.output.to_vector());
}

// p = 0 is bit-identical to no dropout, whatever the seed.
TEST_P(Dropout, ZeroProbabilityIsNoDropout) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const Tensor q = rng.randn({2, 3, 9, 8}), k = rng.randn({2, 3, 13, 8}), v = rng.randn({2, 3, 13, 5});
  AttentionOptions plain;
  plain.need_weights = true;
  plain.backend = GetParam();
  const AttentionResult none = qkv::scaled_dot_product_attention(q, k, v, plain);
  const AttentionResult zero = attend(q, k, v, GetParam(), 0.0f, rng.next_u64());
  EXPECT_EQ(zero.output.to_vector(), none.output.to_vector());
  EXPECT_EQ(zero.weights.to_vector(), none.weights.to_vector());
  EXPECT_EQ(zero.lse.to_vector(), none.lse.to_vector());
}

// Over 32768 weights with p = 0.3 the kept fraction is within 5 standard deviations of 0.7,
// and the kept weights are exactly those dropout_keeps() keeps.
TEST_P(Dropout, KeptFractionIsOneMinusP) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t B = 2, H = 4, N = 64;
  const float p = 0.3f;
  const uint64_t seed = rng.next_u64();
  const Tensor q = rng.randn({B, H, N, 8}), k = rng.randn({B, H, N, 8}), v = rng.randn({B, H, N, 4});
  const std::vector<float> weights = attend(q, k, v, GetParam(), p, seed).weights.to_vector();
  int64_t kept = 0, kept_by_hash = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < N; ++i)
        for (int64_t j = 0; j < N; ++j) {
          kept += weights[static_cast<size_t>(((b * H + h) * N + i) * N + j)] != 0.0f;
          kept_by_hash += qkv::dropout_keeps(seed, b, h, i, j, p);
        }
  const double n = static_cast<double>(B * H * N * N);
  const double sigma = std::sqrt(p * (1 - p) / n);
  EXPECT_NEAR(static_cast<double>(kept) / n, 1.0 - p, 5 * sigma);
  EXPECT_EQ(kept, kept_by_hash);
}

// Each weight is either exactly 0, where dropout_keeps() says drop, or the undropped weight times
// 1 / (1 - p). Covers grouped-query heads (the head is the query head), a mask with empty rows,
// and rank 3 (head 0).
TEST_P(Dropout, SurvivorsScaledDroppedZero) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const float p = static_cast<float>(rng.uniform(0.1, 0.6));
  const uint64_t seed = rng.next_u64();
  SCOPED_TRACE("p = " + std::to_string(p));
  struct Problem {
    Tensor q, k, v;
    Mask mask;
  };
  const std::vector<Problem> problems = {
      {rng.randn({2, 4, 7, 8}), rng.randn({2, 2, 11, 8}), rng.randn({2, 2, 11, 3}),
       Mask::causal(3) & Mask::key_lengths({0, 11})},
      {rng.randn({3, 5, 8}), rng.randn({3, 6, 8}), rng.randn({3, 6, 2}), Mask()},
  };
  for (const Problem& problem : problems) {
    const AttentionResult plain = attend(problem.q, problem.k, problem.v, GetParam(), 0.0f, 0, problem.mask);
    const AttentionResult dropped = attend(problem.q, problem.k, problem.v, GetParam(), p, seed, problem.mask);
    ASSERT_EQ(dropped.weights.shape(), plain.weights.shape());
    const bool rank4 = problem.q.dim() == 4;
    const int64_t B = problem.q.size(0), H = rank4 ? problem.q.size(1) : 1;
    const int64_t Nq = problem.q.size(-2), Nk = problem.k.size(-2);
    const std::vector<float> w0 = plain.weights.to_vector(), w = dropped.weights.to_vector();
    int64_t survivors = 0, dropped_count = 0;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < Nq; ++i)
          for (int64_t j = 0; j < Nk; ++j) {
            const size_t n = static_cast<size_t>(((b * H + h) * Nq + i) * Nk + j);
            if (qkv::dropout_keeps(seed, b, h, i, j, p)) {
              EXPECT_FLOAT_EQ(w[n], static_cast<float>(w0[n] / (1.0 - double{p}))) << b << h << i << j;
              survivors += w0[n] != 0.0f;
            } else {
              EXPECT_EQ(w[n], 0.0f) << b << h << i << j;
              dropped_count += w0[n] != 0.0f;
            }
          }
    EXPECT_GT(survivors, 0);
    EXPECT_GT(dropped_count, 0);
    for (float x : dropped.output.to_vector()) EXPECT_TRUE(std::isfinite(x));
  }
}

// The output is the returned (dropped, scaled) weights times V, checked in float64, and equals the
// float64 oracle that applies dropout_keeps() itself; lse ignores dropout.
TEST_P(Dropout, OutputIsWeightsTimesV) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t B = 2, Hq = 4, Hkv = 2, Nq = 9, Nk = 15, Dv = 6;
  const Tensor q = rng.randn({B, Hq, Nq, 8}), k = rng.randn({B, Hkv, Nk, 8}), v = rng.randn({B, Hkv, Nk, Dv});
  const float p = 0.3f;
  const uint64_t seed = rng.next_u64();
  const Mask mask = Mask::causal(Nk - Nq);
  const AttentionResult got = attend(q, k, v, GetParam(), p, seed, mask);
  const std::vector<float> w = got.weights.to_vector();
  std::vector<double> want(static_cast<size_t>(B * Hq * Nq * Dv), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < Nq; ++i)
        for (int64_t j = 0; j < Nk; ++j)
          for (int64_t d = 0; d < Dv; ++d)
            want[static_cast<size_t>(((b * Hq + h) * Nq + i) * Dv + d)] +=
                double{w[static_cast<size_t>(((b * Hq + h) * Nq + i) * Nk + j)]} * v.at({b, h / (Hq / Hkv), j, d});
  const qkv_test::Comparison from_weights = qkv_test::compare(got.output, want, 1e-5);
  EXPECT_TRUE(from_weights.ok) << from_weights.detail;

  const qkv_test::OracleDropout dropout{
      p, [&](int64_t b, int64_t h, int64_t i, int64_t j) { return qkv::dropout_keeps(seed, b, h, i, j, p); }};
  const qkv_test::OracleResult oracle =
      qkv_test::attention_oracle(q, k, v, 1.0 / std::sqrt(8.0), qkv_test::causal_bias(Nk - Nq), dropout);
  for (const auto& [tensor, values, what] : {std::tuple{&got.output, &oracle.output, "output"},
                                             std::tuple{&got.weights, &oracle.weights, "weights"},
                                             std::tuple{&got.lse, &oracle.lse, "lse"}}) {
    const qkv_test::Comparison c = qkv_test::compare(*tensor, *values, 1e-4);
    EXPECT_TRUE(c.ok) << what << ": " << c.detail;
  }
}

// Without need_weights the same seed drops the same elements: the output is unchanged.
TEST_P(Dropout, SameOutputWithoutWeights) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const Tensor q = rng.randn({2, 3, 9, 8}), k = rng.randn({2, 3, 13, 8}), v = rng.randn({2, 3, 13, 5});
  const uint64_t seed = rng.next_u64();
  const AttentionResult with = attend(q, k, v, GetParam(), 0.25f, seed, Mask::causal(4), true);
  const AttentionResult without = attend(q, k, v, GetParam(), 0.25f, seed, Mask::causal(4), false);
  EXPECT_LE(qkv_test::max_rel_diff(with.output, without.output), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Backends, Dropout, ::testing::Values(Backend::Reference, Backend::Auto),
                         [](const ::testing::TestParamInfo<Backend>& info) {
                           return std::string(qkv::to_string(info.param));
                         });

// dropout_keeps is a pure function of its arguments: p = 0 keeps everything, and every argument
// (seed, batch, head, query, key) changes some decisions.
TEST(DropoutKeeps, PureFunctionOfEveryArgument) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const uint64_t seed = rng.next_u64();
  const float p = 0.5f;
  int64_t differs[5] = {0, 0, 0, 0, 0};
  for (int64_t n = 0; n < 2000; ++n) {
    const int64_t b = rng.integer(0, 7), h = rng.integer(0, 31), i = rng.integer(0, 4095), j = rng.integer(0, 4095);
    const bool keeps = qkv::dropout_keeps(seed, b, h, i, j, p);
    EXPECT_EQ(keeps, qkv::dropout_keeps(seed, b, h, i, j, p));
    EXPECT_TRUE(qkv::dropout_keeps(seed, b, h, i, j, 0.0f));
    differs[0] += keeps != qkv::dropout_keeps(seed + 1, b, h, i, j, p);
    differs[1] += keeps != qkv::dropout_keeps(seed, b + 1, h, i, j, p);
    differs[2] += keeps != qkv::dropout_keeps(seed, b, h + 1, i, j, p);
    differs[3] += keeps != qkv::dropout_keeps(seed, b, h, i + 1, j, p);
    differs[4] += keeps != qkv::dropout_keeps(seed, b, h, i, j + 1, p);
  }
  // Independent decisions differ half the time: far more than 700 of 2000 (mean 1000, sd 22).
  for (int64_t count : differs) EXPECT_GT(count, 700);
}

// dropout_keeps refuses a p that attention refuses, with attention's message; p = 0 and just
// below 1 are answered.
TEST(DropoutKeeps, RefusesTheProbabilitiesAttentionRefuses) {
  const Tensor x = Tensor::zeros(Shape{2, 4});
  for (float p : {std::nanf(""), 1.0f, 2.0f, -1.0f, -0.0f - 1e-30f, INFINITY}) {
    SCOPED_TRACE(p);
    std::string attention_message;
    try {
      attend(x, x, x, Backend::Auto, p, 1);
    } catch (const qkv::Error& e) {
      attention_message = e.what();
    }
    ASSERT_THAT(attention_message, ::testing::HasSubstr("dropout_p must be in [0, 1), got "));
    const std::string expected = attention_message.substr(attention_message.find("dropout_p"));
    EXPECT_THAT([&] { qkv::dropout_keeps(1, 0, 0, 0, 0, p); },
                ::testing::ThrowsMessage<qkv::Error>(::testing::AllOf(::testing::StartsWith("dropout_keeps: "),
                                                                       ::testing::EndsWith(expected))));
  }
  EXPECT_NO_THROW(qkv::dropout_keeps(1, 0, 0, 0, 0, 0.0f));
  EXPECT_NO_THROW(qkv::dropout_keeps(1, 0, 0, 0, 0, std::nextafter(1.0f, 0.0f)));
}

}  // namespace
