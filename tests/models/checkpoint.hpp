// Small random checkpoints in memory for the architecture tests: a WeightSource over tensors of a
// chosen dtype, and the exact values each stored tensor holds (widened to double) for the float64
// oracles (oracles.hpp). Names and shapes are the Hugging Face ones each architecture reads.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "qkv/dtype.hpp"
#include "qkv/models/config.hpp"
#include "qkv/models/weights.hpp"

namespace qkv::models::testing {

// A row-major tensor of doubles: the values a stored tensor represents exactly.
struct Values {
  std::vector<int64_t> shape;
  std::vector<double> data;
  int64_t rows() const { return shape[0]; }
  int64_t cols() const { return shape.size() > 1 ? shape[1] : 1; }
  double at(int64_t i, int64_t j) const { return data[static_cast<size_t>(i * cols() + j)]; }
};

class MemoryWeights final : public WeightSource {
 public:
  const WeightView* find(std::string_view name) const override {
    const auto it = tensors_.find(std::string(name));
    return it == tensors_.end() ? nullptr : &it->second.view;
  }
  std::string describe(std::string_view name) const override { return "memory: tensor '" + std::string(name) + "'"; }

  // Stores `values` in `dtype`, returning what the stored elements represent.
  Values add(const std::string& name, const std::vector<int64_t>& shape, const std::vector<float>& values,
             DType dtype) {
    Stored& s = tensors_[name];
    s.bytes.resize(values.size() * element_size(dtype));
    convert(values.data(), DType::F32, s.bytes.data(), dtype, values.size());
    s.view = WeightView{.dtype = dtype, .shape = shape, .data = s.bytes.data()};
    std::vector<float> back(values.size());
    convert(s.bytes.data(), dtype, back.data(), DType::F32, values.size());
    return Values{shape, std::vector<double>(back.begin(), back.end())};
  }
  void erase(const std::string& name) { tensors_.erase(name); }
  // Replaces a tensor's recorded shape (its bytes stay): for the shape-error tests.
  void reshape(const std::string& name, std::vector<int64_t> shape) { tensors_.at(name).view.shape = std::move(shape); }

 private:
  struct Stored {
    std::vector<std::byte> bytes;
    WeightView view;
  };
  std::map<std::string, Stored> tensors_;
};

// A random checkpoint: each tensor uniform in [-scale, scale] (norm weights around 1), stored in
// one dtype; `values` keeps what was stored, by name.
struct Checkpoint {
  std::shared_ptr<MemoryWeights> weights = std::make_shared<MemoryWeights>();
  std::map<std::string, Values> values;
  DType dtype = DType::F32;
  uint64_t state = 1;

  float uniform() {  // in [-1, 1)
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<float>(static_cast<double>(state >> 11) * 0x1.0p-52 - 1.0);
  }
  void random(const std::string& name, std::vector<int64_t> shape, double scale, double center = 0) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = static_cast<float>(center + scale * uniform());
    values[name] = weights->add(name, shape, v, dtype);
  }
  const Values& operator[](const std::string& name) const { return values.at(name); }
  bool has(const std::string& name) const { return values.count(name) != 0; }
};

// Checkpoints of each architecture for `config` (tensors named as Hugging Face saves them).
inline Checkpoint gpt2_checkpoint(const ModelConfig& c, DType dtype, uint64_t seed,
                                  const std::string& prefix = "transformer.") {
  Checkpoint k;
  k.dtype = dtype;
  k.state = seed;
  const int64_t d = c.hidden_size, inner = c.intermediate_size;
  const double s = 1 / std::sqrt(static_cast<double>(d));
  k.random(prefix + "wte.weight", {c.vocab_size, d}, 0.5);
  k.random(prefix + "wpe.weight", {c.max_positions, d}, 0.3);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string l = prefix + "h." + std::to_string(i) + ".";
    k.random(l + "ln_1.weight", {d}, 0.2, 1);
    k.random(l + "ln_1.bias", {d}, 0.1);
    k.random(l + "attn.c_attn.weight", {d, 3 * d}, 2 * s);
    k.random(l + "attn.c_attn.bias", {3 * d}, 0.1);
    k.random(l + "attn.c_proj.weight", {d, d}, s);
    k.random(l + "attn.c_proj.bias", {d}, 0.1);
    k.random(l + "ln_2.weight", {d}, 0.2, 1);
    k.random(l + "ln_2.bias", {d}, 0.1);
    k.random(l + "mlp.c_fc.weight", {d, inner}, s);
    k.random(l + "mlp.c_fc.bias", {inner}, 0.1);
    k.random(l + "mlp.c_proj.weight", {inner, d}, 1 / std::sqrt(static_cast<double>(inner)));
    k.random(l + "mlp.c_proj.bias", {d}, 0.1);
  }
  k.random(prefix + "ln_f.weight", {d}, 0.2, 1);
  k.random(prefix + "ln_f.bias", {d}, 0.1);
  if (!c.tie_word_embeddings) k.random("lm_head.weight", {c.vocab_size, d}, 0.5);
  return k;
}

