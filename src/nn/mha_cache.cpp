// MultiHeadAttention with a KV cache (include/qkv/nn.hpp, include/qkv/inference.hpp): project the
// new tokens, rotate them to their positions, append their keys and values to the cache and
// attend over the cache in place (its (B, Hkv, len, D) slice is a strided view the kernels read
// as it is), then project out. Decode steps (one token) land on the decode kernel, which reads a
// bf16 / f16 cache in its own dtype.
#include <algorithm>
#include <string>

#include "nn/module_lock.hpp"
#include "qkv/nn.hpp"

namespace qkv::nn {

namespace {
constexpr const char* kWho = "MultiHeadAttention::forward(x, cache): ";

// keep[b, 0, i, j] = 1 where query i of element b (at position before[b] + i) may see key j:
// j <= before[b] + i and j < before[b] + counts[b].
Tensor ragged_keep(const std::vector<int64_t>& before, const std::vector<int64_t>& counts, int64_t len, int64_t keys) {
  const int64_t batch = static_cast<int64_t>(before.size());
  Tensor keep = Tensor::zeros({batch, 1, len, keys});
  float* data = keep.data();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t total = before[static_cast<size_t>(b)] + counts[static_cast<size_t>(b)];
    for (int64_t i = 0; i < len; ++i)
      for (int64_t j = 0; j < std::min(total, before[static_cast<size_t>(b)] + i + 1); ++j)
        data[(b * len + i) * keys + j] = 1.0f;
  }
  return keep;
}
}  // namespace

KVCache MultiHeadAttention::make_cache(int64_t batch, int64_t capacity, DType dtype, int64_t window) const {
  return KVCache(batch, num_kv_heads_, capacity, head_dim(), dtype, window);
}

MultiHeadAttentionOutput MultiHeadAttention::forward(const Tensor& x, KVCache& cache,
                                                     const std::vector<int64_t>& counts) const {
  const std::shared_lock lock(lock_.mutex().mutex);  // reads the module only (include/qkv/nn.hpp)
  if (!x.defined() || x.dim() < 2 || x.dim() > 3 || x.size(-1) != embed_dim_)
    throw Error(std::string(kWho) + "x is " + (x.defined() ? x.shape().str() : std::string("undefined")) +
                " but should be (B, N, " + std::to_string(embed_dim_) + ") or (N, " + std::to_string(embed_dim_) + ")");
  if (options_.attention == AttentionKind::Linear)
    throw Error(std::string(kWho) + "a KV cache serves softmax attention; this layer uses linear attention, whose "
                "state is not cached yet: call forward(x) on the whole sequence");
  const bool unbatched = x.dim() == 2;
  const Tensor x_in = unbatched ? x.unsqueeze(0) : x;
  const int64_t batch = x_in.size(0), len = x_in.size(1), hd = head_dim();
  if (!cache.defined() || cache.batch() != batch || cache.kv_heads() != num_kv_heads_ || cache.head_dim() != hd)
    throw Error(std::string(kWho) + "the cache holds (" + std::to_string(cache.batch()) + ", " +
                std::to_string(cache.kv_heads()) + ", capacity, " + std::to_string(cache.head_dim()) +
                ") but this layer needs (" + std::to_string(batch) + ", " + std::to_string(num_kv_heads_) +
                ", capacity, " + std::to_string(hd) + "): use make_cache");
  std::vector<int64_t> count = counts.empty() ? std::vector<int64_t>(static_cast<size_t>(batch), len) : counts;
  const std::vector<int64_t> before = cache.lengths();
  const bool uniform = std::all_of(count.begin(), count.end(), [&](int64_t c) { return c == len; }) &&
                       std::all_of(before.begin(), before.end(), [&](int64_t l) { return l == before[0]; });
  const bool ring = cache.window() > 0;
  if (ring && !uniform)
    throw Error(std::string(kWho) + "a ring-buffer cache needs every batch element at the same position");
  if (alibi_slopes_.defined() && (ring || !uniform))
    throw Error(std::string(kWho) + "ALiBi needs each key's index to be its position: not with a ring buffer or "
                "ragged lengths");

  // ---- 1. project, 2. split into heads, 2b. rotate to the tokens' positions
  const Tensor q = q_proj.apply(x_in).reshape({batch, len, num_heads_, hd}).transpose(1, 2);
  const Tensor k = k_proj.apply(x_in).reshape({batch, len, num_kv_heads_, hd}).transpose(1, 2);
  const Tensor v = v_proj.apply(x_in).reshape({batch, len, num_kv_heads_, hd}).transpose(1, 2);
  if (rotary_) {
    rotary_->apply_inplace(q, before);
    rotary_->apply_inplace(k, before);
  }

  AttentionOptions attention;
  attention.softcap = options_.softcap;
  attention.alibi_slopes = alibi_slopes_;
  attention.sinks = sinks;
  attention.precision = options_.precision;
  const Tensor concatenated = Tensor::empty({batch, len, num_heads_, hd});
  const Tensor heads_out = concatenated.transpose(1, 2);  // (B, H, N, hd), written by the core
  if (ring) {
    // ---- 3. append and attend one token at a time: the ring then holds exactly the window of
    // positions the token sees (its own and the window - 1 before it), in any order.
    for (int64_t t = 0; t < len; ++t) {
      cache.append(k.narrow(2, t, 1), v.narrow(2, t, 1));
      const int64_t visible = std::min(cache.length(), cache.window());
      AttentionResult result;
      result.output = heads_out.narrow(2, t, 1);
      scaled_dot_product_attention_into(q.narrow(2, t, 1), cache.keys(visible), cache.values(visible), result, attention);
    }
  } else {
    // ---- 3. append (in place, checked against the capacity first), attend over the cache's slice
    cache.append(k, v, count);
    int64_t keys = 0;
    for (size_t b = 0; b < before.size(); ++b) keys = std::max(keys, before[b] + count[b]);
    attention.mask = uniform ? Mask::causal(before[0]) : Mask::keep(ragged_keep(before, count, len, keys));
    AttentionResult result;
    result.output = heads_out;
    scaled_dot_product_attention_into(q, cache.keys(keys), cache.values(keys), result, attention);
  }
  // ---- 4. the heads side by side (already), 5. output projection
  MultiHeadAttentionOutput out;
  out.output = out_proj.apply(concatenated.reshape({batch, len, embed_dim_}));
  if (unbatched) out.output = out.output.squeeze(0);
  return out;
}

}  // namespace qkv::nn
