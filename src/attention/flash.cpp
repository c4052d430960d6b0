// The flash kernel: softmax(Q K^T * scale + mask) V by tiles of queries x keys with an online
// softmax (FlashAttention-2's forward, ggml's flash_attn_ext), never materialising more than one
// Bc x Br tile of scores per worker. Same semantics as reference.cpp, dropout included; writes
// output and lse, never weights (Auto picks Reference when weights are asked for).
//
// Layout: everything runs "transposed", queries along the SIMD lanes. A query tile is one
// (batch b, query head h, Br queries); per query tile, with g = kv_head_of(h):
//
//   Qt   (Dk, Br)  scale * Q[b,h,i0:i0+Br]^T, packed once (zero lanes past Nq)
//   St   (Bc, Br)  one tile of scores S^T = K[b,g,j0:j0+Bc] Qt, then the weights P^T
//   Ot   (Dv, Br)  the unnormalised output O^T, rescaled whenever a row's max grows
//   running_max, row_sum (Br)
//
// With queries in the lanes every softmax step is a vertical vector op (the max over keys is a
// Max of rows, the rescale of O a multiply of rows by one vector): no horizontal reductions, and
// both products are the same register-tiled micro-GEMM, "broadcast an element of A, load a row
// of B":
//   S^T = K Qt      A = K rows (read in place),          B = Qt rows
//   Ot += V^T P^T   A = V^T (V read in place, transposed by its strides), B = P^T rows
// so neither K nor V is ever copied (16-bit K/V: each tile is widened into L1 scratch as it
// is loaded, LoadKvTile).
//
// A work item is one query tile, or, when a head's K and V outgrow a quarter of the L2, up to
// kSlots query tiles of one K/V head (a GQA group's heads, then a head's consecutive tiles)
// that take turns, one key tile each, so that each K/V tile comes from L3 once for all of them.
//
// Memory traffic per query tile (Dk = Dv = d, visible keys n): Q and O once (2 Br d floats), K
// and V once (2 n d floats, from L2: consecutive items share a head; side by side, once per
// item), against 4 Br n d flops; Qt + St + Ot = (2 d + Bc) Br floats stay in L1 (d = 64: 36 KB of
// Zen 5's 48 KB; side by side, a slot's Qt and Ot come back from L2 at its turn). The micro-GEMM
// does kTileRows x kTileVectors FMAs per kTileRows broadcasts + kTileVectors loads.
//
// Masks: the band (causal, window) and key lengths give each query a key range
// [first_visible_key, last_visible_key); a key tile outside every range of the query tile is
// skipped (causal costs about half), a tile inside every range runs with no per-element mask
// work, the rest mask per element. Tensor terms are read per tile, per element. Score
// modifiers (softcap, ALiBi) and the sink are the pipeline's steps (pipeline-inl.h), as is every
// step named below.
//
// Strided keys (a root rule `rest | strided(S, O)`, S >= Bc): a stride leaves one visible key
// per query in many tiles, so they are computed apart, in a first pass by residues. Queries
// r, r + S, ... all meet keys kr, kr + S, ... (kr = r + O mod S): a dense block, run with the
// same key-tile step on lines of steps (S, 0) (queries S apart in the lanes), residue tiles of
// ResidueTileRows() queries. The pass leaves each row's softmax state (unnormalised O, max,
// sum, NaN seen) in the output rows, row_max, row_sum and lse; the second pass, the tiles,
// evaluates `rest` (a band rest folded into the band) and starts each row from that state.
//
// Highway's foreach_target re-includes this file once per SIMD target (see hwy/examples/
// skeleton.cc); the threading and the exported entry point live in the HWY_ONCE part below.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/flash.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "attention/kv_load-inl.h"
#include "attention/pipeline-inl.h"
#include "hwy/highway.h"

#ifndef QKV_ATTENTION_FLASH_ONCE
#define QKV_ATTENTION_FLASH_ONCE
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <vector>

#include "attention/flash.hpp"
#include "attention/problem.hpp"

