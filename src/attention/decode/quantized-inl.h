// Decode's steps for quantized K/V (qkv/quantize.hpp), read in place and widened in registers
// (Highway -inl.h, included by chunk-inl.h once per SIMD target). q stays float32 (the products
// are those of the dequantised values, x' = q * scale rounded once, as the oracle's) except in
// int4's integer scores on AVX-512 (IntChunkDots), which quantise q to int8 per group of 32:
// each element of scale * q then moves by at most max|its group| / 254 (docs/inference.md).
//   Scores: int8 through tiles-inl.h's score tile on the integers (kv::LoadWide sign-extends and
//     converts), the keys' scales then on the score columns, q . (s k) = s (q . k)
//     (ScaleColumns). int4 (Int4Scores): on AVX-512 (AVX3, AVX3_DL) and D <= 512, chunks of four
//     groups as integer dot products (IntChunkDots), the rest of the row as below; elsewhere
//     all of it in floats: a register tile of rows x kScoreKeys keys as
//     dot_scores' (each key unpacked once for every row of the tile), each group's 16 bytes
//     zero-extended once and both nibbles looked up in a 16-entry table (n - 8) * scale of the
//     group (Int4Values: vpermps on 16-lane targets, no conversion; elsewhere a subtract and
//     convert); a row's four dot products added across lanes together and stored as one vector
//     (SumFour: two interleaves and the blocks, not one reduction per key).
//   Values: int8 through tiles-inl.h's value tile on the integers, the scale folded into the
//     weight column, p (s v) = (p s) v (ScaleColumns); int4 through the same broadcast tile
//     (tile_gemm::BroadcastSteps) with Int4Values as its loader, whole groups in registers, and
//     twice the groups a tile for one or two rows (kInt4FewRows: more FMA chains in flight).
//   A last group of fewer than 32 values (int4, D mod 32) runs scalar.
#if defined(QKV_ATTENTION_DECODE_QUANTIZED_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_DECODE_QUANTIZED_INL_H_
#undef QKV_ATTENTION_DECODE_QUANTIZED_INL_H_
#else
#define QKV_ATTENTION_DECODE_QUANTIZED_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

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
// A block of at most kInt4FewRows rows takes kInt4FewRowsGroups groups a tile, twice the chains
// of FMAs in flight, as the float value tile does for few rows (tiles-inl.h, kFewValueRows).
constexpr size_t kInt4FewRows = kFewValueRows;
constexpr size_t kInt4FewRowsGroups = tile_gemm::kWideRegisterFile ? 2 * kInt4TileGroups : kInt4TileGroups;
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


// ---- int4 scores in integers (AVX-512BW): q quantised once per key tile to int8 per group of 32,
// qs = max|q group| / 127 (|q - qs round(q / qs)| <= max|q group| / 254, docs/inference.md), then
// per key and four groups (64 bytes, 128 values): the nibbles n = k + 8 (unsigned) times q
// (signed) summed in pairs (vpmaddubsw: |n q + n' q'| <= 2 x 15 x 127, never saturates), the pairs
// summed in fours (vpmaddwd), sum(8 q) subtracted, converted once and scaled by kscale x qscale
// lane by lane. Exact integer sums: the products are those of q's and k's dequantised values.
// The AVX-512 targets with 16-bit byte products (AVX-512BW), including the ones later Highway
// versions add (AVX3_ZEN4, AVX3_SPR). Set anew for each target this file is compiled for.
#undef QKV_INT4_INTEGER_SCORES
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL || (defined(HWY_AVX3_ZEN4) && HWY_TARGET == HWY_AVX3_ZEN4) || \
    (defined(HWY_AVX3_SPR) && HWY_TARGET == HWY_AVX3_SPR)
