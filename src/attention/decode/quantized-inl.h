// Decode's steps for quantized K/V (qkv/quantize.hpp), read in place and widened in registers
// (Highway -inl.h, included by chunk-inl.h once per SIMD target):
//   int8 (T = int8_t): the products are tiles-inl.h's, on the integers (kv::LoadWide sign-extends
//     and converts); the per-token scales multiply the score columns, q . (s k) = s (q . k), and
//     the weight columns, p (s v) = (p s) v (ScaleColumns).
//   int4 (T = Int4): its scales vary along D (a group of 32), so its score and value steps are
//     its own: each group's 16 bytes unpacked into two vectors per 16 lanes (value c in the low
//     four bits of byte c, value 16 + c in the high four), its partial product times its scale.
//     A last group of fewer than 32 values (D mod 32) runs scalar.
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
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {

// The element type decode is instantiated with for int4 K/V: one byte, two values.
struct Int4 {
  uint8_t byte;
};

constexpr size_t kInt4Group = 32;  // qkv::kInt4Group: values per scale, 16 bytes

// int8: tile[r * kKeyTile + j] *= the scale of key j0 + j step, for `rows` rows and `cols` keys.
HWY_INLINE void ScaleColumns(const Rows<const float>& scales, int64_t b, int64_t g, int64_t j0, int64_t step,
                             size_t cols, size_t rows, float* HWY_RESTRICT tile) {
  float column[kKeyTile];
  for (size_t j = 0; j < cols; ++j) column[j] = *scales.row(b, g, j0 + static_cast<int64_t>(j) * step);
  for (size_t r = 0; r < rows; ++r)
    for (size_t j = 0; j < cols; ++j) tile[r * kKeyTile + j] *= column[j];
}

// Values [c, c + L) and [16 + c, 16 + c + L) of the int4 group whose bytes start at `bytes - c`,
// as floats (the integers q, unscaled).
HWY_INLINE void UnpackInt4(const uint8_t* HWY_RESTRICT bytes, VF& low, VF& high) {
  const DF df;
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto packed = hn::PromoteTo(du, hn::LoadU(hn::Rebind<uint8_t, DF>(), bytes));
  const auto offset = hn::Set(di, 8);
  low = hn::ConvertTo(df, hn::Sub(hn::BitCast(di, hn::And(packed, hn::Set(du, 0x0fu))), offset));
  high = hn::ConvertTo(df, hn::Sub(hn::BitCast(di, hn::ShiftRight<4>(packed)), offset));
}

// Whole groups a row's vectors cover (a vector wider than 16 lanes leaves every group scalar).
HWY_INLINE size_t WholeInt4Groups(size_t dim) { return hn::Lanes(DF()) <= kInt4Group / 2 ? dim / kInt4Group : 0; }

// q . x for the int4 row x (bytes and group scales) of `dim` values.
HWY_INLINE float Int4Dot(const float* HWY_RESTRICT q, const uint8_t* HWY_RESTRICT row,
                         const float* HWY_RESTRICT scales, size_t dim) {
  const DF df;
  const size_t lanes = hn::Lanes(df), whole = WholeInt4Groups(dim);
  VF acc = hn::Zero(df);
  for (size_t group = 0; group < whole; ++group) {
    const float* qg = q + group * kInt4Group;
    VF part = hn::Zero(df);
    for (size_t c = 0; c < kInt4Group / 2; c += lanes) {
      VF low, high;
      UnpackInt4(row + group * kInt4Group / 2 + c, low, high);
      part = hn::MulAdd(low, hn::LoadU(df, qg + c), part);
      part = hn::MulAdd(high, hn::LoadU(df, qg + kInt4Group / 2 + c), part);
    }
    acc = hn::MulAdd(hn::Set(df, scales[group]), part, acc);
  }
  float sum = hn::GetLane(hn::SumOfLanes(df, acc));
  for (size_t first = whole * kInt4Group, group = whole; first < dim; first += kInt4Group, ++group) {
    const size_t half = std::min(kInt4Group, dim - first) / 2;
    const uint8_t* bytes = row + first / 2;
    float part = 0;
    for (size_t j = 0; j < half; ++j)
      part += q[first + j] * static_cast<float>((bytes[j] & 0x0f) - 8) +
              q[first + half + j] * static_cast<float>((bytes[j] >> 4) - 8);
    sum += scales[group] * part;
  }
  return sum;
}

// o[0, dim) += weight x for the int4 row x (bytes and group scales).
HWY_INLINE void Int4AddScaled(float weight, const uint8_t* HWY_RESTRICT row, const float* HWY_RESTRICT scales,
                              size_t dim, float* HWY_RESTRICT o) {
  const DF df;
  const size_t lanes = hn::Lanes(df), whole = WholeInt4Groups(dim);
  for (size_t group = 0; group < whole; ++group) {
    const VF w = hn::Set(df, weight * scales[group]);
    float* og = o + group * kInt4Group;
    for (size_t c = 0; c < kInt4Group / 2; c += lanes) {
      VF low, high;
      UnpackInt4(row + group * kInt4Group / 2 + c, low, high);
      hn::StoreU(hn::MulAdd(w, low, hn::LoadU(df, og + c)), df, og + c);
      hn::StoreU(hn::MulAdd(w, high, hn::LoadU(df, og + kInt4Group / 2 + c)), df, og + kInt4Group / 2 + c);
    }
  }
  for (size_t first = whole * kInt4Group, group = whole; first < dim; first += kInt4Group, ++group) {
    const size_t half = std::min(kInt4Group, dim - first) / 2;
    const uint8_t* bytes = row + first / 2;
    const float w = weight * scales[group];
    for (size_t j = 0; j < half; ++j) {
      o[first + j] += w * static_cast<float>((bytes[j] & 0x0f) - 8);
      o[first + half + j] += w * static_cast<float>((bytes[j] >> 4) - 8);
    }
  }
}

// Step "scores" for int4: S (rows x Bc) = Qs K_run^T, keys outer (each key's bytes reused by
// every row from L1), prefetching as DecodeScores does; columns past the run's keys are zeroed
// (the caller hides them).
inline void Int4Scores(const AttentionProblem& p, const decode::Plan& plan, int64_t b, int64_t g, size_t rows,
                       const KeyRun& run, const Scratch& w) {
  const size_t dk = static_cast<size_t>(p.head_dim);
  for (size_t j = 0; j < run.cols; ++j) {
    const int64_t key = run.j0 + static_cast<int64_t>(j) * run.step;
    if (j % kScoreKeys == 0) {
      const int64_t ahead = key + PrefetchAhead<Int4>() * run.step;
      if (ahead < run.end)
        PrefetchKeys<Int4>(p, b, g, ahead, std::min<int64_t>(ahead + static_cast<int64_t>(kScoreKeys) * run.step, run.end),
                           run.step);
    }
    const uint8_t* row = p.k_quant.row(b, g, key);
    const float* scales = p.k_scales.row(b, g, key);
    for (size_t r = 0; r < rows; ++r) w.scores[r * kKeyTile + j] = Int4Dot(w.q + r * plan.q_stride, row, scales, dk);
  }
  for (size_t r = 0; r < rows; ++r) std::fill(w.scores + r * kKeyTile + run.cols, w.scores + (r + 1) * kKeyTile, 0.0f);
}

// Step "accumulate" for int4: O += P V_run, skipping zero weights (hidden or dropped keys).
inline void Int4Accumulate(const AttentionProblem& p, const decode::Plan& plan, int64_t b, int64_t g, size_t rows,
                           const KeyRun& run, const Scratch& w) {
  const size_t dv = static_cast<size_t>(p.value_dim);
  for (size_t j = 0; j < run.cols; ++j) {
    const int64_t key = run.j0 + static_cast<int64_t>(j) * run.step;
    const uint8_t* row = p.v_quant.row(b, g, key);
    const float* scales = p.v_scales.row(b, g, key);
    for (size_t r = 0; r < rows; ++r) {
      const float weight = w.scores[r * kKeyTile + j];
      if (weight != 0.0f) Int4AddScaled(weight, row, scales, dv, w.out + r * plan.out_stride);
    }
  }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // QKV_ATTENTION_DECODE_QUANTIZED_INL_H_
