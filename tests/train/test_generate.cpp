// Inference with the train model: the cached forward (per-layer KV caches) against the full
// forward, greedy generation with and without the cache, and a trained copy-task model that
// generates the right tokens from its KV cache (f32 and bf16); sinusoidal, rotary and T5 positions
// (the T5 tables random, so that they matter).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "qkv/train.hpp"

namespace {

using ::testing::HasSubstr;
using qkv::Tensor;
using qkv::train::AttentionModel;
using qkv::train::ModelConfig;
using qkv::train::Positions;

std::vector<int64_t> random_ids(int64_t n, int64_t vocab, uint64_t seed) {
  std::vector<int64_t> ids;
  uint64_t state = seed * 0x9E3779B97F4A7C15ULL + 1;
  for (int64_t i = 0; i < n; ++i) {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    ids.push_back(static_cast<int64_t>(state % static_cast<uint64_t>(vocab)));
  }
  return ids;
}

// A T5 model's bias tables (zeros when built) set to random values in [-2, 2), so that its
// positions change the logits; a no-op for other models.
void randomise_t5_tables(AttentionModel& model, uint64_t seed) {
  for (auto& block : model.layers) {
    if (!block.attention.relative_position_bias) continue;
    Tensor& table = block.attention.relative_position_bias->weight;
    const std::vector<int64_t> draws = random_ids(table.numel(), 1000, seed++);
    for (int64_t e = 0; e < table.numel(); ++e) table.data()[e] = static_cast<float>(draws[e]) / 250.0f - 2.0f;
  }
}

// Runs ids (batch 2) through the caches in chunks of `chunk` tokens and returns the logits of
// every position, (2, n, vocab) as a flat vector in the full forward's order.
std::vector<float> cached_logits(const AttentionModel& model, const std::vector<int64_t>& ids, int64_t n,
                                 int64_t chunk, qkv::DType dtype) {
  const int64_t vocab = model.config().vocab_size;
  std::vector<qkv::nn::KVCache> caches = model.make_caches(2, n, dtype);
  std::vector<float> out(static_cast<size_t>(2 * n * vocab), std::nanf(""));
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t len = std::min(chunk, n - start);
    std::vector<int64_t> part;
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t i = 0; i < len; ++i) part.push_back(ids[static_cast<size_t>(b * n + start + i)]);
    const Tensor logits = model.forward(part, 2, len, caches);
    EXPECT_EQ(logits.shape(), qkv::Shape({2, len, vocab}));
    for (int64_t b = 0; b < 2; ++b)
      std::copy(logits.data() + b * len * vocab, logits.data() + (b + 1) * len * vocab,
                out.begin() + (b * n + start) * vocab);
    EXPECT_EQ(caches.front().length(), start + len);
  }
  return out;
}

double max_abs_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(static_cast<double>(a[i]) - b[i]);
    worst = std::isnan(d) ? INFINITY : std::max(worst, d);
  }
  return worst;
}

TEST(CachedForward, EqualsTheFullForwardInChunksOf1_3And17) {
  constexpr int64_t kN = 41;
  for (Positions positions : {Positions::Sinusoidal, Positions::Rotary, Positions::T5}) {
    const ModelConfig config{.vocab_size = 11, .max_len = 48, .d_model = 24, .num_heads = 3, .num_layers = 2,
                             .positions = positions};
    AttentionModel model(config, 7);
    randomise_t5_tables(model, 3);
    const std::vector<int64_t> ids = random_ids(2 * kN, config.vocab_size, 3);
    const std::vector<float> full = model.forward(ids, 2, kN).to_vector();
    double scale = 0;
    for (float v : full) scale = std::max(scale, std::fabs(static_cast<double>(v)));
    for (int64_t chunk : {1, 3, 17}) {
      SCOPED_TRACE(qkv::train::to_string(positions) + ", chunks of " + std::to_string(chunk));
      EXPECT_LE(max_abs_difference(cached_logits(model, ids, kN, chunk, qkv::DType::F32), full), 1e-5 * scale + 1e-5);
      // 16-bit keys and values: the logits move by the rounding of K and V, not more.
      EXPECT_LE(max_abs_difference(cached_logits(model, ids, kN, chunk, qkv::DType::BF16), full), 0.05 * scale);
    }
  }
}