#define QKV_INT4_INTEGER_SCORES 1
#else
#define QKV_INT4_INTEGER_SCORES 0
#endif
#if QKV_INT4_INTEGER_SCORES
constexpr bool kInt4Integer = true;
#else
constexpr bool kInt4Integer = false;
#endif
constexpr size_t kIntChunkGroups = 4;       // groups per 64-byte chunk
constexpr size_t kIntMaxGroups = 16;        // D <= 512 in integers; wider rows stay float
// Quantised q of one row, laid out as a chunk of keys is read: low[16 g + j] = q[32 g + j] (the
// low nibbles' partners), high[16 g + j] = q[32 g + 16 + j]; per int32 lane of a chunk (4 bytes
// of low and of high) the correction 8 sum(q) of its 8 values and the scale of its group.
struct IntQuery {
  alignas(64) int8_t low[kIntMaxGroups * 16];
  alignas(64) int8_t high[kIntMaxGroups * 16];
  alignas(64) int32_t correction[kIntMaxGroups * 4];
  alignas(64) float scale[kIntMaxGroups * 4];
};

// Chunks of four whole groups a row of `dim` values runs in integers (0: all float).
HWY_INLINE size_t IntChunks(size_t dim) {
  return kInt4Integer && dim <= kIntMaxGroups * kInt4Group ? dim / (kInt4Group * kIntChunkGroups) : 0;
}

#if QKV_INT4_INTEGER_SCORES
using VU8 = hn::Vec512<uint8_t>;
using VI32 = hn::Vec512<int32_t>;

// sum over each int32 lane's 4 byte pairs of n * q for the low and the high nibbles' bytes.
HWY_INLINE VI32 NibbleDots(VU8 low, VU8 high, const int8_t* HWY_RESTRICT q_low, const int8_t* HWY_RESTRICT q_high) {
  const __m512i pairs = _mm512_add_epi16(_mm512_maddubs_epi16(low.raw, _mm512_load_si512(q_low)),
                                         _mm512_maddubs_epi16(high.raw, _mm512_load_si512(q_high)));
  return VI32{_mm512_madd_epi16(pairs, _mm512_set1_epi16(1))};
}

// q (dim values, `chunks` x 128 of them) quantised into `out` as IntQuery lays it out.
// False, leaving `out` undefined, when a value is NaN or infinite: the int8 quantisation would clamp
// it away, so such a row keeps the float path.
HWY_INLINE bool QuantizeQuery(const float* HWY_RESTRICT q, size_t chunks, IntQuery& out) {
  const DF df;
  const hn::Full128<int8_t> d8;
  bool finite = true;
  for (size_t g = 0; g < chunks * kIntChunkGroups; ++g) {
    const VF v0 = hn::LoadU(df, q + g * kInt4Group), v1 = hn::LoadU(df, q + g * kInt4Group + 16);
    finite &= hn::AllTrue(df, hn::And(hn::IsFinite(v0), hn::IsFinite(v1)));
    const float amax = hn::GetLane(hn::MaxOfLanes(df, hn::Max(hn::Abs(v0), hn::Abs(v1))));
    const VF inv = hn::Set(df, amax > 0 ? 127.0f / amax : 0.0f);
    hn::Store(hn::DemoteTo(d8, hn::NearestInt(hn::Mul(v0, inv))), d8, out.low + g * 16);
    hn::Store(hn::DemoteTo(d8, hn::NearestInt(hn::Mul(v1, inv))), d8, out.high + g * 16);
    std::fill_n(out.scale + g * 4, 4, amax / 127.0f);
  }
  const VU8 eight = hn::Set(hn::Full512<uint8_t>(), uint8_t{8});
  for (size_t c = 0; c < chunks; ++c)
    hn::Store(NibbleDots(eight, eight, out.low + c * 64, out.high + c * 64), hn::Full512<int32_t>(),
              out.correction + c * 16);
  return finite;
}

