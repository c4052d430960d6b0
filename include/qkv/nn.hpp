// qkv::nn: the modules an attention model is built from. Parameters are stored as PyTorch
// stores them (Linear weight (out, in)), so weights move between the two unchanged.
// Modules are thin: every attention goes through qkv::scaled_dot_product_attention.
//
// Training, llm.c style (no autograd engine): forward() remembers what backward needs (handles to
// its inputs and intermediates, no copies); backward(grad_output) walks the forward in reverse,
// returns the gradient of the input(s) and ADDS the parameter gradients into each parameter's
// grad tensor (zero_grad() clears them). backward uses the most recent forward of the module, so
// call them in pairs. forward() stays const, so inference callers are unchanged: the saved state
// is a cache, not a result. MultiHeadAttention may be called from any number of threads in every
// mode (its own lock, below); the other modules are one thread at a time while training.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/linear_attention.hpp"
#include "qkv/inference.hpp"
#include "qkv/mask.hpp"
#include "qkv/tensor.hpp"

namespace qkv::nn {
class PagedKVCache;  // qkv/paged_cache.hpp
}  // namespace qkv::nn

namespace qkv::nn {

// Modules built without a seed draw one from a global sequence, so two layers made alike get
// different weights (as torch does); manual_seed restarts that sequence, like torch.manual_seed.
void manual_seed(uint64_t seed);

struct NamedTensor {
  std::string name;  // "q_proj.weight"
  Tensor tensor;     // shares storage with the module: writing to it changes the module
  Tensor grad;       // the parameter's gradient, same shape, shared with the module; backward adds to it
};

// y = x W^T + b.  x: (..., in_features) -> y: (..., out_features).
// Initialised as torch.nn.Linear: W, b ~ U(-1/sqrt(in), 1/sqrt(in)).
class Linear {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true, std::optional<uint64_t> seed = std::nullopt);

  Tensor forward(const Tensor& x) const;  // remembers x for backward
  Tensor apply(const Tensor& x) const;    // forward that remembers nothing: safe from many threads
  // grad_output: (..., out_features), shaped as the last forward's y. Returns dL/dx (..., in);
  // adds dL/dW = g^T x to weight_grad and dL/db = sum of g over rows to bias_grad.
  // A grad_output view whose rows are evenly spaced with a contiguous last dim (a narrow of a wider
  // last dim) is read in place; other views are packed first. backward = accumulate_parameter_gradients
  // + input_gradient.
  Tensor backward(const Tensor& grad_output);
  // dL/dx = g W alone: g (..., out_features), a view as above -> (..., in_features).
  // Needs no forward (MultiHeadAttention uses it for the q/k/v row blocks of its fused projection).
  Tensor input_gradient(const Tensor& grad_output) const;
  // Adds dL/dW = g^T x and dL/db = sum of g's rows, x being the last forward's input; g as backward's.
  void accumulate_parameter_gradients(const Tensor& grad_output);
  void zero_grad();  // grads to zeros (reallocated if the parameters were replaced by other shapes)

  int64_t in_features() const { return weight.size(1); }
  int64_t out_features() const { return weight.size(0); }
  std::vector<NamedTensor> parameters(const std::string& prefix = "") const;

  Tensor weight;  // (out_features, in_features)
  Tensor bias;    // (out_features), undefined when built without bias
  Tensor weight_grad, bias_grad;  // shaped as weight and bias, zeros until a backward

 private:
  mutable Tensor saved_input_;  // x of the last forward
};

enum class Weights {
  None,      // do not return weights (fastest)
  PerHead,   // (B, H, Nq, Nk)
  Averaged,  // (B, Nq, Nk), the mean over heads (torch's average_attn_weights=True)
};

// What each head computes: softmax attention (scaled_dot_product_attention), or linear attention
// (linear_attention: O(N), no weights; with linear, the only mask is the causal option, and
// dropout, softcap, alibi and sinks must stay off).
enum class AttentionKind { Softmax, Linear };

// T5's learned relative-position bias (Raffel et al. 2020): a bias per head and per bucket of the
// distance k - q, added to every score (docs/flex.md). Buckets: the first half of the (per
// direction) buckets one distance each, the rest logarithmic up to max_distance, farther ones in
// the last; bidirectional gives keys before and after the query buckets of their own (an encoder),
// else keys after the query share bucket 0 (a causal decoder).
struct RelativePositionBiasOptions {
  int64_t num_buckets = 32;
  int64_t max_distance = 128;
  bool bidirectional = true;
};

