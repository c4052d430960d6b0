// MultiHeadAttention on a paged KV cache (include/qkv/nn.hpp, include/qkv/paged_cache.hpp): project
// the new tokens, rotate them to their sequences' positions, append each element's keys and values
// to its sequence's pages, attend over the pages in place (block_table / cache_seqlens: query i of
// sequence b at position length_b - N + i, where causal aligns it), then project out.
#include <cmath>
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
  if (batch == 0) return {.output = Tensor::empty({0, len, embed_dim_}), .weights = {}};
  // Checked before anything is appended, so that a refused call leaves every sequence as it was:
  // each sequence once (two elements of one sequence would each see the other's keys), and pages
  // for the whole batch (counted per element: stricter than needed when forks share a last page).
  std::vector<int64_t> before;
  int64_t needed = 0;
  for (size_t b = 0; b < sequences.size(); ++b) {
    for (size_t a = 0; a < b; ++a)
      if (sequences[a] == sequences[b])
        throw Error(std::string(who) + "sequence " + std::to_string(sequences[b]) + " is batch elements " +
                    std::to_string(a) + " and " + std::to_string(b) + ": each sequence may appear once");
    before.push_back(cache.length(sequences[b]));
    needed += cache.pages_needed(sequences[b], len);
  }
  if (needed > cache.free_pages())
    throw Error(std::string(who) + "appending " + std::to_string(len) + " positions to each of " +
                std::to_string(batch) + " sequences needs " + std::to_string(needed) + " free pages but the pool has " +
                std::to_string(cache.free_pages()));

  // ---- 1. project, 2. split into heads, 2b. rotate to the tokens' positions
  const CachedHeads heads = project_cached_heads(*this, x, before);
  const Tensor &q = heads.q, &k = heads.k, &v = heads.v;
  if (is_quantized(cache.key_pool().dtype()))  // the cache refuses non-finite rows: before any append
    for (auto [t, name] : {std::pair{&k, "keys"}, {&v, "values"}})
      for (float e : t->contiguous().to_vector())
        if (!std::isfinite(e))
          throw Error(std::string(who) + "the projected " + name + " hold " + std::to_string(e) +
                      ": a quantized cache needs finite keys and values");
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
