// The decode kernel: softmax(Q K^T * scale + mask) V for a few queries against a long KV cache
// (generation time: Nq = 1 or a few, Nk in the thousands), split over the keys as in
// FlashDecoding and ggml's split-KV flash_attn_ext. Same semantics as reference/forward.cpp, dropout
// included; writes output and lse, never weights.
//
// Work. One item is (batch b, key/value head g, key chunk c) (plan.hpp), or for paged K/V that
// decode::page_major_fits, when there is one for each worker, (batch b, key chunk c) over every
// head, reading a pool's pages in runs (page_major-inl.h). An item runs an online softmax over
// the keys of its chunk (chunk-inl.h, on tiles-inl.h's steps) and leaves, per row, a partial:
// running max m_c, sum l_c and unnormalised output o_c (Dv). A second pass merges the chunks of
// each row (merge_row, attention/lse_merge.hpp):
//   m = max_c m_c,   l = sum_c l_c exp(m_c - m),   o = sum_c o_c exp(m_c - m),
//   output = o / l,  lse = m + log l.
// A chunk that saw no key leaves m_c = -inf, l_c = 0, o_c = 0 and adds exactly 0; a row that no
// chunk saw (m = -inf) gets output 0 and lse = -inf, never NaN. When (b, g) has a single chunk
// its item writes the final output and lse itself and there is nothing to merge.
//
// Highway's foreach_target re-includes this file once per SIMD target (see flash/forward.cpp), and
// with it the per-target -inl.h files; the launch, the merge and the exported entry point live in
// the HWY_ONCE part below.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/decode/decode.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "attention/decode/chunk-inl.h"
#include "attention/decode/page_major-inl.h"
#include "hwy/highway.h"

#if HWY_ONCE
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>

#include "attention/decode/plan.hpp"
#include "attention/kernels.hpp"
#include "attention/launch.hpp"
#include "attention/lse_merge.hpp"
#include "attention/problem.hpp"
#include "mask/rule.hpp"
#include "simd/item_shares.hpp"

