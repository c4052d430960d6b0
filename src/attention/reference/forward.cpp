// The reference kernel: softmax(Q K^T * scale + mask) V, step by step, one (batch, head) at a
// time, with the Nq x Nk score matrix materialised. Clarity first: it is the oracle every
// faster kernel is tested against and the path that returns the weights.
//
// Per (b, h), with g = the key/value head of h:
//   1. S = scale * Q[b,h] K[b,g]^T                       (sgemm, Nq x Nk)
//   2. modifiers: S = softcap tanh(S / softcap); S[i,j] -= slope[h] |i + Nk - Nq - j| (ALiBi)
//   3. S[i,j] = -inf where the mask (band, key lengths, rule, keep terms) hides key j from query i;
//      additive terms are added
//   4. P = softmax(S) row by row, the sink (if any) in the denominator; lse[i] = log(exp(sink) +
//      sum_j exp(S[i,j])), and the row's max and sum kept for the backward; a row that sees no
//      key gets P = 0 and lse = -inf (or the sink), never the NaN of exp(-inf - -inf)
//   5. dropout: P[i,j] = keep ? P[i,j] / (1 - p) : 0
//   6. O = P V[b,g]                                        (sgemm, Nq x Dv)
//
// Q, K, V and O are read and written through their row strides (a view is never copied). Keys
// past the last one any query may see (a KV cache's unwritten slots) are never read. A hidden key
// inside that range has weight 0, and 0 * NaN is NaN: when V holds a non-finite value there,
// step 6 skips zero weights, so NaN or Inf reaches only the rows that see it.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention/kernels.hpp"
#include "gemm/gemm.hpp"
#include "core/allocator.hpp"

