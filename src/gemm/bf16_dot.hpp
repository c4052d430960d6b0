// y = x W^T on a bfloat16 W with the CPU's bfloat16 dot products (internal): the models' linear
// layers over many rows (prefill; src/models/linear_any.cpp), where the time is multiply-adds, not
// the reading of W.
//
// x is rounded to bfloat16 (nearest even), each product of two bfloat16 values is exact in float32
// and the sums are float32, as torch computes a bf16 Linear: against the float32 product of x and
// the stored W the result differs by x's rounding, about 2^-9 of each term (the "bf16 bound"
// docs/models.md states). W is read where it is, as (n, k) or (k, n), never widened into memory.
// oneDNN's matmul runs it (AVX512-BF16's vdpbf16ps, AMX where present); its primitives are built
// once per shape and kept.
#pragma once

#include <cstdint>

namespace qkv::detail {

// Whether bf16_dot_gemm can run here: qkv built with oneDNN and a CPU with bfloat16 dot products
// (AVX512-BF16 or AMX), and not switched off by set_bf16_dot_gemm_for_test. Elsewhere callers keep
// their float32 path (oneDNN would emulate the products at a fraction of sgemm's speed).
bool bf16_dot_gemm_available();

// y (m, n) = bf16(x) (m, k) W^T: x and y packed row-major float32; W holds n x k bfloat16 values
// (raw uint16 bits) as (n, k) row-major (in_out false: torch.nn.Linear's weight) or (k, n)
// row-major (in_out true: GPT-2's Conv1D weight). y is written, never read; it must not overlap x
// or W. qkv::Error when !bf16_dot_gemm_available() or oneDNN refuses the shape.
void bf16_dot_gemm(const float* x, int64_t m, int64_t k, const void* w, bool in_out, int64_t n, float* y);

// Test hook: false makes bf16_dot_gemm_available() false (the callers' fallback is tested on a CPU
// that has the dot products); true restores the detection. Process-wide.
void set_bf16_dot_gemm_for_test(bool enabled);

}  // namespace qkv::detail
