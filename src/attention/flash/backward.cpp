// The flash backward: the gradients of softmax(Q K^T * scale + mask) V with respect to Q, K and V
// by tiles of queries x keys (FlashAttention-2's backward), never more than one Bc x Br tile of
// weights per worker. P is recomputed per tile from the forward's lse, P = exp(S - lse); with
// D = rowsum(dO * O) (computed once per row up front) every tile is independent. (P is
// exp(S - shift) * scale from the row stats, problem.hpp; score modifiers and masks are the
// pipeline's steps, attention/steps/pipeline-inl.h, shared with the forward.)
//
//   forward (flash/forward.cpp, per tile)          backward (per tile, in this order)
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
// Layout: queries along the SIMD lanes as in flash/forward.cpp (Qt, dOt (d, Br)) for the two products
// whose output is a (Bc, Br) tile; for the three whose output runs along d, Q, dO and K rows read
// in place, or copied into scratch padded to whole vectors where they are not whole (a short
// query tile, a d that is not whole vectors; K also where some K of the key block is not finite).
// All five are one register-tiled micro-GEMM, "broadcast an element of A, load a row of B", A
// read with any strides:
//   S^T  = K Qt          (Bc x Br, depth Dk)   A = K rows in place
//   dP^T = V dOt         (Bc x Br, depth Dv)   A = V rows in place
//   dV  += P'^T dO       (Bc x Dv, depth Br)   A = P'^T tile
//   dK  += dS^T Q        (Bc x Dk, depth Br)   A = dS^T tile
//   dQ  += dS K          (Br x Dk, depth Bc)   A = dS^T tile read transposed; the scale applied
//                                              as dQ is added to the output (or K copied scaled)
// After a decode forward (bp.decode_scores) S^T is summed in decode's order instead
// (attention/steps/dot_scores-inl.h, from scale * Q rows packed per query tile), so that the weights are
// recomputed from the forward's own scores, bit for bit; the other four products stay as above.
// A query tile is packed once per block of kKeyBlock keys (4 tiles) and runs against each of its
// tiles: the packing is redone per block rather than kept for all of Nq (per key tile it costs
// too much: flash/layout.hpp).
//
// Masks: the band and key lengths skip a query tile the key tile is hidden from, and a fully
// visible pair does no per-element mask work, exactly as the forward; tensor terms per element.
// Keys past the last one any query of the batch may see are never read and get zero gradients.
// A hidden key's V may hold NaN or Inf (a KV cache's unwritten slot): its dS is 0 exactly; a
// hidden key's non-finite K is kept out of dQ by a scalar path that skips zero dS.
//
// Strided keys (a root rule `rest | strided(S, O)`, S >= Bc) are gathered by residues as in the
// forward (residues-inl.h): passes 1-3 run the tiles on `rest`, then pass 4 adds each residue's
// pairs into the gradients the tiles wrote.
//
// Files: layout.hpp (Bc, the key block, the scratch and AMX block layouts), operands-inl.h (query
// tiles packed, key blocks, AMX splits), products-inl.h (the five products, float32 or AMX),
// residues-inl.h (strided keys); this file holds the loop order and the launch
// (attention/launch.hpp: the workers, their blocks and the shared D and dQ partials).
//
// At a lower matmul precision (AttentionOptions::precision High or Medium) on a CPU with AMX, with
// Dk and Dv multiples of 16, the five products run on AMX tiles (gemm/amx.hpp) on bf16 parts
// of their operands, and every other step stays as above: K, V and K^T are split once per key
// block, Qt, dOt, Q and dO once per query tile, P'^T and dS^T per pair; dQ accumulates as
// dQ^T += K^T dS^T, so dS^T's layout serves, and is added into dQ transposed. A key block or
// query tile holding a value the parts cannot hold (NaN, inf, or inf in bf16) stays float32, as
// do a pair whose dS^T cannot be held (its dK and dQ) and the strided residues.
//
// Highway's foreach_target re-includes this file once per SIMD target; the threading and the
// exported entry point live in the HWY_ONCE part below.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/flash/backward.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "attention/steps/pipeline-inl.h"
#include "attention/steps/bias_gradient-inl.h"
#include "attention/flash/operands-inl.h"
#include "attention/flash/products-inl.h"
#include "attention/flash/residues-inl.h"
#include "hwy/highway.h"

