// MultiHeadAttention::forward_packed: a packed batch (x (total_tokens, E), cu_seqlens) against
// forward on each sequence alone, for layers with GQA, causal, softcap, ALiBi, sinks and rotary,
// sequences of lengths 0, 1 and odd ones, a window rule on top; and its refusals.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "harness/oracle.hpp"
#include "qkv/nn.hpp"

namespace {

using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;
using qkv::nn::MultiHeadAttention;
using qkv::nn::MultiHeadAttentionOptions;
using qkv_test::Random;

constexpr int64_t kEmbed = 24, kHeads = 4;

struct LayerCase {
  std::string name;
  MultiHeadAttentionOptions options;
};

std::vector<LayerCase> layers() {
  std::vector<LayerCase> out;
  out.push_back({"plain", {}});
  MultiHeadAttentionOptions causal_gqa;
  causal_gqa.num_kv_heads = 2;
  causal_gqa.causal = true;
  out.push_back({"causal GQA", causal_gqa});
  MultiHeadAttentionOptions modifiers;
  modifiers.causal = true;
  modifiers.softcap = 4.0f;
  modifiers.alibi = true;
  modifiers.sinks = true;
  out.push_back({"causal softcap ALiBi sinks", modifiers});
  MultiHeadAttentionOptions rotary;
  rotary.causal = true;
  rotary.num_kv_heads = 1;
  rotary.rotary = qkv::nn::RotaryEmbeddingOptions{};
  out.push_back({"causal rotary MQA", rotary});
  return out;
}

TEST(MhaPacked, EachSequenceEqualsItsOwnForward) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const std::vector<int64_t> lengths = {5, 1, 0, 17, 9, 2};
  std::vector<int64_t> cu{0};
  for (int64_t n : lengths) cu.push_back(cu.back() + n);
  const Tensor x = rng.randn(Shape{cu.back(), kEmbed});
  for (const LayerCase& layer_case : layers()) {
    for (const Mask& mask : {Mask(), Mask::window(3)}) {
      SCOPED_TRACE(layer_case.name + ", mask " + mask.str());
      MultiHeadAttentionOptions options = layer_case.options;
      options.seed = rng.next_u64();
      MultiHeadAttention layer(kEmbed, kHeads, options);
      if (options.sinks) layer.sinks = rng.randn(Shape{kHeads});  // the learned logits, not zeros
      layer.eval();
      const Tensor packed = layer.forward_packed(x, cu, mask).output;
      ASSERT_EQ(packed.shape(), (Shape{cu.back(), kEmbed}));
      for (size_t b = 0; b < lengths.size(); ++b) {
        if (lengths[b] == 0) continue;
        const Tensor alone = layer.forward(x.narrow(0, cu[b], lengths[b]).contiguous(), mask).output;
        EXPECT_LE(qkv_test::max_rel_diff(packed.narrow(0, cu[b], lengths[b]).contiguous(), alone), 1e-5)
            << "sequence " << b;
      }
    }
  }
}

TEST(MhaPacked, BadInputsAreRefused) {
  MultiHeadAttention layer(kEmbed, kHeads, {.causal = true, .rotary = qkv::nn::RotaryEmbeddingOptions{}});
  const Tensor x = Tensor::zeros({7, kEmbed});
  const auto error_of = [&](const Tensor& input, const std::vector<int64_t>& cu) -> std::string {
    try {
      (void)layer.forward_packed(input, cu);
    } catch (const qkv::Error& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_NE(error_of(Tensor::zeros({1, 7, kEmbed}), {0, 7}).find("x is (1, 7, 24) but should be (total_tokens, 24)"),
            std::string::npos);
  EXPECT_NE(error_of(x, {0, 9}).find("cu_seqlens[1] = 9"), std::string::npos);
  EXPECT_NE(error_of(x, {0, 3, 6}).find("cu_seqlens_q[2] = 6 but q has 7 rows"), std::string::npos);
  MultiHeadAttention linear(kEmbed, kHeads, {.attention = qkv::nn::AttentionKind::Linear});
  EXPECT_THROW((void)linear.forward_packed(x, {0, 7}), qkv::Error);
}

}  // namespace
