// Every bad input throws qkv::Error (a std::invalid_argument) whose message names the argument
// and the actual shapes or values.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "harness/oracle.hpp"

namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using qkv::AttentionOptions;
using qkv::Backend;
using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;

const std::string kCore = "scaled_dot_product_attention: ";

// The message of the qkv::Error that f throws; a failure if it throws nothing or something else.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const qkv::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw something other than qkv::Error: " << e.what();
    return "";
  }
  ADD_FAILURE() << "did not throw";
  return "";
}

// scaled_dot_product_attention on zero tensors of the given shapes.
std::string sdpa_error(const Shape& q, const Shape& k, const Shape& v, const AttentionOptions& options = {}) {
  return error_of([&] {
    qkv::scaled_dot_product_attention(Tensor::zeros(q), Tensor::zeros(k), Tensor::zeros(v), options);
  });
}

AttentionOptions with_mask(const Mask& mask) {
  AttentionOptions options;
  options.mask = mask;
  return options;
}

// qkv::Error is a std::invalid_argument, so generic handlers catch it.
TEST(Errors, CatchableAsInvalidArgument) {
  EXPECT_THROW(qkv::scaled_dot_product_attention(Tensor::zeros({2, 4, 8}), Tensor::zeros({2, 4, 6}),
                                                 Tensor::zeros({2, 4, 6})),
               std::invalid_argument);
  EXPECT_THROW(Tensor::from({1, 2, 3, 4, 5}, {2, 3}), std::invalid_argument);
  EXPECT_THROW(qkv::nn::MultiHeadAttention(512, 7), std::invalid_argument);
}

// Ranks: 2, 3 or 4, and the same for q, k and v.
TEST(Errors, Ranks) {
  EXPECT_THAT(sdpa_error({2, 3, 4, 5, 6}, {2, 3, 4, 5, 6}, {2, 3, 4, 5, 6}),
              HasSubstr(kCore + "q is (2, 3, 4, 5, 6): rank must be 2, 3 or 4"));
  EXPECT_THAT(sdpa_error({4, 8}, {4}, {4}), HasSubstr("rank must be 2, 3 or 4"));
  EXPECT_THAT(sdpa_error({2, 4, 8}, {4, 8}, {4, 8}), HasSubstr(kCore + "q is (2, 4, 8) but k is (4, 8): ranks differ"));
  EXPECT_THAT(sdpa_error({2, 4, 8}, {2, 4, 8}, {1, 2, 4, 8}), HasSubstr("ranks differ"));
}

// Head dims, batch sizes, lengths and head counts must agree.
TEST(Errors, ShapesDisagree) {
  EXPECT_THAT(sdpa_error({2, 4, 8}, {2, 4, 6}, {2, 4, 6}),
              HasSubstr(kCore + "q is (2, 4, 8) but k is (2, 4, 6): head dims differ"));
  EXPECT_THAT(sdpa_error({2, 4, 8}, {3, 4, 8}, {3, 4, 8}),
              HasSubstr(kCore + "q is (2, 4, 8) but k is (3, 4, 8): batch sizes differ"));
  EXPECT_THAT(sdpa_error({2, 4, 8}, {2, 5, 8}, {2, 6, 8}),
              HasSubstr(kCore + "k is (2, 5, 8) but v is (2, 6, 8): key and value lengths differ"));
  EXPECT_THAT(sdpa_error({1, 4, 3, 8}, {1, 2, 5, 8}, {1, 4, 5, 8}),
              HasSubstr(kCore + "k is (1, 2, 5, 8) but v is (1, 4, 5, 8): head counts differ"));
  EXPECT_THAT(sdpa_error({1, 2, 3, 8}, {1, 2, 5, 8}, {2, 2, 5, 8}),
              HasSubstr(kCore + "k is (1, 2, 5, 8) but v is (2, 2, 5, 8): batch sizes differ"));
  EXPECT_THAT(sdpa_error({1, 8, 4, 16}, {1, 3, 4, 16}, {1, 3, 4, 16}),
              HasSubstr(kCore + "q is (1, 8, 4, 16) but k is (1, 3, 4, 16): query heads (8) must be a "
                                "multiple of key/value heads (3)"));
}

// A default-constructed tensor is named as undefined.
TEST(Errors, UndefinedTensors) {
  const Tensor ok = Tensor::zeros({2, 4, 8});
  EXPECT_THAT(error_of([&] { qkv::scaled_dot_product_attention(Tensor(), ok, ok); }), HasSubstr(kCore + "q is undefined"));
  EXPECT_THAT(error_of([&] { qkv::scaled_dot_product_attention(ok, Tensor(), ok); }), HasSubstr(kCore + "k is undefined"));
  EXPECT_THAT(error_of([&] { qkv::scaled_dot_product_attention(ok, ok, Tensor()); }), HasSubstr(kCore + "v is undefined"));
}

