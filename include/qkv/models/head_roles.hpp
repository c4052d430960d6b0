// What each attention head of a model does, measured on the model: the roles interpretability
// work names, each a score in [0, 1] computed from the head's attention weights.
//
//   previous-token  mean over rows i >= 1 of w[i][i-1]               (on the text)
//   first-token     mean over rows i >= 1 of w[i][0]: the "sink"      (on the text)
//   self            mean over rows i >= 1 of w[i][i]                  (on the text)
//   induction       on T random tokens repeated twice, r r: mean over the second copy's
//                   queries of the weight on the token after their token's first occurrence
//                   (query T + t looks at t + 1), the copying step of an induction circuit
//   broad           mean over rows i >= 1 of the row's entropy / log(its visible keys):
//                   1 for a uniform row, 0 for one key
//
// A head's role is the score furthest above its threshold (kRoleThresholds), or None.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "qkv/models/model.hpp"
#include "qkv/tensor.hpp"

namespace qkv::models {

enum class HeadRole { None, PreviousToken, FirstToken, Self, Induction, Broad };
std::string_view to_string(HeadRole role);  // "-", "previous-token", "first-token", "self", "induction", "broad"

struct HeadRoleScores {
  int64_t layer = 0, head = 0;
  double previous_token = 0, first_token = 0, self = 0, induction = 0, broad = 0;
  HeadRole role = HeadRole::None;
};

// The score a role needs to be named, in the order of HeadRole (None's is unused).
inline constexpr double kRoleThresholds[] = {0, 0.4, 0.5, 0.4, 0.3, 0.8};

// Scores of every head from attention weights already computed: text_attention[l] and
// repeat_attention[l] are layer l's weights (1, H, N, N) (or (H, N, N)) on the text and on the
// repeated sequence, whose second copy starts at `repeat_start + repeat_length` (its first at
// repeat_start: a BOS token may come first). `causal`: row i sees keys 0..i (for broad's log).
std::vector<HeadRoleScores> score_heads(const std::vector<Tensor>& text_attention,
                                        const std::vector<Tensor>& repeat_attention, int64_t repeat_start,
                                        int64_t repeat_length, bool causal);

struct HeadRolesOptions {
  int64_t repeat_length = 24;  // T, the random sequence repeated for the induction score
  uint64_t seed = 0;           // which random tokens
};

// The repeated random sequence measure_head_roles runs, prefix_ids then T random tokens of
// candidate_ids (drawn with options.seed) then the same T again, and the model's attention on
// it: the part of the roles that does not depend on the text. A caller that scores many texts on
// one model (`qkv serve`) computes it once and passes it to score_heads with each text's
// attention; the scores are then exactly measure_head_roles'. qkv::Error as measure_head_roles.
struct RepeatedAttention {
  std::vector<int64_t> ids;          // prefix, r, r
  std::vector<Tensor> attention;     // per layer (1, H, N, N)
  int64_t start = 0, length = 0;     // the first copy's start (the prefix's size) and T
};
RepeatedAttention repeated_attention(const Model& model, const std::vector<int64_t>& prefix_ids,
                                     const std::vector<int64_t>& candidate_ids, const HeadRolesOptions& options = {});

// Runs the model on `text_ids` and on a repeated random sequence of `candidate_ids` (tokens to
// draw from: not special ones), prefixed by `prefix_ids` (a BOS the model expects, or empty), and
// scores every head. qkv::Error when the text has fewer than 2 tokens or there are no candidates.
std::vector<HeadRoleScores> measure_head_roles(const Model& model, const std::vector<int64_t>& text_ids,
                                               const std::vector<int64_t>& prefix_ids,
                                               const std::vector<int64_t>& candidate_ids,
                                               const HeadRolesOptions& options = {});

}  // namespace qkv::models
