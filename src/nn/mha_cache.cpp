// MultiHeadAttention with a KV cache (include/qkv/nn.hpp, include/qkv/inference.hpp): project the
// new tokens, rotate them to their positions, append their keys and values to the cache and
// attend over the cache in place (its (B, Hkv, len, D) slice is a strided view the kernels read
// as it is), then project out. Decode steps (one token) land on the decode kernel, which reads a
// bf16 / f16 cache in its own dtype, an int8 / int4 one a dequantised tile at a time.
#include <algorithm>
#include <string>

#include "nn/cached_heads.hpp"
#include "nn/module_lock.hpp"
#include "qkv/error.hpp"
#include "qkv/nn.hpp"
#include "qkv/paged_cache.hpp"

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

// A cached call's tokens and positions, checked against the layer and the cache: x as (B, N, E),
// each element's new tokens (count) and cached ones before them, whether all line up (uniform:
// one causal offset serves every element) and whether the cache is a ring buffer.
struct CachedCall {
  Tensor x;
  int64_t batch, len;
  std::vector<int64_t> count, before;
  bool uniform, ring;
};
CachedCall check_cached_call(const Tensor& x, const KVCache& cache, const std::vector<int64_t>& counts,
                             int64_t embed_dim, int64_t kv_heads, int64_t hd, bool linear, bool alibi,
                             bool relative_bias) {
  if (!x.defined() || x.dim() < 2 || x.dim() > 3 || x.size(-1) != embed_dim)
    throw Error(std::string(kWho) + "x is " + (x.defined() ? x.shape().str() : std::string("undefined")) +
                " but should be (B, N, " + std::to_string(embed_dim) + ") or (N, " + std::to_string(embed_dim) + ")");
  if (linear)
    throw Error(std::string(kWho) + "a KV cache serves softmax attention; this layer uses linear attention, whose "
                "state is not cached yet: call forward(x) on the whole sequence");
  CachedCall call;
  call.x = x.dim() == 2 ? x.unsqueeze(0) : x;
  call.batch = call.x.size(0);
  call.len = call.x.size(1);
  if (!cache.defined() || cache.batch() != call.batch || cache.kv_heads() != kv_heads || cache.head_dim() != hd)
    throw Error(std::string(kWho) + "the cache holds (" + std::to_string(cache.batch()) + ", " +
                std::to_string(cache.kv_heads()) + ", capacity, " + std::to_string(cache.head_dim()) +
                ") but this layer needs (" + std::to_string(call.batch) + ", " + std::to_string(kv_heads) +
                ", capacity, " + std::to_string(hd) + "): use make_cache");
  call.count = counts.empty() ? std::vector<int64_t>(static_cast<size_t>(call.batch), call.len) : counts;
  call.before = cache.lengths();
  const auto& before = call.before;
  call.uniform = std::all_of(call.count.begin(), call.count.end(), [&](int64_t c) { return c == call.len; }) &&
                 std::all_of(before.begin(), before.end(), [&](int64_t l) { return l == before[0]; });
  call.ring = cache.window() > 0;
  if (call.ring && !call.uniform)
    throw Error(std::string(kWho) + "a ring-buffer cache needs every batch element at the same position");
  if (alibi && (call.ring || !call.uniform))
    throw Error(std::string(kWho) + "ALiBi needs each key's index to be its position: not with a ring buffer or "
                "ragged lengths");
  if (relative_bias && call.ring)
    throw Error(std::string(kWho) + "relative_position_bias reads each key's position from its index in the cache: "
                "not with a ring-buffer cache (its slots hold positions in no fixed order)");
  return call;
}

// The T5 relative-position bias of a cached call's new queries (element b's at positions
// before[b] ..) over the cache's first `keys` keys (key j at position j): (1, H, len, keys) when
// every element is at the same position, else (B, H, len, keys), one offset per element. Not
// with a ring buffer (check_cached_call refuses it).
Tensor cached_relative_bias(const RelativePositionBias& bias, const CachedCall& call, int64_t keys) {
  if (call.uniform) return bias.bias(call.len, keys, call.before[0]);
  const Tensor first = bias.bias(call.len, keys, call.before[0]);
  const int64_t per_element = first.numel();
  Tensor out = Tensor::empty({call.batch, first.size(1), call.len, keys});
  for (int64_t b = 0; b < call.batch; ++b) {
    const Tensor element = b == 0 ? first : bias.bias(call.len, keys, call.before[static_cast<size_t>(b)]);
    std::copy(element.data(), element.data() + per_element, out.data() + b * per_element);
  }
  return out;
}
}  // namespace

