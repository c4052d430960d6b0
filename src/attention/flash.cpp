// The flash kernel: softmax(Q K^T * scale + mask) V by tiles of queries x keys with an online
// softmax (FlashAttention-2's forward, ggml's flash_attn_ext), never materialising more than one
// Bc x Br tile of scores per worker. Same semantics as reference.cpp, dropout included; writes
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
// once per item (2 n d floats, from L2: consecutive items share a head), against 4 Br n d flops;
// Qt + St + Ot = (2 d + Bc) Br floats stay in L1 (d = 64: 36 KB of Zen 5's 48 KB). The micro-GEMM
// does kTileRows x kTileVectors FMAs per kTileRows broadcasts + kTileVectors loads.
//
// Masks: the band (causal, window) and key lengths give each query a key range
// [first_visible_key, last_visible_key); a key tile outside every range of the query tile is
// skipped (causal costs about half), a tile inside every range runs with no per-element mask
// work, the rest mask per element. Tensor terms are read per tile, per element. Score
// modifiers (softcap, ALiBi) and the sink are the pipeline's steps (pipeline-inl.h), as is every
// step named below.
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
#include <numeric>
#include <optional>
#include <vector>

#include "attention/flash.hpp"
#include "attention/problem.hpp"

namespace qkv::detail::flash {

// Bc, keys per tile: large enough to amortise the per-tile rescale of Ot (Dv x Br multiplies)
// and its load/store in the second product over Bc FMAs each; small enough that St (Bc x Br)
// stays in L1 beside Qt and Ot. The same for every target.
constexpr size_t kKeyTile = 64;

// One worker's scratch, offsets in floats from a 64-byte aligned base; every part starts on
// its own cache line. br = queries per tile (per target), dk/dv = head and value dims.
struct ScratchLayout {
  size_t q_t, scores, out_t, running_max, row_sum, correction, nan_seen, k_wide, v_wide;
  size_t gather_out, gather_max, gather_sum, gather_correction;  // the strided diagonals' softmax
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
    nan_seen = take(br);               // per query: 1 once a visible score was NaN
    gather_out = take(br * dv);        // O of the gathered diagonals, row-major (Br, Dv)
    gather_max = take(br);
    gather_sum = take(br);
    gather_correction = take(br);
    k_wide = take(wide_kv ? kKeyTile * dk : 0);  // 16-bit K/V: the tile widened to float
    v_wide = take(wide_kv ? kKeyTile * dv : 0);
    total = at;
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

// Br, queries per work item: exactly the micro-tile width, so one micro-GEMM call spans the
// whole query tile and its running max / sum are kTileVectors vectors (48 queries on AVX-512).
size_t QueryTileRows() { return kTileVectors * hn::Lanes(DF()); }

// This target's HWY_TARGET bit, so tests can see which code a dispatch reaches.
int64_t CompiledTarget() { return HWY_TARGET; }

// One worker's view of its scratch block (flash::ScratchLayout).
struct Scratch {
  float *q_t, *scores, *out_t, *running_max, *row_sum, *correction, *nan_seen, *k_wide, *v_wide;
  float *gather_out, *gather_max, *gather_sum, *gather_correction;
  Scratch(float* base, const flash::ScratchLayout& l)
      : q_t(base + l.q_t), scores(base + l.scores), out_t(base + l.out_t), running_max(base + l.running_max),
        row_sum(base + l.row_sum), correction(base + l.correction), nan_seen(base + l.nan_seen),
        k_wide(base + l.k_wide), v_wide(base + l.v_wide), gather_out(base + l.gather_out),
        gather_max(base + l.gather_max), gather_sum(base + l.gather_sum), gather_correction(base + l.gather_correction) {}
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

// The K and V tiles of keys [j0, j0 + cols) as floats: read in place when they are, widened
// into the worker's scratch when they are 16-bit.
struct KvTile {
  const float* k;
  int64_t k_stride;
  const float* v;
  int64_t v_stride;
};
KvTile LoadKvTile(const AttentionProblem& p, int64_t b, int64_t g, int64_t j0, size_t cols, const Scratch& w) {
  if (p.kv_dtype == DType::F32) return {p.k.row(b, g, j0), p.k.row_stride, p.v.row(b, g, j0), p.v.row_stride};
  const size_t dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim);
  if (p.kv_dtype == DType::BF16) {
    WidenTile<hwy::bfloat16_t>(p.k_bits, b, g, j0, cols, dk, w.k_wide);
    WidenTile<hwy::bfloat16_t>(p.v_bits, b, g, j0, cols, dv, w.v_wide);
  } else {
    WidenTile<hwy::float16_t>(p.k_bits, b, g, j0, cols, dk, w.k_wide);
    WidenTile<hwy::float16_t>(p.v_bits, b, g, j0, cols, dv, w.v_wide);
  }
  return {w.k_wide, std::max<int64_t>(p.head_dim, 1), w.v_wide, std::max<int64_t>(p.value_dim, 1)};
}

// One key tile [j0, j0 + cols) of work item (b, h, i0): scores, modifiers and mask, the online
// softmax update, dropout, and Ot += V^T P^T.
void FlashKeyTile(const AttentionProblem& p, int64_t b, int64_t h, int64_t i0, size_t rows, int64_t j0, size_t cols,
                  bool fully_visible, const Scratch& w) {
  const size_t br = QueryTileRows();
  const size_t dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim);
  const int64_t g = p.kv_head_of(h);
  const KvTile kv = LoadKvTile(p, b, g, j0, cols, w);
  const float* HWY_RESTRICT k_tile = kv.k;
  const float* HWY_RESTRICT v_tile = kv.v;

