// The flash kernels' products, per SIMD target, each on float32 micro-GEMMs
// (gemm/micro_kernel-inl.h: "broadcast an element of A, load a row of B", A read with any
// strides) or on AMX tiles (gemm/amx.hpp, bf16 parts of the operands, operands-inl.h):
//   forward   S^T  = K Qt          (Bc x Br, depth Dk)   ForwardProducts::Scores
//             Ot  += V^T P^T       (Dv x Br, depth Bc)   ForwardProducts::Accumulate
//   backward  S^T  = K Qt          (Bc x Br, depth Dk)   BackwardProducts::Scores (or decode's order)
//             dV  += P'^T dO       (Bc x Dv, depth Br)   BackwardProducts::GradV
//             dP^T = V dOt         (Bc x Br, depth Dv)   BackwardProducts::GradP
//             dK  += dS^T Q        (Bc x Dk, depth Br)   BackwardProducts::GradKQ
//             dQ  += dS K          (Br x Dk, depth Bc)   (on AMX: dQ^T += K^T dS^T)
// The choice is made once per query tile (the products object the kernel builds at the item's
// start: an AMX block when the tile's splits fit); within it, a key tile or pair whose own
// splits do not fit runs float32. Every function here inlines into the kernel's per-target
// loop: no indirect call per tile.
//
// Included inside a Highway foreach_target pass (the -inl.h convention), after operands-inl.h.
#if defined(QKV_ATTENTION_FLASH_PRODUCTS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_FLASH_PRODUCTS_INL_H_
#undef QKV_ATTENTION_FLASH_PRODUCTS_INL_H_
#else
#define QKV_ATTENTION_FLASH_PRODUCTS_INL_H_
#endif

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "attention/flash/operands-inl.h"
#include "attention/kernels.hpp"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace flash_steps {

using tile_gemm::Gemm;
using tile_gemm::PanelGemm;

// Where a key tile is: queries i0, i0 + query_step, ... (`rows` real) of head (b, h), keys j0,
// j0 + key_step, ... (`cols`) of its kv head g.
struct TileAt {
  int64_t b, h, g, i0;
  size_t rows;
  int64_t j0;
  size_t cols;
  // The line of key j of the tile, over its queries (the pipeline's steps walk lines).
  step::Line line(const step::Walk& walk, size_t j) const {
    return step::Line{b, h, i0, j0 + static_cast<int64_t>(j) * walk.key_step, walk.query_step, 0};
  }
};

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

// Whether the V rows of the tile that a zero weight may meet are finite (a hidden key's V may be
// NaN or Inf, and 0 x NaN would reach the output through the GEMM): every row when a rule, a
// tensor term or dropout can zero any weight; under the band alone only the keys some query of
// the tile does not see, [j0, first key all see) and [last key all see, j_end) (a causal
// diagonal tile: its rows past the first query, not all 64, since checking them all cost
// noticeably: docs/performance-log.md, "flash/").
inline bool HiddenValuesFinite(const AttentionProblem& p, const step::Walk& walk, const step::TileMask& mask,
                               const TileAt& t, const KvTile& kv) {
  const size_t dv = static_cast<size_t>(p.value_dim);
  if (walk.residue || mask.hide >= 0 || !p.terms.empty() || !p.rule.empty() || p.dropout_p > 0)
    return step::RowsFinite(kv.v, t.cols, dv, kv.v_stride);
  const int64_t j_end = t.j0 + static_cast<int64_t>(t.cols), i_last = t.i0 + static_cast<int64_t>(t.rows) - 1;
  const int64_t all_from = std::clamp(p.first_visible_key(i_last), t.j0, j_end);
  const int64_t all_to = std::clamp(p.last_visible_key(t.b, t.i0), all_from, j_end);
  return step::RowsFinite(kv.v, static_cast<size_t>(all_from - t.j0), dv, kv.v_stride) &&
         step::RowsFinite(kv.v + (all_to - t.j0) * kv.v_stride, static_cast<size_t>(j_end - all_to), dv, kv.v_stride);
}

// ---- Forward: a query tile of V vectors (br = V lanes-wide), one key tile at a time.
struct ForwardProducts {
  int parts = 0;                                  // bf16 parts per operand (AMX)
  uint16_t* amx = nullptr;                        // the worker's AMX block, or null: float32
  const flash::ForwardAmxLayout* at = nullptr;

  // Whether this key tile's products run on AMX tiles: the tiles of consecutive keys (a
  // residue's are S apart) whose head's K and V, split through the tile's last Bc keys, fit.
  bool OnAmx(const AttentionProblem& p, const step::Walk& walk, const TileAt& t) const {
    return amx != nullptr && walk.key_step == 1 && !walk.residue &&
           AmxSplitKeys(p, t.b, t.g, t.j0 + static_cast<int64_t>(kKeyTile), amx, *at);
  }

