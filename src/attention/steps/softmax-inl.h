// Step "softmax": the start of a row (sinks), the exponential every fused kernel's softmax
// uses (ExpSoftmax), the online update with queries in the lanes (flash: SoftmaxColumnsUpdate,
// RescaleColumns, FinishColumns) and with keys in the lanes (decode: SoftmaxRowUpdate), and the
// backward's (RecomputeWeights, SoftmaxGradient).
//
// Included inside a Highway foreach_target pass (the -inl.h convention), through pipeline-inl.h or
// on its own.

// Per-target include guard (Highway's pattern: toggles once per target).
#if defined(QKV_ATTENTION_STEPS_SOFTMAX_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_STEPS_SOFTMAX_INL_H_
#undef QKV_ATTENTION_STEPS_SOFTMAX_INL_H_
#else
#define QKV_ATTENTION_STEPS_SOFTMAX_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "attention/problem.hpp"
#include "attention/steps/lines-inl.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace pipeline {
namespace hn = hwy::HWY_NAMESPACE;

// ---- Step "softmax", the start of a row: the sink, if any, is a key with no value seen first:
// running max = sink, sum = exp(sink - sink) = 1; without one, max -inf and sum 0.
HWY_INLINE float InitialMax(const AttentionProblem& p, int64_t h) { return p.sink(h); }
HWY_INLINE float InitialSum(const AttentionProblem& p) { return p.sinks ? 1.0f : 0.0f; }

// ---- Step "softmax"'s exponential: e^x for x <= 88 (softmax passes s - max <= 0), within 1 ulp
// (0.85 at worst over [-87.3, 0], against a double exp, with FMA; 1.14 on targets without, which
// round each product apart: tests/attention/test_steps.cpp), in 12 vector ops on AVX-512 and 14
// elsewhere, where Highway's general Exp takes about 25 (the difference shows in a forward
// tile's time: docs/performance-log.md).
// x = n ln2 + r with n = round(x / ln2) and |r| <= ln2 / 2 (Cody-Waite: ln2 in two parts, so r is
// exact); e^r = 1 + r + r^2 q(r), q of degree 4 fitted for the least worst relative error over
// that interval (4e-9; degree-7 Taylor, one FMA more, had 1.4e-9; degree 3's 1e-7 would cost up
// to an ulp), which keeps e^0 exactly 1. 2^n is applied by AVX-512's scalef, or elsewhere put in
// the exponent bits: the rounding adds 1.5 * 2^23 + 127, which leaves n + 127 in the low mantissa
// bits, ready to shift into the exponent. Below ln(FLT_MIN) (-87.34: 2^n would not be a normal
// float) the result is 0, -inf included; NaN stays NaN.
template <class D, class V>
HWY_INLINE V ExpSoftmax(D d, V x) {
  const V shifted = hn::MulAdd(x, hn::Set(d, 1.44269504088896341f), hn::Set(d, 12582912.0f + 127.0f));
  const V n = hn::Sub(shifted, hn::Set(d, 12582912.0f + 127.0f));
  V r = hn::MulAdd(n, hn::Set(d, -0.693145751953125f), x);
  r = hn::MulAdd(n, hn::Set(d, -1.428606765330187045e-6f), r);
  V e = hn::Set(d, 1.381461275741458e-3f);
  e = hn::MulAdd(e, r, hn::Set(d, 8.368710055947304e-3f));
  e = hn::MulAdd(e, r, hn::Set(d, 4.166838899254799e-2f));
  e = hn::MulAdd(e, r, hn::Set(d, 1.666652113199234e-1f));
  e = hn::MulAdd(e, r, hn::Set(d, 4.999999403953552e-1f));
  e = hn::MulAdd(e, r, hn::Set(d, 1.0f));
  e = hn::MulAdd(e, r, hn::Set(d, 1.0f));
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3  // every AVX-512 target, later ones included
  if constexpr (hn::MaxLanes(D()) == 16) {
    // One compare (not less than the bound: true for NaN, which passes) and one zero-masked
    // scalef, where the exponent bits take a shift, a multiply, a compare and a blend.
    const __mmask16 normal = _mm512_cmp_ps_mask(x.raw, hn::Set(d, -87.33654f).raw, _CMP_NLT_UQ);
    return V{_mm512_maskz_scalef_ps(normal, e.raw, n.raw)};
  }
#endif
  const hn::RebindToSigned<D> di;
  const V two_to_n = hn::BitCast(d, hn::ShiftLeft<23>(hn::BitCast(di, shifted)));
  return hn::IfThenZeroElse(hn::Lt(x, hn::Set(d, -87.33654f)), hn::Mul(e, two_to_n));
}

