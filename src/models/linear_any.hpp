// Linear layers on weights in their stored dtype (F32, BF16, F16): y = x W^T + b with W read where
// the model folder holds it. A 16-bit W is widened a panel of rows at a time into per-thread
// scratch and multiplied by qkv::detail::sgemm panel by panel, so no float32 copy of a matrix ever
// exists; a float32 W goes to sgemm as it is.
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

// y (m, w.out) = x (m, w.in) W^T (+ bias (w.out) when bias is not null). x and y are packed
// row-major float32 and must not overlap.
void linear(const float* x, int64_t m, const StoredMatrix& w, const float* bias, float* y);

// The same on tensors: x (rows, w.in) packed -> a new (rows, w.out); bias empty or (w.out).
Tensor linear(const Tensor& x, const StoredMatrix& w, const std::vector<float>& bias);

// Row `row` of a stored (rows, cols) OutIn matrix (an embedding table), widened into out (cols).
void gather_row(const StoredMatrix& table, int64_t row, float* out);

}  // namespace qkv::models::detail