inline Checkpoint bert_checkpoint(const ModelConfig& c, DType dtype, uint64_t seed) {
  Checkpoint k;
  k.dtype = dtype;
  k.state = seed;
  const bool mlm = c.architecture == Architecture::BertMaskedLM;
  const std::string p = mlm ? "bert." : "";
  const int64_t d = c.hidden_size, inner = c.intermediate_size;
  const double s = 1 / std::sqrt(static_cast<double>(d));
  const auto dense = [&](const std::string& name, int64_t out, int64_t in) {
    k.random(name + ".weight", {out, in}, 1.5 / std::sqrt(static_cast<double>(in)));
    k.random(name + ".bias", {out}, 0.1);
  };
  const auto norm = [&](const std::string& name) {
    k.random(name + ".weight", {d}, 0.2, 1);
    k.random(name + ".bias", {d}, 0.1);
  };
  k.random(p + "embeddings.word_embeddings.weight", {c.vocab_size, d}, 0.5);
  k.random(p + "embeddings.position_embeddings.weight", {c.max_positions, d}, 0.3);
  k.random(p + "embeddings.token_type_embeddings.weight", {c.type_vocab_size, d}, 0.3);
  norm(p + "embeddings.LayerNorm");
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string l = p + "encoder.layer." + std::to_string(i) + ".";
    dense(l + "attention.self.query", d, d);
    dense(l + "attention.self.key", d, d);
    dense(l + "attention.self.value", d, d);
    dense(l + "attention.output.dense", d, d);
    norm(l + "attention.output.LayerNorm");
    dense(l + "intermediate.dense", inner, d);
    dense(l + "output.dense", d, inner);
    norm(l + "output.LayerNorm");
  }
  if (mlm) {
    dense("cls.predictions.transform.dense", d, d);
    norm("cls.predictions.transform.LayerNorm");
    k.random("cls.predictions.bias", {c.vocab_size}, 0.1);
    if (!c.tie_word_embeddings) k.random("cls.predictions.decoder.weight", {c.vocab_size, d}, s);
  }
  return k;
}

inline Checkpoint llama_checkpoint(const ModelConfig& c, DType dtype, uint64_t seed) {
  Checkpoint k;
  k.dtype = dtype;
  k.state = seed;
  const int64_t d = c.hidden_size, inner = c.intermediate_size;
  const int64_t qw = c.num_heads * c.head_dim, kvw = c.num_kv_heads * c.head_dim;
  const auto proj = [&](const std::string& name, int64_t out, int64_t in, bool bias) {
    k.random(name + ".weight", {out, in}, 1.5 / std::sqrt(static_cast<double>(in)));
    if (bias) k.random(name + ".bias", {out}, 0.2);
  };
  k.random("model.embed_tokens.weight", {c.vocab_size, d}, 1.0);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string l = "model.layers." + std::to_string(i) + ".";
    k.random(l + "input_layernorm.weight", {d}, 0.2, 1);
    k.random(l + "post_attention_layernorm.weight", {d}, 0.2, 1);
    proj(l + "self_attn.q_proj", qw, d, c.attention_bias);
    proj(l + "self_attn.k_proj", kvw, d, c.attention_bias);
    proj(l + "self_attn.v_proj", kvw, d, c.attention_bias);
    proj(l + "self_attn.o_proj", d, qw, c.attention_output_bias);
    proj(l + "mlp.gate_proj", inner, d, c.mlp_bias);
    proj(l + "mlp.up_proj", inner, d, c.mlp_bias);
    proj(l + "mlp.down_proj", d, inner, c.mlp_bias);
  }
  k.random("model.norm.weight", {d}, 0.2, 1);
  if (!c.tie_word_embeddings) k.random("lm_head.weight", {c.vocab_size, d}, 1 / std::sqrt(static_cast<double>(d)));
  return k;
}

}  // namespace qkv::models::testing