// Mask tensors that do not broadcast to the scores name both shapes, keep or additive alike.
TEST(Errors, MaskTensorsMustBroadcast) {
  const Shape q{2, 4, 3, 8}, kv{2, 4, 6, 8};
  EXPECT_THAT(sdpa_error(q, kv, kv, with_mask(Mask::keep(Tensor::zeros({3, 5})))),
              HasSubstr(kCore + "mask keep (3, 5) does not broadcast to the scores (2, 4, 3, 6)"));
  EXPECT_THAT(sdpa_error(q, kv, kv, with_mask(Mask::additive(Tensor::zeros({3, 5})))),
              HasSubstr(kCore + "mask additive (3, 5) does not broadcast to the scores (2, 4, 3, 6)"));
  for (const Shape& bad : {Shape{6}, Shape{1, 2, 4, 3, 6}, Shape{3, 3, 6}, Shape{2, 3, 3, 6}, Shape{2, 4, 6, 3}}) {
    SCOPED_TRACE(bad.str());
    EXPECT_THAT(sdpa_error(q, kv, kv, with_mask(Mask::keep(Tensor::zeros(bad)))),
                AllOf(HasSubstr("mask keep " + bad.str()), HasSubstr("does not broadcast to the scores (2, 4, 3, 6)")));
    EXPECT_THAT(sdpa_error(q, kv, kv, with_mask(Mask::additive(Tensor::zeros(bad)))),
                AllOf(HasSubstr("mask additive " + bad.str()), HasSubstr("does not broadcast")));
  }
}

// key_lengths needs one length per batch, each within [0, Nk].
TEST(Errors, KeyLengths) {
  EXPECT_THAT(sdpa_error({2, 4, 8}, {2, 6, 8}, {2, 6, 8}, with_mask(Mask::key_lengths({1, 2, 3}))),
              HasSubstr(kCore + "mask key_lengths has 3 lengths but the batch is 2"));
  EXPECT_THAT(sdpa_error({2, 4, 8}, {2, 6, 8}, {2, 6, 8}, with_mask(Mask::key_lengths({6, 7}))),
              HasSubstr(kCore + "mask key_lengths[1] = 7 is outside [0, 6]"));
  // A negative length may be refused when the mask is built or when it is used; either way the
  // message names key_lengths and the length.
  const Tensor x = Tensor::zeros({2, 6, 8});
  EXPECT_THAT(error_of([&] {
                AttentionOptions options;
                options.mask = Mask::key_lengths({-1, 6});
                qkv::scaled_dot_product_attention(x, x, x, options);
              }),
              AllOf(HasSubstr("key_lengths"), HasSubstr("-1")));
}

// scale must be finite and positive.
TEST(Errors, Scale) {
  const auto with_scale = [](float scale) {
    AttentionOptions options;
    options.scale = scale;
    return options;
  };
  const Shape s{2, 4, 8};
  EXPECT_THAT(sdpa_error(s, s, s, with_scale(-1.0f)), HasSubstr(kCore + "scale must be finite and positive, got -1"));
  EXPECT_THAT(sdpa_error(s, s, s, with_scale(0.0f)), HasSubstr(kCore + "scale must be finite and positive, got 0"));
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    EXPECT_THAT(sdpa_error(s, s, s, with_scale(bad)), HasSubstr(kCore + "scale must be finite and positive, got "));
  }
}

// dropout_p must be in [0, 1).
TEST(Errors, DropoutProbability) {
  const auto with_p = [](float p) {
    AttentionOptions options;
    options.dropout_p = p;
    return options;
  };
  const Shape s{2, 4, 8};
  EXPECT_THAT(sdpa_error(s, s, s, with_p(1.5f)), HasSubstr(kCore + "dropout_p must be in [0, 1), got 1.5"));
  EXPECT_THAT(sdpa_error(s, s, s, with_p(-0.1f)), HasSubstr(kCore + "dropout_p must be in [0, 1), got -0.1"));
  EXPECT_THAT(sdpa_error(s, s, s, with_p(1.0f)), HasSubstr(kCore + "dropout_p must be in [0, 1), got 1"));
  EXPECT_THAT(sdpa_error(s, s, s, with_p(std::numeric_limits<float>::quiet_NaN())),
              HasSubstr(kCore + "dropout_p must be in [0, 1), got "));
}

// The fused kernels refuse to pretend they have weights to return.
TEST(Errors, BackendsThatCannotServe) {
  const Shape s{1, 2, 4, 8};
  for (Backend fused : {Backend::Flash, Backend::Decode}) {
    AttentionOptions with_weights;
    with_weights.backend = fused;
    with_weights.need_weights = true;
    EXPECT_THAT(sdpa_error(s, s, s, with_weights),
                HasSubstr("backend " + std::string(qkv::to_string(fused)) + " never materialises the weights"));
  }
}

// nn module construction: heads must divide the embedding, kv heads must divide the heads.
TEST(Errors, MultiHeadAttentionConstruction) {
  EXPECT_THAT(error_of([] { qkv::nn::MultiHeadAttention(512, 7); }),
              HasSubstr("MultiHeadAttention: embed_dim (512) must be divisible by num_heads (7)"));
  qkv::nn::MultiHeadAttentionOptions options;
  options.num_kv_heads = 3;
  EXPECT_THAT(error_of([&] { qkv::nn::MultiHeadAttention(512, 8, options); }),
              HasSubstr("MultiHeadAttention: num_heads (8) must be a multiple of num_kv_heads (3)"));
}

