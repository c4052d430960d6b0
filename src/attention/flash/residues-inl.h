// The strided keys of a `rest | strided(S, O)` rule (StridedSplit, mask/rule.hpp, S >= Bc),
// gathered by residues for the flash forward and backward. A stride leaves one visible key per
// query in many key tiles, so those keys are computed apart: queries r, r + S, ... all meet keys
// kr, kr + S, ... (kr = r + O mod S), a dense block that runs as flash tiles of lines with steps
// (S, 0) (queries S apart in the lanes), residue tiles of ResidueTileRows() queries, which every
// pipeline step reads. A residue hides what `rest` shows, so no pair counts twice.
//   forward: the residues run first and leave each row's softmax state (unnormalised O, max and
//     sum, which a NaN score has made NaN) in the output rows, row_max and row_sum; the tiles
//     then evaluate `rest` (a band rest folded into the band) and start each row from it.
//   backward: the tiles run on `rest` first, then the residues add their pairs into dQ, dK, dV
//     (items own a (b, g)'s residues, so their rows).
// Both deal their items as kResiduesPerItem residues of one head (for_each_residue_item), and
// both find a residue tile's keys and mask the same way (ResidueTileMask). The per-tile body is
// the kernel's own (a template argument: inlined, no call through a pointer).
//
// Included inside a Highway foreach_target pass (the -inl.h convention), after products-inl.h;
// its first part (the items) is plain C++, included once.
#ifndef QKV_ATTENTION_FLASH_RESIDUES_ONCE
#define QKV_ATTENTION_FLASH_RESIDUES_ONCE
#include <algorithm>
#include <cstdint>

#include "attention/flash/layout.hpp"
#include "attention/launch.hpp"
#include "attention/problem.hpp"

namespace qkv::detail::flash {

// body(b, head, first, last) for every item of a strided pass: residues [first, last) (at most
// kResiduesPerItem of them, so that each residue's rows are fetched during the last one's work)
// of head `head` of `heads` in batch b.
template <class Body>
void for_each_residue_item(const Launch& launch, const AttentionProblem& p, int64_t stride, int64_t heads,
                           const Body& body) {
  const int64_t residues = std::min(stride, p.q_len);
  const int64_t groups = (residues + kResiduesPerItem - 1) / kResiduesPerItem;
  launch.for_each(p.batch * heads * groups, [&](int64_t item) {
    const int64_t bh = item / groups, first = item % groups * kResiduesPerItem;
    body(bh / heads, bh % heads, first, std::min(residues, first + kResiduesPerItem));
  });
}

}  // namespace qkv::detail::flash
#endif  // QKV_ATTENTION_FLASH_RESIDUES_ONCE

#if defined(QKV_ATTENTION_FLASH_RESIDUES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_FLASH_RESIDUES_INL_H_
#undef QKV_ATTENTION_FLASH_RESIDUES_INL_H_
#else
#define QKV_ATTENTION_FLASH_RESIDUES_INL_H_
#endif

#include "attention/flash/products-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace flash_steps {

// The mask of a residue tile's pairs with the residue keys j0 .. j_last (S apart): false when
// there are none to compute (the band hides them all, or `rest` shows them all: the tiles did).
HWY_INLINE bool ResidueTileMask(const AttentionProblem& p, const StridedSplit& split, int64_t b, int64_t h,
                                int64_t i0, int64_t i_last, int64_t j0, int64_t j_last, step::TileMask* mask) {
  const step::TileClass band = step::ClassifyTile(p, b, i0, i_last, j0, j_last + 1);
  const TileVisibility rest = p.rule.classify(b, h, i0, i_last, j0, j_last, split.rest);
  if (band == step::TileClass::Hidden || rest == TileVisibility::Full) return false;
  *mask = {band != step::TileClass::Full, rest == TileVisibility::Partial ? split.rest : -1};
  return true;
}

// The residue keys (counted in the residue: key residue + c S) that the band lets some query of
// the residue tile i0 .. i_last see: [first, second).
HWY_INLINE std::pair<int64_t, int64_t> VisibleResidueKeys(const AttentionProblem& p, const StridedSplit& split,
                                                         int64_t b, int64_t i0, int64_t i_last) {
  const int64_t residue = split.key_residue(i0);
  return {split.keys_before(residue, p.first_visible_key(i0)), split.keys_before(residue, p.last_visible_key(b, i_last))};
}