// ---- Step "softmax", queries in the lanes (flash): one tile of Bc key lines of V vectors of
// queries (br = V lanes). For each query: the new running max over the tile, the factor
// exp(old - new) that moves what was accumulated to it (into `correction`), P = exp(S - max) in
// place (hidden keys give exactly 0) and the running sum. Returns whether any query's max grew.
// A NaN score, whatever the max, has a NaN weight, which makes its query's running sum NaN for
// good; FinishColumns poisons the row from that, as the reference's softmax does. (A +inf score's
// weight, exp(inf - inf), is NaN too: output, lse and row_sum NaN in both kernels, row_max NaN
// here and +inf in the reference.) Noting NaN in the max pass instead would take two of its
// three vector ops per vector, on the ports the exponentials need. Both passes go key line by
// key line over all V vectors, so each step has V independent chains (the max's: 2 V, even and
// odd lines): one vector at a time, the exponentials of a 64-key tile waited on the max pass and
// on each other's latency.
//
// SoftmaxColumnsUpdateWith takes what a kernel adds to the update in the same passes (the
// summaries' entropy, summary/steps-inl.h), `extra`, called per query vector n (lanes n * Lanes):
// Moved(n, old_max, new_max, factor) once the tile's max is known, Weight(n, d, weight) for each
// weight = e^d (d = score - max, -inf for a hidden key), Summed(n, tile_sum) at the end.
struct NoSoftmaxExtra {
  HWY_INLINE void Moved(size_t, VF, VF, VF) {}
  HWY_INLINE void Weight(size_t, VF, VF) {}
  HWY_INLINE void Summed(size_t, VF) {}
};

template <size_t V, class Extra>
HWY_INLINE bool SoftmaxColumnsUpdateWith(float* HWY_RESTRICT scores, size_t cols, float* HWY_RESTRICT running_max,
                                         float* HWY_RESTRICT row_sum, float* HWY_RESTRICT correction, Extra& extra) {
  const DF df;
  const size_t lanes = hn::Lanes(df), br = V * lanes;
  const VF minus_inf = hn::Set(df, kMinusInf);
  VF tile_max[V], odd_max[V];
  HWY_UNROLL(4)
  for (size_t n = 0; n < V; ++n) tile_max[n] = odd_max[n] = minus_inf;
  size_t j = 0;
  for (; j + 2 <= cols; j += 2) {
    HWY_UNROLL(4)
    for (size_t n = 0; n < V; ++n) {
      tile_max[n] = hn::Max(tile_max[n], hn::Load(df, scores + j * br + n * lanes));
      odd_max[n] = hn::Max(odd_max[n], hn::Load(df, scores + (j + 1) * br + n * lanes));
    }
  }
  if (j < cols) {
    HWY_UNROLL(4)
    for (size_t n = 0; n < V; ++n) tile_max[n] = hn::Max(tile_max[n], hn::Load(df, scores + j * br + n * lanes));
  }
  bool max_grew = false;
  VF safe_max[V], tile_sum[V];
  HWY_UNROLL(4)
  for (size_t n = 0; n < V; ++n) {
    const size_t at = n * lanes;
    // A query that has seen no visible key yet keeps -inf and is exponentiated against 0
    // instead, so its scores (all -inf) give exp = 0, never the NaN of exp(-inf - -inf).
    const VF old_max = hn::Load(df, running_max + at);
    const VF new_max = hn::Max(old_max, hn::Max(tile_max[n], odd_max[n]));
    safe_max[n] = hn::IfThenZeroElse(hn::Eq(new_max, minus_inf), new_max);
    const VF factor = ExpSoftmax(df, hn::Sub(old_max, safe_max[n]));  // 1 when the max did not grow
    max_grew = max_grew || !hn::AllTrue(df, hn::Eq(old_max, new_max));
    hn::Store(new_max, df, running_max + at);
    hn::Store(factor, df, correction + at);
    extra.Moved(n, old_max, new_max, factor);
    tile_sum[n] = hn::Zero(df);
  }
  for (j = 0; j < cols; ++j) {
    HWY_UNROLL(4)
    for (size_t n = 0; n < V; ++n) {
      float* s = scores + j * br + n * lanes;
      const VF exponent = hn::Sub(hn::Load(df, s), safe_max[n]);
      const VF weight = ExpSoftmax(df, exponent);
      hn::Store(weight, df, s);
      tile_sum[n] = hn::Add(tile_sum[n], weight);
      extra.Weight(n, exponent, weight);
    }
  }
  HWY_UNROLL(4)
  for (size_t n = 0; n < V; ++n) {
    const size_t at = n * lanes;
    hn::Store(hn::MulAdd(hn::Load(df, row_sum + at), hn::Load(df, correction + at), tile_sum[n]), df, row_sum + at);
    extra.Summed(n, tile_sum[n]);
  }
  return max_grew;
}

