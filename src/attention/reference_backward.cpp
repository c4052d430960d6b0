// The reference backward: the gradients of softmax(Q K^T * scale + mask) V with respect to Q, K
// and V, step by step, one (batch, head) at a time, with the Nq x Nk matrices materialised (llm.c's
// attention_backward). Clarity first: it is the oracle the flash backward is tested against.
//
// The forward (reference.cpp), per (b, h) with g = the key/value head of h:
//   1. S = scale * Q K^T
//   2. S[i,j] = -inf where the mask hides key j from query i; additive terms are added
//   3. P = softmax(S), lse[i] = log sum_j exp(S[i,j])
//   4. P'[i,j] = keep(b,h,i,j) ? P[i,j] / (1 - p) : 0        (P' = P without dropout)
//   5. O = P' V
// The backward walks it in reverse, each step quoting the line it differentiates. Nothing but O
// and lse is kept from the forward: P is recomputed as exp(S - lse) (flash-attention's backward),
// and a row that saw no key (lse = -inf) has P = 0, so it gets and gives zero gradients.
//
// Grouped-query attention: every query head of a group reads the same K and V, so dK and dV of
// a key/value head are sums over the group's query heads (the loop adds into them).
//
// Keys past the last one any query may see are never read, as in the forward; a hidden key
// inside that range has P = 0, and its dS is set to exactly 0, so a NaN or Inf in its V (a KV
// cache's unwritten slot) reaches no gradient; one in its K is skipped in step 1's dQ product.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "attention/kernels.hpp"
#include "memory.hpp"

namespace qkv::detail {

namespace {
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

bool all_finite(const float* values, int64_t count) {
  for (int64_t n = 0; n < count; ++n)
    if (!std::isfinite(values[n])) return false;
  return true;
}

int to_int(int64_t n) { return static_cast<int>(n); }
}  // namespace

void reference_attention_backward(const AttentionBackwardProblem& bp) {
  const AttentionProblem& p = bp.forward;
  const int64_t nq = p.q_len, nk = p.kv_len, dk = p.head_dim, dv = p.value_dim;
  std::fill_n(bp.grad_k, p.batch * p.kv_heads * nk * dk, 0.0f);
  std::fill_n(bp.grad_v, p.batch * p.kv_heads * nk * dv, 0.0f);
  // P (then dS) and dP', Nq x Nk each, in this thread's workspace.
  float* workspace = thread_workspace(WorkspaceSlot::ReferenceScores).floats(static_cast<size_t>(2 * nq * nk));
  float* weights = workspace;          // P, then dS
  float* grad_weights = workspace + nq * nk;  // dP' = dL/dP', then dP

  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < p.q_heads; ++h) {
      const int64_t bh = b * p.q_heads + h;
      const int64_t bg = b * p.kv_heads + p.kv_head_of(h);
      const float* q = p.q + bh * nq * dk;
      const float* k = p.k + bg * nk * dk;
      const float* v = p.v + bg * nk * dv;
      const float* out = bp.output + bh * nq * dv;
      const float* grad_out = bp.grad_output + bh * nq * dv;
      const float* lse = bp.lse + bh * nq;
      float* grad_q = bp.grad_q + bh * nq * dk;
      float* grad_k = bp.grad_k + bg * nk * dk;
      float* grad_v = bp.grad_v + bg * nk * dv;

      // Keys [0, visible_keys) are all any query of this (b, h) may see; the rest get no gradient.
      const int64_t visible_keys = nq > 0 ? std::clamp<int64_t>(p.last_visible_key(b, nq - 1), 0, nk) : 0;
      if (nq == 0) continue;
      if (visible_keys == 0) {
        std::fill_n(grad_q, nq * dk, 0.0f);
        continue;
      }

      // Recompute the weights. Forward: "S = scale * Q K^T", "mask", "P = softmax(S)"; here
      // P = exp(S - lse), with lse = -inf (no visible key) giving P = 0.
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, to_int(nq), to_int(visible_keys), to_int(dk), p.scale, q,
                  to_int(dk), k, to_int(dk), 0.0f, weights, to_int(nk));
      for (int64_t i = 0; i < nq; ++i) {
        float* row = weights + i * nk;
        reference_mask_row(p, b, h, i, row);
        for (int64_t j = 0; j < visible_keys; ++j) row[j] = lse[i] == kMinusInf ? 0.0f : std::exp(row[j] - lse[i]);
      }

