// qkv::models::parse_config (include/qkv/models/config.hpp): config.json -> a checked ModelConfig.
// Field names and defaults follow the Hugging Face configuration classes of each architecture
// (GPT2Config, BertConfig, LlamaConfig, MistralConfig, Qwen2Config).
#include <cmath>
#include <numbers>
#include <string>

#include <nlohmann/json.hpp>

#include "qkv/error.hpp"
#include "qkv/models/config.hpp"

namespace qkv::models {

namespace {

using Json = nlohmann::json;

std::string str(int64_t n) { return std::to_string(n); }

// Reads the fields of one config object, with the source's name in every message.
class Fields {
 public:
  Fields(const Json& json, std::string_view source) : json_(json), source_(source) {}

  [[noreturn]] void fail(const std::string& what) const { throw Error(source_ + ": " + what); }

  bool has(const char* key) const { return json_.contains(key) && !json_.at(key).is_null(); }

  // The first of `keys` present: an integer in [low, high].
  int64_t integer(std::initializer_list<const char*> keys, int64_t low, int64_t high) const {
    for (const char* key : keys)
      if (has(key)) return integer_at(key, low, high);
    fail("missing field '" + std::string(*keys.begin()) + "'");
  }
  int64_t integer_or(const char* key, int64_t fallback, int64_t low, int64_t high) const {
    return has(key) ? integer_at(key, low, high) : fallback;
  }
  double number_or(std::initializer_list<const char*> keys, double fallback) const {
    for (const char* key : keys)
      if (has(key)) {
        const Json& v = json_.at(key);
        if (!v.is_number() || !std::isfinite(v.get<double>()))
          fail("field '" + std::string(key) + "' is " + v.dump() + ", not a finite number");
        return v.get<double>();
      }
    return fallback;
  }
  bool boolean_or(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!json_.at(key).is_boolean())
      fail("field '" + std::string(key) + "' is " + json_.at(key).dump() + ", not a boolean");
    return json_.at(key).get<bool>();
  }
  std::string text_or(const char* key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    if (!json_.at(key).is_string())
      fail("field '" + std::string(key) + "' is " + json_.at(key).dump() + ", not a string");
    return json_.at(key).get<std::string>();
  }
  // An id or a list of ids (eos_token_id), each in [0, high]; empty when absent.
  std::vector<int64_t> ids(const char* key, int64_t high) const {
    if (!has(key)) return {};
    const Json& v = json_.at(key);
    std::vector<int64_t> out;
    for (const Json& item : v.is_array() ? v : Json::array({v})) {
      if (!item.is_number_integer() || item.get<int64_t>() < 0 || item.get<int64_t>() > high)
        fail("field '" + std::string(key) + "' is " + v.dump() + ": ids must be integers in [0, " + str(high) + "]");
      out.push_back(item.get<int64_t>());
    }
    return out;
  }
  const Json& json() const { return json_; }
  const std::string& source() const { return source_; }

 private:
  int64_t integer_at(const char* key, int64_t low, int64_t high) const {
    const Json& v = json_.at(key);
    if (!v.is_number_integer()) fail("field '" + std::string(key) + "' is " + v.dump() + ", not an integer");
    const int64_t n = v.get<int64_t>();
    if (n < low || n > high)
      fail("field '" + std::string(key) + "' is " + str(n) + ", outside [" + str(low) + ", " + str(high) + "]");
    return n;
  }

