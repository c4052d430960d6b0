// The decode kernel: softmax(Q K^T * scale + mask) V for a few queries against a long KV cache
// (generation time: Nq = 1 or a few, Nk in the thousands), split over the keys as in
// FlashDecoding and ggml's split-KV flash_attn_ext. Same semantics as reference/forward.cpp, dropout
// included; writes output and lse, never weights.
//
// Work. One item is (batch b, key/value head g, key chunk c). Its rows are every query of every
// query head of g's group: R = G x Nq rows with G = Hq / Hkv, row r = (query head g G + r % G,
// query r / G), queries outer so the rows of one query are contiguous. An item runs an online
// softmax over the keys of its chunk and leaves, per row, a partial triple: running max m_c,
// sum l_c and unnormalised output o_c (Dv). A second pass merges the chunks of each row:
//   m = max_c m_c,   l = sum_c l_c exp(m_c - m),   o = sum_c o_c exp(m_c - m),
//   output = o / l,  lse = m + log l.
// A chunk that saw no key leaves m_c = -inf, l_c = 0, o_c = 0 and adds exactly 0; a row that no
// chunk saw (m = -inf) gets output 0 and lse = -inf, never NaN. When (b, g) has a single chunk
// its item writes the final output and lse itself and there is nothing to merge.
//
// Memory traffic. Decode is memory-bound: each key brings Dk + Dv floats from DRAM for
// 2 R (Dk + Dv) flops, i.e. R / 2 flops per byte, where a Zen 5 core does ~300 GFLOP/s but
// streams ~20 GB/s. So everything serves one goal, read K and V from DRAM exactly once:
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
//
// Per item and per tile of Bc keys (rows in blocks of at most kRowBlock):
//   1. S = Qs K_tile^T (rows x Bc), Qs = scale * Q packed once per item. Vectorised along Dk:
//      a register tile of rows x keys, each accumulator a vector of partial dot products summed
//      across lanes at the end (K rows are contiguous in Dk): attention/steps/dot_scores-inl.h, whose order the
//      flash backward repeats when it recomputes a decode forward's scores.
//   2. Masks: the band and key lengths as a per-row key range (a tile every row fully sees does
//      no mask work), tensor terms per element. A `rest | strided(S)` rule (Sparse Transformer's
//      window | strided) runs the tiles on `rest` only, which skips the tiles it hides, and
//      gathers each query's strided keys j = O + i (mod S) as tiles of step S (GatherStrided):
//      a query reads its window and 1 / S of the cache, not every tile.
//   3. Online softmax per row, vectorised along the keys of the tile.
//   4. Dropout, as the reference.
//   5. O += P V_tile (rows x Dv). Vectorised along Dv: a register tile of kValueRows rows x
//      kValueVectors vectors, "broadcast a weight, load a row of V".
//
// Highway's foreach_target re-includes this file once per SIMD target (see flash/forward.cpp); the
// threading, the merge and the exported entry point live in the HWY_ONCE part below.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/decode/decode.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "simd/kv_load-inl.h"
#include "attention/steps/dot_scores-inl.h"
#include "attention/steps/pipeline-inl.h"
#include "hwy/highway.h"

#ifndef QKV_ATTENTION_DECODE_ONCE
#define QKV_ATTENTION_DECODE_ONCE
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "simd/item_shares.hpp"
#include "attention/kernels.hpp"
#include "mask/rule.hpp"
#include "attention/problem.hpp"
#include "qkv/dtype.hpp"

