// qkv::linear_attention and its backward (include/qkv/linear_attention.hpp): the options checked,
// the problem built on scaled_dot_product_attention's checks and operand views (problem.cpp), and
// the kernels launched, one work item a head (query_pass.cpp, key_pass.cpp; docs/linear.md).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "attention/kernels.hpp"
#include "attention/launch.hpp"
#include "attention/problem.hpp"
#include "core/allocator.hpp"
#include "linear/problem.hpp"
#include "qkv/error.hpp"
#include "qkv/linear_attention.hpp"

namespace qkv {
namespace detail {
namespace {

void check_options(const char* who, const LinearAttentionOptions& options) {
  if (!(std::isfinite(options.eps) && options.eps >= 0))
    throw Error(std::string(who) + "eps must be finite and >= 0, got " + std::to_string(options.eps));
  if (options.feature_map != FeatureMap::EluPlusOne && options.feature_map != FeatureMap::Relu)
    throw Error(std::string(who) + "unknown feature map " + std::to_string(static_cast<int>(options.feature_map)));
  if (options.causal_offset <= -Mask::kUnbounded || options.causal_offset >= Mask::kUnbounded)
    throw Error(std::string(who) + "causal_offset " + std::to_string(options.causal_offset) +
                " is outside (-2^60, 2^60)");
}

// scaled_dot_product_attention's checks and operand views (problem.cpp), then the options.
struct Built {
  BuiltProblem attention;
  linear::Problem problem;
};
Built build(const char* who, const Tensor& q, const Tensor& k, const Tensor& v, const LinearAttentionOptions& options) {
  check_options(who, options);
  Built built{build_problem(who, q, k, v, AttentionOptions{}), {}};
  const AttentionProblem& a = built.attention.problem;
  if (a.kv_dtype != DType::F32)
    throw Error(std::string(who) + "k and v are " + std::string(to_string(a.kv_dtype)) +
                ": linear attention reads f32 K/V only (16-bit K/V are for softmax attention's caches)");
  built.problem = linear::Problem{
      .batch = a.batch, .q_heads = a.q_heads, .kv_heads = a.kv_heads, .q_len = a.q_len, .kv_len = a.kv_len,
      .head_dim = a.head_dim, .value_dim = a.value_dim, .q = a.q, .k = a.k, .v = a.v,
      .feature_map = options.feature_map, .causal = options.causal, .offset = options.causal_offset,
      .eps = options.eps, .output = {}, .grad_output = {}, .grad_q = {}, .grad_k = {}, .grad_v = {}, .g_ext = nullptr,
  };
  return built;
}

// Arithmetic of one (batch, head) pass, for the threading threshold.
double head_flops(const linear::Problem& p) {
  const double d = static_cast<double>(p.head_dim), dv = static_cast<double>(p.value_dim);
  const double intra = p.causal ? static_cast<double>(linear::kChunk) * (d + dv) : 0.0;
  return 2.0 * (static_cast<double>(p.q_len) * (d * dv + intra) + static_cast<double>(p.kv_len) * d * dv);
}

// Runs item(index, scratch) for index in [0, items) through Launch (attention/launch.hpp): on the
// workers the work pays for (one runs on the calling thread, with no OpenMP region), each with its
// own scratch block, the items dealt in contiguous shares with stealing. No items: nothing, not
// even the workspace.
template <class Item>
void launch_items(const linear::Problem& p, int64_t items, double flops_per_item, const Item& item) {
  if (items <= 0) return;
  const size_t block =
      linear::ScratchLayout(static_cast<size_t>(p.head_dim), static_cast<size_t>(p.value_dim)).total;
  const Launch launch(WorkspaceSlot::LinearScratch, flops_per_item * static_cast<double>(items), items, block);
  launch.for_each(items, [&](int64_t index) { item(index, launch.block_of_this_worker()); });
}

}  // namespace
}  // namespace detail

std::string_view to_string(FeatureMap feature_map) {
  switch (feature_map) {
    case FeatureMap::EluPlusOne: return "elu+1";
    case FeatureMap::Relu: return "relu";
  }
  return "unknown";
}

FeatureMap feature_map_from_string(std::string_view name) {
  if (name == "elu+1" || name == "elu") return FeatureMap::EluPlusOne;
  if (name == "relu") return FeatureMap::Relu;
  throw Error("unknown feature map \"" + std::string(name) + "\": choose elu+1 or relu");
}

Tensor linear_attention(const Tensor& q, const Tensor& k, const Tensor& v, const LinearAttentionOptions& options) {
  Tensor output;
  linear_attention_into(q, k, v, output, options);
  return output;
}

void linear_attention_into(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& output,
                           const LinearAttentionOptions& options) {
  const char* who = "linear_attention: ";
  detail::Built built = detail::build(who, q, k, v, options);
  detail::prepare_result(who, output, "output", built.attention.output_shape, {&q, &k, &v}, false);
  detail::linear::Problem& p = built.problem;
  p.output = detail::rows_of<float>(output);
  detail::launch_items(p, p.batch * p.q_heads, detail::head_flops(p), [&](int64_t item, float* scratch) {
    detail::linear::forward_head(p, item / p.q_heads, item % p.q_heads, scratch);
  });
}

AttentionGrads linear_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& grad_output,
                                         const LinearAttentionOptions& options) {
  AttentionGrads grads;
  linear_attention_backward_into(q, k, v, grad_output, grads, options);
  return grads;
}

void linear_attention_backward_into(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& grad_output,
                                    AttentionGrads& grads, const LinearAttentionOptions& options) {
  const char* who = "linear_attention_backward: ";
  detail::Built built = detail::build(who, q, k, v, options);
  if (!grad_output.defined()) throw Error(std::string(who) + "grad_output is undefined");
  if (grad_output.shape() != built.attention.output_shape)
    throw Error(std::string(who) + "grad_output is " + grad_output.shape().str() + " but should be " +
                built.attention.output_shape.str() + " (the forward's output)");
  const auto inputs = {&q, &k, &v, &grad_output};
  detail::prepare_result(who, grads.dq, "grads.dq", q.shape(), inputs, false);
  detail::prepare_result(who, grads.dk, "grads.dk", k.shape(), inputs, false);
  detail::prepare_result(who, grads.dv, "grads.dv", v.shape(), inputs, false);
  grads.dsinks = Tensor();
  detail::linear::Problem& p = built.problem;
  const Tensor packed_grad_output = grad_output.contiguous();
  p.grad_output = detail::rows_of<const float>(packed_grad_output);
  p.grad_q = detail::rows_of<float>(grads.dq);
  p.grad_k = detail::rows_of<float>(grads.dk);
  p.grad_v = detail::rows_of<float>(grads.dv);
  // G' = [dO / den, -dO.out / den] per query: the query pass writes it, the key pass reads it.
  const int64_t g_ext_size = p.batch * p.q_heads * p.q_len * (p.value_dim + 1);
  const Tensor g_ext = Tensor::empty(Shape{std::max<int64_t>(g_ext_size, 1)});
  p.g_ext = g_ext.data();
  const double flops = 2 * detail::head_flops(p);
  detail::launch_items(p, p.batch * p.q_heads, flops, [&](int64_t item, float* scratch) {
    detail::linear::query_grads_head(p, item / p.q_heads, item % p.q_heads, scratch);
  });
  detail::launch_items(p, p.batch * p.kv_heads, flops * static_cast<double>(p.q_heads / p.kv_heads),
                       [&](int64_t item, float* scratch) {
                         detail::linear::key_grads_group(p, item / p.kv_heads, item % p.kv_heads, scratch);
                       });
}

}  // namespace qkv
