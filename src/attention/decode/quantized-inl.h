// Decode's steps for quantized K/V (qkv/quantize.hpp), read in place and widened in registers
// (Highway -inl.h, included by chunk-inl.h once per SIMD target). q stays float32: the products
// are those of the dequantised values, x' = q * scale rounded once, as the oracle's.
//   Scores: int8 through tiles-inl.h's score tile on the integers (kv::LoadWide sign-extends and
//     converts), the keys' scales then on the score columns, q . (s k) = s (q . k)
//     (ScaleColumns). int4 (Int4Scores): a register tile of rows x kScoreKeys keys as
//     dot_scores' (each key unpacked once for every row of the tile), each group's 16 bytes
//     zero-extended once and both nibbles looked up in a 16-entry table (n - 8) * scale of the
//     group (Int4Values: vpermps on 16-lane targets, no conversion; elsewhere a subtract and
//     convert); a row's four dot products added across lanes together and stored as one vector
//     (SumFour: two interleaves and the blocks, not one reduction per key).
//   Values: int8 through tiles-inl.h's value tile on the integers, the scale folded into the
//     weight column, p (s v) = (p s) v (ScaleColumns); int4 through the same broadcast tile
//     (tile_gemm::BroadcastSteps) with Int4Values as its loader, whole groups in registers.
//   A last group of fewer than 32 values (int4, D mod 32) runs scalar.
#if defined(QKV_ATTENTION_DECODE_QUANTIZED_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_DECODE_QUANTIZED_INL_H_
#undef QKV_ATTENTION_DECODE_QUANTIZED_INL_H_
#else
#define QKV_ATTENTION_DECODE_QUANTIZED_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "attention/decode/plan.hpp"
#include "attention/decode/tiles-inl.h"
#include "gemm/register_tile-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {

// The element type decode is instantiated with for int4 K/V: one byte, two values.
struct Int4 {
  uint8_t byte;
};

constexpr size_t kInt4Group = 32;  // qkv::kInt4Group: values per scale, 16 bytes
constexpr size_t kMaxLanes = hn::MaxLanes(DF());
// 16 lanes: a group's nibbles index a one-register table (TableLookupLanes reads 16 entries).
constexpr bool kInt4Lookup = kMaxLanes == 16;
// Vectors per int4 group, and groups per value tile (kValueVectors vectors, at least one group).
constexpr size_t kInt4GroupVectors = kMaxLanes <= kInt4Group / 2 ? kInt4Group / kMaxLanes : 1;
constexpr size_t kInt4TileGroups = std::max<size_t>(1, kValueVectors / kInt4GroupVectors);
// The stored nibble n is the integer plus 8: entry n of the lookup table is n - 8.
alignas(64) constexpr float kInt4Integers[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};

// int8: tile[r * kKeyTile + j] *= the scale of key j0 + j step (KeyScales or ValueScales, from
// tiles-inl.h: paged or not), for `rows` rows and `cols` keys.
template <class ScalesOf>
HWY_INLINE void ScaleColumns(ScalesOf scales_of, const AttentionProblem& p, int64_t b, int64_t g, int64_t j0,
                             int64_t step, size_t cols, size_t rows, float* HWY_RESTRICT tile) {
  float column[kKeyTile];
  for (size_t j = 0; j < cols; ++j) column[j] = *scales_of(p, b, g, j0 + static_cast<int64_t>(j) * step);
  for (size_t r = 0; r < rows; ++r)
    for (size_t j = 0; j < cols; ++j) tile[r * kKeyTile + j] *= column[j];
}

// Values [c, c + L) and [16 + c, 16 + c + L) of the int4 group whose bytes start at `bytes - c`,
// dequantised: (n - 8) * scale, the float32 product of quantize.hpp's definition.
HWY_INLINE void Int4Values(const uint8_t* HWY_RESTRICT bytes, float scale, VF& low, VF& high) {
  const DF df;
  const hn::RebindToUnsigned<DF> du;
  const auto packed = hn::PromoteTo(du, hn::LoadU(hn::Rebind<uint8_t, DF>(), bytes));
  if constexpr (kInt4Lookup) {
    const VF table = hn::Mul(hn::Load(df, kInt4Integers), hn::Set(df, scale));
    low = hn::TableLookupLanes(table, hn::IndicesFromVec(df, hn::And(packed, hn::Set(du, 0x0fu))));
    high = hn::TableLookupLanes(table, hn::IndicesFromVec(df, hn::ShiftRight<4>(packed)));
  } else {
    const hn::RebindToSigned<DF> di;
    const auto offset = hn::Set(di, 8);
    const VF s = hn::Set(df, scale);
    low = hn::Mul(hn::ConvertTo(df, hn::Sub(hn::BitCast(di, hn::And(packed, hn::Set(du, 0x0fu))), offset)), s);
    high = hn::Mul(hn::ConvertTo(df, hn::Sub(hn::BitCast(di, hn::ShiftRight<4>(packed)), offset)), s);
  }
}