  // 1. S^T = K_tile Qt: (cols, Br), already scaled (Qt carries the scale); K read in place.
  PanelGemm<kTileVectors>(cols, dk, k_tile, static_cast<size_t>(kv.k_stride), 1, w.q_t, br, w.scores, br, false);
  // 2. Modifiers and mask, one key line over the tile's queries at a time.
  const bool per_element = !fully_visible || p.softcap > 0 || p.alibi_slopes || !p.terms.empty();
  if (per_element)
    for (size_t j = 0; j < cols; ++j)
      step::ScoresToLogits(p, {b, h, i0, j0 + static_cast<int64_t>(j), 1, 0}, w.scores + j * br, br, rows,
                           !fully_visible);
  // 3. Online softmax, one lane per query; Ot moves to the new max when some max grew.
  if (step::SoftmaxColumnsUpdate(w.scores, cols, br, w.running_max, w.row_sum, w.correction, w.nan_seen))
    step::RescaleColumns(w.out_t, dv, br, w.correction);
  // 4. Dropout on P (scaling exp(s - m) is scaling exp(s - m) / l at the end).
  if (p.dropout_p > 0)
    for (size_t j = 0; j < cols; ++j)
      step::Dropout(p, {b, h, i0, j0 + static_cast<int64_t>(j), 1, 0}, w.scores + j * br, rows);
  // 5. Ot += V_tile^T P^T: A(c, j) = V[j0 + j, c], row stride 1 and depth stride V's row stride.
  // Skipping zero weights when a hidden key's V may be NaN or Inf.
  const bool some_hidden = !fully_visible || !p.terms.empty() || p.dropout_p > 0;
  if (some_hidden && !step::RowsFinite(v_tile, cols, dv, kv.v_stride)) {
    accumulate_skipping_zeros(rows, cols, dv, w.scores, 1, br, v_tile, kv.v_stride, w.out_t, 1, br);
  } else {
    PanelGemm<kTileVectors>(dv, cols, v_tile, 1, static_cast<size_t>(kv.v_stride), w.scores, br, w.out_t, br, true);
  }
}

// ---- The strided part of a `rest | strided(S, O)` rule (StridedSplit, mask_rule.hpp), gathered
// by diagonals: on j - i = d (d = O mod S) query i0 + x meets key i0 + x + d, a line with query
// and key steps (1, 1) that every pipeline step reads. Up to Bc diagonals make one St tile with
// its own online softmax and a row-major O, merged with the tiles' at the end (as decode merges
// chunks). The tiles evaluate `rest`; the diagonals hide what `rest` shows, so no pair counts twice.

HWY_INLINE float Dot(const float* HWY_RESTRICT a, const float* HWY_RESTRICT b, size_t n) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  auto acc0 = hn::Zero(df), acc1 = hn::Zero(df);  // two chains of FMAs, not one
  size_t c = 0;
  for (; c + 2 * lanes <= n; c += 2 * lanes) {
    acc0 = hn::MulAdd(hn::LoadU(df, a + c), hn::LoadU(df, b + c), acc0);
    acc1 = hn::MulAdd(hn::LoadU(df, a + c + lanes), hn::LoadU(df, b + c + lanes), acc1);
  }
  for (; c + lanes <= n; c += lanes) acc0 = hn::MulAdd(hn::LoadU(df, a + c), hn::LoadU(df, b + c), acc0);
  float sum = hn::GetLane(hn::SumOfLanes(df, hn::Add(acc0, acc1)));
  for (; c < n; ++c) sum += a[c] * b[c];
  return sum;
}

