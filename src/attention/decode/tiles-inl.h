// Decode's per-target operand and product steps (Highway -inl.h, included by decode.cpp once per
// SIMD target through chunk-inl.h): a worker's scratch, the K/V rows read in place and
// prefetched into L2, the score tile S = Qs K^T (dot_scores-inl.h, whose summation order the
// flash backward repeats) and the value tile O += P V, "broadcast a weight, load a row of V"; and
// a row's steps both item kinds share (StartRow, PackQuery, RowSoftmaxStep, EndRow).
#if defined(QKV_ATTENTION_DECODE_TILES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_DECODE_TILES_INL_H_
#undef QKV_ATTENTION_DECODE_TILES_INL_H_
#else
#define QKV_ATTENTION_DECODE_TILES_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "attention/decode/plan.hpp"
#include "attention/kernels.hpp"
#include "attention/steps/dot_scores-inl.h"
#include "attention/steps/pipeline-inl.h"
#include "gemm/register_tile-inl.h"
#include "simd/kv_load-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

using decode::kKeyTile;
using decode::kRowBlock;
using tile_gemm::AllFinite;

// The value tile: gemm/register_tile-inl.h's four-wide tile, kValueRows x kValueVectors
// accumulators + kValueVectors V loads + 1 broadcast. (The score tile is dot_scores::ScoreTile,
// attention/steps/dot_scores-inl.h, shared with the flash backward.)
constexpr size_t kValueRows = tile_gemm::kFourWideRows;
constexpr size_t kValueVectors = tile_gemm::kFourWideColumns;
// A block of at most kFewValueRows rows (one, in a decode step without grouped heads) takes
// kFewRowsValueVectors vectors a tile: each accumulator is a chain of FMAs, one a key, and
// kValueVectors chains a row leave the step waiting on the FMA's latency; twice the vectors are
// twice the chains in flight. Wide register files only (2 rows x 8 accumulators + 8 values).
constexpr size_t kFewValueRows = kValueRows / 2;
constexpr size_t kFewRowsValueVectors = tile_gemm::kWideRegisterFile ? 2 * kValueVectors : kValueVectors;
using tile_gemm::WithConstant;
constexpr size_t kScoreKeys = dot_scores::kKeys;
static_assert(kKeyTile % kScoreKeys == 0, "a key tile holds whole score tiles");

// Prefetches the cache lines of [begin, end) into L2 (locality hint 2: prefetcht1 on x86).
HWY_INLINE void PrefetchRange(const void* begin, const void* end) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(begin) & ~uintptr_t{63};
  for (uintptr_t line = first; line < reinterpret_cast<uintptr_t>(end); line += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 2);
}

// ---- Step 5's register tile: o[r * o_stride + n L + c] += sum_j p[r * kKeyTile + j]
// v[j * dv + n L + c] over `cols` keys, for Rows rows and Vectors vectors of columns: "broadcast
// a weight, load a row of V" (tile_gemm::BroadcastSteps).
template <size_t Rows, size_t Vectors, class T>
HWY_INLINE void ValueTile(size_t cols, const float* HWY_RESTRICT p, const T* HWY_RESTRICT v, size_t dv,
                          float* HWY_RESTRICT o, size_t o_stride) {
  VF acc[Rows][Vectors];
  tile_gemm::LoadTileOrZero(acc, true, o, o_stride);
  tile_gemm::BroadcastSteps(
      cols, p, kKeyTile, 1, [&](size_t j, VF(&row)[Vectors]) { tile_gemm::LoadConsecutive(v + j * dv, row); }, acc);
  tile_gemm::StoreTile(acc, o, o_stride);
}

namespace step = pipeline;

