// Each architecture against its float64 oracle (oracles.hpp) on small random checkpoints: logits,
// hidden states and per-layer attention weights, with f32 and 16-bit stored weights (the oracle
// reads the very values stored, so the tolerance is float32 arithmetic's either way).
#include <algorithm>
#include <cmath>
#include <thread>

#include <gtest/gtest.h>

#include "checkpoint.hpp"
#include "compare.hpp"
#include "gemm/bf16_dot.hpp"
#include "harness/kernel_cases.hpp"
#include "configs.hpp"
#include "oracles.hpp"
#include "qkv/error.hpp"
#include "models/linear_any.hpp"
#include "qkv/models/model.hpp"

namespace qkv::models::testing {
namespace {

constexpr double kTolerance = 1e-4;
// The bf16 bound: prompts of more than kMaxRowsInPlace tokens on a bf16 checkpoint take the
// bfloat16 dot products where the CPU has them (gemm/bf16_dot.hpp), which round each linear
// layer's input to bfloat16: 2^-9 of every term, as torch's bf16 Linear. Through 2-3 layers of
// random weights the logits moved by up to 3.4e-3 of the largest (measured); 1e-2 leaves room.
constexpr double kBf16Bound = 1e-2;
const std::vector<int64_t> kIds = {3, 17, 0, 42, 8, 8, 29, 51, 1};

// Model::query_keys: each layer's softmax(scale * q . k) under the architecture's mask (causal,
// a sliding window, or both ways) is the attention forward() returns, head by head (GQA: query
// head h reads key head h / (H / Hkv)).
void expect_query_keys_give_the_weights(const Model& model, const ModelOutput& got, const std::string& what) {
  const ModelConfig& c = model.config();
  const auto n = static_cast<int64_t>(kIds.size());
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const QueryKeys qk = model.query_keys(kIds, l);
    ASSERT_EQ(qk.queries.shape(), (Shape{c.num_heads, n, c.head_dim})) << what;
    ASSERT_EQ(qk.keys.shape(), (Shape{c.num_kv_heads, n, c.head_dim})) << what;
    EXPECT_DOUBLE_EQ(qk.scale, 1 / std::sqrt(static_cast<double>(c.head_dim)));
    const Tensor q = qk.queries.contiguous(), k = qk.keys.contiguous(), w = got.attention[static_cast<size_t>(l)].contiguous();
    const int64_t window = c.is_causal() ? c.window_of_layer(l) : 0;
    for (int64_t h = 0; h < c.num_heads; ++h) {
      const int64_t kh = h / (c.num_heads / c.num_kv_heads);
      for (int64_t i = 0; i < n; ++i) {
        std::vector<double> e(static_cast<size_t>(n), 0.0);
        double top = -INFINITY, sum = 0;
        const auto seen = [&](int64_t j) { return !c.is_causal() || (j <= i && (window == 0 || j > i - window)); };
        for (int64_t j = 0; j < n; ++j) {
          if (!seen(j)) continue;
          double dot = 0;
          for (int64_t d = 0; d < c.head_dim; ++d)
            dot += double(q.data()[(h * n + i) * c.head_dim + d]) * k.data()[(kh * n + j) * c.head_dim + d];
          e[static_cast<size_t>(j)] = dot * qk.scale;
          top = std::max(top, e[static_cast<size_t>(j)]);
        }
        for (int64_t j = 0; j < n; ++j) sum += e[static_cast<size_t>(j)] = seen(j) ? std::exp(e[static_cast<size_t>(j)] - top) : 0;
        for (int64_t j = 0; j < n; ++j)
          ASSERT_NEAR(e[static_cast<size_t>(j)] / sum, w.data()[((h * n) + i) * n + j], 1e-5)
              << what << " layer " << l << " head " << h << " query " << i << " key " << j;
      }
    }
  }
  EXPECT_THROW((void)model.query_keys(kIds, c.num_layers), Error);
}

// The forward with weights (the Reference kernel) and without (a fused kernel) against the oracle.
void expect_matches(const Model& model, const OracleOutput& want, const std::string& what) {
  const ModelOutput fast = model.forward(kIds);
  EXPECT_TRUE(fast.attention.empty());
  expect_rows_close(fast.hidden, 0, want.hidden, kTolerance, what + " hidden, no weights");
  const ModelOutput got = model.forward(kIds, true);
  expect_rows_close(got.hidden, 0, want.hidden, kTolerance, what + " hidden");
  if (!want.logits.empty()) expect_rows_close(got.logits, 0, want.logits, kTolerance, what + " logits");
  ASSERT_EQ(got.attention.size(), want.attention.size()) << what;
  for (size_t l = 0; l < want.attention.size(); ++l)
    expect_attention_close(got.attention[l], 0, want.attention[l], kTolerance, what + " layer " + std::to_string(l));
  expect_query_keys_give_the_weights(model, got, what);
}

class Gpt2 : public ::testing::TestWithParam<DType> {};

TEST_P(Gpt2, MatchesOracleTied) {
  const ModelConfig c = parse_config(gpt2_json());
  const Checkpoint k = gpt2_checkpoint(c, GetParam(), 11);
  const Model model(c, k.weights);
  expect_matches(model, gpt2_oracle(c, k, kIds), "gpt2");
}

TEST_P(Gpt2, MatchesOracleUntiedWithoutPrefix) {
  const ModelConfig c = parse_config(gpt2_json(false));
  const Checkpoint k = gpt2_checkpoint(c, GetParam(), 12, "");
  const Model model(c, k.weights);
  expect_matches(model, gpt2_oracle(c, k, kIds, ""), "gpt2 untied");
}

INSTANTIATE_TEST_SUITE_P(StoredDtypes, Gpt2, ::testing::Values(DType::F32, DType::BF16, DType::F16));

TEST(Bert, QueryKeysGiveTheWeightsBothWays) {
  const ModelConfig c = parse_config(bert_json(true));
  const Checkpoint k = bert_checkpoint(c, DType::F32, 19);
  const Model model(c, k.weights);
  expect_query_keys_give_the_weights(model, model.forward(kIds, true), "bert");
}

TEST(Bert, MaskedLmMatchesOracleOnAPaddedBatch) {
  const ModelConfig c = parse_config(bert_json(true));
  const Checkpoint k = bert_checkpoint(c, DType::BF16, 13);
  const Model model(c, k.weights);
  const ModelInput input{.ids = {{2, 7, 30, 4, 11, 9, 1}, {5, 6, 40, 3}},
                         .token_type_ids = {{0, 0, 0, 1, 1, 1, 1}, {0, 1, 1, 1}}};
  const ModelOutput got = model.forward(input, true);
  ASSERT_EQ(got.logits.shape(), (Shape{2, 7, 53}));
  for (int64_t b = 0; b < 2; ++b) {
    const OracleOutput want = bert_oracle(c, k, input.ids[b], input.token_type_ids[b]);
    const std::string what = "bert element " + std::to_string(b);
    expect_rows_close(got.logits, b, want.logits, kTolerance, what + " logits");
    expect_rows_close(got.hidden, b, want.hidden, kTolerance, what + " hidden");
    for (size_t l = 0; l < want.attention.size(); ++l)
      expect_attention_close(got.attention[l], b, want.attention[l], kTolerance, what + " layer " + std::to_string(l));
  }
  // The padded keys of element 1 get no weight; its padded queries' rows are zero.
  for (int64_t h = 0; h < 3; ++h)
    for (int64_t i = 0; i < 7; ++i)
      for (int64_t j = 4; j < 7; ++j) EXPECT_EQ(got.attention[0].at({1, h, i, j}), 0.0f);
  EXPECT_EQ(got.attention[1].at({1, 0, 5, 0}), 0.0f);
}

TEST(Bert, ReadsTensorFlowLayerNormNamesAndTheDecoderBias) {
  const ModelConfig c = parse_config(bert_json(true));
  Checkpoint k = bert_checkpoint(c, DType::F32, 17);
  // The same checkpoint with every LayerNorm's weight/bias renamed gamma/beta, the MLM bias the
  // decoder's.
  Checkpoint renamed;
  for (const auto& [name, values] : k.values) {
    std::string n = name;
    if (n.find("LayerNorm.weight") != std::string::npos) n.replace(n.size() - 6, 6, "gamma");
    if (n.find("LayerNorm.bias") != std::string::npos) n.replace(n.size() - 4, 4, "beta");
    if (n == "cls.predictions.bias") n = "cls.predictions.decoder.bias";
    renamed.weights->add(n, values.shape, std::vector<float>(values.data.begin(), values.data.end()), DType::F32);
  }
  const std::vector<int64_t> ids = {4, 8, 15, 16, 23, 42};
  expect_rows_close(Model(c, renamed.weights).forward(ids).logits, 0, bert_oracle(c, k, ids, {}).logits, kTolerance,
                    "gamma/beta names");
}

TEST(Bert, BaseModelReturnsTheLastHiddenState) {
  const ModelConfig c = parse_config(bert_json(false));
  const Checkpoint k = bert_checkpoint(c, DType::F32, 14);
  const Model model(c, k.weights);
  const std::vector<int64_t> ids = {4, 8, 15, 16, 23, 42};
  const ModelOutput got = model.forward(ids);
  EXPECT_FALSE(got.logits.defined());
  expect_rows_close(got.hidden, 0, bert_oracle(c, k, ids, {}).hidden, kTolerance, "bert hidden");
}

struct LlamaCase {
  std::string name, architecture;
  bool tied;
  std::string extra;
  DType dtype;
};

void PrintTo(const LlamaCase& c, std::ostream* os) { *os << c.name; }

class Llama : public ::testing::TestWithParam<LlamaCase> {};

TEST_P(Llama, MatchesOracle) {
  const LlamaCase& p = GetParam();
  const ModelConfig c = parse_config(llama_json(p.architecture, p.tied, p.extra));
  const Checkpoint k = llama_checkpoint(c, p.dtype, 15);
  const Model model(c, k.weights);
  expect_matches(model, llama_oracle(c, k, kIds), p.name);
}

INSTANTIATE_TEST_SUITE_P(
    Family, Llama,
    ::testing::Values(LlamaCase{"LlamaUntiedF32", "LlamaForCausalLM", false, "", DType::F32},
                      LlamaCase{"LlamaTiedBf16", "LlamaForCausalLM", true, "", DType::BF16},
                      LlamaCase{"LlamaBiasesF16", "LlamaForCausalLM", false,
                                R"(, "attention_bias": true, "mlp_bias": true)", DType::F16},
                      LlamaCase{"RopeLinear", "LlamaForCausalLM", false,
                                R"(, "rope_scaling": {"type": "linear", "factor": 4.0})", DType::F32},
                      LlamaCase{"RopeLlama3", "LlamaForCausalLM", true,
                                R"(, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                     "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64})",
                                DType::BF16},
                      LlamaCase{"MistralWindow3", "MistralForCausalLM", false, R"(, "sliding_window": 3)", DType::F32},
                      LlamaCase{"Qwen2Biases", "Qwen2ForCausalLM", true, "", DType::BF16},
                      LlamaCase{"Qwen2WindowFromLayer1", "Qwen2ForCausalLM", false,
                                R"(, "use_sliding_window": true, "sliding_window": 4, "max_window_layers": 1)",
                                DType::F32}),
    [](const auto& info) { return info.param.name; });

