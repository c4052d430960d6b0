// Decode's per-target loop order (Highway -inl.h, included by decode.cpp once per SIMD target):
// one work item (batch b, K/V head g, key chunk c) runs every row of g's group, R = G x Nq rows
// with G = Hq / Hkv (Plan::head_of, query_of), in blocks of at most kRowBlock, over the chunk's
// keys in tiles of Bc, and leaves per row the partial (m_c, l_c, o_c) for the merge, or with one
// chunk the finished row. Per tile:
//   1. S = Qs K_tile^T (rows x Bc), Qs = scale * Q packed once per item (DecodeScores).
//   2. Masks: the band and key lengths as a per-row key range (a tile every row fully sees does
//      no mask work), tensor terms per element. A `rest | strided(S)` rule (Sparse Transformer's
//      window | strided) runs the tiles on `rest` only, which skips the tiles it hides, and
//      gathers each query's strided keys j = O + i (mod S) as tiles of step S (GatherStrided):
//      a query reads its window and 1 / S of the cache, not every tile.
//   3. Online softmax per row, vectorised along the keys of the tile.
//   4. Dropout, as the reference.
//   5. O += P V_tile (rows x Dv) (DecodeAccumulate).
#if defined(QKV_ATTENTION_DECODE_CHUNK_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_DECODE_CHUNK_INL_H_
#undef QKV_ATTENTION_DECODE_CHUNK_INL_H_
#else
#define QKV_ATTENTION_DECODE_CHUNK_INL_H_
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "attention/decode/plan.hpp"
#include "attention/decode/quantized-inl.h"
#include "attention/decode/tiles-inl.h"
#include "attention/kernels.hpp"
#include "attention/problem.hpp"
#include "attention/steps/pipeline-inl.h"
#include "core/quantize.hpp"
#include "mask/rule.hpp"
#include "qkv/dtype.hpp"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {

// Step 5 for float and 16-bit K/V: O += P V_tile, skipping zero weights when a hidden key's V
// may be NaN or Inf (a 16-bit tile is widened into scratch for that check: masked tiles only).
template <class T>
void AccumulateValues(const AttentionProblem& p, const decode::Plan& plan, int64_t b, int64_t g, size_t rows,
                      const KeyRun& run, bool band, const Scratch& w) {
  const size_t dv = static_cast<size_t>(p.value_dim), cols = run.cols;
  const T* HWY_RESTRICT v_tile = ValueRow<T>(p, b, g, run.j0);
  const size_t v_stride = ValueRowStride(p) * static_cast<size_t>(run.step);
  const bool some_hidden = band || !p.terms.empty() || p.dropout_p > 0;
  if (!some_hidden) return DecodeAccumulate<T>(p, plan, rows, cols, v_tile, v_stride, w);
  const float* wide = nullptr;
  size_t wide_stride = v_stride;
  if constexpr (std::is_same_v<T, float>) {
    wide = v_tile;
  } else {
    for (size_t j = 0; j < cols; ++j)
      convert(v_tile + j * v_stride, p.kv_dtype, w.v_wide + j * plan.out_stride, DType::F32, dv);
    wide = w.v_wide;
    wide_stride = plan.out_stride;
  }
  if (!step::RowsFinite(wide, cols, dv, static_cast<int64_t>(wide_stride))) {
    accumulate_skipping_zeros(rows, cols, dv, w.scores, kKeyTile, 1, wide, static_cast<int64_t>(wide_stride), w.out,
                              plan.out_stride, 1);
  } else {
    DecodeAccumulate<T>(p, plan, rows, cols, v_tile, v_stride, w);
  }
}

