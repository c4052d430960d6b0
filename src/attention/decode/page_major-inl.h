// Paged K/V read page-major (Highway -inl.h, included by decode.cpp once per SIMD target; when:
// decode::page_major_fits and Plan::page_major). One work item (batch b, key chunk c) runs the
// row of every query head (one query) over the chunk's keys in tiles that end where a page does,
// and leaves per row the partial (m_c, l_c, o_c) for decode.cpp's merge, or with one chunk the
// finished row. Per tile, the steps of chunk-inl.h's DecodeKeyTile in its order:
//   1. S = Qs K^T in blocks of kScoreKeys keys, every K/V head over a block in turn, on decode's
//      score tile (dot_scores::ScoreRows): a score is the (b, g, chunk) item's, bit for bit;
//   2. softcap on the tile, ALiBi per row (a row sees every key of the tile: no band, rule or term);
//   3. the online softmax per row (SoftmaxRowUpdate), O moved to the new max;
//   4. O += P V in the same blocks, every head in turn (DecodeAccumulate's value tile).
// A block's rows of every head are a few runs of a page, read in the pool's order; K and V are
// prefetched kPageMajorAheadBytes ahead, block by block. Qs, S and O of every head stay in L1 / L2
// (plan.hpp, kPageMajorMaxRows).
#if defined(QKV_ATTENTION_DECODE_PAGE_MAJOR_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_DECODE_PAGE_MAJOR_INL_H_
#undef QKV_ATTENTION_DECODE_PAGE_MAJOR_INL_H_
#else
#define QKV_ATTENTION_DECODE_PAGE_MAJOR_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "attention/decode/plan.hpp"
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

// One side of a tile, K or V: the page's rows of the tile's keys (key j of the tile at
// row + j key_stride, head g a further g head_stride on), `width` elements each.
template <class T>
struct PageRows {
  const T* row;
  size_t key_stride, head_stride, width;

  const T* at(size_t j, int64_t g) const { return row + j * key_stride + static_cast<size_t>(g) * head_stride; }
  // Head g's rows of keys [first, last) into L2 (locality hint 2: prefetcht1 on x86).
  void Prefetch(size_t first, size_t last, int64_t g) const {
    for (size_t j = first; j < last; ++j) {
      const char* line = reinterpret_cast<const char*>(at(j, g));
      for (size_t c = 0; c < width * sizeof(T); c += 64) __builtin_prefetch(line + c, 0, 2);
    }
  }
};
template <class T>
HWY_INLINE PageRows<T> KeyRows(const AttentionProblem& p, int64_t b, int64_t j0) {
  return {KeyRow<T>(p, b, 0, j0), KeyRowStride(p),
          static_cast<size_t>(p.kv_dtype == DType::F32 ? p.k.head_stride : p.k_bits.head_stride),
          static_cast<size_t>(p.head_dim)};
}
template <class T>
HWY_INLINE PageRows<T> ValueRows(const AttentionProblem& p, int64_t b, int64_t j0) {
  return {ValueRow<T>(p, b, 0, j0), ValueRowStride(p),
          static_cast<size_t>(p.kv_dtype == DType::F32 ? p.v.head_stride : p.v_bits.head_stride),
          static_cast<size_t>(p.value_dim)};
}

// The prefetch distance in keys: kPageMajorAheadBytes of every head's rows, whole blocks, at
// least one.
HWY_INLINE size_t PageMajorAhead(const AttentionProblem& p) {
  const int64_t key_bytes =
      p.kv_heads * std::max(p.head_dim, p.value_dim) * static_cast<int64_t>(element_size(p.kv_dtype));
  const int64_t blocks = decode::kPageMajorAheadBytes / (key_bytes * static_cast<int64_t>(kScoreKeys));
  return kScoreKeys * static_cast<size_t>(std::max<int64_t>(1, blocks));
}

// Steps 1 and 4 over one side of the tile (cols keys): for each block of kScoreKeys keys, every
// K/V head g in turn prefetches its rows `ahead` keys on and runs block(g, j, keys in the block).
template <class T, class Block>
HWY_INLINE void EveryHeadByBlocks(const AttentionProblem& p, const PageRows<T>& rows, size_t cols, size_t ahead,
                                  const Block& block) {
  for (size_t j = 0; j < cols; j += kScoreKeys) {
    const size_t keys = std::min(kScoreKeys, cols - j);
    const size_t next = std::min(cols, j + ahead), next_end = std::min(cols, j + ahead + kScoreKeys);
    for (int64_t g = 0; g < p.kv_heads; ++g) {
      rows.Prefetch(next, next_end, g);
      block(g, j, keys);
    }
  }
}