// The bias as a parameter `weight` (num_buckets, num_heads) (T5's relative_attention_bias
// embedding), zeros at first. bias(q_len, kv_len) is (1, H, Nq, Nk), query i at position
// query_offset + i and key j at position j (a KV cache's new queries after query_offset cached
// tokens); backward(dbias) adds dbias (1 or B, H, Nq, Nk) of a call with query_offset 0, reduced
// into the buckets, into weight_grad.
class RelativePositionBias {
 public:
  RelativePositionBias(int64_t num_heads, const RelativePositionBiasOptions& options);
  // T5's _relative_position_bucket of relative position k - q.
  static int64_t bucket(int64_t relative_position, const RelativePositionBiasOptions& options);
  Tensor bias(int64_t q_len, int64_t kv_len, int64_t query_offset = 0) const;
  void backward(const Tensor& dbias);
  void zero_grad();
  const RelativePositionBiasOptions& options() const { return options_; }

  Tensor weight, weight_grad;

 private:
  int64_t num_heads_;
  RelativePositionBiasOptions options_;
};

struct MultiHeadAttentionOptions {
  int64_t num_kv_heads = 0;  // 0: num_heads. Fewer gives grouped-query attention.
  int64_t kdim = 0;          // features of the key input; 0: embed_dim
  int64_t vdim = 0;          // features of the value input; 0: embed_dim
  bool bias = true;          // biases on the four projections
  float dropout = 0;         // dropout on the attention weights while training
  bool causal = false;       // every forward also applies Mask::causal()
  float softcap = 0;         // > 0: scores soft-capped, s <- softcap * tanh(s / softcap); 0: off
  bool alibi = false;        // ALiBi: head h's scores get -2^(-8 (h + 1) / num_heads) * distance
  bool sinks = false;        // a learned attention-sink logit per head (parameter `sinks`, zeros at first)
  // Rotary position embedding (include/qkv/inference.hpp) on q and k of every forward, token n at
  // position n (with a cache: at its position after the cached ones); none: off.
  std::optional<RotaryEmbeddingOptions> rotary = std::nullopt;
  // A learned T5 relative-position bias (parameter relative_position_bias.weight), trained
  // through the attention backward's dbias; not with linear attention, a ring-buffer KV cache or a
  // float mask.
  std::optional<RelativePositionBiasOptions> relative_position_bias = std::nullopt;
  std::optional<uint64_t> seed = std::nullopt;  // initial weights and dropout decisions; none: see manual_seed
  AttentionKind attention = AttentionKind::Softmax;
  FeatureMap feature_map = FeatureMap::EluPlusOne;  // linear attention's phi
  // Of the attention's products, forward and backward (AttentionOptions::precision: High or
  // Medium allow AMX tiles where the CPU has them); the projections and linear attention stay
  // float32.
  MatmulPrecision precision = MatmulPrecision::Highest;
};

struct MultiHeadAttentionOutput {
  Tensor output;   // (B, Nq, embed_dim), or (Nq, embed_dim) for unbatched input
  Tensor weights;  // see Weights; undefined for Weights::None
};

// The input gradients of a cross-attention forward, shaped as query, key and value.
struct MultiHeadAttentionGrads {
  Tensor query, key, value;
};

}  // namespace qkv::nn

namespace qkv::detail {
struct ModuleMutex;  // a std::shared_mutex (src/nn/module_lock.hpp), kept out of this header
// A module's lock. Copying or moving a module gives the new one a lock of its own.
class ModuleLock {
 public:
  ModuleLock();
  ModuleLock(const ModuleLock&);
  ModuleLock& operator=(const ModuleLock&);
  ~ModuleLock();
  ModuleMutex& mutex() const { return *mutex_; }

 private:
  std::unique_ptr<ModuleMutex> mutex_;
};
}  // namespace qkv::detail

