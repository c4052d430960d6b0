// qkv::models::detail::linear (linear_any.hpp): few rows read W in place (rows_gemm); many rows on
// a bfloat16 W take the CPU's bfloat16 dot products (bf16_dot_gemm) where it has them; otherwise
// panels of a 16-bit weight are widened into per-thread scratch, each multiplied by
// qkv::detail::sgemm.
#include "models/linear_any.hpp"

#include <algorithm>
#include <vector>

#include "gemm/bf16_dot.hpp"
#include "gemm/gemm.hpp"
#include "gemm/rows.hpp"
#include "models/token_ops.hpp"

namespace qkv::models::detail {

namespace {

// How many floats a panel of W holds (whole rows as stored). Few rows of x (decode) read each
// panel once, right after widening it: 256 KiB stays in L2 between the two. Many rows (prefill)
// spend O(m) per widened element, so larger panels (4 MiB) cut the sgemm calls, each of which may
// open a parallel region.
int64_t panel_floats(int64_t m) { return m <= 16 ? int64_t{1} << 16 : int64_t{1} << 20; }

// The calling thread's scratch of at least `count` floats, reused from call to call.
float* scratch(int64_t count) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < count) buffer.resize(static_cast<size_t>(count));
  return buffer.data();
}

const char* row_bytes(const StoredMatrix& w, int64_t row, int64_t row_length) {
  return static_cast<const char*>(w.data) + row * row_length * static_cast<int64_t>(element_size(w.dtype));
}

// y = x W^T with W (out, in): panels of output features, each an sgemm writing its columns of y.
void linear_out_in(const float* x, int64_t m, const StoredMatrix& w, float* y) {
  if (w.dtype == DType::F32) {
    qkv::detail::sgemm(false, true, m, w.out, w.in, 1.0f, x, w.in, static_cast<const float*>(w.data), w.in, 0.0f, y,
                       w.out);
    return;
  }
  const int64_t rows = std::clamp<int64_t>(panel_floats(m) / w.in, 1, w.out);
  float* panel = scratch(rows * w.in);
  for (int64_t r0 = 0; r0 < w.out; r0 += rows) {
    const int64_t r = std::min(rows, w.out - r0);
    convert(row_bytes(w, r0, w.in), w.dtype, panel, DType::F32, static_cast<size_t>(r * w.in));
    qkv::detail::sgemm(false, true, m, r, w.in, 1.0f, x, w.in, panel, w.in, 0.0f, y + r0, w.out);
  }
}

// y = x W with W stored (in, out): panels of input features, each an sgemm adding its terms to y.
void linear_in_out(const float* x, int64_t m, const StoredMatrix& w, float* y) {
  if (w.dtype == DType::F32) {
    qkv::detail::sgemm(false, false, m, w.out, w.in, 1.0f, x, w.in, static_cast<const float*>(w.data), w.out, 0.0f, y,
                       w.out);
    return;
  }
  const int64_t rows = std::clamp<int64_t>(panel_floats(m) / w.out, 1, w.in);
  float* panel = scratch(rows * w.out);
  for (int64_t k0 = 0; k0 < w.in; k0 += rows) {
    const int64_t k = std::min(rows, w.in - k0);
    convert(row_bytes(w, k0, w.out), w.dtype, panel, DType::F32, static_cast<size_t>(k * w.out));
    qkv::detail::sgemm(false, false, m, w.out, k, 1.0f, x + k0, w.in, panel, w.out, k0 == 0 ? 0.0f : 1.0f, y, w.out);
  }
}

// Few rows of x (decode) on a 16-bit W, or on a float32 W stored (in, out): rows_gemm reads W
// once where it is and widens it in registers. Widening panels into scratch for sgemm made decode
// write and re-read twice the bytes of W it had to read; a float32 (out, in) W goes to sgemm,
// whose Small path reads it in place the same way.
bool reads_in_place(int64_t m, const StoredMatrix& w) {
  return m <= kMaxRowsInPlace && (w.dtype != DType::F32 || w.layout == Layout::InOut);
}

}  // namespace

void linear(const float* x, int64_t m, const StoredMatrix& w, const float* bias, float* y) {
  if (reads_in_place(m, w)) {
    qkv::detail::rows_gemm(x, m, w.in, w.data, w.dtype, w.layout == Layout::InOut, w.out, y);
  } else if (w.dtype == DType::BF16 && qkv::detail::bf16_dot_gemm_available()) {
    qkv::detail::bf16_dot_gemm(x, m, w.in, w.data, w.layout == Layout::InOut, w.out, y);
  } else if (w.layout == Layout::OutIn) {
    linear_out_in(x, m, w, y);
  } else {
    linear_in_out(x, m, w, y);
  }
  if (bias != nullptr) add_bias(y, m, w.out, bias);
}

Tensor linear(const Tensor& x, const StoredMatrix& w, const std::vector<float>& bias) {
  const int64_t rows = x.size(0);
  Tensor y = Tensor::empty({rows, w.out});
  linear(x.data(), rows, w, bias.empty() ? nullptr : bias.data(), y.data());
  return y;
}

void gather_row(const StoredMatrix& table, int64_t row, float* out) {
  convert(row_bytes(table, row, table.in), table.dtype, out, DType::F32, static_cast<size_t>(table.in));
}

}  // namespace qkv::models::detail
