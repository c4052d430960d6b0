// The flash kernels' shared constants and the layouts of one worker's blocks (forward.cpp,
// backward.cpp): offsets only, the same for every SIMD target; each kernel's per-target code
// views them through its Scratch (products-inl.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

#include "attention/kernels.hpp"
#include "gemm/amx.hpp"

namespace qkv::detail::flash {

// Bc, keys per tile, forward and backward alike (the backward recomputes the forward's tiles,
// and the strided split, strided_split(rule, kKeyTile), must agree): large enough to amortise
// the per-tile rescale of Ot (Dv x Br multiplies) and its load/store in the second product over
// Bc FMAs each; small enough that St (Bc x Br) stays in L1 beside Qt and Ot. The same for every
// target.
constexpr size_t kKeyTile = 64;

// Backward, keys per block: a query tile is packed (Qt and dOt: two transposes of Br x d; Q and
// dO rows copied too where the tile is not whole) once per block and runs against its key tiles
// one after the other; the block's K and dK, dV accumulators (kKeyBlock x d each; K copied,
// scaled, where it is not finite or Dk is not whole vectors) stay in L2 across the group's query
// tiles. Packing per key tile instead measured slower, blocks of 8 tiles no better
// (docs/performance-log.md, "flash/").
constexpr size_t kKeyBlock = 4 * kKeyTile;

// Strided residues a work item runs one after the other, so that each residue's rows are
// fetched during the last one's work (forward and backward).
constexpr int64_t kResiduesPerItem = 8;

// A forward work item's query tile: queries i0 .. i0 + rows - 1 of head (b, h); rows == 0: none.
struct QueryTile {
  int64_t b = 0, h = 0, i0 = 0, rows = 0;
};

// Offsets of consecutive parts of a block, each starting on its own cache line.
class Parts {
 public:
  size_t take(size_t floats) {
    const size_t start = at_;
    at_ += round_to_cache_line(floats);
    return start;
  }
  size_t total() const { return at_; }

 private:
  size_t at_ = 0;
};

// The floats the score function of p (if any) evaluates a line of br scores in: its derivative
// line and its own scratch (attention/steps/score_mod-inl.h, ScoreMod).
inline size_t score_mod_floats(const AttentionProblem& p, size_t br) {
  return p.score_mod ? br + p.score_mod->scratch_floats(br) : 0;
}

// The floats of a tile of a tensor mask term (Bc, Br), read transposed from its rows
// (steps/tile_mask-inl.h, TileTerms; the backward's dS^T for a row-major dbias too), when p has
// terms.
inline size_t term_tile_floats(const AttentionProblem& p, size_t br) { return p.terms.empty() ? 0 : kKeyTile * br; }

// ---- Forward.

// One forward worker's scratch, offsets in floats from a 64-byte aligned base. br = queries per
// tile (per target), dk/dv = head and value dims.
struct ForwardScratchLayout {
  size_t q_t, scores, out_t, running_max, row_sum, correction, k_wide, v_wide, score_mod, term_t;
  size_t total;

  // The layout for problem p's tiles of br queries.
  ForwardScratchLayout(const AttentionProblem& p, size_t br)
      : ForwardScratchLayout(br, static_cast<size_t>(p.head_dim), static_cast<size_t>(p.value_dim),
                             p.kv_dtype != DType::F32, score_mod_floats(p, br), term_tile_floats(p, br)) {}

  ForwardScratchLayout(size_t br, size_t dk, size_t dv, bool wide_kv = false, size_t score_mod_floats = 0,
                       size_t term_floats = 0) {
    Parts parts;
    q_t = parts.take(dk * br);               // Qt (Dk, Br)
    scores = parts.take(kKeyTile * br);      // St then P^T (Bc, Br)
    out_t = parts.take(dv * br);             // Ot (Dv, Br)
    running_max = parts.take(br);            // per query
    row_sum = parts.take(br);                // per query
    correction = parts.take(br);             // per query: exp(old max - new max), then 1 / l
    k_wide = parts.take(wide_kv ? kKeyTile * dk : 0);  // 16-bit K/V: the tile widened to float
    v_wide = parts.take(wide_kv ? kKeyTile * dv : 0);
    score_mod = parts.take(score_mod_floats);  // the score function's lines (ScoreMod)
    term_t = parts.take(term_floats);          // a mask term's tile, transposed (TileTerms)
    total = parts.total();
  }
};

// The header of a forward worker's AMX block: the K/V head (b, g) its splits are of, how many
// keys are split, and the first key of the first key tile whose values do not fit the parts
// (kAllFit: none so far). The tiles from there on stay float32.
constexpr int64_t kAllFit = std::numeric_limits<int64_t>::max();
struct AmxHeld {
  int64_t b, g, keys, unfit_from;
};

// One forward worker's block for the AMX products (MatmulPrecision High or Medium on a CPU with
// AMX, gemm/amx.hpp), offsets in bf16 elements from a 64-byte aligned base: a header (AmxHeld),
// the query tile's Q parts, one key tile's P parts, and one K/V head's K and V^T parts, split as
// far as the worker's tiles have needed (consecutive items share the head): 2 n_pad (dk_pad + Dv)
// bytes a part.
struct ForwardAmxLayout {
  size_t dk_pad = 0, n_pad = 0;                  // Dk rounded up to 32, keys with room past Nk
  size_t q = 0, p = 0, k = 0, v = 0, total = 0;  // offsets; total in elements
  size_t q_part = 0, p_part = 0, k_part = 0, v_part = 0;