TEST(Llama, RopeScalingChangesTheFrequenciesAsHuggingFaceDoes) {
  for (const char* extra : {R"(, "rope_scaling": {"type": "linear", "factor": 4.0})",
                            R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64})"}) {
    const ModelConfig c = parse_config(llama_json("LlamaForCausalLM", false, extra));
    const std::vector<double> got = rope_inverse_frequencies(c.head_dim, c.rope_theta, c.rope_scaling);
    const std::vector<double> want = hf_inverse_frequencies(c);
    ModelConfig plain = c;
    plain.rope_scaling = {};
    const std::vector<double> unscaled = hf_inverse_frequencies(plain);
    ASSERT_EQ(got.size(), want.size());
    int changed = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_NEAR(got[i], want[i], 1e-12 * unscaled[i]) << extra << " frequency " << i;
      changed += got[i] != unscaled[i];
    }
    EXPECT_GE(changed, 2) << extra;  // the scaling does something on this head_dim
  }
}

TEST(Llama, RaggedBatchEqualsEachSequenceAlone) {
  const ModelConfig c = parse_config(llama_json("MistralForCausalLM", false, R"(, "sliding_window": 4)"));
  const Checkpoint k = llama_checkpoint(c, DType::BF16, 16);
  const Model model(c, k.weights);
  const ModelInput input{.ids = {{1, 2, 3, 4, 5, 6, 7}, {9, 10, 11, 12}}, .token_type_ids = {}};
  const ModelOutput batch = model.forward(input);
  for (int64_t b = 0; b < 2; ++b)
    expect_rows_close(batch.logits, b, llama_oracle(c, k, input.ids[b]).logits, kTolerance,
                      "element " + std::to_string(b));
}

