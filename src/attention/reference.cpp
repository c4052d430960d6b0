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
//
// Keys past the last one any query may see (a KV cache's unwritten slots) are never read. A
// hidden key inside that range has weight 0, and 0 * NaN is NaN: when V holds a non-finite
// value there, step 5 skips zero weights, so NaN or Inf reaches only the rows that see it.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "attention/kernels.hpp"
#include "memory.hpp"

namespace qkv::detail {

namespace {
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
}  // namespace

// Step 2 for one row of scores (also the reference backward's, declared in kernels.hpp).
void reference_mask_row(const AttentionProblem& p, int64_t b, int64_t h, int64_t i, float* scores) {
  const int64_t first = p.first_visible_key(i);
  const int64_t last = p.last_visible_key(b, i);
  for (int64_t j = 0; j < p.kv_len; ++j)
    if (j < first || j >= last) scores[j] = kMinusInf;
  for (const MaskTermView& term : p.terms) {
    for (int64_t j = 0; j < p.kv_len; ++j) {
      const float value = term.at(b, h, i, j);
      if (term.additive) {
        // -inf hides the key whatever its score was (NaN + -inf would be NaN).
        scores[j] = value == kMinusInf ? kMinusInf : scores[j] + value;
      } else if (value == 0.0f) {
        scores[j] = kMinusInf;
      }
    }
  }
}

namespace {
// Step 3 for one row: scores become weights in place; returns the row's log-sum-exp.
float softmax_row(float* row, int64_t n) {
  float row_max = kMinusInf;
  bool any_nan = false;
  for (int64_t j = 0; j < n; ++j) {
    row_max = std::max(row_max, row[j]);
    any_nan = any_nan || std::isnan(row[j]);
  }
  if (row_max == kMinusInf) {
    // No visible key: an empty row, not a NaN. Unless a visible score was NaN (a NaN query):
    // then the row is NaN, as it would be with any visible key.
    const float fill = any_nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
    std::fill_n(row, n, fill);
    return any_nan ? fill : kMinusInf;
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

bool all_finite(const float* values, int64_t count) {
  for (int64_t n = 0; n < count; ++n)
    if (!std::isfinite(values[n])) return false;
  return true;
}

// Step 5 when V holds non-finite values: out[i] = sum over the nonzero weights of row i.
void weighted_sum_skipping_zeros(const float* weights, int64_t weights_stride, const float* v, int64_t nq,
                                 int64_t keys, int64_t dv, float* out) {
  std::fill_n(out, nq * dv, 0.0f);
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t j = 0; j < keys; ++j) {
      const float w = weights[i * weights_stride + j];
      if (w == 0.0f) continue;
      for (int64_t c = 0; c < dv; ++c) out[i * dv + c] += w * v[j * dv + c];
    }
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

      // Keys [0, visible_keys) are all any query of this (b, h) may see.
      const int64_t visible_keys = nq > 0 ? std::clamp<int64_t>(p.last_visible_key(b, nq - 1), 0, nk) : 0;

      // 1. S = scale * Q K^T over those keys (step 2 hides the rest)
      if (nq > 0 && visible_keys > 0)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(nq), static_cast<int>(visible_keys),
                    static_cast<int>(dk), p.scale, q, static_cast<int>(dk), k, static_cast<int>(dk), 0.0f, scores,
                    static_cast<int>(nk));
      for (int64_t i = 0; i < nq; ++i) {
        float* row = scores + i * nk;
        // 2. mask
        reference_mask_row(p, b, h, i, row);
        // 3. softmax and log-sum-exp
        lse[i] = softmax_row(row, nk);
        // 4. dropout on the weights
        if (p.dropout_p > 0) {
          const float survivor_scale = 1.0f / (1.0f - p.dropout_p);
          for (int64_t j = 0; j < nk; ++j) row[j] = dropout_keeps(p, b, h, i, j) ? row[j] * survivor_scale : 0.0f;
        }
      }
      // 5. O = P V over the keys that may be visible
      if (nq == 0 || visible_keys == 0 || dv == 0) {
        std::fill_n(out, nq * dv, 0.0f);
      } else if (all_finite(v, visible_keys * dv)) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(nq), static_cast<int>(dv),
                    static_cast<int>(visible_keys), 1.0f, scores, static_cast<int>(nk), v, static_cast<int>(dv), 0.0f,
                    out, static_cast<int>(dv));
      } else {
        weighted_sum_skipping_zeros(scores, nk, v, nq, visible_keys, dv, out);
      }
    }
  }
}

}  // namespace qkv::detail
