// The KV-cached path (prefill, then one token a step) against full recomputation, and the
// generation loop: greedy, sampling, stopping.
#include <algorithm>
#include <cmath>

#include <gtest/gtest.h>

#include "checkpoint.hpp"
#include "configs.hpp"
#include "qkv/models/model.hpp"

namespace qkv::models::testing {
namespace {

struct CacheCase {
  std::string name, json;
  DType kv_dtype;
  double tolerance;  // relative to the largest logit
};

void PrintTo(const CacheCase& c, std::ostream* os) { *os << c.name; }

class CachedLogits : public ::testing::TestWithParam<CacheCase> {};

Checkpoint checkpoint_for(const ModelConfig& c, uint64_t seed) {
  return c.architecture == Architecture::GPT2 ? gpt2_checkpoint(c, DType::BF16, seed)
                                              : llama_checkpoint(c, DType::BF16, seed);
}

// Each step's last logits from the cache equal the full forward's row at that position.
TEST_P(CachedLogits, EqualFullRecomputation) {
  const CacheCase& p = GetParam();
  const ModelConfig c = parse_config(p.json);
  const Checkpoint k = checkpoint_for(c, 21);
  const Model model(c, k.weights, ModelOptions{.kv_dtype = p.kv_dtype});
  const std::vector<int64_t> ids = {7, 1, 33, 2, 19, 19, 4, 11, 30, 0, 9};
  const int64_t prefill = 4;
  const auto cached = model.cached_logits(ids, prefill);
  const Tensor full = model.forward(ids).logits;
  ASSERT_EQ(cached.size(), ids.size() - prefill + 1);
  for (size_t s = 0; s < cached.size(); ++s) {
    const int64_t position = prefill - 1 + static_cast<int64_t>(s);
    double scale = 1, worst = 0;
    for (int64_t v = 0; v < c.vocab_size; ++v) {
      const double want = full.at({0, position, v});
      scale = std::max(scale, std::abs(want));
      worst = std::max(worst, std::abs(cached[s][static_cast<size_t>(v)] - want));
    }
    EXPECT_LE(worst, p.tolerance * scale) << p.name << " position " << position;
  }
}

// bf16 keys and values: a relative error of 2^-9 per element, through three layers.
INSTANTIATE_TEST_SUITE_P(
    Caches, CachedLogits,
    ::testing::Values(CacheCase{"Gpt2F32", gpt2_json(), DType::F32, 1e-4},
                      CacheCase{"LlamaF32", llama_json(), DType::F32, 1e-4},
                      CacheCase{"LlamaBf16", llama_json(), DType::BF16, 3e-2},
                      CacheCase{"MistralWindowF32", llama_json("MistralForCausalLM", true, R"(, "sliding_window": 3)"),
                                DType::F32, 1e-4},
                      CacheCase{"Qwen2F16", llama_json("Qwen2ForCausalLM", true), DType::F16, 1e-2}),
    [](const auto& info) { return info.param.name; });

TEST(Generate, GreedyEqualsArgmaxOfTheFullForwardTokenByToken) {
  const ModelConfig c = parse_config(llama_json());
  const Checkpoint k = checkpoint_for(c, 22);
  const Model model(c, k.weights, ModelOptions{.kv_dtype = DType::F32});
  const std::vector<int64_t> prompt = {3, 14, 15, 9};
  GenerationOptions options{.max_new_tokens = 10, .stop_at_eos = false};
  std::vector<int64_t> streamed;
  const GenerationResult result = model.generate(prompt, options, [&](int64_t t) {
    streamed.push_back(t);
    return true;
  });
  ASSERT_EQ(result.tokens.size(), 10u);
  EXPECT_EQ(streamed, result.tokens);
  std::vector<int64_t> sequence = prompt;
  for (int64_t token : result.tokens) {
    const Tensor logits = model.forward(sequence).logits;
    const int64_t n = static_cast<int64_t>(sequence.size());
    const std::vector<float> last(logits.data() + (n - 1) * c.vocab_size, logits.data() + n * c.vocab_size);
    // The largest logit of the full forward, or one within its rounding of it: the cached step and
    // the full forward sum in different orders (kernels chosen per CPU), so a near tie may go
    // either way; a greedy step that took any other token is far below.
    const float best = *std::max_element(last.begin(), last.end());
    EXPECT_GE(last[static_cast<size_t>(token)], best - 1e-4f * std::max(1.0f, std::abs(best)))
        << "after " << n << " tokens: token " << token << " where the argmax is "
        << std::max_element(last.begin(), last.end()) - last.begin();
    sequence.push_back(token);
  }
  EXPECT_GT(result.prefill_seconds, 0);
  EXPECT_GT(result.decode_tokens_per_second(), 0);
}

TEST(Generate, SamplingIsSeededAndTopKOneIsGreedy) {
  const ModelConfig c = parse_config(gpt2_json());
  const Checkpoint k = checkpoint_for(c, 23);
  const Model model(c, k.weights);
  const std::vector<int64_t> prompt = {1, 2, 3};
  GenerationOptions sampled{.max_new_tokens = 12, .temperature = 1.5f, .seed = 5, .stop_at_eos = false};
  const auto a = model.generate(prompt, sampled).tokens;
  EXPECT_EQ(a, model.generate(prompt, sampled).tokens);
  sampled.seed = 6;
  EXPECT_NE(a, model.generate(prompt, sampled).tokens);
  GenerationOptions top1 = sampled;
  top1.top_k = 1;
  GenerationOptions greedy{.max_new_tokens = 12, .stop_at_eos = false};
  EXPECT_EQ(model.generate(prompt, top1).tokens, model.generate(prompt, greedy).tokens);
}

TEST(Generate, StopsAtEosAndWhenTheCallbackSaysSo) {
  const ModelConfig c = parse_config(llama_json());
  const Checkpoint k = checkpoint_for(c, 24);
  const Model model(c, k.weights);
  GenerationOptions options{.max_new_tokens = 6, .stop_at_eos = false};
  const auto free_run = model.generate({4, 5, 6}, options).tokens;
  // Make the third greedy token an eos: generation stops right after it.
  ModelConfig with_eos = c;
  with_eos.eos_token_ids = {free_run[2]};
  const Model stopping(with_eos, k.weights);
  options.stop_at_eos = true;
  const GenerationResult stopped = stopping.generate({4, 5, 6}, options);
  const auto first = std::find(free_run.begin(), free_run.end(), free_run[2]) - free_run.begin();
  EXPECT_TRUE(stopped.stopped_at_eos);
  EXPECT_EQ(stopped.tokens, std::vector<int64_t>(free_run.begin(), free_run.begin() + first + 1));
  int calls = 0;
  EXPECT_EQ(model.generate({4, 5, 6}, options, [&](int64_t) { return ++calls < 2; }).tokens.size(), 2u);
}

TEST(Sample, FollowsTheDistributionTopKAndTopP) {
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  uint64_t state = 9;
  int counts[3] = {0, 0, 0};
  const int draws = 6000;
  for (int i = 0; i < draws; ++i) ++counts[sample_token(logits.data(), 3, {.temperature = 1}, state)];
  EXPECT_NEAR(counts[0] / double(draws), 0.5, 0.03);
  EXPECT_NEAR(counts[1] / double(draws), 0.3, 0.03);
  EXPECT_NEAR(counts[2] / double(draws), 0.2, 0.03);
  for (int i = 0; i < 200; ++i) {
    EXPECT_LT(sample_token(logits.data(), 3, {.temperature = 1, .top_p = 0.75f}, state), 2);
    EXPECT_EQ(sample_token(logits.data(), 3, {.temperature = 1, .top_p = 0.45f}, state), 0);
    EXPECT_LT(sample_token(logits.data(), 3, {.temperature = 1, .top_k = 2}, state), 2);
  }
  EXPECT_EQ(sample_token(logits.data(), 3, {.temperature = 0}, state), 0);
  EXPECT_THROW(sample_token(logits.data(), 3, {.temperature = -1}, state), Error);
  EXPECT_THROW(sample_token(logits.data(), 3, {.temperature = 1, .top_p = 0}, state), Error);
}

}  // namespace
}  // namespace qkv::models::testing