#ifndef QKV_ATTENTION_FLASH_BACKWARD_ONCE
#define QKV_ATTENTION_FLASH_BACKWARD_ONCE
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "attention/bias_gradient.hpp"
#include "attention/flash/layout.hpp"
#include "attention/kernels.hpp"
#include "attention/problem.hpp"
#include "gemm/amx.hpp"
#include "simd/query_tiles.hpp"
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using flash::kKeyBlock;
using flash::kKeyTile;
using flash_steps::AmxTiles;
using flash_steps::BackwardProducts;
using flash_steps::BackwardScratch;
using flash_steps::KeyBlock;
using flash_steps::QueryRows;
using flash_steps::TileAt;
using tile_gemm::kTileVectors;
namespace step = pipeline;
using step::TileMask;
using step::Walk;

// Br, queries per tile: about 96, a whole number of micro-tile widths (AVX2 4 x 24, AVX-512
// 2 x 48): dV += P'^T dO and dK += dS^T Q run Br deep, and one micro-tile wide they load and
// store their accumulators every Br FMAs. That many at most (the scratch is laid out for it); a
// band narrower than 4 such tiles (a window) keeps one micro-tile's width, whose tiles cross
// fewer of its hidden keys. (Measured: docs/performance-log.md, "flash/".)
size_t BackwardQueryTileRows() {
  const size_t width = kTileVectors * hn::Lanes(DF());
  return std::max<size_t>(1, 96 / width) * width;
}
size_t BackwardTileRowsFor(const AttentionProblem& p) {
  const size_t most = BackwardQueryTileRows();
  const double band = static_cast<double>(p.band_hi) - static_cast<double>(p.band_lo) + 1;
  return band < 4.0 * static_cast<double>(most) ? kTileVectors * hn::Lanes(DF()) : most;
}

// D = dO . O of rows [row_begin, row_end) of (B, Hq, Nq), into row_dot, summed in float64 as the
// reference does, on float64 vectors (half a float vector promoted at a time; a scalar loop
// showed in profiles: docs/performance-log.md, "flash/").
void RowDots(const AttentionBackwardProblem& bp, int64_t row_begin, int64_t row_end, float* HWY_RESTRICT row_dot) {
  const AttentionProblem& p = bp.forward;
  const int64_t nq = p.q_len, dv = p.value_dim;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t b = row / (p.q_heads * nq), h = row / nq % p.q_heads, i = row % nq;
    const float* HWY_RESTRICT out = bp.output.row(b, h, i);
    const float* HWY_RESTRICT grad_out = bp.grad_output.row(b, h, i);
    double dot = 0;
    int64_t c = 0;
#if HWY_HAVE_FLOAT64
    const hn::ScalableTag<double> dd;
    const hn::Rebind<float, decltype(dd)> half;
    const int64_t lanes = static_cast<int64_t>(hn::Lanes(dd));
    auto even = hn::Zero(dd), odd = hn::Zero(dd);
    auto product = [&](int64_t at, decltype(even) sum) {
      return hn::MulAdd(hn::PromoteTo(dd, hn::LoadU(half, grad_out + at)), hn::PromoteTo(dd, hn::LoadU(half, out + at)),
                        sum);
    };
    for (; c + 2 * lanes <= dv; c += 2 * lanes) {
      even = product(c, even);
      odd = product(c + lanes, odd);
    }
    for (; c + lanes <= dv; c += lanes) even = product(c, even);
    dot = hn::GetLane(hn::SumOfLanes(dd, hn::Add(even, odd)));
#endif
    for (; c < dv; ++c) dot += static_cast<double>(grad_out[c]) * out[c];
    row_dot[row] = static_cast<float>(dot);
  }
}

