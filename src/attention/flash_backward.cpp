// The flash backward: the gradients of softmax(Q K^T * scale + mask) V with respect to Q, K and V
// by tiles of queries x keys (FlashAttention-2's backward), never more than one Bc x Br tile of
// weights per worker. P is recomputed per tile from the forward's lse, P = exp(S - lse); with
// D = rowsum(dO * O) (computed once per row up front) every tile is independent:
//
//   forward (flash.cpp, per tile)          backward (per tile, in this order)
//   1. S = scale * Q K^T                   S^T = (scale K) ... recomputed: S^T = K Qt
//   2. mask                                 the same masking, so hidden keys get P = 0
//   3. P = softmax(S)                       P = exp(S - lse)  (lse = -inf: P = 0, never NaN)
//   4. P' = keep ? P / (1 - p) : 0          P' made from P the same way
//   5. O += P' V                            dV += P'^T dO;  dP' = dO V^T
//   4. (dropout)                            dP = keep ? dP' / (1 - p) : 0
//   3. (softmax)                            dS = P * (dP - D), exactly 0 where P = 0
//   1. (S = scale * Q K^T)                  dK += scale * dS^T Q;  dQ += scale * dS K
//
// Work and races. A work item is (batch b, key/value head g, a chunk of key tiles). It owns the
// dK and dV rows of its keys: for each key tile it runs every query tile of every query head of
// g's group (GQA's sum over the group happens here) that can see the tile, accumulating dK and
// dV of the tile in scratch and storing them once. dQ rows are shared by every key tile: each
// chunk adds into its own dQ (the real one when a (b, g) is a single chunk, else a partial per
// chunk), in key-tile order, and partials are summed in chunk order at the end. Nothing depends
// on which thread runs an item, so the same inputs and thread count give the same bits; the
// thread count only decides the number of chunks.
//
// Layout: queries along the SIMD lanes as in flash.cpp (Qt, dOt (d, Br)) for the two products
// whose output is a (Bc, Br) tile, rows padded to whole vectors (Q, dO (Br, d_pad), scale K
// (Bc, Dk_pad)) for the three whose output runs along d. All five are one register-tiled
// micro-GEMM, "broadcast an element of A, load a row of B", A read with any strides:
//   S^T  = K Qt          (Bc x Br, depth Dk)   A = K rows in place
//   dP^T = V dOt         (Bc x Br, depth Dv)   A = V rows in place
//   dV  += P'^T dO       (Bc x Dv, depth Br)   A = P'^T tile
//   dK  += dS^T Q        (Bc x Dk, depth Br)   A = dS^T tile
//   dQ   = dS (scale K)  (Br x Dk, depth Bc)   A = dS^T tile read transposed
// Per (query tile, key tile): 5 Br Bc d flops pairs against Br (2 Dk + 2 Dv) floats packed, so
// the packing is ~1% at Bc = 64 (it is redone per key tile rather than kept for all of Nq).
//
// Masks: the band and key lengths skip a query tile the key tile is hidden from, and a fully
// visible pair does no per-element mask work, exactly as the forward; tensor terms per element.
// Keys past the last one any query of the batch may see are never read and get zero gradients.
// A hidden key's V may hold NaN or Inf (a KV cache's unwritten slot): its dS is 0 exactly; a
// hidden key's non-finite K is kept out of dQ by a scalar path that skips zero dS.
//
// Highway's foreach_target re-includes this file once per SIMD target; the threading and the
// exported entry point live in the HWY_ONCE part below.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/flash_backward.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "attention/tile_gemm-inl.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

#ifndef QKV_ATTENTION_FLASH_BACKWARD_ONCE
#define QKV_ATTENTION_FLASH_BACKWARD_ONCE
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "attention/kernels.hpp"
#include "attention/problem.hpp"

namespace qkv::detail::flash_backward {

// Bc, keys per tile: the same as the forward's (flash.cpp), for the same reasons; the dK and dV
// accumulators (Bc x d each) stay in L1/L2 across the query tiles of the group.
constexpr size_t kKeyTile = 64;

// One worker's scratch, offsets in floats from a 64-byte aligned base, every part on its own
// cache lines. br = queries per tile (per target); dk_pad / dv_pad the padded dims.
struct ScratchLayout {
  size_t dk_pad, dv_pad;
  size_t q_t, grad_out_t, q_rows, grad_out_rows, weights_t, dropped_t, grad_t, k_rows, grad_k, grad_v, grad_q,
      lse, row_dot, first_key, last_key, total;

