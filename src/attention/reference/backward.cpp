// The reference backward: the gradients of attention with respect to Q, K and V, step by step,
// one (batch, head) at a time, with the Nq x Nk matrices materialised (llm.c's
// attention_backward). Clarity first: it is the oracle the flash backward is tested against.
//
// The forward (reference/forward.cpp), per (b, h) with g = the key/value head of h:
//   1. S = scale * Q K^T
//   2. S = softcap tanh(S / softcap); S[i,j] -= slope[h] |i + Nk - Nq - j|
//   3. S[i,j] = -inf where the mask hides key j from query i; additive terms are added
//   4. P = softmax(S) (the sink in the denominator)
//   5. P'[i,j] = keep(b,h,i,j) ? P[i,j] / (1 - p) : 0        (P' = P without dropout)
//   6. O = P' V
// The backward walks it in reverse, each step quoting the line it differentiates. Nothing but O
// and the row stats is kept from the forward: P is recomputed as exp(S - shift) * scale
// (problem.hpp: from row_max and 1 / row_sum, exact whatever the biases), and a row that saw no
// key has P = 0, so it gets and gives zero gradients. The sinks' gradient is computed once for
// every backward kernel by sink_gradients (problem.cpp); an additive mask term's gradient, dS
// before the modifiers' slopes, is added row by row (attention/bias_gradient.hpp).
//
// Grouped-query attention: every query head of a group reads the same K and V, so dK and dV of
// a key/value head are sums over the group's query heads (the loop adds into them).
//
// Keys past the last one any query may see are never read, as in the forward; a hidden key
// inside that range has P = 0, and its dS is set to exactly 0, so a NaN or Inf in its V (a KV
// cache's unwritten slot) reaches no gradient; one in its K is skipped in step 1's dQ product.
#include <algorithm>
#include <cmath>
#include <limits>

#include "attention/bias_gradient.hpp"
#include "attention/kernels.hpp"
#include "gemm/gemm.hpp"
#include "core/allocator.hpp"

namespace qkv::detail {

namespace {
bool rows_finite(const float* values, int64_t rows, int64_t cols, int64_t stride) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      if (!std::isfinite(values[r * stride + c])) return false;
  return true;
}

// Zeroes `rows` rows of `cols` floats, row stride `stride`.
void zero_rows(float* rows_start, int64_t rows, int64_t cols, int64_t stride) {
  for (int64_t r = 0; r < rows; ++r) std::fill_n(rows_start + r * stride, cols, 0.0f);
}

// Matrices of one (b, h), Nq x Nk each with row stride Nk, in this thread's workspace.
struct HeadScratch {
  float* weights;       // P, then dS
  float* grad_weights;  // dP' = dL/dP', then dP
  float* score_slope;   // d(modified S)/d(raw S), when softcap or a score function is on
};

// Recomputes P for head (b, h). Forward 1-4: "S = scale * Q K^T", "modifiers", "mask",
// "P = softmax(S)"; here P = exp(S - shift) * scale.
void recompute_weights(const AttentionBackwardProblem& bp, int64_t b, int64_t h, int64_t visible_keys,
                       const HeadScratch& m) {
  const AttentionProblem& p = bp.forward;
  const int64_t nq = p.q_len, nk = p.kv_len;
  sgemm(false, true, nq, visible_keys, p.head_dim, p.scale, p.q.row(b, h, 0), p.q.row_stride,
        p.k.row(b, p.kv_head_of(h), 0), p.k.row_stride, 0.0f, m.weights, nk);
  const int64_t row0 = (b * p.q_heads + h) * nq;
  for (int64_t i = 0; i < nq; ++i) {
    float* row = m.weights + i * nk;
    reference_logits_row(p, b, h, i, row, p.has_score_slope() ? m.score_slope + i * nk : nullptr);
    const float shift = bp.row_shift[row0 + i], scale = bp.row_scale[row0 + i];
    for (int64_t j = 0; j < visible_keys; ++j) row[j] = std::exp(row[j] - shift) * scale;
  }
}

// dS for head (b, h) from dP' (in grad_weights), in place of P. Forward 5: "P' = keep ? P / (1 - p)
// : 0", forward 4: "P = softmax(S)", forward 3: "mask", forward 2: "modifiers".
void score_gradients(const AttentionBackwardProblem& bp, int64_t b, int64_t h, int64_t visible_keys,
                     const HeadScratch& m) {
  const AttentionProblem& p = bp.forward;
  const int64_t nk = p.kv_len;
  const float survivor_scale = p.dropout_p > 0 ? 1.0f / (1.0f - p.dropout_p) : 1.0f;
  for (int64_t i = 0; i < p.q_len; ++i) {
    float* grad_row = m.grad_weights + i * nk;
    float* row = m.weights + i * nk;
    // Forward 5: dP = keep ? dP' / (1 - p) : 0.
    if (p.dropout_p > 0)
      for (int64_t j = 0; j < visible_keys; ++j)
        grad_row[j] = dropout_keeps(p, b, h, i, j) ? grad_row[j] * survivor_scale : 0.0f;
    // Forward 4: dS = P * (dP - D), D = sum_j P dP = sum_j P' dP' = dO . O (the sink has no value,
    // so it adds nothing to D).
    const float* grad_out = bp.grad_output.row(b, h, i);
    const float* out = bp.output.row(b, h, i);
    double row_dot = 0;
    for (int64_t c = 0; c < p.value_dim; ++c) row_dot += static_cast<double>(grad_out[c]) * out[c];
    const float d = static_cast<float>(row_dot);
    // Forward 3: a hidden score has P = 0 and gets dS = 0 exactly (never 0 * NaN, nor 0 times a
    // score function's slope, which may be NaN where the mask hides it); an additive term passes
    // dS through, and its own gradient is this dS (bias_gradient.hpp). Forward 2: ALiBi passes it
    // through, softcap and a score function scale it by their slope.
    for (int64_t j = 0; j < visible_keys; ++j) row[j] = row[j] == 0.0f ? 0.0f : row[j] * (grad_row[j] - d);
    if (bp.grad_bias.data) add_bias_gradient_row(bp.grad_bias, b, h, i, row, visible_keys);
    if (p.has_score_slope())
      for (int64_t j = 0; j < visible_keys; ++j)
        if (row[j] != 0.0f) row[j] *= m.score_slope[i * nk + j];
  }
}

// The gradients of head (b, h): dV and dK added into, dQ overwritten.
void head_backward(const AttentionBackwardProblem& bp, int64_t b, int64_t h, int64_t visible_keys,
                   const HeadScratch& m) {
  const AttentionProblem& p = bp.forward;
  const int64_t nq = p.q_len, nk = p.kv_len, dk = p.head_dim, dv = p.value_dim, g = p.kv_head_of(h);
  const float* k = p.k.row(b, g, 0);
  const float* grad_out = bp.grad_output.row(b, h, 0);
  float* grad_q = bp.grad_q.row(b, h, 0);
  recompute_weights(bp, b, h, visible_keys, m);

  // Forward 6: "O = P' V".  dV += P'^T dO  and  dP' = dO V^T; P' made in grad_weights for dV.
  const float* dropped_weights = m.weights;
  if (p.dropout_p > 0) {
    const float survivor_scale = 1.0f / (1.0f - p.dropout_p);
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t j = 0; j < visible_keys; ++j)
        m.grad_weights[i * nk + j] = dropout_keeps(p, b, h, i, j) ? m.weights[i * nk + j] * survivor_scale : 0.0f;
    dropped_weights = m.grad_weights;
  }
  if (dv > 0) {
    sgemm(true, false, visible_keys, dv, nq, 1.0f, dropped_weights, nk, grad_out, bp.grad_output.row_stride, 1.0f,
          bp.grad_v.row(b, g, 0), bp.grad_v.row_stride);
    sgemm(false, true, nq, visible_keys, dv, 1.0f, grad_out, bp.grad_output.row_stride, p.v.row(b, g, 0),
          p.v.row_stride, 0.0f, m.grad_weights, nk);
  } else {
    for (int64_t i = 0; i < nq; ++i) std::fill_n(m.grad_weights + i * nk, visible_keys, 0.0f);
  }
  score_gradients(bp, b, h, visible_keys, m);