// One (query tile, key tile) pair of head (b, h), in the forward's order then back: S^T = K Qt,
// logits (softcap with its slope, ALiBi, the mask, as the forward), P recomputed from the row
// stats, P' with dropout; dV += P'^T dO, dP'^T = V dOt, dropout's and the softmax's gradients
// (dS = P (dP - D), 0 where P = 0, through softcap's and the score function's slopes); dK += dS^T Q
// and dQ += dS K.
// dV and dK go into the key block's accumulators, dQ into the query tile's accumulator w.grad_q
// (FlushGradQ adds it into dQ's rows once per block of key tiles, not per pair, which read and
// wrote every dQ row once per key tile), or, where a hidden key's K is not finite, into
// grad_q_out's rows directly. `products`: float32 or AMX (products-inl.h). Returns whether dQ
// went the float32 way (into w.grad_q, or grad_q_out).
bool BackwardPair(const AttentionBackwardProblem& bp, const Walk& walk, const TileAt& t, const QueryRows& query_rows,
                  const KeyBlock& keys, const TileMask& mask, const Rows<float>& grad_q_out,
                  const BackwardProducts& products, const BackwardScratch& w) {
  const AttentionProblem& p = bp.forward;
  const size_t br = w.br, cols = t.cols;
  // The next key tile's terms and dbias, during this pair.
  const int64_t next = t.j0 + static_cast<int64_t>(cols) * walk.key_step;
  if (bp.grad_bias.data) {
    step::PrefetchBiasTile(bp, walk, t.b, t.h, t.i0, t.rows, next, cols);
  } else if (!p.terms.empty()) {
    step::PrefetchTermTiles(p, walk, t.b, t.h, t.i0, t.rows, next, cols);
  }
  products.Scores(p, walk.key_step, t, w);
  if (mask.band || mask.hide >= 0 || p.softcap > 0 || p.alibi_slopes || p.score_mod || !p.terms.empty()) {
    step::Softcap(p, w.weights_t, cols * br, w.softcap_t);
    step::TileLogits(p, walk, mask, t.b, t.h, t.i0, t.rows, t.j0, cols, br, w.weights_t, w.score_mod, w.softcap_t,
                     w.term_t);
  }
  step::RecomputeWeights(w.weights_t, cols, br, w.shift, w.scale);
  const float* dropped = w.weights_t;
  if (p.dropout_p > 0) {
    std::copy_n(w.weights_t, cols * br, w.dropped_t);
    for (size_t j = 0; j < cols; ++j) step::Dropout(p, t.line(walk, j), w.dropped_t + j * br, t.rows);
    dropped = w.dropped_t;
  }
  products.GradV(p, dropped, query_rows, keys, w);
  products.GradP(p, walk.key_step, t, w);
  if (p.dropout_p > 0)
    for (size_t j = 0; j < cols; ++j) step::Dropout(p, t.line(walk, j), w.grad_t + j * br, t.rows);
  // dL/dbias = dS before the modifiers' slopes (attention/bias_gradient.hpp): with a slope
  // computed apart first, without one taken from the softmax gradient (dS computed once).
  const bool slope = p.has_score_slope();
  if (bp.grad_bias.data && slope)
    step::AddBiasGradientTile(bp.grad_bias, walk, t.b, t.h, t.i0, t.rows, t.j0, cols, br, w.weights_t, w.grad_t,
                              w.row_dot, w.term_t);
  step::SoftmaxGradient(w.weights_t, w.grad_t, cols, br, w.row_dot, slope ? w.softcap_t : nullptr);
  if (bp.grad_bias.data && !slope)
    step::AddBiasGradientFromDs(bp.grad_bias, walk, t.b, t.h, t.i0, t.rows, t.j0, cols, br, w.grad_t);
  return products.GradKQ(p, query_rows, keys, step::EveryStepRows(grad_q_out, t.i0, walk.query_step), t, w);
}

