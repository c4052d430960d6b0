// Step "mask", the symbolic rule (mask/rule.hpp) along a line: which elements node `node` of a
// MaskRule lets through (RuleLine), -inf where the rule hides a key (MaskRuleStep), and the
// complement a strided residue needs (MaskWhereRuleShows).
//
// Included inside a Highway foreach_target pass (the -inl.h convention), through pipeline-inl.h or
// on its own.

// Per-target include guard (Highway's pattern: toggles once per target).
#if defined(QKV_ATTENTION_STEPS_MASK_RULE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_STEPS_MASK_RULE_INL_H_
#undef QKV_ATTENTION_STEPS_MASK_RULE_INL_H_
#else
#define QKV_ATTENTION_STEPS_MASK_RULE_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "attention/problem.hpp"
#include "attention/steps/lines-inl.h"
#include "hwy/highway.h"
#include "mask/rule.hpp"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace pipeline {
namespace hn = hwy::HWY_NAMESPACE;

// ---- Step "mask", the symbolic rule (mask/rule.hpp): visible[x] = 1 where node `node` lets
// element x of the line through, else 0, over n floats (whole vectors, at most kRuleLine). Band,
// key lengths, global and strided rules run in SIMD from the line's coordinates (RuleLeafLine);
// block layouts and keep tensors are read for the `count` real elements only (the rest get 0).
constexpr size_t kRuleLine = 256;

// A leaf computed from the line's coordinates (r.kind Band, KeyLengths, Global or Strided).
HWY_INLINE void RuleLeafLine(const RuleNode& r, const Line& line, size_t n, float* HWY_RESTRICT visible) {
  using Kind = Mask::Rule::Kind;
  const DF df;
  const DI di;
  const size_t lanes = hn::Lanes(df);
  const auto iota = hn::Iota(di, 0);
  const VF one = hn::Set(df, 1.0f);
  auto store = [&](size_t x, auto mask) HWY_ATTR { hn::Store(hn::IfThenElseZero(hn::RebindMask(df, mask), one), df, visible + x); };
  // Along a line, i - j moves by query_step - key_step per element, j by key_step, i by query_step.
  const int32_t diff_step = static_cast<int32_t>(line.query_step - line.key_step);
  auto lane_values = [&](int64_t base, int32_t step) HWY_ATTR { return hn::Add(hn::Set(di, ClampEdge(base)), hn::Mul(iota, hn::Set(di, step))); };
  switch (r.kind) {
    case Kind::Band:
      for (size_t x = 0; x < n; x += lanes) {
        const auto d = lane_values(line.key(x) - line.query(x), -diff_step);  // j - i
        store(x, hn::And(hn::Not(hn::Lt(d, hn::Set(di, ClampEdge(r.lo)))), hn::Not(hn::Gt(d, hn::Set(di, ClampEdge(r.hi))))));
      }
      return;
    case Kind::KeyLengths: {
      const auto length = hn::Set(di, ClampEdge(r.lengths[static_cast<size_t>(line.b)]));
      for (size_t x = 0; x < n; x += lanes)
        store(x, hn::Lt(lane_values(line.key(x), static_cast<int32_t>(line.key_step)), length));
      return;
    }
    case Kind::Global: {
      const auto global = hn::Set(di, ClampEdge(r.count));
      for (size_t x = 0; x < n; x += lanes)
        store(x, hn::Or(hn::Lt(lane_values(line.key(x), static_cast<int32_t>(line.key_step)), global),
                        hn::Lt(lane_values(line.query(x), static_cast<int32_t>(line.query_step)), global)));
      return;
    }
    case Kind::Strided:
      if (r.stride >= 2 * static_cast<int64_t>(lanes) * std::max<int64_t>(std::abs(diff_step), 1)) {
        // e = (offset + i - j) mod stride moved into (-stride/2, stride/2]: within a vector it
        // moves by less than stride/2 (lanes |diff_step| <= stride / 2), so a lane is visible
        // exactly when it reaches 0. Lines of larger steps (the strided residues) go scalar.
        for (size_t x = 0; x < n; x += lanes) {
          int64_t e = floor_mod(r.offset + line.query(x) - line.key(x), r.stride);
          if (e > r.stride / 2) e -= r.stride;
          store(x, hn::Eq(lane_values(e, diff_step), hn::Zero(di)));
        }
        return;
      }
      for (size_t x = 0; x < n; ++x)
        visible[x] = floor_mod(r.offset + line.query(x) - line.key(x), r.stride) == 0 ? 1.0f : 0.0f;
      return;
    case Kind::BlockSparse:  // read from tables, evaluated, and the combinations: RuleLine
    case Kind::Keep:
    case Kind::Expression:
    case Kind::And:
    case Kind::Or:
      return;
  }
}

