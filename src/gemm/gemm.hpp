// qkv::detail::sgemm: the one GEMM entry point of the library outside the fused kernels
// (nn::Linear's backward, and its forward through linear_sgemm, which adds the bias, hence
// MultiHeadAttention's projections; the reference kernel's score and P V products, forward and
// backward). Behind it the library picks a path per shape class (choose_gemm_path, gemm.cpp),
// so that these GEMMs run near the machine's best sgemm whatever the environment says to one
// library (OPENBLAS_CORETYPE=Haswell halves OpenBLAS on an AVX-512 core; oneDNN and qkv's own
// kernel pick their code from the CPU itself):
//   Small     qkv's Highway kernel (gemm/small.hpp): A not transposed, B transposed, few rows
//   Tiled     the fused kernels' micro-GEMM on packed panels of B (gemm/tiled.hpp): any transposes
//   TiledT    the same kernel on the transposed product, C^T = op(B)^T op(A)^T (gemm/tiled.hpp)
//   OneDnn    dnnl_sgemm, when qkv was built with oneDNN (QKV_HAVE_DNNL)
//   OpenBlas  cblas_sgemm
// docs/performance.md gives the measurements behind the choice (`qkv bench` times every path on
// the shape classes the library meets).
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace qkv::detail {

enum class GemmPath { Small, Tiled, TiledT, OneDnn, OpenBlas };

std::string_view to_string(GemmPath path);

// Whether `path` can compute C = alpha op(A) op(B) + beta C with these transposes in this build.
bool gemm_path_can_take(GemmPath path, bool trans_a, bool trans_b);

// The path sgemm takes for this shape class (m x n output, k terms), ignoring the test override.
GemmPath choose_gemm_path(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k);

// C (m x n, row-major, rows ldc apart) = alpha op(A) op(B) + beta C, BLAS's semantics in row-major
// order: op(A) is m x k (A is k x m with rows lda apart when trans_a), op(B) is k x n. beta == 0
// never reads C (NaN there is overwritten). Returns the path it took. m, n or k of 0 is allowed.
GemmPath sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
               const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// A Linear's forward: y (m x n, rows ldy apart) = x (m x k, rows ldx apart) W^T + bias, W (n x k)
// rows ldw apart, bias n floats added to every row (null: none). The path is sgemm's (test
// override included); the Small path adds the bias as it stores its tiles, the others start y at
// the bias rows and accumulate onto them. Returns the path it took.
GemmPath linear_sgemm(int64_t m, int64_t n, int64_t k, const float* x, int64_t ldx, const float* w, int64_t ldw,
                      const float* bias, float* y, int64_t ldy);

// The same on a given path (qkv::Error when the path cannot take the call): for tests and for the
// measurements that justify choose_gemm_path.
void sgemm_on(GemmPath path, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
              int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// Test hook: while set, sgemm takes `path` wherever that path can take the call (the callers'
// tests run under each path); std::nullopt restores the choice. Process-wide.
void set_gemm_path_for_test(std::optional<GemmPath> path);

}  // namespace qkv::detail
