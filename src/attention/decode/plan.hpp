// Decode's plan: how a problem is cut into work items (batch, K/V head, key chunk), or for paged
// K/V read page-major (batch, key chunk) over every head, the rows of an item, one worker's
// scratch and where the partials of several chunks lie. Shared by the per-target item kernels
// (chunk-inl.h, page_major-inl.h) and the launch and merge (decode.cpp).
//
// Memory traffic. Decode is memory-bound: each key brings Dk + Dv floats from DRAM for
// 2 R (Dk + Dv) flops, i.e. R / 2 flops per byte, far below what a core computes per byte it
// streams. So everything serves one goal, read K and V from DRAM exactly once:
//   - all R rows of a group (every query head sharing the K/V head, every query) run against
//     each K/V tile while it sits in L1, so grouped-query heads do not multiply the traffic;
//   - K and V are read in place, never packed, and prefetched into L2 kPrefetchKeys ahead so
//     DRAM misses overlap the arithmetic; keys that the band or the key lengths hide from every
//     row of an item are never read;
//   - the rest is small: Q (R x Dk) and the output (R x Dv) once per item, and the partials,
//     R x (Dv + 2) floats per chunk written once and read once by the merge, which ChunkKeys
//     keeps below 1 / (2 kMinKeysPerPartialRow) of the chunk's K/V bytes.
// Total: B Hkv Nk (Dk + Dv) floats of K and V, plus B Hq Nq (Dk + Dv) of Q and output, plus the
// partials. W4 (B=1 H=32 d=128, Nq=1, Nk=8192): 268 MB of K/V against 0.27 MB of partials.
// The measurements behind the constants: docs/performance-log.md, "decode/ and ring".
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "attention/kernels.hpp"
#include "attention/problem.hpp"
#include "qkv/dtype.hpp"

namespace qkv::detail::decode {

// Bc, keys per tile: the score tile S (kRowBlock x Bc) stays in L1 next to the K and V tiles
// being streamed (Bc x d floats each, 32 KB at d = 128), and the per-tile softmax bookkeeping
// (a max, a sum and possibly a rescale of O per row) is amortised over Bc keys. A multiple of
// kScoreKeys and of every target's lane count.
constexpr size_t kKeyTile = 64;

// How far ahead of the keys being computed K and V are prefetched, in keys. The hardware
// prefetcher alone leaves a core waiting on DRAM while it computes; a software prefetch into L2
// this far ahead keeps misses in flight during the arithmetic: 8 keys = 8 KB of K and V at
// d = 128, prefetched into L2 (the distances and hints measured: docs/performance-log.md,
// "decode/ and ring" and "decode/: K read key after key").
constexpr int64_t kPrefetchKeys = 8;

// Rows (query heads x queries of one group) run together against a K/V tile. Their Qs and O
// (kRowBlock x d each) and S stay in L1/L2: 32 x (128 + 64 + 128) floats = 40 KB at d = 128.
// A group with more rows (large GQA groups times several queries) takes several row blocks per
// chunk, the later ones reading the chunk again from L2 (see kChunkKeys).
constexpr size_t kRowBlock = 32;

// Keys per chunk of float32 K/V, the unit of parallel work (16-bit K/V: twice the keys, the same
// bytes; int8 and int4 four times). Small enough that a single head splits over the workers (8192 keys: 16 chunks) and that
// one chunk's K and V, 512 x (128 + 128) floats = 512 KB at d = 128, stay in a 1 MB L2 for the
// row blocks after the first; large enough that a chunk's partials and per-item setup are noise
// next to its K/V bytes (2048 keys ran slower). A chunk starts a new stream whose first keys the
// running prefetch never covered, a cost per chunk, not per byte, which is why 16-bit chunks hold
// the same bytes, not the same keys.
constexpr int64_t kChunkKeys = 512;

// A `rest | strided(S)` rule with S at least this gathers its strided keys (GatherStrided):
// each query then reads 1 / S of the keys beyond `rest`'s tiles instead of every tile.
constexpr int64_t kMinGatherStride = 4;

// A chunk has at least this many keys per row, so its partials (R x (Dv + 2) floats, written
// and read once more by the merge) stay a small fraction of its K/V traffic
// (keys x (Dk + Dv) floats) however many rows a group has.
constexpr int64_t kMinKeysPerPartialRow = 16;

// Paged K/V read page-major (page_major-inl.h). A pool holds a key's heads side by side (row
// stride Hkv D): reading one head's keys, as an item (b, g, chunk) does, takes 512 bytes of every
// 16 KB at W4 and leaves the rest to other items, and that read alone costs most of the gap
// between a pool's decode and a contiguous cache's on some machines (docs/inference.md,
// BM_ReadOrder). An item (b, chunk) instead runs every
// query head's row over its keys, blocks of a few keys over every head in turn, so that the
// pages are read in runs. It needs one query (every row then sees the same keys, no per-element
// band), K/V of float, 16 bits or int8 (with scales already checked), no rule, tensor term or
// dropout, and at most kPageMajorMaxRows query heads, whose Qs, S and O stay in L2 (40 KB at 32
// heads, d = 128, as the (b, g, chunk) items' row block; 160 KB at 128); any other paged problem
// takes the (b, g, chunk) items.
constexpr int64_t kPageMajorMaxRows = 128;

// Bytes of K and V a page-major item reads: 4 MB is 128 float keys of W4 (32 heads, d = 128), 64
// items; the partials of an item, Hq x (Dv + 2) floats, are then 0.4% of its reads.
constexpr int64_t kPageMajorItemBytes = int64_t{4} << 20;

// How far ahead of the block being computed a page-major item prefetches every head's rows, in
// bytes of one side (K or V): one block of W4's float keys (4 keys x 32 heads x 512 bytes). Longer
// distances ran slower (docs/inference.md, "Page-major items").
constexpr int64_t kPageMajorAheadBytes = int64_t{64} << 10;

inline bool page_major_fits(const AttentionProblem& p) {
  return p.paged.on() && p.q_len == 1 && p.kv_dtype != DType::I4 && !p.scales_unchecked && p.rule.empty() &&
         p.terms.empty() && p.dropout_p == 0 && p.q_heads <= kPageMajorMaxRows;
}

// How a problem is cut into items, shared by the items and the merge.
struct Plan {
  int64_t group;       // G = Hq / Hkv, query heads per key/value head
  int64_t rows;        // R = G x Nq, rows per (b, g)
  bool page_major;     // items (b, chunk) over every head (paged K/V only: page_major-inl.h)
  int64_t block_rows;  // rows a worker's scratch holds: kRowBlock, or Hq x Nq for page-major items
  int64_t chunk_keys;  // keys per chunk, a multiple of kKeyTile
  int64_t chunks;      // chunks per (b, g), at least 1
  int64_t items;       // B Hkv chunks, or B chunks for page-major items
  size_t q_stride;     // floats between rows of the packed Qs (Dk, cache-line rounded)
  size_t out_stride;   // floats between rows of O (Dv, cache-line rounded)