  // S^T = K_tile Qt: (cols, Br), already scaled (Qt carries the scale); K read in place (the
  // query vectors `trim` leaves), or its parts on AMX tiles (whole blocks of 16 keys: the rows
  // past cols are never read).
  template <size_t V>
  HWY_INLINE void Scores(const AttentionProblem& p, bool on_amx, const KvTile& kv, const std::array<size_t, V>& trim,
                         const TileAt& t, const ForwardScratch& w) const {
    const size_t lanes = hn::Lanes(DF()), br = V * lanes, dk = static_cast<size_t>(p.head_dim);
    if (on_amx) {
      amx::product(parts, amx + at->k + static_cast<size_t>(t.j0) * at->dk_pad, at->dk_pad, at->k_part,
                   (t.cols + amx::kRows - 1) / amx::kRows, amx + at->q, at->q_part, at->dk_pad / amx::kDepth, br,
                   w.scores, br, false);
      return;
    }
    const float* HWY_RESTRICT k_tile = kv.k;
    const size_t k_stride = static_cast<size_t>(kv.k_stride);
    ForEachTrimmedRun(trim, [&](auto width, size_t skip, size_t begin, size_t end) {
      PanelGemm<decltype(width)::value, true>(end - begin, dk, k_tile + begin * k_stride, k_stride, 1,
                                              w.q_t + skip * lanes, br, w.scores + begin * br + skip * lanes, br,
                                              false);
    });
  }

  // Ot = correction * Ot + V_tile^T P^T (the correction when some max grew): A(c, j) = V[j0 + j,
  // c], row stride 1 and depth stride V's row stride. `skip_zeros`: a hidden key's V may be NaN
  // or Inf, so zero weights are skipped (accumulate_skipping_zeros). On AMX tiles: P^T's parts
  // (zero past cols), then the product over whole steps of 32 keys (the keys past cols that the
  // last step takes have zero weights and finite, split V rows).
  template <size_t V>
  HWY_INLINE void Accumulate(const AttentionProblem& p, bool on_amx, bool skip_zeros, bool max_grew, const KvTile& kv,
                             const std::array<size_t, V>& trim, const TileAt& t, const ForwardScratch& w) const {
    const size_t lanes = hn::Lanes(DF()), br = V * lanes, dv = static_cast<size_t>(p.value_dim);
    const float* HWY_RESTRICT v_tile = kv.v;
    if (skip_zeros) {
      if (max_grew) step::RescaleColumns(w.out_t, dv, br, w.correction);
      accumulate_skipping_zeros(t.rows, t.cols, dv, w.scores, 1, br, v_tile, kv.v_stride, w.out_t, 1, br);
    } else if (on_amx && dv % amx::kRows == 0) {
      if (max_grew) step::RescaleColumns(w.out_t, dv, br, w.correction);
      const size_t key_steps = (t.cols + amx::kDepth - 1) / amx::kDepth;
      amx::split_pairs(parts, false, w.scores, br, br, t.cols, key_steps * amx::kDepth / 2, amx + at->p, at->p_part);
      amx::product(parts, amx + at->v + t.j0, at->n_pad, at->v_part, dv / amx::kRows, amx + at->p, at->p_part,
                   key_steps, br, w.out_t, br, true);
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
};

// ---- Backward: one (query tile, key tile) pair.

// to[c] = factor * from[c], plus what to[c] held when `add`, for c < n.
inline void ScaleInto(float* HWY_RESTRICT to, const float* HWY_RESTRICT from, size_t n, float factor, bool add) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const auto f = hn::Set(df, factor);
  size_t c = 0;
  for (; c + lanes <= n; c += lanes) {
    const auto scaled = hn::Mul(f, hn::LoadU(df, from + c));
    hn::StoreU(add ? hn::Add(hn::LoadU(df, to + c), scaled) : scaled, df, to + c);
  }
  for (; c < n; ++c) to[c] = add ? to[c] + factor * from[c] : factor * from[c];
}

// S^T (cols keys j0, j0 + key_step, ..., Br queries) in decode's order (attention/steps/
// dot_scores-inl.h): the scores of a forward that ran decode, bit for bit. Past the last key the
// pointers repeat it (its scores land in rows of weights_t that nothing reads).
HWY_INLINE void DecodeOrderScores(const AttentionProblem& p, int64_t b, int64_t g, int64_t j0, int64_t key_step,
                                  size_t cols, const BackwardScratch& w) {
  const size_t dk = static_cast<size_t>(p.head_dim), full = dk / hn::Lanes(DF()) * hn::Lanes(DF());
  constexpr size_t kKeys = dot_scores::kKeys;
  for (size_t j = 0; j < cols; j += kKeys) {
    const float* keys[kKeys];
    for (size_t x = 0; x < kKeys; ++x)
      keys[x] = p.k.row(b, g, j0 + static_cast<int64_t>(std::min(j + x, cols - 1)) * key_step);
    dot_scores::ScoreRows(w.br, dk, full, w.q_scaled, w.dk_pad, keys, w.weights_t + j * w.br, 1, w.br);
  }
}

struct BackwardProducts {
  const AmxTiles* amx = nullptr;  // the pair's AMX tiles (its key block's and query tile's splits fit), or null
  bool decode_scores = false;     // S^T in decode's order (the forward ran decode)

