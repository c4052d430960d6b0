// C = alpha op(A) op(B) + beta C on the fused kernels' register-tiled micro-GEMM (internal): the
// "tiled" path of qkv::detail::sgemm (gemm/gemm.hpp), which picks it (on AVX-512) for many rows against
// a head dimension, the reference kernel's products (S = Q K^T with k = d, P V and dS^T Q with
// n = d), and for many rows of a mid-size Linear (the rule and its measurements: gemm.cpp).
//
// Those shapes are skinny for a library sgemm (well below its rate on large squares). Here
// alpha op(B) is packed once into panels of up to 3 vectors (4 on AVX-512 for a
// last 4-vector block), each panel contiguous so that a block of its rows stays in L1 whatever
// ldb is (B rows a power of two apart fell into a few L1 sets and missed), and threads take
// blocks of A's rows, each running gemm/micro_kernel-inl.h's PanelGemm over every panel, a block of
// depth at a time.
#pragma once

#include <cstdint>

namespace qkv::detail {

// BLAS's semantics in row-major order, as sgemm (gemm/gemm.hpp): op(A) m x k, op(B) k x n, C m x n with
// rows ldc apart; beta == 0 does not read C. m, n, k >= 1; C must not overlap A or B.
void tiled_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// The same product computed as its transpose, C^T = op(B)^T op(A)^T, on the same kernel (the
// "tiled-transposed" path): B's elements are broadcast (in place when trans_b, as a Linear's W;
// else copied a slice at a time, as tiled_gemm copies a transposed A) and op(A) is packed. For
// x W^T with a few dozen rows x (m), W is read where it is and x, small, is what gets packed,
// where tiled_gemm packs all of W. C is written back from the kernel's tile, a column of the tile
// to a stretch of a row of C. Same semantics and requirements as tiled_gemm.
void tiled_gemm_transposed(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// Whether tiled_gemm runs an m x n x k product on several threads (enough multiply-adds, and
// more than one OpenMP thread); below that one thread is faster.
bool tiled_gemm_threads(int64_t m, int64_t n, int64_t k);

// Whether the SIMD target this CPU dispatches to has 32 vector registers (AVX-512: 8 x 3 and
// 6 x 4 register tiles); the 16-register targets run 4 x 3 and 2 + 2 panels.
bool tiled_gemm_has_wide_panels();

}  // namespace qkv::detail
