// The attention kernels behind qkv::scaled_dot_product_attention. Each takes a checked,
// normalised AttentionProblem (problem.hpp) and writes output, lse and (if asked) weights.
#pragma once

#include <cmath>
#include <cstddef>
#include <limits>
#include <cstdint>

#include "simd/item_shares.hpp"
#include "attention/problem.hpp"

namespace qkv::detail {

// The textbook algorithm, scores materialised (src/attention/reference/forward.cpp).
void reference_attention(const AttentionProblem& problem);

// Tiles of queries x keys with an online softmax, SIMD and threads, never an Nq x Nk matrix
// (src/attention/flash/forward.cpp). Writes output and lse; problem.weights must be nullptr.
void flash_attention(const AttentionProblem& problem);
// The forward's work items, (batch, query head, query tile): what its threads share.
int64_t flash_forward_items(const AttentionProblem& problem);

// Few queries against a long KV cache: keys split into chunks across threads, partials merged
// (src/attention/decode/: decode.cpp launches, chunk-inl.h runs an item). Writes output and lse;
// problem.weights must be nullptr. Returns false when problem.scales_unchecked and a scale of K or
// V is not valid, or when it returned before reading any (an empty q): the caller then runs
// check_scales (problem.hpp), which names the bad scale; the outputs hold garbage after a bad one.
bool decode_attention(const AttentionProblem& problem);
// Auto's choice between the two fused kernels: true when decode is expected to beat flash
// (enough key chunks to keep every thread busy, and few queries: up to 8, or up to 64 where
// flash's items would leave threads idle).
bool decode_is_faster(const AttentionProblem& problem);

// The gradients of the forward with respect to q, k and v: P recomputed from the forward's lse,
// D = rowsum(dO * O), dS = P * (dP - D) (see each file's header). Every gradient is overwritten.
// The textbook backward, scores materialised (src/attention/reference/backward.cpp).
void reference_attention_backward(const AttentionBackwardProblem& problem);
// By tiles, never an Nq x Nk matrix, SIMD and threads (src/attention/flash/backward.cpp).
void flash_attention_backward(const AttentionBackwardProblem& problem);

// Step "accumulate" of every kernel when V holds NaN or Inf (a KV cache's unwritten slots): a key
// some row cannot see has weight 0 there and 0 * NaN is NaN, so zero weights are skipped. Weight
// (r, j) at w[r * w_row + j * w_key], V row j at v + j * v_row, O (r, c) at out[r * o_row + c * o_col].
inline void accumulate_skipping_zeros(size_t rows, size_t cols, size_t dv, const float* w, size_t w_row,
                                      size_t w_key, const float* v, int64_t v_row, float* out, size_t o_row,
                                      size_t o_col) {
  for (size_t r = 0; r < rows; ++r)
    for (size_t j = 0; j < cols; ++j) {
      const float weight = w[r * w_row + j * w_key];
      if (weight == 0.0f) continue;
      const float* v_j = v + static_cast<int64_t>(j) * v_row;
      for (size_t c = 0; c < dv; ++c) out[r * o_row + c * o_col] += weight * v_j[c];
    }
}

// Step "finish" of the fused kernels, one row: output = O / l (O read at o[c * o_stride]), lse =
// max + log(l), and the row stats the backward recomputes weights from. A row that saw nothing
// (l = 0) gets zeros and lse = -inf (ggml's S == 0 ? 0 : 1/S guard); one that saw a NaN score
// gets NaN.
inline void finish_row(const float* o, size_t o_stride, size_t dv, float max, float sum, bool nan, float* out,
                       float* lse, float* row_max, float* row_sum) {
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  const float inverse_sum = nan ? kNaN : (sum == 0.0f ? 0.0f : 1.0f / sum);
  for (size_t c = 0; c < dv; ++c) out[c] = o[c * o_stride] * inverse_sum;
  *lse = nan ? kNaN : (sum == 0.0f ? -std::numeric_limits<float>::infinity() : max + std::log(sum));
  *row_max = nan ? kNaN : max;
  *row_sum = nan ? kNaN : sum;
}

// The reference's modifier and masking steps for one row of scaled scores (B, Hq, Nq, Nk)[b, h, i, :]
// (reference/forward.cpp): softcap, ALiBi, the score function (d(modified)/d(raw) into score_slope
// when given: softcap's 1 - tanh^2 times the function's derivative), then -inf
// where the band, the key lengths or a keep term hides the key, and additive terms added.
void reference_logits_row(const AttentionProblem& problem, int64_t b, int64_t h, int64_t i, float* scores,
                          float* score_slope = nullptr);

// n rounded up to a multiple of `multiple`.
constexpr size_t round_up(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// Scratch is laid out in whole cache lines (64 bytes), so workers never share one and every
// part starts aligned for SIMD loads on every target.
constexpr size_t kCacheLineFloats = 64 / sizeof(float);
constexpr size_t round_to_cache_line(size_t floats) { return round_up(floats, kCacheLineFloats); }

// The threads a kernel uses for a problem of `flops`: all of OpenMP's, except below about 100 us
// of one core's arithmetic (kMinFlopsToThread), where it runs on the calling thread alone: a
// parallel region's fork and join costs microseconds on an idle machine and a scheduler time
// slice on a busy one, more than such a problem's work (a short MHA call, one decode step of a
// small model).
int threads_for(double flops);
constexpr double kMinFlopsToThread = 1 << 23;

// For tests: the threshold threads_for uses (0: every problem threads), so that the small random
// cases of the kernel tests really run on several threads. Returns the previous threshold.
double set_min_flops_to_thread_for_test(double flops);

}  // namespace qkv::detail
