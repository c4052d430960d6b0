// The flash kernels' operands, per SIMD target: each worker's view of its scratch, and the
// loading of what the products read. K and V are read in place when they are float32 and
// widened into scratch when they are 16-bit (forward); the query tile is packed transposed,
// queries in the lanes (Qt, dOt), and where a tile or a dim is not whole, or K not finite, rows
// are copied padded (backward); on AMX tiles, the operands are split into bf16 parts
// (gemm/amx.hpp) once per query tile, key block or K/V head, and a split that a value does not
// fit (NaN, inf, inf in bf16) leaves its products float32.
//
// Included inside a Highway foreach_target pass (the -inl.h convention), after
// attention/steps/pipeline-inl.h.
#if defined(QKV_ATTENTION_FLASH_OPERANDS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_FLASH_OPERANDS_INL_H_
#undef QKV_ATTENTION_FLASH_OPERANDS_INL_H_
#else
#define QKV_ATTENTION_FLASH_OPERANDS_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "attention/flash/layout.hpp"
#include "attention/problem.hpp"
#include "attention/steps/dot_scores-inl.h"
#include "attention/steps/pipeline-inl.h"
#include "gemm/amx.hpp"
#include "simd/kv_load-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace flash_steps {
namespace hn = hwy::HWY_NAMESPACE;
namespace step = pipeline;

using DF = hn::ScalableTag<float>;
using flash::kKeyBlock;
using flash::kKeyTile;

// ---- Forward.

// One forward worker's view of its scratch block (flash::ForwardScratchLayout).
struct ForwardScratch {
  float *q_t, *scores, *out_t, *running_max, *row_sum, *correction, *k_wide, *v_wide, *score_mod, *term_t;
  ForwardScratch(float* base, const flash::ForwardScratchLayout& l)
      : q_t(base + l.q_t), scores(base + l.scores), out_t(base + l.out_t), running_max(base + l.running_max),
        row_sum(base + l.row_sum), correction(base + l.correction), k_wide(base + l.k_wide),
        v_wide(base + l.v_wide), score_mod(base + l.score_mod), term_t(base + l.term_t) {}
};