// One query tile (queries i0 .. i0 + rows - 1 of head h, its own Br: w.br) against the key
// block `keys` (of kv head (b, g)): packed once, then run against each of the block's key tiles
// in key order, over the keys some of its queries see (the band and key lengths: a causal pair
// past the diagonal skips the keys all its queries would mask); dQ flushed at the end. `amx`:
// the key block's splits fit (else null); the tile's own must too.
void QueryTileAgainstBlock(const AttentionBackwardProblem& bp, int64_t b, int64_t h, int64_t i0, size_t rows,
                           const KeyBlock& keys, const float* HWY_RESTRICT row_dot_all, const Rows<float>& grad_q_out,
                           const BackwardScratch& w, AmxTiles* amx) {
  const AttentionProblem& p = bp.forward;
  const int64_t i_last = i0 + static_cast<int64_t>(rows) - 1, j0 = keys.j0;
  const QueryRows query_rows = flash_steps::PackQueryTile(bp, b, h, i0, 1, rows, row_dot_all, w);
  if (amx && !flash_steps::SplitQueryTile(p, query_rows, rows, w, *amx)) amx = nullptr;
  const BackwardProducts products{amx, bp.decode_scores};
  bool float_grad_q = false;
  for (size_t at = 0; at < keys.cols; at += kKeyTile) {
    const int64_t t0 = j0 + static_cast<int64_t>(at);
    const int64_t t_lo = std::max(t0, p.first_visible_key(i0));
    const int64_t t_hi = std::min(t0 + static_cast<int64_t>(std::min(kKeyTile, keys.cols - at)),
                                  p.last_visible_key(b, i_last));
    if (t_lo >= t_hi) continue;
    const step::TileClass tile_class = step::ClassifyMaskTile(p, b, h, i0, i_last, t_lo, t_hi);
    if (tile_class == step::TileClass::Hidden) continue;
    if (amx) amx->key = static_cast<size_t>(t_lo - j0);
    const KeyBlock pair_keys = keys.Part(static_cast<size_t>(t_lo - j0), static_cast<size_t>(t_hi - t_lo), t_lo, w);
    float_grad_q |= BackwardPair(bp, {}, TileAt{b, h, p.kv_head_of(h), i0, rows, t_lo, pair_keys.cols}, query_rows,
                                 pair_keys, {tile_class != step::TileClass::Full, -1}, grad_q_out, products, w);
  }
  flash_steps::FlushGradQ(p, b, h, i0, 1, rows, keys.grad_q_scale, grad_q_out, w, float_grad_q, amx);
}

// One work item: key/value head g of batch b, key tiles starting at keys [key_begin, key_end)
// (key_begin a multiple of Bc), by blocks of kKeyBlock keys, each against every query tile of
// every query head of g's group that can see it (GQA's sum over the group happens here). Adds its
// part of dQ into grad_q_out and stores dK, dV of its keys. row_dot_all: D for every row
// (B, Hq, Nq). `amx_block`: this worker's AMX block (laid out by `amx_layout`) when the products
// may run on AMX tiles (16 float lanes: a tile row holds 16 query lanes), else null.
void BackwardKeyChunk(const AttentionBackwardProblem& bp, int64_t b, int64_t g, int64_t key_begin, int64_t key_end,
                      const float* HWY_RESTRICT row_dot_all, const Rows<float>& grad_q_out, float* HWY_RESTRICT scratch,
                      uint16_t* amx_block, const flash::BackwardAmxLayout* amx_layout) {
  const AttentionProblem& p = bp.forward;
  const size_t br = BackwardTileRowsFor(p), lanes = hn::Lanes(DF());
  const int64_t group = p.q_heads / p.kv_heads;
  const flash::BackwardScratchLayout layout(p, BackwardQueryTileRows());
  // A head's queries in tiles of br, a short remainder sharing the last whole tile's vectors
  // (simd/query_tiles.hpp); each tile runs on the vectors its queries fill: the same scratch,
  // its own Br.
  const QueryTiles tiling(p.q_len, static_cast<int64_t>(lanes), static_cast<int64_t>(br / lanes));
  const BackwardScratch w(scratch, br, layout);
  std::fill_n(w.grad_q, br * w.dk_pad, 0.0f);  // each FlushGradQ leaves it zero again
  AmxTiles amx{p.amx_parts, amx_layout, lanes == amx::kRows ? amx_block : nullptr, 0};
  if (amx.base) {
    std::fill_n(amx.grad_q_t(), static_cast<size_t>(p.head_dim) * br, 0.0f);  // as w.grad_q
    amx::configure();
  }
  for (int64_t j0 = key_begin; j0 < key_end; j0 += static_cast<int64_t>(kKeyBlock)) {
    const size_t cols = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(kKeyBlock), key_end - j0));
    const KeyBlock keys = flash_steps::StartKeyTile(p, b, g, j0, 1, cols, w);
    const bool amx_keys = amx.base && flash_steps::SplitKeyBlock(p, b, g, j0, cols, amx);
    for (int64_t h = g * group; h < (g + 1) * group; ++h)
      for (int64_t tile = 0; tile < tiling.count; ++tile) {
        const int64_t i0 = tiling.first_query(tile);
        const size_t rows = static_cast<size_t>(tiling.rows(tile));
        if (step::ClassifyMaskTile(p, b, h, i0, i0 + static_cast<int64_t>(rows) - 1, j0,
                                   j0 + static_cast<int64_t>(cols)) == step::TileClass::Hidden)
          continue;
        const BackwardScratch tile_w(scratch, static_cast<size_t>(tiling.vectors(tile)) * lanes, layout);
        QueryTileAgainstBlock(bp, b, h, i0, rows, keys, row_dot_all, grad_q_out, tile_w, amx_keys ? &amx : nullptr);
      }
    flash_steps::FinishKeyTile(bp, b, g, j0, 1, cols, false, w);
  }
  if (amx.base) amx::release();
}

