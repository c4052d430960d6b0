// Text to attention weights, shared by `qkv viz` (viz.cpp) and `qkv serve` (serve_api.cpp):
// tokens, their embedding, one untrained multi-head layer's weights at a temperature under a
// mask, and for a trained model (`qkv train --save`) the task it was trained on and the text's
// ids in its vocabulary.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "qkv/qkv.hpp"
#include "qkv/train.hpp"

namespace qkv::cli {

// Whitespace-separated words, or (chars) every UTF-8 character with spaces shown as "␣".
std::vector<std::string> tokenize(const std::string& text, bool chars);

// (1, N, embed): each token's word vector (case-folded, so "The" and "the" share one) plus its
// position's sinusoidal code.
Tensor embed_tokens(const std::vector<std::string>& tokens, int64_t embed, uint64_t seed);

// An untrained layer in eval mode. The same seed gives the same projection matrices whatever the
// head count, so different head counts split the very same Q and K differently.
nn::MultiHeadAttention make_layer(int64_t embed, int64_t heads, uint64_t seed);

// Every head's weights, (H, N, N) flattened per head: softmax(Q K^T / (sqrt(d) * T)) under `mask`,
// computed by qkv::scaled_dot_product_attention on the layer's own Q, K and V projections of x.
std::vector<std::vector<float>> head_weights(const nn::MultiHeadAttention& layer, const Tensor& x, const Mask& mask,
                                             double temperature);

// Which (query, key) pairs of n tokens `mask` lets through, (n, n) row-major, 1 = visible. Read
// from the library's own weights for uniform scores (q = k = 0), so it is exactly what attention
// applies; a masked pair is then told apart from a weight that merely rounds to 0.
std::vector<uint8_t> visible_pairs(const Mask& mask, int64_t n);

// The mean row entropy (nats) of one head's (n, n) weights.
double mean_entropy(const std::vector<float>& weights, int64_t n);

// A trained model's (1, H, n, n) weights tensor split into H flattened (n, n) heads.
std::vector<std::vector<float>> split_weights_by_head(const Tensor& weights, int64_t heads);

// The task a model file was trained on. The file holds the vocabulary (symbols + 1) and the
// sequence length (recall 2P + 1: odd; copy and reverse 2L: even), not the task's name: an odd
// length is recall; an even one is copy or reverse, whichever the model gets more right.
struct ModelTask {
  train::TaskOptions options;
  std::string name;
  std::string how;  // how the task was chosen, for the figure
};
// requested: "copy", "recall", "reverse" or empty (inferred). Throws qkv::Error when the model
// cannot be run on any `qkv train` task.
ModelTask model_task(const train::AttentionModel& model, const std::string& requested, uint64_t seed);

// The tokens as the model's ids, or why they cannot be (empty ids and why_not set).
std::vector<int64_t> text_ids(const std::vector<std::string>& tokens, const ModelTask& task, int64_t max_len,
                              std::string& why_not);

}  // namespace qkv::cli