// out[c] += weight * v[c], c < n.
HWY_INLINE void Axpy(float weight, const float* HWY_RESTRICT v, float* HWY_RESTRICT out, size_t n) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const auto w = hn::Set(df, weight);
  size_t c = 0;
  for (; c + lanes <= n; c += lanes) hn::StoreU(hn::MulAdd(w, hn::LoadU(df, v + c), hn::LoadU(df, out + c)), df, out + c);
  for (; c < n; ++c) out[c] += weight * v[c];
}

// Scores, modifiers and mask of diagonal d for the tile's queries into s (Br floats): -inf where
// the key is outside [0, Nk), or the band, key lengths, tensor terms hide it, or `rest` shows it.
void DiagonalLogits(const AttentionProblem& p, const StridedSplit& split, int64_t b, int64_t h, int64_t i0,
                    size_t rows, int64_t d, float* HWY_RESTRICT s) {
  const size_t br = QueryTileRows(), dk = static_cast<size_t>(p.head_dim);
  const int64_t g = p.kv_head_of(h), j_of_x0 = i0 + d;
  const size_t x_lo = static_cast<size_t>(std::clamp<int64_t>(-j_of_x0, 0, static_cast<int64_t>(rows)));
  const size_t x_hi = static_cast<size_t>(std::clamp<int64_t>(p.kv_len - j_of_x0, static_cast<int64_t>(x_lo),
                                                              static_cast<int64_t>(rows)));
  for (size_t x = 0; x < br; ++x) {
    const int64_t i = i0 + static_cast<int64_t>(x);
    s[x] = x >= x_lo && x < x_hi ? p.scale * Dot(p.q.row(b, h, i), p.k.row(b, g, i + d), dk) : 0.0f;
  }
  const step::Line line{b, h, i0, j_of_x0, 1, 1};
  step::ModifyScores(p, line, s, br);
  step::MaskBand(p, line, s, br);
  if (x_hi > x_lo) {  // the rule and the terms read only real (query, key) pairs
    const int64_t at = static_cast<int64_t>(x_lo);
    const step::Line real{b, h, i0 + at, j_of_x0 + at, 1, 1};
    step::MaskWhereRuleShows(p.rule, split.rest, real, s + x_lo, x_hi - x_lo);
    step::MaskTerms(p, real, s + x_lo, x_hi - x_lo);
  }
  std::fill(s, s + x_lo, step::kMinusInf);
  std::fill(s + x_hi, s + br, step::kMinusInf);
}

// The diagonals d0, d0 + S, ... (cols of them) of work item (b, h, i0): one St tile, its online
// softmax into gather_max / gather_sum, dropout, gather_out += P V.
void GatherDiagonals(const AttentionProblem& p, const StridedSplit& split, int64_t b, int64_t h, int64_t i0,
                     size_t rows, int64_t d0, size_t cols, const Scratch& w) {
  const size_t br = QueryTileRows(), dv = static_cast<size_t>(p.value_dim);
  const int64_t g = p.kv_head_of(h);
  for (size_t c = 0; c < cols; ++c)
    DiagonalLogits(p, split, b, h, i0, rows, d0 + static_cast<int64_t>(c) * split.stride, w.scores + c * br);
  if (step::SoftmaxColumnsUpdate(w.scores, cols, br, w.gather_max, w.gather_sum, w.gather_correction, w.nan_seen))
    for (size_t x = 0; x < rows; ++x)
      for (size_t c = 0; c < dv; ++c) w.gather_out[x * dv + c] *= w.gather_correction[x];
  for (size_t c = 0; c < cols; ++c) {
    const int64_t d = d0 + static_cast<int64_t>(c) * split.stride;
    float* s = w.scores + c * br;
    if (p.dropout_p > 0) step::Dropout(p, {b, h, i0, i0 + d, 1, 1}, s, rows);
    for (size_t x = 0; x < rows; ++x)  // a zero weight (a hidden or outside key) is skipped
      if (s[x] != 0.0f) Axpy(s[x], p.v.row(b, g, i0 + static_cast<int64_t>(x) + d), w.gather_out + x * dv, dv);
  }
}

