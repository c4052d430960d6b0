// y = alpha x W^T + beta y for few rows (internal): the "small" path of qkv::detail::sgemm
// (gemm/gemm.hpp), which picks it for A not transposed, B transposed and few rows of A.
//
// With few rows (W5: 20 rows of 512 through a 1536 x 512 weight) sgemm spends as much time
// packing W as multiplying, and its kernels follow
// OPENBLAS_CORETYPE (AVX2 when set to Haswell). This kernel reads W where it is, once: each output
// is a dot product of an x row with a W row, a tile of rows x outputs at a time in SIMD registers
// (Highway, dispatched to the best target of the CPU), threads over blocks of outputs.
#pragma once

#include <cstdint>

namespace qkv::detail {

// y (rows, n) = alpha x (rows, k) W^T + bias + beta y: W (n, k) row-major with rows ldw floats
// apart, x rows ldx apart, y rows ldy apart, bias n floats added to every row (null: none). beta
// == 0 does not read y (BLAS's rule: NaN there is overwritten). y must not overlap x, W or bias.
// The bias is added as each tile is stored, by the thread that computed it: a Linear that first
// filled y with its bias on the calling thread had the other threads fetch their parts of y from
// that thread's cache (docs/performance-log.md, "W5: the bias in the Small kernel's stores, and
// Auto's decode crossover").
void small_rows_gemm(const float* x, int64_t ldx, int64_t rows, int64_t k, const float* w, int64_t ldw, int64_t n,
                     float alpha, float beta, float* y, int64_t ldy, const float* bias = nullptr);

// Whether small_rows_gemm runs a product of rows x n x k on several threads (enough work and
// outputs, and more than one OpenMP thread); below that one thread is faster.
bool small_rows_gemm_threads(int64_t rows, int64_t n, int64_t k);

// Whether the SIMD target this CPU dispatches to runs the kernel's AVX-512 tile (5 rows x 4
// outputs, 20 accumulators); the other targets run 4 x 3 (12 of 16 registers).
bool small_rows_gemm_has_wide_tile();

}  // namespace qkv::detail