template <size_t V>
HWY_INLINE bool SoftmaxColumnsUpdate(float* HWY_RESTRICT scores, size_t cols, float* HWY_RESTRICT running_max,
                                     float* HWY_RESTRICT row_sum, float* HWY_RESTRICT correction) {
  NoSoftmaxExtra none;
  return SoftmaxColumnsUpdateWith<V>(scores, cols, running_max, row_sum, correction, none);
}

// Ot (d, br) moves to the new max: each query's column times its correction factor.
HWY_INLINE void RescaleColumns(float* HWY_RESTRICT out_t, size_t d, size_t br, const float* HWY_RESTRICT correction) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  for (size_t c = 0; c < d; ++c)
    for (size_t n = 0; n < br; n += lanes) {
      float* o = out_t + c * br + n;
      hn::Store(hn::Mul(hn::Load(df, o), hn::Load(df, correction + n)), df, o);
    }
}

// ---- Step "finish", queries in the lanes (flash): finish_row's values for br queries at once,
// with a vector log where finish_row takes a scalar one per row: 1 / l into `inverse`, lse = max
// + log l into `lse`, and the row stats left in running_max and row_sum for the backward. A
// query that saw nothing (l = 0) gets 0 and lse -inf; one that saw a NaN score (its sum is NaN)
// NaN everywhere.
HWY_INLINE void FinishColumns(float* HWY_RESTRICT running_max, float* HWY_RESTRICT row_sum, size_t br,
                              float* HWY_RESTRICT inverse, float* HWY_RESTRICT lse) {
  const DF df;
  const VF one = hn::Set(df, 1.0f), nan = hn::Set(df, std::numeric_limits<float>::quiet_NaN());
  for (size_t n = 0; n < br; n += hn::Lanes(df)) {
    const VF sum = hn::Load(df, row_sum + n), max = hn::Load(df, running_max + n);
    const auto empty = hn::Eq(sum, hn::Zero(df));
    const VF safe_sum = hn::IfThenElse(empty, one, sum);
    const VF log_sum_exp = hn::Add(max, hn::Log(df, safe_sum));
    const auto poisoned = hn::IsNaN(sum);
    hn::Store(hn::IfThenElse(poisoned, nan, hn::IfThenZeroElse(empty, hn::Div(one, safe_sum))), df, inverse + n);
    hn::Store(hn::IfThenElse(poisoned, nan, hn::IfThenElse(empty, hn::Set(df, kMinusInf), log_sum_exp)), df, lse + n);
    hn::Store(hn::IfThenElse(poisoned, nan, max), df, running_max + n);
    hn::Store(hn::IfThenElse(poisoned, nan, sum), df, row_sum + n);
  }
}