namespace qkv::detail::flash {

// Bc, keys per tile: large enough to amortise the per-tile rescale of Ot (Dv x Br multiplies)
// and its load/store in the second product over Bc FMAs each; small enough that St (Bc x Br)
// stays in L1 beside Qt and Ot. The same for every target.
constexpr size_t kKeyTile = 64;

// Strided residues a work item runs one after the other (flash_attention's first pass).
constexpr int64_t kResiduesPerItem = 8;

// The query tiles a work item runs side by side (its slots) when a head's K and V do not fit in
// cache: each key tile is read from memory once for all of them (flash_attention's item_shape).
constexpr size_t kSlots = 4;

// One worker's scratch, offsets in floats from a 64-byte aligned base; every part starts on
// its own cache line. br = queries per tile (per target), dk/dv = head and value dims; `slots`
// query tiles, each with its own Qt, Ot and softmax state, share one tile of scores and one of
// widened K/V. A slot's parts are at `slot * slot_floats` past the first slot's.
struct ScratchLayout {
  size_t scores, k_wide, v_wide;                                      // shared
  size_t q_t, out_t, running_max, row_sum, correction, nan_seen;      // the first slot's
  size_t slot_floats, total;

  ScratchLayout(size_t br, size_t dk, size_t dv, bool wide_kv = false, size_t slots = 1) {
    size_t at = 0;
    auto take = [&](size_t floats) {
      const size_t start = at;
      at += round_to_cache_line(floats);
      return start;
    };
    scores = take(kKeyTile * br);      // St then P^T (Bc, Br)
    k_wide = take(wide_kv ? kKeyTile * dk : 0);  // 16-bit K/V: the tile widened to float
    v_wide = take(wide_kv ? kKeyTile * dv : 0);
    const size_t first_slot = at;
    q_t = take(dk * br);               // Qt (Dk, Br)
    out_t = take(dv * br);             // Ot (Dv, Br)
    running_max = take(br);            // per query
    row_sum = take(br);                // per query
    correction = take(br);             // per query: exp(old max - new max), then 1 / l
    nan_seen = take(br);               // per query: 1 once a visible score was NaN
    slot_floats = at - first_slot;
    total = first_slot + slots * slot_floats;
  }
};

}  // namespace qkv::detail::flash
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using flash::kKeyTile;
using tile_gemm::kTileVectors;
using tile_gemm::PanelGemm;
namespace step = pipeline;
using step::kResidueVectors;
using step::ResidueTileRows;
using step::TileMask;
using step::Walk;

// Br, queries per work item: exactly the micro-tile width, so one micro-GEMM call spans the
// whole query tile and its running max / sum are kTileVectors vectors (48 queries on AVX-512).
size_t QueryTileRows() { return kTileVectors * hn::Lanes(DF()); }

// This target's HWY_TARGET bit, so tests can see which code a dispatch reaches.
int64_t CompiledTarget() { return HWY_TARGET; }

// One worker's view of its scratch block (flash::ScratchLayout), for one of its slots.
struct Scratch {
  float *q_t = nullptr, *scores = nullptr, *out_t = nullptr, *running_max = nullptr, *row_sum = nullptr,
        *correction = nullptr, *nan_seen = nullptr, *k_wide = nullptr, *v_wide = nullptr;
  Scratch() = default;
  Scratch(float* base, const flash::ScratchLayout& l, size_t slot = 0)
      : q_t(base + l.q_t + slot * l.slot_floats), scores(base + l.scores),
        out_t(base + l.out_t + slot * l.slot_floats), running_max(base + l.running_max + slot * l.slot_floats),
        row_sum(base + l.row_sum + slot * l.slot_floats), correction(base + l.correction + slot * l.slot_floats),
        nan_seen(base + l.nan_seen + slot * l.slot_floats), k_wide(base + l.k_wide), v_wide(base + l.v_wide) {}
};