namespace qkv::detail::decode {

// Bc, keys per tile: the score tile S (kRowBlock x Bc) stays in L1 next to the K and V tiles
// being streamed (Bc x d floats each, 32 KB at d = 128), and the per-tile softmax bookkeeping
// (a max, a sum and possibly a rescale of O per row) is amortised over Bc keys. A multiple of
// kScoreKeys and of every target's lane count.
constexpr size_t kKeyTile = 64;

// How far ahead of the keys being computed K and V are prefetched, in keys. The hardware
// prefetcher alone leaves a core waiting on DRAM while it computes (W4 on one Zen 5 core: 0.5 x
// memcpy); a software prefetch into L2 this far ahead keeps misses in flight during the
// arithmetic (0.77 x memcpy). 32 keys = 32 KB of K and V at d = 128; measured against 64, 128
// and 256 keys and against prefetching into L1, which all ran slower.
constexpr int64_t kPrefetchKeys = 32;

// Rows (query heads x queries of one group) run together against a K/V tile. Their Qs and O
// (kRowBlock x d each) and S stay in L1/L2: 32 x (128 + 64 + 128) floats = 40 KB at d = 128.
// A group with more rows (large GQA groups times several queries) takes several row blocks per
// chunk, the later ones reading the chunk again from L2 (see kChunkKeys).
constexpr size_t kRowBlock = 32;

// Keys per chunk of float32 K/V, the unit of parallel work (16-bit K/V: twice the keys, the same
// bytes). Small enough that a single head splits over the workers (8192 keys: 16 chunks) and that
// one chunk's K and V, 512 x (128 + 128) floats = 512 KB at d = 128, stay in Zen 5's 1 MB L2 for
// the row blocks after the first; large enough that a chunk's partials and per-item setup are
// noise next to its K/V bytes (measured on Zen 5, W4: 2048 ran ~10% slower than 512). A chunk
// starts a new stream whose first keys the running prefetch never covered, a cost per chunk, not
// per byte: 16-bit chunks of 512 keys ran W4-bf16 at 0.55-0.58 x W4, chunks of the same bytes
// (1024 keys) at 0.50-0.53, alternating the two types in one process.
constexpr int64_t kChunkKeys = 512;

// A `rest | strided(S)` rule with S at least this gathers its strided keys (GatherStrided):
// each query then reads 1 / S of the keys beyond `rest`'s tiles instead of every tile.
constexpr int64_t kMinGatherStride = 4;

// A chunk has at least this many keys per row, so its partials (R x (Dv + 2) floats, written
// and read once more by the merge) stay a small fraction of its K/V traffic
// (keys x (Dk + Dv) floats) however many rows a group has.
constexpr int64_t kMinKeysPerPartialRow = 16;

// How a problem is cut into items, shared by the items and the merge.
struct Plan {
  int64_t group;       // G = Hq / Hkv, query heads per key/value head
  int64_t rows;        // R = G x Nq, rows per item
  int64_t chunk_keys;  // keys per chunk, a multiple of kKeyTile
  int64_t chunks;      // chunks per (b, g), at least 1
  size_t q_stride;     // floats between rows of the packed Qs (Dk, cache-line rounded)
  size_t out_stride;   // floats between rows of O (Dv, cache-line rounded)

  // Row r of an item of group g: query head g G + r % G, query r / G. Queries outer, so the rows
  // of one query (the query heads of the group) are contiguous: the strided gather runs them together.
  int64_t head_of(int64_t g, int64_t r) const { return g * group + r % group; }
  int64_t query_of(int64_t r) const { return r / group; }

  explicit Plan(const AttentionProblem& p)
      : group(p.q_heads / p.kv_heads),
        rows(group * p.q_len),
        chunk_keys(static_cast<int64_t>(
            round_up(static_cast<size_t>(std::max(kChunkKeys * static_cast<int64_t>(sizeof(float) / element_size(p.kv_dtype)),
                                                  kMinKeysPerPartialRow * rows)),
                     kKeyTile))),
        chunks(std::max<int64_t>(1, (p.kv_len + chunk_keys - 1) / chunk_keys)),
        q_stride(round_up(static_cast<size_t>(p.head_dim), kCacheLineFloats)),
        out_stride(round_up(static_cast<size_t>(p.value_dim), kCacheLineFloats)) {}
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
    q = take(kRowBlock * plan.q_stride);    // Qs (rows, Dk), scaled
    scores = take(kRowBlock * kKeyTile);     // S then P (rows, Bc)
    out = take(kRowBlock * out_stride);       // O (rows, Dv), unnormalised
    running_max = take(kRowBlock);           // per row: m
    row_sum = take(kRowBlock);               // per row: l
    v_wide = take(kKeyTile * out_stride);    // a 16-bit V tile widened, only when masks hide keys
    total = at;
  }
};

// Where the items leave their partials when (b, g) has several chunks: row r of chunk c of
// (b, g) at index ((b Hkv + g) chunks + c) R + r of max and sum, times Dv for out.
struct Partials {
  float* max;
  float* sum;
  float* out;
};

}  // namespace qkv::detail::decode
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

using decode::kKeyTile;
using decode::kRowBlock;
using tile_gemm::AllFinite;

// The value tile's registers. AVX-512 has 32 vector registers: 4 x 4 = 16 accumulators + 4 V
// loads + 1 broadcast = 21. The 16-register targets halve the rows: 8 + 4 + 1 = 13. (The score
// tile is dot_scores::ScoreTile, attention/steps/dot_scores-inl.h, shared with the flash backward.)
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3  // every AVX-512 target, later ones included
constexpr size_t kValueRows = 4;
#else
constexpr size_t kValueRows = 2;
#endif
constexpr size_t kValueVectors = 4;
using dot_scores::WithConstant;
constexpr size_t kScoreKeys = dot_scores::kKeys;
static_assert(kKeyTile % kScoreKeys == 0, "a key tile holds whole score tiles");

