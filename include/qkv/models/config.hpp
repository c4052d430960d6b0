// qkv::models::ModelConfig: a Hugging Face config.json, parsed and checked. Every size is bounded
// and every divisibility the architectures rely on is checked here, once, so the model code
// (src/models/) trusts the config it is given.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace qkv::models {

enum class Architecture {
  GPT2,          // GPT2LMHeadModel: learned positions, pre-LN, GELU-tanh MLP, Conv1D (in, out) weights
  Bert,          // BertModel: post-LN encoder, bidirectional; returns the last hidden state
  BertMaskedLM,  // BertForMaskedLM: the same plus the cls.predictions head (logits over the vocabulary)
  Llama,         // LlamaForCausalLM: RMSNorm, RoPE, SwiGLU, grouped-query attention
  Mistral,       // MistralForCausalLM: Llama with a sliding window
  Qwen2,         // Qwen2ForCausalLM: Llama with q/k/v biases (and an optional sliding window)
};
std::string_view to_string(Architecture architecture);  // the Hugging Face class name
// "GPT2LMHeadModel, BertModel, BertForMaskedLM, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"
std::string supported_architectures();

enum class Activation {
  GeluTanh,  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): gelu_new, gelu_pytorch_tanh
  GeluErf,   // 0.5 x (1 + erf(x / sqrt 2)): gelu
  Silu,      // x / (1 + exp(-x)): silu, swish
  Relu,
};

// rope_scaling: how the rotary inverse frequencies theta_i = rope_theta^(-2i / head_dim) change.
struct RopeScaling {
  enum class Kind {
    None,    // theta_i as they are
    Linear,  // theta_i / factor (position interpolation)
    Llama3,  // Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth ramp between
  };
  Kind kind = Kind::None;
  double factor = 1;
  double low_freq_factor = 1;                       // Llama3
  double high_freq_factor = 4;                      // Llama3
  int64_t original_max_position_embeddings = 8192;  // Llama3
};

// The rotary inverse frequencies (head_dim / 2 of them) of rope_theta under `scaling`, in double,
// as Hugging Face's _compute_default_rope_parameters / _compute_linear_scaling_rope_parameters /
// _compute_llama3_parameters define them.
std::vector<double> rope_inverse_frequencies(int64_t head_dim, double rope_theta, const RopeScaling& scaling);

struct ModelConfig {
  Architecture architecture = Architecture::Llama;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;       // num_heads without grouped-query attention
  int64_t head_dim = 0;           // hidden_size / num_heads unless config.json gives it
  int64_t intermediate_size = 0;  // the MLP's inner width
  int64_t max_positions = 0;      // max_position_embeddings / n_positions
  int64_t type_vocab_size = 0;    // BERT's token types; 0 elsewhere
  double norm_eps = 1e-5;         // layer_norm_epsilon / layer_norm_eps / rms_norm_eps
  Activation activation = Activation::Silu;
  double rope_theta = 10000;  // Llama family
  RopeScaling rope_scaling;   // Llama family
  // Llama family: > 0 when a layer's queries see only their last `sliding_window` positions (their
  // own included), in the layers [sliding_window_from_layer, num_layers) (Mistral: from 0; Qwen2:
  // from max_window_layers, and only with use_sliding_window).
  int64_t sliding_window = 0;
  int64_t sliding_window_from_layer = 0;
  bool tie_word_embeddings = false;    // lm head = token embedding (GPT-2 and BERT's decoder: true)
  bool attention_bias = false;         // biases on q, k, v (Qwen2: always; Llama: attention_bias)
  bool attention_output_bias = false;  // bias on o_proj (Llama: attention_bias)
  bool mlp_bias = false;               // Llama: mlp_bias
  std::vector<int64_t> eos_token_ids;  // eos_token_id (an id or a list); may be empty
  int64_t bos_token_id = -1;           // -1: none given

  bool is_causal() const { return architecture != Architecture::Bert && architecture != Architecture::BertMaskedLM; }
  bool has_lm_head() const { return architecture != Architecture::Bert; }
  bool is_llama_family() const {
    return architecture == Architecture::Llama || architecture == Architecture::Mistral ||
           architecture == Architecture::Qwen2;
  }
  // The sliding window of layer `layer` (0: full causal attention).
  int64_t window_of_layer(int64_t layer) const {
    return sliding_window > 0 && layer >= sliding_window_from_layer ? sliding_window : 0;
  }
};

// Upper bounds of a config's sizes: far above any released model of these architectures, low
// enough that nothing derived from them (products of two, buffers of positions x hidden) overflows.
struct ConfigLimits {
  static constexpr int64_t kMaxLayers = 1024;
  static constexpr int64_t kMaxHidden = 1 << 16;
  static constexpr int64_t kMaxHeads = 1024;
  static constexpr int64_t kMaxHeadDim = 1024;
  static constexpr int64_t kMaxIntermediate = 1 << 18;
  static constexpr int64_t kMaxVocab = 1 << 22;
  static constexpr int64_t kMaxPositions = 1 << 21;
  static constexpr int64_t kMaxTypeVocab = 1 << 10;
};

// Parses config.json's text (`source` names it in error messages). The architecture comes from
// architectures[0], else model_type ("gpt2" -> GPT2, "bert" -> BertModel, "llama", "mistral",
// "qwen2"). Throws qkv::Error naming the field and its value: unknown architecture (listing the
// supported ones), a missing or mistyped field, a size out of ConfigLimits, heads not dividing
// hidden_size (unless head_dim is given), kv heads not dividing heads, an odd rotary head_dim, an
// unsupported activation or rope_scaling type.
ModelConfig parse_config(std::string_view json_text, std::string_view source = "config.json");

// Checks a config built by hand (tests, front ends) as parse_config checks a parsed one.
void check_config(const ModelConfig& config, std::string_view source = "config");

}  // namespace qkv::models
