// Step "score function" (ScoreMod): the problem's score function (qkv::ScoreFunction,
// qkv/flex.hpp: a text function such as `s - 0.1 * abs(q - k)` or a C++ callable, one interface)
// over one key line of a tile, once per line, and in the backward its derivative d f / d s joined
// to softcap's slope. It runs after softcap and ALiBi and before the mask, the reference's order
// (TileLogits in logits-inl.h calls it per key line).
//
// Also here, TextScoreLine: how a text function (mask/mod_expression.hpp, parsed into a program
// of whole-line operations) evaluates a line with SIMD, its derivative alongside (forward-mode
// dual numbers, as ModExpression::evaluate, the scalar definition); attention/score_text.cpp
// puts it behind the interface. The program runs one operation at a time over the whole line (a
// switch per operation and line, not per element): operation i writes line i of the scratch.
//
// Included inside a Highway foreach_target pass (the -inl.h convention), through pipeline-inl.h or
// on its own.

// Per-target include guard (Highway's pattern: toggles once per target).
#if defined(QKV_ATTENTION_STEPS_SCORE_MOD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_STEPS_SCORE_MOD_INL_H_
#undef QKV_ATTENTION_STEPS_SCORE_MOD_INL_H_
#else
#define QKV_ATTENTION_STEPS_SCORE_MOD_INL_H_
#endif

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "attention/problem.hpp"
#include "attention/steps/lines-inl.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "mask/mod_expression.hpp"
#include "qkv/flex.hpp"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace pipeline {
namespace hn = hwy::HWY_NAMESPACE;

namespace score_mod {
using Op = ModExpression::Op;
using Index = ModExpression::Index;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// out[x] = f(a[x], b[x], c[x]) over n floats (whole vectors).
template <class F>
HWY_INLINE void Map(size_t n, const float* HWY_RESTRICT a, const float* HWY_RESTRICT b, const float* HWY_RESTRICT c,
                    float* HWY_RESTRICT out, const F& f) {
  const DF df;
  for (size_t x = 0; x < n; x += hn::Lanes(df))
    hn::StoreU(f(hn::LoadU(df, a + x), hn::LoadU(df, b + x), hn::LoadU(df, c + x)), df, out + x);
}

HWY_INLINE void Fill(float* HWY_RESTRICT out, size_t n, float value) {
  const DF df;
  for (size_t x = 0; x < n; x += hn::Lanes(df)) hn::StoreU(hn::Set(df, value), df, out + x);
}

// Positions first + x * step as floats (exact below 2^24).
HWY_INLINE void Positions(int64_t first, int64_t step, size_t n, float* HWY_RESTRICT out) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const VF offsets = hn::Mul(hn::Iota(df, 0.0f), hn::Set(df, static_cast<float>(step)));
  for (size_t x = 0; x < n; x += lanes)
    hn::StoreU(hn::Add(hn::Set(df, static_cast<float>(first + static_cast<int64_t>(x) * step)), offsets), df, out + x);
}

// An input read at the line's queries, keys, head or batch; elements past `count` (no such query
// or key: the input may end there) are 0 and never read.
HWY_INLINE void ReadInput(const ModInput& input, Index index, const Line& line, size_t n, size_t count,
                          float* HWY_RESTRICT out) {
  const float* HWY_RESTRICT row = input.data + line.b * input.batch_stride;
  if (index == Index::Head || index == Index::Batch) return Fill(out, n, row[index == Index::Head ? line.h : line.b]);
  const bool query = index == Index::Query;
  const int64_t first = query ? line.i0 : line.j0, step = query ? line.query_step : line.key_step;
  if (step == 0 && count > 0) return Fill(out, n, row[first]);  // flash's key lines: one key
  const DF df;
  size_t x = 0;
  if (step == 1)
    for (; x + hn::Lanes(df) <= count; x += hn::Lanes(df)) hn::StoreU(hn::LoadU(df, row + first + x), df, out + x);
  for (; x < count; ++x) out[x] = row[first + static_cast<int64_t>(x) * step];
  for (; x < n; ++x) out[x] = 0;
}

