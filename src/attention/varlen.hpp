// Packed variable-length batches (AttentionOptions::cu_seqlens_q / cu_seqlens_k, FlashAttention's
// varlen convention): the entry points scaled_dot_product_attention(_backward)_into hand such a
// call to (varlen.cpp), and the one-sequence calls those make (dispatch.cpp).
#pragma once

#include <memory>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/mask.hpp"

namespace qkv::detail {

// Whether options describe a packed batch (either offset list given; varlen.cpp checks both).
inline bool is_varlen(const AttentionOptions& options) {
  return !options.cu_seqlens_q.empty() || !options.cu_seqlens_k.empty();
}

// The packed batch: q (total_q, Hq, Dk), k (total_k, Hkv, Dk), v (total_k, Hkv, Dv); result.output
// (total_q, Hq, Dv), result.lse / row_max / row_sum (Hq, total_q). Each sequence runs as
// sequence_attention_into on views of its rows (its output rows written in place).
void varlen_attention_into(const Tensor& q, const Tensor& k, const Tensor& v, AttentionResult& result,
                           const AttentionOptions& options);
// Its backward: grad_output and forward.output (total_q, Hq, Dv), forward.lse (Hq, total_q);
// grads.dq, dk, dv shaped as q, k, v (the rows of a sequence with no queries or no keys zeroed),
// dsinks (Hq) summed over the sequences.
void varlen_attention_backward_into(const Tensor& grad_output, const Tensor& q, const Tensor& k, const Tensor& v,
                                    const AttentionResult& forward, AttentionGrads& grads,
                                    const AttentionOptions& options);

// The packed batch's offsets after every check of the varlen entry (operands, offsets, options):
// sequence b holds query rows [q_starts[b], q_starts[b + 1]) and key rows likewise.
struct PackedSequences {
  std::vector<int64_t> q_starts, k_starts;
};
PackedSequences checked_sequences(const char* who, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const AttentionOptions& options);

// What a call made of per-sequence calls (a packed batch, paged K/V) does not take, each refusal
// naming the option and `by` (the options that made it per-sequence): need_weights, summaries,
// tensor masks, key_lengths, score and mask functions, rules that read by position, quantized K/V;
// (B, Hq) ALiBi slopes must have `batch` rows.
void check_sequence_options(const char* who, const AttentionOptions& options, int64_t batch, const char* by);
// Whether the rule tree holds a leaf that reads tensors or a function by (b, i, j): each sequence
// runs as batch 0 with its own i and j, so such a leaf would read the first sequence's rows for all.
bool reads_by_position(const std::shared_ptr<const Mask::Rule>& rule);
// Sequence b's options: no offsets or pages, its row of (B, Hq) ALiBi slopes, its own dropout
// stream (seed + b).
AttentionOptions sequence_options(const AttentionOptions& options, int64_t b);

// One sequence of a packed batch, (1, H, N, D) views: scaled_dot_product_attention_into and its
// backward with the mask's band aligned to the end of the keys (align_band_to_end, problem.hpp).
void sequence_attention_into(const Tensor& q, const Tensor& k, const Tensor& v, AttentionResult& result,
                             const AttentionOptions& options);
void sequence_attention_backward_into(const Tensor& grad_output, const Tensor& q, const Tensor& k, const Tensor& v,
                                      const AttentionResult& forward, AttentionGrads& grads,
                                      const AttentionOptions& options);

}  // namespace qkv::detail