// Every strided diagonal a query of the item may see, by tiles of Bc diagonals, then merged into
// the tiles' running max, sum and Ot: m = max(m1, m2), O = O1 e^(m1 - m) + O2 e^(m2 - m), likewise l.
void GatherStrided(const AttentionProblem& p, const StridedSplit& split, int64_t b, int64_t h, int64_t i0, size_t rows,
                   const Scratch& w) {
  const size_t br = QueryTileRows(), dv = static_cast<size_t>(p.value_dim);
  std::fill_n(w.gather_out, br * dv, 0.0f);
  std::fill_n(w.gather_max, br, step::kMinusInf);
  std::fill_n(w.gather_sum, br, 0.0f);
  const int64_t i_last = i0 + static_cast<int64_t>(rows) - 1;
  const int64_t d_min = std::max(p.band_lo, -i_last);  // a key >= 0 for the last query
  const int64_t d_max = std::min(p.band_hi, p.key_lengths[static_cast<size_t>(b)] - 1 - i0);
  if (d_min > d_max) return;
  const int64_t tile = static_cast<int64_t>(kKeyTile) * split.stride;
  for (int64_t d0 = d_min + floor_mod(split.offset - d_min, split.stride); d0 <= d_max; d0 += tile) {
    const size_t cols = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(kKeyTile), (d_max - d0) / split.stride + 1));
    GatherDiagonals(p, split, b, h, i0, rows, d0, cols, w);
  }
  for (size_t x = 0; x < rows; ++x) {
    const float m1 = w.running_max[x], m2 = w.gather_max[x];
    if (m2 == step::kMinusInf) continue;  // no diagonal key visible to this query
    const float m = std::max(m1, m2);
    const float f1 = m1 == step::kMinusInf ? 0.0f : std::exp(m1 - m), f2 = std::exp(m2 - m);
    for (size_t c = 0; c < dv; ++c) w.out_t[c * br + x] = w.out_t[c * br + x] * f1 + w.gather_out[x * dv + c] * f2;
    w.row_sum[x] = w.row_sum[x] * f1 + w.gather_sum[x] * f2;
    w.running_max[x] = m;
  }
}

// One work item: query head h of batch b, queries [i0, i0 + Br) (fewer at the end of Nq).
// `scratch` is this worker's block, laid out by flash::ScratchLayout.
// `split`: the strided keys to gather by diagonals (p.rule's root is then `rest`), or nullptr.
void FlashQueryTile(const AttentionProblem& p, const StridedSplit* split, int64_t b, int64_t h, int64_t i0,
                    float* HWY_RESTRICT scratch) {
  const size_t br = QueryTileRows();
  const size_t dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim);
  const int64_t nk = p.kv_len;
  const size_t rows = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(br), p.q_len - i0));
  const Scratch w(scratch, flash::ScratchLayout(br, dk, dv, p.kv_dtype != DType::F32));

  // ---- Set up: Qt = scale * Q^T, Ot = 0, each query's softmax started (with its sink, if any).
  step::PackTransposed(p.q, b, h, i0, rows, dk, br, p.scale, w.q_t);
  std::fill_n(w.out_t, dv * br, 0.0f);
  std::fill_n(w.running_max, br, step::InitialMax(p, h));
  std::fill_n(w.row_sum, br, step::InitialSum(p));
  std::fill_n(w.nan_seen, br, 0.0f);

  // The keys any query of the tile sees; key tiles outside [kv_begin, kv_end) are never visited.
  const int64_t i_last = i0 + static_cast<int64_t>(rows) - 1;
  const int64_t kv_begin = std::min(p.first_visible_key(i0), nk);
  const int64_t kv_end = p.last_visible_key(b, i_last);
  for (int64_t j0 = kv_begin; j0 < kv_end; j0 += static_cast<int64_t>(kKeyTile)) {
    const size_t cols = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(kKeyTile), kv_end - j0));
    const step::TileClass tile = step::ClassifyMaskTile(p, b, h, i0, i_last, j0, j0 + static_cast<int64_t>(cols));
    if (tile == step::TileClass::Hidden) continue;
    FlashKeyTile(p, b, h, i0, rows, j0, cols, tile == step::TileClass::Full, w);
  }
  if (split) GatherStrided(p, *split, b, h, i0, rows, w);

  // ---- Finish each query: O = Ot^T / l, lse and the row stats.
  const int64_t row0 = (b * p.q_heads + h) * p.q_len + i0;
  for (size_t i = 0; i < rows; ++i)
    finish_row(w.out_t + i, br, dv, w.running_max[i], w.row_sum[i], w.nan_seen[i] > 0,
                    p.output.row(b, h, i0 + static_cast<int64_t>(i)), p.lse + row0 + static_cast<int64_t>(i),
                    p.row_max + row0 + static_cast<int64_t>(i), p.row_sum + row0 + static_cast<int64_t>(i));
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <omp.h>

