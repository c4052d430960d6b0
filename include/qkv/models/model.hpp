// qkv::models::Model: a transformer of one of the supported architectures (config.hpp) running on
// its stored weights (weights.hpp, read in place in their dtype) and on qkv's attention: every
// attention is qkv::scaled_dot_product_attention over a qkv::nn::KVCache, rotary positions are
// qkv::nn::RotaryEmbedding. Inference only.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "qkv/dtype.hpp"
#include "qkv/models/config.hpp"
#include "qkv/models/weights.hpp"
#include "qkv/tensor.hpp"

namespace qkv::models {

struct ModelOptions {
  // The dtype of generate()'s KV caches: F32, BF16, F16, or I8 / I4 (quantized as appended,
  // qkv/quantize.hpp; I4 needs an even head_dim).
  DType kv_dtype = DType::BF16;
  // The pages of generate_batch()'s paged caches, >= 1 (at most max_position_embeddings are used).
  int64_t page_size = 64;
};

// A batch of sequences, right-padded to the longest: sequence b has ids[b].size() tokens.
struct ModelInput {
  std::vector<std::vector<int64_t>> ids;
  std::vector<std::vector<int64_t>> token_type_ids;  // BERT only; empty: all 0; else shaped as ids
};

struct ModelOutput {
  // Rows of padding (n >= ids[b].size()) are finite but meaningless. (A ragged batch without
  // need_attention runs packed, no padding row computed, and leaves them zero.)
  Tensor hidden;  // (B, N, hidden_size): the last hidden state (after the final norm, if any)
  Tensor logits;  // (B, N, vocab_size); undefined for BertModel
  // need_attention: layer l's attention weights (B, num_heads, N, N); a padded query's row and a
  // padded key's column hold zeros.
  std::vector<Tensor> attention;
};

struct GenerationOptions {
  int64_t max_new_tokens = 32;
  float temperature = 0;    // 0: greedy (argmax); else softmax(logits / temperature)
  int64_t top_k = 0;        // > 0: sample among the k most likely tokens only
  float top_p = 1;          // < 1: among the fewest most likely tokens whose probability reaches top_p
  uint64_t seed = 0;        // the sampler's seed: the same seed gives the same tokens
  bool stop_at_eos = true;  // stop after a token of config.eos_token_ids
};

struct GenerationResult {
  std::vector<int64_t> tokens;  // the new tokens, the eos that stopped them included
  bool stopped_at_eos = false;
  int64_t prompt_tokens = 0;
  double prefill_seconds = 0;                // the prompt's forward and the first token's choice
  double decode_seconds = 0;                 // every later token's step
  double prefill_tokens_per_second() const;  // prompt_tokens / prefill_seconds
  double decode_tokens_per_second() const;   // (tokens - 1) / decode_seconds
};

// One layer's queries and keys on a sequence, as that layer's attention uses them (after rotary
// positions, for the architectures that have them): its weights are softmax over keys of
// scale * q_i . k_j under the architecture's mask (causal, or both ways for BERT).
struct QueryKeys {
  int64_t layer = 0;
  Tensor queries;    // (num_heads, N, head_dim)
  Tensor keys;       // (num_kv_heads, N, head_dim): query head h reads key head h / (H / Hkv)
  double scale = 1;  // 1 / sqrt(head_dim)
};

// Called with each new token as it is chosen; return false to stop.
using TokenCallback = std::function<bool(int64_t token)>;
// generate_batch's: called with each new token of prompt `index`; return false to stop that one.
using BatchTokenCallback = std::function<bool(int64_t index, int64_t token)>;

class Model {
 public:
  // Checks every weight the config needs against `weights` (present, F32/BF16/F16, its shape):
  // qkv::Error names the tensor (WeightSource::describe), the expected and the found shape.
  // `weights` must outlive the model; nothing is copied but the small vectors (norms, biases).
  Model(const ModelConfig& config, std::shared_ptr<const WeightSource> weights, const ModelOptions& options = {});
  ~Model();
  Model(Model&&) noexcept;
  Model& operator=(Model&&) noexcept;

  const ModelConfig& config() const;

  // The full forward of a batch (no cache kept): causal models mask causally, BERT attends both
  // ways; padding is masked out of every row. Ids are checked against the vocabulary and the
  // length against max_positions.
  ModelOutput forward(const ModelInput& input, bool need_attention = false) const;
  ModelOutput forward(const std::vector<int64_t>& ids, bool need_attention = false) const;

  // Layer `layer`'s q and k on `ids` (batch 1): runs the layers up to that one on the
  // architecture's own code and stops once it has attended. Ids and length are checked as
  // forward() checks them; qkv::Error when the layer is not one of the model's.
  QueryKeys query_keys(const std::vector<int64_t>& ids, int64_t layer) const;

  // Causal models only: prefills the prompt into per-layer KV caches (options.kv_dtype), then one
  // token per step from the caches. on_token may stop it early.
  GenerationResult generate(const std::vector<int64_t>& prompt, const GenerationOptions& options = {},
                            const TokenCallback& on_token = {}) const;

  // Causal models only: several prompts at once, with no padding. The prompts are prefilled
  // together as one packed batch (cu_seqlens: each attends to its own keys), then every unfinished
  // sequence advances a token per step in one batched call, each reading its own pages of
  // per-layer paged KV caches (qkv::nn::PagedKVCache, options.kv_dtype, page_size), released as
  // it stops. Each sequence draws from its own sampler seeded with options.seed, and its prefill
  // attends to its keys and values as the cache holds them (as generate()'s does), so result b is
  // generate(prompts[b], options)'s up to the order of float sums (the same tokens, unless two
  // logits tie to the last bits). Timings are the batch's: result b's prefill_seconds the
  // whole prefill, its decode_seconds the steps it took part in. Every prompt is checked first.
  std::vector<GenerationResult> generate_batch(const std::vector<std::vector<int64_t>>& prompts,
                                               const GenerationOptions& options = {},
                                               const BatchTokenCallback& on_token = {}) const;

  // cached_logits for a batch, on generate_batch's paged path: sequence b prefills its first
  // prefill[b] tokens (all prefilled together), then every sequence with tokens left takes its
  // next `chunk` (or fewer, at its end) in one step (chunk > 1: a chunked prefill, attending over
  // its pages); out[b] holds the last position's logits after each step: of its prefixes of
  // prefill[b], prefill[b] + chunk, ... tokens, and all of them. For tests of the paged, packed
  // path against forward().
  std::vector<std::vector<std::vector<float>>> cached_logits_batch(const std::vector<std::vector<int64_t>>& ids,
                                                                   const std::vector<int64_t>& prefill,
                                                                   int64_t chunk = 1) const;

  // The last position's logits (vocab_size) after each prefix of `ids`, computed with the KV cache
  // as generate() does (prefill of the first `prefill` tokens, then one token per step): for
  // tests of the cache against forward().
  std::vector<std::vector<float>> cached_logits(const std::vector<int64_t>& ids, int64_t prefill) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// qkv::Error when temperature is negative or not finite, top_k negative, top_p outside (0, 1].
void check_generation_options(const GenerationOptions& options);

// The next token from one position's logits under `options` (temperature, top_k, top_p), drawing
// from `state` (advanced): argmax when temperature is 0.
int64_t sample_token(const float* logits, int64_t vocab, const GenerationOptions& options, uint64_t& state);

}  // namespace qkv::models
