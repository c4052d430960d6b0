// Step "dropout": the counter-based hash every kernel shares (dropout_keeps, problem.hpp) applied
// to a line of weights, or in the backward to a line of dP.
//
// Included inside a Highway foreach_target pass (the -inl.h convention), through pipeline-inl.h or
// on its own.

// Per-target include guard (Highway's pattern: toggles once per target).
#if defined(QKV_ATTENTION_STEPS_DROPOUT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_STEPS_DROPOUT_INL_H_
#undef QKV_ATTENTION_STEPS_DROPOUT_INL_H_
#else
#define QKV_ATTENTION_STEPS_DROPOUT_INL_H_
#endif

#include <cstddef>

#include "attention/problem.hpp"
#include "attention/steps/lines-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace pipeline {
namespace hn = hwy::HWY_NAMESPACE;

// ---- Step "dropout": a kept weight is scaled by 1 / (1 - p), a dropped one is 0, over the
// `count` real elements of a line. Also the backward's dP = keep ? dP' / (1 - p) : 0.
HWY_INLINE void Dropout(const AttentionProblem& p, const Line& line, float* HWY_RESTRICT s, size_t count) {
  const float survivor_scale = 1.0f / (1.0f - p.dropout_p);
  for (size_t x = 0; x < count; ++x)
    s[x] = dropout_keeps(p, line.b, line.h, line.query(x), line.key(x)) ? s[x] * survivor_scale : 0.0f;
}

}  // namespace pipeline
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
