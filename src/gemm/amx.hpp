// The flash kernels' products on AMX tiles (x86 CPUs with AMX-BF16), for callers
// that allow a lower matmul precision (AttentionOptions::precision, as torch's
// set_float32_matmul_precision): each float32 operand is split into `parts` bfloat16 numbers
// (x ~ hi + lo, hi x rounded to bf16), and the products of the parts that matter are summed in
// float32 by the tile unit: 1 part (Medium) is one bf16 product, 2 parts (High) are
// hi hi' + hi lo' + lo hi', about 16 significant bits.
//
// The layouts are the flash kernels' (flash/forward.cpp, flash/backward.cpp): St = K Qt (Bc keys x Br
// query lanes), Ot (Dv x Br) and the backward's accumulators stay float32 in the worker's
// scratch, so every other step of the pipeline runs on them unchanged; only the operands are
// split, into bf16 arrays the tiles read (the forward's):
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

// `workers` blocks of `elements` bf16 each (an even count), 64-byte aligned, in the calling
// thread's workspace (WorkspaceSlot::FlashAmx: kept for the next call, as the kernels' float
// scratch is; qkv::release_workspaces frees it). Null past 64 MiB a block or 1 GiB in all, or
// when the allocation fails: the kernel's products then stay float32, so a lower precision never
// fails where Highest runs.
uint16_t* worker_blocks(size_t elements, int workers);

// Loads the tile configuration (every tile 16 rows of 64 bytes) on this thread; release() frees
// the tile state again. Each worker brackets its tile work by the two.
void configure();
void release();

// The splits return false when a value is NaN, +-inf, or rounds to inf in bf16: the parts do not
// hold it, and the caller keeps that work to float32.
//
// dst[part][r][c] (rows dst_row apart, parts part_stride apart) for r < rows_pad, c < cols_pad:
// the parts of src[r][c] (rows src_row apart) for r < rows, c < cols; zero elsewhere. `round`:
// hi rounded to nearest, else truncated (the backward's weights P'^T; checked all the same).
bool split_rows(int parts, bool round, const float* src, size_t src_row, size_t rows, size_t cols, uint16_t* dst,
                size_t dst_row, size_t rows_pad, size_t cols_pad, size_t part_stride);
// dst[part][c][r] (rows dst_row apart) for c < cols, r < rows_pad (a multiple of 16): src
// transposed, as split_rows.
bool split_transposed(int parts, const float* src, size_t src_row, size_t rows, size_t cols, uint16_t* dst,
                      size_t dst_row, size_t rows_pad, size_t part_stride);
// dst[part][x][n][2] = the parts of (src[2x][n], src[2x + 1][n]) for x < pairs, n < width (a
// multiple of 16), src rows src_row floats apart, dst rows (pairs) 2 width elements apart; rows
// from `valid` on read as zero. `round`: hi rounded to nearest (Qt), else truncated (P, the
// weights: faster; its check is skipped, true).
bool split_pairs(int parts, bool round, const float* src, size_t src_row, size_t width, size_t valid, size_t pairs,
                 uint16_t* dst, size_t part_stride);

// dst[i][c] += factor * src[c][i] for i < rows, c < cols (a multiple of 16; src rows src_row
// floats apart, src_row at least rows rounded up to 16; dst rows dst_row apart): the backward's
// dQ^T added into dQ.
void add_transposed(const float* src, size_t src_row, size_t rows, size_t cols, float factor, float* dst,
                    size_t dst_row);

// C[r][n] = (add: C[r][n] +) sum over 32 depth_steps of A[r][x] B[x][n], for r < 16 row_blocks
// and n < cols (a multiple of 16), C rows c_row floats apart. A: split rows (split_rows), a_row
// elements apart, parts a_part apart; B: split pairs of cols columns (split_pairs), parts b_part
// apart. Every product of the flash kernels is one call:
//   forward   St  = K Qt           A = K parts,    B = Qt's (depth Dk)
//             Ot += V^T P^T        A = V^T parts,  B = P^T's (depth: keys)
//   backward  dV += P'^T dO, dK += dS^T Q, dQ^T += K^T dS^T, and St, dP^T as the forward's.
void product(int parts, const uint16_t* a, size_t a_row, size_t a_part, size_t row_blocks, const uint16_t* b,
             size_t b_part, size_t depth_steps, size_t cols, float* c, size_t c_row, bool add);

}  // namespace qkv::detail::amx