  ScratchLayout(size_t br, size_t dk, size_t dv)
      : dk_pad(round_to_cache_line(dk)), dv_pad(round_to_cache_line(dv)) {
    size_t at = 0;
    auto take = [&](size_t floats) {
      const size_t start = at;
      at += round_to_cache_line(floats);
      return start;
    };
    q_t = take(dk * br);                  // Qt (Dk, Br), scale * Q^T
    grad_out_t = take(dv * br);           // dOt (Dv, Br)
    q_rows = take(br * dk_pad);           // Q (Br, Dk_pad)
    grad_out_rows = take(br * dv_pad);    // dO (Br, Dv_pad)
    weights_t = take(kKeyTile * br);      // S^T then P^T (Bc, Br)
    dropped_t = take(kKeyTile * br);      // P'^T (Bc, Br), with dropout
    grad_t = take(kKeyTile * br);         // dP'^T then dS^T (Bc, Br)
    k_rows = take(kKeyTile * dk_pad);     // scale * K tile (Bc, Dk_pad)
    grad_k = take(kKeyTile * dk_pad);     // dK of the key tile (Bc, Dk_pad), without the scale
    grad_v = take(kKeyTile * dv_pad);     // dV of the key tile (Bc, Dv_pad)
    grad_q = take(br * dk_pad);           // dQ of the pair (Br, Dk_pad)
    lse = take(br);                       // per query: lse, +inf where it is -inf (P = 0)
    row_dot = take(br);                   // per query: D = dO . O
    first_key = take(br);                 // per query, int32: first visible key
    last_key = take(br);                  // per query, int32: one past the last visible key
    total = at;
  }
};

}  // namespace qkv::detail::flash_backward
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DI = hn::RebindToSigned<DF>;
using VF = hn::Vec<DF>;
using tile_gemm::AllFinite;
using tile_gemm::Gemm;
using tile_gemm::kTileRows;
using tile_gemm::kTileVectors;
using tile_gemm::PanelGemm;

// Br, queries per tile: one micro-tile wide, as the forward.
size_t BackwardQueryTileRows() { return kTileVectors * hn::Lanes(DF()); }

using flash_backward::kKeyTile;