// Step "load a tile" for 16-bit K/V: rows [j0, j0 + cols) of head (b, g) widened into `to`
// (packed, `dim` floats a row), SIMD over each row and a scalar tail.
template <class T>
void WidenTile(const Rows<const uint16_t>& rows, int64_t b, int64_t g, int64_t j0, size_t cols, size_t dim,
               float* HWY_RESTRICT to) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  for (size_t j = 0; j < cols; ++j) {
    const T* HWY_RESTRICT from = reinterpret_cast<const T*>(rows.row(b, g, j0 + static_cast<int64_t>(j)));
    float* HWY_RESTRICT row = to + j * dim;
    size_t c = 0;
    for (; c + lanes <= dim; c += lanes) hn::StoreU(kv::LoadWide(df, from + c), df, row + c);
    for (; c < dim; ++c) row[c] = kv::ToFloat(from[c]);
  }
}

// The K and V tiles of keys j0, j0 + key_step, ... (cols of them) as floats: read in place when
// they are, widened into the worker's scratch when they are 16-bit.
struct KvTile {
  const float* k;
  int64_t k_stride;
  const float* v;
  int64_t v_stride;
};
KvTile LoadKvTile(const AttentionProblem& p, int64_t b, int64_t g, int64_t j0, int64_t key_step, size_t cols,
                  const Scratch& w) {
  if (p.kv_dtype == DType::F32)
    return {p.k.row(b, g, j0), p.k.row_stride * key_step, p.v.row(b, g, j0), p.v.row_stride * key_step};
  const size_t dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim);
  const Rows<const uint16_t> k = step::EveryStepRows(p.k_bits, j0, key_step);
  const Rows<const uint16_t> v = step::EveryStepRows(p.v_bits, j0, key_step);
  if (p.kv_dtype == DType::BF16) {
    WidenTile<hwy::bfloat16_t>(k, b, g, 0, cols, dk, w.k_wide);
    WidenTile<hwy::bfloat16_t>(v, b, g, 0, cols, dv, w.v_wide);
  } else {
    WidenTile<hwy::float16_t>(k, b, g, 0, cols, dk, w.k_wide);
    WidenTile<hwy::float16_t>(v, b, g, 0, cols, dv, w.v_wide);
  }
  return {w.k_wide, std::max<int64_t>(p.head_dim, 1), w.v_wide, std::max<int64_t>(p.value_dim, 1)};
}

// One key tile (cols keys from j0) of a query tile (V vectors of queries from i0, `rows` real):
// scores, modifiers and mask, the online softmax update, dropout, and Ot += V^T P^T.
template <size_t V>
void FlashKeyTile(const AttentionProblem& p, const Walk& walk, int64_t b, int64_t h, int64_t i0, size_t rows,
                  int64_t j0, size_t cols, const TileMask& mask, const Scratch& w) {
  const size_t br = V * hn::Lanes(DF());
  const size_t dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim);
  const int64_t g = p.kv_head_of(h);
  const KvTile kv = LoadKvTile(p, b, g, j0, walk.key_step, cols, w);
  const float* HWY_RESTRICT k_tile = kv.k;
  const float* HWY_RESTRICT v_tile = kv.v;
  auto line = [&](size_t j) { return step::Line{b, h, i0, j0 + static_cast<int64_t>(j) * walk.key_step, walk.query_step, 0}; };

  // 1. S^T = K_tile Qt: (cols, Br), already scaled (Qt carries the scale); K read in place.
  PanelGemm<V>(cols, dk, k_tile, static_cast<size_t>(kv.k_stride), 1, w.q_t, br, w.scores, br, false);
  // 2. Modifiers and mask, one key line over the tile's queries at a time.
  const bool some_hidden = mask.band || mask.hide >= 0 || !p.terms.empty();
  if (some_hidden || p.softcap > 0 || p.alibi_slopes)
    for (size_t j = 0; j < cols; ++j) {
      if (walk.residue) {
        step::ResidueLogits(p, line(j), w.scores + j * br, br, rows, mask.band, mask.hide);
      } else {
        step::ScoresToLogits(p, line(j), w.scores + j * br, br, rows, mask.band);
      }
    }
  // 3. Online softmax, one lane per query; Ot moves to the new max when some max grew (by the
  // correction factors, applied as the next product loads Ot).
  const bool max_grew =
      step::SoftmaxColumnsUpdate(w.scores, cols, br, w.running_max, w.row_sum, w.correction, w.nan_seen);
  // 4. Dropout on P (scaling exp(s - m) is scaling exp(s - m) / l at the end).
  if (p.dropout_p > 0)
    for (size_t j = 0; j < cols; ++j) step::Dropout(p, line(j), w.scores + j * br, rows);
  // 5. Ot = correction * Ot + V_tile^T P^T: A(c, j) = V[j0 + j, c], row stride 1 and depth stride
  // V's row stride. Skipping zero weights when a hidden key's V may be NaN or Inf.
  if ((some_hidden || p.dropout_p > 0) && !step::RowsFinite(v_tile, cols, dv, kv.v_stride)) {
    if (max_grew) step::RescaleColumns(w.out_t, dv, br, w.correction);
    accumulate_skipping_zeros(rows, cols, dv, w.scores, 1, br, v_tile, kv.v_stride, w.out_t, 1, br);
  } else {
    PanelGemm<V>(dv, cols, v_tile, 1, static_cast<size_t>(kv.v_stride), w.scores, br, w.out_t, br, true,
                 max_grew ? w.correction : nullptr);
  }
}