// Step "load a tile" for 16-bit K/V: rows [j0, j0 + cols) of head (b, g) widened into `to`
// (packed, `dim` floats a row), SIMD over each row and a scalar tail.
template <class T>
inline void WidenTile(const Rows<const uint16_t>& rows, int64_t b, int64_t g, int64_t j0, size_t cols, size_t dim,
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

// Step "load a tile" for quantized K/V: rows [0, cols) of `rows` and their scales dequantised
// into `to` (packed, `dim` floats a row).
inline void DequantizeTile(bool int4, const Rows<const uint8_t>& rows, const Rows<const float>& scales, int64_t b,
                           int64_t g, size_t cols, size_t dim, float* HWY_RESTRICT to) {
  for (size_t j = 0; j < cols; ++j) {
    const int64_t i = static_cast<int64_t>(j);
    kv::DequantizeRow(DF(), int4, rows.row(b, g, i), scales.row(b, g, i), dim, to + j * dim);
  }
}

// The K and V tiles of keys j0, j0 + key_step, ... (cols of them) as floats: read in place when
// they are, widened into the worker's scratch when they are 16-bit or quantized.
struct KvTile {
  const float* k;
  int64_t k_stride;
  const float* v;
  int64_t v_stride;
};
inline KvTile LoadKvTile(const AttentionProblem& p, int64_t b, int64_t g, int64_t j0, int64_t key_step, size_t cols,
                         const ForwardScratch& w) {
  if (p.kv_dtype == DType::F32)
    return {p.k.row(b, g, j0), p.k.row_stride * key_step, p.v.row(b, g, j0), p.v.row_stride * key_step};
  const size_t dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim);
  if (is_quantized(p.kv_dtype)) {
    const bool int4 = p.kv_dtype == DType::I4;
    DequantizeTile(int4, step::EveryStepRows(p.k_quant, j0, key_step), step::EveryStepRows(p.k_scales, j0, key_step),
                   b, g, cols, dk, w.k_wide);
    DequantizeTile(int4, step::EveryStepRows(p.v_quant, j0, key_step), step::EveryStepRows(p.v_scales, j0, key_step),
                   b, g, cols, dv, w.v_wide);
    return {w.k_wide, std::max<int64_t>(p.head_dim, 1), w.v_wide, std::max<int64_t>(p.value_dim, 1)};
  }
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

// Step "softmax", the start of a query tile of br lanes: Qt packed (queries i0, i0 + step, ...,
// `rows` of them, scaled), Ot = 0 and each query's softmax started (with its sink, if any).
inline void StartQueryTile(const AttentionProblem& p, int64_t b, int64_t h, int64_t i0, int64_t query_step,
                           size_t rows, size_t br, const ForwardScratch& w) {
  step::PackTransposed(step::EveryStepRows(p.q, i0, query_step), b, h, 0, rows, static_cast<size_t>(p.head_dim), br,
                       p.scale, w.q_t);
  std::fill_n(w.out_t, static_cast<size_t>(p.value_dim) * br, 0.0f);
  std::fill_n(w.running_max, br, step::InitialMax(p, h));
  std::fill_n(w.row_sum, br, step::InitialSum(p));
}

// The AMX block's splits of head (b, g)'s K and V up to key `need` (whole key tiles, zeros past
// Nk), a key tile at a time, starting over when the block held another head's. Whether every key
// before `need` fits the parts (no NaN, no inf, none rounding to inf): if not, the tile stays
// float32. That depends on the keys alone, not on how far this worker split the head before (a
// worker's earlier tiles must not decide a later tile's path, or the output would change with
// the threads' shares).
inline bool AmxSplitKeys(const AttentionProblem& p, int64_t b, int64_t g, int64_t need, uint16_t* amx,
                         const flash::ForwardAmxLayout& at) {
  auto* held = reinterpret_cast<flash::AmxHeld*>(amx);
  if (held->b != b || held->g != g) *held = {b, g, 0, flash::kAllFit};
  const int64_t tile = static_cast<int64_t>(kKeyTile), n_pad = static_cast<int64_t>(at.n_pad);
  const size_t dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim);
  while (held->keys < need && held->keys < n_pad && held->unfit_from == flash::kAllFit) {
    const int64_t from = held->keys, to = std::min(from + tile, n_pad);
    const int64_t rows = std::clamp<int64_t>(p.kv_len - from, 0, to - from);
    const int64_t first = rows > 0 ? from : 0;  // a row that exists, read only when rows > 0
    const bool k_fits = amx::split_rows(p.amx_parts, true, p.k.row(b, g, first), static_cast<size_t>(p.k.row_stride),
                                        static_cast<size_t>(rows), dk, amx + at.k + static_cast<size_t>(from) * at.dk_pad,
                                        at.dk_pad, static_cast<size_t>(to - from), at.dk_pad, at.k_part);
    const bool v_fits = amx::split_transposed(p.amx_parts, p.v.row(b, g, first), static_cast<size_t>(p.v.row_stride),
                                              static_cast<size_t>(rows), dv, amx + at.v + from, at.n_pad,
                                              static_cast<size_t>(to - from), at.v_part);
    if (!(k_fits && v_fits)) held->unfit_from = from;
    held->keys = to;
  }
  return need <= held->unfit_from;
}

// ---- Backward.

