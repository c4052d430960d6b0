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
// is loaded, LoadKvTile in operands-inl.h).
//
// Files: layout.hpp (Bc, the scratch and AMX block layouts), operands-inl.h (K/V tiles read in
// place or widened, Qt packed, AMX splits), products-inl.h (the two products, float32 or AMX),
// residues-inl.h (strided keys); this file holds the loop order and the launch.
//
// Memory traffic per item (Dk = Dv = d, visible keys n): Q and O once (2 Br d floats), K and V
// once per item (2 n d floats, from L2: consecutive items share a head), against 4 Br n d flops.
// Q and O rows come from memory when the problem outgrows the caches, so each item prefetches
// the next item's into L2, a slice per key tile (QueryTileKeys).
// Qt + St + Ot = (2 d + Bc) Br floats stay in L1 (d = 64: 36 KB, inside a 48 KB L1d). The micro-GEMM
// does kTileRows x kTileVectors FMAs per kTileRows broadcasts + kTileVectors loads.
//
// Masks: the band (causal, window) and key lengths give each query a key range
// [first_visible_key, last_visible_key); a key tile outside every range of the query tile is
// skipped (causal costs about half), a tile inside every range runs with no per-element mask
// work, the rest mask per element. Tensor terms are read per tile, per element. Score
// modifiers (softcap, ALiBi) and the sink are the pipeline's steps (attention/steps/pipeline-inl.h), as is every
// step named below.
//
// Strided keys (a root rule `rest | strided(S, O)`, S >= Bc) run first, by residues
// (residues-inl.h), and leave each row's softmax state for the tiles, which evaluate `rest`.
//
// Highway's foreach_target re-includes this file once per SIMD target (see hwy/examples/
// skeleton.cc); the threading and the exported entry point live in the HWY_ONCE part below.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/flash/forward.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "attention/steps/pipeline-inl.h"
#include "attention/flash/operands-inl.h"
#include "attention/flash/products-inl.h"
#include "attention/flash/residues-inl.h"
#include "hwy/highway.h"

#ifndef QKV_ATTENTION_FLASH_ONCE
#define QKV_ATTENTION_FLASH_ONCE
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>

#include "attention/flash/flash.hpp"
#include "attention/flash/layout.hpp"
#include "attention/problem.hpp"
#include "gemm/amx.hpp"
#include "simd/query_tiles.hpp"
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using flash::kKeyTile;
using flash_steps::ForwardProducts;
using flash_steps::ForwardScratch;
using flash_steps::TileAt;
using tile_gemm::kTileVectors;
namespace step = pipeline;
using step::kResidueVectors;
using step::TileMask;
using step::Walk;

// Br, queries per work item at most: exactly the micro-tile width, so one micro-GEMM call spans
// the whole query tile and its running max / sum are kTileVectors vectors (48 queries on AVX-512).
size_t QueryTileRows() { return kTileVectors * hn::Lanes(DF()); }
size_t VectorLanes() { return hn::Lanes(DF()); }

// This target's HWY_TARGET bit, so tests can see which code a dispatch reaches.
int64_t CompiledTarget() { return HWY_TARGET; }

