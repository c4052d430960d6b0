// The functional core: scaled dot-product attention, softmax(Q K^T * scale + mask) V.
// Every front end (qkv::nn, the CLI, Python) goes through this one call. It checks its
// arguments once, then hands a normalised problem to a kernel.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <map>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "qkv/flex.hpp"
#include "qkv/mask.hpp"
#include "qkv/tensor.hpp"

namespace qkv {

enum class Backend {
  Auto,       // Decode for few queries (<= 8) over many keys, else Flash; Reference for weights
  Reference,  // the textbook algorithm, scores materialised: the oracle of every test
  Flash,      // tiled, online softmax, SIMD + threads, never an n x n matrix; no weights
  Decode,     // few queries against a long KV cache, keys split across threads; no weights
};
std::string_view to_string(Backend backend);
std::ostream& operator<<(std::ostream& os, Backend backend);

// How precise the float32 products Q K^T and P V must be, as torch.set_float32_matmul_precision's
// levels. Lower levels permit a faster path; they never promise one. Today: on a CPU with AMX
// (Intel Sapphire Rapids and later) the Flash forward runs its two products and the Flash
// backward its five on AMX tiles at High and Medium; every other kernel (Reference, Decode) and
// every other CPU computes in float32 at every level.
enum class MatmulPrecision {
  Highest,  // float32 products (the default)
  High,     // each float32 operand as the sum of two bfloat16 (about 16 significant bits)
  Medium,   // each float32 operand rounded to one bfloat16 (8 significant bits)
};
std::string_view to_string(MatmulPrecision precision);
MatmulPrecision matmul_precision_from_string(std::string_view name);  // "highest", "high", "medium"
std::ostream& operator<<(std::ostream& os, MatmulPrecision precision);

struct AttentionOptions {
  Mask mask;                        // none by default
  std::optional<float> scale;       // default 1 / sqrt(Dk)
  float dropout_p = 0;              // dropout on the weights (training); 0 <= p < 1
  uint64_t seed = 0;                // picks the dropped elements, see dropout_keeps()
  bool need_weights = false;        // also return the attention weights
  Backend backend = Backend::Auto;
  MatmulPrecision precision = MatmulPrecision::Highest;

  // Score modifiers, applied to each scaled score s = scale * q.k in this order, then the mask:
  float softcap = 0;    // > 0: s <- softcap * tanh(s / softcap) (Gemma 2, Grok); 0: off
  Tensor alibi_slopes;  // (Hq) or (B, Hq): s <- s - slopes[b, h] * |i + Nk - Nq - j| (ALiBi; queries
                        // aligned to the end of the keys; (B, Hq) a row per batch element, as
                        // FlashAttention takes them); undefined: off
  Tensor sinks;         // (Hq), finite: a logit per head that joins every row's softmax denominator
                        // but carries no value (gpt-oss, StreamingLLM):
                        //   w_ij = exp(s_ij) / (exp(sinks[h]) + sum_j exp(s_ij));
                        // lse includes it, and a row that sees no key gets lse = sinks[h]

  // Your own score and mask functions as text (FlexAttention's score_mod and mask_mod; the
  // language: docs/flex.md). score_mod rewrites each score after softcap and ALiBi, before the
  // mask, e.g. "s - 0.1 * abs(q - k)"; the backward differentiates it. mask_mod hides key k from
  // query q where it is false, e.g. "doc(q) == doc(k)", ANDed with `mask` (Mask::expression).
  // Both read the named tensors of mod_inputs, each (L) or (B, L) float32, indexed by q, k, h or b.
  // Empty: off.
  std::string score_mod;
  std::string mask_mod;
  std::map<std::string, Tensor> mod_inputs;

  // Attention summaries without the weights (the explorer's overview of long documents): > 0
  // returns, besides the output, each row's entropy, its summary_top_k strongest keys and each
  // key's received mass (AttentionResult), computed inside the flash forward in O(N k) memory.
  // 0: off. At most 256; not with dropout; backend Decode refuses (Auto runs Flash; with
  // need_weights or score_mod, Reference, which computes them from its weights).
  int64_t summary_top_k = 0;

  // Quantized K/V (qkv/quantize.hpp): when k and v are int8 or int4 (DType::I8, I4), their f32
  // scales as quantize_kv returns them (the values' leading dims, then a scale per row or group).
  // Forward only; undefined for float K/V.
  Tensor k_scales, v_scales;

  // A score function in C++ (qkv/flex.hpp, qkv::score_function of a generic lambda), in place of
  // the text score_mod; null: off.
  std::shared_ptr<const ScoreFunction> score_function;

