// Shared-prefix (cascade) attention (qkv/cascade.hpp): the arguments checked once, with messages
// naming shapes and values; then three steps, each an existing piece:
//   1. prefix: every sequence's queries stacked as the query rows of one call over the prefix,
//      q (B, Hq, Nq, Dk) -> (1, Hq, B Nq, Dk), so the prefix's K/V is read once, not B times
//      (decode runs a group's rows against each K/V tile while it sits in L1; flash takes many
//      rows). Output (1, Hq, B Nq, Dv) and lse.
//   2. suffix: each sequence's queries against its own keys, written into the caller's output.
//   3. merge: each row's two results and its sink, merge_softmax_parts (lse_merge.hpp).
// Memory traffic of a decode step (Nq = 1) against doing each sequence alone: the prefix's K/V
// once instead of B times, plus the suffixes once either way; the stacked queries and the prefix
// results are B Hq (Dk + Dv + 1) floats.
#include "qkv/cascade.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "attention/lse_merge.hpp"
#include "attention/problem.hpp"  // prepare_result
#include "attention/varlen.hpp"  // sequence_attention_into: a call with the band aligned to the end
#include "qkv/error.hpp"
#include "qkv/mask.hpp"

namespace qkv {
namespace {

constexpr const char* kWho = "cascade_attention: ";
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

[[noreturn]] void fail(const std::string& message) { throw Error(kWho + message); }

std::string str(int64_t n) { return std::to_string(n); }

// The problem's sizes, after the checks.
struct Cascade {
  int64_t batch, q_heads, q_len, prefix_len, suffix_len, value_dim;
  std::vector<int64_t> lengths;  // (B) suffix lengths
  bool causal;

