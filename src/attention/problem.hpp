// The normalised attention problem every kernel receives, and the one builder that makes it.
// build_problem (problem.cpp) checks the arguments once and fills it; kernels trust it and
// check nothing. Tests build their problems with the same builder.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <vector>

#include "attention/bias_gradient.hpp"  // BiasGradView
#include "attention/paged.hpp"  // PagedKv
#include "mask/rule.hpp"  // MaskTermView, MaskRule
#include "qkv/attention.hpp"
#include "qkv/flex.hpp"

namespace qkv::detail {

// One q/k/v-like operand as a kernel reads it, in place: row i of head h of batch b starts at
//   data + b * batch_stride + h * head_stride + i * row_stride
// and its elements are contiguous. A packed (B, H, N, D) tensor has strides (H N D, N D, D); a
// transposed (B, N, H, D) head split has (N H D, D, H D).
template <class T>
struct Rows {
  T* data = nullptr;
  int64_t batch_stride = 0, head_stride = 0, row_stride = 0;

  T* row(int64_t b, int64_t h, int64_t i) const { return data + b * batch_stride + h * head_stride + i * row_stride; }
};

struct AttentionProblem {
  int64_t batch, q_heads, kv_heads;  // q_heads is a multiple of kv_heads
  int64_t q_len, kv_len;             // Nq, Nk
  int64_t head_dim, value_dim;       // Dk, Dv
  Rows<const float> q;               // (B, Hq, Nq, Dk)
  Rows<const float> k;               // (B, Hkv, Nk, Dk), when kv_dtype is F32 (else data null)
  Rows<const float> v;               // (B, Hkv, Nk, Dv), when kv_dtype is F32 (else data null)
  float scale;

  // Score modifiers, applied to s = scale * q.k in this order, before the mask.
  float softcap;               // > 0: s <- softcap * tanh(s / softcap); 0: off
  const float* alibi_slopes;   // (B|1, Hq): s <- s - alibi_slope(b, h) * |i + alibi_offset() - j|; nullptr: off
  int64_t alibi_batch_stride;  // Hq for (B, Hq) slopes, 0 for (Hq)
  int64_t alibi_shift;         // 0, except for a block of a longer sequence (src/attention/ring_block.hpp)
  const float* sinks;          // (Hq): a logit in each row's denominator with no value; nullptr: off
  // A score function (AttentionOptions::score_mod as text, or score_function, a C++ callable:
  // one interface, qkv/flex.hpp) applied after softcap and ALiBi; null: off. Its derivative
  // joins softcap's slope in the backward.
  std::shared_ptr<const ScoreFunction> score_mod;

  // Visibility, one rule for every structured mask: key j is visible to query i of batch b
  // when i + band_lo <= j <= i + band_hi and j < key_lengths[b], every term allows it and
  // the rule does (mask/rule.hpp).
  int64_t band_lo, band_hi;
  std::vector<int64_t> key_lengths;  // one per batch; kv_len where no padding mask was given
  std::vector<MaskTermView> terms;
  MaskRule rule;  // the symbolic rule (unions, strided, global, block-sparse), ANDed; empty: none

  float dropout_p;  // 0: no dropout
  uint64_t seed;
  // The bfloat16 parts each float32 operand of the flash forward's products may be split into
  // on AMX tiles (gemm/amx.hpp): 2 at MatmulPrecision::High, 1 at Medium, 0 (float32) at
  // Highest and when K and V are 16-bit.
  int amx_parts = 0;

  Rows<float> output;  // (B, Hq, Nq, Dv)
  float* weights;      // (B, Hq, Nq, Nk) packed, or nullptr when not asked for
  float* lse;          // (B, Hq, Nq) packed
  float* row_max;      // (B, Hq, Nq) packed: each row's max score (the sink included)
  float* row_sum;      // (B, Hq, Nq) packed: sum_j exp(s_ij - row_max)

  // K and V stored in 16 bits (qkv/dtype.hpp): kv_dtype BF16 or F16, and k_bits / v_bits view
  // them (k and v are then null). Decode reads them in place, flash widens each tile as it
  // loads it, the reference widens a copy (with_float_kv, kv_dtype.cpp).
  DType kv_dtype = DType::F32;
  Rows<const uint16_t> k_bits, v_bits;
  // K and V quantized (kv_dtype I8 or I4, qkv/quantize.hpp): the packed rows (Dk or Dk / 2 bytes)
  // and their scales (1 or ceil(D / 32) floats a row); kernels dequantise a tile at a time.
  Rows<const uint8_t> k_quant, v_quant;
  Rows<const float> k_scales, v_scales;
  // Paged K/V (attention/paged.hpp): when paged.on(), k / k_bits and v / v_bits view the pool's
  // page 0 and key j's row lies paged.offset(j, ...) past it; batch 1, read by decode alone.
  PagedKv paged;
  // Quantized K/V whose scales' values build_problem left unchecked (ScaleValues::Kernel): only
  // decode may run such a problem, and it checks each item's scales as it first reads them, so
  // its tiles then find them in cache instead of DRAM serving them twice (decode/chunk-inl.h).
  bool scales_unchecked = false;

