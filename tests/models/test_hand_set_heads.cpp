// The hand-set GPT-2 of induction_model.hpp does what its construction says, step by step: layer
// 0 head 0 puts all but 2e-7 of each row on the previous token, layer 1 head 0 on the key after
// the query token's earlier occurrence (shared with key 0 where the token is the first one, as
// the construction predicts), the zero heads are uniform; and the head roles name exactly heads
// (0, 0) and (1, 0). The CLI test models_heads_hand_set runs `qkv heads` on the same weights
// written as a folder.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "induction_model.hpp"
#include "qkv/models/head_roles.hpp"
#include "qkv/models/model.hpp"

namespace qkv::models {
namespace {

constexpr int64_t kVocab = 261;  // the byte-level tokenizer of qkv_make_tiny_model

struct HandSet {
  ModelConfig config = parse_config(testing::induction_config_json(kVocab));
  testing::Checkpoint checkpoint = testing::induction_checkpoint(config);
  Model model{config, checkpoint.weights};
};

float weight(const Tensor& w, int64_t head, int64_t i, int64_t j) {
  const int64_t n = w.size(-1);
  return w.contiguous().data()[(head * n + i) * n + j];
}

TEST(HandSetHeads, LayerZeroHeadZeroAttendsToThePreviousToken) {
  const HandSet m;
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < 64; ++i) ids.push_back((i * 37 + 11) % 50);  // tokens repeat: positions decide
  const ModelOutput out = m.model.forward(ids, /*need_attention=*/true);
  for (int64_t i = 1; i < 64; ++i) {
    EXPECT_GT(weight(out.attention[0], 0, i, i - 1), 1 - 2e-6) << "row " << i;
    EXPECT_NEAR(weight(out.attention[0], 1, i, 0), 1.0 / static_cast<double>(i + 1), 1e-6);  // zero head: uniform
  }
}

TEST(HandSetHeads, LayerOneHeadZeroIsAnInductionHead) {
  const HandSet m;
  const int64_t T = 20;
  std::vector<int64_t> ids;
  for (int64_t t = 0; t < T; ++t) ids.push_back(100 + 7 * t);  // distinct tokens, twice
  for (int64_t t = 0; t < T; ++t) ids.push_back(100 + 7 * t);
  const Tensor w = m.model.forward(ids, /*need_attention=*/true).attention[1];
  // Query T + t (token r_t) matches key t + 1, whose previous token is r_t; for t = 0 key 0 too
  // (row 0 of the previous-token head sees only itself, so key 0 carries e_{r_0}).
  EXPECT_NEAR(weight(w, 0, T, 1), 0.5, 1e-5);
  EXPECT_NEAR(weight(w, 0, T, 0), 0.5, 1e-5);
  for (int64_t t = 1; t + 1 < T; ++t) EXPECT_GT(weight(w, 0, T + t, t + 1), 1 - 1e-5) << "t " << t;
}

TEST(HandSetHeads, TheRolesAreExactlyTheBuiltOnes) {
  const HandSet m;
  std::vector<int64_t> text, candidates;
  for (int64_t i = 0; i < 64; ++i) text.push_back((i * 13 + 5) % 90);
  for (int64_t id = 0; id + 1 < kVocab; ++id) candidates.push_back(id);
  const std::vector<HeadRoleScores> s = measure_head_roles(m.model, text, {}, candidates, {.repeat_length = 24});
  ASSERT_EQ(s.size(), 4u);
  EXPECT_EQ(s[0].role, HeadRole::PreviousToken);
  EXPECT_GT(s[0].previous_token, 0.999);
  EXPECT_EQ(s[1].role, HeadRole::Broad);
  EXPECT_EQ(s[2].role, HeadRole::Induction);
  EXPECT_GT(s[2].induction, 0.8);
  EXPECT_EQ(s[3].role, HeadRole::Broad);
}

}  // namespace
}  // namespace qkv::models