// One worker's view of its scratch block (decode::ScratchLayout).
struct Scratch {
  float *q, *scores, *out, *running_max, *row_sum, *v_wide;
  Scratch(float* base, const decode::ScratchLayout& l)
      : q(base + l.q), scores(base + l.scores), out(base + l.out), running_max(base + l.running_max),
        row_sum(base + l.row_sum), v_wide(base + l.v_wide) {}
  // The same scratch seen from row r of the block on (a gather over some of its rows).
  Scratch from_row(const decode::Plan& plan, size_t r) const {
    Scratch w = *this;
    w.q += r * plan.q_stride;
    w.scores += r * kKeyTile;
    w.out += r * plan.out_stride;
    w.running_max += r;
    w.row_sum += r;
    return w;
  }
};

// K and V rows of element type T: float (p.k, p.v) or 16 bits (p.k_bits, p.v_bits), read in place.
template <class T>
HWY_INLINE const T* RowIn(const Rows<const float>& floats, const Rows<const uint16_t>& bits, int64_t b, int64_t g, int64_t j) {
  if constexpr (std::is_same_v<T, float>) {
    return floats.row(b, g, j);
  } else {
    return reinterpret_cast<const T*>(bits.row(b, g, j));
  }
}
HWY_INLINE size_t KeyRowStride(const AttentionProblem& p) {
  if (is_quantized(p.kv_dtype)) return static_cast<size_t>(p.k_quant.row_stride);
  return static_cast<size_t>(p.kv_dtype == DType::F32 ? p.k.row_stride : p.k_bits.row_stride);
}
HWY_INLINE size_t ValueRowStride(const AttentionProblem& p) {
  if (is_quantized(p.kv_dtype)) return static_cast<size_t>(p.v_quant.row_stride);
  return static_cast<size_t>(p.kv_dtype == DType::F32 ? p.v.row_stride : p.v_bits.row_stride);
}
// int8 and int4 K/V (T = int8_t, kv::Int4) are read in place too, from p.k_quant / p.v_quant
// (decode/quantized-inl.h applies their scales). Paged K/V (p.paged, float or 16-bit): key j's row
// lies in its page (PagedKv::offset) past the pool's row 0; the keys [j, paged.page_end(j)) are
// rows of one page, KeyRowStride apart, so a tile that stays in a page is a strided view as a
// contiguous cache's tile is (RowBlockOverChunk cuts tiles at page ends).
// Quantized rows and their scales (paged or not) through these four: key j's bytes and scales.
HWY_INLINE const uint8_t* KeyBytes(const AttentionProblem& p, int64_t b, int64_t g, int64_t j) {
  return p.paged.row<uint8_t>(p.k_quant, p.paged.k_page_stride, b, g, j);
}
HWY_INLINE const uint8_t* ValueBytes(const AttentionProblem& p, int64_t b, int64_t g, int64_t j) {
  return p.paged.row<uint8_t>(p.v_quant, p.paged.v_page_stride, b, g, j);
}
HWY_INLINE const float* KeyScales(const AttentionProblem& p, int64_t b, int64_t g, int64_t j) {
  return p.paged.row<float>(p.k_scales, p.paged.k_scale_page_stride, b, g, j);
}
HWY_INLINE const float* ValueScales(const AttentionProblem& p, int64_t b, int64_t g, int64_t j) {
  return p.paged.row<float>(p.v_scales, p.paged.v_scale_page_stride, b, g, j);
}
template <class T>
HWY_INLINE const T* KeyRow(const AttentionProblem& p, int64_t b, int64_t g, int64_t j) {
  if constexpr (sizeof(T) == 1) return reinterpret_cast<const T*>(KeyBytes(p, b, g, j));
  if (p.paged.on())
    return RowIn<T>(p.k, p.k_bits, 0, g, 0) +
           p.paged.offset(j, p.paged.k_page_stride, static_cast<int64_t>(KeyRowStride(p)));
  return RowIn<T>(p.k, p.k_bits, b, g, j);
}
template <class T>
HWY_INLINE const T* ValueRow(const AttentionProblem& p, int64_t b, int64_t g, int64_t j) {
  if constexpr (sizeof(T) == 1) return reinterpret_cast<const T*>(ValueBytes(p, b, g, j));
  if (p.paged.on())
    return RowIn<T>(p.v, p.v_bits, 0, g, 0) +
           p.paged.offset(j, p.paged.v_page_stride, static_cast<int64_t>(ValueRowStride(p)));
  return RowIn<T>(p.v, p.v_bits, b, g, j);
}