// The strided residues [first, last) of kv head (b, g)'s group (residues-inl.h), on float32
// products, adding into dQ, dK and dV.
void BackwardResidues(const AttentionBackwardProblem& bp, const StridedSplit& split, int64_t b, int64_t g,
                      int64_t first, int64_t last, const float* HWY_RESTRICT row_dot_all, float* HWY_RESTRICT scratch) {
  const AttentionProblem& p = bp.forward;
  const BackwardScratch w(scratch, step::ResidueTileRows(), flash::BackwardScratchLayout(p, BackwardQueryTileRows()));
  const BackwardProducts products{nullptr, bp.decode_scores};
  flash_steps::BackwardResidues(bp, split, b, g, first, last, row_dot_all, w,
                                [&](const Walk& walk, const TileAt& t, const QueryRows& query_rows,
                                    const KeyBlock& keys, const TileMask& mask) {
                                  (void)BackwardPair(bp, walk, t, query_rows, keys, mask, bp.grad_q, products, w);
                                });
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "attention/launch.hpp"
#include "core/allocator.hpp"

namespace qkv::detail {

HWY_EXPORT(BackwardQueryTileRows);
HWY_EXPORT(BackwardKeyChunk);
HWY_EXPORT(BackwardResidues);
HWY_EXPORT(RowDots);

namespace {

// Chunks per (b, g) aim at this many items per thread, so the threads can balance unequal items
// (a causal mask's late keys have fewer queries).
constexpr int64_t kItemsPerThread = 4;

// The backward's items: (b, g, chunk of key tiles), `splits` chunks per (b, g): 1 when the
// pairs alone give every thread several items; more (at most one per key tile) otherwise, each
// chunk with a dQ partial of its own (B, Hq, Nq, Dk) in the launch's shared floats, after D.
// `pair_waves`: the pairs run in that many waves (a broadcast bias's gradient, bias_gradient.hpp),
// so fewer of them share the threads at once.
struct Chunks {
  int64_t splits = 1, items = 0, rows = 0;
  size_t row_dot_floats = 0, partial_floats = 0;

  Chunks(const AttentionProblem& p, int threads, int64_t pair_waves) {
    const int64_t pairs = p.batch * p.kv_heads / pair_waves, key_tile = static_cast<int64_t>(flash::kKeyTile);
    const int64_t key_tiles = (p.kv_len + key_tile - 1) / key_tile;
    if (threads > 1 && pairs > 0 && pairs < kItemsPerThread * threads)
      splits = std::clamp<int64_t>((kItemsPerThread * threads + pairs - 1) / pairs, 1, std::max<int64_t>(key_tiles, 1));
    items = p.batch * p.kv_heads * splits;
    rows = p.batch * p.q_heads * p.q_len;
    row_dot_floats = round_to_cache_line(static_cast<size_t>(rows));
    partial_floats = round_to_cache_line(static_cast<size_t>(rows * p.head_dim));
  }
  size_t shared_floats() const { return row_dot_floats + (splits > 1 ? static_cast<size_t>(splits) * partial_floats : 0); }
  float* row_dot(const Launch& launch) const { return launch.shared(); }
  // The dQ chunk `chunk` adds into: the real dQ when each (b, g) is one chunk, else its partial.
  Rows<float> grad_q(const AttentionBackwardProblem& bp, const Launch& launch, int64_t chunk) const {
    const AttentionProblem& p = bp.forward;
    if (splits == 1) return bp.grad_q;
    return {launch.shared() + row_dot_floats + static_cast<size_t>(chunk) * partial_floats,
            p.q_heads * p.q_len * p.head_dim, p.q_len * p.head_dim, p.head_dim};
  }
};

// Pass 1, per row: D = dO . O (in float64, as the reference) and dQ (or every partial) = 0, by
// runs of 64 rows.
void row_dots_and_zero_grad_q(const AttentionBackwardProblem& bp, const Chunks& chunks, const Launch& launch) {
  const AttentionProblem& p = bp.forward;
  const int64_t nq = p.q_len;
  launch.for_each_run(chunks.rows, 64, [&](int64_t first, int64_t last) {
    HWY_DYNAMIC_DISPATCH(RowDots)(bp, first, last, chunks.row_dot(launch));
    for (int64_t row = first; row < last; ++row) {
      const int64_t b = row / (p.q_heads * nq), h = row / nq % p.q_heads, i = row % nq;
      for (int64_t s = 0; s < chunks.splits; ++s) std::fill_n(chunks.grad_q(bp, launch, s).row(b, h, i), p.head_dim, 0.0f);
    }
  });
}

// Pass 2, item (b, g, chunk): dK and dV of the chunk's keys, its part of dQ. Keys no query of
// the batch may see get zero gradients here.
void key_chunk(const AttentionBackwardProblem& bp, const Chunks& chunks, const Launch& launch, int64_t item,
               uint16_t* amx_block, const flash::BackwardAmxLayout& amx_layout) {
  const AttentionProblem& p = bp.forward;
  const int64_t nq = p.q_len, nk = p.kv_len, key_tile = static_cast<int64_t>(flash::kKeyTile);
  const int64_t pair = item / chunks.splits, chunk = item % chunks.splits;
  const int64_t b = pair / p.kv_heads, g = pair % p.kv_heads;
  const auto visible_end_of = [&](int64_t batch) {
    return nq > 0 ? std::clamp<int64_t>(p.last_visible_key(batch, nq - 1), 0, nk) : 0;
  };
  const int64_t visible_end = visible_end_of(b);
  // The chunks split the keys up to split_end. With a bias gradient broadcast over the batch,
  // chunk n of every batch element runs in one group, after the others (bias_waves), and must
  // cover the same keys: split_end is then the last key any batch element sees (key lengths
  // differ per batch), each element's chunk cut at its own end. (Split at each element's own end,
  // chunk n of one element overlapped chunk n + 1 of another, which ran at the same time on
  // another worker and added into the same dbias lines: a race.)
  int64_t split_end = visible_end;
  if (bp.grad_bias.data && bp.grad_bias.stride_b == 0)
    for (int64_t other = 0; other < p.batch; ++other) split_end = std::max(split_end, visible_end_of(other));
  const int64_t visible_tiles = (split_end + key_tile - 1) / key_tile;
  const int64_t key_begin = std::min(visible_end, visible_tiles * chunk / chunks.splits * key_tile);
  const int64_t key_end = std::min(visible_end, visible_tiles * (chunk + 1) / chunks.splits * key_tile);
  if (chunk == chunks.splits - 1)
    for (int64_t j = visible_end; j < nk; ++j) {
      std::fill_n(bp.grad_k.row(b, g, j), p.head_dim, 0.0f);
      std::fill_n(bp.grad_v.row(b, g, j), p.value_dim, 0.0f);
    }
  if (key_begin >= key_end) return;
  HWY_DYNAMIC_DISPATCH(BackwardKeyChunk)(bp, b, g, key_begin, key_end, chunks.row_dot(launch),
                                         chunks.grad_q(bp, launch, chunk), launch.block_of_this_worker(), amx_block,
                                         &amx_layout);
}

// Pass 3, several chunks: dQ = the partials summed in chunk order, by runs of rows.
void sum_partials(const AttentionBackwardProblem& bp, const Chunks& chunks, const Launch& launch) {
  const AttentionProblem& p = bp.forward;
  const int64_t nq = p.q_len, dk = p.head_dim;
  const float* partials = launch.shared() + chunks.row_dot_floats;
  launch.for_each_run(chunks.rows, 1, [&](int64_t row, int64_t) {
    const int64_t b = row / (p.q_heads * nq), h = row / nq % p.q_heads, i = row % nq;
    float* grad_q = bp.grad_q.row(b, h, i);
    for (int64_t c = 0; c < dk; ++c) {
      float sum = 0;
      for (int64_t s = 0; s < chunks.splits; ++s)
        sum += partials[static_cast<size_t>(s) * chunks.partial_floats + static_cast<size_t>(row * dk + c)];
      grad_q[c] = sum;
    }
  });
}

// Passes 1-3 on `bp` (the tiles: with strided keys split off, `rest` only), then pass 4 when
// `split` is given: its residues on `whole`, the original problem, items of kResiduesPerItem
// residues of a (b, g), each owning its residues' dK, dV and dQ rows. Nothing depends on which
// worker runs an item, so the same inputs and thread count give the same bits; the thread count
// only decides the number of chunks.
void backward_passes(const AttentionBackwardProblem& bp, const StridedSplit* split,
                     const AttentionBackwardProblem& whole) {
  const AttentionProblem& p = bp.forward;
  const int64_t dk = p.head_dim, dv = p.value_dim;
  const double flops = 2.5 * 2.0 * static_cast<double>(p.batch * p.q_heads * p.q_len) *
                       static_cast<double>(p.kv_len) * static_cast<double>(dk + dv);
  const Chunks chunks(p, threads_for(flops), bias_pair_waves(bp.grad_bias, p.batch, p.q_heads, p.kv_heads));
  const size_t br = HWY_DYNAMIC_DISPATCH(BackwardQueryTileRows)();
  const Launch launch(WorkspaceSlot::FlashScratch, flops, chunks.items,
                      flash::BackwardScratchLayout(p, br).total,
                      chunks.shared_floats());
  // The AMX products (MatmulPrecision High or Medium, a CPU with AMX, Dk and Dv multiples of 16,
  // 16 float lanes: BackwardKeyChunk checks): each worker's block, or none (amx::worker_blocks).
  flash::BackwardAmxLayout amx_layout;
  uint16_t* amx_blocks = nullptr;
  if (p.amx_parts > 0 && dk % 16 == 0 && dv % 16 == 0 && amx::available()) {
    amx_layout = flash::BackwardAmxLayout(p.amx_parts, br, static_cast<size_t>(dk), static_cast<size_t>(dv));
    amx_blocks = amx::worker_blocks(amx_layout.total, launch.workers());
  }

  row_dots_and_zero_grad_q(bp, chunks, launch);
  // The items that add into the same dbias elements (the same position in each wave,
  // bias_gradient.hpp) run in wave order on one worker, the next one while its dbias is still in
  // cache; without dbias every item is its own group.
  std::vector<int64_t> starts;
  const std::vector<int64_t> order = bias_waves(bp.grad_bias, p.batch, p.q_heads, p.kv_heads, chunks.splits, starts);
  const size_t waves = starts.size() - 1;
  launch.for_each(starts[1], [&](int64_t n) {
    const size_t worker = static_cast<size_t>(worker_index(launch.workers()));
    for (size_t wave = 0; wave < waves; ++wave)
      key_chunk(bp, chunks, launch, order[static_cast<size_t>(starts[wave] + n)],
                amx_blocks ? amx_blocks + worker * amx_layout.total : nullptr, amx_layout);
  });
  if (chunks.splits > 1) sum_partials(bp, chunks, launch);
  if (split == nullptr) return;
  flash::for_each_residue_item(launch, whole.forward, split->stride, p.kv_heads,
                               [&](int64_t b, int64_t g, int64_t first, int64_t last) {
                                 HWY_DYNAMIC_DISPATCH(BackwardResidues)(whole, *split, b, g, first, last,
                                                                        chunks.row_dot(launch),
                                                                        launch.block_of_this_worker());
                               });
}

}  // namespace

void flash_attention_backward(const AttentionBackwardProblem& bp) {
  // With a bias gradient the tiles evaluate the whole rule (no residues: their items, which own
  // query rows, would add into one dbias element at once where the bias broadcasts over queries).
  if (bp.grad_bias.data) return backward_passes(bp, nullptr, bp);
  // A `rest | strided(S)` rule with S >= Bc: the tiles see `rest` (a band folded into the band),
  // then the strided keys are added by residues, as the forward gathers them.
  const StridedSplit split = strided_split(bp.forward.rule, static_cast<int64_t>(flash::kKeyTile));
  if (split.rest < 0) return backward_passes(bp, nullptr, bp);
  AttentionBackwardProblem tiles = bp;
  tiles.forward.rule = rest_rule(bp.forward.rule, split, tiles.forward.band_lo, tiles.forward.band_hi);
  backward_passes(tiles, &split, bp);
}

}  // namespace qkv::detail
#endif  // HWY_ONCE