// Prefetches the cache lines of [begin, end) into L2 (locality hint 2: prefetcht1 on x86).
HWY_INLINE void PrefetchRange(const void* begin, const void* end) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(begin) & ~uintptr_t{63};
  for (uintptr_t line = first; line < reinterpret_cast<uintptr_t>(end); line += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 2);
}

// ---- Step 5's register tile: o[r * o_stride + n L + c] += sum_j p[r * kKeyTile + j]
// v[j * dv + n L + c] over `cols` keys, for Rows rows and Vectors vectors of columns.
template <size_t Rows, size_t Vectors, class T>
HWY_INLINE void ValueTile(size_t cols, const float* HWY_RESTRICT p, const T* HWY_RESTRICT v, size_t dv,
                          float* HWY_RESTRICT o, size_t o_stride) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  VF acc[Rows][Vectors];
  HWY_UNROLL(16)
  for (size_t r = 0; r < Rows; ++r) {
    HWY_UNROLL(16)
    for (size_t n = 0; n < Vectors; ++n) acc[r][n] = hn::Load(df, o + r * o_stride + n * lanes);
  }
  for (size_t j = 0; j < cols; ++j) {
    VF v_vec[Vectors];
    HWY_UNROLL(16)
    for (size_t n = 0; n < Vectors; ++n) v_vec[n] = kv::LoadWide(df, v + j * dv + n * lanes);
    HWY_UNROLL(16)
    for (size_t r = 0; r < Rows; ++r) {
      const VF weight = hn::Set(df, p[r * kKeyTile + j]);  // broadcast, folded into the FMA
      HWY_UNROLL(16)
      for (size_t n = 0; n < Vectors; ++n) acc[r][n] = hn::MulAdd(weight, v_vec[n], acc[r][n]);
    }
  }
  HWY_UNROLL(16)
  for (size_t r = 0; r < Rows; ++r) {
    HWY_UNROLL(16)
    for (size_t n = 0; n < Vectors; ++n) hn::Store(acc[r][n], df, o + r * o_stride + n * lanes);
  }
}

namespace step = pipeline;

// One worker's view of its scratch block (decode::ScratchLayout).
struct Scratch {
  float *q, *scores, *out, *running_max, *row_sum, *v_wide;
  Scratch(float* base, const decode::ScratchLayout& l)
      : q(base + l.q), scores(base + l.scores), out(base + l.out), running_max(base + l.running_max),
        row_sum(base + l.row_sum), v_wide(base + l.v_wide) {}
  // The same scratch seen from row r of the block on (a gather over some of its rows).
  Scratch from_row(const decode::Plan& plan, size_t r) const {
    Scratch w = *this;
    w.q += r * plan.q_stride;
    w.scores += r * kKeyTile;
    w.out += r * plan.out_stride;
    w.running_max += r;
    w.row_sum += r;
    return w;
  }
};

// K and V rows of element type T: float (p.k, p.v) or 16 bits (p.k_bits, p.v_bits), read in place.
template <class T>
HWY_INLINE const T* KeyRow(const AttentionProblem& p, int64_t b, int64_t g, int64_t j) {
  if constexpr (std::is_same_v<T, float>) {
    return p.k.row(b, g, j);
  } else {
    return reinterpret_cast<const T*>(p.k_bits.row(b, g, j));
  }
}
template <class T>
HWY_INLINE const T* ValueRow(const AttentionProblem& p, int64_t b, int64_t g, int64_t j) {
  if constexpr (std::is_same_v<T, float>) {
    return p.v.row(b, g, j);
  } else {
    return reinterpret_cast<const T*>(p.v_bits.row(b, g, j));
  }
}
HWY_INLINE size_t KeyRowStride(const AttentionProblem& p) {
  return static_cast<size_t>(p.kv_dtype == DType::F32 ? p.k.row_stride : p.k_bits.row_stride);
}
HWY_INLINE size_t ValueRowStride(const AttentionProblem& p) {
  return static_cast<size_t>(p.kv_dtype == DType::F32 ? p.v.row_stride : p.v_bits.row_stride);
}

// Row r of an item of group g (decode::Plan::head_of, query_of).
struct RowCoords {
  int64_t h, i;
};
HWY_INLINE RowCoords RowOf(const decode::Plan& plan, int64_t g, int64_t r) {
  return {plan.head_of(g, r), plan.query_of(r)};
}