  ForwardAmxLayout() = default;
  ForwardAmxLayout(int parts, size_t br, size_t dk, size_t dv, size_t nk) {
    constexpr size_t kLine = 32;  // elements per cache line
    dk_pad = round_up(dk, amx::kDepth);
    // A key tile from any j0 < Nk reads Bc keys of the splits: zeros past Nk.
    n_pad = round_up(nk, kKeyTile) + kKeyTile;
    q_part = round_up(dk_pad * br, kLine), p_part = round_up(kKeyTile * br, kLine),
    k_part = round_up(n_pad * dk_pad, kLine), v_part = round_up(dv * n_pad, kLine);
    const size_t count = static_cast<size_t>(parts);
    q = kLine, p = q + count * q_part, k = p + count * p_part, v = k + count * k_part, total = v + count * v_part;
  }
};

// ---- Backward.

// One backward worker's scratch, offsets in floats from a 64-byte aligned base. br = queries per
// tile (per target); dk_pad / dv_pad the padded dims.
struct BackwardScratchLayout {
  size_t dk, dv, dk_pad, dv_pad;
  size_t q_t, grad_out_t, q_rows, grad_out_rows, q_scaled, weights_t, dropped_t, grad_t, softcap_t, k_rows, grad_k,
      grad_v, grad_q, shift, scale, row_dot, score_mod, term_t, total;

  // The layout for problem p's tiles of at most br queries.
  BackwardScratchLayout(const AttentionProblem& p, size_t br)
      : BackwardScratchLayout(br, static_cast<size_t>(p.head_dim), static_cast<size_t>(p.value_dim),
                              score_mod_floats(p, br), term_tile_floats(p, br)) {}

  BackwardScratchLayout(size_t br, size_t dk_, size_t dv_, size_t score_mod_floats = 0, size_t term_floats = 0)
      : dk(dk_), dv(dv_), dk_pad(round_to_cache_line(dk_)), dv_pad(round_to_cache_line(dv_)) {
    Parts parts;
    q_t = parts.take(dk * br);                // Qt (Dk, Br), scale * Q^T
    grad_out_t = parts.take(dv * br);         // dOt (Dv, Br)
    q_rows = parts.take(br * dk_pad);         // Q (Br, Dk_pad), where not read in place
    grad_out_rows = parts.take(br * dv_pad);  // dO (Br, Dv_pad), where not read in place
    q_scaled = parts.take(br * dk_pad);       // scale * Q (Br, Dk_pad), for decode's score order
    weights_t = parts.take(kKeyTile * br);    // S^T then P^T (Bc, Br)
    dropped_t = parts.take(kKeyTile * br);    // P'^T (Bc, Br), with dropout
    grad_t = parts.take(kKeyTile * br);       // dP'^T then dS^T (Bc, Br)
    softcap_t = parts.take(kKeyTile * br);    // d(logit)/d(raw score): softcap's 1 - tanh^2, the score function's (Bc, Br)
    k_rows = parts.take(kKeyBlock * dk_pad);  // scale * K block (kKeyBlock, Dk_pad), where not read in place
    // dK and dV of the key block (kKeyBlock, Dk_pad / Dv_pad; dK without the scale), and a block
    // of 16 rows past it: AMX tiles add whole blocks of 16 key rows from a pair's first key.
    grad_k = parts.take((kKeyBlock + amx::kRows) * dk_pad);
    grad_v = parts.take((kKeyBlock + amx::kRows) * dv_pad);
    grad_q = parts.take(br * dk_pad);  // dQ of the query tile over a block of key tiles (Br, Dk_pad)
    shift = parts.take(br);            // per query: P = exp(S - shift) * scale
    scale = parts.take(br);
    row_dot = parts.take(br);  // per query: D = dO . O
    score_mod = parts.take(score_mod_floats);  // the score function's lines and their derivatives
    term_t = parts.take(term_floats);  // a mask term's tile, transposed (TileTerms), then dS^T for dbias
    total = parts.total();
  }
};

// Where an array of AMX operand parts starts in a backward worker's AMX block and how far apart
// its parts are, in bf16 elements.
struct AmxArray {
  size_t at = 0, part = 0;
};

// One backward worker's block for the products on AMX tiles (MatmulPrecision High or Medium on a
// CPU with AMX, gemm/amx.hpp; Dk and Dv multiples of 16), offsets in bf16 elements from a
// 64-byte aligned base, every part on its own cache lines. br: the most queries a tile takes.
//   split per key block: K rows and V rows (kKeyBlock + 16 rows: a pair's 16-row blocks from any
//     key of the block), K^T (kKeyBlock + 32 columns: its 32-key steps from any key); zero past
//     the block's keys
//   per query tile: Qt's and dOt's rows in pairs (depth Dk, Dv), Q's and dO's rows in pairs
//     (depth: the tile's queries)
//   per pair: P'^T's then dS^T's rows (depth: queries), dS^T's rows in pairs (depth: keys)
//   and the query tile's dQ^T (Dk x Br) in float32: dQ^T += K^T dS^T keeps dS^T's layout.
struct BackwardAmxLayout {
  size_t dk_pad = 0, dv_pad = 0, key_rows = 0, key_cols = 0, br_pad = 0;  // depths rounded up to 32
  AmxArray k, v, k_t, q_t, grad_out_t, q_pairs, grad_out_pairs, tile_rows, grad_pairs, grad_q_t;
  size_t total = 0;

  BackwardAmxLayout() = default;
  BackwardAmxLayout(int parts, size_t br, size_t dk, size_t dv) {
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

}  // namespace qkv::detail::flash