// One key tile of a query tile of V vectors: load K and V, S^T = K Qt, logits (softcap on the
// whole tile, then ALiBi and the mask: the band for the whole tile at once, the rest one key line
// at a time), the online softmax update (one lane per query; Ot moves to a grown max by the
// correction the next product applies), dropout on P (scaling exp(s - m) is scaling
// exp(s - m) / l at the end), and Ot += V^T P^T.
template <size_t V>
void FlashKeyTile(const AttentionProblem& p, const Walk& walk, const TileAt& t, const TileMask& mask,
                  const ForwardProducts& products, const ForwardScratch& w) {
  const size_t br = V * hn::Lanes(DF());
  const flash_steps::KvTile kv = flash_steps::LoadKvTile(p, t.b, t.g, t.j0, walk.key_step, t.cols, w);
  // The causal diagonal: both products skip the query vectors the band hides (a diagonal tile of
  // 3 vectors skips two thirds of its hidden half).
  std::array<size_t, V> trim;
  step::DiagonalTrim(p, walk, mask, t.i0, t.j0, t.cols, V, trim.data());
  if (!p.terms.empty())  // the next key tile's, during this one (the current one's came too late)
    step::PrefetchTermTiles(p, walk, t.b, t.h, t.i0, t.rows, t.j0 + static_cast<int64_t>(t.cols) * walk.key_step,
                            t.cols);
  const bool on_amx = products.OnAmx(p, walk, t);
  products.Scores<V>(p, on_amx, kv, trim, t, w);
  step::Softcap(p, w.scores, t.cols * br);
  step::TileLogits(p, walk, mask, t.b, t.h, t.i0, t.rows, t.j0, t.cols, br, w.scores, w.score_mod, nullptr,
                   w.term_t);
  const bool max_grew = step::SoftmaxColumnsUpdate<V>(w.scores, t.cols, w.running_max, w.row_sum, w.correction);
  if (p.dropout_p > 0)
    for (size_t j = 0; j < t.cols; ++j) step::Dropout(p, t.line(walk, j), w.scores + j * br, t.rows);
  const bool some_zero = mask.band || mask.hide >= 0 || !p.terms.empty() || p.dropout_p > 0;
  const bool skip_zeros = some_zero && !flash_steps::HiddenValuesFinite(p, walk, mask, t, kv);
  products.Accumulate<V>(p, on_amx, skip_zeros, max_grew, kv, trim, t, w);
}

// The strided residues [first, last) of head (b, h) (residues-inl.h), on float32 products.
void StridedResidues(const AttentionProblem& p, const StridedSplit& split, int64_t b, int64_t h, int64_t first,
                     int64_t last, float* HWY_RESTRICT scratch) {
  const ForwardScratch w(scratch, flash::ForwardScratchLayout(p, QueryTileRows()));
  flash_steps::ForwardResidues(p, split, b, h, first, last, w, [&](const Walk& walk, const TileAt& t, const TileMask& mask) {
    FlashKeyTile<kResidueVectors>(p, walk, t, mask, ForwardProducts{}, w);
  });
}

// The key tiles of one query tile of V vectors (queries i0 .. i0 + rows - 1): the keys any of
// them sees, by tiles of Bc; tiles outside [kv_begin, kv_end) are never visited. `next`: the
// query tile the worker most likely runs next (its share's next item), whose Q rows and the
// output rows it will write are prefetched into L2 meanwhile, a slice of rows before each key
// tile (spread so: issued all at the item's start they stalled there; docs/performance-log.md,
// "flash/").
template <size_t V>
void QueryTileKeys(const AttentionProblem& p, const flash::QueryTile& at, const ForwardProducts& products,
                   const ForwardScratch& w, const flash::QueryTile& next) {
  const int64_t b = at.b, h = at.h, i0 = at.i0, i_last = i0 + at.rows - 1;
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
    FlashKeyTile<V>(p, {}, TileAt{b, h, p.kv_head_of(h), i0, static_cast<size_t>(at.rows), j0, cols},
                    {tile != step::TileClass::Full, -1}, products, w);
  }
}

// The products of a query tile: on AMX tiles when the worker has an AMX block (`amx`, laid out by
// `amx_layout`), the target has 16 float lanes (an AMX tile row holds 16 query lanes) and Qt's
// parts fit (a query tile holding NaN or inf stays float32); else float32.
ForwardProducts QueryTileProducts(const AttentionProblem& p, size_t br, uint16_t* amx,
                                  const flash::ForwardAmxLayout* amx_layout, const ForwardScratch& w) {
  if (amx == nullptr || hn::Lanes(DF()) != amx::kRows) return {};
  const size_t dk = static_cast<size_t>(p.head_dim);
  if (!amx::split_pairs(p.amx_parts, true, w.q_t, br, br, dk, amx_layout->dk_pad / 2, amx + amx_layout->q,
                        amx_layout->q_part))
    return {};
  amx::configure();
  return {p.amx_parts, amx, amx_layout};
}