// Operation `op` on lines a, b, c into out (ModExpression's apply(), on vectors).
HWY_INLINE void Operate(Op op, size_t n, const float* a, const float* b, const float* c, float* HWY_RESTRICT out) {
  const DF df;
  const VF zero = hn::Zero(df), one = hn::Set(df, 1.0f);
  const auto flag = [&](auto is) { return hn::IfThenElseZero(is, one); };
  switch (op) {
    case Op::Neg: return Map(n, a, a, a, out, [](VF x, VF, VF) { return hn::Neg(x); });
    case Op::Not: return Map(n, a, a, a, out, [&](VF x, VF, VF) { return flag(hn::Eq(x, zero)); });
    case Op::Abs: return Map(n, a, a, a, out, [](VF x, VF, VF) { return hn::Abs(x); });
    case Op::Exp:  // Highway's Exp holds to 88.7 (e^x overflows past it)
      return Map(n, a, a, a, out, [&](VF x, VF, VF) {
        return hn::IfThenElse(hn::Gt(x, hn::Set(df, 88.72f)), hn::Set(df, kInf), hn::Exp(df, x));
      });
    case Op::Log:  // Highway's Log holds on (0, FLT_MAX]: log 0 = -inf, log of a negative is NaN
      return Map(n, a, a, a, out, [&](VF x, VF, VF) {
        const VF positive = hn::IfThenElse(hn::Gt(x, zero), x, one);
        VF y = hn::IfThenElse(hn::Eq(x, zero), hn::Set(df, kMinusInf), hn::Log(df, positive));
        y = hn::IfThenElse(hn::Eq(x, hn::Set(df, kInf)), x, y);
        return hn::IfThenElse(hn::Or(hn::Lt(x, zero), hn::IsNaN(x)), hn::Set(df, kNaN), y);
      });
    case Op::Sqrt: return Map(n, a, a, a, out, [](VF x, VF, VF) { return hn::Sqrt(x); });
    case Op::Tanh: return Map(n, a, a, a, out, [&](VF x, VF, VF) { return hn::Tanh(df, x); });
    case Op::Floor: return Map(n, a, a, a, out, [](VF x, VF, VF) { return hn::Floor(x); });
    case Op::Add: return Map(n, a, b, b, out, [](VF x, VF y, VF) { return hn::Add(x, y); });
    case Op::Sub: return Map(n, a, b, b, out, [](VF x, VF y, VF) { return hn::Sub(x, y); });
    case Op::Mul: return Map(n, a, b, b, out, [](VF x, VF y, VF) { return hn::Mul(x, y); });
    case Op::Div: return Map(n, a, b, b, out, [](VF x, VF y, VF) { return hn::Div(x, y); });
    case Op::Min: return Map(n, a, b, b, out, [](VF x, VF y, VF) { return hn::Min(x, y); });
    case Op::Max: return Map(n, a, b, b, out, [](VF x, VF y, VF) { return hn::Max(x, y); });
    case Op::Eq: return Map(n, a, b, b, out, [&](VF x, VF y, VF) { return flag(hn::Eq(x, y)); });
    case Op::Ne: return Map(n, a, b, b, out, [&](VF x, VF y, VF) { return flag(hn::Ne(x, y)); });
    case Op::Lt: return Map(n, a, b, b, out, [&](VF x, VF y, VF) { return flag(hn::Lt(x, y)); });
    case Op::Le: return Map(n, a, b, b, out, [&](VF x, VF y, VF) { return flag(hn::Le(x, y)); });
    case Op::Gt: return Map(n, a, b, b, out, [&](VF x, VF y, VF) { return flag(hn::Gt(x, y)); });
    case Op::Ge: return Map(n, a, b, b, out, [&](VF x, VF y, VF) { return flag(hn::Ge(x, y)); });
    case Op::And:
      return Map(n, a, b, b, out, [&](VF x, VF y, VF) { return flag(hn::And(hn::Ne(x, zero), hn::Ne(y, zero))); });
    case Op::Or:
      return Map(n, a, b, b, out, [&](VF x, VF y, VF) { return flag(hn::Or(hn::Ne(x, zero), hn::Ne(y, zero))); });
    case Op::Where:
      return Map(n, a, b, c, out, [&](VF x, VF y, VF z) { return hn::IfThenElse(hn::Ne(x, zero), y, z); });
    default: return Fill(out, n, 0.0f);  // the leaves are not operations (ScoreMod reads them)
  }
}