KVCache MultiHeadAttention::make_cache(int64_t batch, int64_t capacity, DType dtype, int64_t window,
                                       int64_t page_size) const {
  return KVCache(batch, num_kv_heads_, capacity, head_dim(), dtype, window, page_size);
}

MultiHeadAttentionOutput MultiHeadAttention::forward(const Tensor& x, KVCache& cache,
                                                     const std::vector<int64_t>& counts) const {
  if (PagedKVCache* pool = cache.paged()) {
    // A paged KVCache: element b continues the pool's sequence sequences()[b] (mha_paged.cpp),
    // whole rows only, within the cache's capacity (the pool holds exactly that many pages).
    const Tensor x3 = x.defined() && x.dim() == 2 ? x.unsqueeze(0) : x;
    if (x3.defined() && x3.dim() == 3) {
      const int64_t len = x3.size(1);
      if (x3.size(0) != cache.batch())
        throw Error(std::string(kWho) + "x is " + x.shape().str() + " but the cache holds a batch of " +
                    std::to_string(cache.batch()) + ": use make_cache");
      if (std::any_of(counts.begin(), counts.end(), [&](int64_t c) { return c != len; }))
        throw Error(std::string(kWho) + "a paged cache takes every element's " + std::to_string(len) +
                    " tokens (no counts): its sequences grow by whole rows");
      if (!counts.empty() && static_cast<int64_t>(counts.size()) != cache.batch())
        throw Error(std::string(kWho) + std::to_string(counts.size()) + " counts for a batch of " +
                    std::to_string(cache.batch()));
      for (int64_t b = 0; b < cache.batch(); ++b)
        if (cache.length(b) + len > cache.capacity())
          throw Error(std::string(kWho) + "batch element " + std::to_string(b) + " holds " +
                      std::to_string(cache.length(b)) + " positions; " + std::to_string(len) +
                      " more exceed the capacity " + std::to_string(cache.capacity()));
    }
    MultiHeadAttentionOutput out = forward(x3, *pool, cache.sequences());
    if (x.dim() == 2) out.output = out.output.squeeze(0);
    return out;
  }
  const std::shared_lock lock(lock_.mutex().mutex);  // reads the module only (include/qkv/nn.hpp)
  const int64_t hd = head_dim();
  const CachedCall call = check_cached_call(x, cache, counts, embed_dim_, num_kv_heads_, hd,
                                            options_.attention == AttentionKind::Linear, alibi_slopes_.defined(),
                                            relative_position_bias.has_value());
  const Tensor& x_in = call.x;
  const int64_t batch = call.batch, len = call.len;
  const std::vector<int64_t>& before = call.before;
  const std::vector<int64_t>& count = call.count;
  const bool uniform = call.uniform, ring = call.ring;

  // ---- 1. project, 2. split into heads, 2b. rotate to the tokens' positions
  const CachedHeads heads = project_cached_heads(*this, x_in, before);
  const Tensor &q = heads.q, &k = heads.k, &v = heads.v;

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
      attention.k_scales = cache.key_scales(visible);  // undefined unless the cache is quantized
      attention.v_scales = cache.value_scales(visible);
      scaled_dot_product_attention_into(q.narrow(2, t, 1), cache.keys(visible), cache.values(visible), result, attention);
    }
  } else {
    // ---- 3. append (in place, checked against the capacity first), attend over the cache's slice
    cache.append(k, v, count);
    int64_t keys = 0;
    for (size_t b = 0; b < before.size(); ++b) keys = std::max(keys, before[b] + count[b]);
    attention.mask = uniform ? Mask::causal(before[0]) : Mask::keep(ragged_keep(before, count, len, keys));
    if (relative_position_bias) attention.mask &= Mask::additive(cached_relative_bias(*relative_position_bias, call, keys));
    AttentionResult result;
    result.output = heads_out;
    attention.k_scales = cache.key_scales(keys);
    attention.v_scales = cache.value_scales(keys);
    scaled_dot_product_attention_into(q, cache.keys(keys), cache.values(keys), result, attention);
  }
  // ---- 4. the heads side by side (already), 5. output projection
  MultiHeadAttentionOutput out;
  out.output = out_proj.apply(concatenated.reshape({batch, len, embed_dim_}));
  if (x.dim() == 2) out.output = out.output.squeeze(0);
  return out;
}

}  // namespace qkv::nn