// ---- Forward.

// One residue tile: queries i0 + x S (x < rows <= ResidueTileRows()) of head (b, h), its keys by
// tiles from the last: first one of br keys (under causal, the block on the diagonal, the only
// one to mask), then of Bc; key_tile(walk, tile, mask) runs each. Leaves the rows' softmax state
// in the outputs.
template <class KeyTile>
void ForwardResidueTile(const AttentionProblem& p, const StridedSplit& split, int64_t b, int64_t h, int64_t i0,
                        size_t rows, const ForwardScratch& w, const KeyTile& key_tile) {
  const size_t br = step::ResidueTileRows(), dv = static_cast<size_t>(p.value_dim);
  const int64_t stride = split.stride, residue = split.key_residue(i0);
  const int64_t i_last = i0 + static_cast<int64_t>(rows - 1) * stride;
  StartQueryTile(p, b, h, i0, stride, rows, br, w);
  const auto [c_begin, c_end] = VisibleResidueKeys(p, split, b, i0, i_last);
  for (int64_t c_hi = c_end, width = static_cast<int64_t>(br); c_hi > c_begin; c_hi -= width, width = kKeyTile) {
    const int64_t c_lo = std::max(c_begin, c_hi - width);
    const int64_t j0 = residue + c_lo * stride, j_last = residue + (c_hi - 1) * stride;
    step::TileMask mask;
    if (!ResidueTileMask(p, split, b, h, i0, i_last, j0, j_last, &mask)) continue;
    key_tile(step::Walk{stride, stride, true}, TileAt{b, h, p.kv_head_of(h), i0, rows, j0, static_cast<size_t>(c_hi - c_lo)},
             mask);
  }
  const int64_t row0 = (b * p.q_heads + h) * p.q_len;
  step::UnpackTransposed(w.out_t, br, rows, dv, nullptr, step::EveryStepRows(p.output, i0, stride), b, h, 0);
  for (size_t x = 0; x < rows; ++x) {
    const int64_t i = i0 + static_cast<int64_t>(x) * stride;
    p.row_max[row0 + i] = w.running_max[x];
    p.row_sum[row0 + i] = w.row_sum[x];
  }
}

// Prefetches what the residue tile of queries i0 + x S (x < rows) reads first: its Q rows, the
// rows of O it writes, and the K and V rows of its last br keys (under causal, the new ones).
inline void PrefetchResidueTile(const AttentionProblem& p, const StridedSplit& split, int64_t b, int64_t h, int64_t i0,
                                int64_t rows) {
  const int64_t stride = split.stride, residue = split.key_residue(i0), g = p.kv_head_of(h);
  step::PrefetchRows(p.q, b, h, i0, stride, rows, p.head_dim);
  step::PrefetchRows(p.output, b, h, i0, stride, rows, p.value_dim, true);
  const int64_t c_end = split.keys_before(residue, p.last_visible_key(b, i0 + (rows - 1) * stride));
  const int64_t c_lo = std::max<int64_t>(0, c_end - static_cast<int64_t>(step::ResidueTileRows()));
  if (p.kv_dtype != DType::F32 || c_end <= c_lo) return;
  step::PrefetchRows(p.k, b, g, residue + c_lo * stride, stride, c_end - c_lo, p.head_dim);
  step::PrefetchRows(p.v, b, g, residue + c_lo * stride, stride, c_end - c_lo, p.value_dim);
}

// Residues [first, last) of head (b, h): queries r, r + S, ... below Nq, by residue tiles, each
// prefetching the same tile of the next residue (the rows next to its own).
template <class KeyTile>
void ForwardResidues(const AttentionProblem& p, const StridedSplit& split, int64_t b, int64_t h, int64_t first,
                     int64_t last, const ForwardScratch& w, const KeyTile& key_tile) {
  const int64_t br = static_cast<int64_t>(step::ResidueTileRows());
  for (int64_t r = first; r < last; ++r) {
    const int64_t queries = split.keys_before(r, p.q_len);  // the residue's queries, counted as keys are
    const int64_t next_queries = split.keys_before(r + 1, p.q_len);
    for (int64_t x0 = 0; x0 < queries; x0 += br) {
      if (r + 1 < last && x0 < next_queries)
        PrefetchResidueTile(p, split, b, h, r + 1 + x0 * split.stride, std::min(br, next_queries - x0));
      ForwardResidueTile(p, split, b, h, r + x0 * split.stride, static_cast<size_t>(std::min(br, queries - x0)), w,
                         key_tile);
    }
  }
}

