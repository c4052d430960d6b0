// qkv::scaled_dot_product_attention and its backward: the problem builder (problem.cpp) checks
// every argument once and normalises the options; this file only binds the results and picks
// the kernel, in one place for each direction.
#include "qkv/attention.hpp"

#include <omp.h>

#include <atomic>
#include <ostream>
#include <string>

#include "qkv/error.hpp"

#include "attention/block.hpp"
#include "attention/kernels.hpp"
#include "random.hpp"

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
  detail::block_attention_into(q, k, v, result, options, 0);
}

void detail::block_attention_into(const Tensor& q, const Tensor& k, const Tensor& v, AttentionResult& result,
                                  const AttentionOptions& options, int64_t alibi_shift) {
  detail::BuiltProblem built = detail::build_problem("scaled_dot_product_attention: ", q, k, v, options);
  built.problem.alibi_shift = alibi_shift;
  if ((options.backend == Backend::Flash || options.backend == Backend::Decode) && options.need_weights)
    throw Error("scaled_dot_product_attention: backend " + std::string(to_string(options.backend)) +
                " never materialises the weights; use Backend::Reference or Backend::Auto with need_weights");
  detail::bind_forward_outputs(built, result, options.need_weights, q, k, v);

  // ---- dispatch, in one place: only the reference materialises weights; of the fused kernels,
  // decode serves few queries against many keys, flash the rest.
  const detail::AttentionProblem& problem = built.problem;
  Backend backend = options.backend;
  if (backend == Backend::Auto) {
    if (options.need_weights) {
      backend = Backend::Reference;
    } else {
      backend = detail::decode_is_faster(problem) ? Backend::Decode : Backend::Flash;
    }
  }
  switch (backend) {
    case Backend::Reference: detail::reference_attention(problem); break;
    case Backend::Flash: detail::flash_attention(problem); break;
    case Backend::Decode: detail::decode_attention(problem); break;
    case Backend::Auto: break;  // resolved above
  }
}

AttentionGrads scaled_dot_product_attention_backward(const Tensor& grad_output, const Tensor& q, const Tensor& k,
                                                     const Tensor& v, const AttentionResult& forward,
                                                     const AttentionOptions& options) {
  AttentionGrads grads;
  scaled_dot_product_attention_backward_into(grad_output, q, k, v, forward, grads, options);
  return grads;
}

void scaled_dot_product_attention_backward_into(const Tensor& grad_output, const Tensor& q, const Tensor& k,
                                                const Tensor& v, const AttentionResult& forward,
                                                AttentionGrads& grads, const AttentionOptions& options) {
  detail::block_attention_backward_into(grad_output, q, k, v, forward, grads, options, 0);
}

void detail::block_attention_backward_into(const Tensor& grad_output, const Tensor& q, const Tensor& k,
                                           const Tensor& v, const AttentionResult& forward, AttentionGrads& grads,
                                           const AttentionOptions& options, int64_t alibi_shift) {
  detail::BuiltBackwardProblem built;
  detail::build_backward_problem(built, grad_output, q, k, v, forward, grads, options);
  built.problem.forward.alibi_shift = alibi_shift;
  // ---- dispatch: the reference when asked for, else flash (decode has no backward; a forward
  // that ran on decode has the same output and row stats, which is all backward reads).
  if (options.backend == Backend::Reference) {
    detail::reference_attention_backward(built.problem);
  } else {
    detail::flash_attention_backward(built.problem);
  }
  detail::sink_gradients(built.problem);
}

}  // namespace qkv