// nn forward: inputs whose features do not fit the module name both.
TEST(Errors, ModuleInputs) {
  const qkv::nn::MultiHeadAttention mha(512, 8);
  EXPECT_THAT(error_of([&] { mha.forward(Tensor::zeros({2, 10, 256})); }),
              HasSubstr("MultiHeadAttention: query is (2, 10, 256) but embed_dim is 512"));
  EXPECT_THROW(mha.forward(Tensor::zeros({2, 10, 512}), Tensor::zeros({2, 7, 100}), Tensor::zeros({2, 7, 512})),
               qkv::Error);
  EXPECT_THROW(mha.forward(Tensor::zeros({2, 10, 512}), Tensor::zeros({2, 7, 512}), Tensor::zeros({2, 6, 512})),
               qkv::Error);
  EXPECT_THROW(mha.forward(Tensor::zeros({2, 10, 512}), Mask::keep(Tensor::zeros({3, 10, 10}))), qkv::Error);

  const qkv::nn::Linear linear(4, 3);
  EXPECT_THAT(error_of([&] { linear.forward(Tensor::zeros({2, 5})); }), HasSubstr("Linear: x is (2, 5) but in_features is 4"));
}

// Embedding ids outside the vocabulary name the id and the vocabulary size.
TEST(Errors, EmbeddingIds) {
  const qkv::nn::Embedding embedding(10, 4);
  const std::string too_big = error_of([&] { embedding.forward({3, 12}); });
  EXPECT_THAT(too_big, AllOf(HasSubstr("12"), HasSubstr("10")));
  const std::string negative = error_of([&] { embedding.forward({-1}); });
  EXPECT_THAT(negative, AllOf(HasSubstr("-1"), HasSubstr("10")));
  EXPECT_THROW(embedding.forward({1, 2, 3, 4, 5}, {2, 3}), qkv::Error);  // 5 ids do not fill (2, 3)
}

// Positional encoding: no more positions than max_len, and the feature count must match.
TEST(Errors, PositionalEncoding) {
  const qkv::nn::SinusoidalPositionalEncoding pe(8, 16);
  EXPECT_THROW(pe.forward(Tensor::zeros({9, 16})), qkv::Error);
  EXPECT_THROW(pe.forward(Tensor::zeros({2, 9, 16})), qkv::Error);
  EXPECT_THROW(pe.forward(Tensor::zeros({2, 8, 15})), qkv::Error);
  EXPECT_NO_THROW(pe.forward(Tensor::zeros({2, 8, 16})));
}

// Tensor: from() names the counts and the shape; data() of a view says it is not contiguous.
TEST(Errors, TensorMessages) {
  EXPECT_THAT(error_of([] { Tensor::from({1, 2, 3, 4, 5}, {2, 3}); }),
              HasSubstr("Tensor::from: 5 values do not fill shape (2, 3) of 6 elements"));
  const Tensor t = Tensor::zeros({2, 3});
  EXPECT_THAT(error_of([&] { t.transpose(0, 1).data(); }), HasSubstr("not contiguous"));
}

// Sizes and offsets that would overflow are refused up front, not turned into a short
// allocation or signed overflow later.
TEST(Errors, OverflowingSizesAndOffsets) {
  const int64_t huge = int64_t{1} << 31;
  EXPECT_THAT(error_of([&] { Tensor::zeros({huge, huge}); }), HasSubstr("has too many elements"));
  EXPECT_THAT(error_of([&] { qkv::create_causal_mask(int64_t{1} << 32); }), HasSubstr("has too many elements"));
  EXPECT_THAT(error_of([] { Mask::causal(INT64_MAX); }), HasSubstr("Mask::causal: offset"));
  EXPECT_THAT(error_of([] { Mask::window(5, 0, INT64_MIN); }), HasSubstr("Mask::window: offset"));
}

// shape()[i] is checked and counts negative i from the end, as torch's x.shape[-1] does.
TEST(Errors, ShapeIndexing) {
  const Shape s{2, 3, 4};
  EXPECT_EQ(s[-1], 4);
  EXPECT_EQ(s[0], 2);
  EXPECT_THAT(error_of([&] { (void)s[3]; }), HasSubstr("index 3 is out of range for (2, 3, 4)"));
  EXPECT_THAT(error_of([&] { (void)s[-4]; }), HasSubstr("index -4 is out of range"));
}

// A Linear whose public weight or bias was replaced by a misfit says so instead of reading
// past the end.
TEST(Errors, LinearWithMisfitParameters) {
  qkv::nn::Linear linear(4, 40);
  linear.bias = Tensor::zeros({1});
  EXPECT_THAT(error_of([&] { linear.forward(Tensor::zeros({2, 4})); }),
              HasSubstr("Linear: weight is (40, 4) and bias (1): expected (out, in) and (out)"));
}

}  // namespace
