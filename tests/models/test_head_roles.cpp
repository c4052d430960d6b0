// Head roles (qkv::models::score_heads, measure_head_roles) on attention maps set by hand: a
// previous-token head, a first-token head, a self head, a uniform (broad) head and an induction
// head are each named for what they do, and their scores are the means the header defines.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "checkpoint.hpp"
#include "configs.hpp"
#include "model_test_support.hpp"
#include "qkv/models/head_roles.hpp"

namespace qkv::models {
namespace {

using ::testing::HasSubstr;
using testing::error_of;

// (1, H, N, N) causal weights from a rule row i -> the key it puts all its weight on, or -1 for
// uniform over keys 0..i.
Tensor attention_of(int64_t n, const std::vector<std::function<int64_t(int64_t)>>& heads) {
  Tensor w = Tensor::zeros({1, static_cast<int64_t>(heads.size()), n, n});
  float* p = w.data();
  for (size_t h = 0; h < heads.size(); ++h)
    for (int64_t i = 0; i < n; ++i) {
      float* row = p + (static_cast<int64_t>(h) * n + i) * n;
      const int64_t key = heads[h](i);
      if (key < 0) {
        for (int64_t j = 0; j <= i; ++j) row[j] = 1.0f / static_cast<float>(i + 1);
      } else {
        row[key] = 1;
      }
    }
  return w;
}

TEST(HeadRoles, HandSetHeadsAreNamed) {
  const int64_t n = 10, T = 6, start = 1;  // the repeated sequence: BOS, then T tokens twice
  const auto previous = [](int64_t i) { return i == 0 ? 0 : i - 1; };
  const auto first = [](int64_t) { return int64_t{0}; };
  const auto self = [](int64_t i) { return i; };
  const auto uniform = [](int64_t) { return int64_t{-1}; };
  // Induction: in the second copy, query start + T + t looks at start + t + 1.
  const auto induction = [&](int64_t i) { return i >= start + T ? i - T + 1 : 0; };
  const std::vector<std::function<int64_t(int64_t)>> heads = {previous, first, self, uniform, induction};
  const std::vector<Tensor> text = {attention_of(n, heads)};
  const std::vector<Tensor> repeat = {attention_of(start + 2 * T, heads)};
  const std::vector<HeadRoleScores> s = score_heads(text, repeat, start, T, /*causal=*/true);
  ASSERT_EQ(s.size(), 5u);
  EXPECT_EQ(s[0].role, HeadRole::PreviousToken);
  EXPECT_DOUBLE_EQ(s[0].previous_token, 1.0);
  EXPECT_EQ(s[1].role, HeadRole::FirstToken);
  EXPECT_DOUBLE_EQ(s[1].first_token, 1.0);
  EXPECT_DOUBLE_EQ(s[1].previous_token, 1.0 / (n - 1));  // row 1's previous token is token 0
  EXPECT_EQ(s[2].role, HeadRole::Self);
  EXPECT_EQ(s[3].role, HeadRole::Broad);
  EXPECT_NEAR(s[3].broad, 1.0, 1e-6);
  // On the text, the induction head looks at key 0 except in the rows past start + T.
  EXPECT_EQ(s[4].role, HeadRole::Induction);
  EXPECT_DOUBLE_EQ(s[4].induction, 1.0);
  EXPECT_DOUBLE_EQ(s[0].induction, 0.0);  // the previous-token head looks at start + T + t - 1
  for (const HeadRoleScores& h : s) EXPECT_EQ(h.layer, 0);
}

TEST(HeadRoles, ScoresAreMeansOverRows) {
  // A head that puts 0.7 on the previous token and 0.3 on the first: its scores are those means.
  const int64_t n = 6;
  Tensor w = Tensor::zeros({1, 1, n, n});
  for (int64_t i = 0; i < n; ++i) {
    w.data()[i * n] += i == 0 ? 1.0f : 0.3f;
    if (i > 0) w.data()[i * n + i - 1] += 0.7f;
  }
  const auto s = score_heads({w}, {attention_of(7, {[](int64_t) { return int64_t{0}; }})}, 0, 3, true);
  // Row 1: its previous token is token 0, so both weights land on key 0.
  EXPECT_NEAR(s[0].previous_token, (1.0 + 4 * 0.7) / 5, 1e-6);
  EXPECT_NEAR(s[0].first_token, (1.0 + 4 * 0.3) / 5, 1e-6);
  EXPECT_EQ(s[0].role, HeadRole::PreviousToken);  // 0.76 / 0.4 beats 0.44 / 0.5
}

TEST(HeadRoles, BadShapesAreErrors) {
  const Tensor w = attention_of(4, {[](int64_t) { return int64_t{0}; }});
  EXPECT_THAT(error_of([&] { score_heads({w}, {}, 0, 2, true); }), HasSubstr("1 layers of text attention but 0"));
  EXPECT_THAT(error_of([&] { score_heads({w}, {w}, 1, 2, true); }), HasSubstr("does not fit 4 positions"));
  EXPECT_THAT(error_of([&] { score_heads({Tensor::zeros({4, 3})}, {w}, 0, 2, true); }),
              HasSubstr("expected (1, H, N, N) or (H, N, N)"));
}

TEST(HeadRoles, MeasuredOnAModel) {
  // Every head of a random model gets five scores in [0, 1] and the mean weights are consistent.
  const ModelConfig c = parse_config(testing::llama_json());
  const testing::Checkpoint k = testing::llama_checkpoint(c, DType::F32, 3);
  const Model model(c, k.weights);
  std::vector<int64_t> candidates;
  for (int64_t id = 1; id < c.vocab_size; ++id) candidates.push_back(id);
  const auto s = measure_head_roles(model, {1, 7, 9, 12, 7, 9}, {0}, candidates, {.repeat_length = 8, .seed = 2});
  ASSERT_EQ(static_cast<int64_t>(s.size()), c.num_layers * c.num_heads);
  for (const HeadRoleScores& h : s) {
    for (double v : {h.previous_token, h.first_token, h.self, h.induction, h.broad}) {
      EXPECT_GE(v, 0);
      EXPECT_LE(v, 1 + 1e-6);
    }
    EXPECT_LE(h.previous_token + h.first_token, 1 + 1e-5 + 1.0 / 5);  // row 1 counts key 0 twice
  }
  EXPECT_THAT(error_of([&] { measure_head_roles(model, {1}, {}, candidates); }), HasSubstr("at least 2"));
  EXPECT_THAT(error_of([&] { measure_head_roles(model, {1, 2}, {}, {}); }), HasSubstr("no tokens"));
}

}  // namespace
}  // namespace qkv::models