// Whole groups a row's vectors cover (a vector wider than 16 lanes leaves every group scalar).
HWY_INLINE size_t WholeInt4Groups(size_t dim) { return kMaxLanes <= kInt4Group / 2 ? dim / kInt4Group : 0; }

// Value d of an int4 row of `dim` values, dequantised, read scalar (the last, partial group).
HWY_INLINE float Int4Scalar(const uint8_t* HWY_RESTRICT row, const float* HWY_RESTRICT scales, size_t dim, size_t d) {
  const size_t first = d / kInt4Group * kInt4Group, half = std::min(kInt4Group, dim - first) / 2;
  const size_t j = d - first, byte = row[first / 2 + j % half];
  const int q = static_cast<int>(j < half ? byte & 0x0f : byte >> 4) - 8;
  return static_cast<float>(q) * scales[d / kInt4Group];
}

#if HWY_TARGET != HWY_SCALAR
// The lanes of D added block by block: 128-bit blocks summed into the first, stored (4 floats).
template <class D>
HWY_INLINE void StoreBlockSum(D d, hn::Vec<D> v, float* HWY_RESTRICT out) {
  if constexpr (hn::MaxLanes(D()) > 4) {
    const hn::Half<D> dh;
    StoreBlockSum(dh, hn::Add(hn::LowerHalf(dh, v), hn::UpperHalf(dh, v)), out);
  } else {
    hn::StoreU(v, d, out);
  }
}
#endif

// out[x] = the sum of the lanes of acc[x], x < 4, stored together: interleaved within 128-bit
// blocks twice (lane x of each block then holds part of acc[x]'s sum), then the blocks added
// (one lane: as is).
HWY_INLINE void SumFour(const VF (&acc)[4], float* HWY_RESTRICT out) {
#if HWY_TARGET == HWY_SCALAR
  for (size_t x = 0; x < 4; ++x) out[x] = hn::GetLane(acc[x]);
#else
  const DF d;
  const hn::Repartition<uint64_t, DF> d64;
  // Per block: ab = [a0 + a2, b0 + b2, a1 + a3, b1 + b3], cd alike; their 64-bit halves
  // interleaved and added give [a, b, c, d] of the block.
  const auto pair_sums = [&](const VF& a, const VF& b) {
    return hn::BitCast(d64, hn::Add(hn::InterleaveLower(d, a, b), hn::InterleaveUpper(d, a, b)));
  };
  const auto ab = pair_sums(acc[0], acc[1]), cd = pair_sums(acc[2], acc[3]);
  const VF abcd =
      hn::Add(hn::BitCast(d, hn::InterleaveLower(d64, ab, cd)), hn::BitCast(d, hn::InterleaveUpper(d64, ab, cd)));
  StoreBlockSum(d, abcd, out);
#endif
}
static_assert(kScoreKeys == 4, "SumFour adds the dot products of four keys");

// s[r * kKeyTile + x] = qs_r . k'_x for Rows rows (q_stride apart) and kScoreKeys int4 keys: each
// group's values dequantised once (Int4Values) for every row, the last partial group scalar.
template <size_t Rows>
HWY_INLINE void Int4ScoreTile(size_t dk, const float* HWY_RESTRICT q, size_t q_stride, const Int4* const* keys,
                              const float* const* scales, float* HWY_RESTRICT s) {
  const size_t lanes = hn::Lanes(DF()), whole = WholeInt4Groups(dk);
  const uint8_t* bytes[kScoreKeys];
  for (size_t x = 0; x < kScoreKeys; ++x) bytes[x] = &keys[x]->byte;
  VF acc[Rows][kScoreKeys];
  tile_gemm::ZeroTile(acc);
  for (size_t group = 0; group < whole; ++group) {
    for (size_t c = 0; c < kInt4Group / 2; c += lanes) {
      VF low[kScoreKeys], high[kScoreKeys];
      for (size_t x = 0; x < kScoreKeys; ++x)
        Int4Values(bytes[x] + group * kInt4Group / 2 + c, scales[x][group], low[x], high[x]);
      tile_gemm::DotStep(q + group * kInt4Group + c, q_stride, low, acc);
      tile_gemm::DotStep(q + group * kInt4Group + kInt4Group / 2 + c, q_stride, high, acc);
    }
  }
  for (size_t r = 0; r < Rows; ++r) {
    SumFour(acc[r], s + r * kKeyTile);
    for (size_t x = 0; x < kScoreKeys; ++x)
      for (size_t d = whole * kInt4Group; d < dk; ++d)
        s[r * kKeyTile + x] += q[r * q_stride + d] * Int4Scalar(bytes[x], scales[x], dk, d);
  }
}