namespace qkv::detail {

HWY_EXPORT(DecodeChunk);
HWY_EXPORT(DecodePageMajor);

namespace {

// The merge of one row's chunks (row r of (b, g) = bg), merge_softmax_parts
// (attention/lse_merge.hpp): chunk c is the part (m_c, l_c, o_c); a chunk that saw nothing
// (m_c = -inf) weighs 0, a row no chunk saw gets 0 and lse -inf, one a chunk saw NaN in gets NaN.
void merge_row(const AttentionProblem& p, const decode::Plan& plan, const decode::Partials& partials, int64_t bg,
               int64_t r) {
  const int64_t dv = p.value_dim;
  const int64_t b = bg / p.kv_heads, g = bg % p.kv_heads;
  const int64_t h = plan.head_of(g, r), i = plan.query_of(r);
  const int64_t row = (b * p.q_heads + h) * p.q_len + i;  // in (B, Hq, Nq)
  const MergedRow merged = merge_softmax_parts(
      plan.chunks,
      [&](int64_t c) {
        const int64_t slot = (bg * plan.chunks + c) * plan.rows + r;
        return SoftmaxPart{partials.max[slot], partials.sum[slot], partials.out + slot * dv};
      },
      static_cast<size_t>(dv), p.output.row(b, h, i));
  p.lse[row] = merged.lse;
  p.row_max[row] = merged.max;
  p.row_sum[row] = merged.sum;
}

// Merges rows [first, last) of every (b, g) with several chunks, rows numbered (b, g) outer.
void merge_rows(const AttentionProblem& p, const decode::Plan& plan, const decode::Partials& partials, int64_t first,
                int64_t last) {
  for (int64_t row = first; row < last; ++row) merge_row(p, plan, partials, row / plan.rows, row % plan.rows);
}

}  // namespace

bool decode_attention(const AttentionProblem& problem) {
  if (problem.batch == 0 || problem.q_heads == 0 || problem.q_len == 0) return !problem.scales_unchecked;

  // The workers the arithmetic pays for (one: the calling thread, no region), each with a
  // decode::ScratchLayout block, and the partials shared when there are several chunks
  // (attention/launch.hpp). The plan takes page-major items only when there is one for each
  // of those workers.
  const double flops = 2.0 * static_cast<double>(problem.batch * problem.q_heads * problem.q_len) *
                       static_cast<double>(problem.kv_len) * static_cast<double>(problem.head_dim + problem.value_dim);
  const decode::Plan plan(problem, std::min(threads_for(flops), omp_get_max_threads()));
  const int64_t groups = problem.batch * problem.kv_heads;
  const int64_t items = plan.items;
  const size_t slots = plan.chunks > 1 ? static_cast<size_t>(groups * plan.chunks * plan.rows) : 0;
  const Launch launch(WorkspaceSlot::DecodeScratch, flops, items, decode::ScratchLayout(plan).total,
                      slots * (2 + static_cast<size_t>(problem.value_dim)));
  float* partial_base = launch.shared();
  const decode::Partials partials{partial_base, partial_base + slots, partial_base + 2 * slots};

  // A `rest | strided(S)` rule: the tiles see `rest`, the strided keys are gathered per query.
  // Paged K/V never gather: a strided run of keys crosses pages, and the tiles evaluate the rule.
  const StridedSplit split = problem.paged.on() ? StridedSplit{} : strided_split(problem.rule, decode::kMinGatherStride);
  std::optional<AttentionProblem> tiles_problem;
  if (split.rest >= 0) {
    tiles_problem = problem;
    tiles_problem->rule.root_node = split.rest;
  }
  const AttentionProblem& tiles = tiles_problem ? *tiles_problem : problem;
  const StridedSplit* gather = tiles_problem ? &split : nullptr;

  // The work of every worker: the items, then (after a barrier, so every partial is written)
  // the merge. Items in (batch, kv head, chunk) order, dealt in contiguous shares with stealing
  // (simd/item_shares.hpp): a worker keeps its heads from call to call, and masks that make
  // chunks unequal still balance.
  // Paged K/V in (b, g, chunk) items take them chunk-major instead (every head of a chunk in
  // turn): a pool holds a key's heads side by side (row stride Hkv D), so consecutive items read
  // neighbouring rows of the same pages rather than one row per 4 KB page of a head far from the
  // last. Page-major items are (b, chunk), batch outer.
  const bool chunk_major = problem.paged.on();
  // Set by an item that met a bad scale (problem.scales_unchecked: every item checks its own).
  std::atomic<bool> bad_scales{false};
  ItemShares shares(launch.workers(), items);
  const int64_t merged_rows = plan.chunks > 1 ? groups * plan.rows : 0;
  launch.parallel([&](int worker) {
    float* block = launch.block(worker);
    shares.run(worker, [&](int64_t item) {
      if (plan.page_major)
        return HWY_DYNAMIC_DISPATCH(DecodePageMajor)(problem, plan, item / plan.chunks, item % plan.chunks, partials,
                                                        block);
      const int64_t bg = chunk_major ? item % groups : item / plan.chunks;
      const int64_t chunk = chunk_major ? item / groups : item % plan.chunks;
      HWY_DYNAMIC_DISPATCH(DecodeChunk)(tiles, plan, gather, bg / problem.kv_heads, bg % problem.kv_heads, chunk,
                                        partials, block, problem.scales_unchecked ? &bad_scales : nullptr);
    });
    if (merged_rows == 0) return;
    // One worker: no OpenMP construct at all (Launch::parallel's contract).
    if (launch.workers() == 1) return merge_rows(problem, plan, partials, 0, merged_rows);
#pragma omp barrier  // every partial written
#pragma omp for schedule(static)
    for (int64_t row = 0; row < merged_rows; ++row) merge_row(problem, plan, partials, row / plan.rows, row % plan.rows);
  });
  return !bad_scales.load(std::memory_order_relaxed);
}

// Decode beats flash up to a handful of queries (flash pads queries to its tile; decode's work
// grows with group x queries, each query a row of its own). Measured on 2 threads, where flash's
// (batch, head, query tile) items filled both: with a head dimension of 128 decode was faster up
// to 8 queries and level at 10-12, with 64 level at 8 and slower at 10-12, and from 16 queries
// flash was faster on every shape (docs/performance-log.md, "W5: the bias in the Small kernel's
// stores, and Auto's decode crossover"); 8 is the bound that holds for both. Flash never splits
// keys, so where its items are fewer than the threads (one sequence, few heads, many cores)
// decode, which does, keeps every thread busy: up to kDecodeMaxQueriesIdleFlash queries there
// (the bound measured before flash was faster). Decode parallelises over (batch, kv head, key
// chunk) items (page-major items are paged only, never asked here), so it needs one item per
// thread.
constexpr int64_t kDecodeMaxQueries = 8;
constexpr int64_t kDecodeMaxQueriesIdleFlash = 64;

bool decode_is_faster(const AttentionProblem& problem) {
  if (problem.q_len > kDecodeMaxQueriesIdleFlash) return false;
  const int threads = omp_get_max_threads();
  if (decode::Plan(problem, threads).items < threads) return false;
  return problem.q_len <= kDecodeMaxQueries || flash_forward_items(problem) < threads;
}

}  // namespace qkv::detail
#endif  // HWY_ONCE
