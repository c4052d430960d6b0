// The score modifiers, in the order they act on s = scale * q.k: Softcap (s <- c tanh(s / c), on
// a whole tile, since it does not depend on positions), then Alibi (per line). The mask follows
// (logits-inl.h composes them).
//
// Included inside a Highway foreach_target pass (the -inl.h convention), through pipeline-inl.h or
// on its own.

// Per-target include guard (Highway's pattern: toggles once per target).
#if defined(QKV_ATTENTION_STEPS_MODIFIERS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_STEPS_MODIFIERS_INL_H_
#undef QKV_ATTENTION_STEPS_MODIFIERS_INL_H_
#else
#define QKV_ATTENTION_STEPS_MODIFIERS_INL_H_
#endif

#include <cstddef>
#include <cstdint>

#include "attention/problem.hpp"
#include "attention/steps/lines-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace pipeline {
namespace hn = hwy::HWY_NAMESPACE;

// scale * tanh(x) for softcap's hot loop: x P(x^2) / Q(x^2) on [-9, 9] (past 9, tanh is 1 to
// within 3e-8), P of degree 4 and Q of degree 4 in x^2, fitted by iterated least squares on the
// relative error (max 6e-8 in float64, 3.4e-7 absolute when evaluated in float32). Eight FMAs and
// a refined reciprocal, cheaper than an Exp-based tanh, which made softcap a large share of a
// softcapped forward (docs/performance-log.md). `scale` multiplies P's coefficients (once per
// call, not per vector). NaN stays NaN.
HWY_INLINE VF ScaledTanh(VF x, float scale) {
  const DF df;
  const VF limit = hn::Set(df, 9.0f), minus_limit = hn::Set(df, -9.0f);
#if HWY_ARCH_X86 && HWY_TARGET != HWY_EMU128 && HWY_TARGET != HWY_SCALAR
  // x86's min and max return their second operand when either is NaN: a NaN x passes the clamp
  // and the rational function, with no test of its own.
  const VF clamped = hn::Min(limit, hn::Max(minus_limit, x));
#else
  const VF clamped = hn::IfThenElse(hn::IsNaN(x), x, hn::Min(hn::Max(x, minus_limit), limit));
#endif
  const VF z = hn::Mul(clamped, clamped);
  VF numerator = hn::Set(df, 1.3663458392487726e-08f * scale);
  numerator = hn::MulAdd(numerator, z, hn::Set(df, 2.0831980707288183e-05f * scale));
  numerator = hn::MulAdd(numerator, z, hn::Set(df, 3.5091362204917125e-03f * scale));
  numerator = hn::MulAdd(numerator, z, hn::Set(df, 1.3392434315878096e-01f * scale));
  numerator = hn::MulAdd(numerator, z, hn::Set(df, 9.9999998321745998e-01f * scale));
  VF denominator = hn::Set(df, 7.902955801997180e-07f);
  denominator = hn::MulAdd(denominator, z, hn::Set(df, 3.307789092288514e-04f));
  denominator = hn::MulAdd(denominator, z, hn::Set(df, 2.592852808456218e-02f));
  denominator = hn::MulAdd(denominator, z, hn::Set(df, 4.672575296450575e-01f));
  denominator = hn::MulAdd(denominator, z, hn::Set(df, 1.0f));
  VF reciprocal = hn::ApproximateReciprocal(denominator);  // Q >= 1: no overflow, no zero
  reciprocal = hn::Mul(reciprocal, hn::NegMulAdd(denominator, reciprocal, hn::Set(df, 2.0f)));  // Newton
  return hn::Mul(hn::Mul(clamped, numerator), reciprocal);
}

// ---- Step "softcap": s <- softcap * tanh(s / softcap) over n floats (a whole number of
// vectors): a whole tile at once, since softcap does not depend on positions. When
// softcap_slope is given, it receives d(capped)/d(raw) = 1 - tanh^2 per score, for the backward.
// The cap is folded into ScaledTanh's numerator for caps in [1e-30, 1e30]; past them the folded
// coefficients would overflow (x P(x^2) reaches about 418 cap at the clamp) or go subnormal, and
// 1 / cap may be infinite, so extreme caps divide, take tanh, multiply and keep |s| <= cap.
HWY_INLINE void Softcap(const AttentionProblem& p, float* HWY_RESTRICT s, size_t n,
                        float* HWY_RESTRICT softcap_slope = nullptr) {
  if (!(p.softcap > 0)) return;
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const float cap = p.softcap;  // a local: the stores to s would make p.softcap a load per vector
  const VF one = hn::Set(df, 1.0f);
  if (cap >= 1e-30f && cap <= 1e30f) {
    const VF inverse_cap = hn::Set(df, 1.0f / cap);
    for (size_t x = 0; x < n; x += lanes) {
      const VF capped = ScaledTanh(hn::Mul(hn::Load(df, s + x), inverse_cap), cap);
      hn::Store(capped, df, s + x);
      if (softcap_slope) {  // the backward's logits are the forward's, bit for bit
        const VF t = hn::Mul(capped, inverse_cap);
        hn::Store(hn::NegMulAdd(t, t, one), df, softcap_slope + x);
      }
    }
    return;
  }
  const VF cap_vec = hn::Set(df, cap);
  for (size_t x = 0; x < n; x += lanes) {
    const VF t = ScaledTanh(hn::Div(hn::Load(df, s + x), cap_vec), 1.0f);
    const VF capped = hn::Mul(t, cap_vec);  // NaN stays NaN: the comparison below is false for it
    const VF kept = hn::IfThenElse(hn::Gt(hn::Abs(capped), cap_vec), hn::CopySign(cap_vec, capped), capped);
    hn::Store(kept, df, s + x);
    if (softcap_slope) hn::Store(hn::NegMulAdd(t, t, one), df, softcap_slope + x);
  }
}

// ---- Step "ALiBi": s <- s - slope(b, h) |i + Nk - Nq - j| over a line's n floats (whole vectors),
// after softcap.
HWY_INLINE void Alibi(const AttentionProblem& p, const Line& line, float* HWY_RESTRICT s, size_t n) {
  if (!p.alibi_slopes) return;
  const DF df;
  const size_t lanes = hn::Lanes(df);
  // distance(x) = |i + offset - j| = |base + x * step|, step = query_step - key_step = +-1
  const float slope = p.alibi_slope(line.b, line.h);
  const float base = static_cast<float>(line.i0 + p.alibi_offset() - line.j0);
  const float step = static_cast<float>(line.query_step - line.key_step);
  const VF steps = hn::Mul(hn::Iota(df, 0.0f), hn::Set(df, step));
  const VF slope_vec = hn::Set(df, slope);
  for (size_t x = 0; x < n; x += lanes) {
    const VF distance = hn::Abs(hn::Add(steps, hn::Set(df, base + step * static_cast<float>(x))));
    hn::Store(hn::NegMulAdd(slope_vec, distance, hn::Load(df, s + x)), df, s + x);
  }
}

}  // namespace pipeline
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