// A prompt longer than kMaxRowsInPlace on bf16 weights: within the bf16 bound of the oracle with
// the bfloat16 dot products, within float32's tolerance with them switched off (the fallback).
TEST(Bf16Prefill, LongPromptsStayWithinTheBf16Bound) {
  const ModelConfig gpt2 = parse_config(gpt2_json()), llama = parse_config(llama_json("LlamaForCausalLM", true, ""));
  const Checkpoint gpt2_k = gpt2_checkpoint(gpt2, DType::BF16, 21), llama_k = llama_checkpoint(llama, DType::BF16, 22);
  const Model gpt2_model(gpt2, gpt2_k.weights), llama_model(llama, llama_k.weights);
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < 31; ++i) ids.push_back((i * 37 + 5) % 61);
  ASSERT_GT(static_cast<int64_t>(ids.size()), models::detail::kMaxRowsInPlace);
  const OracleOutput gpt2_want = gpt2_oracle(gpt2, gpt2_k, ids), llama_want = llama_oracle(llama, llama_k, ids);
  for (bool dots : {true, false}) {
    qkv::detail::set_bf16_dot_gemm_for_test(dots);
    const double bound = dots && qkv::detail::bf16_dot_gemm_available() ? kBf16Bound : kTolerance;
    const std::string what = dots ? " (dot products on)" : " (off)";
    expect_rows_close(gpt2_model.forward(ids).logits, 0, gpt2_want.logits, bound, "gpt2" + what);
    expect_rows_close(llama_model.forward(ids).logits, 0, llama_want.logits, bound, "llama" + what);
  }
  qkv::detail::set_bf16_dot_gemm_for_test(true);
}