      // Forward 5: "O = P' V".  dV += P'^T dO  and  dP' = dO V^T.
      // P' = P with dropout's scaling and zeros, made in grad_weights for the dV product.
      const float survivor_scale = p.dropout_p > 0 ? 1.0f / (1.0f - p.dropout_p) : 1.0f;
      const float* dropped_weights = weights;
      if (p.dropout_p > 0) {
        for (int64_t i = 0; i < nq; ++i)
          for (int64_t j = 0; j < visible_keys; ++j)
            grad_weights[i * nk + j] = dropout_keeps(p, b, h, i, j) ? weights[i * nk + j] * survivor_scale : 0.0f;
        dropped_weights = grad_weights;
      }
      if (dv > 0)
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, to_int(visible_keys), to_int(dv), to_int(nq), 1.0f,
                    dropped_weights, to_int(nk), grad_out, to_int(dv), 1.0f, grad_v, to_int(dv));
      if (dv > 0) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, to_int(nq), to_int(visible_keys), to_int(dv), 1.0f,
                    grad_out, to_int(dv), v, to_int(dv), 0.0f, grad_weights, to_int(nk));
      } else {
        for (int64_t i = 0; i < nq; ++i) std::fill_n(grad_weights + i * nk, visible_keys, 0.0f);
      }

      for (int64_t i = 0; i < nq; ++i) {
        float* grad_row = grad_weights + i * nk;
        float* row = weights + i * nk;
        // Forward 4: "P'[i,j] = keep ? P[i,j] / (1 - p) : 0".  dP = keep ? dP' / (1 - p) : 0.
        if (p.dropout_p > 0)
          for (int64_t j = 0; j < visible_keys; ++j)
            grad_row[j] = dropout_keeps(p, b, h, i, j) ? grad_row[j] * survivor_scale : 0.0f;
        // Forward 3: "P = softmax(S)".  dS = P * (dP - D), D = sum_j P dP = sum_j P' dP' = dO . O
        // (the last form needs no pass over the row: O = P' V).
        double row_dot = 0;
        for (int64_t c = 0; c < dv; ++c) row_dot += static_cast<double>(grad_out[i * dv + c]) * out[i * dv + c];
        const float d = static_cast<float>(row_dot);
        // Forward 2: "mask": a hidden score has P = 0 and gets dS = 0 exactly (never 0 * NaN);
        // an additive term passes dS through unchanged.
        for (int64_t j = 0; j < visible_keys; ++j) row[j] = row[j] == 0.0f ? 0.0f : row[j] * (grad_row[j] - d);
      }

      // Forward 1: "S = scale * Q K^T".  dQ = scale * dS K  and  dK += scale * dS^T Q.
      if (all_finite(k, visible_keys * dk)) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, to_int(nq), to_int(dk), to_int(visible_keys), p.scale,
                    weights, to_int(nk), k, to_int(dk), 0.0f, grad_q, to_int(dk));
      } else {  // a hidden key's K may be NaN or Inf: its dS is 0 and must stay out of dQ
        std::fill_n(grad_q, nq * dk, 0.0f);
        for (int64_t i = 0; i < nq; ++i)
          for (int64_t j = 0; j < visible_keys; ++j) {
            const float grad_score = weights[i * nk + j];
            if (grad_score == 0.0f) continue;
            for (int64_t c = 0; c < dk; ++c) grad_q[i * dk + c] += p.scale * grad_score * k[j * dk + c];
          }
      }
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, to_int(visible_keys), to_int(dk), to_int(nq), p.scale,
                  weights, to_int(nk), q, to_int(dk), 1.0f, grad_k, to_int(dk));
    }
  }
}

}  // namespace qkv::detail