namespace qkv::nn {

// Multi-head attention: project, split into heads, attend, concatenate, project.
// Nothing is copied between the steps: the heads are transposed views of the projections, the
// attention writes its heads straight into the (B, Nq, H, hd) input of out_proj, and the backward
// writes the heads' gradients straight into the projections' (B, N, features) gradients.
// With kdim = vdim = embed_dim the q, k and v projections are one GEMM: their weights (and biases
// and grads) are row blocks of one (E + 2 Hkv hd, E) tensor, and forward(x) projects x once.
//   query (B, Nq, embed_dim), key (B, Nk, kdim), value (B, Nk, vdim); always batch first
//   (torch's batch_first=True; its default (N, B, E) layout is not accepted), or unbatched
//   (N, features). The mask is over the scores (B, num_heads, Nq, Nk).
// Threads: every member function may be called from any number of threads at once; the module
// holds a readers-writer lock. In eval() mode forward() only reads the module (no state for
// backward is kept, no dropout counter moves) and takes the lock shared, so one module serves
// inference from many threads in parallel; backward() then has nothing to differentiate (call
// train() first). In training mode (the default) forward() keeps what backward needs and
// advances the dropout seed: it takes the lock exclusively, as backward, zero_grad,
// load_state_dict and train do, so those calls run one at a time and never corrupt the saved
// state (backward then differentiates whichever forward ran last). Writing to the public members
// (q_proj, ..., sinks) or to parameters()' tensors while another thread calls the module is the
// caller's race, as with any array.
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

  // Inference with a KV cache (include/qkv/inference.hpp). make_cache: one for this layer, for
  // `batch` sequences of up to `capacity` positions, K/V stored in `dtype`; window > 0 makes it
  // a ring buffer of `window` slots (capacity must equal window) for a sliding-window model;
  // page_size > 0 keeps them in a pool of pages instead (KVCache's paged mode).
  KVCache make_cache(int64_t batch, int64_t capacity, DType dtype = DType::F32, int64_t window = 0,
                     int64_t page_size = 0) const;
  // x (B, N, embed_dim) (or (N, embed_dim)): tokens at the positions after those in the cache;
  // their keys and values are appended, and the result is what the full causal forward over
  // the whole sequence returns for them (with a ring buffer: the full forward under
  // Mask::window(window - 1)). counts (one per batch element, default N): element b has only its
  // first counts[b] tokens (right padding, for prompts of different lengths); the output rows of
  // its padding are finite but meaningless. Keeps nothing for backward and applies no dropout.
  // A paged cache (make_cache(..., page_size)) runs the paged forward below on its sequences and
  // takes whole rows only (no counts).
  MultiHeadAttentionOutput forward(const Tensor& x, KVCache& cache, const std::vector<int64_t>& counts = {}) const;
  // The same on a paged cache (include/qkv/paged_cache.hpp): batch element b of x (B, N,
  // embed_dim) continues sequence sequences[b], whose N new keys and values are appended (pages
  // taken, a shared last page copied) before attending over its pages in place.
  MultiHeadAttentionOutput forward(const Tensor& x, PagedKVCache& cache, const std::vector<int64_t>& sequences) const;

  // Self-attention on a packed batch (FlashAttention's varlen convention, no padding): x
  // (total_tokens, embed_dim) holds B sequences end to end, sequence b its rows cu_seqlens[b] ..
  // cu_seqlens[b + 1] (B + 1 offsets from 0, non-decreasing, ending at total_tokens). Each
  // sequence attends to its own tokens alone, at positions 0, 1, ... (causal, rotary and ALiBi
  // per sequence), through scaled_dot_product_attention's cu_seqlens; `mask` may add rules
  // (window, strided, ...; not tensors). Returns output (total_tokens, embed_dim): each sequence's
  // rows are what forward on that sequence alone returns. Keeps nothing for backward and applies
  // no dropout (inference); not with linear attention or relative_position_bias.
  MultiHeadAttentionOutput forward_packed(const Tensor& x, const std::vector<int64_t>& cu_seqlens,
                                          const Mask& mask = {}) const;

  // Backward of the last forward; grad_output is shaped as its output. Adds every projection's
  // parameter gradients. backward() follows forward(x) and returns dL/dx (the query, key and
  // value paths summed); backward_cross() follows either form and returns the three apart.
  // Attention itself goes through scaled_dot_product_attention_backward with the forward's
  // mask, scale and dropout seed, so dropout drops the same weights in both directions.
  Tensor backward(const Tensor& grad_output);
  MultiHeadAttentionGrads backward_cross(const Tensor& grad_output);
  void zero_grad();

  int64_t embed_dim() const { return embed_dim_; }
  int64_t num_heads() const { return num_heads_; }
  int64_t num_kv_heads() const { return num_kv_heads_; }
  int64_t head_dim() const { return embed_dim_ / num_heads_; }
  const MultiHeadAttentionOptions& options() const { return options_; }

  // Dropout is applied only while training (the default, as in PyTorch).
  void train(bool training = true);
  void eval() { train(false); }
  bool is_training() const;

