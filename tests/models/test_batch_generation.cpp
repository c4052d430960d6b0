// Many sequences at once, without padding: a ragged forward run packed against the float64
// oracles; generate_batch's paged, packed steps (cached_logits_batch) against each sequence's full
// forward for every architecture, KV dtype and page size; generate_batch against generate one
// prompt at a time; stopping one sequence while the others go on; the refusals.
#include <algorithm>
#include <cmath>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "checkpoint.hpp"
#include "compare.hpp"
#include "configs.hpp"
#include "oracles.hpp"
#include "qkv/error.hpp"
#include "qkv/memory.hpp"
#include "qkv/models/model.hpp"

namespace qkv::models::testing {
namespace {

using ::testing::HasSubstr;

Checkpoint checkpoint_for(const ModelConfig& c, uint64_t seed) {
  return c.architecture == Architecture::GPT2 ? gpt2_checkpoint(c, DType::BF16, seed)
                                              : llama_checkpoint(c, DType::BF16, seed);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

// Three sequences of different lengths, and how many tokens each prefills.
const std::vector<std::vector<int64_t>> kIds = {
    {7, 1, 33, 2, 19, 19, 4, 11, 30, 0, 9}, {12, 40, 3, 3, 8, 21}, {5, 9, 28, 17, 1, 44, 2, 6, 13}};
const std::vector<int64_t> kPrefill = {4, 1, 9};

struct BatchCase {
  std::string name, json;
  DType kv_dtype;
  int64_t page_size;
  double tolerance;  // relative to the largest logit
  int64_t chunk = 1;  // tokens a step after the prefill (> 1: a chunked prefill over the pages)
};

void PrintTo(const BatchCase& c, std::ostream* os) { *os << c.name; }

class CachedLogitsBatch : public ::testing::TestWithParam<BatchCase> {};

// Every step's last logits of every sequence, on pages, equal that sequence's own full forward:
// steps of one token (one paged call for the batch), or chunks of several (a paged call each).
TEST_P(CachedLogitsBatch, EqualEachSequencesFullForward) {
  const BatchCase& p = GetParam();
  const ModelConfig c = parse_config(p.json);
  const Checkpoint k = checkpoint_for(c, 31);
  const Model model(c, k.weights, ModelOptions{.kv_dtype = p.kv_dtype, .page_size = p.page_size});
  const auto cached = model.cached_logits_batch(kIds, kPrefill, p.chunk);
  ASSERT_EQ(cached.size(), kIds.size());
  for (size_t b = 0; b < kIds.size(); ++b) {
    const Tensor full = model.forward(kIds[b]).logits;
    const auto n = static_cast<int64_t>(kIds[b].size());
    ASSERT_EQ(static_cast<int64_t>(cached[b].size()), 1 + (n - kPrefill[b] + p.chunk - 1) / p.chunk) << "sequence " << b;
    for (size_t s = 0; s < cached[b].size(); ++s) {
      const int64_t position = std::min(n, kPrefill[b] + static_cast<int64_t>(s) * p.chunk) - 1;
      double scale = 1, worst = 0;
      for (int64_t v = 0; v < c.vocab_size; ++v) {
        const double want = full.at({0, position, v});
        scale = std::max(scale, std::abs(want));
        worst = std::max(worst, std::abs(cached[b][s][static_cast<size_t>(v)] - want));
      }
      EXPECT_LE(worst, p.tolerance * scale) << p.name << " sequence " << b << " position " << position;
    }
  }
}

// f32: the sums' order alone. bf16 / f16 keys and values: 2^-9 / 2^-12 per element, through the
// layers, as the contiguous cache's test bounds them. int8: a step of 1/127 of a row's largest
// magnitude; int4: 1/7, which on these random weights moves the logits by up to a fifth. (Measured
// worst, relative: f32 4e-7, bf16 2.5e-3, f16 6.4e-4, int8 6.0e-3, int4 0.22.)
INSTANTIATE_TEST_SUITE_P(
    Pools, CachedLogitsBatch,
    ::testing::Values(BatchCase{"Gpt2F32Page4", gpt2_json(), DType::F32, 4, 1e-4},
                      BatchCase{"Gpt2F32Page1", gpt2_json(), DType::F32, 1, 1e-4},
                      BatchCase{"LlamaF32Page64", llama_json(), DType::F32, 64, 1e-4},
                      BatchCase{"LlamaBf16Page3", llama_json(), DType::BF16, 3, 3e-2},
                      BatchCase{"MistralWindowF32Page2",
                                llama_json("MistralForCausalLM", true, R"(, "sliding_window": 3)"), DType::F32, 2,
                                1e-4},
                      BatchCase{"Qwen2F16Page5", llama_json("Qwen2ForCausalLM", true), DType::F16, 5, 1e-2},
                      BatchCase{"LlamaI8Page4", llama_json(), DType::I8, 4, 2e-2},
                      BatchCase{"Gpt2I4Page8", gpt2_json(), DType::I4, 8, 0.4},
                      BatchCase{"Gpt2F32Page4Chunk3", gpt2_json(), DType::F32, 4, 1e-4, 3},
                      BatchCase{"MistralWindowF32Page2Chunk4",
                                llama_json("MistralForCausalLM", true, R"(, "sliding_window": 3)"), DType::F32, 2,
                                1e-4, 4},
                      BatchCase{"LlamaI8Page4Chunk2", llama_json(), DType::I8, 4, 2e-2, 2}),
    [](const auto& info) { return info.param.name; });

// generate_batch gives each prompt generate's tokens, greedy and sampled (each sequence its own
// sampler, seeded alike), while sequences of different lengths share every step; with 16-bit and
// int8 caches too (both prefills attend to the keys and values as the cache holds them).
TEST(GenerateBatch, EachPromptGetsGeneratesTokens) {
  for (const auto& [json, kv] : {std::pair{gpt2_json(), DType::F32},
                                 {llama_json("MistralForCausalLM", false, R"(, "sliding_window": 4)"), DType::F32},
                                 {gpt2_json(), DType::BF16},
                                 {llama_json(), DType::I8}}) {
    const ModelConfig c = parse_config(json);
    const Checkpoint k = checkpoint_for(c, 32);
    const Model model(c, k.weights, ModelOptions{.kv_dtype = kv, .page_size = 4});
    const std::vector<std::vector<int64_t>> prompts = {{3, 14, 15, 9}, {2}, {26, 5, 35, 8, 9, 7, 9}};
    for (const GenerationOptions& options :
         {GenerationOptions{.max_new_tokens = 9, .stop_at_eos = false},
          GenerationOptions{.max_new_tokens = 9, .temperature = 1.3f, .top_k = 20, .seed = 4, .stop_at_eos = false}}) {
      std::vector<std::vector<int64_t>> streamed(prompts.size());
      const auto results = model.generate_batch(prompts, options, [&](int64_t b, int64_t token) {
        streamed[static_cast<size_t>(b)].push_back(token);
        return true;
      });
      ASSERT_EQ(results.size(), prompts.size());
      for (size_t b = 0; b < prompts.size(); ++b) {
        const GenerationResult alone = model.generate(prompts[b], options);
        EXPECT_EQ(results[b].tokens, alone.tokens) << to_string(c.architecture) << " " << to_string(kv) << " prompt "
                                                   << b << " temperature " << options.temperature;
        EXPECT_EQ(streamed[b], results[b].tokens);
        EXPECT_EQ(results[b].prompt_tokens, static_cast<int64_t>(prompts[b].size()));
        EXPECT_GT(results[b].prefill_seconds, 0);
        EXPECT_GT(results[b].decode_tokens_per_second(), 0);
      }
    }
  }
}

// A sequence that stops (eos, or its callback) releases its pages and leaves the batch; the
// others go on unchanged, on int8 pages of two positions.
TEST(GenerateBatch, StoppedSequencesLeaveTheOthersUnchanged) {
  const ModelConfig c = parse_config(llama_json());
  const Checkpoint k = checkpoint_for(c, 33);
  const Model model(c, k.weights, ModelOptions{.kv_dtype = DType::I8, .page_size = 2});
  const std::vector<std::vector<int64_t>> prompts = {{4, 5, 6}, {9, 10}, {11, 12, 13, 14}};
  const GenerationOptions options{.max_new_tokens = 7, .stop_at_eos = false};
  const auto free_run = model.generate_batch(prompts, options);
  // Prompt 1 stopped by its callback after 2 tokens: prompts 0 and 2 keep their tokens.
  int64_t calls = 0;
  const auto callback_stopped = model.generate_batch(prompts, options, [&](int64_t b, int64_t) {
    return b != 1 || ++calls < 2;
  });
  EXPECT_EQ(callback_stopped[1].tokens, std::vector<int64_t>(free_run[1].tokens.begin(), free_run[1].tokens.begin() + 2));
  EXPECT_EQ(callback_stopped[0].tokens, free_run[0].tokens);
  EXPECT_EQ(callback_stopped[2].tokens, free_run[2].tokens);
  // An eos that is prompt 2's third token stops it there (and any other prompt where it comes).
  ModelConfig with_eos = c;
  with_eos.eos_token_ids = {free_run[2].tokens[2]};
  const Model stopping(with_eos, k.weights, ModelOptions{.kv_dtype = DType::I8, .page_size = 2});
  GenerationOptions at_eos = options;
  at_eos.stop_at_eos = true;
  const auto eos_run = stopping.generate_batch(prompts, at_eos);
  for (size_t b = 0; b < prompts.size(); ++b) {
    const auto& all = free_run[b].tokens;
    const auto end = std::find(all.begin(), all.end(), with_eos.eos_token_ids[0]);
    const bool hit = end != all.end();
    EXPECT_EQ(eos_run[b].tokens, std::vector<int64_t>(all.begin(), hit ? end + 1 : all.end())) << "prompt " << b;
    EXPECT_EQ(eos_run[b].stopped_at_eos, hit) << "prompt " << b;
  }
  EXPECT_TRUE(eos_run[2].stopped_at_eos);
}

// A ragged batch without weights runs packed: each element against its own float64 oracle, the
// padding rows zero. (With weights it runs padded: test_architectures.cpp.)
TEST(PackedForward, RaggedBatchesMatchTheOracles) {
  {
    const ModelConfig c = parse_config(bert_json(true));
    const Checkpoint k = bert_checkpoint(c, DType::F32, 34);
    const Model model(c, k.weights);
    const ModelInput input{.ids = {{2, 7, 30, 4, 11, 9, 1}, {5, 6, 40, 3}, {8}},
                           .token_type_ids = {{0, 0, 0, 1, 1, 1, 1}, {0, 1, 1, 1}, {1}}};
    const ModelOutput got = model.forward(input);
    ASSERT_EQ(got.logits.shape(), (Shape{3, 7, 53}));
    for (int64_t b = 0; b < 3; ++b) {
      const auto u = static_cast<size_t>(b);
      const OracleOutput want = bert_oracle(c, k, input.ids[u], input.token_type_ids[u]);
      expect_rows_close(got.logits, b, want.logits, 1e-4, "bert element " + std::to_string(b));
      expect_rows_close(got.hidden, b, want.hidden, 1e-4, "bert hidden " + std::to_string(b));
    }
    for (int64_t n = 4; n < 7; ++n) EXPECT_EQ(got.logits.at({1, n, 0}), 0.0f);
  }
  {
    const ModelConfig c = parse_config(gpt2_json(false));
    const Checkpoint k = gpt2_checkpoint(c, DType::F32, 35);
    const Model model(c, k.weights);
    const ModelInput input{.ids = {{3}, {1, 2, 3, 4, 5, 6, 7, 8, 9}, {20, 21, 22}}, .token_type_ids = {}};
    const ModelOutput got = model.forward(input);
    for (int64_t b = 0; b < 3; ++b)
      expect_rows_close(got.logits, b, gpt2_oracle(c, k, input.ids[static_cast<size_t>(b)]).logits, 1e-4,
                        "gpt2 element " + std::to_string(b));
    EXPECT_EQ(got.hidden.at({0, 5, 3}), 0.0f);
  }
}

TEST(GenerateBatch, RefusesBadInputByName) {
  const ModelConfig c = parse_config(llama_json());
  const Checkpoint k = checkpoint_for(c, 36);
  const Model model(c, k.weights);
  EXPECT_THAT(error_of([&] { model.generate_batch({{1, 2}, {3, 99}}); }),
              HasSubstr("prompt 1: token id 99 is outside the vocabulary [0, 67)"));
  EXPECT_THAT(error_of([&] { model.generate_batch({{1, 2}, {}}); }), HasSubstr("prompt 1: a sequence is empty"));
  EXPECT_THAT(error_of([&] { model.generate_batch({{1, 2}, std::vector<int64_t>(40, 3)}, {.max_new_tokens = 10}); }),
              HasSubstr("prompt 1: max_new_tokens 10 is outside [0, 9]"));
  EXPECT_THAT(error_of([&] { model.cached_logits_batch({{1, 2}}, {3}); }), HasSubstr("prefill[0] = 3 is outside [1, 2]"));
  EXPECT_THAT(error_of([&] { model.cached_logits_batch({{1, 2}}, {}); }), HasSubstr("0 prefill lengths for 1"));
  EXPECT_THAT(error_of([&] { Model(c, k.weights, ModelOptions{.page_size = 0}); }), HasSubstr("page_size 0"));
  // The pools' size (every prompt's positions, every layer) is checked before they are allocated.
  qkv::set_memory_limit(int64_t{1} << 16);
  const std::string pools = error_of([&] { model.generate_batch(std::vector<std::vector<int64_t>>(40, {1, 2})); });
  qkv::set_memory_limit(0);
  EXPECT_THAT(pools, HasSubstr("Model::generate_batch: 40 sequences need"));
  EXPECT_THAT(pools, HasSubstr("3 layers' K/V pools of 40 pages of 48 positions"));
  EXPECT_TRUE(model.generate_batch({}).empty());
  EXPECT_EQ(model.generate_batch({{1}, {2, 3}}, {.max_new_tokens = 0}).size(), 2u);
  const ModelConfig bc = parse_config(bert_json(true));
  const Checkpoint bk = bert_checkpoint(bc, DType::F32, 37);
  const Model bert(bc, bk.weights);
  EXPECT_THAT(error_of([&] { bert.generate_batch({{1, 2}}); }), HasSubstr("not a causal language model"));
}

}  // namespace
}  // namespace qkv::models::testing
