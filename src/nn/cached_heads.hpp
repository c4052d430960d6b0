// The first steps of a cached forward (mha_cache.cpp on a KVCache, mha_paged.cpp on a
// PagedKVCache), shared: project the new tokens x (B, N, embed_dim), split them into heads and
// rotate them to their positions (token n of element b at before[b] + n).
#pragma once

#include <cstdint>
#include <vector>

#include "qkv/nn.hpp"

namespace qkv::nn {

struct CachedHeads {
  Tensor q;     // (B, Hq, N, hd), a transposed view
  Tensor k, v;  // (B, Hkv, N, hd), transposed views
};

inline CachedHeads project_cached_heads(const MultiHeadAttention& m, const Tensor& x, const std::vector<int64_t>& before) {
  const int64_t batch = x.size(0), len = x.size(1), hd = m.head_dim();
  CachedHeads h{m.q_proj.apply(x).reshape({batch, len, m.num_heads(), hd}).transpose(1, 2),
                m.k_proj.apply(x).reshape({batch, len, m.num_kv_heads(), hd}).transpose(1, 2),
                m.v_proj.apply(x).reshape({batch, len, m.num_kv_heads(), hd}).transpose(1, 2)};
  if (const RotaryEmbedding* rotary = m.rotary()) {
    rotary->apply_inplace(h.q, before);
    rotary->apply_inplace(h.k, before);
  }
  return h;
}

}  // namespace qkv::nn