// A model with a mask expression: the cached forward moves the mask to the new tokens' positions
// (bands, strided offsets, global tokens) and equals the full forward under the same mask.
TEST(CachedForward, MaskedModelsEqualTheFullForward) {
  constexpr int64_t kN = 37;
  for (const std::string mask : {"window(3) | strided(4)", "global(2) | window(1)", "strided(5, 2) & window(9)",
                                 "causal & (window(2, 1) | strided(3))", "global(20) | strided(6)"}) {
    for (Positions positions : {Positions::Sinusoidal, Positions::Rotary, Positions::T5}) {
      const ModelConfig config{.vocab_size = 11, .max_len = 40, .d_model = 16, .num_heads = 2, .num_layers = 2,
                               .positions = positions, .mask = mask};
      AttentionModel model(config, 9);
      randomise_t5_tables(model, 4);
      const std::vector<int64_t> ids = random_ids(2 * kN, config.vocab_size, 5);
      const std::vector<float> full = model.forward(ids, 2, kN).to_vector();
      double scale = 0;
      for (float v : full) scale = std::max(scale, std::fabs(static_cast<double>(v)));
      for (int64_t chunk : {1, 3, 17}) {
        SCOPED_TRACE("mask " + mask + ", " + qkv::train::to_string(positions) + ", chunks of " + std::to_string(chunk));
        EXPECT_LE(max_abs_difference(cached_logits(model, ids, kN, chunk, qkv::DType::F32), full), 1e-5 * scale + 1e-5);
      }
      // A quantized cache: the masked cached forward hands attention the cache's scales; int8
      // moves the logits by the rounding of K and V (a 254th of a row's largest), not more.
      SCOPED_TRACE("mask " + mask + ", int8 cache");
      EXPECT_LE(max_abs_difference(cached_logits(model, ids, kN, 3, qkv::DType::I8), full), 0.05 * scale);
    }
  }
  // The mask matters: without it the model computes something else.
  const ModelConfig unmasked{.vocab_size = 11, .max_len = 40, .d_model = 16, .num_heads = 2, .num_layers = 2};
  ModelConfig masked = unmasked;
  masked.mask = "window(3) | strided(4)";
  const std::vector<int64_t> ids = random_ids(2 * kN, 11, 5);
  EXPECT_GT(max_abs_difference(cached_logits(AttentionModel(masked, 9), ids, kN, 1, qkv::DType::F32),
                               AttentionModel(unmasked, 9).forward(ids, 2, kN).to_vector()),
            1e-3);
}

TEST(CachedForward, Errors) {
  const ModelConfig config{.vocab_size = 5, .max_len = 8, .d_model = 8, .num_heads = 2, .num_layers = 1};
  const AttentionModel model(config, 1);
  EXPECT_THAT([&] { (void)model.make_caches(1, 9); }, ::testing::ThrowsMessage<qkv::Error>(HasSubstr("capacity 9")));
  std::vector<qkv::nn::KVCache> caches = model.make_caches(1, 8);
  (void)model.forward(std::vector<int64_t>(6, 1), 1, 6, caches);
  EXPECT_THAT([&] { (void)model.forward(std::vector<int64_t>(3, 1), 1, 3, caches); },
              ::testing::ThrowsMessage<qkv::Error>(HasSubstr("after 6 cached positions (max_len 8)")));
  std::vector<qkv::nn::KVCache> none;
  EXPECT_THAT([&] { (void)model.forward({1}, 1, 1, none); },
              ::testing::ThrowsMessage<qkv::Error>(HasSubstr("0 caches for 1 layers")));

  ModelConfig linear = config;
  linear.attention = qkv::nn::AttentionKind::Linear;
  EXPECT_THAT([&] { (void)AttentionModel(linear, 1).make_caches(1, 8); },
              ::testing::ThrowsMessage<qkv::Error>(HasSubstr("this model uses linear attention")));
  // Without the cache, a linear model generates.
  EXPECT_EQ(qkv::train::generate(AttentionModel(linear, 1), {1, 2}, {.tokens = 3, .use_cache = false}).ids.size(), 3u);
}

