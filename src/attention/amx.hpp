// The flash forward's two products on AMX tiles (Intel Sapphire Rapids and later), for callers
// that allow a lower matmul precision (AttentionOptions::precision, as torch's
// set_float32_matmul_precision): each float32 operand is split into `parts` bfloat16 numbers
// (x ~ hi + lo, hi x rounded to bf16), and the products of the parts that matter are summed in
// float32 by the tile unit: 1 part (Medium) is one bf16 product, 2 parts (High) are
// hi hi' + hi lo' + lo hi', about 16 significant bits.
//
// The layouts are the flash kernel's (flash.cpp): St = K Qt (Bc keys x Br query lanes) and
// Ot (Dv x Br) stay float32 in the worker's scratch, so every other step of the pipeline runs on
// them unchanged; only the operands are split, into bf16 arrays the tiles read:
//   K parts   [part][key][dk_pad]          rows of K, zero past Dk (per K/V head, as far as needed)
//   V^T parts [part][dv][n_pad]            V transposed, keys contiguous, zero past Nk (likewise)
//   Q parts   [part][dk_pad / 2][br][2]    Qt's rows in pairs, interleaved (per query tile)
//   P parts   [part][keys / 2][br][2]      P^T's rows in pairs, interleaved (per key tile)
// (the tile unit's B operand holds pairs of consecutive depth steps side by side).
#pragma once

#include <cstddef>
#include <cstdint>

namespace qkv::detail::amx {

// Depth steps one tile product takes (32 bf16 = 64 bytes a row), and the rows of a tile.
constexpr size_t kDepth = 32, kRows = 16;

// True when this CPU has AMX-BF16 and AVX512-BF16 and the kernel granted this process the tile
// state (Linux >= 5.16, asked for once).
bool available();

// Loads the tile configuration (every tile 16 rows of 64 bytes) on this thread; release() frees
// the tile state again. Each worker brackets its tile work by the two.
void configure();
void release();

// The splits return false when a value is NaN, +-inf, or rounds to inf in bf16: the parts do not
// hold it, and the caller keeps that work to float32.
//
// dst[part][r][c] (rows dst_row apart, parts part_stride apart) for r < rows_pad, c < cols_pad:
// the parts of src[r][c] (rows src_row apart) for r < rows, c < cols; zero elsewhere.
bool split_rows(int parts, const float* src, size_t src_row, size_t rows, size_t cols, uint16_t* dst, size_t dst_row,
                size_t rows_pad, size_t cols_pad, size_t part_stride);
// dst[part][c][r] (rows dst_row apart) for c < cols, r < rows_pad (a multiple of 16): src
// transposed, as split_rows.
bool split_transposed(int parts, const float* src, size_t src_row, size_t rows, size_t cols, uint16_t* dst,
                      size_t dst_row, size_t rows_pad, size_t part_stride);
// dst[part][x][q][2] = the parts of (src[2x][q], src[2x + 1][q]) for x < pairs, q < br (a
// multiple of 16), src rows br floats apart; rows from `valid` on read as zero. `round`: hi
// rounded to nearest (Qt), else truncated (P, the weights: faster; its check is skipped, true).
bool split_pairs(int parts, bool round, const float* src, size_t br, size_t valid, size_t pairs, uint16_t* dst,
                 size_t part_stride);

// St[16 kb + r][q] = sum over the depth of K[16 kb + r] . Qt[., q] for kb < key_blocks, q < br
// (16 <= br <= 48), rows br floats apart: k at the tile's first key (rows k_row elements apart,
// dk_pad = 32 depth_steps), q the query tile's parts.
void scores(int parts, const uint16_t* k, size_t k_row, size_t k_part, size_t key_blocks, const uint16_t* q,
            size_t q_part, size_t depth_steps, size_t br, float* st);
// Ot[c][q] += sum over keys of V^T[c][key] P^T[key][q] for c < 16 dv_blocks, q < br: vt at the
// tile's first key (rows vt_row elements apart), p its parts (32 key_steps keys).
void accumulate(int parts, const uint16_t* vt, size_t vt_row, size_t vt_part, size_t dv_blocks, const uint16_t* p,
                size_t p_part, size_t key_steps, size_t br, float* ot);

}  // namespace qkv::detail::amx
