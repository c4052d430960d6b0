// Paged K/V read page-major (Highway -inl.h, included by decode.cpp once per SIMD target; when:
// decode::page_major_fits and Plan::page_major). One work item (batch b, key chunk c) runs the
// row of every query head (one query) over the chunk's keys in tiles that end where a page does,
// and leaves per row the partial (m_c, l_c, o_c) for decode.cpp's merge, or with one chunk the
// finished row. Per tile, the steps of chunk-inl.h's DecodeKeyTile in its order:
//   1. S = Qs K^T in blocks of kScoreKeys keys, every K/V head over a block in turn, on decode's
//      score tile (dot_scores::ScoreRows; int8 K scaled as quantized-inl.h scales it): a score is
//      the (b, g, chunk) item's, bit for bit;
//   2. softcap on the tile, ALiBi per row (a row sees every key of the tile: no band, rule or term);
//   3. the online softmax per row (SoftmaxRowUpdate), O moved to the new max;
//   4. O += P V in the same blocks, every head in turn (DecodeAccumulate's value tile).
// A block's rows of every head are a few runs of a page, read in the pool's order; K and V are
// prefetched kPageMajorAheadBytes ahead, block by block, across pages. Qs, S and O of every head stay in L1 / L2
// (plan.hpp, kPageMajorMaxRows).
#if defined(QKV_ATTENTION_DECODE_PAGE_MAJOR_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_DECODE_PAGE_MAJOR_INL_H_
#undef QKV_ATTENTION_DECODE_PAGE_MAJOR_INL_H_
#else
#define QKV_ATTENTION_DECODE_PAGE_MAJOR_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "attention/decode/plan.hpp"
#include "attention/decode/quantized-inl.h"
#include "attention/decode/tiles-inl.h"
#include "attention/problem.hpp"
#include "attention/steps/dot_scores-inl.h"
#include "attention/steps/pipeline-inl.h"
#include "qkv/dtype.hpp"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {

// Row r of a page-major item is query head r (its one query); head h's rows read K/V head h / G.

// One side of the item, K or V: key j's row of head 0 (any key of the chunk: its page looked up),
// head g's a further g head_stride elements on, `width` elements each; for int8, key j's scales
// of every head, `scale_floats` floats.
template <class T>
struct Side {
  const T* (*row_of)(const AttentionProblem&, int64_t, int64_t, int64_t);
  const float* (*scales_of)(const AttentionProblem&, int64_t, int64_t, int64_t);
  size_t head_stride, width, scale_floats;
};
// The side of K (values false) or of V.
template <class T>
HWY_INLINE Side<T> SideOf(const AttentionProblem& p, bool values) {
  const auto& floats = values ? p.v : p.k;
  const auto& bits = values ? p.v_bits : p.k_bits;
  const auto& quant = values ? p.v_quant : p.k_quant;
  const bool quantized = is_quantized(p.kv_dtype);
  const int64_t head_stride =
      quantized ? quant.head_stride : (p.kv_dtype == DType::F32 ? floats.head_stride : bits.head_stride);
  return {values ? ValueRow<T> : KeyRow<T>, values ? ValueScales : KeyScales, static_cast<size_t>(head_stride),
          static_cast<size_t>(values ? p.value_dim : p.head_dim),
          quantized ? static_cast<size_t>((values ? p.v_scales : p.k_scales).row_stride) : 0};
}

// The prefetch distance in keys: kPageMajorAheadBytes of every head's rows, whole blocks, at
// least one.
HWY_INLINE int64_t PageMajorAhead(const AttentionProblem& p) {
  const int64_t key_bytes =
      p.kv_heads * std::max(p.head_dim, p.value_dim) * static_cast<int64_t>(element_size(p.kv_dtype));
  const int64_t blocks = decode::kPageMajorAheadBytes / (key_bytes * static_cast<int64_t>(kScoreKeys));
  return static_cast<int64_t>(kScoreKeys) * std::max<int64_t>(1, blocks);
}

