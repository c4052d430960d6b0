// The summaries' options, outputs and oracle: summaries_from_weights computes, from materialised
// weights, exactly what the flash summary kernel computes on the fly (summary/forward.cpp), and
// the reference backend returns it.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "qkv/error.hpp"

#include "attention/kernels.hpp"
#include "attention/summary/summary.hpp"

namespace qkv::detail {

bool summaries_asked(const char* who, const AttentionOptions& options) {
  const int64_t k = options.summary_top_k;
  if (k == 0) return false;
  if (k < 0 || k > kMaxSummaryTopK)
    throw Error(std::string(who) + "summary_top_k must be in [0, " + std::to_string(kMaxSummaryTopK) + "], got " +
                std::to_string(k));
  if (options.dropout_p != 0)
    throw Error(std::string(who) + "summaries (summary_top_k = " + std::to_string(k) +
                ") describe the softmax's weights and take no dropout; got dropout_p = " +
                std::to_string(options.dropout_p));
  if (options.backend == Backend::Decode)
    throw Error(std::string(who) +
                "backend Decode does not compute summaries (summary_top_k > 0); use Auto, Flash or Reference");
  return true;
}

SummaryOutputs bind_summary_outputs(const char* who, const BuiltProblem& built, AttentionResult& result,
                                    int64_t top_k, const Tensor& q, const Tensor& k, const Tensor& v) {
  const std::vector<int64_t>& lse = built.lse_shape.dims();  // L + (Nq)
  std::vector<int64_t> top = lse, received(lse.begin(), lse.end() - 1);
  top.push_back(top_k);
  received.push_back(built.problem.kv_len);
  const std::initializer_list<const Tensor*> inputs = {&q, &k, &v};
  prepare_result(who, result.entropy, "result.entropy", built.lse_shape, inputs, true);
  prepare_result(who, result.top_weights, "result.top_weights", Shape(top), inputs, true);
  prepare_result(who, result.received, "result.received", Shape(received), inputs, true);
  result.top_keys.resize(static_cast<size_t>(Shape(top).numel()));
  return {top_k, result.entropy.data(), result.top_keys.data(), result.top_weights.data(), result.received.data()};
}

void clear_summary_outputs(AttentionResult& result) {
  result.entropy = result.top_weights = result.received = Tensor();
  result.top_keys.clear();
}

namespace {
// Row r's entropy and top keys from its n weights.
void row_summary(const float* w, int64_t n, int64_t k, std::vector<int64_t>& order, float* entropy,
                 int64_t* top_keys, float* top_weights) {
  double h = 0;
  order.clear();
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(w[j])) h = std::nan("");
    if (!(w[j] > 0)) continue;
    h -= static_cast<double>(w[j]) * std::log(static_cast<double>(w[j]));
    order.push_back(j);
  }
  *entropy = static_cast<float>(h);
  const auto first = [&](int64_t a, int64_t b) { return w[a] > w[b] || (w[a] == w[b] && a < b); };
  const size_t kept = std::min(order.size(), static_cast<size_t>(k));
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(kept), order.end(), first);
  for (int64_t e = 0; e < k; ++e) {
    const bool any = static_cast<size_t>(e) < kept;
    top_keys[e] = any ? order[static_cast<size_t>(e)] : -1;
    top_weights[e] = any ? w[order[static_cast<size_t>(e)]] : 0.0f;
  }
}
}  // namespace

void summaries_from_weights(const AttentionProblem& p, const float* weights, const SummaryOutputs& out) {
  const int64_t nq = p.q_len, nk = p.kv_len, k = out.top_k;
  std::vector<int64_t> order;
  std::vector<double> received(static_cast<size_t>(nk));
  for (int64_t head = 0; head < p.batch * p.q_heads; ++head) {
    std::fill(received.begin(), received.end(), 0.0);
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t r = head * nq + i;
      const float* w = weights + r * nk;
      row_summary(w, nk, k, order, out.entropy + r, out.top_keys + r * k, out.top_weights + r * k);
      for (int64_t j = 0; j < nk; ++j) received[static_cast<size_t>(j)] += w[j];
    }
    for (int64_t j = 0; j < nk; ++j) out.received[head * nk + j] = static_cast<float>(received[static_cast<size_t>(j)]);
  }
}

void reference_summary_attention(const AttentionProblem& problem, const SummaryOutputs& out) {
  AttentionProblem p = problem;
  std::vector<float> scratch;
  if (p.weights == nullptr) {
    scratch.resize(static_cast<size_t>(p.batch * p.q_heads * p.q_len * p.kv_len));
    p.weights = scratch.data();
  }
  reference_attention(p);
  summaries_from_weights(p, p.weights, out);
}

}  // namespace qkv::detail