  // Whether the backward scales dS by d(modified score)/d(raw score) (softcap, a score function).
  bool has_score_slope() const { return softcap > 0 || score_mod != nullptr; }
  // Grouped-query attention: the key/value head that query head h reads.
  int64_t kv_head_of(int64_t h) const { return h / (q_heads / kv_heads); }
  // ALiBi aligns the queries to the end of the keys: query i sits at key position i + Nk - Nq,
  // moved by alibi_shift when the call is one block of a longer sequence.
  int64_t alibi_offset() const { return kv_len - q_len + alibi_shift; }
  float alibi_slope(int64_t b, int64_t h) const { return alibi_slopes[b * alibi_batch_stride + h]; }
  // The sink logit of query head h, -inf when there are no sinks (it then adds exp(-inf) = 0).
  float sink(int64_t h) const { return sinks ? sinks[h] : -std::numeric_limits<float>::infinity(); }
  // The half-open range [first, last) of keys the band and key lengths let query i of batch b
  // see (tensor terms may hide more). Empty when first >= last.
  int64_t first_visible_key(int64_t i) const { return i + band_lo > 0 ? i + band_lo : 0; }
  int64_t last_visible_key(int64_t b, int64_t i) const {
    const int64_t band_end = i + band_hi + 1;
    return band_end < key_lengths[b] ? band_end : key_lengths[b];
  }
};

// A packed batch's sequence (attention/varlen.hpp) sees the mask's band aligned to the end of its
// keys, as FlashAttention's varlen causal: band_lo and band_hi, where bounded, move by Nk - Nq, so
// query i sits at key position i + Nk - Nq (where ALiBi already puts it).
void align_band_to_end(AttentionProblem& problem);

// Runs `kernel` on `problem` with K and V widened to packed float copies when they are 16-bit or
// quantized (kv_dtype.cpp): for the kernel that reads float K/V only (the reference).
void with_float_kv(const AttentionProblem& problem, void (*kernel)(const AttentionProblem&));

// The backward problem: the forward's problem (q, k, v, scale, modifiers, masks, dropout; its
// outputs left null) plus what the forward returned and the gradients to write. The weights are
// recomputed as P_ij = exp(s_ij - row_shift[r]) * row_scale[r] for row r = (b, h, i): from the
// forward's row_max and 1 / row_sum, or from its lse and 1; a row that saw nothing has shift
// +inf and scale 0, so P = 0 there, never NaN.
struct AttentionBackwardProblem {
  AttentionProblem forward;
  Rows<const float> output;       // (B, Hq, Nq, Dv), the forward's O
  Rows<const float> grad_output;  // (B, Hq, Nq, Dv), dLoss/dO
  const float* row_shift;         // (B, Hq, Nq) packed
  const float* row_scale;         // (B, Hq, Nq) packed
  Rows<float> grad_q;             // (B, Hq, Nq, Dk), overwritten
  Rows<float> grad_k;             // (B, Hkv, Nk, Dk), overwritten
  Rows<float> grad_v;             // (B, Hkv, Nk, Dv), overwritten
  float* grad_sinks;              // (Hq), overwritten, or nullptr without sinks
  // The flash backward recomputes S in decode's order (attention/steps/dot_scores-inl.h) instead of its
  // micro-GEMM's: set when the forward ran decode, so the recomputed scores are its scores.
  bool decode_scores = false;
  // dL/d(the additive mask term), shaped as that term (attention/bias_gradient.hpp): zeroed, then
  // added into by the kernel; data null when the mask has no single additive term.
  BiasGradView grad_bias;
};

// The dropout probability's check, shared by build_problem and qkv::dropout_keeps: p in [0, 1),
// else qkv::Error "<who>dropout_p must be in [0, 1), got <p>".
void check_dropout_p(const char* who, float p);

// The dropout rule every kernel shares: weight (b, h, i, j) is kept when the counter-based
// uniform for those coordinates is >= p.
bool dropout_keeps(const AttentionProblem& problem, int64_t b, int64_t h, int64_t i, int64_t j);

// ---- The builder (problem.cpp), shared by the library's entry points and the tests.

// A forward problem with what it points into: the tensors it reads (views of the caller's, or
// packed copies of operands whose last dim is not contiguous) and the shapes of its results.
// The outputs (output, weights, lse, row_max, row_sum) are left null: bind_forward_outputs sets them.
struct BuiltProblem {
  AttentionProblem problem;
  Shape output_shape, lse_shape, scores_shape;  // L + (Nq, Dv), L + (Nq), L + (Nq, Nk)
  std::vector<Tensor> held;                     // keeps every tensor the problem points into alive
};

// What build_problem does with quantized k and v's scales (their layout it always checks, unless
// Checked):
//   Scan     every scale's value, here (check_quantized);
//   Checked  nothing: the caller checked them (paged K/V checks the pages a call reaches; its
//            per-sequence k / v are stand-ins whose scales must not be read);
//   Kernel   the values are left to the forward's dispatch (problem.scales_unchecked): decode
//            checks them as it reads them, any other kernel calls check_scales first.
enum class ScaleValues { Scan, Checked, Kernel };

// Checks q, k, v and the options (`who` prefixes every error message) and normalises them.
BuiltProblem build_problem(const char* who, const Tensor& q, const Tensor& k, const Tensor& v,
                           const AttentionOptions& options, ScaleValues scale_values = ScaleValues::Scan);

// Scans the scales build_problem left to the kernel (ScaleValues::Kernel) and clears
// problem.scales_unchecked; throws qkv::Error naming the first bad one, as Scan would have.
void check_scales(const char* who, BuiltProblem& built, const Tensor& k, const Tensor& v,
                  const AttentionOptions& options);

// Prepares result's tensors (allocated when undefined, else checked: shape, a contiguous last
// dim, no storage shared with q, k, v) and points the problem's outputs at them.
void bind_forward_outputs(BuiltProblem& built, AttentionResult& result, bool need_weights, const Tensor& q,
                          const Tensor& k, const Tensor& v);

// A backward problem: the forward's problem built from q, k, v and options, grad_output and the
// forward's result checked against it, row shift/scale computed, grads prepared and bound.
struct BuiltBackwardProblem {
  BuiltProblem forward;
  AttentionBackwardProblem problem;
  std::vector<float> row_shift, row_scale;
  // Given lse alone: the rows whose lse lost precision (lse_lost_precision), whose shift and
  // scale the dispatcher restores from a forward pass before the kernel runs (attention/dispatch.cpp).
  std::vector<int64_t> rows_to_restore;
};
void build_backward_problem(BuiltBackwardProblem& built, const Tensor& grad_output, const Tensor& q,
                            const Tensor& k, const Tensor& v, const AttentionResult& forward, AttentionGrads& grads,
                            const AttentionOptions& options);

// Weights recomputed from lse alone, exp(s - lse), carry lse's rounding as a relative error, up to
// half an ulp of lse: from |lse| >= 128 that is 2^-18 or more, and a row whose keys all carry a
// -1e9 bias loses log(n) entirely (its weights would each be 1, not 1 / n). True for such an lse
// (+inf included); false for -inf (a row that saw nothing) and NaN (a NaN row stays NaN).
bool lse_lost_precision(float lse);

// The backward's per-row shift and scale of the weights (AttentionBackwardProblem), for `rows`
// rows: from the forward's row max and sum when `sums` is given (shift = max, scale = 1 / sum),
// else from its lse (`first` = lse, scale 1). A row that saw nothing gets +inf and 0.
void weight_row_stats(const float* first, const float* sums, size_t rows, float* shift, float* scale);

// A problem's operand view of a tensor read as (B, H, N, D) from rank 2, 3 or 4; its last dim
// must be contiguous.
template <class T>
Rows<T> rows_of(const Tensor& t);

// dsinks[h] = -sum over the rows r of head h of P_sink(r) D(r), with P_sink = exp(sink - shift)
// scale and D = dO . O: the sink is a logit with no value, so dP_sink = 0 and dS_sink = -P_sink D.
// Every backward kernel shares it; it reads only O, dO and the row stats (O(B Hq Nq Dv)).
void sink_gradients(const AttentionBackwardProblem& problem);

// A backward input that must have the shape of a forward result: else qkv::Error "<who><name> is
// <its shape> but should be <shape> (<what>)".
void expect_shape(const char* who, const Tensor& t, const char* name, const Shape& shape, const char* what);

// A caller-provided result tensor (problem.cpp's check, shared with linear_attention.cpp):
// allocated when undefined, else checked to have `shape`, be contiguous (packed) or have a
// contiguous last dim and no overlapping elements, and share no storage with the inputs.
void prepare_result(const char* who, Tensor& t, const char* name, const Shape& shape,
                    std::initializer_list<const Tensor*> inputs, bool packed);

}  // namespace qkv::detail