// Every head's rows (and scales) of keys [first, last) of one side into L2, at once: the first
// keys of an item, which no running prefetch reaches.
template <class T>
HWY_INLINE void PrefetchSide(const AttentionProblem& p, int64_t b, const Side<T>& side, int64_t first, int64_t last) {
  for (int64_t key = first; key < last; ++key) {
    const T* row = side.row_of(p, b, 0, key);
    for (int64_t g = 0; g < p.kv_heads; ++g)
      PrefetchRange(row + static_cast<size_t>(g) * side.head_stride, row + static_cast<size_t>(g) * side.head_stride + side.width);
    if (side.scale_floats > 0) {
      const float* scales = side.scales_of(p, b, 0, key);
      PrefetchRange(scales, scales + side.scale_floats);
    }
  }
}

// Steps 1 and 4 over one side of the tile [j0, j0 + cols): for each block of kScoreKeys keys, the
// scales (int8) of the block `ahead` keys on are prefetched, then every K/V head g in turn
// prefetches its rows of that block (into the next page when the tile ends; never a key at or
// past `end`, one past the item's last visible key) and runs block(g, j, keys in the block).
template <class T, class Block>
HWY_INLINE void EveryHeadByBlocks(const AttentionProblem& p, int64_t b, const Side<T>& side, int64_t j0, size_t cols,
                                  int64_t end, int64_t ahead, const Block& block) {
  for (size_t j = 0; j < cols; j += kScoreKeys) {
    const T* next[kScoreKeys];
    size_t count = 0;
    for (int64_t key = j0 + static_cast<int64_t>(j) + ahead; count < kScoreKeys && key < end; ++key, ++count) {
      next[count] = side.row_of(p, b, 0, key);
      if (side.scale_floats > 0) {
        const float* scales = side.scales_of(p, b, 0, key);
        PrefetchRange(scales, scales + side.scale_floats);
      }
    }
    for (int64_t g = 0; g < p.kv_heads; ++g) {
      for (size_t x = 0; x < count; ++x) {
        const T* row = next[x] + static_cast<size_t>(g) * side.head_stride;
        PrefetchRange(row, row + side.width);
      }
      block(g, j, std::min(kScoreKeys, cols - j));
    }
  }
}