// One backward worker's view of its scratch block (flash::BackwardScratchLayout), for query tiles
// of br queries.
struct BackwardScratch {
  size_t br, dk_pad, dv_pad;
  size_t dk_cols, dv_cols;  // Dk and Dv rounded up to whole vectors: the columns the products compute
  float *q_t, *grad_out_t, *q_rows, *grad_out_rows, *q_scaled, *weights_t, *dropped_t, *grad_t, *softcap_t, *k_rows,
      *grad_k, *grad_v, *grad_q, *shift, *scale, *row_dot, *score_mod, *term_t;
  BackwardScratch(float* s, size_t br_, const flash::BackwardScratchLayout& l)
      : br(br_), dk_pad(l.dk_pad), dv_pad(l.dv_pad), dk_cols(round_up(l.dk, hn::Lanes(DF()))),
        dv_cols(round_up(l.dv, hn::Lanes(DF()))), q_t(s + l.q_t), grad_out_t(s + l.grad_out_t),
        q_rows(s + l.q_rows), grad_out_rows(s + l.grad_out_rows), q_scaled(s + l.q_scaled),
        weights_t(s + l.weights_t), dropped_t(s + l.dropped_t), grad_t(s + l.grad_t), softcap_t(s + l.softcap_t),
        k_rows(s + l.k_rows), grad_k(s + l.grad_k), grad_v(s + l.grad_v), grad_q(s + l.grad_q), shift(s + l.shift),
        scale(s + l.scale), row_dot(s + l.row_dot), score_mod(s + l.score_mod), term_t(s + l.term_t) {}
};

// The keys of a pair: cols keys from j0; the K rows dQ = dS K reads (k_rows, k_stride apart) and
// the factor dQ's sum still needs (grad_q_scale): K in place and the scale, or scale * K packed
// in scratch and 1 where a key's K is not finite (k_finite false) or Dk is not whole vectors; the
// dK, dV accumulators of those rows in the worker's scratch.
struct KeyBlock {
  int64_t j0;
  size_t cols;
  const float* k_rows;
  size_t k_stride;
  float grad_q_scale;
  float *grad_k, *grad_v;
  bool k_finite;

  // `count` of these keys from the at-th, the first of them key `first`.
  KeyBlock Part(size_t at, size_t count, int64_t first, const BackwardScratch& w) const {
    return {first, count, k_rows + at * k_stride, k_stride, grad_q_scale, grad_k + at * w.dk_pad,
            grad_v + at * w.dv_pad, k_finite};
  }
};

// The rows of Q and dO that dK += dS^T Q and dV += P'^T dO read (the products' B), q_stride and
// grad_out_stride floats apart.
struct QueryRows {
  const float* q;
  size_t q_stride;
  const float* grad_out;
  size_t grad_out_stride;
};

// A worker's AMX block (flash::BackwardAmxLayout) where a pair's products run on AMX tiles: the
// key block's and query tile's splits fit the parts. `key`: the pair's first key, counted from
// the key block's first.
struct AmxTiles {
  int parts;
  const flash::BackwardAmxLayout* at;
  uint16_t* base;
  size_t key;
  uint16_t* operator()(const flash::AmxArray& array) const { return base + array.at; }
  float* grad_q_t() const { return reinterpret_cast<float*>(base + at->grad_q_t.at); }
};

// Copies `rows` rows of `d` floats of head (b, h) from row i0 into a padded (br, d_pad) block.
HWY_INLINE void PackRows(const Rows<const float>& a, int64_t b, int64_t h, int64_t i0, size_t rows, size_t d,
                         size_t d_pad, size_t br, float* HWY_RESTRICT out) {
  std::fill_n(out, br * d_pad, 0.0f);
  for (size_t i = 0; i < rows; ++i) std::copy_n(a.row(b, h, i0 + static_cast<int64_t>(i)), d, out + i * d_pad);
}

// Decode's Qs for the tile's `rows` queries (view q): scale * Q rows, dk_pad apart, as decode
// packs them (one rounded product per element); the padding rows zero, so their scores are 0.
HWY_INLINE void PackScaledRows(const Rows<const float>& q, int64_t b, int64_t h, size_t rows, size_t dk, float scale,
                               const BackwardScratch& w) {
  std::fill_n(w.q_scaled, w.br * w.dk_pad, 0.0f);
  for (size_t i = 0; i < rows; ++i) {
    const float* row = q.row(b, h, static_cast<int64_t>(i));
    for (size_t d = 0; d < dk; ++d) w.q_scaled[i * w.dk_pad + d] = scale * row[d];
  }
}