#include "memory.hpp"

namespace qkv::detail {

HWY_EXPORT(QueryTileRows);
HWY_EXPORT(FlashQueryTile);
HWY_EXPORT(CompiledTarget);

namespace {
// The order a head's query tiles run in: the last first (under a causal mask they see the most
// keys, and dynamic scheduling balances best when the longest items start first). With strided
// keys gathered (stride > 0), tiles whose diagonals meet the same key rows run one after the
// other: tile t's diagonal d reads rows br t + d.., as does tile t + P's diagonal d - P br when
// P br is a multiple of the stride, so K and V stay in cache from one tile to the next.
std::vector<int64_t> tile_order(int64_t tiles, int64_t br, int64_t stride) {
  const int64_t period = stride > 0 ? stride / std::gcd(br, stride) : 1;  // lcm(br, stride) / br
  std::vector<int64_t> order;
  order.reserve(static_cast<size_t>(tiles));
  for (int64_t r = 0; r < std::min(period, tiles); ++r)
    for (int64_t t = tiles - 1 - r; t >= 0; t -= period) order.push_back(t);
  return order;
}
}  // namespace

void flash_attention(const AttentionProblem& problem) {
  const int64_t nq = problem.q_len;
  if (problem.batch == 0 || problem.q_heads == 0 || nq == 0) return;

  const size_t br = HWY_DYNAMIC_DISPATCH(QueryTileRows)();
  const int64_t query_tiles = (nq + static_cast<int64_t>(br) - 1) / static_cast<int64_t>(br);
  const int64_t items = problem.batch * problem.q_heads * query_tiles;

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
  // A `rest | strided(S)` rule with S >= Bc: the tiles see `rest`, the strided keys are gathered
  // (from float K/V rows; 16-bit K/V take the tiles, which widen what they load).
  const StridedSplit split = strided_split(problem.rule, static_cast<int64_t>(flash::kKeyTile));
  std::optional<AttentionProblem> tiles_problem;
  if (split.rest >= 0 && problem.kv_dtype == DType::F32) {
    tiles_problem = problem;
    tiles_problem->rule.root_node = split.rest;
  }
  const AttentionProblem& tiles = tiles_problem ? *tiles_problem : problem;
  const StridedSplit* gather = tiles_problem ? &split : nullptr;
  const std::vector<int64_t> order = tile_order(query_tiles, static_cast<int64_t>(br), gather ? split.stride : 0);

  // Items in (batch, head, query tile) order, so neighbouring items share K and V in cache;
  // within a head the last query tiles come first: under a causal mask they see the most keys,
  // and dynamic scheduling balances best when the longest items start first.
#pragma omp parallel for schedule(dynamic) num_threads(workers)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t bh = item / query_tiles;
    const int64_t tile = order[static_cast<size_t>(item % query_tiles)];
    float* block_start = scratch + static_cast<size_t>(omp_get_thread_num()) * block;
    HWY_DYNAMIC_DISPATCH(FlashQueryTile)(tiles, gather, bh / problem.q_heads, bh % problem.q_heads,
                                         tile * static_cast<int64_t>(br), block_start);
  }
}

int64_t flash_attention_compiled_targets() { return HWY_TARGETS; }

int64_t flash_attention_target() { return HWY_DYNAMIC_DISPATCH(CompiledTarget)(); }

}  // namespace qkv::detail
#endif  // HWY_ONCE