// forward() only reads the model: two threads at once get what one thread gets alone.
TEST(Llama, ConcurrentForwardsAgree) {
  const ModelConfig c = parse_config(llama_json("Qwen2ForCausalLM"));
  const Checkpoint k = llama_checkpoint(c, DType::BF16, 18);
  const Model model(c, k.weights);
  const std::vector<int64_t> a = {1, 2, 3, 4, 5, 6, 7, 8}, b = {9, 8, 7};
  const std::vector<float> alone_a = model.forward(a).logits.to_vector(), alone_b = model.forward(b).logits.to_vector();
  std::vector<float> together_a, together_b;
  std::thread other([&] {
    for (int i = 0; i < 20; ++i) together_b = model.forward(b).logits.to_vector();
  });
  for (int i = 0; i < 20; ++i) together_a = model.forward(a).logits.to_vector();
  other.join();
  // Equal up to the order of float sums, which a kernel may split by the threads it gets.
  for (const auto& [got, want] : {std::pair{&together_a, &alone_a}, std::pair{&together_b, &alone_b}}) {
    ASSERT_EQ(got->size(), want->size());
    for (size_t i = 0; i < want->size(); ++i) EXPECT_NEAR((*got)[i], (*want)[i], 1e-5 * (1 + std::abs((*want)[i])));
  }
}

// A prefill's token ops (norms, activations, bias and residual adds) run in runs of rows on every
// thread when the work pays for a parallel region (models/token_ops.hpp); these small models never
// would, so here every problem is threaded, and each architecture still matches its oracle.
TEST(Architectures, TokenOpsOnEveryThreadMatchTheOracles) {
  const qkv_test::ThreadEveryProblem threaded;
  const ModelConfig gpt2 = parse_config(gpt2_json()), bert = parse_config(bert_json(true)),
                    llama = parse_config(llama_json("LlamaForCausalLM", false, ""));
  const Checkpoint gpt2_k = gpt2_checkpoint(gpt2, DType::F32, 23), bert_k = bert_checkpoint(bert, DType::F32, 24),
                   llama_k = llama_checkpoint(llama, DType::F32, 25);
  expect_matches(Model(gpt2, gpt2_k.weights), gpt2_oracle(gpt2, gpt2_k, kIds), "gpt2, threaded");
  const OracleOutput bert_want = bert_oracle(bert, bert_k, kIds, std::vector<int64_t>(kIds.size(), 0));
  const ModelOutput bert_got = Model(bert, bert_k.weights).forward(kIds);
  expect_rows_close(bert_got.logits, 0, bert_want.logits, kTolerance, "bert, threaded");
  expect_matches(Model(llama, llama_k.weights), llama_oracle(llama, llama_k, kIds), "llama, threaded");
}

}  // namespace
}  // namespace qkv::models::testing
