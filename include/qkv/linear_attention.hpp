// Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs"): softmax(q.k) replaced
// by a kernel phi(q).phi(k), so the sums over keys factor through a d x Dv state and the cost is
// O(N d Dv) instead of O(N^2 d):
//
//   out_i = sum_j phi(q_i).phi(k_j) v_j / (sum_j phi(q_i).phi(k_j) + eps)
//
// over every key j, or, when causal, over the keys j <= i + causal_offset (the rule of
// Mask::causal(offset): with the default 0, query i sees keys 0..i whatever Nq and Nk are; a
// decoder whose Nq queries are the last of Nk positions passes Nk - Nq). No scale is applied.
// phi is applied to every element of q and k:
//   EluPlusOne  phi(x) = elu(x) + 1 = x + 1 (x > 0), exp(x) (x <= 0): positive, so every
//               denominator is positive (the paper's choice);
//   Relu        phi(x) = max(x, 0): a query or key whose features are all <= 0 weighs nothing.
// A row whose weights are all 0 with eps = 0 (it sees no key, Nk = 0 included, or ReLU zeroes
// every product) gets out = 0 and zero gradients, as softmax attention's empty rows, never NaN.
// Non-causal: phi(K)^T V (d x Dv) once, then phi(Q) times it. Causal: chunked prefix sums, a
// dense masked block within each chunk and a running state across chunks (docs/linear.md).
#pragma once

#include <cstdint>
#include <string_view>

#include "qkv/attention.hpp"
#include "qkv/tensor.hpp"

namespace qkv {

enum class FeatureMap { EluPlusOne, Relu };
std::string_view to_string(FeatureMap feature_map);
// "elu+1" (or "elu") and "relu"; anything else throws qkv::Error naming the choices.
FeatureMap feature_map_from_string(std::string_view name);

struct LinearAttentionOptions {
  FeatureMap feature_map = FeatureMap::EluPlusOne;
  bool causal = false;
  float eps = 1e-6f;               // added to every denominator; finite and >= 0
  int64_t causal_offset = 0;       // when causal: query i sees keys j <= i + causal_offset
};

// q: (B, Hq, Nq, Dk)  k: (B, Hkv, Nk, Dk)  v: (B, Hkv, Nk, Dv), Hq a multiple of Hkv; rank 3
// (B, N, D) and rank 2 (N, D) are one head; views are read in place as by
// scaled_dot_product_attention, whose shape checks and messages these are. Returns q's leading
// dims + (Nq, Dv). A query that sees no key gets zeros.
Tensor linear_attention(const Tensor& q, const Tensor& k, const Tensor& v, const LinearAttentionOptions& options = {});
// The same, writing into `output`: when defined it must have the shape above, a contiguous last
// dim and no overlapping elements (a transposed view is written in place), and share no storage
// with q, k, v; it is overwritten. When undefined it is allocated.
void linear_attention_into(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& output,
                           const LinearAttentionOptions& options = {});

// Gradients of sum(linear_attention(q, k, v, options) * grad_output) with respect to q, k and v
// (dsinks stays undefined). grad_output has the forward output's shape. The forward is
// recomputed, so nothing from it needs to be kept.
AttentionGrads linear_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& grad_output,
                                         const LinearAttentionOptions& options = {});
// The same, writing into `grads` (dq, dk, dv): each defined tensor must have the shape of q, k or
// v and a contiguous last dim (views are written in place) and is overwritten; undefined ones
// are allocated.
void linear_attention_backward_into(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& grad_output,
                                    AttentionGrads& grads, const LinearAttentionOptions& options = {});

}  // namespace qkv