// Step "softmax", the start of a query tile of br lanes: Qt packed (queries i0, i0 + step, ...,
// `rows` of them, scaled), Ot = 0 and each query's softmax started (with its sink, if any).
void StartQueryTile(const AttentionProblem& p, int64_t b, int64_t h, int64_t i0, int64_t query_step, size_t rows,
                    size_t br, const Scratch& w) {
  step::PackTransposed(step::EveryStepRows(p.q, i0, query_step), b, h, 0, rows, static_cast<size_t>(p.head_dim), br,
                       p.scale, w.q_t);
  std::fill_n(w.out_t, static_cast<size_t>(p.value_dim) * br, 0.0f);
  std::fill_n(w.running_max, br, step::InitialMax(p, h));
  std::fill_n(w.row_sum, br, step::InitialSum(p));
  std::fill_n(w.nan_seen, br, 0.0f);
}

// ---- The strided keys of a `rest | strided(S, O)` rule (StridedSplit, mask_rule.hpp), gathered
// by residues: queries i0, i0 + S, ... meet keys j0, j0 + S, ... (j0 = i0 + O mod S), a dense
// block that runs as flash tiles of lines with steps (S, 0), which every pipeline step reads.
// The residues run first and leave their softmax state (O unnormalised, max, sum, and whether a
// NaN was seen, in the output rows, row_max, row_sum and lse) for the tiles, which evaluate
// `rest` and continue from it; a residue hides what `rest` shows, so no pair counts twice.

// One residue tile: queries i0 + x S (x < rows <= ResidueTileRows()) of head (b, h).
void StridedResidueTile(const AttentionProblem& p, const StridedSplit& split, int64_t b, int64_t h, int64_t i0,
                        size_t rows, float* HWY_RESTRICT scratch) {
  const size_t br = ResidueTileRows(), dv = static_cast<size_t>(p.value_dim);
  const Scratch w(scratch, flash::ScratchLayout(QueryTileRows(), static_cast<size_t>(p.head_dim), dv,
                                                p.kv_dtype != DType::F32));
  const int64_t stride = split.stride, residue = split.key_residue(i0);
  const int64_t i_last = i0 + static_cast<int64_t>(rows - 1) * stride;
  StartQueryTile(p, b, h, i0, stride, rows, br, w);
  // The residue's keys the band lets some query see, by tiles from the last: first one of br keys
  // (under causal, the block on the diagonal, the only one to mask), then of Bc.
  const int64_t c_begin = split.keys_before(residue, p.first_visible_key(i0));
  const int64_t c_end = split.keys_before(residue, p.last_visible_key(b, i_last));
  for (int64_t c_hi = c_end, width = static_cast<int64_t>(br); c_hi > c_begin; c_hi -= width, width = kKeyTile) {
    const int64_t c_lo = std::max(c_begin, c_hi - width);
    const int64_t j0 = residue + c_lo * stride, j_last = residue + (c_hi - 1) * stride;
    const step::TileClass band = step::ClassifyTile(p, b, i0, i_last, j0, j_last + 1);
    const TileVisibility rest = p.rule.classify(b, h, i0, i_last, j0, j_last, split.rest);
    if (band == step::TileClass::Hidden || rest == TileVisibility::Full) continue;
    const TileMask mask{band != step::TileClass::Full, rest == TileVisibility::Partial ? split.rest : -1};
    FlashKeyTile<kResidueVectors>(p, {stride, stride, true}, b, h, i0, rows, j0, static_cast<size_t>(c_hi - c_lo),
                                  mask, w);
  }
  const int64_t row0 = (b * p.q_heads + h) * p.q_len;
  step::UnpackTransposed(w.out_t, br, rows, dv, nullptr, step::EveryStepRows(p.output, i0, stride), b, h, 0);
  for (size_t x = 0; x < rows; ++x) {
    const int64_t i = i0 + static_cast<int64_t>(x) * stride;
    p.row_max[row0 + i] = w.running_max[x];
    p.row_sum[row0 + i] = w.row_sum[x];
    p.lse[row0 + i] = w.nan_seen[x];
  }
}