// Any node: combinations recurse, leaves from coordinates are RuleLeafLine, tables are read.
inline void RuleLine(const MaskRule& rule, int node, const Line& line, size_t n, size_t count,
                     float* HWY_RESTRICT visible) {
  using Kind = Mask::Rule::Kind;
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const RuleNode& r = rule.nodes[static_cast<size_t>(node)];
  switch (r.kind) {
    case Kind::And:
    case Kind::Or: {
      alignas(64) float right[kRuleLine];
      RuleLine(rule, r.left, line, n, count, visible);
      RuleLine(rule, r.right, line, n, count, right);
      for (size_t x = 0; x < n; x += lanes) {
        const VF a = hn::Load(df, visible + x), c = hn::Load(df, right + x);
        hn::Store(r.kind == Kind::And ? hn::Min(a, c) : hn::Max(a, c), df, visible + x);
      }
      return;
    }
    case Kind::Band:
    case Kind::KeyLengths:
    case Kind::Global:
    case Kind::Strided:
      RuleLeafLine(r, line, n, visible);
      return;
    case Kind::Expression: {  // the mask function's program over the real elements
      const size_t real = std::min(count, n);
      rule.function_line(node, {line.b, line.h, line.i0, line.j0, line.query_step, line.key_step}, real, visible);
      std::fill(visible + real, visible + n, 0.0f);
      return;
    }
    case Kind::BlockSparse:
    case Kind::Keep:
      for (size_t x = 0; x < n; ++x)
        visible[x] = x < count && rule.visible(line.b, line.h, line.query(x), line.key(x), node) ? 1.0f : 0.0f;
      return;
  }
}

// -inf where the rule hides the key, over n floats (whole vectors), `count` of them real.
HWY_INLINE void MaskRuleStep(const AttentionProblem& p, const Line& line, float* HWY_RESTRICT s, size_t n,
                             size_t count) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const VF minus_inf = hn::Set(df, kMinusInf), zero = hn::Zero(df);
  alignas(64) float visible[kRuleLine];
  for (size_t x0 = 0; x0 < n; x0 += kRuleLine) {
    const size_t m = std::min(kRuleLine, n - x0);
    const int64_t at = static_cast<int64_t>(x0);
    const Line part{line.b, line.h, line.i0 + at * line.query_step, line.j0 + at * line.key_step, line.query_step,
                    line.key_step};
    RuleLine(p.rule, p.rule.root(), part, m, count > x0 ? count - x0 : 0, visible);
    for (size_t x = 0; x < m; x += lanes) {
      const VF shown = hn::Load(df, visible + x);
      hn::Store(hn::IfThenElse(hn::Eq(shown, zero), minus_inf, hn::Load(df, s + x0 + x)), df, s + x0 + x);
    }
  }
}

// The complement: -inf where node `node` of the rule shows the key, over the `count` real
// elements of a line (at most kRuleLine). A kernel that visits some pairs apart (the strided
// residues) hides there what its tiles already visit.
HWY_INLINE void MaskWhereRuleShows(const MaskRule& rule, int node, const Line& line, float* HWY_RESTRICT s,
                                   size_t count) {
  const size_t lanes = hn::Lanes(DF());
  alignas(64) float visible[kRuleLine];
  RuleLine(rule, node, line, (count + lanes - 1) / lanes * lanes, count, visible);
  for (size_t x = 0; x < count; ++x)
    if (visible[x] != 0.0f) s[x] = kMinusInf;
}

}  // namespace pipeline
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
