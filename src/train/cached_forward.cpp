// AttentionModel's cached forward: new tokens at the positions after those its per-layer KV caches
// hold, under the model's mask moved to those positions.
#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "train/model.hpp"

namespace qkv::train {

namespace {

// x (B, N, d_model) + pe[offset .. offset + N): the sinusoidal table at the tokens' positions.
Tensor add_positions(const Tensor& x, const Tensor& table, int64_t offset) {
  Tensor y = x.clone();
  const int64_t batch = x.size(0), len = x.size(1), d = x.size(2);
  float* out = y.data();
  const float* pe = table.data() + offset * d;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t e = 0; e < len * d; ++e) out[b * len * d + e] += pe[e];
  return y;
}


// A band j - i in [lo, hi] (lo <= 0 <= hi, as window and causal make) for queries at position
// offset + i: Mask::window's offset.
Mask shifted_band(int64_t lo, int64_t hi, int64_t offset) {
  if (lo > 0 || hi < 0)
    throw Error("AttentionModel: the cached forward cannot shift a band [" + std::to_string(lo) + ", " +
                std::to_string(hi) + "] that excludes the query itself");
  return Mask::window(-lo, hi, offset);
}

Mask shifted_rule(const Mask::Rule& rule, int64_t offset, int64_t batch, int64_t keys) {
  using Kind = Mask::Rule::Kind;
  switch (rule.kind) {
    case Kind::Band: return shifted_band(rule.lo, rule.hi, offset);
    case Kind::KeyLengths: return Mask::key_lengths(rule.lengths);
    case Kind::Strided: return Mask::strided(rule.stride, rule.offset + offset);
    case Kind::Global:
      // j < count or offset + i < count: the first keys for every query, every key for the
      // queries before count - offset.
      return Mask::key_lengths(std::vector<int64_t>(static_cast<size_t>(batch), std::min(rule.count, keys))) |
             Mask::global_tokens(std::max<int64_t>(0, rule.count - offset));
    case Kind::And: return shifted_rule(*rule.left, offset, batch, keys) & shifted_rule(*rule.right, offset, batch, keys);
    case Kind::Or: return shifted_rule(*rule.left, offset, batch, keys) | shifted_rule(*rule.right, offset, batch, keys);
    case Kind::Keep:
    case Kind::BlockSparse:
    case Kind::Expression: break;
  }
  throw Error("AttentionModel: the cached forward cannot shift a tensor, block-sparse or function mask");
}

// The model's mask for `len` new queries at positions offset.. over the keys 0 .. offset + len:
// the same expression with every query-relative part moved by offset (Mask::parse's masks only:
// bands, key lengths, strided, global, and their & and |).
Mask shifted_mask(const Mask& mask, int64_t offset, int64_t batch, int64_t keys) {
  Mask out = mask.has_band() ? shifted_band(mask.band_lo(), mask.band_hi(), offset) : Mask();
  if (mask.has_key_lengths()) out &= Mask::key_lengths(mask.lengths());
  if (!mask.terms().empty()) throw Error("AttentionModel: the cached forward cannot shift a tensor mask");
  if (mask.rule()) out &= shifted_rule(*mask.rule(), offset, batch, keys);
  return out;
}

// One layer of the cached forward under the model's mask: what MultiHeadAttention::forward(x,
// cache) does for causal attention alone (project, rotate to the positions, append to the cache,
// attend over its slice in place, project out), with the mask moved to the new queries' positions.
Tensor masked_cached_attention(const nn::MultiHeadAttention& layer, const Tensor& x, nn::KVCache& cache,
                               const Mask& mask) {
  const int64_t batch = x.size(0), len = x.size(1), heads = layer.num_heads(), kv_heads = layer.num_kv_heads(),
                hd = layer.head_dim(), offset = cache.length();
  const Tensor q = layer.q_proj.apply(x).reshape({batch, len, heads, hd}).transpose(1, 2);
  const Tensor k = layer.k_proj.apply(x).reshape({batch, len, kv_heads, hd}).transpose(1, 2);
  const Tensor v = layer.v_proj.apply(x).reshape({batch, len, kv_heads, hd}).transpose(1, 2);
  if (layer.rotary()) {
    layer.rotary()->apply_inplace(q, {offset});
    layer.rotary()->apply_inplace(k, {offset});
  }
  cache.append(k, v);
  const int64_t keys = offset + len;
  AttentionOptions options;
  options.mask = Mask::causal(offset) & shifted_mask(mask, offset, batch, keys);
  if (layer.relative_position_bias)  // T5 positions: queries at offset .., keys at 0 ..
    options.mask &= Mask::additive(layer.relative_position_bias->bias(len, keys, offset));
  options.k_scales = cache.key_scales(keys);  // undefined unless the cache is quantized
  options.v_scales = cache.value_scales(keys);
  const Tensor concatenated = Tensor::empty({batch, len, heads, hd});
  AttentionResult result;
  result.output = concatenated.transpose(1, 2);
  scaled_dot_product_attention_into(q, cache.keys(keys), cache.values(keys), result, options);
  return layer.out_proj.apply(concatenated.reshape({batch, len, layer.embed_dim()}));
}

}  // namespace