// Prefetches what the residue tile of queries i0 + x S (x < rows) reads first: its Q rows, the
// rows of O it writes, and the K and V rows of its last br keys (under causal, the new ones).
void PrefetchResidueTile(const AttentionProblem& p, const StridedSplit& split, int64_t b, int64_t h, int64_t i0,
                         int64_t rows) {
  const int64_t stride = split.stride, residue = split.key_residue(i0), g = p.kv_head_of(h);
  step::PrefetchRows(p.q, b, h, i0, stride, rows, p.head_dim);
  step::PrefetchRows(p.output, b, h, i0, stride, rows, p.value_dim, true);
  const int64_t c_end = split.keys_before(residue, p.last_visible_key(b, i0 + (rows - 1) * stride));
  const int64_t c_lo = std::max<int64_t>(0, c_end - static_cast<int64_t>(ResidueTileRows()));
  if (p.kv_dtype != DType::F32 || c_end <= c_lo) return;
  step::PrefetchRows(p.k, b, g, residue + c_lo * stride, stride, c_end - c_lo, p.head_dim);
  step::PrefetchRows(p.v, b, g, residue + c_lo * stride, stride, c_end - c_lo, p.value_dim);
}

// Residues [first, last) of head (b, h): queries r, r + S, ... below Nq, by residue tiles, each
// prefetching the same tile of the next residue (the rows next to its own).
void StridedResidues(const AttentionProblem& p, const StridedSplit& split, int64_t b, int64_t h, int64_t first,
                     int64_t last, float* HWY_RESTRICT scratch) {
  const int64_t br = static_cast<int64_t>(ResidueTileRows());
  for (int64_t r = first; r < last; ++r) {
    const int64_t queries = split.keys_before(r, p.q_len);  // the residue's queries, counted as keys are
    const int64_t next_queries = split.keys_before(r + 1, p.q_len);
    for (int64_t x0 = 0; x0 < queries; x0 += br) {
      if (r + 1 < last && x0 < next_queries)
        PrefetchResidueTile(p, split, b, h, r + 1 + x0 * split.stride, std::min(br, next_queries - x0));
      StridedResidueTile(p, split, b, h, r + x0 * split.stride, static_cast<size_t>(std::min(br, queries - x0)),
                         scratch);
    }
  }
}

// A query tile of a work item (a slot): query head h, queries [i0, i0 + rows), run on `vectors`
// vectors, with its own scratch; its key tiles are those of [kv_begin, kv_end) the query tile
// may see, by Bc from kv_begin, and next_key is the first not run yet.
struct QueryTile {
  int64_t h, i0;
  size_t rows, vectors;
  Scratch w;
  int64_t next_key, kv_end;
};