// The keys of one tile: j0, j0 + step, ... (cols of them); prefetching stops at `end`. A tile of
// the key range has step 1. Gathered strided keys have the stride as step and gathered_rest >= 0,
// the rule node whose keys the tiles visit, hidden here so that no pair counts twice.
struct KeyRun {
  int64_t j0, step;
  size_t cols;
  int64_t end;
  int gathered_rest;
};

// Rows of `width` elements, `jump` apart, into L2: one range when they touch (K or V of a
// cache read in order), else row by row.
template <class T>
HWY_INLINE void PrefetchRows(const T* row, int64_t rows, int64_t jump, int64_t width) {
  if (jump == width) return PrefetchRange(row, row + rows * width);
  for (int64_t r = 0; r < rows; ++r, row += jump) PrefetchRange(row, row + width);
}

// Step "load a tile": prefetch the K and V rows of keys first, first + step, ... < last of head
// (b, g) into L2.
template <class T>
HWY_INLINE void PrefetchKeys(const AttentionProblem& p, int64_t b, int64_t g, int64_t first, int64_t last,
                             int64_t step) {
  if (first >= last) return;
  const int64_t keys = (last - first + step - 1) / step;
  PrefetchRows(KeyRow<T>(p, b, g, first), keys, static_cast<int64_t>(KeyRowStride(p)) * step, p.head_dim);
  PrefetchRows(ValueRow<T>(p, b, g, first), keys, static_cast<int64_t>(ValueRowStride(p)) * step, p.value_dim);
}

// The prefetch distance in keys of type T: the same bytes whatever the element type, so twice
// the keys for 16-bit K/V.
template <class T>
constexpr int64_t PrefetchAhead() {
  return decode::kPrefetchKeys * static_cast<int64_t>(sizeof(float) / sizeof(T));
}

// Step "scores": S (rows x Bc) = Qs K_tile^T for the keys j0, j0 + step, ... (cols of them; step
// 1 for a tile, the stride for gathered strided keys), keys outer so the kScoreKeys K rows are
// reused from L1 by every row; prefetches kPrefetchKeys ahead within [.., end). Past the tile's
// last key the pointers repeat that key (overwritten with -inf later).
template <class T>
void DecodeScores(const AttentionProblem& p, const decode::Plan& plan, int64_t b, int64_t g, size_t rows,
                  const KeyRun& run, const Scratch& w) {
  const int64_t j0 = run.j0, step = run.step, end = run.end;
  const size_t cols = run.cols;
  const size_t dk = static_cast<size_t>(p.head_dim);
  const size_t full_dk = dk / hn::Lanes(DF()) * hn::Lanes(DF());
  for (size_t j = 0; j < cols; j += kScoreKeys) {
    const int64_t ahead = j0 + (static_cast<int64_t>(j) + PrefetchAhead<T>()) * step;
    if (ahead < end)
      PrefetchKeys<T>(p, b, g, ahead, std::min<int64_t>(ahead + static_cast<int64_t>(kScoreKeys) * step, end), step);
    const T* keys[kScoreKeys];
    for (size_t x = 0; x < kScoreKeys; ++x)
      keys[x] = KeyRow<T>(p, b, g, j0 + static_cast<int64_t>(std::min(j + x, cols - 1)) * step);
    dot_scores::ScoreRows(rows, dk, full_dk, w.q, plan.q_stride, keys, w.scores + j, kKeyTile, 1);
  }
}

// Step "accumulate": O += P V_tile, column blocks outer so a block of V's columns is reused from
// L1 by every row block; then the columns past the last whole vector.
template <class T>
void DecodeAccumulate(const AttentionProblem& p, const decode::Plan& plan, size_t rows, size_t cols,
                      const T* HWY_RESTRICT v_tile, size_t v_stride, const Scratch& w) {
  const size_t lanes = hn::Lanes(DF());
  const size_t dv = static_cast<size_t>(p.value_dim), full_dv = dv / lanes * lanes;
  for (size_t c = 0; c < full_dv; c += kValueVectors * lanes) {
    const size_t vectors = std::min(kValueVectors, (full_dv - c) / lanes);
    for (size_t r = 0; r < rows; r += kValueRows) {
      WithConstant<kValueRows>(std::min(kValueRows, rows - r), [&](auto tile_rows) {
        WithConstant<kValueVectors>(vectors, [&](auto tile_vectors) {
          ValueTile<decltype(tile_rows)::value, decltype(tile_vectors)::value>(
              cols, w.scores + r * kKeyTile, v_tile + c, v_stride, w.out + r * plan.out_stride + c, plan.out_stride);
        });
      });
    }
  }
  for (size_t r = 0; r < rows; ++r)
    for (size_t c = full_dv; c < dv; ++c) {
      float sum = w.out[r * plan.out_stride + c];
      for (size_t j = 0; j < cols; ++j) sum += w.scores[r * kKeyTile + j] * kv::ToFloat(v_tile[j * v_stride + c]);
      w.out[r * plan.out_stride + c] = sum;
    }
}

