// qkv::models::detail::attend_packed (network.hpp): a packed pass's attention, with no padding
// anywhere. Each element's rows are rotated to its own positions and appended to its sequence's
// pages; then
//  - when every element is a whole sequence (a forward, or the prefill of fresh sequences), all
//    attend to their own new keys in one varlen call (cu_seqlens): the flash kernel on each. With
//    a cache, to the keys and values as the cache holds them (rounded to 16 bits, or quantized and
//    back), so a prompt sees what its later tokens will read, as generate()'s prefill does;
//  - else each element's queries attend over its sequence's pages in place (block_table): one
//    paged call for the whole batch when each element brings one token (a decode step), else one
//    paged call per element.
// Either way the architecture's band is aligned by the call to the end of each sequence's keys,
// which is where its new tokens sit.
#include <algorithm>
#include <string>

#include "models/network.hpp"
#include "qkv/attention.hpp"
#include "qkv/error.hpp"
#include "qkv/quantize.hpp"

namespace qkv::models::detail {

namespace {

Mask band_of(const AttentionSpec& spec) {
  if (!spec.causal) return Mask();
  return spec.window > 0 ? Mask::window(spec.window - 1, 0) : Mask::causal();
}

// x (rows, H, hd) f32 as a pool of `dtype` holds it, in f32: rounded to 16 bits, or quantized and
// dequantised with the pool's own rows (qkv::quantize_kv), exactly as attention then reads them.
Tensor as_stored(const Tensor& x, DType dtype) {
  if (dtype == DType::F32) return x;
  if (is_quantized(dtype)) return dequantize_kv(quantize_kv(x, dtype));
  return x.to(dtype).to(DType::F32);
}

// Rows [start, start + n) of a (rows, H, hd) view, as the (1, H, n, hd) view of one element.
Tensor element_rows(const Tensor& t, int64_t start, int64_t n) {
  return t.narrow(0, start, n).transpose(0, 1).unsqueeze(0);
}

}  // namespace

void attend_packed(const Tensor& q, const Tensor& k, const Tensor& v, const Pass& pass, int64_t layer,
                   const AttentionSpec& spec, const Tensor& out) {
  if (pass.attention != nullptr || pass.queries != nullptr || pass.keys != nullptr)
    throw Error("attend_packed: weights and query/key captures are taken on padded passes only");
  const auto at = [](const std::vector<int64_t>& list, int64_t b) { return list[static_cast<size_t>(b)]; };
  if (spec.rotary != nullptr)
    for (int64_t b = 0; b < pass.batch; ++b) {
      spec.rotary->apply_inplace(element_rows(q, at(pass.offsets, b), at(pass.counts, b)), {at(pass.positions, b)});
      spec.rotary->apply_inplace(element_rows(k, at(pass.offsets, b), at(pass.counts, b)), {at(pass.positions, b)});
    }
  nn::PagedKVCache* cache = pass.paged != nullptr ? &(*pass.paged)[static_cast<size_t>(layer)] : nullptr;
  if (cache != nullptr)
    for (int64_t b = 0; b < pass.batch; ++b) {
      const int64_t start = at(pass.offsets, b), n = at(pass.counts, b);
      cache->append(at(pass.sequences, b), k.narrow(0, start, n).transpose(0, 1), v.narrow(0, start, n).transpose(0, 1));
    }
  AttentionOptions options;
  options.mask = band_of(spec);
  AttentionResult result;
  const bool whole = std::all_of(pass.positions.begin(), pass.positions.end(), [](int64_t p) { return p == 0; });
  if (whole) {
    options.cu_seqlens_q = options.cu_seqlens_k = pass.offsets;
    result.output = out;
    const DType stored = cache != nullptr ? cache->key_pool().dtype() : DType::F32;
    scaled_dot_product_attention_into(q, as_stored(k, stored), as_stored(v, stored), result, options);
    return;
  }
  if (cache == nullptr) throw Error("attend_packed: elements past position 0 need the pass's paged caches");
  if (std::all_of(pass.counts.begin(), pass.counts.end(), [](int64_t n) { return n == 1; })) {
    cache->set_paged_options(pass.sequences, options);
    result.output = out.unsqueeze(2);  // (B, H, 1, hd): row b is element b's one token
    scaled_dot_product_attention_into(q.unsqueeze(2), cache->key_pool(), cache->value_pool(), result, options);
    return;
  }
  for (int64_t b = 0; b < pass.batch; ++b) {
    const int64_t start = at(pass.offsets, b), n = at(pass.counts, b);
    AttentionOptions own = options;
    cache->set_paged_options({at(pass.sequences, b)}, own);
    AttentionResult part;
    part.output = element_rows(out, start, n);
    scaled_dot_product_attention_into(element_rows(q, start, n), cache->key_pool(), cache->value_pool(), part, own);
  }
}

}  // namespace qkv::models::detail
