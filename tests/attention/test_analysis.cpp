// qkv::analysis: entropy of real attention weights against a float64 computation, the FLOPs and
// bytes formulas against counting, and the attention / feed-forward crossover against a direct
// comparison of the two costs.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "harness/oracle.hpp"

namespace {

using qkv::Tensor;
namespace analysis = qkv::analysis;

// Row and head entropies of weights from a real attention call, against float64 sums; one-hot
// rows give 0, uniform rows ln(Nk), and a fully masked row (all zeros) 0.
TEST(Analysis, EntropyOfAttentionWeights) {
  qkv_test::Random random;
  SCOPED_TRACE(random.note());
  const int64_t B = 2, H = 3, N = 7;
  qkv::AttentionOptions options;
  options.need_weights = true;
  options.mask = qkv::Mask::causal() & qkv::Mask::key_lengths({N, 0});
  const Tensor q = random.randn({B, H, N, 8}), k = random.randn({B, H, N, 8}), v = random.randn({B, H, N, 8});
  const Tensor weights = qkv::scaled_dot_product_attention(q, k, v, options).weights;
  const Tensor rows = analysis::row_entropy(weights);
  const Tensor heads = analysis::head_entropy(weights);
  ASSERT_EQ(rows.shape(), (qkv::Shape{B, H, N}));
  ASSERT_EQ(heads.shape(), (qkv::Shape{B, H}));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      double head_sum = 0;
      for (int64_t i = 0; i < N; ++i) {
        double want = 0;
        for (int64_t j = 0; j < N; ++j) {
          const double w = weights.at({b, h, i, j});
          if (w > 0) want -= w * std::log(w);
        }
        EXPECT_NEAR(rows.at({b, h, i}), want, 1e-5);
        head_sum += want;
      }
      EXPECT_NEAR(heads.at({b, h}), head_sum / N, 1e-5);
    }
  // Query 0 of batch 0 sees only key 0 (one-hot): entropy 0; batch 1 sees nothing: 0 as well.
  EXPECT_EQ(rows.at({0, 0, 0}), 0.0f);
  EXPECT_EQ(rows.at({1, 2, 3}), 0.0f);
  const Tensor uniform = Tensor::full({2, 5}, 0.2f);
  EXPECT_NEAR(analysis::row_entropy(uniform).at({1}), std::log(5.0), 1e-6);
  EXPECT_THROW(analysis::head_entropy(Tensor::zeros({4, 4})), qkv::Error);
}

// FLOPs: counted multiply-adds of Q K^T and P V equal the formula; causal is half; the bytes of
// a materialising kernel exceed the fused ones by exactly the scores written and read.
TEST(Analysis, FlopsAndBytesFormulas) {
  const analysis::Workload w1{4, 12, 12, 512, 512, 64, 64, false};
  EXPECT_DOUBLE_EQ(analysis::forward_flops(w1), 4.0 * 4 * 12 * 512 * 512 * 64);
  analysis::Workload gqa{1, 32, 8, 3, 11, 128, 96, false};
  double counted = 0;  // 2 flops per multiply-add, per (b, h, i, j): Dk for the score, Dv for P V
  for (int64_t pair = 0; pair < 32 * 3 * 11; ++pair) counted += 2.0 * 128 + 2.0 * 96;
  EXPECT_DOUBLE_EQ(analysis::forward_flops(gqa), counted);
  gqa.causal = true;
  EXPECT_DOUBLE_EQ(analysis::forward_flops(gqa), counted / 2);
  EXPECT_DOUBLE_EQ(analysis::fused_bytes(gqa), 4.0 * (32 * 3 * (128 + 96 + 1) + 8 * 11 * (128 + 96)));
  EXPECT_DOUBLE_EQ(analysis::materialised_bytes(gqa) - analysis::fused_bytes(gqa), 2 * 4.0 * 32 * 3 * 11);
}

// At the crossover the two costs per token are equal, and one token later attention costs more.
TEST(Analysis, AttentionPassesTheFeedForward) {
  for (bool causal : {false, true})
    for (int64_t d : {64, 768, 4096}) {
      const int64_t m = 4;
      const int64_t n = analysis::attention_ffn_crossover(d, m, causal);
      const auto attention = [&](int64_t keys) { return (causal ? 2.0 : 4.0) * double(keys) * double(d); };
      const double ffn = 2.0 * 2.0 * double(d) * double(m * d);
      EXPECT_DOUBLE_EQ(attention(n), ffn) << d << (causal ? " causal" : "");
      EXPECT_GT(attention(n + 1), ffn);
    }
  EXPECT_EQ(analysis::attention_ffn_crossover(768), 3072);
  EXPECT_THROW(analysis::attention_ffn_crossover(0), qkv::Error);
}

}  // namespace