// One pass of every row over keys [chunk_begin, chunk_end) of batch b: leaves O, running max and
// sum in `w`; the first chunk starts each row's softmax with its sink, if any.
template <class T>
void RowsPageMajor(const AttentionProblem& p, const decode::Plan& plan, int64_t b, int64_t chunk_begin,
                   int64_t chunk_end, const Scratch& w) {
  const size_t rows = static_cast<size_t>(plan.block_rows), group = static_cast<size_t>(plan.group);
  const size_t dk = static_cast<size_t>(p.head_dim);
  const size_t full_dk = dk / hn::Lanes(DF()) * hn::Lanes(DF());
  std::fill_n(w.out, rows * plan.out_stride, 0.0f);
  for (size_t r = 0; r < rows; ++r) {
    w.running_max[r] = chunk_begin == 0 ? step::InitialMax(p, static_cast<int64_t>(r)) : step::kMinusInf;
    w.row_sum[r] = chunk_begin == 0 ? step::InitialSum(p) : 0.0f;
  }
  // The keys the band and key lengths show the one query, the same for every row.
  const int64_t begin = std::max(chunk_begin, p.first_visible_key(0));
  const int64_t end = std::min(chunk_end, p.last_visible_key(b, 0));
  if (begin >= end) return;  // K and V are never read
  for (size_t r = 0; r < rows; ++r) {
    const float* q = p.q.row(b, static_cast<int64_t>(r), 0);
    for (size_t d = 0; d < dk; ++d) w.q[r * plan.q_stride + d] = p.scale * q[d];
  }
  const size_t ahead = PageMajorAhead(p);
  for (int64_t j0 = begin, cols = 0; j0 < end; j0 += cols) {
    cols = std::min<int64_t>(static_cast<int64_t>(kKeyTile), std::min(end, p.paged.page_end(j0)) - j0);
    const size_t n = static_cast<size_t>(cols);
    // 1. Scores; past the tile's last key the pointers repeat that key (overwritten with -inf).
    const PageRows<T> k = KeyRows<T>(p, b, j0);
    EveryHeadByBlocks(p, k, n, ahead, [&](int64_t g, size_t j, size_t) {
      const T* keys[kScoreKeys];
      for (size_t x = 0; x < kScoreKeys; ++x) keys[x] = k.at(std::min(j + x, n - 1), g);
      const size_t r0 = static_cast<size_t>(g) * group;
      dot_scores::ScoreRows(group, dk, full_dk, w.q + r0 * plan.q_stride, plan.q_stride, keys,
                            w.scores + r0 * kKeyTile + j, kKeyTile, 1);
    });
    // 2. Modifiers. 3. The online softmax of each row.
    step::Softcap(p, w.scores, rows * kKeyTile);
    for (size_t r = 0; r < rows; ++r) {
      float* HWY_RESTRICT s = w.scores + r * kKeyTile;
      if (p.alibi_slopes)
        step::ScoresToLogits(p, step::Line{b, static_cast<int64_t>(r), 0, j0, 0, 1}, s, kKeyTile, n, false);
      std::fill(s + n, s + kKeyTile, step::kMinusInf);
      const float factor = step::SoftmaxRowUpdate(s, kKeyTile, w.running_max[r], w.row_sum[r]);
      if (factor != 1.0f)
        for (size_t c = 0; c < plan.out_stride; ++c) w.out[r * plan.out_stride + c] *= factor;
    }
    // 4. O += P V, the G rows of head g on its value rows.
    const PageRows<T> v = ValueRows<T>(p, b, j0);
    EveryHeadByBlocks(p, v, n, ahead, [&](int64_t g, size_t j, size_t keys) {
      Scratch rows_of_g = w.from_row(plan, static_cast<size_t>(g) * group);
      rows_of_g.scores += j;
      DecodeAccumulate<T>(p, plan, group, keys, v.at(j, g), v.key_stride, rows_of_g);
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
    default: HWY_ASSERT(false);  // decode::page_major_fits: float and 16-bit K/V only
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
