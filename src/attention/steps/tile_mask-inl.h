// Steps "classify" and "mask", structured part: how the band, the key lengths and the rule treat
// a whole tile (ClassifyMaskTile), -inf where the band and key lengths hide a key (MaskBandLines
// over a tile's key lines, MaskBand over one line), the tensor terms (MaskTerms), and the lines a
// causal diagonal tile's products may skip (DiagonalTrim). The symbolic rule per line is
// mask_rule-inl.h.
//
// Included inside a Highway foreach_target pass (the -inl.h convention), through pipeline-inl.h or
// on its own.

// Per-target include guard (Highway's pattern: toggles once per target).
#if defined(QKV_ATTENTION_STEPS_TILE_MASK_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_STEPS_TILE_MASK_INL_H_
#undef QKV_ATTENTION_STEPS_TILE_MASK_INL_H_
#else
#define QKV_ATTENTION_STEPS_TILE_MASK_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "attention/problem.hpp"
#include "attention/steps/lines-inl.h"
#include "attention/steps/operands-inl.h"
#include "attention/steps/pack-inl.h"
#include "hwy/highway.h"
#include "mask/rule.hpp"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace pipeline {
namespace hn = hwy::HWY_NAMESPACE;

// How the band and key lengths treat a tile of queries [i0, i_last] x keys [j0, j_end): both
// ends of a query's visible range grow with the query, so the first and last rows decide.
enum class TileClass { Hidden, Partial, Full };
HWY_INLINE TileClass ClassifyTile(const AttentionProblem& p, int64_t b, int64_t i0, int64_t i_last, int64_t j0,
                                  int64_t j_end) {
  if (p.last_visible_key(b, i_last) <= j0 || p.first_visible_key(i0) >= j_end) return TileClass::Hidden;
  if (p.first_visible_key(i_last) <= j0 && p.last_visible_key(b, i0) >= j_end) return TileClass::Full;
  return TileClass::Partial;
}

// The same for the whole mask, the symbolic rule (mask/rule.hpp) of query head h included: a tile
// the band or the rule hides is skipped; one both fully show needs no per-element mask work.
HWY_INLINE TileClass ClassifyMaskTile(const AttentionProblem& p, int64_t b, int64_t h, int64_t i0, int64_t i_last,
                                      int64_t j0, int64_t j_end) {
  const TileClass band = ClassifyTile(p, b, i0, i_last, j0, j_end);
  if (band == TileClass::Hidden || p.rule.empty()) return band;
  const TileVisibility rule = p.rule.classify(b, h, i0, i_last, j0, j_end - 1);
  if (rule == TileVisibility::Hidden) return TileClass::Hidden;
  return band == TileClass::Full && rule == TileVisibility::Full ? TileClass::Full : TileClass::Partial;
}

// ---- Step "mask", structured part: -inf where the band (band_lo <= j - i <= band_hi) or the
// key length (j < key_lengths[b]) hides the key; only hidden elements are written.
//
// A tile of key lines (flash's, its backward's, their strided residues'): line l the key
// j0 + l key_step over queries i0 + x q (q > 0, x < br, whole vectors), lines br floats apart.
// Each line sees its key in one run of lanes, x in [ceil((j - i0 - band_hi) / q),
// floor((j - i0 - band_lo) / q)] (empty past the key length): the vectors outside the run are
// stored -inf whole, the one or two it cuts by a masked store, those inside are not touched: a
// vector's edges are decided once a line, not lane by lane, and the whole tile is one call.
HWY_INLINE int64_t FloorDiv(int64_t a, int64_t q) { return a >= 0 ? a / q : -((-a + q - 1) / q); }

// Band edges within +-2^61 (Mask's unbounded is 2^60), so that j - i0 - edge cannot overflow.
constexpr int64_t kBandEdgeFar = int64_t{1} << 61;

HWY_INLINE void MaskBandLines(const AttentionProblem& p, int64_t b, int64_t i0, int64_t q, int64_t j0,
                              int64_t key_step, float* HWY_RESTRICT s, size_t br, size_t lines) {
  const DF df;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(df)), count = static_cast<int64_t>(br);
  const VF minus_inf = hn::Set(df, kMinusInf);
  const int64_t key_length = p.key_lengths[static_cast<size_t>(b)];
  constexpr int64_t kFar = kBandEdgeFar;
  const int64_t hi = std::clamp(p.band_hi, -kFar, kFar), lo = std::clamp(p.band_lo, -kFar, kFar);
  for (size_t l = 0; l < lines; ++l) {
    const int64_t key = j0 + static_cast<int64_t>(l) * key_step, from_i0 = key - i0;
    int64_t first = 0, end = 0;  // the visible run of lanes
    // ceil((j - i0 - hi) / q) and floor((j - i0 - lo) / q) + 1, without a division when q = 1
    if (key < key_length) {
      first = std::clamp<int64_t>(q == 1 ? from_i0 - hi : -FloorDiv(hi - from_i0, q), 0, count);
      end = std::clamp<int64_t>((q == 1 ? from_i0 - lo : FloorDiv(from_i0 - lo, q)) + 1, first, count);
    }
    float* HWY_RESTRICT line = s + l * br;
    for (int64_t x = 0; x < count; x += lanes) {
      if (x >= first && x + lanes <= end) continue;  // all visible
      if (x + lanes <= first || x >= end) {          // all hidden
        hn::Store(minus_inf, df, line + x);
        continue;
      }
      const auto seen = hn::AndNot(hn::FirstN(df, static_cast<size_t>(std::max<int64_t>(first - x, 0))),
                                   hn::FirstN(df, static_cast<size_t>(std::min(end - x, lanes))));
      hn::BlendedStore(minus_inf, hn::Not(seen), df, line + x);
    }
  }
}