// Row r of an item of group g (decode::Plan::head_of, query_of).
struct RowCoords {
  int64_t h, i;
};
HWY_INLINE RowCoords RowOf(const decode::Plan& plan, int64_t g, int64_t r) {
  return {plan.head_of(g, r), plan.query_of(r)};
}

// The start of row r of an item's scratch, a row of query head h: O = 0 is the caller's; the
// running max and sum start at the sink (InitialMax / InitialSum) in the first chunk, else empty.
HWY_INLINE void StartRow(const AttentionProblem& p, int64_t h, int64_t chunk_begin, const Scratch& w, size_t r) {
  w.running_max[r] = chunk_begin == 0 ? step::InitialMax(p, h) : step::kMinusInf;
  w.row_sum[r] = chunk_begin == 0 ? step::InitialSum(p) : 0.0f;
}

// Row r of the packed Qs: scale * q of query i of head h (once per item, not per tile).
HWY_INLINE void PackQuery(const AttentionProblem& p, const decode::Plan& plan, int64_t b, int64_t h, int64_t i,
                          const Scratch& w, size_t r) {
  const float* q = p.q.row(b, h, i);
  for (size_t d = 0; d < static_cast<size_t>(p.head_dim); ++d) w.q[r * plan.q_stride + d] = p.scale * q[d];
}

// Steps 2 (ALiBi and the mask, after softcap on the whole tile) and 3 for row r of a key tile of
// `cols` keys, on `line`: logits where a key may be hidden or ALiBi applies, the columns past the
// tile's last key hidden after the modifiers (softcap(-inf) is finite), the online softmax
// update, O moved to the new max (exactly 1: left alone). `band` and `hide`: ScoresToLogits'.
HWY_INLINE void RowSoftmaxStep(const AttentionProblem& p, const decode::Plan& plan, const step::Line& line, size_t cols,
                               bool band, int hide, const Scratch& w, size_t r) {
  float* HWY_RESTRICT s = w.scores + r * kKeyTile;
  if (band || p.alibi_slopes || !p.terms.empty()) step::ScoresToLogits(p, line, s, kKeyTile, cols, band, hide);
  std::fill(s + cols, s + kKeyTile, step::kMinusInf);
  const float factor = step::SoftmaxRowUpdate(s, kKeyTile, w.running_max[r], w.row_sum[r]);
  if (factor != 1.0f)
    for (size_t c = 0; c < plan.out_stride; ++c) w.out[r * plan.out_stride + c] *= factor;
}

// The end of row (b, h, i) of an item, its O unnormalised with running max and sum: with one chunk
// the finished output, lse and row stats; with several, the partial (m, l, o) left in `slot` of
// the partials for the merge (decode::Partials).
HWY_INLINE void EndRow(const AttentionProblem& p, const decode::Plan& plan, const decode::Partials& partials, int64_t b,
                       int64_t h, int64_t i, int64_t slot, const float* o, float max, float sum) {
  const size_t dv = static_cast<size_t>(p.value_dim);
  if (plan.chunks == 1) {
    const int64_t at = (b * p.q_heads + h) * p.q_len + i;  // in (B, Hq, Nq)
    finish_row(o, 1, dv, max, sum, std::isnan(max), p.output.row(b, h, i), p.lse + at, p.row_max + at, p.row_sum + at);
    return;
  }
  partials.max[slot] = max;
  partials.sum[slot] = sum;
  std::copy_n(o, dv, partials.out + slot * static_cast<int64_t>(dv));
}

// The keys of one tile: j0, j0 + step, ... (cols of them); prefetching stops at `end`. A tile of
// the key range has step 1. Gathered strided keys have the stride as step and gathered_rest >= 0,
// the rule node whose keys the tiles visit, hidden here so that no pair counts twice.
struct KeyRun {
  int64_t j0, step;
  size_t cols;
  int64_t end;
  int gathered_rest;
};