  // Packed variable-length batches (FlashAttention's varlen convention); empty: off. Given (both,
  // B + 1 offsets from 0, non-decreasing, ending at total_q / total_k): q is (total_q, Hq, Dk), k
  // (total_k, Hkv, Dk), v (total_k, Hkv, Dv), and sequence b holds query rows [cu_seqlens_q[b],
  // cu_seqlens_q[b + 1]) and key rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]). Each sequence attends
  // to its own keys alone, the mask's band (causal, window) aligned to the end of its keys (query i
  // at key position i + Nk_b - Nq_b: FlashAttention's bottom-right causal), ALiBi likewise, (B, Hq)
  // slopes' row b, dropout drawn with seed + b; the other mask rules see the sequence's own i, j.
  // output is (total_q, Hq, Dv); lse, row_max, row_sum (Hq, total_q). Not with need_weights,
  // summaries, tensor masks, key_lengths or score/mask functions. docs/inference.md.
  std::vector<int64_t> cu_seqlens_q, cu_seqlens_k;

  // Paged K/V (FlashAttention's flash_attn_with_kvcache, vLLM's block tables); empty: off. Given
  // (both): q is (B, Hq, Nq, Dk), k (num_pages, page_size, Hkv, Dk) and v (num_pages, page_size,
  // Hkv, Dv) page pools; block_table holds B x max_pages pool page indices, row-major (row b: the
  // pages of sequence b in key order), cache_seqlens the B key counts. Sequence b's key j is row
  // j % page_size of pool page block_table[b * max_pages + j / page_size]; its query i sits at key
  // position cache_seqlens[b] - Nq + i (causal and window aligned to the end of its keys, ALiBi
  // likewise, (B, Hq) slopes' row b, dropout drawn with seed + b). Pages may be shared between
  // sequences and lie in any order; only the entries a sequence's keys reach are read (and must
  // lie in [0, num_pages)). Runs the decode kernel on the pages in place, any Nq; output (B, Hq,
  // Nq, Dv). K/V f32, bf16, f16, or int8 / int4 pools with k_scales / v_scales their scale pools
  // (num_pages, page_size, Hkv, groups). Forward only; not with need_weights, summaries, tensor masks,
  // key_lengths, score/mask functions, cu_seqlens or backend Flash / Reference. docs/inference.md.
  std::vector<int64_t> block_table, cache_seqlens;

  // Rotary positions from tables (FlashAttention's rotary_cos / rotary_sin / rotary_interleaved;
  // qkv::nn::RotaryTable's rotation, include/qkv/inference.hpp); undefined: off. Given (both,
  // (seqlen_ro, rotary_dim / 2), f32, bf16 or f16, finite, rotary_dim <= Dk), the first rotary_dim
  // features of q, and of k when rotary_keys, are rotated before the scores: query i at position
  // n - Nq + i, key j at j, where n is the keys (Nk; its sequence's keys with cu_seqlens;
  // cache_seqlens[b] with pages): the queries are the last tokens of their sequence, where ALiBi
  // measures from. rotary_keys = false: k is a cache whose keys were rotated when appended (paged
  // pools, 16-bit or quantized K require it). The backward returns dq and dk of the unrotated q
  // and k. Refused (qkv::Error) where the mask would place the queries elsewhere: with Nq != Nk, a
  // band not ending at the query's position (Mask::causal() is top-left; use causal(Nk - Nq)) or
  // key_lengths (a padded cache: give it as pages); a paged call with Nq > 1 and no band
  // (FlashAttention puts all such queries at one position); positions past the tables or before 0
  // (a sequence with keys, but fewer than its queries). docs/inference.md.
  Tensor rotary_cos, rotary_sin;
  bool rotary_interleaved = false;
  bool rotary_keys = true;
};

// Shapes, with L = q's leading dims ((), (B) or (B, Hq) for rank 2, 3 or 4):
//   output  L + (Nq, Dv)
//   weights L + (Nq, Nk), only when need_weights; after dropout, as applied to V
//   lse     L + (Nq), the log-sum-exp of each row's scaled, masked scores (-inf: no key visible)
//   row_max L + (Nq), each row's largest scaled, masked score (the sink included)
//   row_sum L + (Nq), sum_j exp(s_ij - row_max), so w_ij = exp(s_ij - row_max) / row_sum
// and with options.summary_top_k = k > 0 (undefined / empty otherwise), from the weights w_ij
// before dropout (the softmax's):
//   entropy     L + (Nq), -sum_j w_ij log w_ij (natural log; 0 for a row that sees no key)
//   top_keys    L + (Nq, k) int64 row-major (a vector: Tensor is float), the keys of the k
//               largest weights, descending, ties to the lower index; -1 past the row's keys of
//               nonzero weight
//   top_weights L + (Nq, k), their weights (0 where the key is -1)
//   received    L + (Nk), sum_i w_ij: the mass each key receives from the head's queries
// row_max and row_sum are what the backward recomputes the weights from: lse = row_max +
// log(row_sum) alone loses log(row_sum) in float32 when the max is huge (a row whose keys all carry
// a -1e9 bias), and weights recomputed from it would not sum to 1.
struct AttentionResult {
  Tensor output;
  Tensor weights;
  Tensor lse;
  Tensor row_max;
  Tensor row_sum;
  Tensor entropy;
  std::vector<int64_t> top_keys;
  Tensor top_weights;
  Tensor received;
};

// q: (B, Hq, Nq, Dk)  k: (B, Hkv, Nk, Dk)  v: (B, Hkv, Nk, Dv), Hq a multiple of Hkv
// (grouped-query: query head h reads key/value head h / (Hq / Hkv), nothing is copied).
// Rank 3 (B, N, D) and rank 2 (N, D) are one head. q, k and v may be views with any strides
// (a transposed (B, N, H, D) head split, a slice of a preallocated cache): when their last dim
// is contiguous they are read where they are, else packed once. A query that sees no key gets an output of
// zeros, weights of zeros and lse = -inf, never NaN. Bad arguments throw qkv::Error.
AttentionResult scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const AttentionOptions& options = {});