  // AMX tiles take whole blocks of 16 keys (rows past cols are zero in the splits) and steps of
  // 32 keys or queries (zero past cols and Br).
  static size_t KeyBlocks(size_t cols) { return round_up(cols, amx::kRows) / amx::kRows; }
  static size_t QuerySteps(size_t br) { return round_up(br, amx::kDepth) / amx::kDepth; }

  // (Bc, Br) = the key block's split rows (K or V, depth_pad wide) times the query tile's split
  // pairs (Qt or dOt): S^T and dP'^T.
  void KeysTimesQueries(const flash::AmxArray& rows, size_t depth_pad, const flash::AmxArray& pairs, size_t cols,
                        size_t br, float* HWY_RESTRICT out) const {
    amx::product(amx->parts, (*amx)(rows) + amx->key * depth_pad, depth_pad, rows.part, KeyBlocks(cols), (*amx)(pairs),
                 pairs.part, depth_pad / amx::kDepth, br, out, br, false);
  }

  // S^T = K_tile Qt into w.weights_t (keys j0, j0 + key_step, ...).
  HWY_INLINE void Scores(const AttentionProblem& p, int64_t key_step, const TileAt& t, const BackwardScratch& w) const {
    if (decode_scores)
      DecodeOrderScores(p, t.b, t.g, t.j0, key_step, t.cols, w);
    else if (amx)
      KeysTimesQueries(amx->at->k, amx->at->dk_pad, amx->at->q_t, t.cols, w.br, w.weights_t);
    else
      Gemm(t.cols, w.br, static_cast<size_t>(p.head_dim), p.k.row(t.b, t.g, t.j0),
           static_cast<size_t>(p.k.row_stride * key_step), 1, w.q_t, w.br, w.weights_t, w.br, false);
  }

  // dV += P'^T dO (into the key block's accumulator keys.grad_v); float32 where P'^T's split
  // does not fit.
  HWY_INLINE void GradV(const AttentionProblem& p, const float* dropped, const QueryRows& query_rows,
                        const KeyBlock& keys, const BackwardScratch& w) const {
    const size_t br = w.br, dv_pad = w.dv_pad;
    if (amx && SplitTileRows(false, dropped, keys.cols, br, *amx))
      amx::product(amx->parts, (*amx)(amx->at->tile_rows), amx->at->br_pad, amx->at->tile_rows.part,
                   KeyBlocks(keys.cols), (*amx)(amx->at->grad_out_pairs), amx->at->grad_out_pairs.part,
                   QuerySteps(br), static_cast<size_t>(p.value_dim), keys.grad_v, dv_pad, true);
    else
      Gemm(keys.cols, w.dv_cols, br, dropped, br, 1, query_rows.grad_out, query_rows.grad_out_stride, keys.grad_v,
           dv_pad, true);
  }

  // dP'^T = V_tile dOt into w.grad_t.
  HWY_INLINE void GradP(const AttentionProblem& p, int64_t key_step, const TileAt& t, const BackwardScratch& w) const {
    if (amx)
      KeysTimesQueries(amx->at->v, amx->at->dv_pad, amx->at->grad_out_t, t.cols, w.br, w.grad_t);
    else
      Gemm(t.cols, w.br, static_cast<size_t>(p.value_dim), p.v.row(t.b, t.g, t.j0),
           static_cast<size_t>(p.v.row_stride * key_step), 1, w.grad_out_t, w.br, w.grad_t, w.br, false);
  }