// The query tile i0, i0 + step, ... (`rows` queries) of head (b, h): Qt = scale * Q^T and dOt
// (queries in lanes), and per query the weights' shift and scale and D; returns where Q's and
// dO's rows are. A whole tile (rows = Br, Dk and Dv whole vectors) is read in place (with K, it
// measured no slower than copying: docs/performance-log.md, "flash/"); any other is copied into
// scratch, padded with zeros (padding queries have P = dS = 0, but 0 x NaN from a row past the
// tile would not be). Padding lanes see nothing (shift +inf, scale 0).
inline QueryRows PackQueryTile(const AttentionBackwardProblem& bp, int64_t b, int64_t h, int64_t i0, int64_t step,
                               size_t rows, const float* HWY_RESTRICT row_dot_all, const BackwardScratch& w) {
  const AttentionProblem& p = bp.forward;
  const size_t dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim);
  const Rows<const float> q = step::EveryStepRows(p.q, i0, step), grad_out = step::EveryStepRows(bp.grad_output, i0, step);
  step::PackTransposed(q, b, h, 0, rows, dk, w.br, p.scale, w.q_t);
  step::PackTransposed(grad_out, b, h, 0, rows, dv, w.br, 1.0f, w.grad_out_t);
  QueryRows in_rows{q.row(b, h, 0), static_cast<size_t>(q.row_stride), grad_out.row(b, h, 0),
                    static_cast<size_t>(grad_out.row_stride)};
  if (rows != w.br || w.dk_cols != dk || w.dv_cols != dv) {
    PackRows(q, b, h, 0, rows, dk, w.dk_pad, w.br, w.q_rows);
    PackRows(grad_out, b, h, 0, rows, dv, w.dv_pad, w.br, w.grad_out_rows);
    in_rows = {w.q_rows, w.dk_pad, w.grad_out_rows, w.dv_pad};
  }
  if (bp.decode_scores) PackScaledRows(q, b, h, rows, dk, p.scale, w);
  const int64_t row0 = (b * p.q_heads + h) * p.q_len + i0;
  for (size_t i = 0; i < w.br; ++i) {
    const int64_t row = row0 + static_cast<int64_t>(i) * step;
    w.shift[i] = i < rows ? bp.row_shift[row] : step::kInf;
    w.scale[i] = i < rows ? bp.row_scale[row] : 0.0f;
    w.row_dot[i] = i < rows ? row_dot_all[row] : 0.0f;
  }
  return in_rows;
}

// The key tile of keys j0, j0 + step, ... (cols of them) of kv head (b, g): K for the dQ product
// (KeyBlock: in place, or scale * K packed and padded), dK and dV accumulators at 0.
inline KeyBlock StartKeyTile(const AttentionProblem& p, int64_t b, int64_t g, int64_t j0, int64_t step, size_t cols,
                             const BackwardScratch& w) {
  const size_t dk = static_cast<size_t>(p.head_dim);
  const int64_t k_stride = p.k.row_stride * step;
  const bool k_finite = step::RowsFinite(p.k.row(b, g, j0), cols, dk, k_stride);
  std::fill_n(w.grad_k, (cols + amx::kRows) * w.dk_pad, 0.0f);  // and the 16 rows AMX tiles may add 0 into
  std::fill_n(w.grad_v, (cols + amx::kRows) * w.dv_pad, 0.0f);
  if (k_finite && w.dk_cols == dk)
    return {j0, cols, p.k.row(b, g, j0), static_cast<size_t>(k_stride), p.scale, w.grad_k, w.grad_v, true};
  for (size_t j = 0; j < cols; ++j) {
    const float* k_row = p.k.row(b, g, j0 + static_cast<int64_t>(j) * step);
    for (size_t c = 0; c < dk; ++c) w.k_rows[j * w.dk_pad + c] = p.scale * k_row[c];
    std::fill(w.k_rows + j * w.dk_pad + dk, w.k_rows + (j + 1) * w.dk_pad, 0.0f);
  }
  return {j0, cols, w.k_rows, w.dk_pad, 1.0f, w.grad_k, w.grad_v, k_finite};
}

