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
// so neither K nor V is ever copied.
//
// Memory traffic per item (Dk = Dv = d, visible keys n): Q and O once (2 Br d floats), K and V
// once per item (2 n d floats, from L2: consecutive items share a head), against 4 Br n d flops;
// Qt + St + Ot = (2 d + Bc) Br floats stay in L1 (d = 64: 36 KB of Zen 5's 48 KB). The micro-GEMM
// does kTileRows x kTileVectors FMAs per kTileRows broadcasts + kTileVectors loads.
//
// Masks: the band (causal, window) and key lengths give each query a key range
// [first_visible_key, last_visible_key); a key tile outside every range of the query tile is
// skipped (causal costs about half), a tile inside every range runs with no per-element mask
// work, the rest mask per element. Tensor terms are read per tile, per element.
//
// Highway's foreach_target re-includes this file once per SIMD target (see hwy/examples/
// skeleton.cc); the threading and the exported entry point live in the HWY_ONCE part below.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/flash.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "attention/tile_gemm-inl.h"
#include "hwy/contrib/math/math-inl.h"
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
  size_t q_t, scores, out_t, running_max, row_sum, correction, nan_seen, first_key, last_key, total;

  ScratchLayout(size_t br, size_t dk, size_t dv) {
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
    first_key = take(br);              // per query, int32: first visible key
    last_key = take(br);               // per query, int32: one past the last visible key
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
using DI = hn::RebindToSigned<DF>;
using VF = hn::Vec<DF>;
using tile_gemm::AllFinite;
using tile_gemm::kTileRows;
using tile_gemm::kTileVectors;
using tile_gemm::PanelGemm;

// Br, queries per work item: exactly the micro-tile width, so one micro-GEMM call spans the
// whole query tile and its running max / sum are kTileVectors vectors (48 queries on AVX-512).
size_t QueryTileRows() { return kTileVectors * hn::Lanes(DF()); }

// This target's HWY_TARGET bit, so tests can see which code a dispatch reaches.
int64_t CompiledTarget() { return HWY_TARGET; }

using flash::kKeyTile;

// One work item: query head h of batch b, queries [i0, i0 + Br) (fewer at the end of Nq).
// `scratch` is this worker's block, laid out by flash::ScratchLayout.
void FlashQueryTile(const AttentionProblem& p, int64_t b, int64_t h, int64_t i0, float* HWY_RESTRICT scratch) {
  const DF df;
  const DI di;
  const size_t lanes = hn::Lanes(df);
  const size_t br = kTileVectors * lanes;
  const size_t dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim);
  const int64_t nk = p.kv_len;
  const size_t rows = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(br), p.q_len - i0));
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

  const flash::ScratchLayout layout(br, dk, dv);
  float* HWY_RESTRICT q_t = scratch + layout.q_t;
  float* HWY_RESTRICT scores = scratch + layout.scores;
  float* HWY_RESTRICT out_t = scratch + layout.out_t;
  float* HWY_RESTRICT running_max = scratch + layout.running_max;
  float* HWY_RESTRICT row_sum = scratch + layout.row_sum;
  float* HWY_RESTRICT correction = scratch + layout.correction;
  float* HWY_RESTRICT nan_seen = scratch + layout.nan_seen;
  int32_t* HWY_RESTRICT first_key = reinterpret_cast<int32_t*>(scratch + layout.first_key);
  int32_t* HWY_RESTRICT last_key = reinterpret_cast<int32_t*>(scratch + layout.last_key);

  const int64_t bh = b * p.q_heads + h;
  const int64_t bg = b * p.kv_heads + p.kv_head_of(h);
  const float* HWY_RESTRICT q = p.q + (bh * p.q_len + i0) * static_cast<int64_t>(dk);
  const float* HWY_RESTRICT k_head = p.k + bg * nk * static_cast<int64_t>(dk);
  const float* HWY_RESTRICT v_head = p.v + bg * nk * static_cast<int64_t>(dv);

  // ---- Set up: Qt = scale * Q^T (padding lanes zero), Ot = 0, running max -inf, sums 0, and
  // each query's visible key range from the band and key lengths (padding lanes see nothing).
  for (size_t c = 0; c < dk; ++c) {
    for (size_t i = 0; i < rows; ++i) q_t[c * br + i] = p.scale * q[i * dk + c];
    for (size_t i = rows; i < br; ++i) q_t[c * br + i] = 0.0f;
  }
  std::fill_n(out_t, dv * br, 0.0f);
  std::fill_n(running_max, br, kMinusInf);
  std::fill_n(row_sum, br, 0.0f);
  std::fill_n(nan_seen, br, 0.0f);
  for (size_t i = 0; i < br; ++i) {
    if (i < rows) {  // clamped into [0, Nk]: int32 holds it (Nk < 2^31)
      first_key[i] = static_cast<int32_t>(std::min(p.first_visible_key(i0 + static_cast<int64_t>(i)), nk));
      last_key[i] = static_cast<int32_t>(std::max<int64_t>(p.last_visible_key(b, i0 + static_cast<int64_t>(i)), 0));
    } else {
      first_key[i] = 0;
      last_key[i] = 0;
    }
  }
  // The keys any query of the tile sees: both ends grow with the query, so the first row gives
  // the start and the last row the end. Key tiles outside [kv_begin, kv_end) are never visited.
  const int64_t i_last = i0 + static_cast<int64_t>(rows) - 1;
  const int64_t kv_begin = std::min(p.first_visible_key(i0), nk);
  const int64_t kv_end = p.last_visible_key(b, i_last);

  const VF minus_inf = hn::Set(df, kMinusInf);
  const float survivor_scale = p.dropout_p > 0 ? 1.0f / (1.0f - p.dropout_p) : 1.0f;

  for (int64_t j0 = kv_begin; j0 < kv_end; j0 += static_cast<int64_t>(kKeyTile)) {
    // Keys at or past kv_end are hidden from every query of the tile: never computed.
    const size_t cols = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(kKeyTile), kv_end - j0));
    const int64_t j_end = j0 + static_cast<int64_t>(cols);
    // Tile class from the monotone ranges: hidden when every row's range ends before the tile or
    // starts after it; fully visible when every row's range covers it.
    if (p.last_visible_key(b, i_last) <= j0 || p.first_visible_key(i0) >= j_end) continue;
    const bool fully_visible = p.first_visible_key(i_last) <= j0 && p.last_visible_key(b, i0) >= j_end;

    // 1. S^T = K_tile Qt: (cols, Br), already scaled (Qt carries the scale).
    PanelGemm<kTileVectors>(cols, dk, k_head + j0 * static_cast<int64_t>(dk), dk, 1, q_t, br, scores, br, false);

    // 2. Masks. Band and key lengths: a partial tile hides, per lane, the keys outside
    // [first_key, last_key); a fully visible tile does nothing here.
    if (!fully_visible) {
      for (size_t j = 0; j < cols; ++j) {
        const int32_t key = static_cast<int32_t>(j0 + static_cast<int64_t>(j));
        const auto key_vec = hn::Set(di, key);
        const auto key_next = hn::Set(di, key + 1);
        for (size_t n = 0; n < kTileVectors; ++n) {
          // visible: first <= key (first < key + 1) and key < last
          const auto visible = hn::And(hn::Lt(hn::Load(di, first_key + n * lanes), key_next),
                                       hn::Lt(key_vec, hn::Load(di, last_key + n * lanes)));
          float* s = scores + j * br + n * lanes;
          hn::Store(hn::IfThenElse(hn::RebindMask(df, visible), hn::Load(df, s), minus_inf), df, s);
        }
      }
    }
    // Tensor terms, in the reference's order (after the band): keep 0 hides, additive adds.
    for (const MaskTermView& term : p.terms) {
      for (size_t i = 0; i < rows; ++i) {
        const float* values = term.data + b * term.stride_b + h * term.stride_h +
                              (i0 + static_cast<int64_t>(i)) * term.stride_q + j0 * term.stride_k;
        for (size_t j = 0; j < cols; ++j) {
          const float value = values[static_cast<int64_t>(j) * term.stride_k];
          float& s = scores[j * br + i];
          if (term.additive) {
            s = value == kMinusInf ? kMinusInf : s + value;  // -inf hides even a NaN score
          } else if (value == 0.0f) {
            s = kMinusInf;
          }
        }
      }
    }

    // 3. Online softmax, one lane per query (ggml's flash_attn_ext, vectorised over queries).
    bool max_grew = false;
    for (size_t n = 0; n < kTileVectors; ++n) {
      // 3a. The tile's max per query: a vertical Max over the tile's key rows. Max and Exp
      // drop NaN, so a NaN score (a NaN in q or k) is noted here and poisons its row at the end,
      // as the reference's softmax does.
      VF tile_max = minus_inf;
      VF tile_nan = hn::Zero(df);
      for (size_t j = 0; j < cols; ++j) {
        const VF score = hn::Load(df, scores + j * br + n * lanes);
        tile_max = hn::Max(tile_max, score);
        tile_nan = hn::IfThenElse(hn::IsNaN(score), hn::Set(df, 1.0f), tile_nan);
      }
      hn::Store(hn::Max(hn::Load(df, nan_seen + n * lanes), tile_nan), df, nan_seen + n * lanes);
      // 3b. The new running max. A query that has seen no visible key yet keeps -inf; it is
      // exponentiated against 0 instead, so its scores (all -inf) give exp = 0, never the NaN of
      // exp(-inf - -inf).
      const VF old_max = hn::Load(df, running_max + n * lanes);
      const VF new_max = hn::Max(old_max, tile_max);
      const VF safe_max = hn::IfThenZeroElse(hn::Eq(new_max, minus_inf), new_max);
      // 3c. The factor that moves what was accumulated against the old max to the new one:
      // exp(old - new) <= 1; exactly 1 when the max did not grow, 0 when nothing was seen before.
      const VF factor = hn::Exp(df, hn::Sub(old_max, safe_max));
      max_grew = max_grew || !hn::AllTrue(df, hn::Eq(old_max, new_max));
      hn::Store(new_max, df, running_max + n * lanes);
      hn::Store(factor, df, correction + n * lanes);
      // 3d. P = exp(S - max) in place (hidden scores, -inf, give exactly 0) and its sum over the
      // tile's keys; every visible key counts, dropped or not (dropout acts on normalised weights).
      VF tile_sum = hn::Zero(df);
      for (size_t j = 0; j < cols; ++j) {
        float* s = scores + j * br + n * lanes;
        const VF weight = hn::Exp(df, hn::Sub(hn::Load(df, s), safe_max));
        hn::Store(weight, df, s);
        tile_sum = hn::Add(tile_sum, weight);
      }
      // 3e. The running sum, moved to the new max, plus this tile's.
      hn::Store(hn::MulAdd(hn::Load(df, row_sum + n * lanes), factor, tile_sum), df, row_sum + n * lanes);
    }
    // 3f. Ot moves to the new max too (skipped when no query's max grew: every factor is 1).
    if (max_grew) {
      for (size_t c = 0; c < dv; ++c) {
        for (size_t n = 0; n < kTileVectors; ++n) {
          float* o = out_t + c * br + n * lanes;
          hn::Store(hn::Mul(hn::Load(df, o), hn::Load(df, correction + n * lanes)), df, o);
        }
      }
    }

    // 4. Dropout, as the reference: a kept weight is scaled by 1 / (1 - p), a dropped one is 0.
    // Scaling the unnormalised exp(s - m) is the same as scaling exp(s - m) / l at the end.
    if (p.dropout_p > 0) {
      for (size_t i = 0; i < rows; ++i) {
        for (size_t j = 0; j < cols; ++j) {
          float& weight = scores[j * br + i];
          weight = dropout_keeps(p, b, h, i0 + static_cast<int64_t>(i), j0 + static_cast<int64_t>(j))
                       ? weight * survivor_scale
                       : 0.0f;
        }
      }
    }

    // 5. Ot += V_tile^T P^T: A(c, j) = V[j0 + j, c], i.e. row stride 1 and depth stride Dv.
    // A key some query of the tile cannot see has weight 0 there, and 0 * NaN is NaN: if such a
    // tile's values hold NaN or Inf (a KV cache's unwritten slots), skip the zero weights so
    // they reach only the queries that see them. Fully visible, finite tiles take the GEMM.
    const float* v_tile = v_head + j0 * static_cast<int64_t>(dv);
    const bool some_hidden = !fully_visible || !p.terms.empty() || p.dropout_p > 0;
    if (some_hidden && !AllFinite(v_tile, cols * dv)) {
      for (size_t j = 0; j < cols; ++j)
        for (size_t i = 0; i < rows; ++i) {
          const float weight = scores[j * br + i];
          if (weight == 0.0f) continue;
          for (size_t c = 0; c < dv; ++c) out_t[c * br + i] += weight * v_tile[j * dv + c];
        }
    } else {
      PanelGemm<kTileVectors>(dv, cols, v_tile, 1, dv, scores, br, out_t, br, true);
    }
  }

  // ---- Finish: O = Ot^T / l and lse = max + log(l); a query that saw no key has l = 0 and gets
  // zeros and lse = -inf (ggml's S == 0 ? 0 : 1/S guard); one that saw a NaN score gets NaN.
  float* HWY_RESTRICT out = p.output + (bh * p.q_len + i0) * static_cast<int64_t>(dv);
  float* HWY_RESTRICT lse = p.lse + bh * p.q_len + i0;
  const VF zero = hn::Zero(df);
  for (size_t n = 0; n < kTileVectors; ++n) {
    const VF sum = hn::Load(df, row_sum + n * lanes);
    const auto empty = hn::Eq(sum, zero);
    const VF safe_sum = hn::IfThenElse(empty, hn::Set(df, 1.0f), sum);
    hn::Store(hn::IfThenZeroElse(empty, hn::Div(hn::Set(df, 1.0f), safe_sum)), df, correction + n * lanes);
    const VF log_sum_exp = hn::Add(hn::Load(df, running_max + n * lanes), hn::Log(df, safe_sum));
    hn::Store(hn::IfThenElse(empty, minus_inf, log_sum_exp), df, row_sum + n * lanes);
    const auto poisoned = hn::Gt(hn::Load(df, nan_seen + n * lanes), hn::Zero(df));
    const VF nan = hn::Set(df, std::numeric_limits<float>::quiet_NaN());
    hn::Store(hn::IfThenElse(poisoned, nan, hn::Load(df, correction + n * lanes)), df, correction + n * lanes);
    hn::Store(hn::IfThenElse(poisoned, nan, hn::Load(df, row_sum + n * lanes)), df, row_sum + n * lanes);
  }
  for (size_t i = 0; i < rows; ++i) {
    const float inverse_sum = correction[i];
    for (size_t c = 0; c < dv; ++c) out[i * dv + c] = out_t[c * br + i] * inverse_sum;
    lse[i] = row_sum[i];
  }
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
  const int threads = flops < kMinFlopsToThread ? 1 : omp_get_max_threads();
  const int workers = static_cast<int>(std::min<int64_t>(threads, items));
  const size_t block =
      flash::ScratchLayout(br, static_cast<size_t>(problem.head_dim), static_cast<size_t>(problem.value_dim)).total;
  // The calling thread's workspace holds every worker's block and is kept for the next call.
  float* scratch = thread_workspace(WorkspaceSlot::FlashScratch).floats(static_cast<size_t>(workers) * block);

  // Items in (batch, head, query tile) order, so neighbouring items share K and V in cache;
  // within a head the last query tiles come first: under a causal mask they see the most keys,
  // and dynamic scheduling balances best when the longest items start first.
#pragma omp parallel for schedule(dynamic) num_threads(workers)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t bh = item / query_tiles;
    const int64_t tile = query_tiles - 1 - item % query_tiles;
    float* block_start = scratch + static_cast<size_t>(omp_get_thread_num()) * block;
    HWY_DYNAMIC_DISPATCH(FlashQueryTile)(problem, bh / problem.q_heads, bh % problem.q_heads,
                                         tile * static_cast<int64_t>(br), block_start);
  }
}

int64_t flash_attention_compiled_targets() { return HWY_TARGETS; }

int64_t flash_attention_target() { return HWY_DYNAMIC_DISPATCH(CompiledTarget)(); }

}  // namespace qkv::detail
#endif  // HWY_ONCE
