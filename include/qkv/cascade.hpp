// Shared-prefix (cascade) attention: B sequences that share a prompt prefix keep one copy of its
// keys and values and attend to it in one pass for all their queries (FlashInfer's cascade /
// MultiLevelCascadeAttentionWrapper, vLLM's cascade_attention), merged through the log-sum-exp
// with each sequence's own suffix. docs/inference.md, "Shared-prefix (cascade) decoding".
#pragma once

#include "qkv/attention.hpp"
#include "qkv/tensor.hpp"

namespace qkv {

// Sequence b attends to concat(prefix, suffix[b]), as scaled_dot_product_attention of q[b] over
// those keys would, with its Nq queries the last Nq positions of that sequence:
//   q         (B, Hq, Nq, Dk)    float32; Nq = 1 for a decode step
//   prefix_k  (1, Hkv, Np, Dk)   one copy of the shared prefix (Np >= 0)
//   prefix_v  (1, Hkv, Np, Dv)
//   suffix_k  (B, Hkv, Ns, Dk)   each sequence's own keys, the first suffix_lengths[b] of them
//   suffix_v  (B, Hkv, Ns, Dv)   (Ns >= 0)
// Hq a multiple of Hkv (grouped-query heads, nothing copied). K/V float32, bf16 or f16 (prefix and
// suffix each one dtype of their own), any views whose last dim is contiguous.
//
// options, the fields of one attention call that cascade takes:
//   mask: none; Mask::causal() (query i of sequence b at position Np + L_b - Nq + i sees the
//         positions at or before its own: FlashAttention's bottom-right causal, as
//         flash_attn_with_kvcache; it needs L_b >= Nq - 1, so that every query sees the whole
//         prefix); Mask::key_lengths(L) with L[b] in [0, Ns], the suffix lengths (vLLM's
//         suffix_kv_lens; absent: every sequence holds all Ns); or causal & key_lengths.
//   scale, softcap, sinks (Hq: counted once per row, in the merge), backend (of both passes),
//   precision.
// Refused with a qkv::Error: other masks, dropout, need_weights, ALiBi (the one prefix pass
// cannot give each sequence its own distances), score/mask functions, summaries, quantized K/V,
// cu_seqlens. Forward only: there is no backward.
//
// Returns output (B, Hq, Nq, Dv) and lse (B, Hq, Nq) with scaled_dot_product_attention's meanings
// (a row that sees no key and no sink: output 0, lse -inf); no weights, row_max or row_sum.
//
// How: (1) all B Nq query rows of each head attend to the prefix in one call, q stacked as
// (1, Hq, B Nq, Dk): the prefix's K/V is read once for every sequence (decode's row tile, or
// flash for many rows); (2) each sequence's queries attend to its own suffix (one call with key
// lengths, or one per sequence where causal or ragged lengths need their own band); (3) each row
// merges the two results and the sink through the log-sum-exp.
AttentionResult cascade_attention(const Tensor& q, const Tensor& prefix_k, const Tensor& prefix_v,
                                  const Tensor& suffix_k, const Tensor& suffix_v,
                                  const AttentionOptions& options = {});

// The same, writing into `result`: output and lse, when defined, must already have the shapes
// above and be contiguous, and are overwritten in place (a decode loop allocates no outputs);
// undefined ones are allocated. weights, row_max and row_sum are reset. The outputs must not share
// storage with the inputs.
void cascade_attention_into(const Tensor& q, const Tensor& prefix_k, const Tensor& prefix_v, const Tensor& suffix_k,
                            const Tensor& suffix_v, AttentionResult& result, const AttentionOptions& options = {});

}  // namespace qkv