// Rows of `width` elements, `jump` apart, into L2: one range when they touch (K or V of a
// cache read in order), else row by row.
template <class T>
HWY_INLINE void PrefetchRows(const T* row, int64_t rows, int64_t jump, int64_t width) {
  if (jump == width) return PrefetchRange(row, row + rows * width);
  for (int64_t r = 0; r < rows; ++r, row += jump) PrefetchRange(row, row + width);
}

// Step "load a tile": prefetch the K and V rows of keys first, first + step, ... < last of head
// (b, g) into L2. Not for int8 / int4 K/V read as one stream (rows back to back, key after key):
// a byte a value is consumed slowly enough for the hardware's stream prefetcher, and the prefetch
// loop's own stalls then cost more than it saves (docs/inference.md, the quantized bench rows;
// f32 and 16-bit K/V need it). Pages, strided rows and gathered keys, which no stream follows,
// keep it.
template <class T>
HWY_INLINE void PrefetchKeys(const AttentionProblem& p, int64_t b, int64_t g, int64_t first, int64_t last,
                             int64_t step) {
  if (first >= last) return;
  if (is_quantized(p.kv_dtype) && !p.paged.on() && step == 1) {
    const int64_t per_byte = p.kv_dtype == DType::I4 ? 2 : 1;
    if (p.k_quant.row_stride * per_byte == p.head_dim && p.v_quant.row_stride * per_byte == p.value_dim) return;
  }
  // Paged: a run at a time within one page (the whole range at once otherwise).
  for (int64_t j = first; j < last;) {
    const int64_t stop = p.paged.on() ? std::min(last, p.paged.page_end(j)) : last;
    const int64_t run = (stop - j + step - 1) / step;
    if (is_quantized(p.kv_dtype)) {  // the packed rows (bytes) and their scales
      const int64_t k_bytes = p.kv_dtype == DType::I4 ? p.head_dim / 2 : p.head_dim;
      const int64_t v_bytes = p.kv_dtype == DType::I4 ? p.value_dim / 2 : p.value_dim;
      PrefetchRows(KeyBytes(p, b, g, j), run, p.k_quant.row_stride * step, k_bytes);
      PrefetchRows(ValueBytes(p, b, g, j), run, p.v_quant.row_stride * step, v_bytes);
      PrefetchRows(KeyScales(p, b, g, j), run, p.k_scales.row_stride * step, p.k_scales.row_stride);
      PrefetchRows(ValueScales(p, b, g, j), run, p.v_scales.row_stride * step, p.v_scales.row_stride);
    } else {
      PrefetchRows(KeyRow<T>(p, b, g, j), run, static_cast<int64_t>(KeyRowStride(p)) * step, p.head_dim);
      PrefetchRows(ValueRow<T>(p, b, g, j), run, static_cast<int64_t>(ValueRowStride(p)) * step, p.value_dim);
    }
    j += run * step;
  }
}

// The prefetch distance in keys of type T: the same bytes whatever the element type, so twice
// the keys for 16-bit K/V, four times for int8 and int4 (one byte an element: kv::Int4 holds two).
template <class T>
constexpr int64_t PrefetchAhead() {
  return decode::kPrefetchKeys * static_cast<int64_t>(sizeof(float) / sizeof(T));
}

