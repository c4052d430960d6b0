// The flash kernel: softmax(Q K^T * scale + mask) V by tiles of queries x keys with an online
// softmax (FlashAttention-2's forward, ggml's flash_attn_ext), never materialising more than one
// Bc x Br tile of scores per worker. Same semantics as reference/forward.cpp, dropout included; writes
// output and lse, never weights (Auto picks Reference when weights are asked for).
//
// Layout: everything runs "transposed", queries along the SIMD lanes. A work item is one
// (batch b, query head h, query tile of Br rows); per item, with g = kv_head_of(h):
//
//   Qt   (Dk, Br)  scale * Q[b,h,i0:i0+Br]^T, packed once per item (zero lanes past Nq)
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
// Memory traffic per item (Dk = Dv = d, visible keys n): Q and O once (2 Br d floats), K and V
// once per item (2 n d floats, from L2: consecutive items share a head), against 4 Br n d flops.
// Q and O rows come from memory when the problem outgrows the caches, so each item prefetches
// the next item's into L2, a slice per key tile (QueryTileKeys).
// Qt + St + Ot = (2 d + Bc) Br floats stay in L1 (d = 64: 36 KB of Zen 5's 48 KB). The micro-GEMM
// does kTileRows x kTileVectors FMAs per kTileRows broadcasts + kTileVectors loads.
//
// Masks: the band (causal, window) and key lengths give each query a key range
// [first_visible_key, last_visible_key); a key tile outside every range of the query tile is
// skipped (causal costs about half), a tile inside every range runs with no per-element mask
// work, the rest mask per element. Tensor terms are read per tile, per element. Score
// modifiers (softcap, ALiBi) and the sink are the pipeline's steps (attention/steps/pipeline-inl.h), as is every
// step named below.
//
// Strided keys (a root rule `rest | strided(S, O)`, S >= Bc): a stride leaves one visible key
// per query in many tiles, so they are computed apart, in a first pass by residues. Queries
// r, r + S, ... all meet keys kr, kr + S, ... (kr = r + O mod S): a dense block, run with the
// same key-tile step on lines of steps (S, 0) (queries S apart in the lanes), residue tiles of
// ResidueTileRows() queries. The pass leaves each row's softmax state (unnormalised O, max and
// sum, which a NaN score has made NaN) in the output rows, row_max and row_sum; the second pass,
// the tiles, evaluates `rest` (a band rest folded into the band) and starts each row from it.
//
// Highway's foreach_target re-includes this file once per SIMD target (see hwy/examples/
// skeleton.cc); the threading and the exported entry point live in the HWY_ONCE part below.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/flash/forward.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "simd/kv_load-inl.h"
#include "attention/steps/pipeline-inl.h"
#include "hwy/highway.h"

#ifndef QKV_ATTENTION_FLASH_ONCE
#define QKV_ATTENTION_FLASH_ONCE
#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <type_traits>
#include <vector>

#include "gemm/amx.hpp"
#include "attention/flash/flash.hpp"
#include "attention/problem.hpp"
#include "simd/query_tiles.hpp"

namespace qkv::detail::flash {

// Bc, keys per tile: large enough to amortise the per-tile rescale of Ot (Dv x Br multiplies)
// and its load/store in the second product over Bc FMAs each; small enough that St (Bc x Br)
// stays in L1 beside Qt and Ot. The same for every target.
constexpr size_t kKeyTile = 64;

// Strided residues a work item runs one after the other (flash_attention's first pass).
constexpr int64_t kResiduesPerItem = 8;

// A work item's query tile: queries i0 .. i0 + rows - 1 of head (b, h); rows == 0: none.
struct QueryTile {
  int64_t b = 0, h = 0, i0 = 0, rows = 0;
};

// One worker's scratch, offsets in floats from a 64-byte aligned base; every part starts on
// its own cache line. br = queries per tile (per target), dk/dv = head and value dims.
struct ScratchLayout {
  size_t q_t, scores, out_t, running_max, row_sum, correction, k_wide, v_wide;
  size_t total;