// ---- Backward: after the tiles (which evaluated `rest`), adding into dQ, dK and dV.

// The residue tile of queries i0 + x S (x < rows) of head h against the key block's keys the
// band lets it see (trimmed from the block, so a causal residue computes few hidden pairs):
// pair(walk, tile, query_rows, keys, mask) runs it, then its dQ is flushed.
template <class Pair>
void BackwardResidueTile(const AttentionBackwardProblem& bp, const StridedSplit& split, int64_t b, int64_t h,
                         int64_t i0, size_t rows, const KeyBlock& block, const float* HWY_RESTRICT row_dot_all,
                         const BackwardScratch& w, const Pair& pair) {
  const AttentionProblem& p = bp.forward;
  const int64_t stride = split.stride, residue = split.key_residue(i0);
  const int64_t i_last = i0 + static_cast<int64_t>(rows - 1) * stride;
  const int64_t c0 = (block.j0 - residue) / stride;
  const auto [c_begin, c_end] = VisibleResidueKeys(p, split, b, i0, i_last);
  const int64_t c_lo = std::max(c0, c_begin), c_hi = std::min(c0 + static_cast<int64_t>(block.cols), c_end);
  if (c_lo >= c_hi) return;
  const int64_t j0 = residue + c_lo * stride, j_last = residue + (c_hi - 1) * stride;
  step::TileMask mask;
  if (!ResidueTileMask(p, split, b, h, i0, i_last, j0, j_last, &mask)) return;
  const QueryRows query_rows = PackQueryTile(bp, b, h, i0, stride, rows, row_dot_all, w);
  const KeyBlock keys = block.Part(static_cast<size_t>(c_lo - c0), static_cast<size_t>(c_hi - c_lo), j0, w);
  pair(step::Walk{stride, stride, true}, TileAt{b, h, p.kv_head_of(h), i0, rows, j0, keys.cols}, query_rows, keys,
       mask);
  FlushGradQ(p, b, h, i0, stride, rows, block.grad_q_scale, bp.grad_q, w, true, nullptr);
}

// Residues [first, last) of the queries of kv head (b, g)'s group: every residue's key tiles,
// each against every query head of the group and every residue tile of its queries. `w`: a
// scratch of ResidueTileRows() queries.
template <class Pair>
void BackwardResidues(const AttentionBackwardProblem& bp, const StridedSplit& split, int64_t b, int64_t g,
                      int64_t first, int64_t last, const float* HWY_RESTRICT row_dot_all, const BackwardScratch& w,
                      const Pair& pair) {
  const AttentionProblem& p = bp.forward;
  const int64_t br = static_cast<int64_t>(w.br), group = p.q_heads / p.kv_heads, stride = split.stride;
  std::fill_n(w.grad_q, w.br * w.dk_pad, 0.0f);  // each FlushGradQ leaves it zero again
  for (int64_t r = first; r < last; ++r) {
    const int64_t residue = split.key_residue(r), queries = split.keys_before(r, p.q_len);
    const int64_t keys = split.keys_before(residue, p.kv_len);
    for (int64_t c0 = 0; c0 < keys; c0 += static_cast<int64_t>(kKeyTile)) {
      const size_t cols = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(kKeyTile), keys - c0));
      const KeyBlock block = StartKeyTile(p, b, g, residue + c0 * stride, stride, cols, w);
      for (int64_t h = g * group; h < (g + 1) * group; ++h)
        for (int64_t x0 = 0; x0 < queries; x0 += br)
          BackwardResidueTile(bp, split, b, h, r + x0 * stride, static_cast<size_t>(std::min(br, queries - x0)), block,
                              row_dot_all, w, pair);
      FinishKeyTile(bp, b, g, residue + c0 * stride, stride, cols, true, w);
    }
  }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace flash_steps
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // QKV_ATTENTION_FLASH_RESIDUES_INL_H_ toggle