// ALiBi and the mask of gathered strided keys (KeyRun; softcap ran on the whole tile before):
// what the tiles evaluate, except that the strided rule holds by construction and the keys
// `rest` shows are hidden (the tiles visit those).
HWY_INLINE void GatheredLogits(const AttentionProblem& p, int rest, const step::Line& line, float* HWY_RESTRICT s,
                               size_t cols) {
  step::Alibi(p, line, s, kKeyTile);
  step::MaskBand(p, line, s, kKeyTile);
  step::MaskWhereRuleShows(p.rule, rest, line, s, cols);
  step::MaskTerms(p, line, s, cols);
}

// One key tile (KeyRun) for rows [r0, r0 + rows) of group (b, g): scores, modifiers and mask
// per row, the online softmax update, dropout, O += P V. `band`: some key of the tile may be
// hidden from some row (per-element mask work); always so for gathered keys.
template <class T>
void DecodeKeyTile(const AttentionProblem& p, const decode::Plan& plan, int64_t b, int64_t g, int64_t r0, size_t rows,
                   const KeyRun& run, bool band, const Scratch& w) {
  const size_t dv = static_cast<size_t>(p.value_dim), cols = run.cols;
  const T* HWY_RESTRICT v_tile = ValueRow<T>(p, b, g, run.j0);
  const size_t v_stride = ValueRowStride(p) * static_cast<size_t>(run.step);
  // 1. Scores. 2. Softcap on the whole tile, then ALiBi and the mask, one query's line over the
  // tile's keys at a time; the columns past the tile's last key are hidden after the modifiers
  // (softcap(-inf) is finite).
  DecodeScores<T>(p, plan, b, g, rows, run, w);
  step::Softcap(p, w.scores, rows * kKeyTile);
  const bool per_element = band || p.alibi_slopes || !p.terms.empty();
  for (size_t r = 0; r < rows; ++r) {
    float* HWY_RESTRICT s = w.scores + r * kKeyTile;
    const RowCoords row = RowOf(plan, g, r0 + static_cast<int64_t>(r));
    const step::Line line{b, row.h, row.i, run.j0, 0, run.step};
    if (run.gathered_rest >= 0) {
      GatheredLogits(p, run.gathered_rest, line, s, cols);
    } else if (per_element) {
      step::ScoresToLogits(p, line, s, kKeyTile, cols, band);
    }
    std::fill(s + cols, s + kKeyTile, step::kMinusInf);
    // 3. Online softmax of the row; O moves to the new max (exactly 1: left alone).
    const float factor = step::SoftmaxRowUpdate(s, kKeyTile, w.running_max[r], w.row_sum[r]);
    if (factor != 1.0f)
      for (size_t c = 0; c < plan.out_stride; ++c) w.out[r * plan.out_stride + c] *= factor;
    // 4. Dropout on P.
    if (p.dropout_p > 0) step::Dropout(p, line, s, cols);
  }
  // 5. O += P V_tile, skipping zero weights when a hidden key's V may be NaN or Inf (a 16-bit
  // tile is widened into scratch for that check: masked tiles only).
  const bool some_hidden = band || !p.terms.empty() || p.dropout_p > 0;
  if (!some_hidden) return DecodeAccumulate<T>(p, plan, rows, cols, v_tile, v_stride, w);
  const float* wide = nullptr;
  size_t wide_stride = v_stride;
  if constexpr (std::is_same_v<T, float>) {
    wide = v_tile;
  } else {
    for (size_t j = 0; j < cols; ++j)
      convert(v_tile + j * v_stride, p.kv_dtype, w.v_wide + j * plan.out_stride, DType::F32, dv);
    wide = w.v_wide;
    wide_stride = plan.out_stride;
  }
  if (!step::RowsFinite(wide, cols, dv, static_cast<int64_t>(wide_stride))) {
    accumulate_skipping_zeros(rows, cols, dv, w.scores, kKeyTile, 1, wide, static_cast<int64_t>(wide_stride), w.out,
                              plan.out_stride, 1);
  } else {
    DecodeAccumulate<T>(p, plan, rows, cols, v_tile, v_stride, w);
  }
}

