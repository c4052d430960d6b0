// The normalised attention problem every kernel receives. src/attention/attention.cpp builds
// it after checking the arguments once; kernels trust it and check nothing.
#pragma once

#include <cstdint>
#include <vector>

namespace qkv::detail {

// A tensor mask as a kernel reads it: the value for scores element (b, h, i, j) is
//   data[b * stride_b + h * stride_h + i * stride_q + j * stride_k],
// with stride 0 on every broadcast dim.
struct MaskTermView {
  const float* data;
  int64_t stride_b, stride_h, stride_q, stride_k;
  bool additive;  // false: keep (0 = masked); true: added to the scaled score

  float at(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return data[b * stride_b + h * stride_h + i * stride_q + j * stride_k];
  }
};

struct AttentionProblem {
  int64_t batch, q_heads, kv_heads;  // q_heads is a multiple of kv_heads
  int64_t q_len, kv_len;             // Nq, Nk
  int64_t head_dim, value_dim;       // Dk, Dv
  const float* q;  // (B, Hq, Nq, Dk), packed
  const float* k;  // (B, Hkv, Nk, Dk), packed
  const float* v;  // (B, Hkv, Nk, Dv), packed
  float scale;

  // Visibility, one rule for every structured mask: key j is visible to query i of batch b
  // when i + band_lo <= j <= i + band_hi and j < key_lengths[b], and every term allows it.
  int64_t band_lo, band_hi;
  std::vector<int64_t> key_lengths;  // one per batch; kv_len where no padding mask was given
  std::vector<MaskTermView> terms;

  float dropout_p;  // 0: no dropout
  uint64_t seed;

  float* output;   // (B, Hq, Nq, Dv)
  float* weights;  // (B, Hq, Nq, Nk), or nullptr when not asked for
  float* lse;      // (B, Hq, Nq)

  // Grouped-query attention: the key/value head that query head h reads.
  int64_t kv_head_of(int64_t h) const { return h / (q_heads / kv_heads); }
  // The half-open range [first, last) of keys the band and key lengths let query i of batch b
  // see (tensor terms may hide more). Empty when first >= last.
  int64_t first_visible_key(int64_t i) const { return i + band_lo > 0 ? i + band_lo : 0; }
  int64_t last_visible_key(int64_t b, int64_t i) const {
    const int64_t band_end = i + band_hi + 1;
    return band_end < key_lengths[b] ? band_end : key_lengths[b];
  }
};

// The backward problem: the forward's problem (q, k, v, scale, masks, dropout; its output,
// weights and lse pointers are null) plus what the forward returned and the gradients to write.
struct AttentionBackwardProblem {
  AttentionProblem forward;
  const float* output;       // (B, Hq, Nq, Dv), the forward's O
  const float* lse;          // (B, Hq, Nq), the forward's log-sum-exp (-inf: the row saw no key)
  const float* grad_output;  // (B, Hq, Nq, Dv), dLoss/dO
  float* grad_q;             // (B, Hq, Nq, Dk), overwritten
  float* grad_k;             // (B, Hkv, Nk, Dk), overwritten
  float* grad_v;             // (B, Hkv, Nk, Dv), overwritten
};

// The dropout rule every kernel shares: weight (b, h, i, j) is kept when the counter-based
// uniform for those coordinates is >= p.
bool dropout_keeps(const AttentionProblem& problem, int64_t b, int64_t h, int64_t i, int64_t j);

}  // namespace qkv::detail