  // q_proj.weight, q_proj.bias, k_proj..., v_proj..., out_proj.weight, out_proj.bias, and
  // sinks with options().sinks.
  std::vector<NamedTensor> parameters() const;
  int64_t parameter_count() const;
  // Loads a torch.nn.MultiheadAttention state dict (in_proj_weight, in_proj_bias, or
  // q_proj_weight / k_proj_weight / v_proj_weight, out_proj.weight, out_proj.bias) or qkv's own
  // names (sinks too, with options().sinks: torch has no such parameter). Every parameter must be
  // given, with its exact shape; unknown names are an error.
  void load_state_dict(const std::map<std::string, Tensor>& state);

  // The ALiBi slopes (num_heads) with options().alibi, else undefined.
  const Tensor& alibi_slopes() const { return alibi_slopes_; }
  // The rotary embedding with options().rotary, else nullptr.
  const RotaryEmbedding* rotary() const { return rotary_ ? &*rotary_ : nullptr; }

  Linear q_proj, k_proj, v_proj, out_proj;
  Tensor sinks, sinks_grad;  // (num_heads) with options().sinks, else undefined
  std::optional<RelativePositionBias> relative_position_bias;  // with options().relative_position_bias

 private:
  struct Checked {};  // the options below have been checked and their defaults filled in
  MultiHeadAttention(int64_t embed_dim, int64_t num_heads, const MultiHeadAttentionOptions& options, Checked);

  int64_t embed_dim_, num_heads_, num_kv_heads_;
  MultiHeadAttentionOptions options_;
  // kdim = vdim = embed_dim: the fused q/k/v projection whose row blocks q_proj, k_proj and v_proj
  // view (weights, biases, grads); used while those views are intact (see fused()).
  std::optional<Linear> in_proj_;
  Tensor alibi_slopes_;
  std::optional<RotaryEmbedding> rotary_;
  detail::ModuleLock lock_;  // see "Threads" above
  bool training_ = true;
  mutable uint64_t dropout_calls_ = 0;  // advances the dropout seed on each training forward

  // What backward needs from the last forward (handles to its tensors, no copies).
  struct Saved {
    bool valid = false;
    bool self_attention = false;  // forward(x): the three input gradients are summed
    bool fused = false;           // forward(x) through in_proj_: one projection to differentiate
    bool unbatched = false;
    Tensor q, k, v;               // (B, H, Nq, hd), (B, Hkv, Nk, hd) x2: the split projections
    AttentionResult attended;     // output (B, H, Nq, hd), a view of out_proj's input, lse and row stats
    AttentionOptions attention;   // mask (with causal), scale, dropout seed of that call
  };
  mutable Saved saved_;

  bool fused() const;  // in_proj_ exists and q_proj, k_proj, v_proj still view its row blocks
  // The bodies of forward(x), forward(query, key, value), backward, backward_cross and
  // parameters, called with lock_ held (shared_mutex is not recursive: they never take it).
  MultiHeadAttentionOutput self_forward(const Tensor& x, const Mask& mask, Weights weights) const;
  MultiHeadAttentionOutput cross_forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                         const Mask& mask, Weights weights) const;
  // forward(x) in eval() for few rows, each thread projecting and attending the heads it is
  // dealt, then its share of the out-projection's columns (src/nn/mha_by_heads.cpp): the same
  // result to rounding, one parallel region.
  bool forward_by_heads_applies(const Tensor& x, const Mask& mask, Weights weights) const;
  MultiHeadAttentionOutput forward_by_heads(const Tensor& x, const Mask& mask, bool unbatched) const;
  Tensor self_backward(const Tensor& grad_output);
  MultiHeadAttentionGrads cross_backward(const Tensor& grad_output);
  std::vector<NamedTensor> named_parameters() const;
  // Steps 3-5 of forward: attend over the (B, H, N, hd) head views, concatenate, project.
  LinearAttentionOptions linear_options() const;  // for AttentionKind::Linear
  MultiHeadAttentionOutput attend(const Tensor& q, const Tensor& k, const Tensor& v, const Mask& mask,
                                  Weights weights, bool unbatched, bool fused) const;
  // Steps 5-3 of backward: the gradients of the projections' outputs, as the projections wrote
  // them: {(B, N, E + 2 Hkv hd)} after a fused forward, else {dq (B, Nq, E), dk, dv (B, Nk, Hkv hd)}.
  std::vector<Tensor> backward_to_projections(const Tensor& grad_output);
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
  Tensor forward(const std::vector<int64_t>& ids, const Shape& leading) const;  // remembers ids
  // grad_output: shaped as the last forward's output. Adds each row of it to weight_grad's row
  // of its id (a repeated id collects every row). Ids have no gradient: returns nothing.
  void backward(const Tensor& grad_output);
  void zero_grad();
  std::vector<NamedTensor> parameters(const std::string& prefix = "") const;

  Tensor weight;       // (num_embeddings, embedding_dim)
  Tensor weight_grad;  // shaped as weight

 private:
  mutable std::vector<int64_t> saved_ids_;
};