// Step "scores": S (rows x Bc) = Qs K_tile^T for the keys j0, j0 + step, ... (cols of them; step
// 1 for a tile, the stride for gathered strided keys), keys outer so the kScoreKeys K rows are
// reused from L1 by every row (a lone row reads them key after key: dot_scores::KeyOrder);
// prefetches kPrefetchKeys ahead within [.., end). Past the tile's last key the pointers repeat
// that key (overwritten with -inf later).
template <class T>
void DecodeScores(const AttentionProblem& p, const decode::Plan& plan, int64_t b, int64_t g, size_t rows,
                  const KeyRun& run, const Scratch& w) {
  const int64_t j0 = run.j0, step = run.step, end = run.end;
  const size_t cols = run.cols;
  const size_t dk = static_cast<size_t>(p.head_dim);
  const size_t full_dk = dk / hn::Lanes(DF()) * hn::Lanes(DF());
  // The tile's keys are rows key_step apart (one page of paged K/V: RowBlockOverChunk's cut).
  const T* tile = KeyRow<T>(p, b, g, j0);
  const size_t key_step = KeyRowStride(p) * static_cast<size_t>(step);
  for (size_t j = 0; j < cols; j += kScoreKeys) {
    const int64_t ahead = j0 + (static_cast<int64_t>(j) + PrefetchAhead<T>()) * step;
    if (ahead < end)
      PrefetchKeys<T>(p, b, g, ahead, std::min<int64_t>(ahead + static_cast<int64_t>(kScoreKeys) * step, end), step);
    const T* keys[kScoreKeys];
    for (size_t x = 0; x < kScoreKeys; ++x) keys[x] = tile + std::min(j + x, cols - 1) * key_step;
    if (rows == 1)  // a lone row reads K key after key (dot_scores::KeyOrder)
      dot_scores::ScoreRows<dot_scores::KeyOrder::KeyAfterKey>(rows, dk, full_dk, w.q, plan.q_stride, keys,
                                                               w.scores + j, kKeyTile, 1);
    else
      dot_scores::ScoreRows(rows, dk, full_dk, w.q, plan.q_stride, keys, w.scores + j, kKeyTile, 1);
  }
}

// O += P V_tile over the first full_dv columns in tiles of at most MaxRows x MaxVectors, column
// blocks outer so a block of V's columns is reused from L1 by every row block.
template <size_t MaxRows, size_t MaxVectors, class T>
HWY_INLINE void ValueTiles(const decode::Plan& plan, size_t rows, size_t cols, size_t full_dv,
                           const T* HWY_RESTRICT v_tile, size_t v_stride, const Scratch& w) {
  const size_t lanes = hn::Lanes(DF());
  for (size_t c = 0; c < full_dv; c += MaxVectors * lanes) {
    const size_t vectors = std::min(MaxVectors, (full_dv - c) / lanes);
    for (size_t r = 0; r < rows; r += MaxRows) {
      WithConstant<MaxRows>(std::min(MaxRows, rows - r), [&](auto tile_rows) {
        WithConstant<MaxVectors>(vectors, [&](auto tile_vectors) {
          ValueTile<decltype(tile_rows)::value, decltype(tile_vectors)::value>(
              cols, w.scores + r * kKeyTile, v_tile + c, v_stride, w.out + r * plan.out_stride + c, plan.out_stride);
        });
      });
    }
  }
}

// Step "accumulate": O += P V_tile (ValueTiles; a block of few rows in wider tiles), then the
// columns past the last whole vector. Each output element sums its keys in order whatever the
// tile, so the tile's shape never changes a result.
template <class T>
void DecodeAccumulate(const AttentionProblem& p, const decode::Plan& plan, size_t rows, size_t cols,
                      const T* HWY_RESTRICT v_tile, size_t v_stride, const Scratch& w) {
  const size_t lanes = hn::Lanes(DF());
  const size_t dv = static_cast<size_t>(p.value_dim), full_dv = dv / lanes * lanes;
  bool few = false;
  if constexpr (kFewRowsValueVectors > kValueVectors) {
    few = rows <= kFewValueRows;
    if (few) ValueTiles<kFewValueRows, kFewRowsValueVectors>(plan, rows, cols, full_dv, v_tile, v_stride, w);
  }
  if (!few) ValueTiles<kValueRows, kValueVectors>(plan, rows, cols, full_dv, v_tile, v_stride, w);
  for (size_t r = 0; r < rows; ++r)
    for (size_t c = full_dv; c < dv; ++c) {
      float sum = w.out[r * plan.out_stride + c];
      for (size_t j = 0; j < cols; ++j) sum += w.scores[r * kKeyTile + j] * kv::ToFloat(v_tile[j * v_stride + c]);
      w.out[r * plan.out_stride + c] = sum;
    }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // QKV_ATTENTION_DECODE_TILES_INL_H_
