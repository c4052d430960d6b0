// qkv::train::AttentionModel: embedding + positions, [LayerNorm, causal attention, residual] x L,
// LayerNorm, head. Forward in numbered passes; backward walks them in reverse. The cached forward
// is in cached_forward.cpp, the .qkv file format in model_file.cpp.
#include <algorithm>
#include <chrono>
#include <string>

#include "core/random.hpp"
#include "train/model.hpp"

namespace qkv::train {

namespace {

// Each module draws its weights from a seed of its own, derived from the model's.
uint64_t module_seed(uint64_t seed, uint64_t module) { return detail::mix64(seed * 64 + module); }

// Bytes of what a config implies beyond its parameters: the sinusoidal table (max_len x d_model
// floats, built for every model). Counted before anything is allocated, so that a small file
// cannot ask for a huge table.
int64_t derived_bytes(const ModelConfig& c) { return c.max_len * c.d_model * static_cast<int64_t>(sizeof(float)); }

// A linear-attention layer's weights on x (B, N, d_model): w_ij = phi(q_i).phi(k_j) /
// (sum_j' phi(q_i).phi(k_j') + eps) over j <= i, (B, H, N, N). They are what linear attention
// multiplies the values by, so the library's own linear_attention computes them, with the
// identity as the values: out_i = sum_j w_ij e_j = row i of the weights.
Tensor linear_head_weights(const nn::MultiHeadAttention& layer, const Tensor& x) {
  const int64_t batch = x.size(0), len = x.size(1), heads = layer.num_heads(), kv_heads = layer.num_kv_heads(),
                hd = layer.head_dim();
  const Tensor q = layer.q_proj.apply(x).reshape({batch, len, heads, hd}).transpose(1, 2);
  const Tensor k = layer.k_proj.apply(x).reshape({batch, len, kv_heads, hd}).transpose(1, 2);
  if (layer.rotary()) {
    layer.rotary()->apply_inplace(q, {0});
    layer.rotary()->apply_inplace(k, {0});
  }
  Tensor identity = Tensor::zeros({batch, kv_heads, len, len});
  for (int64_t b = 0; b < batch * kv_heads; ++b)
    for (int64_t j = 0; j < len; ++j) identity.data()[(b * len + j) * len + j] = 1;
  LinearAttentionOptions options;
  options.feature_map = layer.options().feature_map;
  options.causal = layer.options().causal;
  return linear_attention(q, k, identity, options);
}

// In place: a += b, same shapes (the residual connections of backward).
void add_into(const Tensor& a, const Tensor& b) {
  float* out = a.data();
  const float* in = b.data();
  const int64_t count = a.numel();
  for (int64_t e = 0; e < count; ++e) out[e] += in[e];
}

}  // namespace

ModelConfig checked(const ModelConfig& c) {
  // Bounds keep a corrupt file from asking for absurd allocations as well as catching mistakes.
  auto in_range = [](int64_t v, int64_t most) { return v >= 1 && v <= most; };
  if (!in_range(c.vocab_size, kMaxVocabSize) || !in_range(c.max_len, kMaxLen) || !in_range(c.d_model, kMaxDModel) ||
      !in_range(c.num_heads, c.d_model) || c.num_layers < 0 || c.num_layers > kMaxLayers ||
      c.d_model % c.num_heads != 0)
    throw Error("AttentionModel: config vocab_size " + std::to_string(c.vocab_size) + ", max_len " +
                std::to_string(c.max_len) + ", d_model " + std::to_string(c.d_model) + ", num_heads " +
                std::to_string(c.num_heads) + ", num_layers " + std::to_string(c.num_layers) +
                ": vocab_size must be in [1, " + std::to_string(kMaxVocabSize) + "], max_len in [1, " +
                std::to_string(kMaxLen) + "], d_model in [1, " + std::to_string(kMaxDModel) + "], layers in [0, " +
                std::to_string(kMaxLayers) + "], d_model divisible by num_heads");
  if (derived_bytes(c) > kMaxPositionTableBytes)
    throw Error("AttentionModel: config max_len " + std::to_string(c.max_len) + " x d_model " +
                std::to_string(c.d_model) + " needs a positional table of " + std::to_string(derived_bytes(c)) +
                " bytes, over the limit of " + std::to_string(kMaxPositionTableBytes));
  if (c.attention != nn::AttentionKind::Softmax && c.attention != nn::AttentionKind::Linear)
    throw Error("AttentionModel: unknown attention kind " + std::to_string(static_cast<int>(c.attention)));
  if (c.positions != Positions::Sinusoidal && c.positions != Positions::Rotary && c.positions != Positions::T5)
    throw Error("AttentionModel: unknown positions " + std::to_string(static_cast<int>(c.positions)));
  if (c.positions == Positions::Rotary && (c.d_model / c.num_heads) % 2 != 0)
    throw Error("AttentionModel: rotary positions need an even head dim, but d_model " + std::to_string(c.d_model) +
                " / num_heads " + std::to_string(c.num_heads) + " is odd");
  if (c.mask.size() > kMaxMaskText)
    throw Error("AttentionModel: the mask expression has " + std::to_string(c.mask.size()) + " bytes (at most " +
                std::to_string(kMaxMaskText) + ")");
  if (!c.mask.empty() && c.attention == nn::AttentionKind::Linear)
    throw Error("AttentionModel: mask '" + c.mask + "' with linear attention: linear attention takes no mask "
                "(it is causal only)");
  return c;
}

Mask parsed_mask(const std::string& text) {
  if (text.empty()) return {};
  Mask mask;
  try {
    mask = Mask::parse(text);
  } catch (const Error& e) {
    throw Error(std::string("AttentionModel: mask: ") + e.what());
  }
  return mask;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

Tensor add(const Tensor& a, const Tensor& b) {
  Tensor sum = a.clone();
  const float* in = b.data();
  float* out = sum.data();
  const int64_t count = sum.numel();
  for (int64_t e = 0; e < count; ++e) out[e] += in[e];
  return sum;
}

AttentionModel::AttentionModel(const ModelConfig& config, uint64_t seed)
    : embedding(checked(config).vocab_size, config.d_model, module_seed(seed, 0)),
      positions(config.max_len, config.d_model),
      final_norm(config.d_model),
      head(config.d_model, config.vocab_size, true, module_seed(seed, 1)),
      config_(config),
      mask_(parsed_mask(config.mask)) {
  for (int64_t l = 0; l < config.num_layers; ++l) {
    nn::MultiHeadAttentionOptions options;
    options.causal = true;
    options.seed = module_seed(seed, 2 + static_cast<uint64_t>(l));
    options.attention = config.attention;
    if (config.positions == Positions::Rotary) options.rotary = nn::RotaryEmbeddingOptions{};
    if (config.positions == Positions::T5) options.relative_position_bias = nn::RelativePositionBiasOptions{32, 128, false};
    layers.push_back({nn::LayerNorm(config.d_model), nn::MultiHeadAttention(config.d_model, config.num_heads, options)});
  }
}


Tensor AttentionModel::forward(const std::vector<int64_t>& ids, int64_t batch, int64_t length, const Mask& mask,
                               std::vector<Tensor>* head_weights, double* attention_seconds) const {
  if (batch < 1 || length < 1 || length > config_.max_len || static_cast<int64_t>(ids.size()) != batch * length)
    throw Error("AttentionModel: " + std::to_string(ids.size()) + " ids for batch " + std::to_string(batch) +
                " x length " + std::to_string(length) + " (max_len " + std::to_string(config_.max_len) + ")");
  if (head_weights) head_weights->clear();
  // ---- 1. x = embedding(ids) + pe   (rotary: the layers rotate q and k instead)
  Tensor x = embedding.forward(ids, {batch, length});
  if (config_.positions == Positions::Sinusoidal) x = positions.forward(x);
  // ---- 2. per layer: x = x + attention(norm(x))   (attention is causal, and-ed with the
  // model's mask and the call's)
  const Mask layer_mask = mask_.is_none() ? mask : mask_ & mask;
  for (const Block& block : layers) {
    const Tensor normed = block.norm.forward(x);
    const auto start = std::chrono::steady_clock::now();
    const bool linear = config_.attention == nn::AttentionKind::Linear;
    const nn::MultiHeadAttentionOutput attended = block.attention.forward(
        normed, layer_mask, head_weights && !linear ? nn::Weights::PerHead : nn::Weights::None);
    if (attention_seconds) *attention_seconds += seconds_since(start);
    if (head_weights) head_weights->push_back(linear ? linear_head_weights(block.attention, normed) : attended.weights);
    x = add(x, attended.output);
  }
  // ---- 3. logits = head(final_norm(x))
  return head.forward(final_norm.forward(x));
}

AttentionModel AttentionModel::with_max_len(int64_t max_len) const {
  ModelConfig config = config_;
  config.max_len = max_len;
  AttentionModel longer(config, 0);
  const auto from = parameters(), to = longer.parameters();
  for (size_t i = 0; i < from.size(); ++i) {
    const Tensor values = from[i].tensor.contiguous();
    std::copy(values.data(), values.data() + values.numel(), to[i].tensor.data());
  }
  return longer;
}

void AttentionModel::backward(const Tensor& grad_logits) {
  // ---- 3. logits = head(final_norm(x))
  const Tensor dx = final_norm.backward(head.backward(grad_logits));
  // ---- 2. x = x + attention(norm(x)): the residual passes dx through, the branch adds to it
  for (auto block = layers.rbegin(); block != layers.rend(); ++block)
    add_into(dx, block->norm.backward(block->attention.backward(dx)));
  // ---- 1. x = embedding(ids) + pe: pe is fixed, so dx flows to the embedding rows unchanged
  embedding.backward(dx);
}

void AttentionModel::zero_grad() {
  embedding.zero_grad();
  for (Block& block : layers) {
    block.norm.zero_grad();
    block.attention.zero_grad();
  }
  final_norm.zero_grad();
  head.zero_grad();
}

std::vector<nn::NamedTensor> AttentionModel::parameters() const {
  std::vector<nn::NamedTensor> params = embedding.parameters("embedding.");
  auto append = [&](std::vector<nn::NamedTensor> more, const std::string& prefix) {
    for (auto& p : more) params.push_back({prefix + p.name, p.tensor, p.grad});
  };
  for (size_t l = 0; l < layers.size(); ++l) {
    const std::string prefix = "layers." + std::to_string(l) + ".";
    append(layers[l].norm.parameters(), prefix + "norm.");
    append(layers[l].attention.parameters(), prefix + "attention.");
  }
  append(final_norm.parameters(), "final_norm.");
  append(head.parameters(), "head.");
  return params;
}

int64_t AttentionModel::parameter_count() const {
  int64_t count = 0;
  for (const auto& p : parameters()) count += p.tensor.numel();
  return count;
}

}  // namespace qkv::train
