// Steps "bias gradient" (the flash backward's, once per pair of tiles): dS = P (dP - D), exactly
// 0 where P = 0, of the pair's pairs added into dbias, either computed here (before the softmax
// gradient multiplies dS by a modifier's slope) or taken from the softmax gradient's output when
// there is no slope (attention/bias_gradient.hpp). The tile holds key lines over query lanes; dbias is read
// by its rows where it has them (AddTileRows, by register transposes), any other layout (a bias
// broadcast over queries, a residue's strides) lane by lane. PrefetchBiasTile fetches the next
// pair's terms and dbias.
//
// Included inside a Highway foreach_target pass (the -inl.h convention).

// Per-target include guard (Highway's pattern: toggles once per target).
#if defined(QKV_ATTENTION_STEPS_BIAS_GRADIENT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_STEPS_BIAS_GRADIENT_INL_H_
#undef QKV_ATTENTION_STEPS_BIAS_GRADIENT_INL_H_
#else
#define QKV_ATTENTION_STEPS_BIAS_GRADIENT_INL_H_
#endif

#include <cstddef>
#include <cstdint>

#include "attention/bias_gradient.hpp"
#include "attention/problem.hpp"
#include "attention/steps/lines-inl.h"
#include "attention/steps/operands-inl.h"
#include "attention/steps/tile_mask-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace pipeline {
namespace hn = hwy::HWY_NAMESPACE;

// Adds the tile's dS into dbias: line l (key j0 + l walk.key_step) of br lanes, lane x query
// i0 + x walk.query_step, `rows` lanes real; ds(at, x) gives the vector of dS at float `at` of
// the tile (lanes x ..), read whole (br is whole vectors). Lanes that are not a whole vector of
// contiguous elements (a bias broadcast over queries: lane_step 0; a residue's strides) are added
// one by one from the vector stored, never from a scalar product: the compiler fuses a scalar
// `line += p * (dP - D)` into one FMA, which rounds differently from the vector lanes and from
// SoftmaxGradient's dS.
template <class VectorDs>
HWY_INLINE void AddTileLines(const BiasGradView& g, const Walk& walk, int64_t b, int64_t h, int64_t i0, size_t rows,
                             int64_t j0, size_t cols, size_t br, const VectorDs& ds) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const int64_t lane_step = walk.query_step * g.stride_q;
  HWY_ALIGN float part[HWY_MAX_BYTES / sizeof(float)];
  for (size_t l = 0; l < cols; ++l) {
    float* line = g.row(b, h, i0) + (j0 + static_cast<int64_t>(l) * walk.key_step) * g.stride_k;
    size_t x = 0;
    if (lane_step == 1)
      for (; x + lanes <= rows; x += lanes) hn::StoreU(hn::Add(hn::LoadU(df, line + x), ds(l * br + x, x)), df, line + x);
    for (; x < rows; x += lanes) {
      hn::Store(ds(l * br + x, x), df, part);
      for (size_t n = 0; n < lanes && x + n < rows; ++n) line[static_cast<int64_t>(x + n) * lane_step] += part[n];
    }
  }
}

// Whether dbias takes a tile's dS by its rows (AddTileRows): dbias laid out by query rows (the
// caller's packed tensor, keys contiguous, not broadcast over queries), a tile of consecutive
// queries and keys.
HWY_INLINE bool BiasByRows(const BiasGradView& g, const Walk& walk) {
  return g.stride_k == 1 && g.stride_q != 0 && walk.key_step == 1 && walk.query_step == 1 && !walk.residue;
}

// dS^T (cols key lines of br) added into dbias's `rows` rows from i0, keys j0 .., by register
// transposes (UnpackTransposed's add: each element + its dS, one rounding, as AddTileLines'):
// added by key lines in place, each line's lanes lie Nk floats apart and missed L1 on each.
HWY_INLINE void AddTileRows(const BiasGradView& g, int64_t b, int64_t h, int64_t i0, size_t rows, int64_t j0,
                            size_t cols, size_t br, const float* HWY_RESTRICT ds_t) {
  UnpackTransposed(ds_t, br, rows, cols, nullptr, Rows<float>{g.data + j0, g.stride_b, g.stride_h, g.stride_q}, b, h,
                   i0, /*add=*/true);
}

// weights_t holds P and grad_t dP (after dropout) as key lines (as AddTileLines), row_dot the
// lanes' D: adds dS = P (dP - D), 0 where P = 0. For a pair whose scores have a slope (softcap, a
// score function), before SoftmaxGradient multiplies dS by it. `ds_t` (Bc x Br floats) holds
// dS^T on its way into a dbias taken by rows.
HWY_INLINE void AddBiasGradientTile(const BiasGradView& g, const Walk& walk, int64_t b, int64_t h, int64_t i0,
                                    size_t rows, int64_t j0, size_t cols, size_t br,
                                    const float* HWY_RESTRICT weights_t, const float* HWY_RESTRICT grad_t,
                                    const float* HWY_RESTRICT row_dot, float* HWY_RESTRICT ds_t) {
  const DF df;
  const auto ds = [&](size_t at, size_t x) {
    const VF p = hn::Load(df, weights_t + at);
    const VF ds = hn::Mul(p, hn::Sub(hn::Load(df, grad_t + at), hn::Load(df, row_dot + x)));
    return hn::IfThenZeroElse(hn::Eq(p, hn::Zero(df)), ds);
  };
  if (!BiasByRows(g, walk)) return AddTileLines(g, walk, b, h, i0, rows, j0, cols, br, ds);
  for (size_t l = 0; l < cols; ++l)
    for (size_t x = 0; x < br; x += hn::Lanes(df)) hn::Store(ds(l * br + x, x), df, ds_t + l * br + x);
  AddTileRows(g, b, h, i0, rows, j0, cols, br, ds_t);
}

// The same from dS itself (ds_t, SoftmaxGradient's output without a slope: the same bits as
// above), so that a pair without softcap or a score function computes dS once (issue 42's
// backward-with-dbias target; measured in docs/flex.md).
HWY_INLINE void AddBiasGradientFromDs(const BiasGradView& g, const Walk& walk, int64_t b, int64_t h, int64_t i0,
                                      size_t rows, int64_t j0, size_t cols, size_t br,
                                      const float* HWY_RESTRICT ds_t) {
  if (BiasByRows(g, walk)) return AddTileRows(g, b, h, i0, rows, j0, cols, br, ds_t);
  const DF df;
  AddTileLines(g, walk, b, h, i0, rows, j0, cols, br, [&](size_t at, size_t) { return hn::Load(df, ds_t + at); });
}

// The tile's part of the terms (PrefetchTermTiles) and of dbias (for writing), prefetched.
HWY_INLINE void PrefetchBiasTile(const AttentionBackwardProblem& bp, const Walk& walk, int64_t b, int64_t h,
                                 int64_t i0, size_t rows, int64_t j0, size_t cols) {
  PrefetchTermTiles(bp.forward, walk, b, h, i0, rows, j0, cols);
  const BiasGradView& g = bp.grad_bias;
  if (BiasByRows(g, walk))
    PrefetchTileRows(bp.forward, g.data, g.stride_b, g.stride_h, g.stride_q, b, h, i0, rows, j0, cols, true);
}

}  // namespace pipeline
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