// The first line of a tile of consecutive keys (from j0) and queries (from i0, in lanes) from
// which the band hides every lane of query vector v, as MaskBandLines decides (a vector whose
// lanes all lie before the first visible one: key j >= i0 + band_hi + (v + 1) lanes), clamped to
// [0, lines). On the causal diagonal the products may skip vector v's lines from there on: the
// mask stores -inf in them whatever the scores held, and their weights are 0.
HWY_INLINE size_t BandHidesVectorFrom(const AttentionProblem& p, int64_t i0, int64_t j0, size_t v, size_t lines) {
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(DF()));
  const int64_t hi = std::clamp(p.band_hi, -kBandEdgeFar, kBandEdgeFar);
  return static_cast<size_t>(
      std::clamp<int64_t>(i0 + hi + static_cast<int64_t>(v + 1) * lanes - j0, 0, static_cast<int64_t>(lines)));
}

// One line of n floats (whole vectors): a line of one key over queries as above, any other
// (decode's one query over keys) lane by lane.
HWY_INLINE void MaskBand(const AttentionProblem& p, const Line& line, float* HWY_RESTRICT s, size_t n) {
  if (line.key_step == 0 && line.query_step > 0)
    return MaskBandLines(p, line.b, line.i0, line.query_step, line.j0, 0, s, n, 1);
  const DF df;
  const DI di;
  const size_t lanes = hn::Lanes(df);
  const int32_t diagonal_step = static_cast<int32_t>(line.key_step - line.query_step);  // of j - i
  const int32_t key_step = static_cast<int32_t>(line.key_step);
  const auto lanes_index = hn::Iota(di, 0);
  const auto lo = hn::Set(di, ClampEdge(p.band_lo)), hi = hn::Set(di, ClampEdge(p.band_hi));
  const auto key_len = hn::Set(di, ClampEdge(p.key_lengths[static_cast<size_t>(line.b)]));
  const VF minus_inf = hn::Set(df, kMinusInf);
  for (size_t x = 0; x < n; x += lanes) {
    const auto diagonal = hn::Add(hn::Mul(lanes_index, hn::Set(di, diagonal_step)),
                                  hn::Set(di, ClampEdge(line.key(x) - line.query(x))));
    const auto key = hn::Add(hn::Mul(lanes_index, hn::Set(di, key_step)), hn::Set(di, ClampEdge(line.key(x))));
    const auto visible = hn::And(hn::And(hn::Not(hn::Lt(diagonal, lo)), hn::Not(hn::Gt(diagonal, hi))),
                                 hn::Lt(key, key_len));
    hn::BlendedStore(minus_inf, hn::RebindMask(df, hn::Not(visible)), df, s + x);
  }
}

// ---- Step "mask", tensor terms, in the reference's order (after the band): a keep 0 hides, an
// additive term adds (-inf hides even a NaN score). One line of `count` real elements, the term's
// values `step` floats apart: contiguous ones by whole vectors (the same operations lane by
// lane), the rest one by one.
HWY_INLINE void MaskTermLine(const float* HWY_RESTRICT values, int64_t step, bool additive, float* HWY_RESTRICT s,
                             size_t count) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const VF minus_inf = hn::Set(df, kMinusInf), zero = hn::Zero(df);
  size_t x = 0;
  for (; step == 1 && x + lanes <= count; x += lanes) {
    const VF value = hn::LoadU(df, values + x), score = hn::LoadU(df, s + x);
    hn::StoreU(additive ? hn::IfThenElse(hn::Eq(value, minus_inf), minus_inf, hn::Add(score, value))
                        : hn::IfThenElse(hn::Eq(value, zero), minus_inf, score),
               df, s + x);
  }
  for (; x < count; ++x) {
    const float value = values[static_cast<int64_t>(x) * step];
    if (additive) {
      s[x] = value == kMinusInf ? kMinusInf : s[x] + value;
    } else if (value == 0.0f) {
      s[x] = kMinusInf;
    }
  }
}

