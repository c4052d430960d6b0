// parse_config on the config.json of released models (copied field for field from their Hugging
// Face folders): every field the architectures read, and the defaults of those they leave out.
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "qkv/models/config.hpp"

namespace qkv::models {
namespace {

TEST(Config, Gpt2) {
  const ModelConfig c = parse_config(R"({"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"],
    "attn_pdrop": 0.1, "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12,
    "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": null, "summary_first_dropout": 0.1,
    "summary_proj_to_labels": true, "summary_type": "cls_index", "summary_use_proj": true,
    "task_specific_params": {"text-generation": {"do_sample": true, "max_length": 50}}, "vocab_size": 50257})");
  EXPECT_EQ(c.architecture, Architecture::GPT2);
  EXPECT_EQ(c.hidden_size, 768);
  EXPECT_EQ(c.num_layers, 12);
  EXPECT_EQ(c.num_heads, 12);
  EXPECT_EQ(c.num_kv_heads, 12);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.intermediate_size, 3072);  // n_inner absent: 4 * n_embd
  EXPECT_EQ(c.max_positions, 1024);
  EXPECT_EQ(c.vocab_size, 50257);
  EXPECT_EQ(c.activation, Activation::GeluTanh);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{50256});
  EXPECT_DOUBLE_EQ(c.norm_eps, 1e-5);
}

TEST(Config, BertBaseUncased) {
  const ModelConfig c = parse_config(R"({"architectures": ["BertForMaskedLM"], "attention_probs_dropout_prob": 0.1,
    "gradient_checkpointing": false, "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": 768,
    "initializer_range": 0.02, "intermediate_size": 3072, "layer_norm_eps": 1e-12, "max_position_embeddings": 512,
    "model_type": "bert", "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 0,
    "position_embedding_type": "absolute", "transformers_version": "4.6.0.dev0", "type_vocab_size": 2,
    "use_cache": true, "vocab_size": 30522})");
  EXPECT_EQ(c.architecture, Architecture::BertMaskedLM);
  EXPECT_EQ(c.activation, Activation::GeluErf);
  EXPECT_EQ(c.type_vocab_size, 2);
  EXPECT_EQ(c.max_positions, 512);
  EXPECT_DOUBLE_EQ(c.norm_eps, 1e-12);
  EXPECT_FALSE(c.is_causal());
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(parse_config(R"({"model_type": "bert", "vocab_size": 30, "hidden_size": 8, "num_hidden_layers": 1,
    "num_attention_heads": 2, "intermediate_size": 16, "max_position_embeddings": 8})")
                .architecture,
            Architecture::Bert);
}

TEST(Config, TinyLlama) {
  const ModelConfig c = parse_config(R"({"architectures": ["LlamaForCausalLM"], "attention_bias": false,
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 5632, "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 22, "num_key_value_heads": 4, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": null, "rope_theta": 10000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    "transformers_version": "4.35.0", "use_cache": true, "vocab_size": 32000})");
  EXPECT_EQ(c.architecture, Architecture::Llama);
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.rope_scaling.kind, RopeScaling::Kind::None);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_EQ(c.bos_token_id, 1);
}

TEST(Config, Llama32WithLlama3RopeAndAnEosList) {
  const ModelConfig c = parse_config(R"({"architectures": ["LlamaForCausalLM"], "attention_bias": false,
    "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256})");
  EXPECT_EQ(c.rope_scaling.kind, RopeScaling::Kind::Llama3);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 32);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{128001, 128008, 128009}));
  EXPECT_TRUE(c.tie_word_embeddings);
  // Llama 3's frequencies: the highest kept, the lowest divided by the factor.
  const std::vector<double> inv = rope_inverse_frequencies(c.head_dim, c.rope_theta, c.rope_scaling);
  EXPECT_DOUBLE_EQ(inv.front(), 1.0);
  EXPECT_NEAR(inv.back(), std::pow(500000.0, -62.0 / 64) / 32, 1e-15);
}

TEST(Config, MistralSlidingWindow) {
  const ModelConfig c = parse_config(R"({"architectures": ["MistralForCausalLM"], "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    "transformers_version": "4.34.0.dev0", "use_cache": true, "vocab_size": 32000})");
  EXPECT_EQ(c.architecture, Architecture::Mistral);
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_EQ(c.window_of_layer(0), 4096);
  EXPECT_EQ(c.window_of_layer(31), 4096);
}

TEST(Config, Qwen2WithoutItsSlidingWindow) {
  const ModelConfig c = parse_config(R"({"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896,
    "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 32768,
    "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.40.1",
    "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})");
  EXPECT_EQ(c.architecture, Architecture::Qwen2);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_TRUE(c.attention_bias);
  EXPECT_FALSE(c.attention_output_bias);
  EXPECT_EQ(c.window_of_layer(23), 0);  // use_sliding_window false
  EXPECT_TRUE(c.tie_word_embeddings);
}

}  // namespace
}  // namespace qkv::models