// How the mask's rule treats keys [j0, j0 + cols) for rows [r0, r0 + rows) of group (b, g):
// hidden from every row, fully visible to every row, or partial.
TileVisibility RuleTileOfRows(const AttentionProblem& p, const decode::Plan& plan, int64_t b, int64_t g, int64_t r0,
                              size_t rows, int64_t j0, size_t cols) {
  bool any = false, all = true;
  for (size_t r = 0; r < rows; ++r) {
    const RowCoords row = RowOf(plan, g, r0 + static_cast<int64_t>(r));
    const TileVisibility v = p.rule.classify(b, row.h, row.i, row.i, j0, j0 + static_cast<int64_t>(cols) - 1);
    any = any || v != TileVisibility::Hidden;
    all = all && v == TileVisibility::Full;
  }
  return !any ? TileVisibility::Hidden : (all ? TileVisibility::Full : TileVisibility::Partial);
}

// The strided keys of a `rest | strided(S, O)` rule (StridedSplit, mask/rule.hpp) within
// [chunk_begin, chunk_end), gathered per query: the rows of query i (contiguous, Plan::query_of)
// see the keys j = O + i (mod S) inside the band and key lengths, read as tiles of step S into the
// same online softmax as the tiles, which visit what `rest` shows. Never reads another key.
template <class T>
void GatherStrided(const AttentionProblem& p, const decode::Plan& plan, const StridedSplit& split, int64_t b, int64_t g,
                   int64_t r0, size_t rows, int64_t chunk_begin, int64_t chunk_end, const Scratch& w) {
  for (size_t r = 0; r < rows;) {
    const int64_t i = plan.query_of(r0 + static_cast<int64_t>(r));
    size_t next = r + 1;
    while (next < rows && plan.query_of(r0 + static_cast<int64_t>(next)) == i) ++next;
    const int64_t lo = std::max(chunk_begin, p.first_visible_key(i));
    const int64_t hi = std::min(chunk_end, p.last_visible_key(b, i));
    const int64_t first = lo + floor_mod(split.offset + i - lo, split.stride);
    const int64_t keys = first < hi ? (hi - 1 - first) / split.stride + 1 : 0;
    for (int64_t t = 0; t < keys; t += static_cast<int64_t>(kKeyTile)) {
      const KeyRun run{first + t * split.stride, split.stride,
                       static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(kKeyTile), keys - t)), hi, split.rest};
      DecodeKeyTile<T>(p, plan, b, g, r0 + static_cast<int64_t>(r), next - r, run, true, w.from_row(plan, r));
    }
    r = next;
  }
}

// One pass of a row block over one chunk: rows [r0, r0 + rows) of item (b, g, chunk), keys
// [chunk_begin, chunk_end). Leaves O, running max and sum of the block in `scratch`; the first
// chunk starts each row's softmax with its sink, if any. `split`: the strided keys to gather
// (p.rule's root is then `rest`), or nullptr.
template <class T>
void RowBlockOverChunk(const AttentionProblem& p, const decode::Plan& plan, const StridedSplit* split, int64_t b,
                       int64_t g, int64_t r0, size_t rows, int64_t chunk_begin, int64_t chunk_end,
                       float* HWY_RESTRICT scratch) {
  const size_t dk = static_cast<size_t>(p.head_dim);
  const Scratch w(scratch, decode::ScratchLayout(plan));

  // ---- Set up: O = 0, the softmax started; the key range [begin, end) some row of the block
  // sees within the chunk, and the range every row sees (a tile inside it needs no band work).
  std::fill_n(w.out, rows * plan.out_stride, 0.0f);
  int64_t begin = chunk_end, end = chunk_begin;
  int64_t all_begin = chunk_begin, all_end = chunk_end;
  for (size_t r = 0; r < rows; ++r) {
    const RowCoords row = RowOf(plan, g, r0 + static_cast<int64_t>(r));
    w.running_max[r] = chunk_begin == 0 ? step::InitialMax(p, row.h) : step::kMinusInf;
    w.row_sum[r] = chunk_begin == 0 ? step::InitialSum(p) : 0.0f;
    const int64_t first = p.first_visible_key(row.i), last = p.last_visible_key(b, row.i);
    begin = std::min(begin, std::max(first, chunk_begin));
    end = std::max(end, std::min(last, chunk_end));
    all_begin = std::max(all_begin, first);
    all_end = std::min(all_end, last);
  }
  if (begin >= end) return;  // the chunk is hidden from every row: K and V are never read

  // Qs = scale * Q, packed once per pass (not per tile).
  for (size_t r = 0; r < rows; ++r) {
    const RowCoords row = RowOf(plan, g, r0 + static_cast<int64_t>(r));
    const float* q = p.q.row(b, row.h, row.i);
    for (size_t d = 0; d < dk; ++d) w.q[r * plan.q_stride + d] = p.scale * q[d];
  }
  // The keys the running prefetch (DecodeScores) never reaches, the chunk's first PrefetchAhead,
  // requested together so their misses overlap (W4: 6.5 -> 5.8 ms, W4-bf16: 3.3 -> 2.9 ms). Not
  // under a rule, whose first tiles may be hidden and never read.
  if (p.rule.empty()) PrefetchKeys<T>(p, b, g, begin, std::min(end, begin + PrefetchAhead<T>()), 1);
  for (int64_t j0 = begin; j0 < end; j0 += static_cast<int64_t>(kKeyTile)) {
    const size_t cols = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(kKeyTile), end - j0));
    bool band = !(all_begin <= j0 && j0 + static_cast<int64_t>(cols) <= all_end);
    if (!p.rule.empty()) {  // the rule's view of the tile: skipped when it hides it from every row
      const TileVisibility rule = RuleTileOfRows(p, plan, b, g, r0, rows, j0, cols);
      if (rule == TileVisibility::Hidden) continue;
      band = band || rule == TileVisibility::Partial;
    }
    DecodeKeyTile<T>(p, plan, b, g, r0, rows, {j0, 1, cols, end, -1}, band, w);
  }
  if (split) GatherStrided<T>(p, plan, *split, b, g, r0, rows, chunk_begin, chunk_end, w);
}

