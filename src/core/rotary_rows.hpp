// The rotation every rotary form shares (include/qkv/inference.hpp): RotaryEmbedding computes each
// angle's cos and sin from its base, RotaryTable and attention's rotary tables
// (AttentionOptions::rotary_cos / rotary_sin) look them up in tables; the pairs, the loop order and
// the arithmetic (double, rounded once to float) are this one function, so a table holding the
// base form's values rotates to the same bits. Also the tables' checks, shared by both table users.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "qkv/error.hpp"
#include "qkv/tensor.hpp"

namespace qkv::detail {

// Checks x (B, H, N, head_dim), f32 with a contiguous last dim, and the offsets (one, or one per
// batch element, each >= 0) before anything is rotated; returns offset b's value per batch element.
inline std::vector<int64_t> rotary_offsets(const std::string& who, const Tensor& x, int64_t head_dim,
                                           const std::vector<int64_t>& offsets) {
  if (!x.defined() || x.dim() != 4 || x.size(3) != head_dim)
    throw Error(who + "x is " + (x.defined() ? x.shape().str() : std::string("undefined")) +
                " but should be (B, H, N, " + std::to_string(head_dim) + ")");
  if (x.strides()[3] != 1) throw Error(who + "x " + x.shape().str() + " has a strided last dim");
  const int64_t batch = x.size(0);
  if (offsets.size() != 1 && static_cast<int64_t>(offsets.size()) != batch)
    throw Error(who + std::to_string(offsets.size()) + " position offsets for a batch of " + std::to_string(batch));
  std::vector<int64_t> per_batch(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t offset = offsets[offsets.size() == 1 ? 0 : static_cast<size_t>(b)];
    if (offset < 0) throw Error(who + "position offset " + std::to_string(offset) + " is negative");
    per_batch[static_cast<size_t>(b)] = offset;
  }
  return per_batch;
}

// apply(x, position_offset) of either form: x (B, H, N, D), (H, N, D) or (N, D) copied, the copy
// viewed as (B, H, N, D) and rotated in place by rotate(view, {position_offset}).
template <class Rotate>
Tensor rotated_copy(const std::string& who, const Tensor& x, int64_t position_offset, Rotate rotate) {
  if (!x.defined() || x.dim() < 2 || x.dim() > 4)
    throw Error(who + "x is " + (x.defined() ? x.shape().str() : std::string("undefined")) +
                ": expected (B, H, N, D), (H, N, D) or (N, D)");
  Tensor out = x.clone();
  Tensor four = out;
  while (four.dim() < 4) four = four.unsqueeze(0);
  rotate(four, std::vector<int64_t>{position_offset});
  return out;
}

// Rotates, in place, the pairs of the first rotary_dim features of every row of x (checked by
// rotary_offsets): token n of batch element b sits at position offsets[b] + n, and its pair i
// turns by the angle whose cosine and sine cos_sin(position, i, c, s) gives (negated sine when
// inverse). Half-split pairs (i, i + rotary_dim / 2), or interleaved (2i, 2i + 1).
template <class CosSin>
void rotate_pairs(const Tensor& x, const std::vector<int64_t>& offsets, int64_t rotary_dim, bool interleaved,
                  bool inverse, CosSin cos_sin) {
  const int64_t batch = x.size(0), heads = x.size(1), len = x.size(2), half = rotary_dim / 2;
  float* data = x.view_data();  // checks f32
  const auto& st = x.strides();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t n = 0; n < len; ++n) {
      const int64_t position = offsets[static_cast<size_t>(b)] + n;
      for (int64_t i = 0; i < half; ++i) {
        double c = 0, s = 0;
        cos_sin(position, i, c, s);
        if (inverse) s = -s;
        const int64_t first = interleaved ? 2 * i : i, second = interleaved ? 2 * i + 1 : i + half;
        for (int64_t h = 0; h < heads; ++h) {
          float* row = data + b * st[0] + h * st[1] + n * st[2];
          const double x1 = row[first], x2 = row[second];
          row[first] = static_cast<float>(x1 * c - x2 * s);
          row[second] = static_cast<float>(x2 * c + x1 * s);
        }
      }
    }
  }
}

// Checks cos and sin as rotary tables for heads of head_dim features: both 2-D (seqlen_ro,
// rotary_dim / 2), the same shape, at least one column, rotary_dim <= head_dim. Returns
// rotary_dim / 2. The messages start with `who` and name the shapes.
inline int64_t rotary_table_half(const std::string& who, const Tensor& cos, const Tensor& sin, int64_t head_dim) {
  const auto shape_of = [](const Tensor& t) { return t.defined() ? t.shape().str() : std::string("undefined"); };
  if (!cos.defined() || !sin.defined() || cos.dim() != 2 || sin.dim() != 2)
    throw Error(who + "cos is " + shape_of(cos) + " and sin is " + shape_of(sin) +
                ": each should be (seqlen_ro, rotary_dim / 2)");
  if (cos.shape() != sin.shape())
    throw Error(who + "cos is " + cos.shape().str() + " but sin is " + sin.shape().str() +
                ": the tables must have the same shape (seqlen_ro, rotary_dim / 2)");
  const int64_t half = cos.size(1);
  if (half < 1) throw Error(who + "the tables " + cos.shape().str() + " have no column: rotary_dim is 0");
  if (head_dim < 2 || 2 * half > head_dim)
    throw Error(who + "the tables " + cos.shape().str() + " rotate rotary_dim " + std::to_string(2 * half) +
                " features, more than head_dim " + std::to_string(head_dim));
  return half;
}

// Rows [first, first + count) of a table (f32, bf16 or f16: each widens exactly) in double,
// row-major, each finite; a non-finite entry is an Error naming its row and column in the table.
inline std::vector<double> widened_table_rows(const std::string& who, const Tensor& table, const char* name,
                                              int64_t first, int64_t count) {
  const std::vector<float> values = table.narrow(0, first, count).to(DType::F32).to_vector();
  std::vector<double> out(values.begin(), values.end());
  const int64_t columns = table.size(1);
  for (size_t k = 0; k < out.size(); ++k)
    if (!std::isfinite(out[k]))
      throw Error(who + name + "[" + std::to_string(first + static_cast<int64_t>(k) / columns) + ", " +
                  std::to_string(static_cast<int64_t>(k) % columns) + "] is " + std::to_string(out[k]) +
                  ": the tables must be finite");
  return out;
}

}  // namespace qkv::detail