namespace qkv::detail {

namespace {
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
}  // namespace

namespace {
// The score function over row i of head (b, h), in place; with `slope`, its derivative joins it
// (slope *= d score_mod / ds). The row goes through a copy padded to whole vectors of any target
// (ScoreFunction::line's contract); scratch: the calling thread's, grown once.
void apply_score_mod(const AttentionProblem& p, int64_t b, int64_t h, int64_t i, float* scores, float* slope) {
  constexpr size_t kWidest = 16;  // floats in the widest SIMD vector
  thread_local std::vector<float> scratch, line, derivative;
  const size_t nk = static_cast<size_t>(p.kv_len), n = (nk + kWidest - 1) / kWidest * kWidest;
  if (scratch.size() < p.score_mod->scratch_floats(n)) scratch.resize(p.score_mod->scratch_floats(n));
  if (line.size() < n) line.resize(n), derivative.resize(n);
  std::copy_n(scores, nk, line.data());
  std::fill(line.begin() + static_cast<std::ptrdiff_t>(nk), line.begin() + static_cast<std::ptrdiff_t>(n), 0.0f);
  p.score_mod->line({b, h, i, 0, 0, 1}, n, nk, line.data(), slope ? derivative.data() : nullptr, scratch.data());
  std::copy_n(line.data(), nk, scores);
  if (slope)
    for (size_t j = 0; j < nk; ++j) slope[j] *= derivative[j];
}
}  // namespace

// Steps 2 and 3 for one row of scores (also the reference backward's, declared in kernels.hpp).
void reference_logits_row(const AttentionProblem& p, int64_t b, int64_t h, int64_t i, float* scores,
                          float* score_slope) {
  const int64_t nk = p.kv_len;
  if (score_slope) std::fill_n(score_slope, nk, 1.0f);
  if (p.softcap > 0)
    for (int64_t j = 0; j < nk; ++j) {
      const float t = std::tanh(scores[j] / p.softcap);
      scores[j] = p.softcap * t;
      if (score_slope) score_slope[j] = 1.0f - t * t;
    }
  if (p.alibi_slopes)
    for (int64_t j = 0; j < nk; ++j)
      scores[j] -= p.alibi_slope(b, h) * static_cast<float>(std::abs(i + p.alibi_offset() - j));
  if (p.score_mod) apply_score_mod(p, b, h, i, scores, score_slope);
  const int64_t first = p.first_visible_key(i);
  const int64_t last = p.last_visible_key(b, i);
  for (int64_t j = 0; j < p.kv_len; ++j)
    if (j < first || j >= last) scores[j] = kMinusInf;
  if (!p.rule.empty())
    for (int64_t j = std::max<int64_t>(first, 0); j < std::min(last, p.kv_len); ++j)
      if (!p.rule.visible(b, h, i, j)) scores[j] = kMinusInf;
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
// Step 4 for one row: scores become weights in place, the sink logit (-inf: none) joining the
// denominator; writes the row's max, sum and log-sum-exp.
void softmax_row(float* row, int64_t n, float sink, float& row_max, float& row_sum, float& lse) {
  row_max = sink;
  bool any_nan = false;
  for (int64_t j = 0; j < n; ++j) {
    row_max = std::max(row_max, row[j]);
    any_nan = any_nan || std::isnan(row[j]);
  }
  if (any_nan) {  // a visible NaN score (a NaN query): the row is NaN, as with any visible key
    std::fill_n(row, n, std::numeric_limits<float>::quiet_NaN());
    row_max = row_sum = lse = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  if (row_max == kMinusInf) {  // no visible key and no sink: an empty row, not a NaN
    std::fill_n(row, n, 0.0f);
    row_sum = 0;
    lse = kMinusInf;
    return;
  }
  // Subtracting the row max keeps every exp in (0, 1]: no overflow for large logits.
  double sum = sink == kMinusInf ? 0.0 : std::exp(static_cast<double>(sink) - row_max);
  for (int64_t j = 0; j < n; ++j) {
    row[j] = std::exp(row[j] - row_max);
    sum += row[j];
  }
  const float inverse = static_cast<float>(1.0 / sum);
  for (int64_t j = 0; j < n; ++j) row[j] *= inverse;
  row_sum = static_cast<float>(sum);
  lse = row_max + static_cast<float>(std::log(sum));
}

bool rows_finite(const float* values, int64_t rows, int64_t cols, int64_t stride) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      if (!std::isfinite(values[r * stride + c])) return false;
  return true;
}

// Steps 1-5 for head (b, h): the weights (Nq x Nk, row stride nk) and the row statistics.
void weights_of_head(const AttentionProblem& p, int64_t b, int64_t h, int64_t visible_keys, float* scores) {
  const int64_t nq = p.q_len, nk = p.kv_len, dk = p.head_dim;
  const int64_t g = p.kv_head_of(h);
  // 1. S = scale * Q K^T over the keys that may be visible (step 3 hides the rest)
  if (visible_keys > 0)
    sgemm(false, true, nq, visible_keys, dk, p.scale, p.q.row(b, h, 0), p.q.row_stride, p.k.row(b, g, 0),
          p.k.row_stride, 0.0f, scores, nk);
  const int64_t row0 = (b * p.q_heads + h) * nq;
  for (int64_t i = 0; i < nq; ++i) {
    float* row = scores + i * nk;
    // 2, 3. modifiers and mask
    reference_logits_row(p, b, h, i, row);
    // 4. softmax, log-sum-exp and the row stats
    softmax_row(row, nk, p.sink(h), p.row_max[row0 + i], p.row_sum[row0 + i], p.lse[row0 + i]);
    // 5. dropout on the weights
    if (p.dropout_p > 0) {
      const float survivor_scale = 1.0f / (1.0f - p.dropout_p);
      for (int64_t j = 0; j < nk; ++j) row[j] = dropout_keeps(p, b, h, i, j) ? row[j] * survivor_scale : 0.0f;
    }
  }
}
}  // namespace

void reference_attention(const AttentionProblem& p) {
  if (p.kv_dtype != DType::F32) return with_float_kv(p, reference_attention);  // a widened copy
  const int64_t nq = p.q_len, nk = p.kv_len, dv = p.value_dim;
  // Scores go straight into the caller's weights when asked for, else into this thread's
  // workspace, reused from call to call.
  float* scratch = p.weights ? nullptr : thread_workspace(WorkspaceSlot::ReferenceScores).floats(static_cast<size_t>(nq * nk));

  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < p.q_heads; ++h) {
      if (nq == 0) continue;
      const int64_t g = p.kv_head_of(h);
      float* scores = p.weights ? p.weights + (b * p.q_heads + h) * nq * nk : scratch;
      // Keys [0, visible_keys) are all any query of this (b, h) may see.
      const int64_t visible_keys = std::clamp<int64_t>(p.last_visible_key(b, nq - 1), 0, nk);
      weights_of_head(p, b, h, visible_keys, scores);

      // 6. O = P V over the keys that may be visible
      const float* v = p.v.row(b, g, 0);
      float* out = p.output.row(b, h, 0);
      const int64_t out_stride = p.output.row_stride;
      if (visible_keys == 0 || dv == 0) {
        for (int64_t i = 0; i < nq; ++i) std::fill_n(out + i * out_stride, dv, 0.0f);
      } else if (rows_finite(v, visible_keys, dv, p.v.row_stride)) {
        sgemm(false, false, nq, dv, visible_keys, 1.0f, scores, nk, v, p.v.row_stride, 0.0f, out, out_stride);
      } else {
        for (int64_t i = 0; i < nq; ++i) std::fill_n(out + i * out_stride, dv, 0.0f);
        accumulate_skipping_zeros(static_cast<size_t>(nq), static_cast<size_t>(visible_keys), static_cast<size_t>(dv),
                                  scores, static_cast<size_t>(nk), 1, v, p.v.row_stride, out,
                                  static_cast<size_t>(out_stride), 1);
      }
    }
  }
}

}  // namespace qkv::detail
