// qkv::scaled_dot_product_attention and its backward: the problem builder (problem.cpp) checks
// every argument once and normalises the options; this file only binds the results and picks
// the kernel, in one place for each direction.
#include "qkv/attention.hpp"

#include <omp.h>

#include <atomic>
#include <ostream>
#include <string>

#include "qkv/error.hpp"

#include "attention/paged.hpp"
#include "attention/ring_block.hpp"
#include "attention/rotary.hpp"
#include "attention/varlen.hpp"
#include "attention/kernels.hpp"
#include "attention/summary/summary.hpp"
#include "core/random.hpp"

namespace qkv {

std::string_view to_string(Backend backend) {
  switch (backend) {
    case Backend::Auto: return "Auto";
    case Backend::Reference: return "Reference";
    case Backend::Flash: return "Flash";
    case Backend::Decode: return "Decode";
  }
  return "unknown";
}

std::ostream& operator<<(std::ostream& os, Backend backend) { return os << to_string(backend); }

std::string_view to_string(MatmulPrecision precision) {
  switch (precision) {
    case MatmulPrecision::Highest: return "highest";
    case MatmulPrecision::High: return "high";
    case MatmulPrecision::Medium: return "medium";
  }
  return "unknown";
}

std::ostream& operator<<(std::ostream& os, MatmulPrecision precision) { return os << to_string(precision); }

MatmulPrecision matmul_precision_from_string(std::string_view name) {
  for (MatmulPrecision precision : {MatmulPrecision::Highest, MatmulPrecision::High, MatmulPrecision::Medium})
    if (name == to_string(precision)) return precision;
  throw Error("unknown matmul precision '" + std::string(name) + "': expected highest, high or medium");
}

namespace {
// The rule itself, for a p already checked (the kernels' problems were built by build_problem).
bool keeps(uint64_t seed, int64_t batch, int64_t head, int64_t query, int64_t key, float p) {
  return detail::counter_uniform(seed, static_cast<uint64_t>(batch), static_cast<uint64_t>(head),
                                 static_cast<uint64_t>(query), static_cast<uint64_t>(key)) >= p;
}
}  // namespace

bool dropout_keeps(uint64_t seed, int64_t batch, int64_t head, int64_t query, int64_t key, float p) {
  detail::check_dropout_p("dropout_keeps: ", p);
  return keeps(seed, batch, head, query, key, p);
}

namespace detail {
namespace {
std::atomic<double> min_flops_to_thread{kMinFlopsToThread};

// ---- dispatch, in one place for both directions: only the reference materialises weights; of
// the fused kernels, decode serves few queries against many keys, flash the rest. The backward
// asks it which kernel made the scores it recomputes (given the forward's options).
Backend forward_kernel(const AttentionProblem& problem, const AttentionOptions& options) {
  // A score function runs in the reference and flash (forward and backward), not in decode:
  // decode asked for it refuses, Auto gives decode's few-query calls to flash.
  if (problem.score_mod && options.backend == Backend::Decode)
    throw Error("scaled_dot_product_attention: backend Decode does not take score_mod; use backend Auto, Flash or "
                "Reference");
  if (options.backend != Backend::Auto) return options.backend;
  if (options.need_weights) return Backend::Reference;
  if (options.summary_top_k > 0) return Backend::Flash;  // decode computes no summaries
  return !problem.score_mod && decode_is_faster(problem) ? Backend::Decode : Backend::Flash;
}

// False when decode met a bad scale or left scales unread (problem.scales_unchecked: decode alone).
bool run_forward(Backend kernel, const AttentionProblem& problem) {
  switch (kernel) {
    case Backend::Reference: reference_attention(problem); break;
    case Backend::Flash: flash_attention(problem); break;
    case Backend::Decode: return decode_attention(problem);
    case Backend::Auto: break;  // forward_kernel resolves it
  }
  return true;
}

// A backward given lse alone (lse_lost_precision, problem.hpp): the listed rows get their max and
// sum from a forward pass of the forward's kernel, into scratch; every other row keeps lse's.
// The pass covers the whole problem: such rows are rare (huge biases or scores), and a pass of
// the fused kernels over every row costs less than picking rows apart.
void restore_row_stats(BuiltBackwardProblem& built, Backend kernel) {
  if (built.rows_to_restore.empty()) return;
  AttentionProblem p = built.problem.forward;
  const int64_t rows = p.batch * p.q_heads * p.q_len;
  const Tensor out = Tensor::empty(Shape{rows, p.value_dim}), stats = Tensor::empty(Shape{3, rows});
  p.output = {out.data(), p.q_heads * p.q_len * p.value_dim, p.q_len * p.value_dim, p.value_dim};
  p.weights = nullptr;
  p.lse = stats.data();
  p.row_max = p.lse + rows;
  p.row_sum = p.row_max + rows;
  run_forward(kernel, p);
  for (int64_t r : built.rows_to_restore)
    weight_row_stats(p.row_max + r, p.row_sum + r, 1, &built.row_shift[static_cast<size_t>(r)],
                     &built.row_scale[static_cast<size_t>(r)]);
}
}  // namespace

int threads_for(double flops) { return flops < min_flops_to_thread.load() ? 1 : omp_get_max_threads(); }

double set_min_flops_to_thread_for_test(double flops) { return min_flops_to_thread.exchange(flops); }

bool dropout_keeps(const AttentionProblem& problem, int64_t b, int64_t h, int64_t i, int64_t j) {
  return keeps(problem.seed, b, h, i, j, problem.dropout_p);
}
}  // namespace detail

AttentionResult scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const AttentionOptions& options) {
  AttentionResult result;
  scaled_dot_product_attention_into(q, k, v, result, options);
  return result;
}