  const Json& json_;
  std::string source_;
};

using L = ConfigLimits;

Architecture architecture_of(const Fields& f) {
  std::string name;
  if (f.has("architectures")) {
    const Json& list = f.json().at("architectures");
    if (!list.is_array() || list.empty() || !list[0].is_string())
      f.fail("field 'architectures' is " + list.dump() + ", not a list of class names");
    name = list[0].get<std::string>();
    for (Architecture a : {Architecture::GPT2, Architecture::Bert, Architecture::BertMaskedLM, Architecture::Llama,
                           Architecture::Mistral, Architecture::Qwen2})
      if (name == to_string(a)) return a;
  } else {
    name = f.text_or("model_type", "");
    if (name == "gpt2") return Architecture::GPT2;
    if (name == "bert") return Architecture::Bert;
    if (name == "llama") return Architecture::Llama;
    if (name == "mistral") return Architecture::Mistral;
    if (name == "qwen2") return Architecture::Qwen2;
    if (name.empty())
      f.fail("neither 'architectures' nor 'model_type' names the architecture; supported: " +
             supported_architectures());
  }
  f.fail("architecture '" + name + "' is not supported; supported: " + supported_architectures());
}

Activation activation_from(const Fields& f, const char* key, const std::string& fallback) {
  const std::string name = f.text_or(key, fallback);
  if (name == "gelu_new" || name == "gelu_pytorch_tanh" || name == "gelu_fast") return Activation::GeluTanh;
  if (name == "gelu") return Activation::GeluErf;
  if (name == "silu" || name == "swish") return Activation::Silu;
  if (name == "relu") return Activation::Relu;
  f.fail("field '" + std::string(key) + "' is '" + name +
         "'; supported: gelu_new, gelu_pytorch_tanh, gelu, silu, relu");
}

void parse_gpt2(const Fields& f, ModelConfig& c) {
  c.vocab_size = f.integer({"vocab_size"}, 1, L::kMaxVocab);
  c.hidden_size = f.integer({"n_embd", "hidden_size"}, 1, L::kMaxHidden);
  c.num_layers = f.integer({"n_layer", "num_hidden_layers"}, 1, L::kMaxLayers);
  c.num_heads = f.integer({"n_head", "num_attention_heads"}, 1, L::kMaxHeads);
  c.num_kv_heads = c.num_heads;
  c.max_positions = f.integer({"n_positions", "n_ctx", "max_position_embeddings"}, 1, L::kMaxPositions);
  c.intermediate_size = f.integer_or("n_inner", 4 * c.hidden_size, 1, L::kMaxIntermediate);
  c.norm_eps = f.number_or({"layer_norm_epsilon"}, 1e-5);
  c.activation = activation_from(f, "activation_function", "gelu_new");
  c.tie_word_embeddings = f.boolean_or("tie_word_embeddings", true);
  c.attention_bias = c.attention_output_bias = c.mlp_bias = true;
  if (f.boolean_or("scale_attn_by_inverse_layer_idx", false) || f.boolean_or("reorder_and_upcast_attn", false))
    f.fail("scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported");
}

void parse_bert(const Fields& f, ModelConfig& c) {
  c.vocab_size = f.integer({"vocab_size"}, 1, L::kMaxVocab);
  c.hidden_size = f.integer({"hidden_size"}, 1, L::kMaxHidden);
  c.num_layers = f.integer({"num_hidden_layers"}, 1, L::kMaxLayers);
  c.num_heads = f.integer({"num_attention_heads"}, 1, L::kMaxHeads);
  c.num_kv_heads = c.num_heads;
  c.intermediate_size = f.integer({"intermediate_size"}, 1, L::kMaxIntermediate);
  c.max_positions = f.integer({"max_position_embeddings"}, 1, L::kMaxPositions);
  c.type_vocab_size = f.integer_or("type_vocab_size", 2, 1, L::kMaxTypeVocab);
  c.norm_eps = f.number_or({"layer_norm_eps"}, 1e-12);
  c.activation = activation_from(f, "hidden_act", "gelu");
  c.tie_word_embeddings = f.boolean_or("tie_word_embeddings", true);
  c.attention_bias = c.attention_output_bias = c.mlp_bias = true;
  const std::string positions = f.text_or("position_embedding_type", "absolute");
  if (positions != "absolute") f.fail("position_embedding_type '" + positions + "' is not supported (absolute only)");
}

RopeScaling rope_scaling_from(const Fields& f) {
  RopeScaling s;
  if (!f.has("rope_scaling")) return s;
  const Json& r = f.json().at("rope_scaling");
  if (!r.is_object()) f.fail("field 'rope_scaling' is " + r.dump() + ", not an object");
  const Fields g(r, f.source() + ": rope_scaling");
  const std::string type = g.text_or("rope_type", g.text_or("type", "default"));
  if (type == "default") return s;
  s.factor = g.number_or({"factor"}, 1);
  if (!(s.factor >= 1) || s.factor > 1e6) g.fail("factor is " + std::to_string(s.factor) + ", outside [1, 1e6]");
  if (type == "linear") {
    s.kind = RopeScaling::Kind::Linear;
  } else if (type == "llama3") {
    s.kind = RopeScaling::Kind::Llama3;
    s.low_freq_factor = g.number_or({"low_freq_factor"}, 1);
    s.high_freq_factor = g.number_or({"high_freq_factor"}, 4);
    s.original_max_position_embeddings = g.integer({"original_max_position_embeddings"}, 1, L::kMaxPositions);
    if (!(s.low_freq_factor > 0) || !(s.high_freq_factor > s.low_freq_factor))
      g.fail("needs 0 < low_freq_factor < high_freq_factor, got " + std::to_string(s.low_freq_factor) + " and " +
             std::to_string(s.high_freq_factor));
  } else {
    g.fail("type '" + type + "' is not supported (default, linear, llama3)");
  }
  return s;
}

void parse_llama(const Fields& f, ModelConfig& c) {
  c.vocab_size = f.integer({"vocab_size"}, 1, L::kMaxVocab);
  c.hidden_size = f.integer({"hidden_size"}, 1, L::kMaxHidden);
  c.num_layers = f.integer({"num_hidden_layers"}, 1, L::kMaxLayers);
  c.num_heads = f.integer({"num_attention_heads"}, 1, L::kMaxHeads);
  c.num_kv_heads = f.integer_or("num_key_value_heads", c.num_heads, 1, L::kMaxHeads);
  c.head_dim = f.integer_or("head_dim", 0, 1, L::kMaxHeadDim);
  c.intermediate_size = f.integer({"intermediate_size"}, 1, L::kMaxIntermediate);
  c.max_positions = f.integer({"max_position_embeddings"}, 1, L::kMaxPositions);
  c.norm_eps = f.number_or({"rms_norm_eps"}, 1e-6);
  c.activation = activation_from(f, "hidden_act", "silu");
  c.rope_theta = f.number_or({"rope_theta"}, 10000);
  c.rope_scaling = rope_scaling_from(f);
  c.tie_word_embeddings = f.boolean_or("tie_word_embeddings", false);
  if (c.architecture == Architecture::Qwen2) {
    c.attention_bias = true;
    if (f.boolean_or("use_sliding_window", false)) {
      c.sliding_window = f.integer_or("sliding_window", 0, 1, L::kMaxPositions);
      c.sliding_window_from_layer = f.integer_or("max_window_layers", 0, 0, L::kMaxLayers);
    }
  } else {
    c.attention_bias = c.attention_output_bias = f.boolean_or("attention_bias", false);
    c.mlp_bias = f.boolean_or("mlp_bias", false);
    if (c.architecture == Architecture::Mistral)
      c.sliding_window = f.integer_or("sliding_window", 0, 1, L::kMaxPositions);
  }
}

void check_at_most(const std::string& who, const char* name, int64_t value, int64_t low, int64_t high) {
  if (value < low || value > high)
    throw Error(who + name + " is " + str(value) + ", outside [" + str(low) + ", " + str(high) + "]");
}

}  // namespace

