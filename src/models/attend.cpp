// qkv::models::detail::attend (network.hpp): every architecture's attention, on qkv's
// scaled_dot_product_attention over a qkv::nn::KVCache (a packed pass's: attend_packed.cpp). The
// mask says what the architecture means: causal from the cache's position (or a sliding window of
// the last `window` positions, Mistral), or both ways (BERT), and-ed with the padding of a ragged
// batch.
#include <algorithm>
#include <string>

#include "models/network.hpp"
#include "qkv/attention.hpp"

namespace qkv::models::detail {

bool Pass::ragged() const {
  return std::any_of(counts.begin(), counts.end(), [&](int64_t c) { return c != length; });
}

int64_t Pass::rows() const { return packed ? offsets.back() : batch * length; }

std::vector<int64_t> Pass::row_positions() const {
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(rows()));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t n = 0; n < (packed ? counts[static_cast<size_t>(b)] : length); ++n)
      out.push_back((packed ? positions[static_cast<size_t>(b)] : position) + n);
  return out;
}

Pass packed_pass(const std::vector<std::vector<int64_t>>& ids) {
  Pass pass;
  pass.packed = true;
  pass.batch = static_cast<int64_t>(ids.size());
  pass.offsets = {0};
  for (const auto& sequence : ids) {
    pass.counts.push_back(static_cast<int64_t>(sequence.size()));
    pass.length = std::max(pass.length, pass.counts.back());
    pass.offsets.push_back(pass.offsets.back() + pass.counts.back());
    pass.ids.insert(pass.ids.end(), sequence.begin(), sequence.end());
  }
  pass.positions.assign(ids.size(), 0);
  return pass;
}

Tensor heads_view(const Tensor& x, const Pass& pass, int64_t first, int64_t heads, int64_t head_dim) {
  const int64_t width = x.size(1);
  if (pass.packed) return x.reshape({x.size(0), width / head_dim, head_dim}).narrow(1, first / head_dim, heads);
  return x.reshape({pass.batch, pass.length, width / head_dim, head_dim})
      .narrow(2, first / head_dim, heads)
      .transpose(1, 2);
}

namespace {

// Query i (position pass.position + i) of element b sees key j when the architecture's rule allows
// it and j < pass.position + counts[b].
Mask mask_of(const Pass& pass, const AttentionSpec& spec) {
  Mask mask;
  if (spec.causal)
    mask = spec.window > 0 ? Mask::window(spec.window - 1, 0, pass.position) : Mask::causal(pass.position);
  if (pass.ragged()) {
    std::vector<int64_t> lengths = pass.counts;
    for (int64_t& l : lengths) l += pass.position;
    mask &= Mask::key_lengths(std::move(lengths));
  }
  return mask;
}

// The rows of padded queries (i >= counts[b]) of weights (B, H, N, K) set to zero.
void zero_padded_rows(const Tensor& weights, const Pass& pass) {
  const int64_t heads = weights.size(1), keys = weights.size(3);
  float* w = weights.data();
  for (int64_t b = 0; b < pass.batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = pass.counts[static_cast<size_t>(b)]; i < pass.length; ++i)
        std::fill_n(w + ((b * heads + h) * pass.length + i) * keys, keys, 0.0f);
}

}  // namespace

void attend(const Tensor& q, const Tensor& k, const Tensor& v, const Pass& pass, int64_t layer,
            const AttentionSpec& spec, const Tensor& out) {
  if (pass.packed) return attend_packed(q, k, v, pass, layer, spec, out);
  nn::KVCache& cache = (*pass.caches)[static_cast<size_t>(layer)];
  if (spec.rotary != nullptr) {
    spec.rotary->apply_inplace(q, {pass.position});
    spec.rotary->apply_inplace(k, {pass.position});
  }
  if (pass.queries != nullptr) *pass.queries = q.clone();
  if (pass.keys != nullptr) *pass.keys = k.clone();
  cache.append(k, v, pass.counts);
  const int64_t keys = pass.position + pass.length;
  AttentionOptions options;
  options.mask = mask_of(pass, spec);
  options.need_weights = pass.attention != nullptr;
  options.k_scales = cache.key_scales(keys);  // undefined unless the cache is quantized
  options.v_scales = cache.value_scales(keys);
  AttentionResult result;
  result.output = out;
  scaled_dot_product_attention_into(q, cache.keys(keys), cache.values(keys), result, options);
  if (pass.attention != nullptr) {
    zero_padded_rows(result.weights, pass);
    pass.attention->push_back(result.weights);
  }
}

}  // namespace qkv::models::detail