// One work item: every row of group g of batch b against chunk `chunk`. With one chunk per
// (b, g) it writes the final output, lse and row stats; with several it leaves its partials for
// the merge. `scratch` is this worker's block, laid out by decode::ScratchLayout.
void DecodeChunk(const AttentionProblem& p, const decode::Plan& plan, const StridedSplit* split, int64_t b, int64_t g,
                 int64_t chunk, const decode::Partials& partials, float* HWY_RESTRICT scratch) {
  const size_t dv = static_cast<size_t>(p.value_dim);
  const Scratch w(scratch, decode::ScratchLayout(plan));
  const int64_t chunk_begin = chunk * plan.chunk_keys;
  const int64_t chunk_end = std::min(p.kv_len, chunk_begin + plan.chunk_keys);
  const int64_t bg = b * p.kv_heads + g;

  for (int64_t r0 = 0; r0 < plan.rows; r0 += static_cast<int64_t>(kRowBlock)) {
    const size_t rows = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(kRowBlock), plan.rows - r0));
    switch (p.kv_dtype) {  // K and V read in their own element type, never widened to memory
      case DType::F32: RowBlockOverChunk<float>(p, plan, split, b, g, r0, rows, chunk_begin, chunk_end, scratch); break;
      case DType::BF16:
        RowBlockOverChunk<hwy::bfloat16_t>(p, plan, split, b, g, r0, rows, chunk_begin, chunk_end, scratch);
        break;
      case DType::F16:
        RowBlockOverChunk<hwy::float16_t>(p, plan, split, b, g, r0, rows, chunk_begin, chunk_end, scratch);
        break;
    }
    for (size_t r = 0; r < rows; ++r) {
      const float* o = w.out + r * plan.out_stride;
      if (plan.chunks == 1) {
        const RowCoords row = RowOf(plan, g, r0 + static_cast<int64_t>(r));
        const int64_t at = (b * p.q_heads + row.h) * p.q_len + row.i;  // in (B, Hq, Nq)
        finish_row(o, 1, dv, w.running_max[r], w.row_sum[r], std::isnan(w.running_max[r]), p.output.row(b, row.h, row.i),
                   p.lse + at, p.row_max + at, p.row_sum + at);
      } else {  // leave the partials (m, l, o) of the row for the merge
        const int64_t slot = (bg * plan.chunks + chunk) * plan.rows + r0 + static_cast<int64_t>(r);
        partials.max[slot] = w.running_max[r];
        partials.sum[slot] = w.row_sum[r];
        std::copy_n(o, dv, partials.out + slot * static_cast<int64_t>(dv));
      }
    }
  }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <omp.h>

#include <optional>

#include "attention/lse_merge.hpp"
#include "core/allocator.hpp"

namespace qkv::detail {

HWY_EXPORT(DecodeChunk);

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

}  // namespace

