// Where the pipeline's scores sit: the vector types every step uses, a line of scores (Line), a
// kernel's walk over queries and keys (Walk) and how a tile is masked (TileMask).
//
// Scores travel in "lines": n consecutive floats of a tile, s[x] for query i0 + x * query_step
// and key j0 + x * key_step. Flash keeps queries in the SIMD lanes, so its lines are one key over
// the queries (query_step 1, key_step 0); decode keeps keys in the lanes, so its lines are one
// query over the keys (0, 1). Every step that depends on positions (ALiBi, the band, tensor
// terms, dropout) works from those coordinates and serves both layouts.
//
// Included inside a Highway foreach_target pass (the -inl.h convention), through pipeline-inl.h or
// on its own.

// Per-target include guard (Highway's pattern: toggles once per target).
#if defined(QKV_ATTENTION_STEPS_LINES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_STEPS_LINES_INL_H_
#undef QKV_ATTENTION_STEPS_LINES_INL_H_
#else
#define QKV_ATTENTION_STEPS_LINES_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace pipeline {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DI = hn::RebindToSigned<DF>;
using VF = hn::Vec<DF>;

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
constexpr float kInf = std::numeric_limits<float>::infinity();

// Where a line of scores sits in the problem (see the header comment).
struct Line {
  int64_t b, h;                   // batch, query head
  int64_t i0, j0;                 // the query and key of s[0]
  int64_t query_step, key_step;   // (1, 0): one key over queries; (0, 1): one query over keys
  int64_t query(size_t x) const { return i0 + static_cast<int64_t>(x) * query_step; }
  int64_t key(size_t x) const { return j0 + static_cast<int64_t>(x) * key_step; }
};

// A band edge clamped into int32 (|j - i| < 2^31 for every real pair, so clamping changes nothing).
HWY_INLINE int32_t ClampEdge(int64_t edge) {
  return static_cast<int32_t>(std::clamp<int64_t>(edge, -(int64_t{1} << 31) + 1, (int64_t{1} << 31) - 1));
}

// Where a kernel's tile of queries and keys sits: query x (a lane) is i0 + x * query_step, key c
// of the key tile is j0 + c * key_step. The tiles walk steps 1; a strided residue walks steps S.
struct Walk {
  int64_t query_step = 1, key_step = 1;
  bool residue = false;
};

// How a tile is masked per element: `band` the band and key lengths (and in the tiles, the
// rule); in a residue, `hide` >= 0 the rule node whose pairs the tiles visit instead.
struct TileMask {
  bool band = false;
  int hide = -1;
};

}  // namespace pipeline
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
