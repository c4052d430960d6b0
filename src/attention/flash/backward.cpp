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
// tiles: the packing is redone per block rather than kept for all of Nq, and per 64-key tile it
// took about a tenth of the time (bench/step_benchmark.cpp times one transpose at 0.5 us).
//
// Masks: the band and key lengths skip a query tile the key tile is hidden from, and a fully
// visible pair does no per-element mask work, exactly as the forward; tensor terms per element.
// Keys past the last one any query of the batch may see are never read and get zero gradients.
// A hidden key's V may hold NaN or Inf (a KV cache's unwritten slot): its dS is 0 exactly; a
// hidden key's non-finite K is kept out of dQ by a scalar path that skips zero dS.
//
// Strided keys (a root rule `rest | strided(S, O)`, S >= Bc) are gathered by residues as in the
// forward (flash/forward.cpp): passes 1-3 run the tiles on `rest`, then pass 4 adds each residue's pairs
// (queries r, r + S, ... against keys kr, kr + S, ...; items own a (b, g)'s residues, so their
// dQ, dK and dV rows) into the gradients the tiles wrote.
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

#include "attention/steps/dot_scores-inl.h"
#include "attention/steps/pipeline-inl.h"
#include "hwy/highway.h"

#ifndef QKV_ATTENTION_FLASH_BACKWARD_ONCE
#define QKV_ATTENTION_FLASH_BACKWARD_ONCE
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "gemm/amx.hpp"
#include "attention/kernels.hpp"
#include "attention/problem.hpp"
#include "simd/query_tiles.hpp"

namespace qkv::detail::flash_backward {

// Bc, keys per tile: the same as the forward's (flash/forward.cpp), for the same reasons.
constexpr size_t kKeyTile = 64;

// Keys per block: a query tile is packed (Qt and dOt: two transposes of Br x d; Q and dO rows
// copied too where the tile is not whole) once per block and runs against its key tiles one
// after the other; the block's K and dK, dV accumulators (kKeyBlock x d each; K copied, scaled,
// where it is not finite or Dk is not whole vectors) stay in L2 across the group's query tiles.
// Packed per 64-key tile instead, W1-bwd and W2-bwd took 1.11 and 1.16 x the time of blocks of 4
// tiles; blocks of 8 measured no better (qkv bench, 2 threads, four alternations each).
constexpr size_t kKeyBlock = 4 * kKeyTile;

// One worker's scratch, offsets in floats from a 64-byte aligned base, every part on its own
// cache lines. br = queries per tile (per target); dk_pad / dv_pad the padded dims.
struct ScratchLayout {
  size_t dk, dv, dk_pad, dv_pad;
  size_t q_t, grad_out_t, q_rows, grad_out_rows, q_scaled, weights_t, dropped_t, grad_t, softcap_t, k_rows, grad_k,
      grad_v, grad_q, shift, scale, row_dot, total;

  ScratchLayout(size_t br, size_t dk_, size_t dv_)
      : dk(dk_), dv(dv_), dk_pad(round_to_cache_line(dk_)), dv_pad(round_to_cache_line(dv_)) {
    size_t at = 0;
    auto take = [&](size_t floats) {
      const size_t start = at;
      at += round_to_cache_line(floats);
      return start;
    };
    q_t = take(dk * br);                  // Qt (Dk, Br), scale * Q^T
    grad_out_t = take(dv * br);           // dOt (Dv, Br)
    q_rows = take(br * dk_pad);           // Q (Br, Dk_pad), where not read in place
    grad_out_rows = take(br * dv_pad);    // dO (Br, Dv_pad), where not read in place
    q_scaled = take(br * dk_pad);         // scale * Q (Br, Dk_pad), for decode's score order
    weights_t = take(kKeyTile * br);      // S^T then P^T (Bc, Br)
    dropped_t = take(kKeyTile * br);      // P'^T (Bc, Br), with dropout
    grad_t = take(kKeyTile * br);         // dP'^T then dS^T (Bc, Br)
    softcap_t = take(kKeyTile * br);      // softcap's slope 1 - tanh^2 (Bc, Br)
    k_rows = take(kKeyBlock * dk_pad);    // scale * K block (kKeyBlock, Dk_pad), where not read in place
    // dK and dV of the key block (kKeyBlock, Dk_pad / Dv_pad; dK without the scale), and a block
    // of 16 rows past it: AMX tiles add whole blocks of 16 key rows from a pair's first key.
    grad_k = take((kKeyBlock + amx::kRows) * dk_pad);
    grad_v = take((kKeyBlock + amx::kRows) * dv_pad);
    grad_q = take(br * dk_pad);           // dQ of the query tile over a block of key tiles (Br, Dk_pad)
    shift = take(br);                     // per query: P = exp(S - shift) * scale
    scale = take(br);
    row_dot = take(br);                   // per query: D = dO . O
    total = at;
  }
};

// Where an array of AMX operand parts starts in a worker's AMX block and how far apart its parts
// are, in bf16 elements.
struct AmxArray {
  size_t at = 0, part = 0;
};

// One worker's block for the products on AMX tiles (MatmulPrecision High or Medium on a CPU with
// AMX, gemm/amx.hpp; Dk and Dv multiples of 16), offsets in bf16 elements from a 64-byte
// aligned base, every part on its own cache lines. br: the most queries a tile takes.
//   split per key block: K rows and V rows (kKeyBlock + 16 rows: a pair's 16-row blocks from any
//     key of the block), K^T (kKeyBlock + 32 columns: its 32-key steps from any key); zero past
//     the block's keys
//   per query tile: Qt's and dOt's rows in pairs (depth Dk, Dv), Q's and dO's rows in pairs
//     (depth: the tile's queries)
//   per pair: P'^T's then dS^T's rows (depth: queries), dS^T's rows in pairs (depth: keys)
//   and the query tile's dQ^T (Dk x Br) in float32: dQ^T += K^T dS^T keeps dS^T's layout.
struct AmxLayout {
  size_t dk_pad = 0, dv_pad = 0, key_rows = 0, key_cols = 0, br_pad = 0;  // depths rounded up to 32
  AmxArray k, v, k_t, q_t, grad_out_t, q_pairs, grad_out_pairs, tile_rows, grad_pairs, grad_q_t;
  size_t total = 0;

