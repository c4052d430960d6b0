// Bad configs, weights and inputs: each a qkv::Error that names the field, tensor or value.
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "checkpoint.hpp"
#include "configs.hpp"
#include "qkv/models/model.hpp"

namespace qkv::models::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// The message of the qkv::Error `f` throws ("" when it throws none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string with(std::string json, const std::string& from, const std::string& to) {
  const size_t at = json.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return json.replace(at, from.size(), to);
}

TEST(ConfigErrors, UnknownArchitectureNamesItAndTheSupportedOnes) {
  EXPECT_THAT(error_of([] { parse_config(with(llama_json(), "LlamaForCausalLM", "GemmaForCausalLM")); }),
              AllOf(HasSubstr("'GemmaForCausalLM'"), HasSubstr("LlamaForCausalLM"), HasSubstr("GPT2LMHeadModel"),
                    HasSubstr("BertForMaskedLM")));
  EXPECT_THAT(error_of([] { parse_config(R"({"model_type": "t5"})"); }), HasSubstr("'t5'"));
  EXPECT_THAT(error_of([] { parse_config("{"); }), HasSubstr("not valid JSON"));
  EXPECT_THAT(error_of([] { parse_config("[1]"); }), HasSubstr("JSON object"));
}

TEST(ConfigErrors, SizesAreBoundedAndDivisible) {
  EXPECT_THAT(
      error_of([] { parse_config(with(llama_json(), R"("num_hidden_layers": 3)", R"("num_hidden_layers": 100000)")); }),
      AllOf(HasSubstr("num_hidden_layers"), HasSubstr("100000")));
  EXPECT_THAT(
      error_of([] { parse_config(with(llama_json(), R"("num_hidden_layers": 3)", R"("num_hidden_layers": 0)")); }),
      HasSubstr("num_hidden_layers"));
  EXPECT_THAT(
      error_of([] { parse_config(with(llama_json(), R"("num_key_value_heads": 2)", R"("num_key_value_heads": 3)")); }),
      AllOf(HasSubstr("num_key_value_heads 3"), HasSubstr("num_attention_heads 4")));
  EXPECT_THAT(error_of([] { parse_config(with(gpt2_json(), R"("n_head": 4)", R"("n_head": 5)")); }),
              AllOf(HasSubstr("5"), HasSubstr("hidden_size 48")));
  EXPECT_THAT(error_of([] { parse_config(with(llama_json(), R"("hidden_size": 40)", R"("hidden_size": 44)")); }),
              HasSubstr("head_dim 11 is odd"));
  EXPECT_THAT(error_of([] { parse_config(with(llama_json(), R"("vocab_size": 67)", R"("vocab_size": "67")")); }),
              AllOf(HasSubstr("vocab_size"), HasSubstr("not an integer")));
  EXPECT_THAT(error_of([] { parse_config(with(llama_json(), R"("intermediate_size": 72,)", "")); }),
              HasSubstr("missing field 'intermediate_size'"));
  EXPECT_THAT(error_of([] { parse_config(with(llama_json(), R"([5, 66])", "[5, 67]")); }), HasSubstr("eos_token_id"));
  EXPECT_THAT(
      error_of([] {
        parse_config(llama_json("LlamaForCausalLM", false, R"(, "rope_scaling": {"type": "yarn", "factor": 2})"));
      }),
      HasSubstr("'yarn'"));
  EXPECT_THAT(error_of([] { parse_config(with(gpt2_json(), "gelu_new", "mish")); }), HasSubstr("'mish'"));
}

TEST(WeightErrors, MissingAndMisshapedTensorsAreNamed) {
  const ModelConfig c = parse_config(llama_json());
  Checkpoint k = llama_checkpoint(c, DType::BF16, 31);
  k.weights->erase("model.layers.2.mlp.up_proj.weight");
  EXPECT_THAT(error_of([&] { Model(c, k.weights); }),
              AllOf(HasSubstr("missing weight 'model.layers.2.mlp.up_proj.weight'"), HasSubstr("(72, 40)"),
                    HasSubstr("memory: tensor")));
  k = llama_checkpoint(c, DType::BF16, 31);
  k.weights->reshape("model.layers.1.self_attn.k_proj.weight", {40, 20});
  EXPECT_THAT(error_of([&] { Model(c, k.weights); }), AllOf(HasSubstr("'model.layers.1.self_attn.k_proj.weight'"),
                                                            HasSubstr("is (40, 20)"), HasSubstr("needs (20, 40)")));
  // An untied model needs its lm_head; a GPT-2 Conv1D weight stored as (out, in) is refused.
  ModelConfig untied = parse_config(llama_json("LlamaForCausalLM", true));
  untied.tie_word_embeddings = false;
  EXPECT_THAT(error_of([&] {
                Model(untied,
                      llama_checkpoint(parse_config(llama_json("LlamaForCausalLM", true)), DType::F32, 3).weights);
              }),
              HasSubstr("missing weight 'lm_head.weight'"));
  const ModelConfig g = parse_config(gpt2_json());
  Checkpoint gk = gpt2_checkpoint(g, DType::F32, 32);
  gk.weights->reshape("transformer.h.0.mlp.c_fc.weight", {192, 48});
  EXPECT_THAT(error_of([&] { Model(g, gk.weights); }),
              AllOf(HasSubstr("transformer.h.0.mlp.c_fc.weight"), HasSubstr("(192, 48)"), HasSubstr("(48, 192)")));
}

TEST(InputErrors, IdsLengthsAndArchitectures) {
  const ModelConfig c = parse_config(gpt2_json());
  const Checkpoint k = gpt2_checkpoint(c, DType::F32, 33);
  const Model model(c, k.weights);
  EXPECT_THAT(error_of([&] { model.forward(std::vector<int64_t>{1, 61}); }), HasSubstr("token id 61"));
  EXPECT_THAT(error_of([&] { model.forward(std::vector<int64_t>{}); }), HasSubstr("empty"));
  EXPECT_THAT(error_of([&] { model.forward(std::vector<int64_t>(33, 1)); }), HasSubstr("max_position_embeddings 32"));
  EXPECT_THAT(error_of([&] { model.generate({1, 2}, {.max_new_tokens = 40}); }), HasSubstr("max_new_tokens 40"));
  EXPECT_THAT(error_of([&] { model.forward(ModelInput{.ids = {{1}}, .token_type_ids = {{0}}}); }),
              HasSubstr("no token types"));
  ModelConfig wide = c;  // 2 layers x 4 heads x 32768^2 weights: refused before anything runs
  wide.max_positions = 1 << 15;
  const Checkpoint wk = gpt2_checkpoint(wide, DType::BF16, 35);
  EXPECT_THAT(error_of([&] { Model(wide, wk.weights).forward(std::vector<int64_t>(1 << 15, 1), true); }),
              HasSubstr("more than 2^31 floats"));
  const ModelConfig b = parse_config(bert_json(true));
  const Model bert(b, bert_checkpoint(b, DType::F32, 34).weights);
  EXPECT_THAT(error_of([&] { bert.generate({1, 2}); }), HasSubstr("not a causal language model"));
  EXPECT_THAT(error_of([&] {
                bert.forward(ModelInput{.ids = {{1, 2}}, .token_type_ids = {{0, 2}}});
              }),
              HasSubstr("token type 2"));
}

}  // namespace
}  // namespace qkv::models::testing