void scaled_dot_product_attention_into(const Tensor& q, const Tensor& k, const Tensor& v, AttentionResult& result,
                                       const AttentionOptions& options) {
  if (detail::has_rotary(options)) {
    const char* who = "scaled_dot_product_attention: ";
    detail::check_outputs_apart(who, {{&result.output, "result.output"}, {&result.weights, "result.weights"},
                                      {&result.lse, "result.lse"}, {&result.row_max, "result.row_max"},
                                      {&result.row_sum, "result.row_sum"}}, q, k);
    const detail::RotatedInputs r = detail::rotated_inputs(who, q, k, v, options);
    return scaled_dot_product_attention_into(r.q, r.k, v, result, r.options);
  }
  if (detail::is_varlen(options)) return detail::varlen_attention_into(q, k, v, result, options);
  if (detail::is_paged(options)) return detail::paged_attention_into(q, k, v, result, options);
  detail::block_attention_into(q, k, v, result, options, 0);
}

namespace detail {
namespace {
// The forward of every entry: alibi_shift for a block of a longer sequence (ring_block.hpp),
// band_from_end for a sequence of a packed batch (varlen.hpp).
void forward_into(const Tensor& q, const Tensor& k, const Tensor& v, AttentionResult& result,
                  const AttentionOptions& options, int64_t alibi_shift, bool band_from_end) {
  const char* who = "scaled_dot_product_attention: ";
  detail::BuiltProblem built = detail::build_problem(who, q, k, v, options, ScaleValues::Kernel);
  built.problem.alibi_shift = alibi_shift;
  if (band_from_end) align_band_to_end(built.problem);
  if ((options.backend == Backend::Flash || options.backend == Backend::Decode) && options.need_weights)
    throw Error("scaled_dot_product_attention: backend " + std::string(to_string(options.backend)) +
                " never materialises the weights; use Backend::Reference or Backend::Auto with need_weights");
  const Backend kernel = detail::forward_kernel(built.problem, options);
  const bool with_summaries = detail::summaries_asked(who, options);
  // Quantized K/V's scales: decode checks each as it reads it (a bad one throws after the kernel,
  // the result's buffers then hold garbage); any other kernel needs them checked first.
  if (kernel != Backend::Decode || with_summaries) check_scales(who, built, k, v, options);
  detail::bind_forward_outputs(built, result, options.need_weights, q, k, v);
  if (!with_summaries) {
    detail::clear_summary_outputs(result);
    // False: decode met a bad scale (the scan throws, naming it) or had none to read.
    if (!detail::run_forward(kernel, built.problem)) check_scales(who, built, k, v, options);
    return;
  }
  const detail::SummaryOutputs summaries =
      detail::bind_summary_outputs(who, built, result, options.summary_top_k, q, k, v);
  if (kernel == Backend::Reference) {
    detail::reference_summary_attention(built.problem, summaries);
  } else {
    detail::flash_summary_attention(built.problem, summaries);
  }
}
}  // namespace
}  // namespace detail