// Step "scores" for int4: S (rows x Bc) = Qs K'_run^T, keys outer in fours (each key unpacked
// once per row tile, its bytes reused from L1), prefetching as DecodeScores does. Past the run's
// last key the pointers repeat that key (hidden later).
inline void Int4Scores(const AttentionProblem& p, const decode::Plan& plan, int64_t b, int64_t g, size_t rows,
                       const KeyRun& run, const Scratch& w) {
  const size_t dk = static_cast<size_t>(p.head_dim);
  for (size_t j = 0; j < run.cols; j += kScoreKeys) {
    const int64_t ahead = run.j0 + (static_cast<int64_t>(j) + PrefetchAhead<Int4>()) * run.step;
    if (ahead < run.end)
      PrefetchKeys<Int4>(p, b, g, ahead,
                         std::min<int64_t>(ahead + static_cast<int64_t>(kScoreKeys) * run.step, run.end), run.step);
    const Int4* keys[kScoreKeys];
    const float* scales[kScoreKeys];
    for (size_t x = 0; x < kScoreKeys; ++x) {
      const int64_t key = run.j0 + static_cast<int64_t>(std::min(j + x, run.cols - 1)) * run.step;
      keys[x] = KeyRow<Int4>(p, b, g, key);
      scales[x] = KeyScales(p, b, g, key);
    }
    for (size_t r = 0; r < rows; r += dot_scores::kRows)
      tile_gemm::WithConstant<dot_scores::kRows>(std::min(dot_scores::kRows, rows - r), [&](auto tile_rows) {
        Int4ScoreTile<decltype(tile_rows)::value>(dk, w.q + r * plan.q_stride, plan.q_stride, keys, scales,
                                                  w.scores + r * kKeyTile + j);
      });
  }
}

// o[r * o_stride + c] += sum_j p[r * kKeyTile + j] v'_j[c] for Rows rows and the Groups whole
// int4 groups of columns from `first_group` on, over `cols` keys: the value tile with Int4Values
// as its loader.
template <size_t Rows, size_t Groups>
HWY_INLINE void Int4ValueTile(size_t cols, const float* HWY_RESTRICT p, const uint8_t* const* values,
                              const float* const* scales, size_t first_group, float* HWY_RESTRICT o, size_t o_stride) {
  constexpr size_t kVectors = Groups * kInt4GroupVectors, kHalf = kInt4GroupVectors / 2;
  const size_t lanes = hn::Lanes(DF());
  VF acc[Rows][kVectors];
  tile_gemm::LoadTileOrZero(acc, true, o + first_group * kInt4Group, o_stride);
  tile_gemm::BroadcastSteps(
      cols, p, kKeyTile, 1,
      [&](size_t j, VF(&row)[kVectors]) {
        for (size_t n = 0; n < Groups; ++n)
          for (size_t h = 0; h < kHalf; ++h)
            Int4Values(values[j] + (first_group + n) * kInt4Group / 2 + h * lanes, scales[j][first_group + n],
                       row[n * kInt4GroupVectors + h], row[n * kInt4GroupVectors + kHalf + h]);
      },
      acc);
  tile_gemm::StoreTile(acc, o + first_group * kInt4Group, o_stride);
}

// Step "accumulate" for int4: O += P V'_run, whole groups in value tiles, the last partial group
// scalar. Quantized values are finite, so hidden keys (weight 0) add exactly 0.
inline void Int4Accumulate(const AttentionProblem& p, const decode::Plan& plan, int64_t b, int64_t g, size_t rows,
                           const KeyRun& run, const Scratch& w) {
  const size_t dv = static_cast<size_t>(p.value_dim), whole = WholeInt4Groups(dv);
  const uint8_t* values[kKeyTile];
  const float* scales[kKeyTile];
  for (size_t j = 0; j < run.cols; ++j) {
    const int64_t key = run.j0 + static_cast<int64_t>(j) * run.step;
    values[j] = ValueBytes(p, b, g, key);
    scales[j] = ValueScales(p, b, g, key);
  }
  for (size_t group = 0; group < whole; group += kInt4TileGroups)
    for (size_t r = 0; r < rows; r += kValueRows)
      WithConstant<kValueRows>(std::min(kValueRows, rows - r), [&](auto tile_rows) {
        WithConstant<kInt4TileGroups>(std::min(kInt4TileGroups, whole - group), [&](auto tile_groups) {
          Int4ValueTile<decltype(tile_rows)::value, decltype(tile_groups)::value>(
              run.cols, w.scores + r * kKeyTile, values, scales, group, w.out + r * plan.out_stride, plan.out_stride);
        });
      });
  for (size_t r = 0; r < rows; ++r)
    for (size_t c = whole * kInt4Group; c < dv; ++c) {
      float sum = w.out[r * plan.out_stride + c];
      for (size_t j = 0; j < run.cols; ++j) sum += w.scores[r * kKeyTile + j] * Int4Scalar(values[j], scales[j], dv, c);
      w.out[r * plan.out_stride + c] = sum;
    }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // QKV_ATTENTION_DECODE_QUANTIZED_INL_H_