TEST(Generate, TheCacheChangesTheTimeNotTheTokens) {
  for (Positions positions : {Positions::Sinusoidal, Positions::Rotary, Positions::T5}) {
    const ModelConfig config{.vocab_size = 13, .max_len = 40, .d_model = 16, .num_heads = 2, .num_layers = 2,
                             .positions = positions};
    AttentionModel model(config, 21);
    randomise_t5_tables(model, 5);
    const std::vector<int64_t> prompt = random_ids(9, config.vocab_size, 4);
    const qkv::train::Generation cached = qkv::train::generate(model, prompt, {.tokens = 31});
    const qkv::train::Generation recomputed = qkv::train::generate(model, prompt, {.tokens = 31, .use_cache = false});
    EXPECT_EQ(cached.ids, recomputed.ids);
    ASSERT_EQ(cached.steps.size(), 31u);
    EXPECT_EQ(cached.steps[0].read, 9);  // the prefill
    EXPECT_EQ(cached.steps[0].position, 8);
    EXPECT_EQ(cached.steps[5].read, 1);
    EXPECT_EQ(cached.steps[5].position, 13);
    EXPECT_EQ(recomputed.steps[5].read, 14);
    for (const auto& step : cached.steps) {
      EXPECT_GT(step.attention_seconds, 0);
      EXPECT_GE(step.total_seconds, step.attention_seconds);
    }
  }
  const AttentionModel model({.vocab_size = 5, .max_len = 8, .d_model = 8, .num_heads = 2, .num_layers = 1}, 1);
  EXPECT_THAT([&] { (void)qkv::train::generate(model, {1, 2, 3}, {.tokens = 7}); },
              ::testing::ThrowsMessage<qkv::Error>(HasSubstr("need 9 positions, but the model reads at most max_len 8")));
  EXPECT_THAT([&] { (void)qkv::train::generate(model, {1, 5}, {.tokens = 1}); },
              ::testing::ThrowsMessage<qkv::Error>(HasSubstr("token id 5 is outside the vocabulary [0, 5)")));
  EXPECT_THAT([&] { (void)qkv::train::generate(model, {}, {.tokens = 1}); },
              ::testing::ThrowsMessage<qkv::Error>(HasSubstr("the prompt is empty")));
  EXPECT_EQ(qkv::train::generate(model, {1, 2, 3}, {.tokens = 6}).ids.size(), 6u);  // exactly fills max_len
}

// A copy-task model trained for a few seconds copies: prompted with "a b c d e |", it generates
// "a b c d e" from its KV cache, in f32 and in bf16.
TEST(Generate, ATrainedCopyModelCopiesFromItsCache) {
  const qkv::train::TaskOptions task{.task = qkv::train::Task::Copy, .symbols = 8, .length = 5};
  const ModelConfig config{.vocab_size = qkv::train::vocab_size(task), .max_len = qkv::train::sequence_length(task),
                           .d_model = 32, .num_heads = 2, .num_layers = 2, .positions = Positions::Rotary};
  qkv::train::TrainOptions options;
  options.task = task;
  options.steps = 150;
  options.batch = 32;
  options.seed = 2;
  options.adamw.lr = 1e-2f;
  options.warmup_steps = 20;
  AttentionModel model(config, options.seed);
  qkv::train::train(model, options);

  const qkv::train::Batch held_out = qkv::train::make_batch(task, 64, qkv::train::held_out_seed(options.seed));
  for (qkv::DType dtype : {qkv::DType::F32, qkv::DType::BF16}) {
    int64_t right = 0;
    for (int64_t s = 0; s < held_out.batch; ++s) {
      const int64_t* ids = held_out.ids.data() + s * held_out.length;
      const std::vector<int64_t> prompt(ids, ids + task.length + 1);  // the symbols and '|'
      const std::vector<int64_t> expected(ids, ids + task.length);
      const qkv::train::Generation generated =
          qkv::train::generate(model, prompt, {.tokens = task.length, .kv_dtype = dtype});
      right += generated.ids == expected;
      if (dtype == qkv::DType::F32)
        EXPECT_EQ(generated.ids, qkv::train::generate(model, prompt, {.tokens = task.length, .use_cache = false}).ids);
    }
    std::printf("copy %lld symbols: %lld of %lld held-out sequences generated right with a %s cache\n",
                static_cast<long long>(task.length), static_cast<long long>(right),
                static_cast<long long>(held_out.batch), std::string(qkv::to_string(dtype)).c_str());
    EXPECT_GE(right, 58) << "at least 90% of the sequences copied exactly";
  }
}

}  // namespace