// The same, writing into `result`: each of its tensors that is defined must already have the
// shape above and be contiguous, and is overwritten in place; undefined ones are allocated (and
// weights is reset when not asked for). Calling it again with the same `result` allocates
// nothing, so a loop pays for fresh pages once. The outputs must not share storage with q, k, v.
// result.output may also be a view whose last dim is contiguous (MHA writes its heads straight
// into the (B, N, H, Dv) layout it concatenates).
void scaled_dot_product_attention_into(const Tensor& q, const Tensor& k, const Tensor& v, AttentionResult& result,
                                       const AttentionOptions& options = {});

// Gradients of scaled_dot_product_attention with respect to q, k, v (shaped as q, k and v), when
// options.sinks is given the sinks (Hq), and when the mask has one additive tensor term (a float
// attn_mask, Mask::additive) that bias: dbias = dL/d(logits), the scores after every modifier as
// the bias is added to them, summed over the dims the bias broadcasts over, shaped as the bias
// (its own shape, e.g. (Nq, Nk) or (1, Hq, Nq, Nk)); 0 where the mask hides the score. Computed
// whenever there is such a term (as dsinks whenever there are sinks); undefined otherwise, and
// when the mask has two or more additive terms (add them into one tensor to get its gradient).
struct AttentionGrads { Tensor dq, dk, dv, dsinks, dbias; };
// grad_output: shaped as forward.output. `forward` is the result of the forward call on the same
// q, k, v and options: its output is used, and the weights are recomputed from its row_max and
// row_sum (exact whatever the biases), or from its lse when those are undefined: exact where
// |lse| < 128; a row with a larger lse (a -1e9 bias on every key, where lse loses log(n), or huge
// scores) gets its max and sum from a forward pass first. grad_output and forward's tensors may
// be views, as q, k and v.
// options must be the forward's (need_weights and backend included): the backward recomputes the
// scores in the order the forward's kernel summed them, so its weights come from the forward's
// scores bit for bit. After Reference (asked for, or Auto with need_weights) it runs the reference
// backward; after Flash the flash backward; after Decode (asked for, or Auto's choice) the flash
// backward with decode's dot products (Auto's choice depends on omp_get_max_threads(): run both
// directions with the same thread count).
AttentionGrads scaled_dot_product_attention_backward(const Tensor& grad_output, const Tensor& q, const Tensor& k,
                                                     const Tensor& v, const AttentionResult& forward,
                                                     const AttentionOptions& options = {});
// The same, writing into `grads`: each defined tensor must have its shape above and a contiguous
// last dim (views are written in place: MHA passes its (B, N, H, D) gradient buffers transposed);
// undefined ones are allocated.
void scaled_dot_product_attention_backward_into(const Tensor& grad_output, const Tensor& q, const Tensor& k,
                                                const Tensor& v, const AttentionResult& forward,
                                                AttentionGrads& grads, const AttentionOptions& options = {});

// The dropout decision for one weight: a counter-based hash of (seed, batch, head, query, key),
// so every kernel drops exactly the same elements. True = kept (and scaled by 1 / (1 - p)).
// p is checked as attention checks dropout_p: outside [0, 1) (or NaN) throws qkv::Error.
bool dropout_keeps(uint64_t seed, int64_t batch, int64_t head, int64_t query, int64_t key,
                   float p);

}  // namespace qkv