// d op / ds into out from the operands' values (a, b) and derivatives (da, db, dc) and op's
// value v (ModExpression's derive(), on vectors).
HWY_INLINE void Derive(Op op, size_t n, const float* v, const float* a, const float* b, const float* da,
                       const float* db, const float* dc, float* HWY_RESTRICT out) {
  const DF df;
  const VF zero = hn::Zero(df), one = hn::Set(df, 1.0f);
  const size_t lanes = hn::Lanes(df);
  for (size_t x = 0; x < n; x += lanes) {
    const VF va = hn::LoadU(df, a + x), vb = hn::LoadU(df, b + x), dva = hn::LoadU(df, da + x);
    const VF dvb = hn::LoadU(df, db + x), dvc = hn::LoadU(df, dc + x), value = hn::LoadU(df, v + x);
    VF d = zero;  // constants, positions, inputs, floor, comparisons and logic: flat in s
    switch (op) {
      case Op::Neg: d = hn::Neg(dva); break;
      case Op::Abs:
        d = hn::IfThenElse(hn::Gt(va, zero), dva, hn::IfThenElseZero(hn::Lt(va, zero), hn::Neg(dva)));
        break;
      case Op::Exp: d = hn::Mul(value, dva); break;
      case Op::Log: d = hn::Div(dva, va); break;
      case Op::Sqrt: d = hn::Div(dva, hn::Add(value, value)); break;
      case Op::Tanh: d = hn::Mul(hn::NegMulAdd(value, value, one), dva); break;
      case Op::Add: d = hn::Add(dva, dvb); break;
      case Op::Sub: d = hn::Sub(dva, dvb); break;
      case Op::Mul: d = hn::MulAdd(dva, vb, hn::Mul(va, dvb)); break;
      case Op::Div: d = hn::Div(hn::MulSub(dva, vb, hn::Mul(va, dvb)), hn::Mul(vb, vb)); break;
      case Op::Min: d = hn::IfThenElse(hn::Le(va, vb), dva, dvb); break;
      case Op::Max: d = hn::IfThenElse(hn::Ge(va, vb), dva, dvb); break;
      case Op::Where: d = hn::IfThenElse(hn::Ne(va, zero), dvb, dvc); break;
      default: break;
    }
    hn::StoreU(d, df, out + x);
  }
}
}  // namespace score_mod

