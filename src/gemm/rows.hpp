// y = x W^T for few rows of x on a weight matrix in its stored dtype (internal): the models'
// linear layers at decode (src/models/linear_any.cpp), where one row of x meets each weight once
// and the time is the reading of W.
//
// W is read where it is, in its dtype (float32, bfloat16, float16), and widened in registers
// (simd/kv_load-inl.h's LoadWide: bfloat16 by a shift, float16 by F16C), never into memory:
// widening a panel into scratch first made a decode step write and re-read twice the bytes it
// had to read. The products and sums are float32 FMAs on the widened lanes, x as given (not
// rounded to 16 bits), so the result is the float32 product of the stored values. Threads (the
// library's work split, simd/item_shares.hpp) take blocks of outputs.
#pragma once

#include <cstdint>

#include "qkv/dtype.hpp"

namespace qkv::detail {

// y (rows, n) = x (rows, k) W^T: x and y packed row-major float32; W holds n x k elements of
// `w_type` (F32, BF16 or F16), as (n, k) row-major (in_out false: torch.nn.Linear's weight) or as
// (k, n) row-major (in_out true: GPT-2's Conv1D weight). y is written, never read (NaN there is
// overwritten); it must not overlap x or W. Any rows >= 0 is allowed: rows beyond
// kRowsGemmTileRows run as several passes over W.
void rows_gemm(const float* x, int64_t rows, int64_t k, const void* w, DType w_type, bool in_out, int64_t n,
               float* y);

// The most rows one pass over W holds in registers.
inline constexpr int64_t kRowsGemmTileRows = 4;

// Whether rows_gemm runs rows x n x k on several threads (enough work, more than one OpenMP thread).
bool rows_gemm_threads(int64_t rows, int64_t n, int64_t k);

}  // namespace qkv::detail
