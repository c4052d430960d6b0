// Steps "bias gradient" (the flash backward's, once per pair of tiles, before the softmax
// gradient overwrites P): dS = P (dP - D), exactly 0 where P = 0, of the pair's pairs added into
// dbias (attention/bias_gradient.hpp). The tile holds key lines over query lanes; dbias is read
// through its view, so a key-major accumulator (flash/key_major_bias.hpp: queries contiguous)
// takes whole vectors per line, and any other layout (a bias broadcast over queries, a residue's
// strides) the same sums lane by lane. PrefetchBiasTile fetches the pair's bias and dbias first.
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
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace pipeline {
namespace hn = hwy::HWY_NAMESPACE;

// weights_t holds P and grad_t dP (after dropout) as key lines: line l (key j0 + l walk.key_step)
// of br lanes, lane x query i0 + x walk.query_step, `rows` lanes real; row_dot the lanes' D.
HWY_INLINE void AddBiasGradientTile(const BiasGradView& g, const Walk& walk, int64_t b, int64_t h, int64_t i0,
                                    size_t rows, int64_t j0, size_t cols, size_t br,
                                    const float* HWY_RESTRICT weights_t, const float* HWY_RESTRICT grad_t,
                                    const float* HWY_RESTRICT row_dot) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const int64_t lane_step = walk.query_step * g.stride_q;
  for (size_t l = 0; l < cols; ++l) {
    float* line = g.row(b, h, i0) + (j0 + static_cast<int64_t>(l) * walk.key_step) * g.stride_k;
    const float* weights = weights_t + l * br;
    const float* grads = grad_t + l * br;
    size_t x = 0;
    if (lane_step == 1)
      for (; x + lanes <= rows; x += lanes) {
        const VF p = hn::Load(df, weights + x);
        const VF ds = hn::Mul(p, hn::Sub(hn::Load(df, grads + x), hn::Load(df, row_dot + x)));
        hn::StoreU(hn::Add(hn::LoadU(df, line + x), hn::IfThenZeroElse(hn::Eq(p, hn::Zero(df)), ds)), df, line + x);
      }
    for (; x < rows; ++x) {
      const float p = weights[x];
      line[static_cast<int64_t>(x) * lane_step] += p == 0.0f ? 0.0f : p * (grads[x] - row_dot[x]);
    }
  }
}

// Prefetches (into L2) what the pair reads of a key-major tensor: for each of its key lines the
// run of its queries' floats, when they are contiguous (stride_q 1). The bias and its gradient
// are streamed from memory once per wave, and a line's run (Br floats) starts a few cache lines
// a whole row (Nq floats) after the last line's, which the hardware prefetchers did not follow:
// the mask step and AddBiasGradientTile then waited on each (measured: docs/flex.md). Issued
// before the pair's products, the lines arrive while they run.
HWY_INLINE void PrefetchKeyMajorTile(const float* data, int64_t stride_b, int64_t stride_h, int64_t stride_q,
                                     int64_t stride_k, const Walk& walk, int64_t b, int64_t h, int64_t i0,
                                     size_t rows, int64_t j0, size_t cols, bool write) {
  if (walk.query_step * stride_q != 1) return;
  // The pair's key lines as rows of `rows` floats, walk.key_step keys apart.
  const Rows<const float> lines{data + b * stride_b + h * stride_h + i0 + j0 * stride_k, 0, 0,
                                walk.key_step * stride_k};
  PrefetchRows(lines, 0, 0, 0, 1, static_cast<int64_t>(cols), static_cast<int64_t>(rows), write);
}

// The pair's part of the bias (the one additive term) and of dbias, prefetched (see above).
HWY_INLINE void PrefetchBiasTile(const AttentionBackwardProblem& bp, const Walk& walk, int64_t b, int64_t h,
                                 int64_t i0, size_t rows, int64_t j0, size_t cols) {
  for (const MaskTermView& m : bp.forward.terms)
    if (m.additive)
      PrefetchKeyMajorTile(m.data, m.stride_b, m.stride_h, m.stride_q, m.stride_k, walk, b, h, i0, rows, j0, cols,
                           false);
  const BiasGradView& g = bp.grad_bias;
  PrefetchKeyMajorTile(g.data, g.stride_b, g.stride_h, g.stride_q, g.stride_k, walk, b, h, i0, rows, j0, cols, true);
}

}  // namespace pipeline
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