  // dK += dS^T Q (scaled when stored); dQ += dS K (scaled when flushed, or K packed scaled), on
  // AMX tiles as dQ^T += K^T dS^T when dS^T's splits fit. dQ goes into the query tile's
  // accumulator w.grad_q, or, where a hidden key's K is not finite, into grad_q's rows (the
  // tile's queries) skipping zero dS so the NaN reaches no row. Returns whether dQ went the
  // float32 way.
  HWY_INLINE bool GradKQ(const AttentionProblem& p, const QueryRows& query_rows, const KeyBlock& keys,
                         const Rows<float>& grad_q, const TileAt& t, const BackwardScratch& w) const {
    const size_t br = w.br, dk = static_cast<size_t>(p.head_dim), cols = keys.cols;
    const size_t key_steps = round_up(cols, amx::kDepth) / amx::kDepth;
    const bool amx_grad = amx && SplitTileRows(true, w.grad_t, cols, br, *amx) &&
                          amx::split_pairs(amx->parts, true, w.grad_t, br, br, cols, key_steps * amx::kDepth / 2,
                                           (*amx)(amx->at->grad_pairs), amx->at->grad_pairs.part);
    if (amx_grad) {
      const flash::BackwardAmxLayout* at = amx->at;
      amx::product(amx->parts, (*amx)(at->tile_rows), at->br_pad, at->tile_rows.part, KeyBlocks(cols),
                   (*amx)(at->q_pairs), at->q_pairs.part, QuerySteps(br), dk, keys.grad_k, w.dk_pad, true);
      amx::product(amx->parts, (*amx)(at->k_t) + amx->key, at->key_cols, at->k_t.part, dk / amx::kRows,
                   (*amx)(at->grad_pairs), at->grad_pairs.part, key_steps, br, amx->grad_q_t(), br, true);
      return false;
    }
    Gemm(cols, w.dk_cols, br, w.grad_t, br, 1, query_rows.q, query_rows.q_stride, keys.grad_k, w.dk_pad, true);
    if (keys.k_finite)
      Gemm(t.rows, w.dk_cols, cols, w.grad_t, 1, br, keys.k_rows, keys.k_stride, w.grad_q, w.dk_pad, true);
    else
      accumulate_skipping_zeros(t.rows, cols, dk, w.grad_t, 1, br, keys.k_rows, static_cast<int64_t>(keys.k_stride),
                                grad_q.row(t.b, t.h, 0), static_cast<size_t>(grad_q.row_stride), 1);
    return true;
  }
};

// The query tile's dQ accumulator (w.grad_q, Br x Dk_pad) times `factor` (KeyBlock's
// grad_q_scale) added into the rows i0, i0 + step, ... of grad_q_out, then zeroed for the next
// block of key tiles (unless no pair added into it: `floats` false); with `amx`, then the AMX
// products' dQ^T (Dk x Br) times the scale.
inline void FlushGradQ(const AttentionProblem& p, int64_t b, int64_t h, int64_t i0, int64_t step, size_t rows,
                       float factor, const Rows<float>& grad_q_out, const BackwardScratch& w, bool floats,
                       const AmxTiles* amx) {
  const size_t dk = static_cast<size_t>(p.head_dim);
  if (floats) {
    for (size_t i = 0; i < rows; ++i)
      ScaleInto(grad_q_out.row(b, h, i0 + static_cast<int64_t>(i) * step), w.grad_q + i * w.dk_pad, dk, factor, true);
    std::fill_n(w.grad_q, rows * w.dk_pad, 0.0f);
  }
  if (amx == nullptr) return;
  amx::add_transposed(amx->grad_q_t(), w.br, rows, dk, p.scale, grad_q_out.row(b, h, i0),
                      static_cast<size_t>(grad_q_out.row_stride * step));
  std::fill_n(amx->grad_q_t(), dk * w.br, 0.0f);
}

// The key tile's gradients, summed over every query of the group, into the rows of keys j0,
// j0 + step, ...: stored, or added to what the tiles stored (`add`, the strided residues).
inline void FinishKeyTile(const AttentionBackwardProblem& bp, int64_t b, int64_t g, int64_t j0, int64_t step,
                          size_t cols, bool add, const BackwardScratch& w) {
  const AttentionProblem& p = bp.forward;
  for (size_t j = 0; j < cols; ++j) {
    const int64_t key = j0 + static_cast<int64_t>(j) * step;
    ScaleInto(bp.grad_k.row(b, g, key), w.grad_k + j * w.dk_pad, static_cast<size_t>(p.head_dim), p.scale, add);
    ScaleInto(bp.grad_v.row(b, g, key), w.grad_v + j * w.dv_pad, static_cast<size_t>(p.value_dim), 1.0f, add);
  }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace flash_steps
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // QKV_ATTENTION_FLASH_PRODUCTS_INL_H_ toggle
