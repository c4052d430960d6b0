// Attention summaries (AttentionOptions::summary_top_k): per query row the entropy of its
// weights and its k strongest keys, per query head the mass each key receives, in O(N k) memory.
// The flash summary kernel (summary/forward.cpp) computes them inside a flash forward, never
// holding more than a query tile's weights; the reference (summary/reference.cpp) computes the
// same from its materialised weights and is the oracle of the tests.
#pragma once

#include <cstdint>
#include <vector>

#include "attention/problem.hpp"
#include "qkv/attention.hpp"

namespace qkv::detail {

// Where the summaries go, all packed; rows r = (b * Hq + h) * Nq + i, heads (b * Hq + h).
struct SummaryOutputs {
  int64_t top_k = 0;            // k >= 1
  float* entropy = nullptr;     // (B, Hq, Nq): -sum_j w_ij log w_ij (natural log), 0 for an empty row
  int64_t* top_keys = nullptr;  // (B, Hq, Nq, k): keys by weight, descending, ties to the lower
                                // index; -1 past the row's keys of nonzero weight
  float* top_weights = nullptr; // (B, Hq, Nq, k): their weights, 0 where the key is -1
  float* received = nullptr;    // (B, Hq, Nk): sum_i w_ij over the head's queries
};

// The summary options' checks: summary_top_k >= 0 and at most kMaxSummaryTopK, no dropout (the
// summaries describe the softmax, dropout would make them random), backend Decode refused
// (`who` prefixes the errors). True when summaries are asked for.
constexpr int64_t kMaxSummaryTopK = 256;
bool summaries_asked(const char* who, const AttentionOptions& options);

// Prepares result's summary tensors (allocated when undefined, else checked as the other results)
// for the problem's shapes (lse_shape = L + (Nq)) and returns where the kernels write.
SummaryOutputs bind_summary_outputs(const char* who, const BuiltProblem& built, AttentionResult& result,
                                    int64_t top_k, const Tensor& q, const Tensor& k, const Tensor& v);
// Resets result's summary tensors when summaries were not asked for.
void clear_summary_outputs(AttentionResult& result);

// The flash forward with summaries: output, lse, row stats as flash_attention writes them
// (float32 products at every precision, the strided keys in the tiles), plus the summaries.
// problem.weights must be nullptr and dropout off.
void flash_summary_attention(const AttentionProblem& problem, const SummaryOutputs& out);

// The summaries from the reference's weights (B, Hq, Nq, Nk) packed: the oracle.
void summaries_from_weights(const AttentionProblem& problem, const float* weights, const SummaryOutputs& out);

// The reference forward with summaries: problem.weights when asked for, else a scratch matrix.
void reference_summary_attention(const AttentionProblem& problem, const SummaryOutputs& out);

}  // namespace qkv::detail
