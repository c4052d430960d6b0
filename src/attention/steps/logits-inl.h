// Scores to logits: the modifiers that depend on positions and the mask, composed in the
// reference's order, on one line (ScoresToLogits: decode's) or on a tile of key lines
// (TileLogits: flash's and its backward's). Softcap runs on the whole tile before either.
//
// Included inside a Highway foreach_target pass (the -inl.h convention), through pipeline-inl.h or
// on its own.

// Per-target include guard (Highway's pattern: toggles once per target).
#if defined(QKV_ATTENTION_STEPS_LOGITS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_STEPS_LOGITS_INL_H_
#undef QKV_ATTENTION_STEPS_LOGITS_INL_H_
#else
#define QKV_ATTENTION_STEPS_LOGITS_INL_H_
#endif

#include <cstddef>
#include <cstdint>

#include "attention/problem.hpp"
#include "attention/steps/lines-inl.h"
#include "attention/steps/mask_rule-inl.h"
#include "attention/steps/modifiers-inl.h"
#include "attention/steps/score_mod-inl.h"
#include "attention/steps/tile_mask-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace pipeline {
namespace hn = hwy::HWY_NAMESPACE;

// ALiBi and mask on a whole line (softcap ran on the whole tile before): n floats computed
// (whole vectors), `count` of them real. `band` false skips the structured mask and the rule (a
// tile every query of it fully sees). `hide` >= 0 (decode's gathered strided keys, as
// TileLogits' residues): -inf where node `hide` of the rule shows the key, in place of the rule
// (the strided rule holds by construction; the tiles visit what `hide` shows).
HWY_INLINE void ScoresToLogits(const AttentionProblem& p, const Line& line, float* HWY_RESTRICT s, size_t n,
                               size_t count, bool band, int hide = -1) {
  Alibi(p, line, s, n);
  if (band) MaskBand(p, line, s, n);
  if (hide >= 0) {
    MaskWhereRuleShows(p.rule, hide, line, s, count);
  } else if (band && !p.rule.empty()) {
    MaskRuleStep(p, line, s, n, count);
  }
  MaskTerms(p, line, s, count);
}

// ALiBi, the score function and mask on a tile of key lines (flash's and its backward's; softcap
// ran on the whole tile before): line l the key j0 + l walk.key_step over br queries
// i0 + x walk.query_step, `rows` of them real, lines br floats apart. In the reference's order:
// ALiBi line by line (when the problem has slopes), the score function (when it has one, in
// `mod_scratch`, ModExpression::scratch_floats(br) floats: the whole tile in one call,
// ScoreModTile; with `slope`, the backward's tile of softcap's slopes, line by line, ScoreMod, its
// derivative joining them), the band and key lengths for
// all lines at once (MaskBandLines), then
// line by line the rule (a residue's: -inf where node `hide` of the rule shows the key, the pairs
// the tiles visit; the strided rule holds by construction), then the tensor terms (TileTerms,
// each term over every line; `term_t` its tile's floats, term_tile_floats). (ALiBi after the
// band would differ where slope x distance overflows without FMA: -inf + inf.) `mask.band` false
// skips the band and the rule (a tile every query of it fully sees).
HWY_INLINE void TileLogits(const AttentionProblem& p, const Walk& walk, const TileMask& mask, int64_t b, int64_t h,
                           int64_t i0, size_t rows, int64_t j0, size_t cols, size_t br, float* HWY_RESTRICT s,
                           float* HWY_RESTRICT mod_scratch = nullptr, float* HWY_RESTRICT slope = nullptr,
                           float* HWY_RESTRICT term_t = nullptr) {
  const auto line = [&](size_t l) {
    return Line{b, h, i0, j0 + static_cast<int64_t>(l) * walk.key_step, walk.query_step, 0};
  };
  if (p.alibi_slopes)
    for (size_t l = 0; l < cols; ++l) Alibi(p, line(l), s + l * br, br);
  if (p.score_mod && slope == nullptr) ScoreModTile(p, line(0), walk.key_step, cols, s, br, rows, mod_scratch);
  if (p.score_mod && slope != nullptr)
    for (size_t l = 0; l < cols; ++l) ScoreMod(p, line(l), s + l * br, br, rows, slope + l * br, mod_scratch);
  if (mask.band) MaskBandLines(p, b, i0, walk.query_step, j0, walk.key_step, s, br, cols);
  const bool rule = walk.residue ? mask.hide >= 0 : mask.band && !p.rule.empty();
  for (size_t l = 0; rule && l < cols; ++l) {
    if (walk.residue) {
      MaskWhereRuleShows(p.rule, mask.hide, line(l), s + l * br, rows);
    } else {
      MaskRuleStep(p, line(l), s + l * br, br, rows);
    }
  }
  if (!p.terms.empty()) TileTerms(p, walk, b, h, i0, rows, j0, cols, br, s, term_t);
}

}  // namespace pipeline
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
