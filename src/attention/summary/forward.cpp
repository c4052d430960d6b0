// The flash forward with summaries (AttentionOptions::summary_top_k): flash/forward.cpp's loop
// (work items of one query tile, key tiles with an online softmax) composed from the same steps
// (products, logits, softmax, finish), with the summary steps (summary/steps-inl.h) between and
// inside them:
//   per key tile   after the logits: the top k offered (TopLogits); in the softmax update's own
//                  passes: T moved and added to (EntropyTerms); the max kept (KeepMax; P itself
//                  is computed in its slot of the kept weights)
//   per query tile after finish: each row's entropy and top keys (FinishRowSummaries), the kept
//                  P folded into the head's received mass at the final max and sum (FoldReceived)
// Each worker adds received mass into its own (B, Hq, Nk) partial; the launch sums them after.
// Memory: per worker the flash scratch plus br x Nk kept weights and br x k top keys (k rounded
// up to 4, 8 or 16; keys int32, so at most 2^31 - 1 keys).
//
// Simpler than flash/forward.cpp where speed matters less than one pass: float32 products at
// every MatmulPrecision (no AMX), and a strided rule's keys visited by the tiles (no residues),
// so the weights equal flash's up to the order of the products' sums.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/summary/forward.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "attention/steps/pipeline-inl.h"
#include "attention/flash/operands-inl.h"
#include "attention/flash/products-inl.h"
#include "attention/summary/steps-inl.h"
#include "hwy/highway.h"

#ifndef QKV_ATTENTION_SUMMARY_FORWARD_ONCE
#define QKV_ATTENTION_SUMMARY_FORWARD_ONCE
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>

#include "attention/flash/layout.hpp"
#include "attention/problem.hpp"
#include "attention/summary/layout.hpp"
#include "attention/summary/summary.hpp"
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
using summary_steps::SummaryScratch;
namespace step = pipeline;

// Names apart from flash/forward.cpp's (both are functions of the same per-target namespace).
size_t SummaryQueryTileRows() { return tile_gemm::kTileVectors * hn::Lanes(DF()); }
size_t SummaryVectorLanes() { return hn::Lanes(DF()); }

// One key tile (`tile`-th of the query tile's): flash's steps, the summary's between them.
// The tile's scores, then P, live in its slot of the kept weights (no copy for FoldReceived).
template <size_t V>
void SummaryKeyTile(const AttentionProblem& p, const TileAt& t, size_t tile, const step::TileMask& mask,
                    const ForwardScratch& scratch, const SummaryScratch& s) {
  const size_t br = V * hn::Lanes(DF());
  ForwardScratch w = scratch;
  w.scores = s.kept + tile * kKeyTile * br;
  const step::Walk walk;
  const flash_steps::KvTile kv = flash_steps::LoadKvTile(p, t.b, t.g, t.j0, 1, t.cols, w);
  std::array<size_t, V> trim;
  step::DiagonalTrim(p, walk, mask, t.i0, t.j0, t.cols, V, trim.data());
  if (!p.terms.empty())  // the next key tile's, during this one
    step::PrefetchTermTiles(p, walk, t.b, t.h, t.i0, t.rows, t.j0 + static_cast<int64_t>(t.cols), t.cols);
  const ForwardProducts products;
  products.Scores<V>(p, false, kv, trim, t, w);
  step::Softcap(p, w.scores, t.cols * br);
  step::TileLogits(p, walk, mask, t.b, t.h, t.i0, t.rows, t.j0, t.cols, br, w.scores, w.score_mod, nullptr,
                   w.term_t);
  summary_steps::TopLogits<V>(w.scores, t.cols, t.j0, s);
  summary_steps::EntropyTerms<V> entropy(s);
  const bool max_grew =
      step::SoftmaxColumnsUpdateWith<V>(w.scores, t.cols, w.running_max, w.row_sum, w.correction, entropy);
  summary_steps::KeepMax(br, tile, w.running_max, s);
  const bool some_zero = mask.band || !p.terms.empty();
  const bool skip_zeros = some_zero && !flash_steps::HiddenValuesFinite(p, walk, mask, t, kv);
  products.Accumulate<V>(p, false, skip_zeros, max_grew, kv, trim, t, w);
}

// The key tiles [kv_begin, kv_end) of one query tile of V vectors; tile t of them is kept in slot t.
template <size_t V>
void SummaryTileKeys(const AttentionProblem& p, const flash::QueryTile& at, int64_t kv_begin, int64_t kv_end,
                     const ForwardScratch& w, const SummaryScratch& s) {
  const int64_t key_tile = static_cast<int64_t>(kKeyTile), i_last = at.i0 + at.rows - 1;
  for (int64_t j0 = kv_begin; j0 < kv_end; j0 += key_tile) {
    const size_t cols = static_cast<size_t>(std::min<int64_t>(key_tile, kv_end - j0));
    const int64_t j_end = j0 + static_cast<int64_t>(cols);
    const step::TileClass cls = step::ClassifyMaskTile(p, at.b, at.h, at.i0, i_last, j0, j_end);
    if (cls == step::TileClass::Hidden) continue;
    SummaryKeyTile<V>(p, TileAt{at.b, at.h, p.kv_head_of(at.h), at.i0, static_cast<size_t>(at.rows), j0, cols},
                      static_cast<size_t>((j0 - kv_begin) / key_tile), {cls != step::TileClass::Full, -1}, w, s);
  }
}