// ---- Step "softmax", keys in the lanes (decode): one query's line of n scores (whole vectors).
// The same update as SoftmaxColumnsUpdate for one row, with the same exponential (ExpSoftmax,
// so decode's and flash's weights agree); a NaN score makes the running max NaN,
// which poisons the row's sum and output. Returns the factor exp(old - new) to rescale O by.
HWY_INLINE float SoftmaxRowUpdate(float* HWY_RESTRICT s, size_t n, float& running_max, float& row_sum) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  VF max_vec = hn::Set(df, kMinusInf);
  auto nan_mask = hn::IsNaN(max_vec);
  for (size_t x = 0; x < n; x += lanes) {
    const VF score = hn::Load(df, s + x);
    max_vec = hn::Max(max_vec, score);
    nan_mask = hn::Or(nan_mask, hn::IsNaN(score));
  }
  const float old_max = running_max;
  const float new_max = hn::AllFalse(df, nan_mask) ? std::max(old_max, hn::GetLane(hn::MaxOfLanes(df, max_vec)))
                                                   : std::numeric_limits<float>::quiet_NaN();
  const float safe_max = new_max == kMinusInf ? 0.0f : new_max;
  const float factor = hn::GetLane(ExpSoftmax(df, hn::Set(df, old_max - safe_max)));  // the tile's exp
  running_max = new_max;
  const VF max_broadcast = hn::Set(df, safe_max);
  VF sum_vec = hn::Zero(df);
  for (size_t x = 0; x < n; x += lanes) {
    const VF weight = ExpSoftmax(df, hn::Sub(hn::Load(df, s + x), max_broadcast));
    hn::Store(weight, df, s + x);
    sum_vec = hn::Add(sum_vec, weight);
  }
  row_sum = row_sum * factor + hn::GetLane(hn::SumOfLanes(df, sum_vec));
  return factor;
}


// ---- Backward step "softmax": P = exp(S - shift) * scale per query in the lanes, over a tile of
// `cols` key lines of br queries (problem.hpp: shift +inf and scale 0 give P = 0). A NaN exponent
// gives P = 0, as Highway's Exp does: a padding lane's score is NaN when a hidden key's K is
// (0 x NaN), and the backward sums P over the lanes (dV), so that NaN would reach real keys.
HWY_INLINE void RecomputeWeights(float* HWY_RESTRICT scores, size_t cols, size_t br, const float* HWY_RESTRICT shift,
                                 const float* HWY_RESTRICT scale) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  for (size_t j = 0; j < cols; ++j)
    for (size_t n = 0; n < br; n += lanes) {
      float* s = scores + j * br + n;
      const VF exponent = hn::Sub(hn::Load(df, s), hn::Load(df, shift + n));
      const VF weight = hn::IfThenZeroElse(hn::IsNaN(exponent), ExpSoftmax(df, exponent));
      hn::Store(hn::Mul(weight, hn::Load(df, scale + n)), df, s);
    }
}

// ---- Backward step "softmax": dS = P * (dP - D) in place of dP, exactly 0 where P = 0 (a hidden
// key, whose V may be NaN), then through softcap's slope when given (ALiBi and additive terms
// pass dS through unchanged).
HWY_INLINE void SoftmaxGradient(const float* HWY_RESTRICT weights, float* HWY_RESTRICT grad, size_t cols, size_t br,
                                const float* HWY_RESTRICT row_dot, const float* HWY_RESTRICT softcap_slope) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const VF zero = hn::Zero(df);
  for (size_t j = 0; j < cols; ++j)
    for (size_t n = 0; n < br; n += lanes) {
      const size_t at = j * br + n;
      const VF weight = hn::Load(df, weights + at);
      VF grad_score = hn::Mul(weight, hn::Sub(hn::Load(df, grad + at), hn::Load(df, row_dot + n)));
      if (softcap_slope) grad_score = hn::Mul(grad_score, hn::Load(df, softcap_slope + at));
      hn::Store(hn::IfThenZeroElse(hn::Eq(weight, zero), grad_score), df, grad + at);
    }
}

}  // namespace pipeline
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