// Set up: Qt = scale * Q^T, Ot = 0, each query's softmax started (with its sink, if any), or
// Ot and the softmax state as the residues left them (`carried`).
void StartSlot(const AttentionProblem& p, bool carried, int64_t b, const QueryTile& t) {
  const size_t br = t.vectors * hn::Lanes(DF());
  StartQueryTile(p, b, t.h, t.i0, 1, t.rows, br, t.w);
  if (!carried) return;
  const int64_t row0 = (b * p.q_heads + t.h) * p.q_len + t.i0;
  const Rows<const float> partial{p.output.data, p.output.batch_stride, p.output.head_stride, p.output.row_stride};
  step::PackTransposed(partial, b, t.h, t.i0, t.rows, static_cast<size_t>(p.value_dim), br, 1.0f, t.w.out_t);
  std::copy_n(p.row_max + row0, t.rows, t.w.running_max);
  std::copy_n(p.row_sum + row0, t.rows, t.w.row_sum);
  std::copy_n(p.lse + row0, t.rows, t.w.nan_seen);
}

// The slot's next key tile, skipped when the mask hides it from every query of the slot;
// false when none is left.
bool NextKeyTile(const AttentionProblem& p, int64_t b, QueryTile& t) {
  if (t.next_key >= t.kv_end) return false;
  const int64_t j0 = t.next_key, i_last = t.i0 + static_cast<int64_t>(t.rows) - 1;
  const size_t cols = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(kKeyTile), t.kv_end - j0));
  t.next_key += static_cast<int64_t>(kKeyTile);
  const step::TileClass tile = step::ClassifyMaskTile(p, b, t.h, t.i0, i_last, j0, j0 + static_cast<int64_t>(cols));
  if (tile == step::TileClass::Hidden) return true;
  const TileMask mask{tile != step::TileClass::Full, -1};
  if (t.vectors == 1) {
    FlashKeyTile<1>(p, {}, b, t.h, t.i0, t.rows, j0, cols, mask, t.w);
  } else if (t.vectors == 2) {
    FlashKeyTile<2>(p, {}, b, t.h, t.i0, t.rows, j0, cols, mask, t.w);
  } else {
    FlashKeyTile<kTileVectors>(p, {}, b, t.h, t.i0, t.rows, j0, cols, mask, t.w);
  }
  return true;
}

// Finish each query: O = Ot^T / l, then lse and the row stats, each the tile's `rows` contiguous
// floats of its (B, Hq, Nq) array written as one run (W0 on two threads: about 1% faster than a
// store of each per row).
void FinishSlot(const AttentionProblem& p, int64_t b, const QueryTile& t) {
  const size_t br = t.vectors * hn::Lanes(DF());
  const int64_t row0 = (b * p.q_heads + t.h) * p.q_len + t.i0;
  step::FinishColumns(t.w.running_max, t.w.row_sum, t.w.nan_seen, br, t.w.correction, t.w.scores);
  step::UnpackTransposed(t.w.out_t, br, t.rows, static_cast<size_t>(p.value_dim), t.w.correction, p.output, b, t.h,
                         t.i0);
  std::copy_n(t.w.scores, t.rows, p.lse + row0);
  std::copy_n(t.w.running_max, t.rows, p.row_max + row0);
  std::copy_n(t.w.row_sum, t.rows, p.row_sum + row0);
}

