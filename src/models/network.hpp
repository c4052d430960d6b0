// The inside of qkv::models::Model: one Network per architecture (gpt2.cpp, bert.cpp, llama.cpp)
// turns a pass over new tokens into hidden states and logits, and every one of them attends
// through attend() (attend.cpp), the one place that calls qkv's attention and its KV cache.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "qkv/inference.hpp"
#include "qkv/paged_cache.hpp"
#include "qkv/models/config.hpp"
#include "qkv/models/weights.hpp"
#include "qkv/tensor.hpp"

namespace qkv::models::detail {

// One forward pass over the new tokens of a batch, in one of two row layouts: padded (each
// element's tokens right-padded to the longest, the same position for all, per-layer KVCaches) or
// packed (the elements' tokens back to back, no padding: FlashAttention's varlen layout; each
// element at its own position, per-layer paged caches or none).
struct Pass {
  int64_t batch = 0, length = 0;               // B, N: the longest run of new tokens
  std::vector<int64_t> counts;                 // (B): element b's new tokens, 1..N
  // The rows' ids: padded (B, N) row-major, padding 0 (element b's token n at row b * N + n);
  // packed, element b's token n at row offsets[b] + n.
  std::vector<int64_t> ids;
  std::vector<int64_t> token_types;            // as ids, BERT; empty: all 0
  bool packed = false;
  std::vector<int64_t> offsets;                // packed: B + 1 row offsets (cu_seqlens)
  int64_t position = 0;                        // padded: the position of every element's first new token
  std::vector<int64_t> positions;              // packed: element b's first new token's position
  std::vector<nn::KVCache>* caches = nullptr;  // padded: one per layer, each holding `position` tokens
  // packed: one pool per layer, element b being sequence sequences[b] of every pool (holding
  // positions[b] tokens); null: no cache, every element a whole sequence (positions all 0).
  std::vector<nn::PagedKVCache>* paged = nullptr;
  std::vector<int64_t> sequences;
  std::vector<Tensor>* attention = nullptr;    // padded, non-null: each layer's weights are appended
  // >= 0: the pass ends once this layer has attended (hidden_states returns an undefined
  // Tensor), after attend() has kept its q and k in `queries` and `keys` (Model::query_keys).
  int64_t stop_layer = -1;
  Tensor* queries = nullptr;                   // with stop_layer: q (B, H, N, hd) after rotary
  Tensor* keys = nullptr;                      // with stop_layer: k (B, Hkv, N, hd) after rotary
  bool ragged() const;                         // some element has fewer than N new tokens
  int64_t rows() const;                        // padded B * N; packed the sum of counts
  std::vector<int64_t> row_positions() const;  // each row's position (padding rows: as if tokens)
};

// A packed pass over whole sequences of ids (positions 0, no cache).
Pass packed_pass(const std::vector<std::vector<int64_t>>& ids);

class Network {
 public:
  virtual ~Network() = default;
  // (rows, hidden_size): the last hidden state of the pass's rows (after the final norm, if any).
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

// One attention layer's core. Padded: q (B, H, N, hd), k and v (B, Hkv, N, hd) are views (last
// dim contiguous) of the pass's new tokens; rotates q and k in place (spec.rotary), appends k and v
// to layer `layer`'s cache, attends q over the cache's keys with the spec's mask and the pass's
// padding, writing `out` (B, H, N, hd), a view. With pass.attention, appends the weights (B, H, N,
// position + N), zero in the rows of padded queries. With pass.queries and pass.keys, copies q and
// k there once rotated (the caller has stopped at the layer it wants, pass.stop_layer).
// Packed (attend_packed.cpp): q (rows, H, hd), k and v (rows, Hkv, hd), out (rows, H, hd); each
// element rotated to its own positions, appended to its sequence's pages, and attended alone.
void attend(const Tensor& q, const Tensor& k, const Tensor& v, const Pass& pass, int64_t layer,
            const AttentionSpec& spec, const Tensor& out);
void attend_packed(const Tensor& q, const Tensor& k, const Tensor& v, const Pass& pass, int64_t layer,
                   const AttentionSpec& spec, const Tensor& out);

// x (rows, dim), rows contiguous -> the view of its columns [first, first + heads * head_dim) as
// attend() takes it: padded (B, heads, N, head_dim), rows being (b, n) in order; packed (rows,
// heads, head_dim).
Tensor heads_view(const Tensor& x, const Pass& pass, int64_t first, int64_t heads, int64_t head_dim);

}  // namespace qkv::models::detail