  // Row r of an item of group g: query head g G + r % G, query r / G. Queries outer, so the rows
  // of one query (the query heads of the group) are contiguous: the strided gather runs them together.
  int64_t head_of(int64_t g, int64_t r) const { return g * group + r % group; }
  int64_t query_of(int64_t r) const { return r / group; }

  // `threads`: the workers decode will have (Launch: what the arithmetic pays for); page-major
  // items are taken only when there are as many of them, so that they never idle a core that
  // the (b, g, chunk) items would keep busy. The chunks, and so the rounding of a paged call's
  // merge, may then depend on the threads.
  Plan(const AttentionProblem& p, int threads)
      : group(p.q_heads / p.kv_heads),
        rows(group * p.q_len),
        q_stride(round_up(static_cast<size_t>(p.head_dim), kCacheLineFloats)),
        out_stride(round_up(static_cast<size_t>(p.value_dim), kCacheLineFloats)) {
    // (b, g, chunk) items: kChunkKeys float keys, the same bytes of any other element type.
    const int64_t keys = kChunkKeys * static_cast<int64_t>(sizeof(float) / element_size(p.kv_dtype));
    if (page_major_fits(p)) {
      // Page-major items: kPageMajorItemBytes of every head's K and V, at most a (b, g, chunk) item's keys.
      const int64_t key_bytes =
          p.kv_heads * (p.head_dim + p.value_dim) * static_cast<int64_t>(element_size(p.kv_dtype));
      cut(p, std::clamp<int64_t>(kPageMajorItemBytes / std::max<int64_t>(1, key_bytes), 1, keys), p.batch);
      page_major = items >= threads;
      block_rows = p.q_heads * p.q_len;
      if (page_major) return;
    }
    cut(p, keys, p.batch * p.kv_heads);
    page_major = false;
    block_rows = static_cast<int64_t>(kRowBlock);
  }

 private:
  // Chunks of about `keys` keys (a multiple of kKeyTile, at least kMinKeysPerPartialRow per row),
  // `per_chunk` items each.
  void cut(const AttentionProblem& p, int64_t keys, int64_t per_chunk) {
    chunk_keys = static_cast<int64_t>(
        round_up(static_cast<size_t>(std::max(keys, kMinKeysPerPartialRow * rows)), kKeyTile));
    chunks = std::max<int64_t>(1, (p.kv_len + chunk_keys - 1) / chunk_keys);
    items = per_chunk * chunks;
  }
};

// One worker's scratch, offsets in floats from a 64-byte aligned base; every part starts on its
// own cache line.
struct ScratchLayout {
  size_t q, scores, out, running_max, row_sum, v_wide, total;

  explicit ScratchLayout(const Plan& plan) {
    size_t at = 0;
    auto take = [&](size_t floats) {
      const size_t start = at;
      at += round_up(floats, kCacheLineFloats);
      return start;
    };
    const size_t out_stride = plan.out_stride;
    const size_t rows = static_cast<size_t>(plan.block_rows);
    q = take(rows * plan.q_stride);    // Qs (rows, Dk), scaled
    scores = take(rows * kKeyTile);     // S then P (rows, Bc)
    out = take(rows * out_stride);       // O (rows, Dv), unnormalised
    running_max = take(rows);           // per row: m
    row_sum = take(rows);               // per row: l
    // A 16-bit V tile widened, only when masks hide keys (never for page-major items).
    v_wide = take(plan.page_major ? 0 : kKeyTile * out_stride);
    total = at;
  }
};

// Where the items leave their partials when (b, g) has several chunks: row r of chunk c of
// (b, g) at index ((b Hkv + g) chunks + c) R + r of max and sum, times Dv for out (page-major
// items too: their row of query head h is row h % G of (b, h / G)).
struct Partials {
  float* max;
  float* sum;
  float* out;
};

}  // namespace qkv::detail::decode