  AmxLayout() = default;
  AmxLayout(int parts, size_t br, size_t dk, size_t dv) {
    constexpr size_t kLine = 32;  // elements per cache line
    dk_pad = round_up(dk, amx::kDepth), dv_pad = round_up(dv, amx::kDepth), br_pad = round_up(br, amx::kDepth);
    key_rows = kKeyBlock + amx::kRows, key_cols = kKeyBlock + amx::kDepth;
    size_t at = 0;
    auto take = [&](size_t part, size_t count) {
      const AmxArray array{at, round_up(part, kLine)};
      at += count * array.part;
      return array;
    };
    const size_t n = static_cast<size_t>(parts);
    k = take(key_rows * dk_pad, n);
    v = take(key_rows * dv_pad, n);
    k_t = take(dk * key_cols, n);
    q_t = take(dk_pad * br, n);
    grad_out_t = take(dv_pad * br, n);
    q_pairs = take(br_pad * dk, n);
    grad_out_pairs = take(br_pad * dv, n);
    tile_rows = take(kKeyTile * br_pad, n);
    grad_pairs = take(kKeyTile * br, n);
    grad_q_t = take(2 * dk * br, 1);  // floats
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
using flash_backward::kKeyBlock;
using flash_backward::kKeyTile;
using tile_gemm::Gemm;
using tile_gemm::kTileVectors;
namespace step = pipeline;
using step::kResidueVectors;
using step::ResidueTileRows;
using step::TileMask;
using step::Walk;

// Br, queries per tile: about 96, a whole number of micro-tile widths (AVX2 4 x 24, AVX-512
// 2 x 48). dV += P'^T dO and dK += dS^T Q run Br deep, and one micro-tile wide (24 on AVX2) they
// loaded and stored their accumulators every 24 FMAs: against that, Zen 3, in-process A/B, 72
// and 96 took 0.93-0.96 of the time (W1-bwd, W2-bwd, 1 and 2 threads), 48 0.93-1.0.
// That many at most (the scratch is laid out for it); a band narrower than 4 such tiles (a
// window: W6's 256 keys) keeps one micro-tile's width, whose tiles cross fewer of its hidden
// keys (W6-bwd took 1.04 x the time with 96).
size_t BackwardQueryTileRows() {
  const size_t width = kTileVectors * hn::Lanes(DF());
  return std::max<size_t>(1, 96 / width) * width;
}
size_t BackwardTileRowsFor(const AttentionProblem& p) {
  const size_t most = BackwardQueryTileRows();
  const double band = static_cast<double>(p.band_hi) - static_cast<double>(p.band_lo) + 1;
  return band < 4.0 * static_cast<double>(most) ? kTileVectors * hn::Lanes(DF()) : most;
}

// One worker's view of its scratch block (flash_backward::ScratchLayout).
struct Scratch {
  size_t br, dk_pad, dv_pad;
  size_t dk_cols, dv_cols;  // Dk and Dv rounded up to whole vectors: the columns the products compute
  float *q_t, *grad_out_t, *q_rows, *grad_out_rows, *q_scaled, *weights_t, *dropped_t, *grad_t, *softcap_t, *k_rows,
      *grad_k, *grad_v, *grad_q, *shift, *scale, *row_dot;
  Scratch(float* s, size_t br_, const flash_backward::ScratchLayout& l)
      : br(br_), dk_pad(l.dk_pad), dv_pad(l.dv_pad), dk_cols(round_up(l.dk, hn::Lanes(DF()))),
        dv_cols(round_up(l.dv, hn::Lanes(DF()))),
        q_t(s + l.q_t), grad_out_t(s + l.grad_out_t),
        q_rows(s + l.q_rows), grad_out_rows(s + l.grad_out_rows), q_scaled(s + l.q_scaled),
        weights_t(s + l.weights_t),
        dropped_t(s + l.dropped_t), grad_t(s + l.grad_t), softcap_t(s + l.softcap_t), k_rows(s + l.k_rows),
        grad_k(s + l.grad_k), grad_v(s + l.grad_v), grad_q(s + l.grad_q), shift(s + l.shift), scale(s + l.scale),
        row_dot(s + l.row_dot) {}
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
  KeyBlock Part(size_t at, size_t count, int64_t first, const Scratch& w) const {
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

// A worker's AMX block (flash_backward::AmxLayout) where a pair's products run on AMX tiles: the
// key block's and query tile's splits fit the parts. `key`: the pair's first key, counted from
// the key block's first.
struct AmxTiles {
  int parts;
  const flash_backward::AmxLayout* at;
  uint16_t* base;
  size_t key;
  uint16_t* operator()(const flash_backward::AmxArray& array) const { return base + array.at; }
  float* grad_q_t() const { return reinterpret_cast<float*>(base + at->grad_q_t.at); }
};

// The key block's splits (keys j0 .. j0 + cols - 1 of kv head (b, g)): K and V rows, K^T. False
// when some value does not fit the parts (NaN, inf, or inf in bf16): the block stays float32.
bool SplitKeyBlock(const AttentionProblem& p, int64_t b, int64_t g, int64_t j0, size_t cols, const AmxTiles& amx) {
  const flash_backward::AmxLayout& at = *amx.at;
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

// Copies `rows` rows of `d` floats of head (b, h) from row i0 into a padded (br, d_pad) block.
HWY_INLINE void PackRows(const Rows<const float>& a, int64_t b, int64_t h, int64_t i0, size_t rows, size_t d,
                         size_t d_pad, size_t br, float* HWY_RESTRICT out) {
  std::fill_n(out, br * d_pad, 0.0f);
  for (size_t i = 0; i < rows; ++i) std::copy_n(a.row(b, h, i0 + static_cast<int64_t>(i)), d, out + i * d_pad);
}

// Decode's Qs for the tile's `rows` queries (view q): scale * Q rows, dk_pad apart, as decode
// packs them (one rounded product per element); the padding rows zero, so their scores are 0.
HWY_INLINE void PackScaledRows(const Rows<const float>& q, int64_t b, int64_t h, size_t rows, size_t dk, float scale,
                               const Scratch& w) {
  std::fill_n(w.q_scaled, w.br * w.dk_pad, 0.0f);
  for (size_t i = 0; i < rows; ++i) {
    const float* row = q.row(b, h, static_cast<int64_t>(i));
    for (size_t d = 0; d < dk; ++d) w.q_scaled[i * w.dk_pad + d] = scale * row[d];
  }
}

// S^T (cols keys j0, j0 + key_step, ..., Br queries) in decode's order (attention/steps/dot_scores-inl.h): the
// scores of a forward that ran decode, bit for bit. Past the last key the pointers repeat it
// (its scores land in rows of weights_t that nothing reads).
HWY_INLINE void DecodeOrderScores(const AttentionProblem& p, int64_t b, int64_t g, int64_t j0, int64_t key_step,
                                  size_t cols, const Scratch& w) {
  const size_t dk = static_cast<size_t>(p.head_dim), full = dk / hn::Lanes(DF()) * hn::Lanes(DF());
  constexpr size_t kKeys = dot_scores::kKeys;
  for (size_t j = 0; j < cols; j += kKeys) {
    const float* keys[kKeys];
    for (size_t x = 0; x < kKeys; ++x)
      keys[x] = p.k.row(b, g, j0 + static_cast<int64_t>(std::min(j + x, cols - 1)) * key_step);
    dot_scores::ScoreRows(w.br, dk, full, w.q_scaled, w.dk_pad, keys, w.weights_t + j * w.br, 1, w.br);
  }
}

// The query tile i0, i0 + step, ... (`rows` queries) of head (b, h): Qt = scale * Q^T and dOt
// (queries in lanes), and per query the weights' shift and scale and D; returns where Q's and
// dO's rows are. A whole tile (rows = Br, Dk and Dv whole vectors) is read in place; any other is
// copied into scratch, padded with zeros (padding queries have P = dS = 0, but 0 x NaN from a row
// past the tile would not be). Padding lanes see nothing (shift +inf, scale 0). Read in place,
// with K (StartKeyTile), W1-bwd and W2-bwd took 0.95-1.01 of the time of copying them (Ice Lake,
// in-process A/B, 1 and 2 threads).
QueryRows PackQueryTile(const AttentionBackwardProblem& bp, int64_t b, int64_t h, int64_t i0, int64_t step,
                        size_t rows, const float* HWY_RESTRICT row_dot_all, const Scratch& w) {
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

// D = dO . O of rows [row_begin, row_end) of (B, Hq, Nq), into row_dot, summed in float64 as the
// reference does, on float64 vectors (half a float vector promoted at a time): the scalar loop
// took about 3% of W1-bwd (`perf record`, one thread).
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

// Steps "modifiers" and "mask" of a pair's tile of weights: softcap (and its slope) on the
// whole tile, then ALiBi and the mask (TileLogits, as the forward).
void PairLogits(const AttentionProblem& p, const Walk& walk, int64_t b, int64_t h, int64_t i0, size_t rows,
                int64_t j0, size_t cols, const TileMask& mask, size_t br, float* HWY_RESTRICT weights,
                float* HWY_RESTRICT softcap_slope) {
  step::Softcap(p, weights, cols * br, softcap_slope);
  step::TileLogits(p, walk, mask, b, h, i0, rows, j0, cols, br, weights);
}

// to[c] = factor * from[c], plus what to[c] held when `add`, for c < n.
void ScaleInto(float* HWY_RESTRICT to, const float* HWY_RESTRICT from, size_t n, float factor, bool add) {
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

// The query tile's dQ accumulator (w.grad_q, Br x Dk_pad) times `factor` (KeyBlock's
// grad_q_scale) added into the rows i0, i0 + step, ... of grad_q_out, then zeroed for the next
// block of key tiles (unless no pair added into it: `floats` false); with `amx`, then the AMX
// products' dQ^T (Dk x Br) times the scale.
void FlushGradQ(const AttentionProblem& p, int64_t b, int64_t h, int64_t i0, int64_t step, size_t rows,
                float factor, const Rows<float>& grad_q_out, const Scratch& w, bool floats, const AmxTiles* amx) {
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

// The query tile's splits for the AMX products: PackQueryTile's Qt and dOt (in pairs of depth
// rows) and Q's and dO's rows (`rows` of the tile's w.br queries, zero past them, in pairs of
// queries). False when some value does not fit the parts: the tile's pairs stay float32.
bool SplitQueryTile(const AttentionProblem& p, const QueryRows& query_rows, size_t rows, const Scratch& w,
                    const AmxTiles& amx) {
  const flash_backward::AmxLayout& at = *amx.at;
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
bool SplitTileRows(bool round, const float* tile, size_t cols, size_t br, const AmxTiles& amx) {
  const flash_backward::AmxLayout& at = *amx.at;
  return amx::split_rows(amx.parts, round, tile, br, cols, br, amx(at.tile_rows), at.br_pad, round_up(cols, amx::kRows),
                         round_up(br, amx::kDepth), at.tile_rows.part);
}

// One (query tile, key block) pair of head (b, h): P and dS recomputed, dV and dK added into the
// key block's accumulators, dQ added into the query tile's accumulator w.grad_q (FlushGradQ adds
// it into dQ's rows once per block of key tiles: per pair, W2-bwd read and wrote its dQ rows 32
// times), or, where a hidden key's K is not finite, into grad_q_out's rows (of queries i0 + x *
// query_step) directly.
// `amx` (else null): the five products on AMX tiles (the key block's and query tile's splits
// fit), each one's result float32 where the float32 product puts it, but for dQ: dQ^T in the
// AMX block (FlushGradQ adds it too). The pair's own splits, P'^T and dS^T, are checked here: a
// dS^T that does not fit the parts keeps dK and dQ to float32. Returns whether dQ went the
// float32 way (into w.grad_q, or grad_q_out).
bool BackwardPair(const AttentionBackwardProblem& bp, const Walk& walk, int64_t b, int64_t h, int64_t i0, size_t rows,
                  const QueryRows& query_rows, const KeyBlock& keys, const TileMask& mask,
                  const Rows<float>& grad_q_out, const Scratch& w, const AmxTiles* amx) {
  const AttentionProblem& p = bp.forward;
  const size_t br = w.br, dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim);
  const size_t cols = keys.cols;
  const int64_t g = p.kv_head_of(h), j0 = keys.j0, ks = walk.key_step;
  const float* softcap_slope = p.softcap > 0 ? w.softcap_t : nullptr;
  auto line = [&](size_t j) { return step::Line{b, h, i0, j0 + static_cast<int64_t>(j) * ks, walk.query_step, 0}; };
  // AMX: the tiles take whole blocks of 16 keys (rows past cols are zero in the splits) and
  // steps of 32 keys or queries (zero past cols and Br).
  const flash_backward::AmxLayout* at = amx ? amx->at : nullptr;
  const size_t key_blocks = round_up(cols, amx::kRows) / amx::kRows, key_steps = round_up(cols, amx::kDepth) / amx::kDepth;
  const size_t query_steps = round_up(br, amx::kDepth) / amx::kDepth;
  // (Bc, Br) = the key block's split rows (K or V, depth_pad wide) times the query tile's split
  // pairs (Qt or dOt): S^T and dP'^T.
  auto keys_times_queries = [&](const flash_backward::AmxArray& rows, size_t depth_pad,
                                const flash_backward::AmxArray& pairs, float* HWY_RESTRICT out) {
    amx::product(amx->parts, (*amx)(rows) + amx->key * depth_pad, depth_pad, rows.part, key_blocks, (*amx)(pairs),
                 pairs.part, depth_pad / amx::kDepth, br, out, br, false);
  };
  // ---- Forward 1-3: "S = scale * Q K^T", "modifiers", "mask": S^T = K_tile Qt, the same steps;
  // summed in decode's order when the forward ran decode.
  if (bp.decode_scores)
    DecodeOrderScores(p, b, g, j0, ks, cols, w);
  else if (amx)
    keys_times_queries(at->k, at->dk_pad, at->q_t, w.weights_t);
  else
    Gemm(cols, br, dk, p.k.row(b, g, j0), static_cast<size_t>(p.k.row_stride * ks), 1, w.q_t, br, w.weights_t, br,
         false);
  if (mask.band || mask.hide >= 0 || p.softcap > 0 || p.alibi_slopes || !p.terms.empty())
    PairLogits(p, walk, b, h, i0, rows, j0, cols, mask, br, w.weights_t, w.softcap_t);
  // ---- Forward 4: "P = softmax(S)", recomputed from the row stats.
  step::RecomputeWeights(w.weights_t, cols, br, w.shift, w.scale);
  // ---- Forward 5: "P' = keep ? P / (1 - p) : 0", recomputed from P.
  const float* dropped = w.weights_t;
  if (p.dropout_p > 0) {
    std::copy_n(w.weights_t, cols * br, w.dropped_t);
    for (size_t j = 0; j < cols; ++j) step::Dropout(p, line(j), w.dropped_t + j * br, rows);
    dropped = w.dropped_t;
  }
  // ---- Forward 6: "O += P' V".  dV += P'^T dO;  dP'^T = V_tile dOt.
  if (amx && SplitTileRows(false, dropped, cols, br, *amx))
    amx::product(amx->parts, (*amx)(at->tile_rows), at->br_pad, at->tile_rows.part, key_blocks,
                 (*amx)(at->grad_out_pairs), at->grad_out_pairs.part, query_steps, dv, keys.grad_v, w.dv_pad, true);
  else
    Gemm(cols, w.dv_cols, br, dropped, br, 1, query_rows.grad_out, query_rows.grad_out_stride, keys.grad_v, w.dv_pad,
         true);
  if (amx)
    keys_times_queries(at->v, at->dv_pad, at->grad_out_t, w.grad_t);
  else
    Gemm(cols, br, dv, p.v.row(b, g, j0), static_cast<size_t>(p.v.row_stride * ks), 1, w.grad_out_t, br, w.grad_t, br,
         false);
  // ---- Forward 5, dropout: dP = keep ? dP' / (1 - p) : 0.  Forward 4-2: dS = P (dP - D), 0 where
  // P = 0, through softcap's slope.
  if (p.dropout_p > 0)
    for (size_t j = 0; j < cols; ++j) step::Dropout(p, line(j), w.grad_t + j * br, rows);
  step::SoftmaxGradient(w.weights_t, w.grad_t, cols, br, w.row_dot, softcap_slope);
  // ---- Forward 1: "S = scale * Q K^T".  dK += dS^T Q (scaled when stored); dQ += dS K (scaled when
  // flushed, or K packed scaled), on AMX tiles as dQ^T += K^T dS^T.
  const bool amx_grad = amx && SplitTileRows(true, w.grad_t, cols, br, *amx) &&
                        amx::split_pairs(amx->parts, true, w.grad_t, br, br, cols, key_steps * amx::kDepth / 2,
                                         (*amx)(at->grad_pairs), at->grad_pairs.part);
  if (amx_grad) {
    amx::product(amx->parts, (*amx)(at->tile_rows), at->br_pad, at->tile_rows.part, key_blocks, (*amx)(at->q_pairs),
                 at->q_pairs.part, query_steps, dk, keys.grad_k, w.dk_pad, true);
    amx::product(amx->parts, (*amx)(at->k_t) + amx->key, at->key_cols, at->k_t.part, dk / amx::kRows,
                 (*amx)(at->grad_pairs), at->grad_pairs.part, key_steps, br, amx->grad_q_t(), br, true);
    return false;
  }
  Gemm(cols, w.dk_cols, br, w.grad_t, br, 1, query_rows.q, query_rows.q_stride, keys.grad_k, w.dk_pad, true);
  if (keys.k_finite) {
    Gemm(rows, w.dk_cols, cols, w.grad_t, 1, br, keys.k_rows, keys.k_stride, w.grad_q, w.dk_pad, true);
  } else {  // a hidden key's K may be NaN or Inf: skip zero dS so it reaches no row (K packed, scaled)
    const Rows<float> grad_q = step::EveryStepRows(grad_q_out, i0, walk.query_step);
    accumulate_skipping_zeros(rows, cols, dk, w.grad_t, 1, br, keys.k_rows, static_cast<int64_t>(keys.k_stride),
                              grad_q.row(b, h, 0), static_cast<size_t>(grad_q.row_stride), 1);
  }
  return true;
}

// The key tile of keys j0, j0 + step, ... (cols of them) of kv head (b, g): K for the dQ product
// (KeyBlock: in place, or scale * K packed and padded), dK and dV accumulators at 0.
KeyBlock StartKeyTile(const AttentionProblem& p, int64_t b, int64_t g, int64_t j0, int64_t step, size_t cols,
                      const Scratch& w) {
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

// The key tile's gradients, summed over every query of the group, into the rows of keys j0,
// j0 + step, ...: stored, or added to what the tiles stored (`add`, the strided residues).
void FinishKeyTile(const AttentionBackwardProblem& bp, int64_t b, int64_t g, int64_t j0, int64_t step, size_t cols,
                   bool add, const Scratch& w) {
  const AttentionProblem& p = bp.forward;
  for (size_t j = 0; j < cols; ++j) {
    const int64_t key = j0 + static_cast<int64_t>(j) * step;
    ScaleInto(bp.grad_k.row(b, g, key), w.grad_k + j * w.dk_pad, static_cast<size_t>(p.head_dim), p.scale, add);
    ScaleInto(bp.grad_v.row(b, g, key), w.grad_v + j * w.dv_pad, static_cast<size_t>(p.value_dim), 1.0f, add);
  }
}

// One work item: key/value head g of batch b, key tiles starting at keys [key_begin, key_end)
// (key_begin a multiple of Bc), by blocks of kKeyBlock keys. Adds its part of dQ into grad_q_out
// and stores dK, dV of its keys.
// row_dot_all: D for every row (B, Hq, Nq). `amx_block`: this worker's AMX block (laid out by
// `amx_layout`) when the products may run on AMX tiles, else null.
void BackwardKeyChunk(const AttentionBackwardProblem& bp, int64_t b, int64_t g, int64_t key_begin, int64_t key_end,
                      const float* HWY_RESTRICT row_dot_all, const Rows<float>& grad_q_out, float* HWY_RESTRICT scratch,
                      uint16_t* amx_block, const flash_backward::AmxLayout* amx_layout) {
  const AttentionProblem& p = bp.forward;
  const size_t br = BackwardTileRowsFor(p), lanes = hn::Lanes(DF());
  const int64_t group = p.q_heads / p.kv_heads;
  const flash_backward::ScratchLayout layout(BackwardQueryTileRows(), static_cast<size_t>(p.head_dim),
                                             static_cast<size_t>(p.value_dim));
  // A head's queries in tiles of br, a short remainder sharing the last whole tile's vectors
  // (simd/query_tiles.hpp): W1's 512 as 4 x 96 + 2 x 64, not 5 x 96 + 32. Each tile runs on the
  // vectors its queries fill: the same scratch, its own Br.
  const QueryTiles tiling(p.q_len, static_cast<int64_t>(lanes), static_cast<int64_t>(br / lanes));
  const Scratch w(scratch, br, layout);
  std::fill_n(w.grad_q, br * w.dk_pad, 0.0f);  // each FlushGradQ leaves it zero again
  // AMX tiles hold 16 query lanes a row: only targets with 16 float lanes take them.
  AmxTiles amx{p.amx_parts, amx_layout, lanes == amx::kRows ? amx_block : nullptr, 0};
  if (amx.base) {
    std::fill_n(amx.grad_q_t(), static_cast<size_t>(p.head_dim) * br, 0.0f);  // as w.grad_q
    amx::configure();
  }

  for (int64_t j0 = key_begin; j0 < key_end; j0 += static_cast<int64_t>(kKeyBlock)) {
    const size_t cols = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(kKeyBlock), key_end - j0));
    const KeyBlock keys = StartKeyTile(p, b, g, j0, 1, cols, w);
    const bool amx_keys = amx.base && SplitKeyBlock(p, b, g, j0, cols, amx);
    for (int64_t h = g * group; h < (g + 1) * group; ++h)
      for (int64_t tile = 0; tile < tiling.count; ++tile) {
        const int64_t i0 = tiling.first_query(tile);
        const size_t rows = static_cast<size_t>(tiling.rows(tile));
        const int64_t i_last = i0 + static_cast<int64_t>(rows) - 1;
        if (step::ClassifyMaskTile(p, b, h, i0, i_last, j0, j0 + static_cast<int64_t>(cols)) == step::TileClass::Hidden)
          continue;
        const Scratch tile_w(scratch, static_cast<size_t>(tiling.vectors(tile)) * lanes, layout);
        const QueryRows query_rows = PackQueryTile(bp, b, h, i0, 1, rows, row_dot_all, tile_w);
        const bool amx_pairs = amx_keys && SplitQueryTile(p, query_rows, rows, tile_w, amx);
        bool float_grad_q = false;
        for (size_t at = 0; at < cols; at += kKeyTile) {  // the block's key tiles, in key order
          // The tile's keys that some query of the query tile sees (the band and key lengths), as
          // the forward bounds a query tile's keys: a causal pair past the diagonal skips the keys
          // all its queries would mask.
          const int64_t t0 = j0 + static_cast<int64_t>(at);
          const int64_t t_lo = std::max(t0, p.first_visible_key(i0));
          const int64_t t_hi = std::min(t0 + static_cast<int64_t>(std::min(kKeyTile, cols - at)),
                                        p.last_visible_key(b, i_last));
          if (t_lo >= t_hi) continue;
          const step::TileClass tile_class = step::ClassifyMaskTile(p, b, h, i0, i_last, t_lo, t_hi);
          if (tile_class == step::TileClass::Hidden) continue;
          amx.key = static_cast<size_t>(t_lo - j0);
          float_grad_q |= BackwardPair(
              bp, {}, b, h, i0, rows, query_rows,
              keys.Part(static_cast<size_t>(t_lo - j0), static_cast<size_t>(t_hi - t_lo), t_lo, w),
              {tile_class != step::TileClass::Full, -1}, grad_q_out, tile_w, amx_pairs ? &amx : nullptr);
        }
        FlushGradQ(p, b, h, i0, 1, rows, keys.grad_q_scale, grad_q_out, tile_w, float_grad_q,
                   amx_pairs ? &amx : nullptr);
      }
    FinishKeyTile(bp, b, g, j0, 1, cols, false, w);
  }
  if (amx.base) amx::release();
}

// ---- The strided keys of a `rest | strided(S, O)` rule, by residues as in the forward
// (flash/forward.cpp): queries r, r + S, ... against keys kr, kr + S, ... (kr = r + O mod S), after the
// tiles (which evaluated `rest`), hiding what `rest` shows. Adds into dQ, dK and dV.

// The residue tile of queries i0 + x S (x < rows) of head h against the key block's keys the
// band lets it see (trimmed from the block, so a causal residue computes few hidden pairs).
void ResiduePair(const AttentionBackwardProblem& bp, const StridedSplit& split, int64_t b, int64_t h, int64_t i0,
                 size_t rows, const KeyBlock& block, const float* HWY_RESTRICT row_dot_all, const Scratch& w) {
  const AttentionProblem& p = bp.forward;
  const int64_t stride = split.stride, residue = split.key_residue(i0);
  const int64_t i_last = i0 + static_cast<int64_t>(rows - 1) * stride;
  const int64_t c0 = (block.j0 - residue) / stride;
  const int64_t c_lo = std::max(c0, split.keys_before(residue, p.first_visible_key(i0)));
  const int64_t c_hi = std::min(c0 + static_cast<int64_t>(block.cols), split.keys_before(residue, p.last_visible_key(b, i_last)));
  if (c_lo >= c_hi) return;
  const int64_t j0 = residue + c_lo * stride, j_last = residue + (c_hi - 1) * stride;
  const step::TileClass band = step::ClassifyTile(p, b, i0, i_last, j0, j_last + 1);
  const TileVisibility rest = p.rule.classify(b, h, i0, i_last, j0, j_last, split.rest);
  if (band == step::TileClass::Hidden || rest == TileVisibility::Full) return;
  const QueryRows query_rows = PackQueryTile(bp, b, h, i0, stride, rows, row_dot_all, w);
  (void)BackwardPair(bp, {stride, stride, true}, b, h, i0, rows, query_rows,
                     block.Part(static_cast<size_t>(c_lo - c0), static_cast<size_t>(c_hi - c_lo), j0, w),
                     {band != step::TileClass::Full, rest == TileVisibility::Partial ? split.rest : -1}, bp.grad_q, w,
                     nullptr);
  FlushGradQ(p, b, h, i0, stride, rows, block.grad_q_scale, bp.grad_q, w, true, nullptr);
}

// Residues [first, last) of the queries of kv head (b, g)'s group: every residue's key tiles, each
// against every query head of the group and every residue tile of its queries.
void BackwardResidues(const AttentionBackwardProblem& bp, const StridedSplit& split, int64_t b, int64_t g,
                      int64_t first, int64_t last, const float* HWY_RESTRICT row_dot_all, float* HWY_RESTRICT scratch) {
  const AttentionProblem& p = bp.forward;
  const size_t br = ResidueTileRows();
  const int64_t group = p.q_heads / p.kv_heads, stride = split.stride;
  const Scratch w(scratch, br,
                  flash_backward::ScratchLayout(BackwardQueryTileRows(), static_cast<size_t>(p.head_dim),
                                                static_cast<size_t>(p.value_dim)));
  std::fill_n(w.grad_q, br * w.dk_pad, 0.0f);  // each FlushGradQ leaves it zero again
  for (int64_t r = first; r < last; ++r) {
    const int64_t residue = split.key_residue(r), queries = split.keys_before(r, p.q_len);
    const int64_t keys = split.keys_before(residue, p.kv_len);
    for (int64_t c0 = 0; c0 < keys; c0 += static_cast<int64_t>(kKeyTile)) {
      const size_t cols = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(kKeyTile), keys - c0));
      const KeyBlock block = StartKeyTile(p, b, g, residue + c0 * stride, stride, cols, w);
      for (int64_t h = g * group; h < (g + 1) * group; ++h)
        for (int64_t x0 = 0; x0 < queries; x0 += static_cast<int64_t>(br))
          ResiduePair(bp, split, b, h, r + x0 * stride, static_cast<size_t>(std::min<int64_t>(br, queries - x0)), block,
                      row_dot_all, w);
      FinishKeyTile(bp, b, g, residue + c0 * stride, stride, cols, true, w);
    }
  }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <omp.h>

#include "core/allocator.hpp"

namespace qkv::detail {

HWY_EXPORT(BackwardQueryTileRows);
HWY_EXPORT(BackwardKeyChunk);
HWY_EXPORT(BackwardResidues);
HWY_EXPORT(RowDots);

namespace {
// Chunks per (b, g) aim at this many items per thread, so the threads can balance
// unequal items (a causal mask's late keys have fewer queries).
constexpr int64_t kItemsPerThread = 4;
}  // namespace

namespace {
// The dQ a chunk adds into: the real dQ when each (b, g) is one chunk, else chunk's own packed
// partial (B, Hq, Nq, Dk) in `partials`, partial_floats apart.
Rows<float> grad_q_of_chunk(const AttentionBackwardProblem& bp, int64_t splits, float* partials, size_t partial_floats,
                            int64_t chunk) {
  const AttentionProblem& p = bp.forward;
  if (splits == 1) return bp.grad_q;
  return {partials + static_cast<size_t>(chunk) * partial_floats, p.q_heads * p.q_len * p.head_dim,
          p.q_len * p.head_dim, p.head_dim};
}
}  // namespace

namespace {
// Pass 4, after the tiles: the strided keys by residues of the original problem `bp`, items of
// kResiduesPerItem residues of a (b, g), each owning its residues' dK, dV and dQ rows.
constexpr int64_t kResiduesPerItem = 8;
void backward_residues(const AttentionBackwardProblem& bp, const StridedSplit& split, const float* row_dot,
                       float* blocks, size_t block, int workers) {
  const AttentionProblem& p = bp.forward;
  const int64_t residues = std::min(split.stride, p.q_len);
  const int64_t groups = (residues + kResiduesPerItem - 1) / kResiduesPerItem;
  for_each_item(workers, p.batch * p.kv_heads * groups, [&](int64_t item) {
    const int64_t pair = item / groups, first = item % groups * kResiduesPerItem;
    HWY_DYNAMIC_DISPATCH(BackwardResidues)(bp, split, pair / p.kv_heads, pair % p.kv_heads, first,
                                           std::min(residues, first + kResiduesPerItem), row_dot,
                                           blocks + static_cast<size_t>(worker_index(workers)) * block);
  });
}

// Passes 1-3 on `bp` (the tiles: with strided keys split off, `rest` only), then pass 4 when
// `split` is given: its residues on `whole`, the original problem.
void backward_passes(const AttentionBackwardProblem& bp, const StridedSplit* split,
                     const AttentionBackwardProblem& whole) {
  const AttentionProblem& p = bp.forward;
  const int64_t nq = p.q_len, nk = p.kv_len, dk = p.head_dim, dv = p.value_dim;
  const int64_t rows_total = p.batch * p.q_heads * nq;
  const int64_t pairs = p.batch * p.kv_heads;
  const int64_t key_tile = static_cast<int64_t>(flash_backward::kKeyTile);
  const int64_t key_tiles = (nk + key_tile - 1) / key_tile;

  // Threads, as the forward: a problem too small to pay for waking them runs here alone.
  const int threads = threads_for(2.5 * 2.0 * static_cast<double>(rows_total) * static_cast<double>(nk) *
                                  static_cast<double>(dk + dv));
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
  const size_t partials_total = splits > 1 ? static_cast<size_t>(splits) * partial_floats : 0;
  const int workers = static_cast<int>(std::clamp<int64_t>(std::min<int64_t>(threads, items), 1, threads));
  float* scratch = thread_workspace(WorkspaceSlot::FlashScratch)
                       .floats(row_dot_floats + partials_total + static_cast<size_t>(workers) * block);
  float* row_dot = scratch;
  float* partials = scratch + row_dot_floats;
  float* blocks = partials + partials_total;
  // The AMX products (MatmulPrecision High or Medium, a CPU with AMX, Dk and Dv multiples of 16,
  // 16 float lanes: BackwardKeyChunk checks): each worker's block, or none (amx::worker_blocks).
  flash_backward::AmxLayout amx_layout;
  uint16_t* amx_blocks = nullptr;
  if (p.amx_parts > 0 && dk % 16 == 0 && dv % 16 == 0 && amx::available()) {
    amx_layout = flash_backward::AmxLayout(p.amx_parts, br, static_cast<size_t>(dk), static_cast<size_t>(dv));
    amx_blocks = amx::worker_blocks(amx_layout.total, workers);
  }

  // ---- Pass 1, per row: D = dO . O (in float64, as the reference) and dQ (or every partial) = 0,
  // by blocks of kRowsPerBlock rows.
  constexpr int64_t kRowsPerBlock = 64;
#pragma omp parallel for schedule(static) num_threads(workers)
  for (int64_t first = 0; first < rows_total; first += kRowsPerBlock) {
    const int64_t last = std::min(rows_total, first + kRowsPerBlock);
    HWY_DYNAMIC_DISPATCH(RowDots)(bp, first, last, row_dot);
    for (int64_t row = first; row < last; ++row) {
      const int64_t b = row / (p.q_heads * nq), h = row / nq % p.q_heads, i = row % nq;
      for (int64_t s = 0; s < splits; ++s)
        std::fill_n(grad_q_of_chunk(bp, splits, partials, partial_floats, s).row(b, h, i), dk, 0.0f);
    }
  }

  // ---- Pass 2, items (b, g, chunk): dK and dV of the chunk's keys, its part of dQ. Keys no
  // query of the batch may see get zero gradients here.
  for_each_item(workers, items, [&](int64_t item) {
    const int64_t pair = item / splits, chunk = item % splits;
    const int64_t b = pair / p.kv_heads, g = pair % p.kv_heads;
    const int64_t visible_end = nq > 0 ? std::clamp<int64_t>(p.last_visible_key(b, nq - 1), 0, nk) : 0;
    const int64_t visible_tiles = (visible_end + key_tile - 1) / key_tile;
    const int64_t key_begin = std::min(visible_end, visible_tiles * chunk / splits * key_tile);
    const int64_t key_end = std::min(visible_end, visible_tiles * (chunk + 1) / splits * key_tile);
    if (chunk == splits - 1)
      for (int64_t j = visible_end; j < nk; ++j) {
        std::fill_n(bp.grad_k.row(b, g, j), dk, 0.0f);
        std::fill_n(bp.grad_v.row(b, g, j), dv, 0.0f);
      }
    if (key_begin >= key_end) return;
    const size_t worker = static_cast<size_t>(worker_index(workers));
    HWY_DYNAMIC_DISPATCH(BackwardKeyChunk)(bp, b, g, key_begin, key_end, row_dot,
                                           grad_q_of_chunk(bp, splits, partials, partial_floats, chunk),
                                           blocks + worker * block,
                                           amx_blocks ? amx_blocks + worker * amx_layout.total : nullptr, &amx_layout);
  });

  // ---- Pass 3, several chunks: dQ = the partials summed in chunk order.
  if (splits > 1) {
#pragma omp parallel for schedule(static) num_threads(workers)
    for (int64_t row = 0; row < rows_total; ++row) {
      const int64_t b = row / (p.q_heads * nq), h = row / nq % p.q_heads, i = row % nq;
      float* grad_q = bp.grad_q.row(b, h, i);
      for (int64_t c = 0; c < dk; ++c) {
        float sum = 0;
        for (int64_t s = 0; s < splits; ++s) sum += partials[static_cast<size_t>(s) * partial_floats + static_cast<size_t>(row * dk + c)];
        grad_q[c] = sum;
      }
    }
  }
  if (split) backward_residues(whole, *split, row_dot, blocks, block, workers);
}
}  // namespace

void flash_attention_backward(const AttentionBackwardProblem& bp) {
  // A `rest | strided(S)` rule with S >= Bc: the tiles see `rest` (a band folded into the band),
  // then the strided keys are added by residues, as the forward gathers them.
  const StridedSplit split = strided_split(bp.forward.rule, static_cast<int64_t>(flash_backward::kKeyTile));
  if (split.rest < 0) return backward_passes(bp, nullptr, bp);
  AttentionBackwardProblem tiles = bp;
  tiles.forward.rule = rest_rule(bp.forward.rule, split, tiles.forward.band_lo, tiles.forward.band_hi);
  backward_passes(tiles, &split, bp);
}

}  // namespace qkv::detail
#endif  // HWY_ONCE