// One work item, the query tile `at`: `scratch` the worker's block (flash's, then the summary's),
// `received` the worker's (B, Hq, Nk) partial.
void SummaryQueryTile(const AttentionProblem& p, const SummaryOutputs& out, const flash::QueryTile& at,
                      float* HWY_RESTRICT scratch, float* HWY_RESTRICT received) {
  const size_t lanes = hn::Lanes(DF()), rows = static_cast<size_t>(at.rows);
  const size_t dv = static_cast<size_t>(p.value_dim);
  const size_t vectors = std::min(tile_gemm::kTileVectors, (rows + lanes - 1) / lanes), br = vectors * lanes;
  const flash::ForwardScratchLayout flash_layout(p, SummaryQueryTileRows());
  const summary::ScratchLayout layout(SummaryQueryTileRows(), static_cast<size_t>(out.top_k),
                                      static_cast<size_t>(p.kv_len));
  const ForwardScratch w(scratch, flash_layout);
  const SummaryScratch s(scratch + flash_layout.total, layout);
  const int64_t row0 = (at.b * p.q_heads + at.h) * p.q_len + at.i0;
  const int64_t kv_begin = std::min(p.first_visible_key(at.i0), p.kv_len);
  const int64_t kv_end = std::max(kv_begin, p.last_visible_key(at.b, at.i0 + at.rows - 1));

  flash_steps::StartQueryTile(p, at.b, at.h, at.i0, 1, rows, br, w);
  summary_steps::StartSummaries(rows, br, layout.tiles, s);
  if (vectors == 1) {
    SummaryTileKeys<1>(p, at, kv_begin, kv_end, w, s);
  } else if (vectors == 2) {
    SummaryTileKeys<2>(p, at, kv_begin, kv_end, w, s);
  } else {
    SummaryTileKeys<tile_gemm::kTileVectors>(p, at, kv_begin, kv_end, w, s);
  }
  step::FinishColumns(w.running_max, w.row_sum, br, w.correction, w.scores);
  step::UnpackTransposed(w.out_t, br, rows, dv, w.correction, p.output, at.b, at.h, at.i0);
  std::copy_n(w.scores, rows, p.lse + row0);
  std::copy_n(w.running_max, rows, p.row_max + row0);
  std::copy_n(w.row_sum, rows, p.row_sum + row0);
  summary_steps::FinishRowSummaries(rows, br, w.running_max, w.row_sum, w.correction, row0, out, s);
  summary_steps::FoldReceived(layout.tiles, kv_begin, kv_end, rows, br, w.running_max, w.correction,
                              scratch + flash_layout.total + layout.factor,
                              received + (at.b * p.q_heads + at.h) * p.kv_len, s);
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <limits>
#include <string>

#include "attention/launch.hpp"
#include "qkv/error.hpp"
#include "simd/query_tiles.hpp"

namespace qkv::detail {
HWY_EXPORT(SummaryQueryTileRows);
HWY_EXPORT(SummaryVectorLanes);
HWY_EXPORT(SummaryQueryTile);

// Items (b, h, query tile) over the workers, as flash_attention deals them; each worker's block
// is the flash scratch and the summary scratch, and the shared floats one received-mass partial
// per worker, summed into out.received at the end.
void flash_summary_attention(const AttentionProblem& problem, const SummaryOutputs& out) {
  const int64_t heads = problem.batch * problem.q_heads, nk = problem.kv_len;
  if (nk > std::numeric_limits<int32_t>::max())
    throw Error("attention summaries: at most " + std::to_string(std::numeric_limits<int32_t>::max()) +
                " keys (the top keys are int32 while the kernel runs), got " + std::to_string(nk));
  std::fill_n(out.received, heads * nk, 0.0f);
  if (heads == 0 || problem.q_len == 0) return;
  const size_t br = HWY_DYNAMIC_DISPATCH(SummaryQueryTileRows)();
  const int64_t lanes = static_cast<int64_t>(HWY_DYNAMIC_DISPATCH(SummaryVectorLanes)());
  const QueryTiles tiling(problem.q_len, lanes, static_cast<int64_t>(br) / lanes);
  const int64_t items = heads * tiling.count;
  const double flops = 2.0 * static_cast<double>(heads * problem.q_len) * static_cast<double>(nk) *
                       static_cast<double>(problem.head_dim + problem.value_dim);
  const size_t block = flash::ForwardScratchLayout(problem, br).total +
                       summary::ScratchLayout(br, static_cast<size_t>(out.top_k), static_cast<size_t>(nk)).total;
  const size_t partial = round_to_cache_line(static_cast<size_t>(heads * nk));
  // Sized for every worker the launch may have: its worker count is known only once built.
  const Launch probe(WorkspaceSlot::FlashScratch, flops, items, 0);
  const Launch launch(WorkspaceSlot::FlashScratch, flops, items, block,
                      partial * static_cast<size_t>(probe.workers()));
  const int workers = launch.workers();
  float* partials = launch.shared();
  std::fill_n(partials, partial * static_cast<size_t>(workers), 0.0f);
  launch.for_each(items, [&](int64_t item) {
    // Within a head the last query tiles first, as flash_attention deals them: under a causal
    // mask they see the most keys, so a share ends with its shortest items.
    const int64_t bh = item / tiling.count, tile = tiling.count - 1 - item % tiling.count;
    const flash::QueryTile at{bh / problem.q_heads, bh % problem.q_heads, tiling.first_query(tile), tiling.rows(tile)};
    float* received = partials + partial * static_cast<size_t>(worker_index(workers));
    HWY_DYNAMIC_DISPATCH(SummaryQueryTile)(problem, out, at, launch.block_of_this_worker(), received);
  });
  for (int worker = 0; worker < workers; ++worker)
    for (int64_t x = 0; x < heads * nk; ++x) out.received[x] += partials[partial * static_cast<size_t>(worker) + x];
}

}  // namespace qkv::detail
#endif  // HWY_ONCE