// Layer normalisation over the last dim, as torch.nn.LayerNorm(normalized_shape = dim):
//   y = (x - mean) / sqrt(var + eps) * weight + bias, var the biased variance of the row.
// x: (..., dim) -> y: same shape. weight starts at ones, bias at zeros.
class LayerNorm {
 public:
  explicit LayerNorm(int64_t dim, float eps = 1e-5f, bool elementwise_affine = true);

  Tensor forward(const Tensor& x) const;  // remembers x, each row's mean and 1/std
  Tensor backward(const Tensor& grad_output);  // returns dL/dx; adds dL/dweight, dL/dbias
  void zero_grad();
  std::vector<NamedTensor> parameters(const std::string& prefix = "") const;

  int64_t dim() const { return dim_; }
  float eps() const { return eps_; }

  Tensor weight, bias;            // (dim) each; undefined without elementwise_affine
  Tensor weight_grad, bias_grad;

 private:
  int64_t dim_;
  float eps_;
  mutable Tensor saved_input_;    // (..., dim)
  mutable std::vector<float> saved_mean_, saved_rstd_;  // one per row
};

// Cross-entropy of logits against class ids, averaged over the targets that are not
// ignore_index (torch.nn.CrossEntropyLoss with reduction='mean'):
//   loss = mean over rows r with targets[r] != ignore_index of  logsumexp(logits[r]) - logits[r, targets[r]]
// logits: (..., C), one row per target. With no counted target the loss is 0 (torch gives NaN).
class CrossEntropyLoss {
 public:
  explicit CrossEntropyLoss(int64_t ignore_index = -100) : ignore_index_(ignore_index) {}

  float forward(const Tensor& logits, const std::vector<int64_t>& targets);  // remembers softmax
  // dL/dlogits, shaped as the logits: (softmax - onehot(target)) / count on counted rows, 0 elsewhere.
  // Scaled by grad_loss (dL_total/dloss), 1 for this loss alone.
  Tensor backward(float grad_loss = 1.0f) const;

  int64_t ignore_index() const { return ignore_index_; }
  int64_t count() const { return count_; }  // targets counted by the last forward

 private:
  int64_t ignore_index_;
  Tensor probabilities_;  // softmax of the last logits
  std::vector<int64_t> targets_;
  int64_t count_ = 0;
};

// AdamW, as torch.optim.AdamW with its defaults (decoupled weight decay, bias-corrected moments):
//   p <- p * (1 - lr * weight_decay)
//   m <- beta1 m + (1 - beta1) g,   v <- beta2 v + (1 - beta2) g^2      (t counts steps from 1)
//   p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
struct AdamWOptions {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
};

// What AdamW carries from step to step, for checkpoints (qkv/train.hpp): the step count t and
// the two moments of each parameter (numel floats each, in parameters() order).
struct AdamWState {
  int64_t steps = 0;
  std::vector<std::vector<float>> first_moment, second_moment;
};

class AdamW {
 public:
  // Every parameter must have a grad tensor of its shape (the modules' parameters() do).
  explicit AdamW(std::vector<NamedTensor> parameters, const AdamWOptions& options = {});

  void step();       // one update of every parameter from its grad
  void zero_grad();  // every grad to zeros
  int64_t steps() const { return steps_; }
  AdamWOptions& options() { return options_; }  // e.g. to change lr on a schedule
  const std::vector<NamedTensor>& parameters() const { return parameters_; }
  AdamWState state() const { return {steps_, first_moment_, second_moment_}; }
  // Resumes from a state(): one moment pair per parameter, each of its numel; else qkv::Error
  // (and the optimizer is unchanged).
  void load_state(const AdamWState& state);

 private:
  std::vector<NamedTensor> parameters_;
  std::vector<std::vector<float>> first_moment_, second_moment_;
  AdamWOptions options_;
  int64_t steps_ = 0;
};

}  // namespace qkv::nn