// One work item: key/value head g of batch b, key tiles starting at keys [key_begin, key_end)
// (key_begin a multiple of Bc). Adds its part of dQ into grad_q_out (B, Hq, Nq, Dk) and stores
// dK, dV of its keys. row_dot: D for every row (B, Hq, Nq).
void BackwardKeyChunk(const AttentionBackwardProblem& bp, int64_t b, int64_t g, int64_t key_begin, int64_t key_end,
                      const float* HWY_RESTRICT row_dot_all, float* HWY_RESTRICT grad_q_out,
                      float* HWY_RESTRICT scratch) {
  const AttentionProblem& p = bp.forward;
  const DF df;
  const DI di;
  const size_t lanes = hn::Lanes(df);
  const size_t br = kTileVectors * lanes;
  const size_t dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim);
  const int64_t nq = p.q_len;
  const int64_t group = p.q_heads / p.kv_heads;
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  constexpr float kInf = std::numeric_limits<float>::infinity();

  const flash_backward::ScratchLayout layout(br, dk, dv);
  const size_t dk_pad = layout.dk_pad, dv_pad = layout.dv_pad;
  float* HWY_RESTRICT q_t = scratch + layout.q_t;
  float* HWY_RESTRICT grad_out_t = scratch + layout.grad_out_t;
  float* HWY_RESTRICT q_rows = scratch + layout.q_rows;
  float* HWY_RESTRICT grad_out_rows = scratch + layout.grad_out_rows;
  float* HWY_RESTRICT weights_t = scratch + layout.weights_t;
  float* HWY_RESTRICT dropped_t = scratch + layout.dropped_t;
  float* HWY_RESTRICT grad_t = scratch + layout.grad_t;
  float* HWY_RESTRICT k_rows = scratch + layout.k_rows;
  float* HWY_RESTRICT grad_k = scratch + layout.grad_k;
  float* HWY_RESTRICT grad_v = scratch + layout.grad_v;
  float* HWY_RESTRICT grad_q = scratch + layout.grad_q;
  float* HWY_RESTRICT lse = scratch + layout.lse;
  float* HWY_RESTRICT row_dot = scratch + layout.row_dot;
  int32_t* HWY_RESTRICT first_key = reinterpret_cast<int32_t*>(scratch + layout.first_key);
  int32_t* HWY_RESTRICT last_key = reinterpret_cast<int32_t*>(scratch + layout.last_key);

  const int64_t bg = b * p.kv_heads + g;
  const float* HWY_RESTRICT k_head = p.k + bg * p.kv_len * static_cast<int64_t>(dk);
  const float* HWY_RESTRICT v_head = p.v + bg * p.kv_len * static_cast<int64_t>(dv);
  const VF minus_inf = hn::Set(df, kMinusInf);
  const VF zero = hn::Zero(df);
  const float survivor_scale = p.dropout_p > 0 ? 1.0f / (1.0f - p.dropout_p) : 1.0f;

  for (int64_t j0 = key_begin; j0 < key_end; j0 += static_cast<int64_t>(kKeyTile)) {
    const size_t cols = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(kKeyTile), key_end - j0));
    const int64_t j_end = j0 + static_cast<int64_t>(cols);
    const float* HWY_RESTRICT k_tile = k_head + j0 * static_cast<int64_t>(dk);
    const float* HWY_RESTRICT v_tile = v_head + j0 * static_cast<int64_t>(dv);
    // The key tile: scale * K padded for the dQ product; dK, dV accumulators at 0.
    for (size_t j = 0; j < cols; ++j) {
      for (size_t c = 0; c < dk; ++c) k_rows[j * dk_pad + c] = p.scale * k_tile[j * dk + c];
      std::fill(k_rows + j * dk_pad + dk, k_rows + (j + 1) * dk_pad, 0.0f);
    }
    const bool k_finite = AllFinite(k_tile, cols * dk);
    std::fill_n(grad_k, cols * dk_pad, 0.0f);
    std::fill_n(grad_v, cols * dv_pad, 0.0f);

    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      const int64_t bh = b * p.q_heads + h;
      for (int64_t i0 = 0; i0 < nq; i0 += static_cast<int64_t>(br)) {
        const size_t rows = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(br), nq - i0));
        const int64_t i_last = i0 + static_cast<int64_t>(rows) - 1;
        // The forward's tile classes: hidden (skipped), fully visible (no mask work), partial.
        if (p.last_visible_key(b, i_last) <= j0 || p.first_visible_key(i0) >= j_end) continue;
        const bool fully_visible = p.first_visible_key(i_last) <= j0 && p.last_visible_key(b, i0) >= j_end;

        // ---- Pack the query tile: Qt = scale * Q^T and dOt (queries in lanes), Q and dO rows
        // (padded), lse (+inf where -inf: P = exp(S - inf) = 0), D, the visible key ranges.
        // Padding lanes and rows are 0 and see nothing.
        const float* HWY_RESTRICT q = p.q + (bh * nq + i0) * static_cast<int64_t>(dk);
        const float* HWY_RESTRICT grad_out = bp.grad_output + (bh * nq + i0) * static_cast<int64_t>(dv);
        for (size_t c = 0; c < dk; ++c) {
          for (size_t i = 0; i < rows; ++i) q_t[c * br + i] = p.scale * q[i * dk + c];
          for (size_t i = rows; i < br; ++i) q_t[c * br + i] = 0.0f;
        }
        for (size_t c = 0; c < dv; ++c) {
          for (size_t i = 0; i < rows; ++i) grad_out_t[c * br + i] = grad_out[i * dv + c];
          for (size_t i = rows; i < br; ++i) grad_out_t[c * br + i] = 0.0f;
        }
        std::fill_n(q_rows, br * dk_pad, 0.0f);
        std::fill_n(grad_out_rows, br * dv_pad, 0.0f);
        for (size_t i = 0; i < rows; ++i) {
          std::copy_n(q + i * dk, dk, q_rows + i * dk_pad);
          std::copy_n(grad_out + i * dv, dv, grad_out_rows + i * dv_pad);
        }
        for (size_t i = 0; i < br; ++i) {
          if (i < rows) {
            const int64_t query = i0 + static_cast<int64_t>(i);
            const float row_lse = bp.lse[bh * nq + query];
            lse[i] = row_lse == kMinusInf ? kInf : row_lse;
            row_dot[i] = row_dot_all[bh * nq + query];
            first_key[i] = static_cast<int32_t>(std::min(p.first_visible_key(query), p.kv_len));
            last_key[i] = static_cast<int32_t>(std::max<int64_t>(p.last_visible_key(b, query), 0));
          } else {
            lse[i] = kInf;
            row_dot[i] = 0.0f;
            first_key[i] = 0;
            last_key[i] = 0;
          }
        }

        // ---- Forward 1: "S = scale * Q K^T".  Recomputed: S^T = K_tile Qt (cols, Br).
        Gemm(cols, br, dk, k_tile, dk, 1, q_t, br, weights_t, br, false);

        // ---- Forward 2: "mask".  The same masking, so hidden keys get P = 0 below.
        if (!fully_visible) {
          for (size_t j = 0; j < cols; ++j) {
            const int32_t key = static_cast<int32_t>(j0 + static_cast<int64_t>(j));
            const auto key_vec = hn::Set(di, key);
            const auto key_next = hn::Set(di, key + 1);
            for (size_t n = 0; n < kTileVectors; ++n) {
              const auto visible = hn::And(hn::Lt(hn::Load(di, first_key + n * lanes), key_next),
                                           hn::Lt(key_vec, hn::Load(di, last_key + n * lanes)));
              float* s = weights_t + j * br + n * lanes;
              hn::Store(hn::IfThenElse(hn::RebindMask(df, visible), hn::Load(df, s), minus_inf), df, s);
            }
          }
        }
        for (const MaskTermView& term : p.terms) {
          for (size_t i = 0; i < rows; ++i) {
            const float* values = term.data + b * term.stride_b + h * term.stride_h +
                                  (i0 + static_cast<int64_t>(i)) * term.stride_q + j0 * term.stride_k;
            for (size_t j = 0; j < cols; ++j) {
              const float value = values[static_cast<int64_t>(j) * term.stride_k];
              float& s = weights_t[j * br + i];
              if (term.additive) {
                s = value == kMinusInf ? kMinusInf : s + value;
              } else if (value == 0.0f) {
                s = kMinusInf;
              }
            }
          }
        }

        // ---- Forward 3: "P = softmax(S)".  Recomputed: P = exp(S - lse), no max or sum needed.
        for (size_t j = 0; j < cols; ++j)
          for (size_t n = 0; n < kTileVectors; ++n) {
            float* s = weights_t + j * br + n * lanes;
            hn::Store(hn::Exp(df, hn::Sub(hn::Load(df, s), hn::Load(df, lse + n * lanes))), df, s);
          }

        // ---- Forward 4: "P' = keep ? P / (1 - p) : 0".  Recomputed from P.
        const float* dropped = weights_t;
        if (p.dropout_p > 0) {
          std::copy_n(weights_t, cols * br, dropped_t);
          for (size_t i = 0; i < rows; ++i)
            for (size_t j = 0; j < cols; ++j) {
              float& weight = dropped_t[j * br + i];
              weight = dropout_keeps(p, b, h, i0 + static_cast<int64_t>(i), j0 + static_cast<int64_t>(j))
                           ? weight * survivor_scale
                           : 0.0f;
            }
          dropped = dropped_t;
        }

        // ---- Forward 5: "O += P' V".  dV += P'^T dO  (cols, Dv_pad), A(j, i) = P'^T[j, i];
        // dP'^T = V_tile dOt  (cols, Br).
        Gemm(cols, dv_pad, br, dropped, br, 1, grad_out_rows, dv_pad, grad_v, dv_pad, true);
        Gemm(cols, br, dv, v_tile, dv, 1, grad_out_t, br, grad_t, br, false);

        // ---- Forward 4, dropout: dP = keep ? dP' / (1 - p) : 0.
        if (p.dropout_p > 0) {
          for (size_t i = 0; i < rows; ++i)
            for (size_t j = 0; j < cols; ++j) {
              float& grad = grad_t[j * br + i];
              grad = dropout_keeps(p, b, h, i0 + static_cast<int64_t>(i), j0 + static_cast<int64_t>(j))
                         ? grad * survivor_scale
                         : 0.0f;
            }
        }
        // ---- Forward 3, softmax: dS = P * (dP - D), D = rowsum(P dP) = dO . O; exactly 0 where
        // P = 0 (a hidden key, whose V may be NaN). Forward 2's additive terms pass dS through.
        for (size_t j = 0; j < cols; ++j)
          for (size_t n = 0; n < kTileVectors; ++n) {
            float* grad = grad_t + j * br + n * lanes;
            const VF weight = hn::Load(df, weights_t + j * br + n * lanes);
            const VF grad_score = hn::Mul(weight, hn::Sub(hn::Load(df, grad), hn::Load(df, row_dot + n * lanes)));
            hn::Store(hn::IfThenZeroElse(hn::Eq(weight, zero), grad_score), df, grad);
          }

        // ---- Forward 1: "S = scale * Q K^T".  dK += dS^T Q (scaled when stored) and
        // dQ = dS (scale K), A(i, j) = dS^T[j, i]: row stride 1, depth stride Br.
        Gemm(cols, dk_pad, br, grad_t, br, 1, q_rows, dk_pad, grad_k, dk_pad, true);
        float* HWY_RESTRICT grad_q_rows = grad_q_out + (bh * nq + i0) * static_cast<int64_t>(dk);
        if (k_finite) {
          Gemm(rows, dk_pad, cols, grad_t, 1, br, k_rows, dk_pad, grad_q, dk_pad, false);
          for (size_t i = 0; i < rows; ++i)
            for (size_t c = 0; c < dk; ++c) grad_q_rows[i * dk + c] += grad_q[i * dk_pad + c];
        } else {  // a hidden key's K may be NaN or Inf: skip zero dS so it reaches no row
          for (size_t i = 0; i < rows; ++i)
            for (size_t j = 0; j < cols; ++j) {
              const float grad_score = grad_t[j * br + i];
              if (grad_score == 0.0f) continue;
              for (size_t c = 0; c < dk; ++c) grad_q_rows[i * dk + c] += grad_score * k_rows[j * dk_pad + c];
            }
        }
      }
    }

    // ---- The key tile's gradients, summed over every query of the group: stored once.
    float* HWY_RESTRICT grad_k_out = bp.grad_k + (bg * p.kv_len + j0) * static_cast<int64_t>(dk);
    float* HWY_RESTRICT grad_v_out = bp.grad_v + (bg * p.kv_len + j0) * static_cast<int64_t>(dv);
    for (size_t j = 0; j < cols; ++j) {
      for (size_t c = 0; c < dk; ++c) grad_k_out[j * dk + c] = p.scale * grad_k[j * dk_pad + c];
      for (size_t c = 0; c < dv; ++c) grad_v_out[j * dv + c] = grad_v[j * dv_pad + c];
    }
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