  bool suffix_uniform() const {
    for (int64_t length : lengths)
      if (length != suffix_len) return false;
    return true;
  }
  bool suffix_empty() const {
    for (int64_t length : lengths)
      if (length != 0) return false;
    return true;
  }
};

// What cascade does not take, each refusal naming the option.
void check_options(const AttentionOptions& o) {
  const auto refuse = [](bool given, const std::string& what) {
    if (given) fail(what + " is not taken by cascade attention");
  };
  refuse(o.dropout_p != 0, "dropout_p = " + std::to_string(o.dropout_p) + " (it is for inference):");
  refuse(o.need_weights, "need_weights (the weights of two passes have no one tensor)");
  refuse(o.alibi_slopes.defined(),
         "alibi_slopes (the one prefix pass cannot give each sequence its own query positions)");
  refuse(!o.score_mod.empty() || !o.mask_mod.empty() || o.score_function || !o.mod_inputs.empty(),
         "a score or mask function (score_mod, mask_mod, score_function, mod_inputs)");
  refuse(o.summary_top_k > 0, "summary_top_k");
  refuse(o.k_scales.defined() || o.v_scales.defined(), "quantized K/V (k_scales, v_scales)");
  refuse(!o.cu_seqlens_q.empty() || !o.cu_seqlens_k.empty(), "cu_seqlens_q / cu_seqlens_k");
  refuse(!o.block_table.empty() || !o.cache_seqlens.empty(), "block_table / cache_seqlens (paged K/V)");
  refuse(o.rotary_cos.defined() || o.rotary_sin.defined(),
         "rotary_cos / rotary_sin (the levels are caches of rotated keys: rotate the queries first)");
  const Mask& m = o.mask;
  const bool causal_only = m.band_lo() == -Mask::kUnbounded && (m.band_hi() == 0 || m.band_hi() == Mask::kUnbounded);
  if (!m.terms().empty() || m.rule() || !causal_only)
    fail("the mask " + m.str() + " is not taken: cascade takes none, causal, key_lengths (the suffix lengths) or " +
         "causal & key_lengths");
  if (o.sinks.defined() && o.sinks.dtype() != DType::F32) fail("sinks must be float32");
}

void check_operand(const Tensor& t, const char* name, const char* shape) {
  if (!t.defined()) fail(std::string(name) + " is undefined");
  if (t.dim() != 4) fail(std::string(name) + " is " + t.shape().str() + ": it must be " + shape);
}

// k and v of one level: one float dtype (f32, bf16, f16) for both.
void check_kv_dtypes(const Tensor& k, const Tensor& v, const char* k_name, const char* v_name) {
  const auto floating = [](DType d) { return d == DType::F32 || d == DType::BF16 || d == DType::F16; };
  if (!floating(k.dtype()) || k.dtype() != v.dtype())
    fail(std::string(k_name) + " is " + std::string(to_string(k.dtype())) + " and " + v_name + " " +
         std::string(to_string(v.dtype())) + ": they must be one of f32, bf16, f16, both the same");
}

Cascade check_cascade(const Tensor& q, const Tensor& pk, const Tensor& pv, const Tensor& sk, const Tensor& sv,
                      const AttentionOptions& options) {
  check_options(options);
  check_operand(q, "q", "(B, Hq, Nq, Dk)");
  check_operand(pk, "prefix_k", "(1, Hkv, Np, Dk)");
  check_operand(pv, "prefix_v", "(1, Hkv, Np, Dv)");
  check_operand(sk, "suffix_k", "(B, Hkv, Ns, Dk)");
  check_operand(sv, "suffix_v", "(B, Hkv, Ns, Dv)");
  if (q.dtype() != DType::F32) fail("q is " + std::string(to_string(q.dtype())) + ": it must be f32");
  check_kv_dtypes(pk, pv, "prefix_k", "prefix_v");
  check_kv_dtypes(sk, sv, "suffix_k", "suffix_v");
  const int64_t batch = q.size(0), q_heads = q.size(1), dk = q.size(3), kv_heads = pk.size(1), dv = pv.size(3);
  const auto shapes = [&] {
    return " (q " + q.shape().str() + ", prefix_k " + pk.shape().str() + ", prefix_v " + pv.shape().str() +
           ", suffix_k " + sk.shape().str() + ", suffix_v " + sv.shape().str() + ")";
  };
  if (pk.size(0) != 1 || pv.shape() != Shape{1, kv_heads, pk.size(2), dv} || pk.size(3) != dk)
    fail("the prefix must be one copy, prefix_k (1, Hkv, Np, Dk) and prefix_v (1, Hkv, Np, Dv)" + shapes());
  if (sk.shape() != Shape{batch, kv_heads, sk.size(2), dk} || sv.shape() != Shape{batch, kv_heads, sk.size(2), dv})
    fail("the suffixes must be suffix_k (B, Hkv, Ns, Dk) and suffix_v (B, Hkv, Ns, Dv) with q's B, Dk and the "
         "prefix's Hkv, Dv" + shapes());
  if (kv_heads == 0 || q_heads % kv_heads != 0)
    fail("Hq = " + str(q_heads) + " is not a multiple of Hkv = " + str(kv_heads) + shapes());
  if (options.sinks.defined() && options.sinks.shape() != Shape{q_heads})
    fail("sinks is " + options.sinks.shape().str() + ": it must be (Hq) = (" + str(q_heads) + ")");

  Cascade c{batch, q_heads, q.size(2), pk.size(2), sk.size(2), dv, {}, options.mask.band_hi() == 0};
  c.lengths = options.mask.has_key_lengths() ? options.mask.lengths() : std::vector<int64_t>(batch, c.suffix_len);
  if (static_cast<int64_t>(c.lengths.size()) != batch)
    fail("key_lengths has " + str(static_cast<int64_t>(c.lengths.size())) + " entries but q has B = " + str(batch) +
         ": one suffix length per sequence");
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t length = c.lengths[static_cast<size_t>(b)];
    if (length < 0 || length > c.suffix_len)
      fail("key_lengths[" + str(b) + "] = " + str(length) + " is outside [0, Ns = " + str(c.suffix_len) + "]");
    if (c.causal && length < c.q_len - 1)
      fail("causal: sequence " + str(b) + " holds " + str(length) + " suffix keys for Nq = " + str(c.q_len) +
           " queries; its queries are its last positions, so it needs at least Nq - 1 = " + str(c.q_len - 1) +
           " (else a query would sit inside the shared prefix)");
  }
  return c;
}

// The options of either pass: the caller's scale, softcap, backend and precision with `mask`.
AttentionOptions pass_options(const AttentionOptions& options, Mask mask) {
  AttentionOptions o;
  o.mask = std::move(mask);
  o.scale = options.scale;
  o.softcap = options.softcap;
  o.backend = options.backend;
  o.precision = options.precision;
  return o;
}

// From this many stacked query rows per head, Auto runs the prefix pass on flash rather than on
// decode (which Auto's own rule picks up to 8 queries, or 64 where flash would idle threads):
// every row multiplies the pass's products while its bytes stay the prefix's, and flash's
// register tiles run many rows faster than decode's per-row score dot products (the crossover
// measured on C1's shape: docs/inference.md, "Shared-prefix (cascade) decoding").
constexpr int64_t kFlashStackedRows = 8;

// Step 1: the B Nq query rows of each head over the prefix, in one call.
AttentionResult prefix_pass(const Cascade& c, const Tensor& q, const Tensor& pk, const Tensor& pv,
                            const AttentionOptions& options) {
  const int64_t rows = c.batch * c.q_len;
  const Tensor stacked = q.transpose(0, 1).reshape(Shape{1, c.q_heads, rows, q.size(3)});
  AttentionOptions o = pass_options(options, Mask());
  if (o.backend == Backend::Auto && rows >= kFlashStackedRows) o.backend = Backend::Flash;
  return scaled_dot_product_attention(stacked, pk, pv, o);
}

// Marks batch element b's rows of a suffix result as having seen no key.
void no_suffix_keys(AttentionResult& r, int64_t b) {
  const int64_t rows = r.lse.numel() / r.lse.size(0);
  std::fill_n(r.lse.data() + b * rows, rows, kMinusInf);
}

// Step 2: each sequence's queries over its own suffix keys, into `result` (output and lse). One
// call for the whole batch when the suffixes share one band (equal lengths, or no causal band
// among several queries); else a call per sequence, its band aligned to the end of its keys.
void suffix_pass(const Cascade& c, const Tensor& q, const Tensor& sk, const Tensor& sv, AttentionResult& result,
                 const AttentionOptions& options) {
  const Mask band = c.causal ? Mask::causal() : Mask();
  if (c.suffix_uniform()) {
    detail::sequence_attention_into(q, sk, sv, result, pass_options(options, band));
  } else if (!c.causal || c.q_len == 1) {  // one query at the end of its sequence sees all its keys
    detail::sequence_attention_into(q, sk, sv, result, pass_options(options, Mask::key_lengths(c.lengths)));
  } else {
    const AttentionOptions one = pass_options(options, band);
    for (int64_t b = 0; b < c.batch; ++b) {
      const int64_t length = c.lengths[static_cast<size_t>(b)];
      if (length == 0) {
        no_suffix_keys(result, b);
        continue;
      }
      AttentionResult part;
      part.output = result.output.narrow(0, b, 1);
      part.lse = result.lse.narrow(0, b, 1);
      detail::sequence_attention_into(q.narrow(0, b, 1), sk.narrow(0, b, 1).narrow(2, 0, length),
                                      sv.narrow(0, b, 1).narrow(2, 0, length), part, one);
    }
  }
  result.row_max = result.row_sum = Tensor();  // the passes' own; the merge gives output and lse
}

// Step 3: row (b, h, i) merges the prefix's result, the suffix's (already in result.output) and
// the sink (the part (sink, 1, zeros)), in place.
void merge(const Cascade& c, const AttentionResult& prefix, bool has_suffix, const AttentionResult& result,
           const Tensor& sinks) {
  const int64_t dv = c.value_dim, stacked_rows = c.batch * c.q_len;
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.q_heads; ++h)
      for (int64_t i = 0; i < c.q_len; ++i) {
        const int64_t row = (b * c.q_heads + h) * c.q_len + i;
        const int64_t stacked = h * stacked_rows + b * c.q_len + i;  // in (1, Hq, B Nq)
        float* out = result.output.data() + row * dv;
        detail::SoftmaxPart parts[3];
        int64_t count = 0;
        if (prefix.lse.defined()) parts[count++] = {prefix.lse.data()[stacked], 1.0f, prefix.output.data() + stacked * dv};
        if (has_suffix) parts[count++] = {result.lse.data()[row], 1.0f, out};
        if (sinks.defined()) parts[count++] = {sinks.data()[h], 1.0f, nullptr};
        const detail::MergedRow merged = detail::merge_softmax_parts(
            count, [&](int64_t p) { return parts[p]; }, static_cast<size_t>(dv), out);
        result.lse.data()[row] = merged.lse;
      }
}

}  // namespace

