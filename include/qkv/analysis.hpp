// qkv::analysis: the numbers a course uses to watch and to size attention, each with its
// formula. Pure functions: no kernel runs here.
#pragma once

#include <cstdint>

#include "qkv/tensor.hpp"

namespace qkv::analysis {

// ---- Watching attention

// The entropy of each row of attention weights, in nats: H(i) = -sum_j w_ij ln w_ij, 0 ln 0 = 0.
// 0 when a row puts all its weight on one key; ln(k) when it spreads evenly over k keys.
// weights (..., Nq, Nk) -> (..., Nq). A row of zeros (a query that saw no key) has entropy 0.
Tensor row_entropy(const Tensor& weights);

// The mean row entropy of each head, the course's collapse monitor: a head whose entropy falls
// towards 0 attends to a single token, one near ln(Nk) attends to everything alike.
// weights (B, H, Nq, Nk) -> (B, H), or (H, Nq, Nk) -> (H).
Tensor head_entropy(const Tensor& weights);

// ---- Sizing attention

// The sizes of one attention call, as scaled_dot_product_attention takes them.
struct Workload {
  int64_t batch = 1, q_heads = 1, kv_heads = 1;
  int64_t q_len = 1, kv_len = 1;
  int64_t head_dim = 64, value_dim = 64;
  bool causal = false;
};

// Forward FLOPs, counting a multiply-add as 2: Q K^T is 2 Nq Nk Dk and P V is 2 Nq Nk Dv per
// (batch, query head), so B Hq Nq Nk (2 Dk + 2 Dv), i.e. 4 B Hq Nq Nk d when Dk = Dv = d;
// half of it under a causal mask (the convention of qkv bench and bench/compare_torch.py; exactly,
// a causal square mask keeps N (N + 1) / 2 of the N^2 pairs).
double forward_flops(const Workload& w);

// Bytes a fused (flash or decode) kernel must move at least, float32: q, k, v read once, the
// output and the log-sum-exp written once:
//   4 (B Hq Nq (Dk + Dv + 1) + B Hkv Nk (Dk + Dv)).
double fused_bytes(const Workload& w);
// A kernel that materialises the Nq x Nk scores also writes and reads them back once more:
//   fused_bytes + 2 x 4 B Hq Nq Nk.
double materialised_bytes(const Workload& w);

// Per token and layer, attention's sequence-dependent work is 4 N d FLOPs (Q K^T and P V over
// N keys, d = the model's width summed over heads; 2 N d under a causal mask, where a token sees
// N / 2 keys on average); the feed-forward block, d -> m d -> d, costs 4 m d^2. Attention costs
// more once N > m d (2 m d causal): for GPT-2 small (d = 768, m = 4), beyond 3072 tokens.
int64_t attention_ffn_crossover(int64_t model_width, int64_t ffn_multiplier = 4, bool causal = false);

// The memory of the attention matrices of a whole transformer, exact counts.
struct AttentionMemoryModel {
  int64_t seq = 0, layers = 0, heads = 0, batch = 0, head_dim = 0, dtype_bytes = 4;
};
struct AttentionMemory {
  int64_t matrix_elements = 0;     // seq^2: one head's weights for one sequence
  int64_t matrix_bytes = 0;
  int64_t layer_elements = 0;      // batch * heads * seq^2: every head of one layer
  int64_t layer_bytes = 0;
  int64_t model_elements = 0;      // layers * layer_elements: every layer's matrices kept at once
  int64_t model_bytes = 0;
  int64_t course_model_bytes = 0;  // layers * matrix_bytes: a per-model figure that counts ONE head
  // The flash path keeps per layer the output (batch * heads * seq * head_dim) and the
  // log-sum-exp (batch * heads * seq), never a seq x seq matrix.
  int64_t flash_layer_elements = 0;
  int64_t flash_layer_bytes = 0;
  int64_t flash_model_bytes = 0;
};
// Throws qkv::Error when a size is not positive or a count overflows int64.
AttentionMemory attention_memory(const AttentionMemoryModel& model);

}  // namespace qkv::analysis
