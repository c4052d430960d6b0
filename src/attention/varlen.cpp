// Packed variable-length batches (varlen.hpp): the offsets checked once, with messages naming the
// offending values; then each sequence attends as a call of its own on (1, H, N, D) views of its
// rows of q, k, v and of the caller's output and gradients, which its kernel reads and writes in
// place. A sequence's call is exactly the call a caller would make for it alone (with the band
// aligned to the end of its keys), so a packed batch gives the bits of its sequences' calls; only
// the row statistics, (Hq, total_q) here as FlashAttention returns them, are copied into place.
#include "attention/varlen.hpp"

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "attention/problem.hpp"  // prepare_result, expect_shape
#include "attention/summary/summary.hpp"  // clear_summary_outputs
#include "qkv/error.hpp"
#include "qkv/mask.hpp"

namespace qkv::detail {
namespace {

[[noreturn]] void fail(const char* who, const std::string& message) { throw Error(who + message); }

// The sequences' first rows: q_starts[b] .. q_starts[b + 1] are sequence b's queries, likewise keys.
struct Sequences {
  std::vector<int64_t> q_starts, k_starts;
  int64_t count() const { return static_cast<int64_t>(q_starts.size()) - 1; }
  int64_t q_len(int64_t b) const { return q_starts[static_cast<size_t>(b) + 1] - q_starts[static_cast<size_t>(b)]; }
  int64_t k_len(int64_t b) const { return k_starts[static_cast<size_t>(b) + 1] - k_starts[static_cast<size_t>(b)]; }
};

// B + 1 offsets: from 0, non-decreasing, ending at `total` (the rows of `tensor`).
void check_offsets(const char* who, const std::vector<int64_t>& offsets, const char* name, int64_t total,
                   const char* tensor) {
  const auto at = [&](size_t b) {
    return std::string(name) + "[" + std::to_string(b) + "] = " + std::to_string(offsets[b]);
  };
  if (offsets.size() < 2)
    fail(who, std::string(name) + " has " + std::to_string(offsets.size()) +
                  " entries: it needs B + 1 >= 2 offsets, from 0 to the total rows of " + tensor);
  if (offsets[0] != 0) fail(who, at(0) + ": the offsets start at 0");
  for (size_t b = 1; b < offsets.size(); ++b)
    if (offsets[b] < offsets[b - 1]) fail(who, at(b) + " is below " + at(b - 1) + ": the offsets must not decrease");
  if (offsets.back() != total)
    fail(who, at(offsets.size() - 1) + " but " + tensor + " has " + std::to_string(total) +
                  " rows: the last offset is the total");
}

void check_packed_operand(const char* who, const Tensor& t, const char* name, const char* shape) {
  if (!t.defined()) fail(who, std::string(name) + " is undefined");
  if (t.dim() != 3)
    fail(who, std::string(name) + " is " + t.shape().str() + ": with cu_seqlens it must be " + shape);
}

}  // namespace

bool reads_by_position(const std::shared_ptr<const Mask::Rule>& rule) {
  if (!rule) return false;
  using Kind = Mask::Rule::Kind;
  if (rule->kind == Kind::Keep || rule->kind == Kind::Expression) return true;
  return reads_by_position(rule->left) || reads_by_position(rule->right);
}

void check_sequence_options(const char* who, const AttentionOptions& o, int64_t batch, const char* by) {
  const auto refuse = [&](bool given, const std::string& what) {
    if (given) fail(who, what + " is not taken with " + by);
  };
  refuse(o.need_weights, "need_weights (a per-sequence call's weights have no one shape)");
  refuse(o.summary_top_k > 0, "summary_top_k");
  refuse(!o.mask.terms().empty(), "a tensor mask (keep or additive): use causal, window or the mask rules; it");
  refuse(o.mask.has_key_lengths(), "key_lengths (the sequences' lengths give each its keys)");
  refuse(!o.score_mod.empty() || !o.mask_mod.empty() || o.score_function || !o.mod_inputs.empty(),
         "a score or mask function (score_mod, mask_mod, score_function, mod_inputs)");
  refuse(reads_by_position(o.mask.rule()),
         "a mask rule that reads a keep tensor or a mask function (" + o.mask.str() + ")");
  refuse(o.k_scales.defined() || o.v_scales.defined(), "quantized K/V (k_scales, v_scales)");
  if (o.alibi_slopes.defined() && o.alibi_slopes.dim() == 2 && o.alibi_slopes.size(0) != batch)
    fail(who, "alibi_slopes is " + o.alibi_slopes.shape().str() + " but the batch has " + std::to_string(batch) +
                  " sequences: (B, Hq) slopes need one row per sequence");
}

namespace {

Sequences check_varlen(const char* who, const Tensor& q, const Tensor& k, const Tensor& v,
                       const AttentionOptions& options) {
  const auto& cq = options.cu_seqlens_q;
  const auto& ck = options.cu_seqlens_k;
  if (cq.empty() || ck.empty())
    fail(who, "cu_seqlens_q has " + std::to_string(cq.size()) + " entries and cu_seqlens_k " +
                  std::to_string(ck.size()) + ": a packed batch needs both");
  check_packed_operand(who, q, "q", "(total_q, Hq, Dk)");
  check_packed_operand(who, k, "k", "(total_k, Hkv, Dk)");
  check_packed_operand(who, v, "v", "(total_k, Hkv, Dv)");
  if (v.size(0) != k.size(0) || v.size(1) != k.size(1))
    fail(who, "k is " + k.shape().str() + " but v is " + v.shape().str() + ": they need the same (total_k, Hkv)");
  check_offsets(who, cq, "cu_seqlens_q", q.size(0), "q");
  check_offsets(who, ck, "cu_seqlens_k", k.size(0), "k");
  if (cq.size() != ck.size())
    fail(who, "cu_seqlens_q has " + std::to_string(cq.size()) + " entries but cu_seqlens_k " +
                  std::to_string(ck.size()) + ": one pair of offsets per sequence");
  if (!options.block_table.empty() || !options.cache_seqlens.empty())
    fail(who, "block_table / cache_seqlens (paged K/V) are not taken with cu_seqlens_q / cu_seqlens_k");
  check_sequence_options(who, options, static_cast<int64_t>(cq.size()) - 1, "cu_seqlens_q / cu_seqlens_k");
  return {cq, ck};
}

}  // namespace

PackedSequences checked_sequences(const char* who, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const AttentionOptions& options) {
  const Sequences seqs = check_varlen(who, q, k, v, options);
  return {seqs.q_starts, seqs.k_starts};
}

namespace {

// Rows [start, start + length) of a (total, H, D) tensor as the (1, H, length, D) view a sequence's call takes.
Tensor sequence_rows(const Tensor& t, int64_t start, int64_t length) {
  return t.narrow(0, start, length).transpose(0, 1).unsqueeze(0);
}

// Zeros rows [start, start + length) of a (total, H, D) tensor with a contiguous last dim.
void zero_rows(const Tensor& t, int64_t start, int64_t length) {
  float* data = t.view_data();
  const auto& st = t.strides();
  for (int64_t r = start; r < start + length; ++r)
    for (int64_t h = 0; h < t.size(1); ++h) std::fill_n(data + r * st[0] + h * st[1], t.size(2), 0.0f);
}

// (1, Hq, n) packed row statistics of one sequence into columns [start, start + n) of (Hq, total).
void place_stats(const Tensor& part, const Tensor& all, int64_t start) {
  const int64_t heads = all.size(0), total = all.size(1), n = part.size(-1);
  for (int64_t h = 0; h < heads; ++h) std::copy_n(part.data() + h * n, n, all.data() + h * total + start);
}
}  // namespace

AttentionOptions sequence_options(const AttentionOptions& options, int64_t b) {
  AttentionOptions o = options;
  o.cu_seqlens_q.clear();
  o.cu_seqlens_k.clear();
  o.block_table.clear();
  o.cache_seqlens.clear();
  if (options.alibi_slopes.defined() && options.alibi_slopes.dim() == 2)
    o.alibi_slopes = options.alibi_slopes.narrow(0, b, 1).squeeze(0);
  o.seed = options.seed + static_cast<uint64_t>(b);
  return o;
}

void varlen_attention_into(const Tensor& q, const Tensor& k, const Tensor& v, AttentionResult& result,
                           const AttentionOptions& options) {
  const char* who = "scaled_dot_product_attention: ";
  const Sequences seqs = check_varlen(who, q, k, v, options);
  const int64_t total_q = q.size(0), heads = q.size(1);
  const auto inputs = {&q, &k, &v};
  prepare_result(who, result.output, "result.output", Shape{total_q, heads, v.size(2)}, inputs, false);
  for (auto [t, name] : {std::pair{&result.lse, "result.lse"}, {&result.row_max, "result.row_max"},
                         {&result.row_sum, "result.row_sum"}})
    prepare_result(who, *t, name, Shape{heads, total_q}, inputs, true);
  result.weights = Tensor();
  clear_summary_outputs(result);
  for (int64_t b = 0; b < seqs.count(); ++b) {
    const int64_t q0 = seqs.q_starts[static_cast<size_t>(b)], nq = seqs.q_len(b);
    const int64_t k0 = seqs.k_starts[static_cast<size_t>(b)], nk = seqs.k_len(b);
    if (nq == 0) continue;
    AttentionResult part;
    part.output = sequence_rows(result.output, q0, nq);
    sequence_attention_into(sequence_rows(q, q0, nq), sequence_rows(k, k0, nk), sequence_rows(v, k0, nk), part,
                            sequence_options(options, b));
    place_stats(part.lse, result.lse, q0);
    place_stats(part.row_max, result.row_max, q0);
    place_stats(part.row_sum, result.row_sum, q0);
  }
}

void varlen_attention_backward_into(const Tensor& grad_output, const Tensor& q, const Tensor& k, const Tensor& v,
                                    const AttentionResult& forward, AttentionGrads& grads,
                                    const AttentionOptions& options) {
  const char* who = "scaled_dot_product_attention_backward: ";
  const Sequences seqs = check_varlen(who, q, k, v, options);
  const int64_t total_q = q.size(0), heads = q.size(1);
  const Shape output_shape{total_q, heads, v.size(2)}, stats_shape{heads, total_q};
  expect_shape(who, grad_output, "grad_output", output_shape, "(total_q, Hq, Dv), as the forward's output");
  expect_shape(who, forward.output, "forward.output", output_shape, "(total_q, Hq, Dv)");
  expect_shape(who, forward.lse, "forward.lse", stats_shape, "(Hq, total_q)");
  if (forward.row_max.defined()) expect_shape(who, forward.row_max, "forward.row_max", stats_shape, "as lse");
  if (forward.row_sum.defined()) expect_shape(who, forward.row_sum, "forward.row_sum", stats_shape, "as lse");
  const auto inputs = {&q, &k, &v};
  prepare_result(who, grads.dq, "grads.dq", q.shape(), inputs, false);
  prepare_result(who, grads.dk, "grads.dk", k.shape(), inputs, false);
  prepare_result(who, grads.dv, "grads.dv", v.shape(), inputs, false);
  grads.dbias = Tensor();
  if (options.sinks.defined()) {
    prepare_result(who, grads.dsinks, "grads.dsinks", options.sinks.shape(), inputs, true);
    std::fill_n(grads.dsinks.data(), grads.dsinks.numel(), 0.0f);
  } else {
    grads.dsinks = Tensor();
  }
  const auto stats = [](const Tensor& t, int64_t start, int64_t n) {
    return t.defined() ? t.narrow(1, start, n).unsqueeze(0) : Tensor();
  };
  for (int64_t b = 0; b < seqs.count(); ++b) {
    const int64_t q0 = seqs.q_starts[static_cast<size_t>(b)], nq = seqs.q_len(b);
    const int64_t k0 = seqs.k_starts[static_cast<size_t>(b)], nk = seqs.k_len(b);
    if (nq == 0 || nk == 0) {  // no query or no key: no weight, so no gradient
      zero_rows(grads.dq, q0, nq);
      zero_rows(grads.dk, k0, nk);
      zero_rows(grads.dv, k0, nk);
      continue;
    }
    AttentionResult part_forward;
    part_forward.output = sequence_rows(forward.output, q0, nq);
    part_forward.lse = stats(forward.lse, q0, nq);
    part_forward.row_max = stats(forward.row_max, q0, nq);
    part_forward.row_sum = stats(forward.row_sum, q0, nq);
    AttentionGrads part{sequence_rows(grads.dq, q0, nq), sequence_rows(grads.dk, k0, nk),
                        sequence_rows(grads.dv, k0, nk), Tensor(), Tensor()};
    sequence_attention_backward_into(sequence_rows(grad_output, q0, nq), sequence_rows(q, q0, nq),
                                     sequence_rows(k, k0, nk), sequence_rows(v, k0, nk), part_forward, part,
                                     sequence_options(options, b));
    if (grads.dsinks.defined())
      for (int64_t h = 0; h < heads; ++h) grads.dsinks.data()[h] += part.dsinks.data()[h];
  }
}

}  // namespace qkv::detail
