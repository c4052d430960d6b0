// Linear layers on weights in their stored dtype (F32, BF16, F16): y = x W^T + b with W read where
// the model folder holds it. Few rows (decode) read W in place and widen it in registers
// (gemm/rows.hpp). Many rows on a bfloat16 W, where the CPU has bfloat16 dot products, round x to
// bfloat16 and multiply in bfloat16 with float32 sums (gemm/bf16_dot.hpp: torch's bf16 Linear; x's
// rounding costs about 2^-9 of each term). Otherwise a 16-bit W is widened a panel of rows at a
// time into per-thread scratch and multiplied by qkv::detail::sgemm panel by panel, so no float32
// copy of a matrix ever exists; a float32 W goes to sgemm as it is.
#pragma once

#include <cstdint>
#include <vector>

#include "qkv/dtype.hpp"
#include "qkv/tensor.hpp"

namespace qkv::models::detail {

// How a stored matrix holds W (out_features x in_features in the y = x W^T convention).
enum class Layout {
  OutIn,  // (out, in), row-major: torch.nn.Linear's weight
  InOut,  // (in, out), row-major: GPT-2's Conv1D weight
};

// A matrix as stored: `data` holds out * in elements of `dtype` in `layout`.
struct StoredMatrix {
  const void* data = nullptr;
  DType dtype = DType::F32;
  int64_t out = 0, in = 0;
  Layout layout = Layout::OutIn;
};

// The most rows of x that read a 16-bit W in place (decode); more take the bf16 dot products or
// widened panels.
inline constexpr int64_t kMaxRowsInPlace = 16;

// y (m, w.out) = x (m, w.in) W^T (+ bias (w.out) when bias is not null). x and y are packed
// row-major float32 and must not overlap.
void linear(const float* x, int64_t m, const StoredMatrix& w, const float* bias, float* y);

// The same on tensors: x (rows, w.in) packed -> a new (rows, w.out); bias empty or (w.out).
Tensor linear(const Tensor& x, const StoredMatrix& w, const std::vector<float>& bias);

// Row `row` of a stored (rows, cols) OutIn matrix (an embedding table), widened into out (cols).
void gather_row(const StoredMatrix& table, int64_t row, float* out);

}  // namespace qkv::models::detail
