// Attention on one block of a longer sequence: scaled_dot_product_attention_into and its backward
// for a (query block, key block) pair cut out of a sequence, as ring attention (src/dist/) computes
// them. Everything a single call means is unchanged except where ALiBi puts the queries:
//   s <- s - slope[h] * |i + Nk - Nq + alibi_shift - j|
// with i and j the block's local rows and Nq, Nk the block's lengths. A block whose first query
// and key sit at rows qs and ks of a sequence of Nq' queries and Nk' keys gets the distances of
// the whole sequence with alibi_shift = (qs - ks) + (Nk' - Nq') - (Nk - Nq). Causal, window and key lengths need no such field: a Mask carries its
// own offset. Internal on purpose: AttentionOptions says what one call on a whole sequence
// means, and a public shift would be one more way to get ALiBi wrong.
#pragma once

#include <cstdint>

#include "qkv/attention.hpp"

namespace qkv::detail {

void block_attention_into(const Tensor& q, const Tensor& k, const Tensor& v, AttentionResult& result,
                          const AttentionOptions& options, int64_t alibi_shift);

// forward.lse is the whole row's (every key block's): rows whose lse lost precision are not
// restored from a pass over this block, whose max and sum are the block's, not the row's.
void block_attention_backward_into(const Tensor& grad_output, const Tensor& q, const Tensor& k, const Tensor& v,
                                   const AttentionResult& forward, AttentionGrads& grads,
                                   const AttentionOptions& options, int64_t alibi_shift);

}  // namespace qkv::detail