std::vector<nn::KVCache> AttentionModel::make_caches(int64_t batch, int64_t capacity, DType dtype) const {
  if (config_.attention != nn::AttentionKind::Softmax)
    throw Error("AttentionModel::make_caches: a KV cache serves softmax attention; this model uses " +
                to_string(config_.attention) + " attention (generate without the cache)");
  if (capacity < 1 || capacity > config_.max_len)
    throw Error("AttentionModel::make_caches: capacity " + std::to_string(capacity) + " must be in [1, max_len " +
                std::to_string(config_.max_len) + "]");
  std::vector<nn::KVCache> caches;
  for (const Block& block : layers) caches.push_back(block.attention.make_cache(batch, capacity, dtype));
  return caches;
}

Tensor AttentionModel::forward(const std::vector<int64_t>& ids, int64_t batch, int64_t length,
                               std::vector<nn::KVCache>& caches, double* attention_seconds) const {
  const std::string who = "AttentionModel::forward(ids, caches): ";
  if (caches.size() != layers.size())
    throw Error(who + std::to_string(caches.size()) + " caches for " + std::to_string(layers.size()) +
                " layers: use make_caches");
  const int64_t offset = caches.empty() ? 0 : caches.front().length();
  for (const nn::KVCache& cache : caches)
    for (int64_t l : cache.lengths())
      if (l != offset) throw Error(who + "the caches hold different lengths; every sequence must be at the same position");
  if (batch < 1 || length < 1 || offset + length > config_.max_len ||
      static_cast<int64_t>(ids.size()) != batch * length)
    throw Error(who + std::to_string(ids.size()) + " ids for batch " + std::to_string(batch) + " x length " +
                std::to_string(length) + " after " + std::to_string(offset) + " cached positions (max_len " +
                std::to_string(config_.max_len) + ")");
  // ---- 1. x = embedding(ids) + pe at the positions offset .. offset + length
  Tensor x = embedding.forward(ids, {batch, length});
  if (config_.positions == Positions::Sinusoidal) x = add_positions(x, positions.encoding(), offset);
  // ---- 2. per layer: x = x + attention(norm(x)), the layer's keys and values from its cache
  for (size_t l = 0; l < layers.size(); ++l) {
    const Tensor normed = layers[l].norm.forward(x);
    const auto start = std::chrono::steady_clock::now();
    const Tensor attended = mask_.is_none() ? layers[l].attention.forward(normed, caches[l]).output
                                            : masked_cached_attention(layers[l].attention, normed, caches[l], mask_);
    if (attention_seconds) *attention_seconds += seconds_since(start);
    x = add(x, attended);
  }
  // ---- 3. logits = head(final_norm(x))
  return head.forward(final_norm.forward(x));
}
}  // namespace qkv::train
