// Linear attention's problem as its kernels receive it, one worker's scratch, and the kernels'
// entry points. linear_attention.cpp checks the arguments and builds the Problem; the kernels
// (query_pass.cpp: the forward and the backward's query pass; key_pass.cpp: the backward's key
// pass) trust it. The algorithm is described in query_pass.cpp and derived in docs/linear.md.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "attention/kernels.hpp"
#include "attention/problem.hpp"
#include "qkv/linear_attention.hpp"

namespace qkv::detail {
namespace linear {

// Queries (and keys) per chunk: the intra block is C x C, so C trades the intra work per query
// (C (Dk + Dv)) against the per-chunk overheads; a multiple of every target's lane count.
constexpr size_t kChunk = 64;

// The checked, normalised problem (built from scaled_dot_product_attention's AttentionProblem,
// whose checks and operand views it reuses) plus what the backward reads and writes.
struct Problem {
  int64_t batch, q_heads, kv_heads, q_len, kv_len, head_dim, value_dim;
  Rows<const float> q, k, v;
  FeatureMap feature_map;
  bool causal;
  int64_t offset;
  float eps;
  Rows<float> output;             // forward: (B, Hq, Nq, Dv)
  Rows<const float> grad_output;  // backward: (B, Hq, Nq, Dv)
  Rows<float> grad_q, grad_k, grad_v;
  float* g_ext;                   // backward: (B, Hq, Nq, Dv + 1), [dO_i / den_i, -dO_i.out_i / den_i]

  int64_t kv_head_of(int64_t h) const { return h / (q_heads / kv_heads); }
  // n(i): query i sees keys [0, n(i)).
  int64_t visible_keys(int64_t i) const {
    if (!causal) return kv_len;
    return std::clamp<int64_t>(i + offset + 1, 0, kv_len);
  }
  // The first query that sees key j (q_len when none does).
  int64_t first_query(int64_t j) const {
    if (!causal) return 0;
    return std::clamp<int64_t>(j - offset, 0, q_len);
  }
};

// One worker's scratch, in floats, every part on its own cache line. C = kChunk.
struct ScratchLayout {
  size_t state, z, qf, kft, kf, scores, out, den, row, vt, st, dqf, dv_rows, total;
  ScratchLayout(size_t dk, size_t dv) {
    size_t at = 0;
    auto take = [&](size_t floats) {
      const size_t start = at;
      at += round_to_cache_line(floats);
      return start;
    };
    state = take(dk * (dv + 1));     // S (Dk, Dv); backward keys: T' (Dv + 1, Dk)
    z = take(dk);                    // z (Dk)
    qf = take(kChunk * dk);          // phi(Q chunk) (C, Dk)
    kft = take(dk * kChunk);         // phi(K chunk)^T (Dk, C); backward keys: phi(Q)^T
    kf = take(kChunk * dk);          // backward: phi(K chunk) (C, Dk)
    scores = take(kChunk * kChunk);  // A (C, C), then the backward's dA
    out = take(kChunk * std::max(dv, dk));  // O (C, Dv); backward keys: dphi(K) (C, Dk)
    den = take(kChunk);              // den (C); backward: c (C)
    row = take(std::max(dk, dv));    // one row of phi
    vt = take((dv + 1) * kChunk);    // backward: V^T (Dv, C); keys: G'^T (Dv + 1, C)
    st = take(dv * dk);              // backward: S^T (Dv, Dk); keys: T (Dk, Dv)
    dqf = take(kChunk * dk);         // backward: dphi(Q) (C, Dk)
    dv_rows = take(kChunk * dv);     // backward keys: dV (C, Dv)
    total = at;
  }
};

// The kernels, per work item, on the SIMD target the CPU runs; `scratch` is one worker's block
// of ScratchLayout(head_dim, value_dim).total floats.
// Forward of query head h of batch b: writes p.output (query_pass.cpp).
void forward_head(const Problem& p, int64_t b, int64_t h, float* scratch);
// The backward's query pass of head h: writes p.g_ext and p.grad_q (query_pass.cpp).
void query_grads_head(const Problem& p, int64_t b, int64_t h, float* scratch);
// The backward's key pass of kv head g, after every head's query pass: writes p.grad_k and
// p.grad_v (key_pass.cpp).
void key_grads_group(const Problem& p, int64_t b, int64_t g, float* scratch);

}  // namespace linear
}  // namespace qkv::detail
