// MultiHeadAttention on a paged KV cache (include/qkv/nn.hpp, include/qkv/paged_cache.hpp): project
// the new tokens, rotate them to their sequences' positions, append each element's keys and values
// to its sequence's pages, attend over the pages in place (block_table / cache_seqlens: query i of
// sequence b at position length_b - N + i, where causal aligns it), then project out.
#include <string>
#include <vector>

#include "nn/cached_heads.hpp"
#include "nn/module_lock.hpp"
#include "qkv/error.hpp"
#include "qkv/nn.hpp"
#include "qkv/paged_cache.hpp"

namespace qkv::nn {

MultiHeadAttentionOutput MultiHeadAttention::forward(const Tensor& x, PagedKVCache& cache,
                                                     const std::vector<int64_t>& sequences) const {
  const std::shared_lock lock(lock_.mutex().mutex);  // reads the module only
  const char* who = "MultiHeadAttention::forward(x, paged cache): ";
  if (relative_position_bias || options_.attention == AttentionKind::Linear)
    throw Error(std::string(who) + "takes softmax attention without relative_position_bias");
  if (!x.defined() || x.dim() != 3 || x.size(2) != embed_dim_ || x.size(0) != static_cast<int64_t>(sequences.size()))
    throw Error(std::string(who) + "x is " + (x.defined() ? x.shape().str() : std::string("undefined")) +
                " but should be (B, N, " + std::to_string(embed_dim_) + ") with B = " +
                std::to_string(sequences.size()) + " sequences");
  const int64_t batch = x.size(0), len = x.size(1), hd = head_dim();
  std::vector<int64_t> before;
  for (int64_t id : sequences) before.push_back(cache.length(id));

  // ---- 1. project, 2. split into heads, 2b. rotate to the tokens' positions
  const CachedHeads heads = project_cached_heads(*this, x, before);
  const Tensor &q = heads.q, &k = heads.k, &v = heads.v;
  // ---- 3. append each element's rows to its sequence, attend over the pages
  for (int64_t b = 0; b < batch; ++b)
    cache.append(sequences[static_cast<size_t>(b)], k.narrow(0, b, 1).squeeze(0), v.narrow(0, b, 1).squeeze(0));
  AttentionOptions attention;
  attention.mask = Mask::causal();  // bottom-right: query i at position before[b] + i
  attention.softcap = options_.softcap;
  attention.alibi_slopes = alibi_slopes_;
  attention.sinks = sinks;
  cache.set_paged_options(sequences, attention);
  const Tensor concatenated = Tensor::empty({batch, len, num_heads_, hd});
  AttentionResult result;
  result.output = concatenated.transpose(1, 2);  // (B, H, N, hd), written by the core
  scaled_dot_product_attention_into(q, cache.key_pool(), cache.value_pool(), result, attention);
  // ---- 4. the heads side by side (already), 5. output projection
  MultiHeadAttentionOutput out;
  out.output = out_proj.apply(concatenated.reshape({batch, len, embed_dim_}));
  return out;
}

}  // namespace qkv::nn