// One key tile (KeyRun) for rows [r0, r0 + rows) of group (b, g): scores, modifiers and mask
// per row, the online softmax update, dropout, O += P V. `band`: some key of the tile may be
// hidden from some row (per-element mask work); always so for gathered keys. T: the K/V element
// (float, bf16, f16, int8_t or Int4: quantized-inl.h).
template <class T>
void DecodeKeyTile(const AttentionProblem& p, const decode::Plan& plan, int64_t b, int64_t g, int64_t r0, size_t rows,
                   const KeyRun& run, bool band, const Scratch& w) {
  const size_t cols = run.cols;
  // 1. Scores. 2. Softcap on the whole tile, then ALiBi and the mask, one query's line over the
  // tile's keys at a time; the columns past the tile's last key are hidden after the modifiers
  // (softcap(-inf) is finite).
  if constexpr (std::is_same_v<T, Int4>) {
    Int4Scores(p, plan, b, g, rows, run, w);
  } else {
    DecodeScores<T>(p, plan, b, g, rows, run, w);
  }
  if constexpr (std::is_same_v<T, int8_t>) ScaleColumns(KeyScales, p, b, g, run.j0, run.step, cols, rows, w.scores);
  step::Softcap(p, w.scores, rows * kKeyTile);
  for (size_t r = 0; r < rows; ++r) {
    const RowCoords row = RowOf(plan, g, r0 + static_cast<int64_t>(r));
    const step::Line line{b, row.h, row.i, run.j0, 0, run.step};
    // 3. Online softmax of the row. Gathered strided keys (band is true for them) hide what
    // `rest` shows: the tiles visit it.
    RowSoftmaxStep(p, plan, line, cols, band, run.gathered_rest, w, r);
    // 4. Dropout on P.
    if (p.dropout_p > 0) step::Dropout(p, line, w.scores + r * kKeyTile, cols);
  }
  // 5. O += P V_tile. Quantized values are integers times finite scales, never NaN or inf.
  if constexpr (std::is_same_v<T, Int4>) {
    Int4Accumulate(p, plan, b, g, rows, run, w);
  } else if constexpr (std::is_same_v<T, int8_t>) {
    ScaleColumns(ValueScales, p, b, g, run.j0, run.step, cols, rows, w.scores);
    DecodeAccumulate<T>(p, plan, rows, cols, ValueRow<T>(p, b, g, run.j0),
                        ValueRowStride(p) * static_cast<size_t>(run.step), w);
  } else {
    AccumulateValues<T>(p, plan, b, g, rows, run, band, w);
  }
}

// How the mask's rule treats keys [j0, j0 + cols) for rows [r0, r0 + rows) of group (b, g):
// hidden from every row, fully visible to every row, or partial.
TileVisibility RuleTileOfRows(const AttentionProblem& p, const decode::Plan& plan, int64_t b, int64_t g, int64_t r0,
                              size_t rows, int64_t j0, size_t cols) {
  bool any = false, all = true;
  for (size_t r = 0; r < rows; ++r) {
    const RowCoords row = RowOf(plan, g, r0 + static_cast<int64_t>(r));
    const TileVisibility v = p.rule.classify(b, row.h, row.i, row.i, j0, j0 + static_cast<int64_t>(cols) - 1);
    any = any || v != TileVisibility::Hidden;
    all = all && v == TileVisibility::Full;
  }
  return !any ? TileVisibility::Hidden : (all ? TileVisibility::Full : TileVisibility::Partial);
}

// The strided keys of a `rest | strided(S, O)` rule (StridedSplit, mask/rule.hpp) within
// [chunk_begin, chunk_end), gathered per query: the rows of query i (contiguous, Plan::query_of)
// see the keys j = O + i (mod S) inside the band and key lengths, read as tiles of step S into the
// same online softmax as the tiles, which visit what `rest` shows. Never reads another key.
template <class T>
void GatherStrided(const AttentionProblem& p, const decode::Plan& plan, const StridedSplit& split, int64_t b, int64_t g,
                   int64_t r0, size_t rows, int64_t chunk_begin, int64_t chunk_end, const Scratch& w) {
  for (size_t r = 0; r < rows;) {
    const int64_t i = plan.query_of(r0 + static_cast<int64_t>(r));
    size_t next = r + 1;
    while (next < rows && plan.query_of(r0 + static_cast<int64_t>(next)) == i) ++next;
    const int64_t lo = std::max(chunk_begin, p.first_visible_key(i));
    const int64_t hi = std::min(chunk_end, p.last_visible_key(b, i));
    const int64_t first = lo + floor_mod(split.offset + i - lo, split.stride);
    const int64_t keys = first < hi ? (hi - 1 - first) / split.stride + 1 : 0;
    for (int64_t t = 0; t < keys; t += static_cast<int64_t>(kKeyTile)) {
      const KeyRun run{first + t * split.stride, split.stride,
                       static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(kKeyTile), keys - t)), hi, split.rest};
      DecodeKeyTile<T>(p, plan, b, g, r0 + static_cast<int64_t>(r), next - r, run, true, w.from_row(plan, r));
    }
    r = next;
  }
}