  // Forward 1: "S = scale * Q K^T".  dQ = scale * dS K  and  dK += scale * dS^T Q.
  if (rows_finite(k, visible_keys, dk, p.k.row_stride)) {
    sgemm(false, false, nq, dk, visible_keys, p.scale, m.weights, nk, k, p.k.row_stride, 0.0f, grad_q,
          bp.grad_q.row_stride);
  } else {  // a hidden key's K may be NaN or Inf: its dS is 0 and must stay out of dQ
    zero_rows(grad_q, nq, dk, bp.grad_q.row_stride);
    accumulate_skipping_zeros(static_cast<size_t>(nq), static_cast<size_t>(visible_keys), static_cast<size_t>(dk),
                              m.weights, static_cast<size_t>(nk), 1, k, p.k.row_stride, grad_q,
                              static_cast<size_t>(bp.grad_q.row_stride), 1);
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t c = 0; c < dk; ++c) grad_q[i * bp.grad_q.row_stride + c] *= p.scale;
  }
  sgemm(true, false, visible_keys, dk, nq, p.scale, m.weights, nk, p.q.row(b, h, 0), p.q.row_stride, 1.0f,
        bp.grad_k.row(b, g, 0), bp.grad_k.row_stride);
}
}  // namespace

void reference_attention_backward(const AttentionBackwardProblem& bp) {
  const AttentionProblem& p = bp.forward;
  const int64_t nq = p.q_len, nk = p.kv_len;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t g = 0; g < p.kv_heads; ++g) {
      zero_rows(bp.grad_k.row(b, g, 0), nk, p.head_dim, bp.grad_k.row_stride);
      zero_rows(bp.grad_v.row(b, g, 0), nk, p.value_dim, bp.grad_v.row_stride);
    }
  const size_t matrix = static_cast<size_t>(nq * nk);
  float* workspace = thread_workspace(WorkspaceSlot::ReferenceScores).floats((p.has_score_slope() ? 3 : 2) * matrix);
  const HeadScratch m{workspace, workspace + matrix, workspace + 2 * matrix};

  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.q_heads; ++h) {
      if (nq == 0) continue;
      // Keys [0, visible_keys) are all any query of this (b, h) may see; the rest get no gradient.
      const int64_t visible_keys = std::clamp<int64_t>(p.last_visible_key(b, nq - 1), 0, nk);
      if (visible_keys == 0) {
        zero_rows(bp.grad_q.row(b, h, 0), nq, p.head_dim, bp.grad_q.row_stride);
        continue;
      }
      head_backward(bp, b, h, visible_keys, m);
    }
}

}  // namespace qkv::detail
