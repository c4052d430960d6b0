// The reference kernel: softmax(Q K^T * scale + mask) V, step by step, one (batch, head) at a
// time, with the Nq x Nk score matrix materialised. Clarity first: it is the oracle every
// faster kernel is tested against and the path that returns the weights.
//
// Per (b, h), with g = the key/value head of h:
//   1. S = scale * Q[b,h] K[b,g]^T                       (sgemm, Nq x Nk)
//   2. S[i,j] = -inf where the mask hides key j from query i; additive terms are added
//   3. P = softmax(S) row by row, lse[i] = log sum_j exp(S[i,j]); a row that sees no key
//      gets P = 0 and lse = -inf (never the NaN of exp(-inf - -inf))
//   4. dropout: P[i,j] = keep ? P[i,j] / (1 - p) : 0
//   5. O = P V[b,g]                                        (sgemm, Nq x Dv)
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "attention/kernels.hpp"
#include "memory.hpp"

namespace qkv::detail {

namespace {
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// Step 2 for one row of scores.
void mask_row(const AttentionProblem& p, int64_t b, int64_t h, int64_t i, float* scores) {
  const int64_t first = p.first_visible_key(i);
  const int64_t last = p.last_visible_key(b, i);
  for (int64_t j = 0; j < p.kv_len; ++j)
    if (j < first || j >= last) scores[j] = kMinusInf;
  for (const MaskTermView& term : p.terms) {
    for (int64_t j = 0; j < p.kv_len; ++j) {
      const float value = term.at(b, h, i, j);
      if (term.additive) {
        scores[j] += value;
      } else if (value == 0.0f) {
        scores[j] = kMinusInf;
      }
    }
  }
}

// Step 3 for one row: scores become weights in place; returns the row's log-sum-exp.
float softmax_row(float* row, int64_t n) {
  float row_max = kMinusInf;
  for (int64_t j = 0; j < n; ++j) row_max = std::max(row_max, row[j]);
  if (row_max == kMinusInf) {  // no visible key: an empty row, not a NaN
    std::fill_n(row, n, 0.0f);
    return kMinusInf;
  }
  // Subtracting the row max keeps every exp in (0, 1]: no overflow for large logits.
  double row_sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    row[j] = std::exp(row[j] - row_max);
    row_sum += row[j];
  }
  const float inverse = static_cast<float>(1.0 / row_sum);
  for (int64_t j = 0; j < n; ++j) row[j] *= inverse;
  return row_max + static_cast<float>(std::log(row_sum));
}
}  // namespace

void reference_attention(const AttentionProblem& p) {
  const int64_t nq = p.q_len, nk = p.kv_len, dk = p.head_dim, dv = p.value_dim;
  // Scores go straight into the caller's weights when asked for, else into this thread's
  // workspace, reused from call to call.
  float* scratch = p.weights ? nullptr : thread_workspace(WorkspaceSlot::ReferenceScores).floats(static_cast<size_t>(nq * nk));

  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < p.q_heads; ++h) {
      const int64_t bh = b * p.q_heads + h;
      const int64_t bg = b * p.kv_heads + p.kv_head_of(h);
      const float* q = p.q + bh * nq * dk;
      const float* k = p.k + bg * nk * dk;
      const float* v = p.v + bg * nk * dv;
      float* scores = p.weights ? p.weights + bh * nq * nk : scratch;
      float* out = p.output + bh * nq * dv;
      float* lse = p.lse + bh * nq;

      // 1. S = scale * Q K^T
      if (nq > 0 && nk > 0)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(nq), static_cast<int>(nk),
                    static_cast<int>(dk), p.scale, q, static_cast<int>(dk), k, static_cast<int>(dk), 0.0f, scores,
                    static_cast<int>(nk));
      for (int64_t i = 0; i < nq; ++i) {
        float* row = scores + i * nk;
        // 2. mask
        mask_row(p, b, h, i, row);
        // 3. softmax and log-sum-exp
        lse[i] = softmax_row(row, nk);
        // 4. dropout on the weights
        if (p.dropout_p > 0) {
          const float survivor_scale = 1.0f / (1.0f - p.dropout_p);
          for (int64_t j = 0; j < nk; ++j) row[j] = dropout_keeps(p, b, h, i, j) ? row[j] * survivor_scale : 0.0f;
        }
      }
      // 5. O = P V
      if (nq > 0 && nk > 0 && dv > 0) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(nq), static_cast<int>(dv),
                    static_cast<int>(nk), 1.0f, scores, static_cast<int>(nk), v, static_cast<int>(dv), 0.0f, out,
                    static_cast<int>(dv));
      } else {
        std::fill_n(out, nq * dv, 0.0f);
      }
    }
  }
}

}  // namespace qkv::detail