  ScratchLayout(size_t br, size_t dk, size_t dv, bool wide_kv = false) {
    size_t at = 0;
    auto take = [&](size_t floats) {
      const size_t start = at;
      at += round_to_cache_line(floats);
      return start;
    };
    q_t = take(dk * br);               // Qt (Dk, Br)
    scores = take(kKeyTile * br);      // St then P^T (Bc, Br)
    out_t = take(dv * br);             // Ot (Dv, Br)
    running_max = take(br);            // per query
    row_sum = take(br);                // per query
    correction = take(br);             // per query: exp(old max - new max), then 1 / l
    k_wide = take(wide_kv ? kKeyTile * dk : 0);  // 16-bit K/V: the tile widened to float
    v_wide = take(wide_kv ? kKeyTile * dv : 0);
    total = at;
  }
};

// The header of a worker's AMX block: the K/V head (b, g) its splits are of, how many keys are
// split, and the first key of the first key tile whose values do not fit the parts (kAllFit:
// none so far). The tiles from there on stay float32.
constexpr int64_t kAllFit = std::numeric_limits<int64_t>::max();
struct AmxHeld {
  int64_t b, g, keys, unfit_from;
};

// One worker's block for the AMX products (MatmulPrecision High or Medium on a CPU with AMX,
// gemm/amx.hpp), offsets in bf16 elements from a 64-byte aligned base: a header (AmxHeld),
// the query tile's Q parts, one key tile's P parts, and one K/V head's K and V^T parts, split as
// far as the worker's tiles have needed (consecutive items share the head): 2 n_pad (dk_pad + Dv)
// bytes a part.
struct AmxLayout {
  size_t dk_pad = 0, n_pad = 0;                  // Dk rounded up to 32, keys with room past Nk
  size_t q = 0, p = 0, k = 0, v = 0, total = 0;  // offsets; total in elements
  size_t q_part = 0, p_part = 0, k_part = 0, v_part = 0;