// One work item: query heads [h0, h0 + heads) of batch b (one K/V head's), each over query tiles
// [tile0, tile0 + tiles) of Br queries (fewer at the end of Nq): heads x tiles slots, which run
// their key tiles in turns, one each, so that a K/V tile read for one slot is still in cache
// for the others. `scratch` is this worker's block, laid out by flash::ScratchLayout for that
// many slots. `carried`: the strided residues ran first and left each row's softmax state in the
// outputs; continue from it.
void FlashQueryTiles(const AttentionProblem& p, bool carried, int64_t b, int64_t h0, int64_t heads, int64_t tile0,
                     int64_t tiles, float* HWY_RESTRICT scratch) {
  const size_t lanes = hn::Lanes(DF()), br = QueryTileRows();
  const flash::ScratchLayout layout(br, static_cast<size_t>(p.head_dim), static_cast<size_t>(p.value_dim),
                                    p.kv_dtype != DType::F32, static_cast<size_t>(heads * tiles));
  QueryTile slot[flash::kSlots];
  size_t slots = 0;
  for (int64_t h = h0; h < h0 + heads; ++h)
    for (int64_t tile = tile0; tile < tile0 + tiles; ++tile) {
      const int64_t i0 = tile * static_cast<int64_t>(br);
      if (i0 >= p.q_len) break;
      const size_t rows = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(br), p.q_len - i0));
      const int64_t i_last = i0 + static_cast<int64_t>(rows) - 1;
      // The width of this tile: the vectors its queries fill. Only a head's last tile can be
      // narrower (W0's 256 queries are 5 x 48 + 16): padded to 48 lanes it did 3 x the work of
      // its 16 queries, a quarter of all W0's; on one vector W0 takes 0.85 of the time.
      const size_t vectors = std::min(kTileVectors, (rows + lanes - 1) / lanes);
      slot[slots] = {h, i0, rows, vectors, Scratch(scratch, layout, slots), std::min(p.first_visible_key(i0), p.kv_len),
                     p.last_visible_key(b, i_last)};
      StartSlot(p, carried, b, slot[slots]);
      ++slots;
    }
  for (bool more = true; more;) {
    more = false;
    for (size_t s = 0; s < slots; ++s) more = NextKeyTile(p, b, slot[s]) || more;
  }
  for (size_t s = 0; s < slots; ++s) FinishSlot(p, b, slot[s]);
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <omp.h>
#include <unistd.h>

#include <atomic>

#include "memory.hpp"