// One pass of a row block over one chunk: rows [r0, r0 + rows) of item (b, g, chunk), keys
// [chunk_begin, chunk_end). Leaves O, running max and sum of the block in `scratch`; the first
// chunk starts each row's softmax with its sink, if any. `split`: the strided keys to gather
// (p.rule's root is then `rest`), or nullptr.
template <class T>
void RowBlockOverChunk(const AttentionProblem& p, const decode::Plan& plan, const StridedSplit* split, int64_t b,
                       int64_t g, int64_t r0, size_t rows, int64_t chunk_begin, int64_t chunk_end,
                       float* HWY_RESTRICT scratch) {
  const Scratch w(scratch, decode::ScratchLayout(plan));

  // ---- Set up: O = 0, the softmax started; the key range [begin, end) some row of the block
  // sees within the chunk, and the range every row sees (a tile inside it needs no band work).
  std::fill_n(w.out, rows * plan.out_stride, 0.0f);
  int64_t begin = chunk_end, end = chunk_begin;
  int64_t all_begin = chunk_begin, all_end = chunk_end;
  for (size_t r = 0; r < rows; ++r) {
    const RowCoords row = RowOf(plan, g, r0 + static_cast<int64_t>(r));
    StartRow(p, row.h, chunk_begin, w, r);
    const int64_t first = p.first_visible_key(row.i), last = p.last_visible_key(b, row.i);
    begin = std::min(begin, std::max(first, chunk_begin));
    end = std::max(end, std::min(last, chunk_end));
    all_begin = std::max(all_begin, first);
    all_end = std::min(all_end, last);
  }
  if (begin >= end) return;  // the chunk is hidden from every row: K and V are never read

  // Qs = scale * Q, packed once per pass (not per tile).
  for (size_t r = 0; r < rows; ++r) {
    const RowCoords row = RowOf(plan, g, r0 + static_cast<int64_t>(r));
    PackQuery(p, plan, b, row.h, row.i, w, r);
  }
  // The keys the running prefetch (DecodeScores) never reaches, the chunk's first PrefetchAhead,
  // requested together so their misses overlap (docs/performance-log.md). Not
  // under a rule, whose first tiles may be hidden and never read.
  if (p.rule.empty()) PrefetchKeys<T>(p, b, g, begin, std::min(end, begin + PrefetchAhead<T>()), 1);
  // Tiles of Bc keys; paged K/V's also end where a page does (a tile is then rows of one page).
  for (int64_t j0 = begin, cols = 0; j0 < end; j0 += cols) {
    const int64_t tile_end = std::min(end, p.paged.on() ? p.paged.page_end(j0) : end);
    cols = std::min<int64_t>(static_cast<int64_t>(kKeyTile), tile_end - j0);
    bool band = !(all_begin <= j0 && j0 + cols <= all_end);
    if (!p.rule.empty()) {  // the rule's view of the tile: skipped when it hides it from every row
      const TileVisibility rule = RuleTileOfRows(p, plan, b, g, r0, rows, j0, static_cast<size_t>(cols));
      if (rule == TileVisibility::Hidden) continue;
      band = band || rule == TileVisibility::Partial;
    }
    DecodeKeyTile<T>(p, plan, b, g, r0, rows, {j0, 1, static_cast<size_t>(cols), end, -1}, band, w);
  }
  if (split) GatherStrided<T>(p, plan, *split, b, g, r0, rows, chunk_begin, chunk_end, w);
}

