// Head roles: each score is a mean over rows of the head's weights (head_roles.hpp).
#include "qkv/models/head_roles.hpp"

#include <cmath>
#include <string>

#include "core/random.hpp"
#include "qkv/error.hpp"

namespace qkv::models {
namespace {

// Layer weights (1, H, N, N) or (H, N, N), packed, with their sizes.
struct HeadWeights {
  Tensor packed;
  int64_t heads = 0, rows = 0, cols = 0;
  float at(int64_t h, int64_t i, int64_t j) const { return packed.data()[(h * rows + i) * cols + j]; }
};

HeadWeights head_weights(const Tensor& weights, const char* which, size_t layer) {
  const bool ok = weights.defined() && (weights.dim() == 3 || (weights.dim() == 4 && weights.size(0) == 1)) &&
                  weights.size(-1) == weights.size(-2);
  if (!ok)
    throw Error("score_heads: " + std::string(which) + " attention of layer " + std::to_string(layer) + " is " +
                (weights.defined() ? weights.shape().str() : std::string("undefined")) +
                ", expected (1, H, N, N) or (H, N, N)");
  return {weights.contiguous(), weights.size(-3), weights.size(-2), weights.size(-1)};
}

// Mean over rows i in [1, N) of f(i).
template <class F>
double mean_over_rows(int64_t rows, F f) {
  double sum = 0;
  for (int64_t i = 1; i < rows; ++i) sum += f(i);
  return rows > 1 ? sum / static_cast<double>(rows - 1) : 0.0;
}

double normalized_entropy(const HeadWeights& w, int64_t h, int64_t i, bool causal) {
  const int64_t visible = causal ? i + 1 : w.cols;
  if (visible < 2) return 1.0;
  double entropy = 0;
  for (int64_t j = 0; j < w.cols; ++j) {
    const double p = w.at(h, i, j);
    if (p > 0) entropy -= p * std::log(p);
  }
  return entropy / std::log(static_cast<double>(visible));
}

HeadRole strongest_role(const HeadRoleScores& s) {
  const double scores[] = {0, s.previous_token, s.first_token, s.self, s.induction, s.broad};
  HeadRole best = HeadRole::None;
  double best_ratio = 1;
  for (int r = 1; r <= 5; ++r) {
    const double ratio = scores[r] / kRoleThresholds[r];
    if (ratio >= best_ratio) best = static_cast<HeadRole>(r), best_ratio = ratio;
  }
  return best;
}

}  // namespace

std::string_view to_string(HeadRole role) {
  switch (role) {
    case HeadRole::None: return "-";
    case HeadRole::PreviousToken: return "previous-token";
    case HeadRole::FirstToken: return "first-token";
    case HeadRole::Self: return "self";
    case HeadRole::Induction: return "induction";
    case HeadRole::Broad: return "broad";
  }
  return "?";
}

std::vector<HeadRoleScores> score_heads(const std::vector<Tensor>& text_attention,
                                        const std::vector<Tensor>& repeat_attention, int64_t repeat_start,
                                        int64_t repeat_length, bool causal) {
  if (text_attention.size() != repeat_attention.size())
    throw Error("score_heads: " + std::to_string(text_attention.size()) + " layers of text attention but " +
                std::to_string(repeat_attention.size()) + " of repeat attention");
  std::vector<HeadRoleScores> scores;
  for (size_t l = 0; l < text_attention.size(); ++l) {
    const HeadWeights text = head_weights(text_attention[l], "text", l);
    const HeadWeights repeat = head_weights(repeat_attention[l], "repeat", l);
    const int64_t second = repeat_start + repeat_length;
    if (repeat.heads != text.heads || repeat_start < 0 || repeat_length < 2 || second + repeat_length > repeat.rows)
      throw Error("score_heads: layer " + std::to_string(l) + ": the repeated sequence (start " +
                  std::to_string(repeat_start) + ", length " + std::to_string(repeat_length) + ") does not fit " +
                  std::to_string(repeat.rows) + " positions of " + std::to_string(repeat.heads) + " heads");
    for (int64_t h = 0; h < text.heads; ++h) {
      HeadRoleScores s;
      s.layer = static_cast<int64_t>(l);
      s.head = h;
      s.previous_token = mean_over_rows(text.rows, [&](int64_t i) { return text.at(h, i, i - 1); });
      s.first_token = mean_over_rows(text.rows, [&](int64_t i) { return text.at(h, i, 0); });
      s.self = mean_over_rows(text.rows, [&](int64_t i) { return text.at(h, i, i); });
      s.broad = mean_over_rows(text.rows, [&](int64_t i) { return normalized_entropy(text, h, i, causal); });
      double induction = 0;
      for (int64_t t = 0; t + 1 < repeat_length; ++t)
        induction += repeat.at(h, second + t, repeat_start + t + 1);
      s.induction = induction / static_cast<double>(repeat_length - 1);
      s.role = strongest_role(s);
      scores.push_back(s);
    }
  }
  return scores;
}

RepeatedAttention repeated_attention(const Model& model, const std::vector<int64_t>& prefix_ids,
                                     const std::vector<int64_t>& candidate_ids, const HeadRolesOptions& options) {
  if (candidate_ids.empty()) throw Error("head roles: no tokens to draw the repeated sequence from");
  if (options.repeat_length < 2)
    throw Error("head roles: repeat_length is " + std::to_string(options.repeat_length) + "; give at least 2");
  // T random tokens, then the same T again.
  RepeatedAttention r;
  r.ids = prefix_ids;
  detail::SplitMix64 random(options.seed);
  std::vector<int64_t> once;
  for (int64_t t = 0; t < options.repeat_length; ++t)
    once.push_back(candidate_ids[random.next() % candidate_ids.size()]);
  r.ids.insert(r.ids.end(), once.begin(), once.end());
  r.ids.insert(r.ids.end(), once.begin(), once.end());
  r.attention = model.forward(r.ids, /*need_attention=*/true).attention;
  r.start = static_cast<int64_t>(prefix_ids.size());
  r.length = options.repeat_length;
  return r;
}

std::vector<HeadRoleScores> measure_head_roles(const Model& model, const std::vector<int64_t>& text_ids,
                                               const std::vector<int64_t>& prefix_ids,
                                               const std::vector<int64_t>& candidate_ids,
                                               const HeadRolesOptions& options) {
  if (text_ids.size() < 2)
    throw Error("head roles: the text has " + std::to_string(text_ids.size()) + " tokens; give at least 2");
  const RepeatedAttention repeat = repeated_attention(model, prefix_ids, candidate_ids, options);
  const ModelOutput text = model.forward(text_ids, /*need_attention=*/true);
  return score_heads(text.attention, repeat.attention, repeat.start, repeat.length, model.config().is_causal());
}

}  // namespace qkv::models
