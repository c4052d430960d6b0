// The attention kernels behind qkv::scaled_dot_product_attention. Each takes a checked,
// normalised AttentionProblem (problem.hpp) and writes output, lse and (if asked) weights.
#pragma once

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

// Below about 100 us of one core's arithmetic, a kernel runs on the calling thread alone: a
// parallel region's fork and join costs microseconds on an idle machine and a scheduler time
// slice on a busy one, more than such a problem's work (a short MHA call, one decode step of a
// small model).
constexpr double kMinFlopsToThread = 1 << 23;

}  // namespace qkv::detail
