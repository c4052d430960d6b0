// nn::RotaryEmbeddingOptions::inverse_frequencies, which the Llama family's rope scaling rides on:
// explicit theta_i rotate exactly as base's do when they are base's, and are checked.
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "qkv/inference.hpp"
#include "qkv/models/config.hpp"

namespace qkv::nn {
namespace {

TEST(RotaryFrequencies, BasesFrequenciesGivenExplicitlyRotateTheSame) {
  const Tensor x = Tensor::randn({1, 3, 7, 10}, 5);
  const RotaryEmbedding by_base(10, {.base = 500});
  const RotaryEmbedding explicit_frequencies(
      10, {.inverse_frequencies = models::rope_inverse_frequencies(10, 500, models::RopeScaling{})});
  EXPECT_EQ(by_base.apply(x, 3).to_vector(), explicit_frequencies.apply(x, 3).to_vector());
}

TEST(RotaryFrequencies, ScaledFrequenciesRotateByTheirAngle) {
  // Linear scaling by 4 at position p rotates as the unscaled frequencies at position p / 4.
  const Tensor x = Tensor::randn({1, 2, 1, 8}, 6);
  const models::RopeScaling linear{.kind = models::RopeScaling::Kind::Linear, .factor = 4};
  const RotaryEmbedding scaled(8, {.inverse_frequencies = models::rope_inverse_frequencies(8, 10000, linear)});
  const std::vector<float> at_8 = scaled.apply(x, 8).to_vector();
  const std::vector<float> at_2 = RotaryEmbedding(8).apply(x, 2).to_vector();
  for (size_t i = 0; i < at_8.size(); ++i) EXPECT_NEAR(at_8[i], at_2[i], 1e-6) << i;
}

TEST(RotaryFrequencies, AreChecked) {
  EXPECT_THROW(RotaryEmbedding(8, {.inverse_frequencies = {1, 0.1, 0.01}}), Error);     // 3 for head_dim 8
  EXPECT_THROW(RotaryEmbedding(4, {.inverse_frequencies = {1, -0.1}}), Error);          // not > 0
  EXPECT_THROW(RotaryEmbedding(4, {.inverse_frequencies = {1, std::nan("")}}), Error);  // not finite
}

}  // namespace
}  // namespace qkv::nn
