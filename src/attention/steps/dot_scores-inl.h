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

#include "gemm/register_tile-inl.h"
#include "simd/kv_load-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace dot_scores {
namespace hn = hwy::HWY_NAMESPACE;

// The register tile (gemm/register_tile-inl.h's four-wide tile): kRows x kKeys accumulators plus
// kKeys K vectors and a Q vector.
constexpr size_t kRows = tile_gemm::kFourWideRows;
constexpr size_t kKeys = tile_gemm::kFourWideColumns;

// How a score tile reads its kKeys K rows.
//   Side by side: a vector of each row in turn, depth outer, every K vector shared by the tile's
//     rows (the tile for K in cache, and for several rows).
//   Key after key: each K row's dims in order, one key at a time, its own accumulator chain per
//     key (the kKeys chains independent), a Q vector loaded per K vector. For K streamed from DRAM
//     by a single query row: side by side strides a K row's length back and forth, which the
//     hardware's stream prefetcher does not follow, where this reads contiguous K rows as one
//     ascending stream (docs/performance-log.md, "decode/: K read key after key").
enum class KeyOrder { SideBySide, KeyAfterKey };

// s[r * s_row + x * s_key] = sum_d qs[r * q_stride + d] keys[x][d] for Rows rows and kKeys keys.
// Vectors over the first `full` dims (dk rounded down to whole vectors), then a scalar tail up to
// dk: K rows are read in place and must not be read past their end. Each dot sums its dims in the
// same order whatever the KeyOrder.
template <size_t Rows, KeyOrder Order, class T>
HWY_INLINE void ScoreTile(size_t dk, size_t full, const float* HWY_RESTRICT qs, size_t q_stride,
                          const T* const* keys, float* HWY_RESTRICT s, size_t s_row, size_t s_key) {
  const hn::ScalableTag<float> df;
  const size_t lanes = hn::Lanes(df);
  tile_gemm::VF acc[Rows][kKeys];
  tile_gemm::ZeroTile(acc);
  if constexpr (Order == KeyOrder::SideBySide) {
    for (size_t d = 0; d < full; d += lanes) {
      tile_gemm::VF key_vec[kKeys];
      tile_gemm::LoadGathered(keys, d, key_vec);
      tile_gemm::DotStep(qs + d, q_stride, key_vec, acc);
    }
  } else {
    HWY_UNROLL(16)
    for (size_t x = 0; x < kKeys; ++x)
      for (size_t d = 0; d < full; d += lanes) {
        const tile_gemm::VF key_vec = kv::LoadWide(df, keys[x] + d);
        HWY_UNROLL(16)
        for (size_t r = 0; r < Rows; ++r)
          acc[r][x] = hn::MulAdd(hn::LoadU(df, qs + r * q_stride + d), key_vec, acc[r][x]);
      }
  }
  tile_gemm::ReduceDots(acc, [&](size_t r, size_t x, float dot) {
    for (size_t d = full; d < dk; ++d) dot += qs[r * q_stride + d] * kv::ToFloat(keys[x][d]);
    s[r * s_row + x * s_key] = dot;
  });
}

// ScoreTile over `rows` rows (any count), for the kKeys keys of `keys`.
template <KeyOrder Order = KeyOrder::SideBySide, class T>
HWY_INLINE void ScoreRows(size_t rows, size_t dk, size_t full, const float* HWY_RESTRICT qs, size_t q_stride,
                          const T* const* keys, float* HWY_RESTRICT s, size_t s_row, size_t s_key) {
  for (size_t r = 0; r < rows; r += kRows)
    tile_gemm::WithConstant<kRows>(std::min(kRows, rows - r), [&](auto tile_rows) {
      ScoreTile<decltype(tile_rows)::value, Order>(dk, full, qs + r * q_stride, q_stride, keys, s + r * s_row, s_row,
                                                   s_key);
    });
}

}  // namespace dot_scores
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