// One work item: the query tile `at` (at.rows <= Br). `scratch`: this worker's block
// (flash::ForwardScratchLayout). `carried`: the strided residues ran first and left each row's
// softmax state in the outputs; continue from it. `amx`: this worker's AMX block, else null.
// `next`: the query tile whose rows to prefetch meanwhile.
void FlashQueryTile(const AttentionProblem& p, bool carried, const flash::QueryTile& at, float* HWY_RESTRICT scratch,
                    uint16_t* amx, const flash::ForwardAmxLayout* amx_layout, const flash::QueryTile& next) {
  const size_t lanes = hn::Lanes(DF()), rows = static_cast<size_t>(at.rows);
  const size_t dv = static_cast<size_t>(p.value_dim);
  // The width of this tile: the vectors its queries fill (QueryTiles, simd/query_tiles.hpp).
  const size_t vectors = std::min(kTileVectors, (rows + lanes - 1) / lanes), br = vectors * lanes;
  const ForwardScratch w(scratch, flash::ForwardScratchLayout(p, QueryTileRows()));
  const int64_t row0 = (at.b * p.q_heads + at.h) * p.q_len + at.i0;

  // Qt = scale * Q^T, Ot = 0 and each query's softmax started, or Ot and the softmax state as
  // the residues left them.
  flash_steps::StartQueryTile(p, at.b, at.h, at.i0, 1, rows, br, w);
  if (carried) {
    const Rows<const float> partial{p.output.data, p.output.batch_stride, p.output.head_stride, p.output.row_stride};
    step::PackTransposed(partial, at.b, at.h, at.i0, rows, dv, br, 1.0f, w.out_t);
    std::copy_n(p.row_max + row0, rows, w.running_max);
    std::copy_n(p.row_sum + row0, rows, w.row_sum);
  }
  const ForwardProducts products = QueryTileProducts(p, br, amx, amx_layout, w);
  if (vectors == 1) {
    QueryTileKeys<1>(p, at, products, w, next);
  } else if (vectors == 2) {
    QueryTileKeys<2>(p, at, products, w, next);
  } else {
    QueryTileKeys<kTileVectors>(p, at, products, w, next);
  }
  if (products.amx) amx::release();

  // Each query finished: O = Ot^T / l, then lse and the row stats, each the tile's `rows`
  // contiguous floats of its (B, Hq, Nq) array written as one run (not a store per row: docs/performance-log.md, "flash/").
  step::FinishColumns(w.running_max, w.row_sum, br, w.correction, w.scores);
  step::UnpackTransposed(w.out_t, br, rows, dv, w.correction, p.output, at.b, at.h, at.i0);
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

#include "attention/launch.hpp"
#include "core/allocator.hpp"

namespace qkv::detail {

HWY_EXPORT(QueryTileRows);
HWY_EXPORT(VectorLanes);
HWY_EXPORT(FlashQueryTile);
HWY_EXPORT(StridedResidues);
HWY_EXPORT(CompiledTarget);

namespace {

// The AMX products' blocks (MatmulPrecision High or Medium, a CPU with AMX, 16 float lanes): one
// per worker, none of them holding a head's splits yet. A block grows with Nk (a head's K and V
// split), and stays in the calling thread's workspace for the next call as the scratch does.
// Past 64 MiB a worker (64K keys at d = 128 with two parts) or 1 GiB in all, or when the
// allocation fails, there are none and the products stay float32 (amx::worker_blocks).
struct ForwardAmxBlocks {
  flash::ForwardAmxLayout layout;
  uint16_t* blocks = nullptr;

  ForwardAmxBlocks(const AttentionProblem& problem, size_t br, int64_t lanes, int workers) {
    if (problem.amx_parts <= 0 || lanes != static_cast<int64_t>(amx::kRows) || !amx::available()) return;
    layout = flash::ForwardAmxLayout(problem.amx_parts, br, static_cast<size_t>(problem.head_dim),
                                     static_cast<size_t>(problem.value_dim), static_cast<size_t>(problem.kv_len));
    blocks = amx::worker_blocks(layout.total, workers);
    for (int worker = 0; blocks != nullptr && worker < workers; ++worker)
      *reinterpret_cast<flash::AmxHeld*>(blocks + static_cast<size_t>(worker) * layout.total) = {-1, -1, 0,
                                                                                                 flash::kAllFit};
  }
  // The block of the worker running a Launch::for_each body, or null.
  uint16_t* of_this_worker(int workers) const {
    return blocks != nullptr ? blocks + static_cast<size_t>(worker_index(workers)) * layout.total : nullptr;
  }
};

// The query tiles of one head: Br rows each, the last ones narrowed to the vectors they fill.
QueryTiles query_tiles_of(const AttentionProblem& problem) {
  const size_t br = HWY_DYNAMIC_DISPATCH(QueryTileRows)();
  const int64_t lanes = static_cast<int64_t>(HWY_DYNAMIC_DISPATCH(VectorLanes)());
  return QueryTiles(problem.q_len, lanes, static_cast<int64_t>(br) / lanes);
}

}  // namespace

int64_t flash_forward_items(const AttentionProblem& problem) {
  return problem.batch * problem.q_heads * query_tiles_of(problem).count;
}

// The forward's launch: items (b, h, query tile) over the workers, after the strided residues
// when the rule has them; each worker's float block laid out by ForwardScratchLayout, and its AMX
// block (ForwardAmxLayout) when the products may run on AMX tiles.
void flash_attention(const AttentionProblem& problem) {
  const int64_t nq = problem.q_len;
  if (problem.batch == 0 || problem.q_heads == 0 || nq == 0) return;

  const size_t br = HWY_DYNAMIC_DISPATCH(QueryTileRows)();
  const int64_t lanes = static_cast<int64_t>(HWY_DYNAMIC_DISPATCH(VectorLanes)());
  const QueryTiles tiling = query_tiles_of(problem);
  const int64_t query_tiles = tiling.count;
  const int64_t items = flash_forward_items(problem);
  const double flops = 4.0 * static_cast<double>(items) * static_cast<double>(br) *
                       static_cast<double>(problem.kv_len) * static_cast<double>(problem.head_dim + problem.value_dim) / 2;
  const Launch launch(WorkspaceSlot::FlashScratch, flops, items, flash::ForwardScratchLayout(problem, br).total);

  // A `rest | strided(S)` rule with S >= Bc: the strided keys first, by residues (b, h, first
  // query), then the tiles see `rest` (a band folded into the band) and continue each row.
  const StridedSplit split = strided_split(problem.rule, static_cast<int64_t>(flash::kKeyTile));
  std::optional<AttentionProblem> tiles_problem;
  if (split.rest >= 0) {
    flash::for_each_residue_item(launch, problem, split.stride, problem.q_heads,
                                 [&](int64_t b, int64_t h, int64_t first, int64_t last) {
                                   HWY_DYNAMIC_DISPATCH(StridedResidues)(problem, split, b, h, first, last,
                                                                         launch.block_of_this_worker());
                                 });
    tiles_problem = problem;
    tiles_problem->rule = rest_rule(problem.rule, split, tiles_problem->band_lo, tiles_problem->band_hi);
  }
  const AttentionProblem& tiles = tiles_problem ? *tiles_problem : problem;

  const ForwardAmxBlocks amx(problem, br, lanes, launch.workers());
  // Items in (batch, head, query tile) order, so neighbouring items share K and V in cache (a
  // thread's share is whole heads, simd/item_shares.hpp); within a head the last query tiles come
  // first: under a causal mask they see the most keys, so a share runs its longest items first
  // and leaves its shortest at the back, where other threads take them.
  const auto query_tile_of = [&](int64_t item) {
    const int64_t bh = item / query_tiles, tile = query_tiles - 1 - item % query_tiles;
    return flash::QueryTile{bh / problem.q_heads, bh % problem.q_heads, tiling.first_query(tile), tiling.rows(tile)};
  };
  launch.for_each(items, [&](int64_t item) {
    const flash::QueryTile at = query_tile_of(item);
    const flash::QueryTile next = item + 1 < items ? query_tile_of(item + 1) : flash::QueryTile{};  // a guess
    HWY_DYNAMIC_DISPATCH(FlashQueryTile)(tiles, tiles_problem.has_value(), at, launch.block_of_this_worker(),
                                         amx.of_this_worker(launch.workers()), &amx.layout, next);
  });
}

int64_t flash_attention_compiled_targets() { return HWY_TARGETS; }

int64_t flash_attention_target() { return HWY_DYNAMIC_DISPATCH(CompiledTarget)(); }

}  // namespace qkv::detail
#endif  // HWY_ONCE