// The key block's splits (keys j0 .. j0 + cols - 1 of kv head (b, g)): K and V rows, K^T. False
// when some value does not fit the parts (NaN, inf, or inf in bf16): the block stays float32.
inline bool SplitKeyBlock(const AttentionProblem& p, int64_t b, int64_t g, int64_t j0, size_t cols,
                          const AmxTiles& amx) {
  const flash::BackwardAmxLayout& at = *amx.at;
  const size_t dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim);
  const size_t k_stride = static_cast<size_t>(p.k.row_stride), v_stride = static_cast<size_t>(p.v.row_stride);
  const float *k = p.k.row(b, g, j0), *v = p.v.row(b, g, j0);
  // Zero as far as a pair of these keys reads: 16-row blocks and 32-key steps from its first key.
  const size_t rows_pad = round_up(cols + amx::kRows - 1, amx::kRows);
  const size_t cols_pad = round_up(cols + amx::kDepth - 1, amx::kRows);
  return amx::split_rows(amx.parts, true, k, k_stride, cols, dk, amx(at.k), at.dk_pad, rows_pad, at.dk_pad,
                         at.k.part) &&
         amx::split_rows(amx.parts, true, v, v_stride, cols, dv, amx(at.v), at.dv_pad, rows_pad, at.dv_pad,
                         at.v.part) &&
         amx::split_transposed(amx.parts, k, k_stride, cols, dk, amx(at.k_t), at.key_cols, cols_pad, at.k_t.part);
}

// The query tile's splits for the AMX products: PackQueryTile's Qt and dOt (in pairs of depth
// rows) and Q's and dO's rows (`rows` of the tile's w.br queries, zero past them, in pairs of
// queries). False when some value does not fit the parts: the tile's pairs stay float32.
inline bool SplitQueryTile(const AttentionProblem& p, const QueryRows& query_rows, size_t rows,
                           const BackwardScratch& w, const AmxTiles& amx) {
  const flash::BackwardAmxLayout& at = *amx.at;
  const size_t dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim), br = w.br;
  const size_t query_pairs = round_up(br, amx::kDepth) / 2;
  return amx::split_pairs(amx.parts, true, w.q_t, br, br, dk, at.dk_pad / 2, amx(at.q_t), at.q_t.part) &&
         amx::split_pairs(amx.parts, true, w.grad_out_t, br, br, dv, at.dv_pad / 2, amx(at.grad_out_t),
                          at.grad_out_t.part) &&
         amx::split_pairs(amx.parts, true, query_rows.q, query_rows.q_stride, dk, rows, query_pairs, amx(at.q_pairs),
                          at.q_pairs.part) &&
         amx::split_pairs(amx.parts, true, query_rows.grad_out, query_rows.grad_out_stride, dv, rows, query_pairs,
                          amx(at.grad_out_pairs), at.grad_out_pairs.part);
}

// A (cols, Br) tile of the pair (P'^T or dS^T) split into rows for the AMX products whose depth
// is the queries (dV, dK): whole blocks of 16 keys, zero past cols and past Br. `round` as
// amx::split_rows: the weights P'^T are truncated (as the forward's P), dS^T rounded; both
// checked (P' is inf where the caller's lse is far below the true one: dV goes float32 there).
inline bool SplitTileRows(bool round, const float* tile, size_t cols, size_t br, const AmxTiles& amx) {
  const flash::BackwardAmxLayout& at = *amx.at;
  return amx::split_rows(amx.parts, round, tile, br, cols, br, amx(at.tile_rows), at.br_pad, round_up(cols, amx::kRows),
                         round_up(br, amx::kDepth), at.tile_rows.part);
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace flash_steps
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // QKV_ATTENTION_FLASH_OPERANDS_INL_H_ toggle
