// The inside of qkv::models::Model (include/qkv/models/model.hpp), shared by model.cpp (the
// checks, forward, single-sequence generation) and batch_generation.cpp (many sequences on paged
// caches).
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "models/network.hpp"
#include "qkv/error.hpp"
#include "qkv/models/model.hpp"

namespace qkv::models {

struct Model::Impl {
  ModelConfig config;
  ModelOptions options;
  std::shared_ptr<const WeightSource> weights;
  std::unique_ptr<detail::Network> network;

  void check_causal(const std::string& who) const {
    if (!config.is_causal())
      throw Error(who + ": " + std::string(to_string(config.architecture)) + " is not a causal language model");
  }

  // `count` tokens starting at `position` fit the model's positions; ids are in the vocabulary.
  void check_tokens(const std::string& who, const std::vector<int64_t>& ids, int64_t position) const {
    if (ids.empty()) throw Error(who + ": a sequence is empty: give at least one token");
    const auto end = position + static_cast<int64_t>(ids.size());
    if (end > config.max_positions)
      throw Error(who + ": " + std::to_string(end) + " positions exceed the model's max_position_embeddings " +
                  std::to_string(config.max_positions));
    for (int64_t id : ids)
      if (id < 0 || id >= config.vocab_size)
        throw Error(who + ": token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                    std::to_string(config.vocab_size) + ")");
  }

  // `rows` tokens in one pass (`what` says which) keep the widest activation (the logits, or the
  // MLP's inner rows) within 2^31 floats.
  static constexpr int64_t kMaxActivationFloats = int64_t{1} << 31;
  void check_activation_rows(const std::string& who, int64_t rows, const std::string& what) const {
    const int64_t widest =
        std::max({config.has_lm_head() ? config.vocab_size : 0, config.intermediate_size, 3 * config.hidden_size});
    if (rows > kMaxActivationFloats / widest)
      throw Error(who + ": " + what + " need " + std::to_string(rows) + " x " + std::to_string(widest) +
                  " floats of activations, more than 2^31: split the batch");
  }

  // options.max_new_tokens fit after a prompt of `prompt_length` tokens.
  void check_new_tokens(const std::string& who, int64_t prompt_length, const GenerationOptions& options) const {
    if (options.max_new_tokens < 0 || options.max_new_tokens > config.max_positions - prompt_length + 1)
      throw Error(who + ": max_new_tokens " + std::to_string(options.max_new_tokens) + " is outside [0, " +
                  std::to_string(config.max_positions - prompt_length + 1) + "] for a prompt of " +
                  std::to_string(prompt_length) + " tokens (max_position_embeddings " +
                  std::to_string(config.max_positions) + ")");
  }

  bool is_eos(int64_t token) const {
    return std::find(config.eos_token_ids.begin(), config.eos_token_ids.end(), token) != config.eos_token_ids.end();
  }

  std::vector<nn::KVCache> make_caches(int64_t batch, int64_t capacity, DType dtype) const {
    std::vector<nn::KVCache> caches;
    for (int64_t l = 0; l < config.num_layers; ++l)
      caches.emplace_back(batch, config.num_kv_heads, capacity, config.head_dim, dtype);
    return caches;
  }

  // Model::forward of a ragged batch without weights (model.cpp), its input checked; `padded`
  // holds the padded layout's batch, length and counts (the outputs' shape), not its rows.
  ModelOutput forward_packed(const ModelInput& input, const detail::Pass& padded) const;

  // The logits (vocab) of the last of `tokens`, which follow `position` cached ones (batch 1).
  std::vector<float> step(const std::vector<int64_t>& tokens, int64_t position,
                          std::vector<nn::KVCache>& caches) const {
    detail::Pass pass;
    pass.batch = 1;
    pass.length = static_cast<int64_t>(tokens.size());
    pass.counts = {pass.length};
    pass.ids = tokens;
    pass.position = position;
    pass.caches = &caches;
    const Tensor hidden = network->hidden_states(pass);  // (length, hidden_size)
    const Tensor last = hidden.narrow(0, pass.length - 1, 1).contiguous();
    return network->logits(last).to_vector();
  }
};

}  // namespace qkv::models
