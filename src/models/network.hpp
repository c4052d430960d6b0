// The inside of qkv::models::Model: one Network per architecture (gpt2.cpp, bert.cpp, llama.cpp)
// turns a pass over new tokens into hidden states and logits, and every one of them attends
// through attend() (attend.cpp), the one place that calls qkv's attention and its KV cache.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "qkv/inference.hpp"
#include "qkv/models/config.hpp"
#include "qkv/models/weights.hpp"
#include "qkv/tensor.hpp"

namespace qkv::models::detail {

// One forward pass over the new tokens of a batch, right-padded to the longest.
struct Pass {
  int64_t batch = 0, length = 0;               // B, N: the longest run of new tokens
  std::vector<int64_t> counts;                 // (B): element b's new tokens, 1..N
  std::vector<int64_t> ids;                    // (B, N) row-major, padding 0
  std::vector<int64_t> token_types;            // (B, N), BERT; empty: all 0
  int64_t position = 0;                        // the position of every element's first new token
  std::vector<nn::KVCache>* caches = nullptr;  // one per layer, each holding `position` tokens
  std::vector<Tensor>* attention = nullptr;    // non-null: each layer's weights are appended
  // >= 0: the pass ends once this layer has attended (hidden_states returns an undefined
  // Tensor), after attend() has kept its q and k in `queries` and `keys` (Model::query_keys).
  int64_t stop_layer = -1;
  Tensor* queries = nullptr;                   // with stop_layer: q (B, H, N, hd) after rotary
  Tensor* keys = nullptr;                      // with stop_layer: k (B, Hkv, N, hd) after rotary
  bool ragged() const;                         // some element has fewer than N new tokens
};

class Network {
 public:
  virtual ~Network() = default;
  // (B, N, hidden_size): the last hidden state of the pass's tokens (after the final norm, if any).
  virtual Tensor hidden_states(const Pass& pass) const = 0;
  // hidden (rows, hidden_size) -> (rows, vocab_size); only when config.has_lm_head().
  virtual Tensor logits(const Tensor& hidden) const = 0;
};

std::unique_ptr<Network> make_gpt2(const ModelConfig& config, const WeightSource& weights);
std::unique_ptr<Network> make_bert(const ModelConfig& config, const WeightSource& weights);
std::unique_ptr<Network> make_llama(const ModelConfig& config, const WeightSource& weights);

// "LlamaForCausalLM (2 layers, hidden 40)": how errors name the model.
std::string model_name(const ModelConfig& config);

// How one layer attends.
struct AttentionSpec {
  bool causal = true;
  int64_t window = 0;                           // > 0: the query sees its last `window` positions
  const nn::RotaryEmbedding* rotary = nullptr;  // rotates q and k to their positions first
};

// One attention layer's core: q (B, H, N, hd), k and v (B, Hkv, N, hd) are views (last dim
// contiguous) of the pass's new tokens. Rotates q and k in place (spec.rotary), appends k and v to
// `cache`, attends q over the cache's keys with the spec's mask and the pass's padding, writing
// `out` (B, H, N, hd), a view. With pass.attention, appends the weights (B, H, N, position + N),
// zero in the rows of padded queries. With pass.queries and pass.keys, copies q and k there once
// rotated (the caller has stopped at the layer it wants, pass.stop_layer).
void attend(const Tensor& q, const Tensor& k, const Tensor& v, nn::KVCache& cache, const Pass& pass,
            const AttentionSpec& spec, const Tensor& out);

// x (rows, dim) packed -> a (B, heads, N, head_dim) view of its columns [first, first + heads *
// head_dim), rows being (b, n) in order.
Tensor heads_view(const Tensor& x, const Pass& pass, int64_t first, int64_t heads, int64_t head_dim);

}  // namespace qkv::models::detail