// Whether the scales of quantized K and V for keys [begin, end) of head (b, g) are valid
// (scales_valid, core/quantize.hpp): a contiguous run when the rows' scales are back to back.
inline bool ChunkScalesValid(const AttentionProblem& p, int64_t b, int64_t g, int64_t begin, int64_t end) {
  const auto valid = [&](const Rows<const float>& scales, int64_t dim) {
    const int64_t groups = quantized_groups(p.kv_dtype, dim);
    if (scales.row_stride == groups) return scales_valid(scales.row(b, g, begin), (end - begin) * groups, p.kv_dtype);
    for (int64_t j = begin; j < end; ++j)
      if (!scales_valid(scales.row(b, g, j), groups, p.kv_dtype)) return false;
    return true;
  };
  return valid(p.k_scales, p.head_dim) && valid(p.v_scales, p.value_dim);
}

// One work item: every row of group g of batch b against chunk `chunk`. With one chunk per
// (b, g) it writes the final output, lse and row stats; with several it leaves its partials for
// the merge. `scratch` is this worker's block, laid out by decode::ScratchLayout. `bad_scales`
// (p.scales_unchecked): set when the chunk's scales are not all valid, checked first, whether or
// not the mask lets a row read them, so that every scale of the call is checked once; the tiles
// then find them in cache. The item still runs: the call throws afterwards (dispatch.cpp), and
// what it wrote to the outputs is garbage.
void DecodeChunk(const AttentionProblem& p, const decode::Plan& plan, const StridedSplit* split, int64_t b, int64_t g,
                 int64_t chunk, const decode::Partials& partials, float* HWY_RESTRICT scratch,
                 std::atomic<bool>* bad_scales) {
  const Scratch w(scratch, decode::ScratchLayout(plan));
  const int64_t chunk_begin = chunk * plan.chunk_keys;
  const int64_t chunk_end = std::min(p.kv_len, chunk_begin + plan.chunk_keys);
  const int64_t bg = b * p.kv_heads + g;
  if (bad_scales && !ChunkScalesValid(p, b, g, chunk_begin, chunk_end)) bad_scales->store(true, std::memory_order_relaxed);

  for (int64_t r0 = 0; r0 < plan.rows; r0 += static_cast<int64_t>(kRowBlock)) {
    const size_t rows = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(kRowBlock), plan.rows - r0));
    switch (p.kv_dtype) {  // 16-bit K and V read in their own element type, never widened to memory
      case DType::F32: RowBlockOverChunk<float>(p, plan, split, b, g, r0, rows, chunk_begin, chunk_end, scratch); break;
      case DType::BF16:
        RowBlockOverChunk<hwy::bfloat16_t>(p, plan, split, b, g, r0, rows, chunk_begin, chunk_end, scratch);
        break;
      case DType::F16:
        RowBlockOverChunk<hwy::float16_t>(p, plan, split, b, g, r0, rows, chunk_begin, chunk_end, scratch);
        break;
      case DType::I8:  // read in place as T = int8_t, widened in registers; the scales on S and P
        RowBlockOverChunk<int8_t>(p, plan, split, b, g, r0, rows, chunk_begin, chunk_end, scratch);
        break;
      case DType::I4:  // read in place, unpacked in registers (quantized-inl.h)
        RowBlockOverChunk<Int4>(p, plan, split, b, g, r0, rows, chunk_begin, chunk_end, scratch);
        break;
    }
    for (size_t r = 0; r < rows; ++r) {
      const RowCoords row = RowOf(plan, g, r0 + static_cast<int64_t>(r));
      EndRow(p, plan, partials, b, row.h, row.i, (bg * plan.chunks + chunk) * plan.rows + r0 + static_cast<int64_t>(r),
             w.out + r * plan.out_stride, w.running_max[r], w.row_sum[r]);
    }
  }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // QKV_ATTENTION_DECODE_CHUNK_INL_H_