void detail::block_attention_into(const Tensor& q, const Tensor& k, const Tensor& v, AttentionResult& result,
                                  const AttentionOptions& options, int64_t alibi_shift) {
  forward_into(q, k, v, result, options, alibi_shift, false);
}

void detail::sequence_attention_into(const Tensor& q, const Tensor& k, const Tensor& v, AttentionResult& result,
                                     const AttentionOptions& options) {
  forward_into(q, k, v, result, options, 0, true);
}

AttentionGrads scaled_dot_product_attention_backward(const Tensor& grad_output, const Tensor& q, const Tensor& k,
                                                     const Tensor& v, const AttentionResult& forward,
                                                     const AttentionOptions& options) {
  AttentionGrads grads;
  scaled_dot_product_attention_backward_into(grad_output, q, k, v, forward, grads, options);
  return grads;
}

namespace detail {
namespace {
// The backward of both entries. restore_rows: rows whose lse lost precision get their max and sum
// from a forward pass (restore_row_stats); a block of a longer sequence must not, since its
// forward.lse is the whole row's and a pass over the block would give the block's.
void backward_into(const Tensor& grad_output, const Tensor& q, const Tensor& k, const Tensor& v,
                   const AttentionResult& forward, AttentionGrads& grads, const AttentionOptions& options,
                   int64_t alibi_shift, bool restore_rows, bool band_from_end = false) {
  BuiltBackwardProblem built;
  build_backward_problem(built, grad_output, q, k, v, forward, grads, options);
  built.problem.forward.alibi_shift = alibi_shift;
  if (band_from_end) align_band_to_end(built.problem.forward);
  // ---- dispatch: the backward recomputes the scores in the order the forward's kernel summed
  // them, so its weights come from the forward's scores: after the reference, the reference
  // backward (the same sgemm); after flash, flash backward; after decode, flash backward with
  // decode's dot products (decode has no backward of its own).
  const Backend kernel = forward_kernel(built.problem.forward, options);
  built.problem.decode_scores = kernel == Backend::Decode;
  if (restore_rows) restore_row_stats(built, kernel);
  if (kernel == Backend::Reference) {
    reference_attention_backward(built.problem);
  } else {
    flash_attention_backward(built.problem);
  }
  sink_gradients(built.problem);
}
}  // namespace
}  // namespace detail

void scaled_dot_product_attention_backward_into(const Tensor& grad_output, const Tensor& q, const Tensor& k,
                                                const Tensor& v, const AttentionResult& forward,
                                                AttentionGrads& grads, const AttentionOptions& options) {
  if (detail::is_paged(options))
    throw Error("scaled_dot_product_attention_backward: block_table / cache_seqlens (paged K/V) are forward only");
  if (detail::has_rotary(options)) {
    const char* who = "scaled_dot_product_attention_backward: ";
    detail::check_outputs_apart(who, {{&grads.dq, "grads.dq"}, {&grads.dk, "grads.dk"}, {&grads.dv, "grads.dv"},
                                      {&grads.dsinks, "grads.dsinks"}, {&grads.dbias, "grads.dbias"}}, q, k);
    const detail::RotatedInputs r = detail::rotated_inputs(who, q, k, v, options);
    scaled_dot_product_attention_backward_into(grad_output, r.q, r.k, v, forward, grads, r.options);
    detail::unrotate_gradients(who, q, k, v, options, grads);
    return;
  }
  if (detail::is_varlen(options))
    return detail::varlen_attention_backward_into(grad_output, q, k, v, forward, grads, options);
  detail::backward_into(grad_output, q, k, v, forward, grads, options, 0, true);
}

void detail::sequence_attention_backward_into(const Tensor& grad_output, const Tensor& q, const Tensor& k,
                                              const Tensor& v, const AttentionResult& forward, AttentionGrads& grads,
                                              const AttentionOptions& options) {
  backward_into(grad_output, q, k, v, forward, grads, options, 0, true, true);
}

void detail::block_attention_backward_into(const Tensor& grad_output, const Tensor& q, const Tensor& k,
                                           const Tensor& v, const AttentionResult& forward, AttentionGrads& grads,
                                           const AttentionOptions& options, int64_t alibi_shift) {
  backward_into(grad_output, q, k, v, forward, grads, options, alibi_shift, false);
}

}  // namespace qkv
