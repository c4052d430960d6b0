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

}  // namespace qkv::detail
