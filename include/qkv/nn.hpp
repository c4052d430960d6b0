// qkv::nn: the modules an attention model is built from. Parameters are stored as PyTorch
// stores them (Linear weight (out, in)), so weights move between the two unchanged.
// Modules are thin: every attention goes through qkv::scaled_dot_product_attention.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/mask.hpp"
#include "qkv/tensor.hpp"

namespace qkv::nn {

// Modules built without a seed draw one from a global sequence, so two layers made alike get
// different weights (as torch does); manual_seed restarts that sequence, like torch.manual_seed.
void manual_seed(uint64_t seed);

struct NamedTensor {
  std::string name;  // "q_proj.weight"
  Tensor tensor;     // shares storage with the module: writing to it changes the module
};

// y = x W^T + b.  x: (..., in_features) -> y: (..., out_features).
// Initialised as torch.nn.Linear: W, b ~ U(-1/sqrt(in), 1/sqrt(in)).
class Linear {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true, std::optional<uint64_t> seed = std::nullopt);

  Tensor forward(const Tensor& x) const;

  int64_t in_features() const { return weight.size(1); }
  int64_t out_features() const { return weight.size(0); }
  std::vector<NamedTensor> parameters(const std::string& prefix = "") const;

  Tensor weight;  // (out_features, in_features)
  Tensor bias;    // (out_features), undefined when built without bias
};

enum class Weights {
  None,      // do not return weights (fastest)
  PerHead,   // (B, H, Nq, Nk)
  Averaged,  // (B, Nq, Nk), the mean over heads (torch's average_attn_weights=True)
};

struct MultiHeadAttentionOptions {
  int64_t num_kv_heads = 0;  // 0: num_heads. Fewer gives grouped-query attention.
  int64_t kdim = 0;          // features of the key input; 0: embed_dim
  int64_t vdim = 0;          // features of the value input; 0: embed_dim
  bool bias = true;          // biases on the four projections
  float dropout = 0;         // dropout on the attention weights while training
  bool causal = false;       // every forward also applies Mask::causal()
  std::optional<uint64_t> seed;  // initial weights and dropout decisions; none: see manual_seed
};

struct MultiHeadAttentionOutput {
  Tensor output;   // (B, Nq, embed_dim), or (Nq, embed_dim) for unbatched input
  Tensor weights;  // see Weights; undefined for Weights::None
};

// Multi-head attention: project, split into heads, attend, concatenate, project.
//   query (B, Nq, embed_dim), key (B, Nk, kdim), value (B, Nk, vdim); always batch first
//   (torch's batch_first=True; its default (N, B, E) layout is not accepted), or unbatched
//   (N, features). The mask is over the scores (B, num_heads, Nq, Nk).
// forward() is const but, while training with dropout, advances a counter for the dropout
// seed: do not call it on one module from several threads at once in that mode.
// Initialised as torch.nn.MultiheadAttention: xavier-uniform q/k/v projections, zero biases.
class MultiHeadAttention {
 public:
  MultiHeadAttention(int64_t embed_dim, int64_t num_heads,
                     const MultiHeadAttentionOptions& options = {});

  // Self-attention: query = key = value = x.
  MultiHeadAttentionOutput forward(const Tensor& x, const Mask& mask = {},
                                   Weights weights = Weights::None) const;
  // Cross-attention: queries from one sequence, keys and values from another.
  MultiHeadAttentionOutput forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                   const Mask& mask = {}, Weights weights = Weights::None) const;

  int64_t embed_dim() const { return embed_dim_; }
  int64_t num_heads() const { return num_heads_; }
  int64_t num_kv_heads() const { return num_kv_heads_; }
  int64_t head_dim() const { return embed_dim_ / num_heads_; }
  const MultiHeadAttentionOptions& options() const { return options_; }

  // Dropout is applied only while training (the default, as in PyTorch).
  void train(bool training = true) { training_ = training; }
  void eval() { training_ = false; }
  bool is_training() const { return training_; }

  // q_proj.weight, q_proj.bias, k_proj..., v_proj..., out_proj.weight, out_proj.bias.
  std::vector<NamedTensor> parameters() const;
  int64_t parameter_count() const;
  // Loads a torch.nn.MultiheadAttention state dict (in_proj_weight, in_proj_bias, or
  // q_proj_weight / k_proj_weight / v_proj_weight, out_proj.weight, out_proj.bias) or qkv's own
  // names. Every parameter must be given, with its exact shape; unknown names are an error.
  void load_state_dict(const std::map<std::string, Tensor>& state);

  Linear q_proj, k_proj, v_proj, out_proj;

 private:
  struct Checked {};  // the options below have been checked and their defaults filled in
  MultiHeadAttention(int64_t embed_dim, int64_t num_heads, const MultiHeadAttentionOptions& options, Checked);

  int64_t embed_dim_, num_heads_, num_kv_heads_;
  MultiHeadAttentionOptions options_;
  bool training_ = true;
  mutable uint64_t dropout_calls_ = 0;  // advances the dropout seed on each training forward
};

// The fixed sin/cos positional encoding of "Attention Is All You Need":
//   pe[pos, 2i] = sin(pos / 10000^(2i / d_model)),  pe[pos, 2i + 1] = cos(same angle).
class SinusoidalPositionalEncoding {
 public:
  SinusoidalPositionalEncoding(int64_t max_len, int64_t d_model);
  // x: (B, N, d_model) or (N, d_model), N <= max_len; returns x + pe[:N].
  Tensor forward(const Tensor& x) const;
  const Tensor& encoding() const { return encoding_; }  // (max_len, d_model)

 private:
  Tensor encoding_;
};

// A table of learned vectors, one per token id; initialised N(0, 1) as torch.nn.Embedding.
class Embedding {
 public:
  Embedding(int64_t num_embeddings, int64_t embedding_dim, std::optional<uint64_t> seed = std::nullopt);
  // ids -> (ids.size(), dim); with leading shape, e.g. {B, N}: (B, N, dim).
  Tensor forward(const std::vector<int64_t>& ids) const;
  Tensor forward(const std::vector<int64_t>& ids, const Shape& leading) const;
  std::vector<NamedTensor> parameters(const std::string& prefix = "") const;

  Tensor weight;  // (num_embeddings, embedding_dim)
};

}  // namespace qkv::nn
