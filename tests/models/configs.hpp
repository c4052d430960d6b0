// The small configs of the architecture tests, as config.json text (so every test also goes
// through parse_config): odd sizes, grouped-query attention, tied and untied heads.
#pragma once

#include <string>

#include "qkv/models/config.hpp"

namespace qkv::models::testing {

inline std::string gpt2_json(bool tied = true) {
  return R"({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 61, "n_embd": 48,
    "n_layer": 2, "n_head": 4, "n_positions": 32, "n_inner": null, "layer_norm_epsilon": 1e-5,
    "activation_function": "gelu_new", "tie_word_embeddings": )" +
         std::string(tied ? "true" : "false") + R"(, "eos_token_id": 60, "bos_token_id": 60})";
}

inline std::string bert_json(bool masked_lm) {
  return R"({"architectures": [")" + std::string(masked_lm ? "BertForMaskedLM" : "BertModel") +
         R"("], "model_type": "bert", "vocab_size": 53, "hidden_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 3, "intermediate_size": 80, "hidden_act": "gelu", "max_position_embeddings": 24,
    "type_vocab_size": 2, "layer_norm_eps": 1e-12, "position_embedding_type": "absolute"})";
}

// Llama-family configs: `extra` adds fields (rope_scaling, sliding_window, ...) to the object.
inline std::string llama_json(const std::string& architecture = "LlamaForCausalLM", bool tied = false,
                              const std::string& extra = "") {
  return R"({"architectures": [")" + architecture + R"("], "vocab_size": 67, "hidden_size": 40,
    "intermediate_size": 72, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 48, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
    "tie_word_embeddings": )" +
         std::string(tied ? "true" : "false") + R"(, "eos_token_id": [5, 66])" + extra + "}";
}

}  // namespace qkv::models::testing