// One pass of every row over keys [chunk_begin, chunk_end) of batch b: leaves O, running max and
// sum in `w`; the first chunk starts each row's softmax with its sink, if any.
template <class T>
void RowsPageMajor(const AttentionProblem& p, const decode::Plan& plan, int64_t b, int64_t chunk_begin,
                   int64_t chunk_end, const Scratch& w) {
  constexpr bool int8 = std::is_same_v<T, int8_t>;
  const size_t rows = static_cast<size_t>(plan.block_rows), group = static_cast<size_t>(plan.group);
  const size_t dk = static_cast<size_t>(p.head_dim);
  const size_t full_dk = dk / hn::Lanes(DF()) * hn::Lanes(DF());
  std::fill_n(w.out, rows * plan.out_stride, 0.0f);
  for (size_t r = 0; r < rows; ++r) StartRow(p, static_cast<int64_t>(r), chunk_begin, w, r);
  // The keys the band and key lengths show the one query, the same for every row.
  const int64_t begin = std::max(chunk_begin, p.first_visible_key(0));
  const int64_t end = std::min(chunk_end, p.last_visible_key(b, 0));
  if (begin >= end) return;  // K and V are never read
  for (size_t r = 0; r < rows; ++r) PackQuery(p, plan, b, static_cast<int64_t>(r), 0, w, r);
  const int64_t ahead = PageMajorAhead(p);
  const Side<T> k_side = SideOf<T>(p, false), v_side = SideOf<T>(p, true);
  PrefetchSide(p, b, k_side, begin, std::min(end, begin + ahead));
  for (int64_t j0 = begin, cols = 0; j0 < end; j0 += cols) {
    cols = std::min<int64_t>(static_cast<int64_t>(kKeyTile), std::min(end, p.paged.page_end(j0)) - j0);
    const size_t n = static_cast<size_t>(cols);
    // 1. Scores; past the tile's last key the pointers repeat that key (overwritten with -inf).
    // int8: on the integers, the keys' scales then on the score columns (quantized-inl.h).
    const T* k_tile = KeyRow<T>(p, b, 0, j0);
    const size_t key_stride = KeyRowStride(p);
    EveryHeadByBlocks(p, b, k_side, j0, n, end, ahead, [&](int64_t g, size_t j, size_t keys_in_block) {
      const T* keys[kScoreKeys];
      for (size_t x = 0; x < kScoreKeys; ++x)
        keys[x] = k_tile + std::min(j + x, n - 1) * key_stride + static_cast<size_t>(g) * k_side.head_stride;
      const size_t r0 = static_cast<size_t>(g) * group;
      float* HWY_RESTRICT s = w.scores + r0 * kKeyTile + j;
      dot_scores::ScoreRows(group, dk, full_dk, w.q + r0 * plan.q_stride, plan.q_stride, keys, s, kKeyTile, 1);
      if constexpr (int8) ScaleColumns(KeyScales, p, b, g, j0 + static_cast<int64_t>(j), 1, keys_in_block, group, s);
    });
    if (j0 == begin) PrefetchSide(p, b, v_side, begin, std::min(end, begin + ahead));  // while S is finished
    // 2. Modifiers: softcap on the tile, ALiBi per row (every row sees the whole tile: no band).
    // 3. The online softmax of each row.
    step::Softcap(p, w.scores, rows * kKeyTile);
    for (size_t r = 0; r < rows; ++r)
      RowSoftmaxStep(p, plan, step::Line{b, static_cast<int64_t>(r), 0, j0, 0, 1}, n, false, -1, w, r);
    // 4. O += P V, the G rows of head g on its value rows (int8: the values' scales folded into
    // P's columns first, which nothing reads after). Quantized values are integers times finite
    // scales, never NaN or inf; float and 16-bit ones are not checked either, as the (b, g, chunk)
    // items do not check a tile every row sees.
    const T* v_tile = ValueRow<T>(p, b, 0, j0);
    const size_t value_stride = ValueRowStride(p);
    EveryHeadByBlocks(p, b, v_side, j0, n, end, ahead, [&](int64_t g, size_t j, size_t keys) {
      Scratch rows_of_g = w.from_row(plan, static_cast<size_t>(g) * group);
      rows_of_g.scores += j;
      if constexpr (int8) ScaleColumns(ValueScales, p, b, g, j0 + static_cast<int64_t>(j), 1, keys, group, rows_of_g.scores);
      DecodeAccumulate<T>(p, plan, group, keys, v_tile + j * value_stride + static_cast<size_t>(g) * v_side.head_stride,
                          value_stride, rows_of_g);
    });
  }
}

// One page-major work item: every row of batch b against chunk `chunk`. With one chunk it writes
// the final output, lse and row stats; with several it leaves its partials for the merge.
// `scratch` is this worker's block, laid out by decode::ScratchLayout.
void DecodePageMajor(const AttentionProblem& p, const decode::Plan& plan, int64_t b, int64_t chunk,
                     const decode::Partials& partials, float* HWY_RESTRICT scratch) {
  const Scratch w(scratch, decode::ScratchLayout(plan));
  const int64_t chunk_begin = chunk * plan.chunk_keys;
  const int64_t chunk_end = std::min(p.kv_len, chunk_begin + plan.chunk_keys);
  switch (p.kv_dtype) {  // 16-bit K and V read in their own element type, never widened to memory
    case DType::F32: RowsPageMajor<float>(p, plan, b, chunk_begin, chunk_end, w); break;
    case DType::BF16: RowsPageMajor<hwy::bfloat16_t>(p, plan, b, chunk_begin, chunk_end, w); break;
    case DType::F16: RowsPageMajor<hwy::float16_t>(p, plan, b, chunk_begin, chunk_end, w); break;
    case DType::I8: RowsPageMajor<int8_t>(p, plan, b, chunk_begin, chunk_end, w); break;
    case DType::I4: HWY_ASSERT(false);  // decode::page_major_fits: not int4
  }
  for (int64_t h = 0; h < p.q_heads; ++h) {  // row h % G of (b, h / G), as the merge reads it
    const size_t r = static_cast<size_t>(h);
    EndRow(p, plan, partials, b, h, 0, ((b * p.kv_heads + h / plan.group) * plan.chunks + chunk) * plan.rows + h % plan.group,
           w.out + r * plan.out_stride, w.running_max[r], w.row_sum[r]);
  }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // QKV_ATTENTION_DECODE_PAGE_MAJOR_INL_H_