  AmxLayout() = default;
  AmxLayout(int parts, size_t br, size_t dk, size_t dv, size_t nk) {
    constexpr size_t kLine = 32;  // elements per cache line
    dk_pad = round_up(dk, amx::kDepth);
    // A key tile from any j0 < Nk reads Bc keys of the splits: zeros past Nk.
    n_pad = round_up(nk, kKeyTile) + kKeyTile;
    q_part = round_up(dk_pad * br, kLine), p_part = round_up(kKeyTile * br, kLine),
    k_part = round_up(n_pad * dk_pad, kLine), v_part = round_up(dv * n_pad, kLine);
    const size_t count = static_cast<size_t>(parts);
    q = kLine, p = q + count * q_part, k = p + count * p_part, v = k + count * k_part, total = v + count * v_part;
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

// Br, queries per work item at most: exactly the micro-tile width, so one micro-GEMM call spans
// the whole query tile and its running max / sum are kTileVectors vectors (48 queries on AVX-512).
size_t QueryTileRows() { return kTileVectors * hn::Lanes(DF()); }
size_t VectorLanes() { return hn::Lanes(DF()); }

// This target's HWY_TARGET bit, so tests can see which code a dispatch reaches.
int64_t CompiledTarget() { return HWY_TARGET; }

// One worker's view of its scratch block (flash::ScratchLayout), and of its AMX block when the
// item's products run on AMX tiles (else amx is null).
struct Scratch {
  float *q_t, *scores, *out_t, *running_max, *row_sum, *correction, *k_wide, *v_wide;
  uint16_t* amx = nullptr;
  const flash::AmxLayout* amx_layout = nullptr;
  Scratch(float* base, const flash::ScratchLayout& l)
      : q_t(base + l.q_t), scores(base + l.scores), out_t(base + l.out_t), running_max(base + l.running_max),
        row_sum(base + l.row_sum), correction(base + l.correction), k_wide(base + l.k_wide),
        v_wide(base + l.v_wide) {}
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

// Whether the V rows of the tile that a zero weight may meet are finite (a hidden key's V may be
// NaN or Inf, and 0 x NaN would reach the output through the GEMM): every row when a rule, a
// tensor term or dropout can zero any weight; under the band alone only the keys some query of
// the tile does not see, [j0, first key all see) and [last key all see, j_end) (a causal
// diagonal tile: its rows past the first query, not all 64; the whole check was 3% of W0).
bool HiddenValuesFinite(const AttentionProblem& p, const Walk& walk, const TileMask& mask, int64_t b, int64_t i0,
                        size_t rows, int64_t j0, size_t cols, const KvTile& kv) {
  const size_t dv = static_cast<size_t>(p.value_dim);
  if (walk.residue || mask.hide >= 0 || !p.terms.empty() || !p.rule.empty() || p.dropout_p > 0)
    return step::RowsFinite(kv.v, cols, dv, kv.v_stride);
  const int64_t j_end = j0 + static_cast<int64_t>(cols), i_last = i0 + static_cast<int64_t>(rows) - 1;
  const int64_t all_from = std::clamp(p.first_visible_key(i_last), j0, j_end);
  const int64_t all_to = std::clamp(p.last_visible_key(b, i0), all_from, j_end);
  return step::RowsFinite(kv.v, static_cast<size_t>(all_from - j0), dv, kv.v_stride) &&
         step::RowsFinite(kv.v + (all_to - j0) * kv.v_stride, static_cast<size_t>(j_end - all_to), dv, kv.v_stride);
}

// The AMX block's splits of head (b, g)'s K and V up to key `need` (whole key tiles, zeros past
// Nk), a key tile at a time, starting over when the block held another head's. Whether every key
// before `need` fits the parts (no NaN, no inf, none rounding to inf): if not, the tile stays
// float32. That depends on the keys alone, not on how far this worker split the head before: a
// worker that had met a bad key for an earlier query tile kept every later tile of the head to
// float32, one starting fresh did not, so the output changed with the threads' shares.
bool AmxSplitKeys(const AttentionProblem& p, int64_t b, int64_t g, int64_t need, const Scratch& w) {
  auto* held = reinterpret_cast<flash::AmxHeld*>(w.amx);
  if (held->b != b || held->g != g) *held = {b, g, 0, flash::kAllFit};
  const flash::AmxLayout& at = *w.amx_layout;
  const int64_t tile = static_cast<int64_t>(kKeyTile), n_pad = static_cast<int64_t>(at.n_pad);
  const size_t dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim);
  while (held->keys < need && held->keys < n_pad && held->unfit_from == flash::kAllFit) {
    const int64_t from = held->keys, to = std::min(from + tile, n_pad);
    const int64_t rows = std::clamp<int64_t>(p.kv_len - from, 0, to - from);
    const int64_t first = rows > 0 ? from : 0;  // a row that exists, read only when rows > 0
    const bool k_fits = amx::split_rows(p.amx_parts, true, p.k.row(b, g, first), static_cast<size_t>(p.k.row_stride),
                                        static_cast<size_t>(rows), dk,
                                        w.amx + at.k + static_cast<size_t>(from) * at.dk_pad, at.dk_pad,
                                        static_cast<size_t>(to - from), at.dk_pad, at.k_part);
    const bool v_fits = amx::split_transposed(p.amx_parts, p.v.row(b, g, first), static_cast<size_t>(p.v.row_stride),
                                              static_cast<size_t>(rows), dv, w.amx + at.v + from, at.n_pad,
                                              static_cast<size_t>(to - from), at.v_part);
    if (!(k_fits && v_fits)) held->unfit_from = from;
    held->keys = to;
  }
  return need <= held->unfit_from;
}

// f(width, skip, begin, end) for each run of lines of a trimmed tile (step::DiagonalTrim): lines
// [begin, end) of the last `width` = V - skip vectors (width a std::integral_constant, for the
// micro-GEMM's template), the first run (all V vectors) even when empty.
template <size_t V, size_t Skip = 0, class F>
void ForEachTrimmedRun(const std::array<size_t, V>& trim, const F& f) {
  if constexpr (Skip < V) {
    const size_t begin = Skip == 0 ? 0 : trim[Skip - 1];
    if (Skip == 0 || trim[Skip] > begin) f(std::integral_constant<size_t, V - Skip>(), Skip, begin, trim[Skip]);
    ForEachTrimmedRun<V, Skip + 1>(trim, f);
  }
}

// One key tile (cols keys from j0) of a query tile (V vectors of queries from i0, `rows` real):
// scores, modifiers and mask, the online softmax update, dropout, and Ot += V^T P^T.
template <size_t V>
void FlashKeyTile(const AttentionProblem& p, const Walk& walk, int64_t b, int64_t h, int64_t i0, size_t rows,
                  int64_t j0, size_t cols, const TileMask& mask, const Scratch& w) {
  const size_t lanes = hn::Lanes(DF()), br = V * lanes;
  const size_t dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim);
  const int64_t g = p.kv_head_of(h);
  const KvTile kv = LoadKvTile(p, b, g, j0, walk.key_step, cols, w);
  // The causal diagonal: both products skip the query vectors the band hides (step::DiagonalTrim).
  // A diagonal tile of W0 (48 queries, 3 vectors) skips two thirds of its hidden half.
  std::array<size_t, V> trim;
  step::DiagonalTrim(p, walk, mask, i0, j0, cols, V, trim.data());
  const float* HWY_RESTRICT k_tile = kv.k;
  const float* HWY_RESTRICT v_tile = kv.v;
  auto line = [&](size_t j) { return step::Line{b, h, i0, j0 + static_cast<int64_t>(j) * walk.key_step, walk.query_step, 0}; };

  // The AMX products (w.amx set) take the tiles of consecutive keys (a residue's are S apart)
  // whose head's K and V, split through the tile's last 64 keys, fit the parts.
  const bool amx_tile = w.amx != nullptr && walk.key_step == 1 && !walk.residue &&
                        AmxSplitKeys(p, b, g, j0 + static_cast<int64_t>(kKeyTile), w);
  const flash::AmxLayout* amx_at = w.amx_layout;

  // 1. S^T = K_tile Qt: (cols, Br), already scaled (Qt carries the scale); K read in place, or
  // its parts on AMX tiles (whole blocks of 16 keys: the rows past cols are never read).
  if (amx_tile) {
    amx::product(p.amx_parts, w.amx + amx_at->k + static_cast<size_t>(j0) * amx_at->dk_pad, amx_at->dk_pad,
                 amx_at->k_part, (cols + amx::kRows - 1) / amx::kRows, w.amx + amx_at->q, amx_at->q_part,
                 amx_at->dk_pad / amx::kDepth, br, w.scores, br, false);
  } else {
    const size_t k_stride = static_cast<size_t>(kv.k_stride);
    ForEachTrimmedRun(trim, [&](auto width, size_t skip, size_t begin, size_t end) {
      PanelGemm<decltype(width)::value, true>(end - begin, dk, k_tile + begin * k_stride, k_stride, 1,
                                              w.q_t + skip * lanes, br, w.scores + begin * br + skip * lanes, br,
                                              false);
    });
  }
  // 2. Softcap on the whole tile, then ALiBi and the mask (TileLogits: the band for the whole
  // tile at once, the rest one key line over the tile's queries at a time).
  step::Softcap(p, w.scores, cols * br);
  const bool some_hidden = mask.band || mask.hide >= 0 || !p.terms.empty();
  step::TileLogits(p, walk, mask, b, h, i0, rows, j0, cols, br, w.scores);
  // 3. Online softmax, one lane per query; Ot moves to the new max when some max grew (by the
  // correction factors, applied as the next product loads Ot).
  const bool max_grew = step::SoftmaxColumnsUpdate<V>(w.scores, cols, w.running_max, w.row_sum, w.correction);
  // 4. Dropout on P (scaling exp(s - m) is scaling exp(s - m) / l at the end).
  if (p.dropout_p > 0)
    for (size_t j = 0; j < cols; ++j) step::Dropout(p, line(j), w.scores + j * br, rows);
  // 5. Ot = correction * Ot + V_tile^T P^T: A(c, j) = V[j0 + j, c], row stride 1 and depth stride
  // V's row stride. Skipping zero weights when a hidden key's V may be NaN or Inf.
  if ((some_hidden || p.dropout_p > 0) && !HiddenValuesFinite(p, walk, mask, b, i0, rows, j0, cols, kv)) {
    if (max_grew) step::RescaleColumns(w.out_t, dv, br, w.correction);
    accumulate_skipping_zeros(rows, cols, dv, w.scores, 1, br, v_tile, kv.v_stride, w.out_t, 1, br);
  } else if (amx_tile && dv % amx::kRows == 0) {
    // On AMX tiles: P^T's parts (zero past cols), then Ot += V^T P^T over whole steps of 32 keys
    // (the keys past cols that the last step takes have zero weights and finite, split V rows).
    if (max_grew) step::RescaleColumns(w.out_t, dv, br, w.correction);
    const size_t key_steps = (cols + amx::kDepth - 1) / amx::kDepth;
    amx::split_pairs(p.amx_parts, false, w.scores, br, br, cols, key_steps * amx::kDepth / 2, w.amx + amx_at->p,
                     amx_at->p_part);
    amx::product(p.amx_parts, w.amx + amx_at->v + j0, amx_at->n_pad, amx_at->v_part, dv / amx::kRows,
                 w.amx + amx_at->p, amx_at->p_part, key_steps, br, w.out_t, br, true);
  } else {
    const size_t v_stride = static_cast<size_t>(kv.v_stride);
    ForEachTrimmedRun(trim, [&](auto width, size_t skip, size_t begin, size_t end) {
      const float* rescale = skip == 0 && max_grew ? w.correction : nullptr;  // all V vectors, once
      if (end > begin || rescale)
        PanelGemm<decltype(width)::value, true>(dv, end - begin, v_tile + begin * v_stride, 1, v_stride,
                                                w.scores + begin * br + skip * lanes, br, w.out_t + skip * lanes,
                                                br, true, rescale);
    });
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
}

// ---- The strided keys of a `rest | strided(S, O)` rule (StridedSplit, mask/rule.hpp), gathered
// by residues: queries i0, i0 + S, ... meet keys j0, j0 + S, ... (j0 = i0 + O mod S), a dense
// block that runs as flash tiles of lines with steps (S, 0), which every pipeline step reads.
// The residues run first and leave their softmax state (O unnormalised, max and sum, in the
// output rows, row_max and row_sum) for the tiles, which evaluate `rest` and continue from it;
// a residue hides what `rest` shows, so no pair counts twice.

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

// The key tiles of one query tile of V vectors (queries i0 .. i0 + rows - 1): the keys any of
// them sees, by tiles of Bc; tiles outside [kv_begin, kv_end) are never visited. `next`: the
// query tile the worker most likely runs next (its share's next item), whose Q rows and the
// output rows it will write are prefetched into L2 meanwhile, a slice of rows before each key
// tile. With W1's Q and O in memory (6 MiB each), `qkv_step_benchmark`'s Call/W1 ran in
// 0.93-0.99 of the time it took without them on one thread and 0.95-0.98 on two (ratios per
// alternation, Sapphire Rapids-class Xeon). Issued all at the item's start instead, they stalled
// there (a sampled 3.7% of the call) and the call took 0.98-0.99.
template <size_t V>
void QueryTileKeys(const AttentionProblem& p, int64_t b, int64_t h, int64_t i0, size_t rows, const Scratch& w,
                   const flash::QueryTile& next) {
  const int64_t i_last = i0 + static_cast<int64_t>(rows) - 1;
  const int64_t kv_begin = std::min(p.first_visible_key(i0), p.kv_len);
  const int64_t kv_end = p.last_visible_key(b, i_last);
  const int64_t key_tile = static_cast<int64_t>(kKeyTile);
  const int64_t key_tiles = std::max<int64_t>(1, (kv_end - kv_begin + key_tile - 1) / key_tile);
  const int64_t slice = (next.rows + key_tiles - 1) / key_tiles;
  int64_t prefetched = 0;
  for (int64_t j0 = kv_begin; j0 < kv_end; j0 += key_tile) {
    if (prefetched < next.rows) {
      const int64_t count = std::min(slice, next.rows - prefetched);
      step::PrefetchRows(p.q, next.b, next.h, next.i0 + prefetched, 1, count, p.head_dim);
      step::PrefetchRows(p.output, next.b, next.h, next.i0 + prefetched, 1, count, p.value_dim, true);
      prefetched += count;
    }
    const size_t cols = static_cast<size_t>(std::min<int64_t>(key_tile, kv_end - j0));
    const step::TileClass tile = step::ClassifyMaskTile(p, b, h, i0, i_last, j0, j0 + static_cast<int64_t>(cols));
    if (tile == step::TileClass::Hidden) continue;
    FlashKeyTile<V>(p, {}, b, h, i0, rows, j0, cols, {tile != step::TileClass::Full, -1}, w);
  }
}

// One work item: query head h of batch b, queries [i0, i0 + rows), rows <= Br. `scratch` is
// this worker's block, laid out by flash::ScratchLayout. `carried`: the strided residues ran
// first and left each row's softmax state in the outputs; continue from it.
// `amx`: this worker's AMX block (flash::AmxLayout `amx_layout`) when the products run on AMX
// tiles, else null. `next`: the query tile whose rows to prefetch meanwhile.
void FlashQueryTile(const AttentionProblem& p, bool carried, int64_t b, int64_t h, int64_t i0, size_t rows,
                    float* HWY_RESTRICT scratch, uint16_t* amx, const flash::AmxLayout* amx_layout,
                    const flash::QueryTile& next) {
  const size_t lanes = hn::Lanes(DF());
  const size_t dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim);
  // The width of this tile: the vectors its queries fill (QueryTiles, simd/query_tiles.hpp).
  const size_t vectors = std::min(kTileVectors, (rows + lanes - 1) / lanes), br = vectors * lanes;
  Scratch w(scratch, flash::ScratchLayout(QueryTileRows(), dk, dv, p.kv_dtype != DType::F32));
  // AMX tiles hold 16 query lanes a row: only targets with 16 float lanes take them.
  if (amx != nullptr && lanes == amx::kRows) w.amx = amx, w.amx_layout = amx_layout;
  const int64_t row0 = (b * p.q_heads + h) * p.q_len + i0;

  // ---- Set up: Qt = scale * Q^T, Ot = 0, each query's softmax started (with its sink, if any),
  // or Ot and the softmax state as the residues left them.
  StartQueryTile(p, b, h, i0, 1, rows, br, w);
  if (carried) {
    const Rows<const float> partial{p.output.data, p.output.batch_stride, p.output.head_stride, p.output.row_stride};
    step::PackTransposed(partial, b, h, i0, rows, dv, br, 1.0f, w.out_t);
    std::copy_n(p.row_max + row0, rows, w.running_max);
    std::copy_n(p.row_sum + row0, rows, w.row_sum);
  }

  // AMX: Qt's parts (a query tile holding NaN or inf stays float32), then the tile state.
  if (w.amx) {
    if (amx::split_pairs(p.amx_parts, true, w.q_t, br, br, dk, w.amx_layout->dk_pad / 2, w.amx + w.amx_layout->q,
                         w.amx_layout->q_part)) {
      amx::configure();
    } else {
      w.amx = nullptr;
    }
  }

  if (vectors == 1) {
    QueryTileKeys<1>(p, b, h, i0, rows, w, next);
  } else if (vectors == 2) {
    QueryTileKeys<2>(p, b, h, i0, rows, w, next);
  } else {
    QueryTileKeys<kTileVectors>(p, b, h, i0, rows, w, next);
  }
  if (w.amx) amx::release();

  // ---- Finish each query: O = Ot^T / l, then lse and the row stats, each the tile's `rows`
  // contiguous floats of its (B, Hq, Nq) array written as one run (W0 on two threads: about 1%
  // faster than a store of each per row).
  step::FinishColumns(w.running_max, w.row_sum, br, w.correction, w.scores);
  step::UnpackTransposed(w.out_t, br, rows, dv, w.correction, p.output, b, h, i0);
  std::copy_n(w.scores, rows, p.lse + row0);
  std::copy_n(w.running_max, rows, p.row_max + row0);
  std::copy_n(w.row_sum, rows, p.row_sum + row0);
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <omp.h>

#include "core/allocator.hpp"

namespace qkv::detail {

HWY_EXPORT(QueryTileRows);
HWY_EXPORT(VectorLanes);
HWY_EXPORT(FlashQueryTile);
HWY_EXPORT(StridedResidues);
HWY_EXPORT(CompiledTarget);

void flash_attention(const AttentionProblem& problem) {
  const int64_t nq = problem.q_len;
  if (problem.batch == 0 || problem.q_heads == 0 || nq == 0) return;

  const size_t br = HWY_DYNAMIC_DISPATCH(QueryTileRows)();
  const int64_t lanes = static_cast<int64_t>(HWY_DYNAMIC_DISPATCH(VectorLanes)());
  const QueryTiles tiling(nq, lanes, static_cast<int64_t>(br) / lanes);
  const int64_t query_tiles = tiling.count;
  const int64_t heads = problem.batch * problem.q_heads;
  const int64_t items = heads * query_tiles;

  // Per-worker scratch, sized up front: each block a whole number of cache lines, 64-byte
  // aligned, so workers never share a line and the hot loop never allocates.
  // A problem too small to pay for waking the other threads runs on the calling thread.
  const double flops = 4.0 * static_cast<double>(items) * static_cast<double>(br) *
                       static_cast<double>(problem.kv_len) * static_cast<double>(problem.head_dim + problem.value_dim) / 2;
  const int threads = threads_for(flops);
  const int workers = static_cast<int>(std::min<int64_t>(threads, items));
  const size_t block =
      flash::ScratchLayout(br, static_cast<size_t>(problem.head_dim), static_cast<size_t>(problem.value_dim),
                           problem.kv_dtype != DType::F32).total;
  // The calling thread's workspace holds every worker's block and is kept for the next call.
  float* scratch = thread_workspace(WorkspaceSlot::FlashScratch).floats(static_cast<size_t>(workers) * block);
  const auto block_of_this_thread = [&] { return scratch + static_cast<size_t>(worker_index(workers)) * block; };

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

  // The AMX products (MatmulPrecision High or Medium, a CPU with AMX, 16 float lanes): each
  // worker's block, none of them holding a head's splits yet. A block grows with Nk (a head's K
  // and V split), and stays in the calling thread's workspace for the next call as flash's scratch
  // does. Past 64 MiB a worker (64K keys at d = 128 with two parts) or 1 GiB in all, or when the
  // allocation fails, the products stay float32 (amx::worker_blocks).
  flash::AmxLayout amx_layout;
  uint16_t* amx_blocks = nullptr;
  if (problem.amx_parts > 0 && lanes == static_cast<int64_t>(amx::kRows) && amx::available()) {
    amx_layout = flash::AmxLayout(problem.amx_parts, br, static_cast<size_t>(problem.head_dim),
                                  static_cast<size_t>(problem.value_dim), static_cast<size_t>(problem.kv_len));
    amx_blocks = amx::worker_blocks(amx_layout.total, workers);
    for (int worker = 0; amx_blocks != nullptr && worker < workers; ++worker)
      *reinterpret_cast<flash::AmxHeld*>(amx_blocks + static_cast<size_t>(worker) * amx_layout.total) = {
          -1, -1, 0, flash::kAllFit};
  }
  const auto amx_block_of_this_thread = [&]() -> uint16_t* {
    return amx_blocks != nullptr ? amx_blocks + static_cast<size_t>(worker_index(workers)) * amx_layout.total : nullptr;
  };

  // Items in (batch, head, query tile) order, so neighbouring items share K and V in cache (a
  // thread's share is whole heads, simd/item_shares.hpp); within a head the last query tiles come
  // first: under a causal mask they see the most keys, so a share runs its longest items first
  // and leaves its shortest at the back, where other threads take them.
  const auto query_tile_of = [&](int64_t item) {
    const int64_t bh = item / query_tiles, tile = query_tiles - 1 - item % query_tiles;
    return flash::QueryTile{bh / problem.q_heads, bh % problem.q_heads, tiling.first_query(tile), tiling.rows(tile)};
  };
  for_each_item(workers, items, [&](int64_t item) {
    const flash::QueryTile at = query_tile_of(item);
    const flash::QueryTile next = item + 1 < items ? query_tile_of(item + 1) : flash::QueryTile{};  // a guess
    HWY_DYNAMIC_DISPATCH(FlashQueryTile)(tiles, tiles_problem.has_value(), at.b, at.h, at.i0,
                                         static_cast<size_t>(at.rows), block_of_this_thread(),
                                         amx_block_of_this_thread(), &amx_layout, next);
  });
}

int64_t flash_attention_compiled_targets() { return HWY_TARGETS; }

int64_t flash_attention_target() { return HWY_DYNAMIC_DISPATCH(CompiledTarget)(); }

}  // namespace qkv::detail
#endif  // HWY_ONCE