AttentionResult cascade_attention(const Tensor& q, const Tensor& prefix_k, const Tensor& prefix_v,
                                  const Tensor& suffix_k, const Tensor& suffix_v, const AttentionOptions& options) {
  AttentionResult result;
  cascade_attention_into(q, prefix_k, prefix_v, suffix_k, suffix_v, result, options);
  return result;
}

void cascade_attention_into(const Tensor& q, const Tensor& prefix_k, const Tensor& prefix_v, const Tensor& suffix_k,
                            const Tensor& suffix_v, AttentionResult& result, const AttentionOptions& options) {
  const Cascade c = check_cascade(q, prefix_k, prefix_v, suffix_k, suffix_v, options);
  const Tensor sinks = options.sinks.defined() ? options.sinks.contiguous() : Tensor();
  if (sinks.defined())
    for (int64_t h = 0; h < c.q_heads; ++h)
      if (!std::isfinite(sinks.data()[h]))
        fail("sinks[" + str(h) + "] = " + std::to_string(sinks.data()[h]) + ": sinks must be finite");
  const auto inputs = {&q, &prefix_k, &prefix_v, &suffix_k, &suffix_v};
  detail::prepare_result(kWho, result.output, "result.output", Shape{c.batch, c.q_heads, c.q_len, c.value_dim},
                         inputs, true);
  detail::prepare_result(kWho, result.lse, "result.lse", Shape{c.batch, c.q_heads, c.q_len}, inputs, true);
  result.weights = result.row_max = result.row_sum = Tensor();
  if (c.batch == 0 || c.q_heads == 0 || c.q_len == 0) return;
  const AttentionResult prefix =
      c.prefix_len > 0 ? prefix_pass(c, q, prefix_k, prefix_v, options) : AttentionResult{};
  const bool has_suffix = c.suffix_len > 0 && !c.suffix_empty();
  if (has_suffix) suffix_pass(c, q, suffix_k, suffix_v, result, options);
  merge(c, prefix, has_suffix, result, sinks);
}

}  // namespace qkv