std::string_view to_string(Architecture architecture) {
  switch (architecture) {
    case Architecture::GPT2: return "GPT2LMHeadModel";
    case Architecture::Bert: return "BertModel";
    case Architecture::BertMaskedLM: return "BertForMaskedLM";
    case Architecture::Llama: return "LlamaForCausalLM";
    case Architecture::Mistral: return "MistralForCausalLM";
    case Architecture::Qwen2: return "Qwen2ForCausalLM";
  }
  return "?";
}

std::string supported_architectures() {
  return "GPT2LMHeadModel, BertModel, BertForMaskedLM, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM";
}

std::vector<double> rope_inverse_frequencies(int64_t head_dim, double rope_theta, const RopeScaling& scaling) {
  std::vector<double> inv(static_cast<size_t>(head_dim / 2));
  for (size_t i = 0; i < inv.size(); ++i)
    inv[i] = std::pow(rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
  if (scaling.kind == RopeScaling::Kind::Linear) {
    for (double& f : inv) f /= scaling.factor;
  } else if (scaling.kind == RopeScaling::Kind::Llama3) {
    // Wavelengths longer than the original context / low_freq_factor are interpolated (divided by
    // factor), those shorter than context / high_freq_factor kept, the ones between blended.
    const double context = static_cast<double>(scaling.original_max_position_embeddings);
    const double long_wavelength = context / scaling.low_freq_factor;
    const double short_wavelength = context / scaling.high_freq_factor;
    for (double& f : inv) {
      const double wavelength = 2 * std::numbers::pi / f;
      if (wavelength > long_wavelength) {
        f /= scaling.factor;
      } else if (wavelength >= short_wavelength) {
        const double smooth =
            (context / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor);
        f = (1 - smooth) * f / scaling.factor + smooth * f;
      }
    }
  }
  return inv;
}

void check_config(const ModelConfig& c, std::string_view source) {
  const std::string who = std::string(source) + ": ";
  check_at_most(who, "vocab_size", c.vocab_size, 1, L::kMaxVocab);
  check_at_most(who, "hidden_size", c.hidden_size, 1, L::kMaxHidden);
  check_at_most(who, "num_hidden_layers", c.num_layers, 1, L::kMaxLayers);
  check_at_most(who, "num_attention_heads", c.num_heads, 1, L::kMaxHeads);
  check_at_most(who, "num_key_value_heads", c.num_kv_heads, 1, c.num_heads);
  check_at_most(who, "head_dim", c.head_dim, 1, L::kMaxHeadDim);
  check_at_most(who, "intermediate_size", c.intermediate_size, 1, L::kMaxIntermediate);
  check_at_most(who, "max_position_embeddings", c.max_positions, 1, L::kMaxPositions);
  check_at_most(who, "type_vocab_size", c.type_vocab_size,
                c.architecture == Architecture::Bert || c.architecture == Architecture::BertMaskedLM ? 1 : 0,
                L::kMaxTypeVocab);
  check_at_most(who, "sliding_window", c.sliding_window, 0, L::kMaxPositions);
  check_at_most(who, "max_window_layers", c.sliding_window_from_layer, 0, L::kMaxLayers);
  if (c.num_heads % c.num_kv_heads != 0)
    throw Error(who + "num_key_value_heads " + str(c.num_kv_heads) + " does not divide num_attention_heads " +
                str(c.num_heads));
  if (!c.is_llama_family() && c.num_heads * c.head_dim != c.hidden_size)
    throw Error(who + "num_attention_heads " + str(c.num_heads) + " does not divide hidden_size " + str(c.hidden_size));
  if (c.is_llama_family() && c.head_dim % 2 != 0)
    throw Error(who + "head_dim " + str(c.head_dim) + " is odd: rotary embeddings rotate pairs of features");
  if (!(c.norm_eps > 0) || !(c.norm_eps < 1))
    throw Error(who + "the norm epsilon " + std::to_string(c.norm_eps) + " is outside (0, 1)");
  if (c.is_llama_family() && (!(c.rope_theta > 1) || !std::isfinite(c.rope_theta)))
    throw Error(who + "rope_theta " + std::to_string(c.rope_theta) + " must be finite and > 1");
  for (int64_t id : c.eos_token_ids) check_at_most(who, "eos_token_id", id, 0, c.vocab_size - 1);
  check_at_most(who, "bos_token_id", c.bos_token_id, -1, c.vocab_size - 1);
}

ModelConfig parse_config(std::string_view json_text, std::string_view source) {
  Json json;
  try {
    json = Json::parse(json_text);
  } catch (const Json::parse_error& e) {
    throw Error(std::string(source) + ": not valid JSON: " + e.what());
  }
  if (!json.is_object()) throw Error(std::string(source) + ": a config is a JSON object, got " + json.type_name());
  const Fields f(json, source);
  ModelConfig c;
  c.architecture = architecture_of(f);
  switch (c.architecture) {
    case Architecture::GPT2: parse_gpt2(f, c); break;
    case Architecture::Bert:
    case Architecture::BertMaskedLM: parse_bert(f, c); break;
    case Architecture::Llama:
    case Architecture::Mistral:
    case Architecture::Qwen2: parse_llama(f, c); break;
  }
  if (c.head_dim == 0) {
    if (c.hidden_size % c.num_heads != 0)
      f.fail("num_attention_heads " + str(c.num_heads) + " does not divide hidden_size " + str(c.hidden_size));
    c.head_dim = c.hidden_size / c.num_heads;
  }
  c.eos_token_ids = f.ids("eos_token_id", c.vocab_size - 1);
  const std::vector<int64_t> bos = f.ids("bos_token_id", c.vocab_size - 1);
  if (!bos.empty()) c.bos_token_id = bos[0];
  check_config(c, source);
  return c;
}

}  // namespace qkv::models