// A text score function's line (ScoreFunction::line for TextScoreFunction, attention/score_text.cpp):
// s[x] <- f(s[x], ...) over n floats (whole vectors), `count` of them real (lanes past them keep
// their score; their slope is undefined); with `slope`, slope[x] = df/ds. `scratch`:
// e.scratch_floats(n) floats. Unaligned lines are fine (the reference's rows).
HWY_INLINE void TextScoreLine(const ModExpression& e, const ModInput* inputs, const ScoreLine& at, size_t n,
                              size_t count, float* HWY_RESTRICT s, float* HWY_RESTRICT slope,
                              float* HWY_RESTRICT scratch) {
  using score_mod::Op;
  const Line line{at.b, at.h, at.i0, at.j0, at.query_step, at.key_step};
  const std::vector<ModExpression::Instruction>& program = e.program();
  const size_t size = program.size();
  const auto value = [&](uint32_t i) { return scratch + static_cast<size_t>(i) * n; };
  const auto derivative = [&](uint32_t i) { return scratch + (size + i) * n; };
  for (uint32_t i = 0; i < size; ++i) {
    const ModExpression::Instruction& in = program[i];
    float* HWY_RESTRICT v = value(i);
    switch (in.op) {
      case Op::Constant: score_mod::Fill(v, n, in.constant); break;
      case Op::Score: score_mod::Map(n, s, s, s, v, [](VF x, VF, VF) { return x; }); break;
      case Op::Query: score_mod::Positions(line.i0, line.query_step, n, v); break;
      case Op::Key: score_mod::Positions(line.j0, line.key_step, n, v); break;
      case Op::Batch: score_mod::Fill(v, n, static_cast<float>(line.b)); break;
      case Op::Head: score_mod::Fill(v, n, static_cast<float>(line.h)); break;
      case Op::Input: score_mod::ReadInput(inputs[in.input], in.index, line, n, count, v); break;
      default: score_mod::Operate(in.op, n, value(in.a), value(in.b), value(in.c), v);
    }
    if (slope == nullptr) continue;
    if (in.op == Op::Score || !in.has_derivative) {
      score_mod::Fill(derivative(i), n, in.op == Op::Score ? 1.0f : 0.0f);
    } else {
      score_mod::Derive(in.op, n, v, value(in.a), value(in.b), derivative(in.a), derivative(in.b), derivative(in.c),
                        derivative(i));
    }
  }
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const float* HWY_RESTRICT result = value(static_cast<uint32_t>(size - 1));
  for (size_t x = 0; x < n; x += lanes) {
    const auto real = hn::FirstN(df, count > x ? count - x : 0);
    hn::StoreU(hn::IfThenElse(real, hn::LoadU(df, result + x), hn::LoadU(df, s + x)), df, s + x);
  }
  if (slope) score_mod::Map(n, derivative(static_cast<uint32_t>(size - 1)), s, s, slope, [](VF d, VF, VF) { return d; });
}

// ---- Step "score function": s[x] <- f(s[x], b, h, query(x), key(x)) over a line's n floats
// (whole vectors), `count` of them real (the lanes past them have no query or key: they keep
// their score, and their slope), through the problem's ScoreFunction (qkv/flex.hpp: a text
// function or a C++ callable, one call per line). With `slope` (the backward), f's derivative
// joins it: slope[x] *= df/ds when softcap ran before (it wrote its own slope there), else
// slope[x] = df/ds: the backward's dS_raw = dS * df/ds * dsoftcap/ds, as the reference.
// `scratch`: ScoreModFloats(p, n) floats. No-op without a score function.
HWY_INLINE void ScoreMod(const AttentionProblem& p, const Line& line, float* HWY_RESTRICT s, size_t n, size_t count,
                         float* HWY_RESTRICT slope, float* HWY_RESTRICT scratch) {
  if (!p.score_mod) return;
  float* HWY_RESTRICT d = scratch;  // df/ds, then the function's own scratch
  p.score_mod->line({line.b, line.h, line.i0, line.j0, line.query_step, line.key_step}, n, count, s,
                    slope ? d : nullptr, scratch + n);
  if (slope == nullptr) return;
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const bool after_softcap = p.softcap > 0;
  for (size_t x = 0; x < n; x += lanes) {
    const auto real = hn::FirstN(df, count > x ? count - x : 0);
    const VF before = after_softcap ? hn::Load(df, slope + x) : hn::Set(df, 1.0f);
    hn::Store(hn::IfThenElse(real, hn::Mul(before, hn::LoadU(df, d + x)), before), df, slope + x);
  }
}

// The forward's ScoreMod over a tile of `lines` key lines (line l's key first.j0 + l *
// line_key_step, its n floats at s + l * n, `count` of them real): one call of the score
// function for the tile (ScoreFunction::tile). No-op without a score function.
HWY_INLINE void ScoreModTile(const AttentionProblem& p, const Line& first, int64_t line_key_step, size_t lines,
                             float* HWY_RESTRICT s, size_t n, size_t count, float* HWY_RESTRICT scratch) {
  if (!p.score_mod) return;
  p.score_mod->tile({first.b, first.h, first.i0, first.j0, first.query_step, first.key_step}, line_key_step, lines, n,
                    count, s, scratch + n);
}

}  // namespace pipeline
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