namespace qkv::detail {

HWY_EXPORT(QueryTileRows);
HWY_EXPORT(FlashQueryTiles);
HWY_EXPORT(StridedResidues);
HWY_EXPORT(CompiledTarget);

namespace {
// How the query tiles are dealt into work items: `heads` query heads of one K/V head, by `tiles`
// consecutive query tiles each, side by side (FlashQueryTiles' slots).
struct ItemShape {
  int64_t heads = 1, tiles = 1;
};

// The K/V bytes of a head above which query tiles run side by side: a quarter of the L2 (glibc
// reads it from the CPU; 512 KiB when it cannot). Zen 3's 512 KiB: W1's 256 KiB heads and up
// (W0's 128 KiB not); Zen 5's 1 MiB: W2's 1 MiB heads and up.
double l2_quarter() {
  const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return (l2 > 0 ? static_cast<double>(l2) : 512.0 * 1024) / 4;
}
std::atomic<double> side_by_side_bytes{l2_quarter()};

// One query tile per item while a head's K and V fit a quarter of the L2: its items then read
// them from L2, and a tile's Qt, Ot and scores stay in L1 from one key tile to the next. Past
// that, K and V come from L3 (or memory, when other processes crowd L3) for every query tile
// and the threads contend for them: flash::kSlots query tiles side by side read each K/V tile
// once, at the cost of moving their Qt and Ot between L1 and L2. The heads of a GQA group come
// first (their key ranges are the same), then consecutive query tiles of a head.
// Measured on Zen 3 (AVX2, 512 KiB L2), 2 threads, against one tile per item, min of 4-5
// alternations: W1 0.91, W2 0.98, W2-full 0.96, W3 0.94 of the time (medians 0.87-0.92); 2, 3
// and 6 slots measured no better than 4; one thread 0.97-0.99.
ItemShape item_shape(const AttentionProblem& p, int64_t query_tiles) {
  const double kv_bytes = static_cast<double>(p.kv_len) * static_cast<double>(p.head_dim + p.value_dim) *
                          static_cast<double>(element_size(p.kv_dtype));
  if (kv_bytes <= side_by_side_bytes.load(std::memory_order_relaxed)) return {};
  const int64_t group = p.q_heads / p.kv_heads, slots = static_cast<int64_t>(flash::kSlots);
  int64_t heads = std::min(group, slots);
  while (group % heads != 0) --heads;
  return {heads, std::clamp<int64_t>(slots / heads, 1, query_tiles)};
}
}  // namespace

double set_flash_side_by_side_bytes_for_test(double bytes) { return side_by_side_bytes.exchange(bytes); }

void flash_attention(const AttentionProblem& problem) {
  const int64_t nq = problem.q_len;
  if (problem.batch == 0 || problem.q_heads == 0 || nq == 0) return;

  const size_t br = HWY_DYNAMIC_DISPATCH(QueryTileRows)();
  const int64_t query_tiles = (nq + static_cast<int64_t>(br) - 1) / static_cast<int64_t>(br);
  const int64_t heads = problem.batch * problem.q_heads;
  const ItemShape shape = item_shape(problem, query_tiles);
  const int64_t head_groups = problem.q_heads / shape.heads;
  const int64_t blocks = (query_tiles + shape.tiles - 1) / shape.tiles;  // of shape.tiles query tiles
  const int64_t items = problem.batch * head_groups * blocks;

  // Per-worker scratch, sized up front: each block a whole number of cache lines, 64-byte
  // aligned, so workers never share a line and the hot loop never allocates.
  // A problem too small to pay for waking the other threads runs on the calling thread.
  const double flops = 4.0 * static_cast<double>(heads * query_tiles) * static_cast<double>(br) *
                       static_cast<double>(problem.kv_len) * static_cast<double>(problem.head_dim + problem.value_dim) / 2;
  const int threads = threads_for(flops);
  const int workers = static_cast<int>(std::min<int64_t>(threads, heads * query_tiles));
  const size_t block =
      flash::ScratchLayout(br, static_cast<size_t>(problem.head_dim), static_cast<size_t>(problem.value_dim),
                           problem.kv_dtype != DType::F32, static_cast<size_t>(shape.heads * shape.tiles)).total;
  // The calling thread's workspace holds every worker's block and is kept for the next call.
  float* scratch = thread_workspace(WorkspaceSlot::FlashScratch).floats(static_cast<size_t>(workers) * block);
  const auto block_of_this_thread = [&] { return scratch + static_cast<size_t>(omp_get_thread_num()) * block; };

  // A `rest | strided(S)` rule with S >= Bc: the strided keys first, by residues (b, h, first
  // query), then the tiles see `rest` (a band folded into the band) and continue each row.
  const StridedSplit split = strided_split(problem.rule, static_cast<int64_t>(flash::kKeyTile));
  std::optional<AttentionProblem> tiles_problem;
  if (split.rest >= 0) {
    // Items of kResiduesPerItem residues, so that each residue's rows are fetched during the last one's work.
    const int64_t residues = std::min(split.stride, nq);
    const int64_t groups = (residues + flash::kResiduesPerItem - 1) / flash::kResiduesPerItem;
    for_each_item(workers, heads * groups, [&](int64_t item) {
      const int64_t bh = item / groups, first = item % groups * flash::kResiduesPerItem;
      HWY_DYNAMIC_DISPATCH(StridedResidues)(problem, split, bh / problem.q_heads, bh % problem.q_heads, first,
                                            std::min(residues, first + flash::kResiduesPerItem), block_of_this_thread());
    });
    tiles_problem = problem;
    tiles_problem->rule = rest_rule(problem.rule, split, tiles_problem->band_lo, tiles_problem->band_hi);
  }
  const AttentionProblem& tiles = tiles_problem ? *tiles_problem : problem;

  // Items in (batch, heads, query tiles) order, so neighbouring items share K and V in cache (a
  // thread's share is whole heads, item_shares.hpp); within a head the last query tiles come
  // first: under a causal mask they see the most keys, so a share runs its longest items first
  // and leaves its shortest at the back, where other threads take them.
  for_each_item(workers, items, [&](int64_t item) {
    const int64_t bg = item / blocks, first_tile = (blocks - 1 - item % blocks) * shape.tiles;
    HWY_DYNAMIC_DISPATCH(FlashQueryTiles)(tiles, tiles_problem.has_value(), bg / head_groups,
                                          bg % head_groups * shape.heads, shape.heads, first_tile, shape.tiles,
                                          block_of_this_thread());
  });
}

int64_t flash_attention_compiled_targets() { return HWY_TARGETS; }

int64_t flash_attention_target() { return HWY_DYNAMIC_DISPATCH(CompiledTarget)(); }

}  // namespace qkv::detail
#endif  // HWY_ONCE