HWY_EXPORT(BackwardQueryTileRows);
HWY_EXPORT(BackwardKeyChunk);

namespace {
// Chunks per (b, g) aim at this many items per thread, so dynamic scheduling can balance
// unequal items (a causal mask's late keys have fewer queries).
constexpr int64_t kItemsPerThread = 4;
}  // namespace

void flash_attention_backward(const AttentionBackwardProblem& bp) {
  const AttentionProblem& p = bp.forward;
  const int64_t nq = p.q_len, nk = p.kv_len, dk = p.head_dim, dv = p.value_dim;
  const int64_t rows_total = p.batch * p.q_heads * nq;
  const int64_t pairs = p.batch * p.kv_heads;
  const int64_t key_tile = static_cast<int64_t>(flash_backward::kKeyTile);
  const int64_t key_tiles = (nk + key_tile - 1) / key_tile;

  // Threads, as the forward: a problem too small to pay for waking them runs here alone.
  const double flops = 2.5 * 2.0 * static_cast<double>(rows_total) * static_cast<double>(nk) *
                       static_cast<double>(dk + dv);
  const int threads = flops < kMinFlopsToThread ? 1 : omp_get_max_threads();
  // Chunks per (b, g): 1 when the pairs alone give every thread several items; more (at most
  // one per key tile) otherwise, each with a dQ partial of its own.
  int64_t splits = 1;
  if (threads > 1 && pairs > 0 && pairs < kItemsPerThread * threads)
    splits = std::clamp<int64_t>((kItemsPerThread * threads + pairs - 1) / pairs, 1, std::max<int64_t>(key_tiles, 1));
  const int64_t items = pairs * splits;

  // Scratch, sized up front in the calling thread's workspace: D per row, the dQ partials and
  // one block per worker, each starting on its own cache line.
  const size_t br = HWY_DYNAMIC_DISPATCH(BackwardQueryTileRows)();
  const size_t block = flash_backward::ScratchLayout(br, static_cast<size_t>(dk), static_cast<size_t>(dv)).total;
  const size_t row_dot_floats = round_to_cache_line(static_cast<size_t>(rows_total));
  const size_t partial_floats = round_to_cache_line(static_cast<size_t>(rows_total * dk));
  const int workers = static_cast<int>(std::clamp<int64_t>(std::min<int64_t>(threads, items), 1, threads));
  float* scratch = thread_workspace(WorkspaceSlot::FlashScratch)
                       .floats(row_dot_floats + (splits > 1 ? static_cast<size_t>(splits) * partial_floats : 0) +
                               static_cast<size_t>(workers) * block);
  float* row_dot = scratch;
  float* partials = scratch + row_dot_floats;
  float* blocks = partials + (splits > 1 ? static_cast<size_t>(splits) * partial_floats : 0);
  float* grad_q_of_chunk0 = splits > 1 ? partials : bp.grad_q;

  // ---- Pass 1, per row: D = dO . O (in float64, as the reference) and dQ (or every partial) = 0.
#pragma omp parallel for schedule(static) num_threads(workers)
  for (int64_t row = 0; row < rows_total; ++row) {
    const float* out = bp.output + row * dv;
    const float* grad_out = bp.grad_output + row * dv;
    double dot = 0;
    for (int64_t c = 0; c < dv; ++c) dot += static_cast<double>(grad_out[c]) * out[c];
    row_dot[row] = static_cast<float>(dot);
    for (int64_t s = 0; s < splits; ++s) std::fill_n(grad_q_of_chunk0 + s * static_cast<int64_t>(partial_floats) + row * dk, dk, 0.0f);
  }

  // ---- Pass 2, items (b, g, chunk): dK and dV of the chunk's keys, its part of dQ. Keys no
  // query of the batch may see get zero gradients here.
#pragma omp parallel for schedule(dynamic) num_threads(workers)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t pair = item / splits, chunk = item % splits;
    const int64_t b = pair / p.kv_heads, g = pair % p.kv_heads;
    const int64_t visible_end = nq > 0 ? std::clamp<int64_t>(p.last_visible_key(b, nq - 1), 0, nk) : 0;
    const int64_t visible_tiles = (visible_end + key_tile - 1) / key_tile;
    const int64_t key_begin = std::min(visible_end, visible_tiles * chunk / splits * key_tile);
    const int64_t key_end = std::min(visible_end, visible_tiles * (chunk + 1) / splits * key_tile);
    if (chunk == splits - 1) {
      std::fill(bp.grad_k + (pair * nk + visible_end) * dk, bp.grad_k + (pair + 1) * nk * dk, 0.0f);
      std::fill(bp.grad_v + (pair * nk + visible_end) * dv, bp.grad_v + (pair + 1) * nk * dv, 0.0f);
    }
    if (key_begin >= key_end) continue;
    float* block_start = blocks + static_cast<size_t>(omp_get_thread_num()) * block;
    HWY_DYNAMIC_DISPATCH(BackwardKeyChunk)(bp, b, g, key_begin, key_end, row_dot,
                                           grad_q_of_chunk0 + chunk * static_cast<int64_t>(partial_floats),
                                           block_start);
  }

  // ---- Pass 3, several chunks: dQ = the partials summed in chunk order.
  if (splits > 1) {
#pragma omp parallel for schedule(static) num_threads(workers)
    for (int64_t row = 0; row < rows_total; ++row)
      for (int64_t c = 0; c < dk; ++c) {
        float sum = 0;
        for (int64_t s = 0; s < splits; ++s) sum += partials[s * static_cast<int64_t>(partial_floats) + row * dk + c];
        bp.grad_q[row * dk + c] = sum;
      }
  }
}

}  // namespace qkv::detail
#endif  // HWY_ONCE
