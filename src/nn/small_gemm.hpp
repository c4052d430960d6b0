// y = x W^T + b for few rows (internal to src/nn): the GEMM of nn::Linear when the batch is small.
//
// With few rows (W5: 20 rows of 512 through a 1536 x 512 weight) sgemm spends as much time
// packing W as multiplying (OpenBLAS: sgemm_incopy ~ 1/4 of the call), and its kernels follow
// OPENBLAS_CORETYPE (AVX2 when set to Haswell). This kernel reads W where it is, once: each output
// is a dot product of an x row with a W row, a tile of rows x outputs at a time in SIMD registers
// (Highway, dispatched to the best target of the CPU), threads over blocks of outputs.
#pragma once

#include <cstdint>

namespace qkv::nn::gemm {

// Linear uses small_rows_linear for at most this many rows; sgemm beyond (its packing pays off).
inline constexpr int64_t kSmallGemmMaxRows = 64;

// y (rows, n) = x (rows, k) W^T + bias: W (n, k) row-major, bias (n) or nullptr; x rows are ldx
// floats apart, y rows ldy apart. y must not overlap x, W or bias.
void small_rows_linear(const float* x, int64_t ldx, int64_t rows, int64_t k, const float* w, int64_t n,
                       const float* bias, float* y, int64_t ldy);

}  // namespace qkv::nn::gemm