void decode_attention(const AttentionProblem& problem) {
  if (problem.batch == 0 || problem.q_heads == 0 || problem.q_len == 0) return;

  const decode::Plan plan(problem);
  const int64_t groups = problem.batch * problem.kv_heads;
  const int64_t items = groups * plan.chunks;

  // Per-worker scratch, sized up front: each block a whole number of cache lines, 64-byte
  // aligned, so workers never share a line and the hot loop never allocates. Then the partials,
  // when there are several chunks. All in the calling thread's workspace, kept for the next call
  // (a decode loop touches no fresh pages).
  // A problem too small to pay for waking the other threads runs on the calling thread.
  const double flops = 2.0 * static_cast<double>(problem.batch * problem.q_heads * problem.q_len) *
                       static_cast<double>(problem.kv_len) * static_cast<double>(problem.head_dim + problem.value_dim);
  const int threads = threads_for(flops);
  const int workers = static_cast<int>(std::min<int64_t>(threads, items));
  const size_t block = decode::ScratchLayout(plan).total;
  const size_t slots = plan.chunks > 1 ? static_cast<size_t>(items * plan.rows) : 0;
  float* scratch = thread_workspace(WorkspaceSlot::DecodeScratch)
                       .floats(static_cast<size_t>(workers) * block + slots * (2 + static_cast<size_t>(problem.value_dim)));
  float* partial_base = scratch + static_cast<size_t>(workers) * block;
  const decode::Partials partials{partial_base, partial_base + slots, partial_base + 2 * slots};

  // A `rest | strided(S)` rule: the tiles see `rest`, the strided keys are gathered per query.
  const StridedSplit split = strided_split(problem.rule, decode::kMinGatherStride);
  std::optional<AttentionProblem> tiles_problem;
  if (split.rest >= 0) {
    tiles_problem = problem;
    tiles_problem->rule.root_node = split.rest;
  }
  const AttentionProblem& tiles = tiles_problem ? *tiles_problem : problem;
  const StridedSplit* gather = tiles_problem ? &split : nullptr;

  // The work of every thread: the items, then (after a barrier, so every partial is written)
  // the merge. One worker runs both on the calling thread, without a parallel region: a small
  // step pays no thread wake-up.
  // Items in (batch, kv head, chunk) order, dealt in contiguous shares with stealing
  // (simd/item_shares.hpp): a thread keeps its heads from call to call, and masks that make chunks
  // unequal still balance.
  ItemShares shares(workers, items);
  const auto run_items = [&](int worker) {
    float* block_start = scratch + static_cast<size_t>(worker) * block;
    shares.run(worker, [&](int64_t item) {
      const int64_t bg = item / plan.chunks;
      HWY_DYNAMIC_DISPATCH(DecodeChunk)(tiles, plan, gather, bg / problem.kv_heads, bg % problem.kv_heads,
                                        item % plan.chunks, partials, block_start);
    });
  };
  const int64_t merged_rows = plan.chunks > 1 ? groups * plan.rows : 0;
  // One worker: no OpenMP construct at all (a barrier or loop here would bind to a region the
  // caller may be running in, and omp_get_thread_num() would be the caller's number).
  if (workers == 1) {
    run_items(0);
    for (int64_t row = 0; row < merged_rows; ++row) merge_row(problem, plan, partials, row / plan.rows, row % plan.rows);
    return;
  }
#pragma omp parallel num_threads(workers)
  {
    run_items(omp_get_thread_num());
    if (merged_rows > 0) {
#pragma omp barrier  // every partial written
#pragma omp for schedule(static)
      for (int64_t row = 0; row < merged_rows; ++row)
        merge_row(problem, plan, partials, row / plan.rows, row % plan.rows);
    }
  }
}

// Measured on Zen 5 (Hq = 32, d = 128, Nk from 256 to 16384, MHA and GQA): decode beats flash
// by 4-27x up to 8 queries, ~2x at 16 and ~1.2x at 32-64; from 128 queries flash wins (it
// pads queries to its tile, decode's work grows with group x queries). Decode parallelises
// over (batch, kv head, key chunk) items only, so it also needs one item per thread.
constexpr int64_t kDecodeMaxQueries = 64;

bool decode_is_faster(const AttentionProblem& problem) {
  if (problem.q_len > kDecodeMaxQueries) return false;
  const decode::Plan plan(problem);
  return problem.batch * problem.kv_heads * plan.chunks >= omp_get_max_threads();
}

}  // namespace qkv::detail
#endif  // HWY_ONCE