// Every term over one line (decode's one query over keys; a tile's line where its term is not
// read by TileTerms' transposes).
HWY_INLINE void MaskTerms(const AttentionProblem& p, const Line& line, float* HWY_RESTRICT s, size_t count) {
  for (const MaskTermView& term : p.terms)
    MaskTermLine(term.data + line.b * term.stride_b + line.h * term.stride_h + line.i0 * term.stride_q +
                     line.j0 * term.stride_k,
                 line.query_step * term.stride_q + line.key_step * term.stride_k, term.additive, s, count);
}

// Whether a tile reads a term by its rows: a term laid out by query rows (keys contiguous, one
// row per query), a tile of consecutive queries and keys.
HWY_INLINE bool TermByRows(const MaskTermView& term, const Walk& walk) {
  return term.stride_k == 1 && term.stride_q != 0 && walk.key_step == 1 && walk.query_step == 1 && !walk.residue;
}

// The terms over a tile's `cols` key lines (line l: key j0 + l walk.key_step over the `rows` real
// queries from i0, lines br floats apart). A term laid out by query rows is read as rows and
// transposed in registers into `term_t` (Bc x Br floats; PackTransposed): read by key lines in
// place, each line gathered one float per query, Nk floats apart, missing L1 on each (the
// W1-bias forward ran 1.7-1.8 x W1 so; docs/flex.md). Other terms line by line.
HWY_INLINE void TileTerms(const AttentionProblem& p, const Walk& walk, int64_t b, int64_t h, int64_t i0, size_t rows,
                          int64_t j0, size_t cols, size_t br, float* HWY_RESTRICT s, float* HWY_RESTRICT term_t) {
  for (const MaskTermView& term : p.terms) {
    if (term_t != nullptr && TermByRows(term, walk)) {
      PackTransposed(Rows<const float>{term.data + j0, term.stride_b, term.stride_h, term.stride_q}, b, h, i0, rows,
                     cols, br, 1.0f, term_t);
      for (size_t l = 0; l < cols; ++l) MaskTermLine(term_t + l * br, 1, term.additive, s + l * br, rows);
      continue;
    }
    for (size_t l = 0; l < cols; ++l) {
      const int64_t j = j0 + static_cast<int64_t>(l) * walk.key_step;
      const float* values = term.data + b * term.stride_b + h * term.stride_h + i0 * term.stride_q + j * term.stride_k;
      MaskTermLine(values, walk.query_step * term.stride_q, term.additive, s + l * br, rows);
    }
  }
}

// Prefetches (into L2) the part of a tensor laid out by query rows that a tile of consecutive
// queries and keys reads (or writes: the backward's dbias): its `rows` rows from i0, `cols`
// floats each from key j0, the keys past kv_len left out. Issued a tile ahead: a tile's rows, Nk
// floats apart, are streams the hardware prefetchers pick up only after some misses.
HWY_INLINE void PrefetchTileRows(const AttentionProblem& p, const float* data, int64_t stride_b, int64_t stride_h,
                                 int64_t stride_q, int64_t b, int64_t h, int64_t i0, size_t rows, int64_t j0,
                                 size_t cols, bool write) {
  const int64_t keys = std::min(static_cast<int64_t>(cols), p.kv_len - j0);
  if (keys <= 0) return;
  PrefetchRows(Rows<const float>{data + j0, stride_b, stride_h, stride_q}, b, h, i0, 1, static_cast<int64_t>(rows),
               keys, write);
}

// The tile's part of every term TileTerms reads by rows, prefetched (above).
HWY_INLINE void PrefetchTermTiles(const AttentionProblem& p, const Walk& walk, int64_t b, int64_t h, int64_t i0,
                                  size_t rows, int64_t j0, size_t cols) {
  for (const MaskTermView& m : p.terms)
    if (TermByRows(m, walk))
      PrefetchTileRows(p, m.data, m.stride_b, m.stride_h, m.stride_q, b, h, i0, rows, j0, cols, false);
}

// Step "diagonal trim": the lines (keys) of a tile each query vector's products need, on the
// causal diagonal. trim[v] (v < vectors) = the line from which the band hides every query of
// vector v (BandHidesVectorFrom; trim[vectors - 1] = lines), so vectors v, ..., vectors - 1 run
// on lines [trim[v - 1], trim[v]) (trim[-1] = 0): the products that make scores need not compute
// what the mask overwrites with -inf, and those that take weights or dS need not add their zeros.
// Only for tiles of consecutive keys and queries whose mask is the band and the rule (which hide,
// never show): an additive term could make a hidden pair's weight NaN (+inf + -inf), which the
// float32 products carry on.
HWY_INLINE void DiagonalTrim(const AttentionProblem& p, const Walk& walk, const TileMask& mask, int64_t i0, int64_t j0,
                             size_t lines, size_t vectors, size_t* HWY_RESTRICT trim) {
  std::fill_n(trim, vectors, lines);
  if (!mask.band || walk.key_step != 1 || walk.query_step != 1 || walk.residue || !p.terms.empty()) return;
  for (size_t v = 0; v + 1 < vectors; ++v) trim[v] = BandHidesVectorFrom(p, i0, j0, v, lines);
}

}  // namespace pipeline
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
