// Decode's score order, per SIMD target: s = sum_d qs[d] k[d] as a vector of partial dot
// products along d (lane c sums d = c, c + L, ...), added across lanes, then a scalar tail. The
// decode kernel computes its scores this way (keys read in place, rows of contiguous Dk), and the
// flash backward recomputes a decode forward's scores the same way, so that its recomputed
// weights come from the forward's scores, bit for bit: a score near 137 summed in another order
// differs by an ulp, 1.5e-5, and every weight of its row with it.
//
// Included inside a Highway foreach_target pass (the -inl.h convention).
#if defined(QKV_ATTENTION_DOT_SCORES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_DOT_SCORES_INL_H_
#undef QKV_ATTENTION_DOT_SCORES_INL_H_
#else
#define QKV_ATTENTION_DOT_SCORES_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <type_traits>

#include "simd/kv_load-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace dot_scores {
namespace hn = hwy::HWY_NAMESPACE;

// The register tile: kRows x kKeys accumulators plus kKeys K vectors and the Q vectors.
// AVX-512 has 32 vector registers: 4 x 4 = 16 accumulators + 4 K + 4 Q loads = 24. The
// 16-register targets halve the rows: 8 + 4 + 2 = 14.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3  // every AVX-512 target, later ones included
constexpr size_t kRows = 4;
#else
constexpr size_t kRows = 2;
#endif
constexpr size_t kKeys = 4;

// s[r * s_row + x * s_key] = sum_d qs[r * q_stride + d] keys[x][d] for Rows rows and kKeys keys.
// Vectors over the first `full` dims (dk rounded down to whole vectors), then a scalar tail up to
// dk: K rows are read in place and must not be read past their end. qs (already scaled) starts
// each row on a vector boundary.
template <size_t Rows, class T>
HWY_INLINE void ScoreTile(size_t dk, size_t full, const float* HWY_RESTRICT qs, size_t q_stride,
                          const T* const* keys, float* HWY_RESTRICT s, size_t s_row, size_t s_key) {
  using DF = hn::ScalableTag<float>;
  using VF = hn::Vec<DF>;
  const DF df;
  const size_t lanes = hn::Lanes(df);
  VF acc[Rows][kKeys];
  HWY_UNROLL(16)
  for (size_t r = 0; r < Rows; ++r) {
    HWY_UNROLL(16)
    for (size_t x = 0; x < kKeys; ++x) acc[r][x] = hn::Zero(df);
  }
  for (size_t d = 0; d < full; d += lanes) {
    VF key_vec[kKeys];
    HWY_UNROLL(16)
    for (size_t x = 0; x < kKeys; ++x) key_vec[x] = kv::LoadWide(df, keys[x] + d);
    HWY_UNROLL(16)
    for (size_t r = 0; r < Rows; ++r) {
      const VF q_vec = hn::Load(df, qs + r * q_stride + d);
      HWY_UNROLL(16)
      for (size_t x = 0; x < kKeys; ++x) acc[r][x] = hn::MulAdd(q_vec, key_vec[x], acc[r][x]);
    }
  }
  HWY_UNROLL(16)
  for (size_t r = 0; r < Rows; ++r) {
    HWY_UNROLL(16)
    for (size_t x = 0; x < kKeys; ++x) {
      float dot = hn::GetLane(hn::SumOfLanes(df, acc[r][x]));
      for (size_t d = full; d < dk; ++d) dot += qs[r * q_stride + d] * kv::ToFloat(keys[x][d]);
      s[r * s_row + x * s_key] = dot;
    }
  }
}

// Calls body(std::integral_constant<size_t, n>()) for a run-time 1 <= n <= Max, so the
// remainder of a register tile gets its own fully unrolled instance.
template <size_t Max, class Body>
HWY_INLINE void WithConstant(size_t n, const Body& body) {
  if constexpr (Max >= 1) {
    if (n == Max) return body(std::integral_constant<size_t, Max>());
    WithConstant<Max - 1>(n, body);
  }
}

// ScoreTile over `rows` rows (any count), for the kKeys keys of `keys`.
template <class T>
HWY_INLINE void ScoreRows(size_t rows, size_t dk, size_t full, const float* HWY_RESTRICT qs, size_t q_stride,
                          const T* const* keys, float* HWY_RESTRICT s, size_t s_row, size_t s_key) {
  for (size_t r = 0; r < rows; r += kRows)
    WithConstant<kRows>(std::min(kRows, rows - r), [&](auto tile_rows) {
      ScoreTile<decltype(tile_rows)::value>(dk, full, qs + r * q_stride, q_stride, keys, s + r * s_row, s_row, s_key);
    });
}

}  // namespace dot_scores
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
