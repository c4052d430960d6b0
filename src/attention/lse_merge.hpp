// The log-sum-exp merge of softmax partials and the sink gradient: the arithmetic of combining
// attention over disjoint sets of keys, defined once. Decode merges its key chunks with it
// (decode/launch.cpp), ring attention its (query block, key block) results and its sinks
// (src/dist/), cascade attention its prefix and suffix results and sinks (cascade.cpp), and the
// backward kernels' and ring's sink gradients are sink_gradient_of_row.
//
// A part is one row's softmax over some of its keys, in the online-softmax state
//   max m, sum l = sum_j exp(s_j - m), out o = sum_j exp(s_j - m) v_j (Dv floats).
// A finished result (output O, lse) is the part (lse, 1, O); a sink is the part (sink, 1, zeros).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace qkv::detail {

struct SoftmaxPart {
  float max;         // m (-inf: the part saw no key; NaN: it saw a NaN score)
  float sum;         // l, in units of exp(-m)
  const float* out;  // o (Dv floats), or nullptr for zeros (a sink)
};

// The merged row: max and sum as a single online softmax over every part's keys would end with
// them (the row stats the backward recomputes weights from) and lse = max + log(sum).
struct MergedRow {
  float max, sum, lse;
};

// Merges `parts` partials of one row, part(c) -> SoftmaxPart, into out (dv floats, normalised):
//   m = max_c m_c,  w_c = exp(m_c - m),  l = sum_c l_c w_c,  out = sum_c o_c w_c / l,  lse = m + log l,
// in float64. A part with m_c = -inf weighs exactly 0 (it is skipped: its o_c is never read); a
// row no part saw gets out 0 and lse -inf; a row some part saw NaN in gets NaN everywhere, as a
// single call would. `out` may be a part's o (each element is written after every part's is read).
template <class PartOf>
MergedRow merge_softmax_parts(int64_t parts, const PartOf& part, size_t dv, float* out) {
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  float row_max = kMinusInf;
  bool nan = false;
  for (int64_t c = 0; c < parts; ++c) {
    const float m = part(c).max;
    row_max = std::max(row_max, m);
    nan = nan || std::isnan(m);
  }
  if (nan || row_max == kMinusInf) {
    const float fill = nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
    std::fill_n(out, dv, fill);
    return nan ? MergedRow{fill, fill, fill} : MergedRow{kMinusInf, 0.0f, kMinusInf};
  }
  double sum = 0;
  for (int64_t c = 0; c < parts; ++c) {
    const SoftmaxPart x = part(c);
    if (x.max != kMinusInf) sum += static_cast<double>(x.sum) * std::exp(static_cast<double>(x.max) - row_max);
  }
  // out in blocks of kBlock columns, parts inner, accumulated in float64 (a vector of the block).
  constexpr size_t kBlock = 64;
  for (size_t c0 = 0; c0 < dv; c0 += kBlock) {
    const size_t width = std::min(kBlock, dv - c0);
    double acc[kBlock] = {};
    for (int64_t c = 0; c < parts; ++c) {
      const SoftmaxPart x = part(c);
      if (x.max == kMinusInf || x.out == nullptr) continue;
      const double weight = std::exp(static_cast<double>(x.max) - row_max) / sum;
      for (size_t i = 0; i < width; ++i) acc[i] += weight * x.out[c0 + i];
    }
    for (size_t i = 0; i < width; ++i) out[c0 + i] = static_cast<float>(acc[i]);
  }
  return {row_max, static_cast<float>(sum), static_cast<float>(row_max + std::log(sum))};
}

// One row's term of a sink's gradient, -P_sink (dO . O), where the sink's weight is
// P_sink = exp(sink - shift) * scale (the row stats: shift = lse and scale = 1, or shift = max and
// scale = 1 / sum). A row that saw nothing, not even a sink (scale 0 or shift -inf), adds 0.
// dsinks[h] is the sum of these terms over the rows of head h.
inline double sink_gradient_of_row(float sink, float shift, float scale, const float* grad_out, const float* out,
                                   int64_t dv) {
  if (scale == 0.0f || shift == -std::numeric_limits<float>::infinity()) return 0.0;
  double dot = 0;  // D = dO . O
  for (int64_t c = 0; c < dv; ++c) dot += static_cast<double>(grad_out[c]) * out[c];
  return -(std::exp(static_cast<double>(sink) - shift) * scale) * dot;
}

}  // namespace qkv::detail