// acc[r][x] += lane partial sums of q_r . k'_x over the first `chunks` chunks (IntQuery rows).
template <size_t Rows>
HWY_INLINE void IntChunkDots(size_t chunks, const IntQuery* queries, const uint8_t* const* bytes,
                             const float* const* scales, VF (&acc)[Rows][kScoreKeys]) {
  const hn::Full512<uint8_t> du8;
  const VU8 nibble = hn::Set(du8, uint8_t{0x0f});
  const __m512i group_of_lane = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  for (size_t c = 0; c < chunks; ++c) {
    VU8 low[kScoreKeys], high[kScoreKeys];
    VF kscale[kScoreKeys];
    for (size_t x = 0; x < kScoreKeys; ++x) {
      const VU8 raw = hn::LoadU(du8, bytes[x] + c * 64);
      low[x] = hn::And(raw, nibble);
      high[x] = hn::And(VU8{_mm512_srli_epi16(raw.raw, 4)}, nibble);
      kscale[x] = VF{_mm512_permutexvar_ps(group_of_lane, _mm512_castps128_ps512(_mm_loadu_ps(scales[x] + c * 4)))};
    }
    for (size_t r = 0; r < Rows; ++r) {
      const IntQuery& qr = queries[r];
      const VI32 correction = hn::Load(hn::Full512<int32_t>(), qr.correction + c * 16);
      const VF qscale = hn::Load(DF(), qr.scale + c * 16);
      for (size_t x = 0; x < kScoreKeys; ++x) {
        const VI32 dots = hn::Sub(NibbleDots(low[x], high[x], qr.low + c * 64, qr.high + c * 64), correction);
        acc[r][x] = hn::MulAdd(hn::ConvertTo(DF(), dots), hn::Mul(kscale[x], qscale), acc[r][x]);
      }
    }
  }
}
#else
HWY_INLINE bool QuantizeQuery(const float*, size_t, IntQuery&) { return true; }
template <size_t Rows>
HWY_INLINE void IntChunkDots(size_t, const IntQuery*, const uint8_t* const*, const float* const*,
                             VF (&)[Rows][kScoreKeys]) {}
#endif

// s[r * kKeyTile + x] = qs_r . k'_x for Rows rows (q_stride apart) and kScoreKeys int4 keys: each
// group's values dequantised once (Int4Values) for every row, the last partial group scalar.
template <size_t Rows>
HWY_INLINE void Int4ScoreTile(size_t dk, size_t chunks, const float* HWY_RESTRICT q, size_t q_stride,
                              const IntQuery* queries, const Int4* const* keys, const float* const* scales,
                              float* HWY_RESTRICT s) {
  const size_t lanes = hn::Lanes(DF()), whole = WholeInt4Groups(dk);
  const uint8_t* bytes[kScoreKeys];
  for (size_t x = 0; x < kScoreKeys; ++x) bytes[x] = &keys[x]->byte;
  VF acc[Rows][kScoreKeys];
  tile_gemm::ZeroTile(acc);
  IntChunkDots(chunks, queries, bytes, scales, acc);
  for (size_t group = chunks * kIntChunkGroups; group < whole; ++group) {
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
  // A non-finite q keeps the float path for the block: its NaN or inf must reach the scores.
  size_t chunks = IntChunks(dk);
  IntQuery queries[kRowBlock];  // the block's rows of q in integers (used when chunks > 0)
  for (size_t r = 0; r < rows && chunks > 0; ++r)
    if (!QuantizeQuery(w.q + r * plan.q_stride, chunks, queries[r])) chunks = 0;
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
        Int4ScoreTile<decltype(tile_rows)::value>(dk, chunks, w.q + r * plan.q_stride, plan.q_stride, queries + r,
                                                  keys, scales, w.scores + r * kKeyTile + j);
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
  const auto tiles = [&](auto max_rows, auto max_groups) {
    constexpr size_t kRows = decltype(max_rows)::value, kGroups = decltype(max_groups)::value;
    for (size_t group = 0; group < whole; group += kGroups)
      for (size_t r = 0; r < rows; r += kRows)
        WithConstant<kRows>(std::min(kRows, rows - r), [&](auto tile_rows) {
          WithConstant<kGroups>(std::min(kGroups, whole - group), [&](auto tile_groups) {
            Int4ValueTile<decltype(tile_rows)::value, decltype(tile_groups)::value>(
                run.cols, w.scores + r * kKeyTile, values, scales, group, w.out + r * plan.out_stride, plan.out_stride);
          });
        });
  };
  if (rows <= kInt4FewRows) {
    tiles(std::integral_constant<size_t, kInt4FewRows>(), std::integral_constant<size_t, kInt4FewRowsGroups>());
  } else {
    tiles(std::integral_constant<size_t, kValueRows>(), std::integral_constant<size_t, kInt4TileGroups>());
  }
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
