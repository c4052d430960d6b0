// The attention kernels behind qkv::scaled_dot_product_attention. Each takes a checked,
// normalised AttentionProblem (problem.hpp) and writes output, lse and (if asked) weights.
#pragma once

#include <cstddef>

#include "attention/problem.hpp"

namespace qkv::detail {

// The textbook algorithm, scores materialised (src/attention/reference.cpp).
void reference_attention(const AttentionProblem& problem);

// Tiles of queries x keys with an online softmax, SIMD and threads, never an Nq x Nk matrix
// (src/attention/flash.cpp). Writes output and lse; problem.weights must be nullptr.
void flash_attention(const AttentionProblem& problem);

// Few queries against a long KV cache: keys split into chunks across threads, partials merged
// (src/attention/decode.cpp). Writes output and lse; problem.weights must be nullptr.
void decode_attention(const AttentionProblem& problem);
// Auto's choice between the two fused kernels: true when decode is expected to beat flash
// (few queries, and enough key chunks to keep every thread busy).
bool decode_is_faster(const AttentionProblem& problem);

// The gradients of the forward with respect to q, k and v: P recomputed from the forward's lse,
// D = rowsum(dO * O), dS = P * (dP - D) (see each file's header). Every gradient is overwritten.
// The textbook backward, scores materialised (src/attention/reference_backward.cpp).
void reference_attention_backward(const AttentionBackwardProblem& problem);
// By tiles, never an Nq x Nk matrix, SIMD and threads (src/attention/flash_backward.cpp).
void flash_attention_backward(const AttentionBackwardProblem& problem);

// The reference's masking step for one row of scaled scores (B, Hq, Nq, Nk)[b, h, i, :]: -inf
// where the band, the key lengths or a keep term hides the key; additive terms added.
void reference_mask_row(const AttentionProblem& problem, int64_t b, int64_t h, int64_t i, float* scores);

// Scratch is laid out in whole cache lines (64 bytes), so workers never share one and every
// part starts aligned for SIMD loads on every target.
constexpr size_t kCacheLineFloats = 64 / sizeof(float);
constexpr size_t round_to_cache_line(size_t floats) {
  return (floats + kCacheLineFloats - 1) / kCacheLineFloats * kCacheLineFloats;
}

// Below about 100 us of one core's arithmetic, a kernel runs on the calling thread alone: a
// parallel region's fork and join costs microseconds on an idle machine and a scheduler time
// slice on a busy one, more than such a problem's work (a short MHA call, one decode step of a
// small model).
constexpr double kMinFlopsToThread = 1 << 23;

}  // namespace qkv::detail
