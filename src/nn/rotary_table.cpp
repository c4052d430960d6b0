// qkv::nn::RotaryTable (include/qkv/inference.hpp): rotary positions from cos / sin tables the
// caller supplies (FlashAttention's rotary_cos / rotary_sin), over a partial rotary_dim. The
// rotation itself is RotaryEmbedding's (core/rotary_rows.hpp); only where c and s come from differs.
#include <cmath>
#include <cstdint>
#include <string>

#include "core/allocator.hpp"
#include "core/rotary_rows.hpp"
#include "qkv/error.hpp"
#include "qkv/inference.hpp"

namespace qkv::nn {
namespace {

constexpr const char* kWho = "RotaryTable: ";

std::string str(int64_t v) { return std::to_string(v); }

// The tables' bytes as doubles, counted against the memory limit before they are allocated.
void check_table_bytes(int64_t length, int64_t half) {
  const int64_t elements = half > 0 && length > INT64_MAX / 16 / half ? INT64_MAX / 16 : length * half;
  detail::check_request("RotaryTable", "tables (" + str(length) + ", " + str(half) + ")", elements * 16,
                        "cos and sin in double", "");
}

}  // namespace

RotaryTable::RotaryTable(int64_t head_dim, const RotaryTableOptions& options) {
  const Tensor& cos = options.cos;
  const int64_t half = qkv::detail::rotary_table_half(kWho, cos, options.sin, head_dim);
  check_table_bytes(cos.size(0), half);
  head_dim_ = head_dim;
  rotary_dim_ = 2 * half;
  length_ = cos.size(0);
  interleaved_ = options.interleaved;
  cos_ = qkv::detail::widened_table_rows(kWho, cos, "cos", 0, length_);
  sin_ = qkv::detail::widened_table_rows(kWho, options.sin, "sin", 0, length_);
}

RotaryTable RotaryTable::from_base(int64_t head_dim, int64_t length, const RotaryEmbeddingOptions& options,
                                   int64_t rotary_dim) {
  const int64_t dim = rotary_dim == 0 ? head_dim : rotary_dim;
  if (dim < 2 || dim % 2 != 0)
    throw Error(std::string(kWho) + "rotary_dim " + str(dim) +
                " must be even and at least 2: rotary embeddings rotate pairs of features");
  if (dim > head_dim)
    throw Error(std::string(kWho) + "rotary_dim " + str(dim) + " is more than head_dim " + str(head_dim));
  if (length < 0) throw Error(std::string(kWho) + "length " + str(length) + " is negative");
  const RotaryEmbedding base(dim, options);  // checks the base and the inverse frequencies
  const int64_t half = dim / 2;
  check_table_bytes(length, half);
  RotaryTable table;
  table.head_dim_ = head_dim;
  table.rotary_dim_ = dim;
  table.length_ = length;
  table.interleaved_ = options.interleaved;
  table.cos_.resize(static_cast<size_t>(length * half));
  table.sin_.resize(static_cast<size_t>(length * half));
  for (int64_t p = 0; p < length; ++p)
    for (int64_t i = 0; i < half; ++i) {  // the angle exactly as RotaryEmbedding::apply_inplace computes it
      const double angle = static_cast<double>(p) * base.inverse_frequencies()[static_cast<size_t>(i)];
      table.cos_[static_cast<size_t>(p * half + i)] = std::cos(angle);
      table.sin_[static_cast<size_t>(p * half + i)] = std::sin(angle);
    }
  return table;
}

Tensor RotaryTable::apply(const Tensor& x, int64_t position_offset) const {
  return qkv::detail::rotated_copy("RotaryTable::apply: ", x, position_offset,
                                   [&](const Tensor& four, const std::vector<int64_t>& offsets) {
                                     apply_inplace(four, offsets);
                                   });
}

void RotaryTable::apply_inplace(const Tensor& x, const std::vector<int64_t>& offsets, bool inverse) const {
  const std::vector<int64_t> per_batch = qkv::detail::rotary_offsets(kWho, x, head_dim_, offsets);
  const int64_t len = x.size(2), half = rotary_dim_ / 2;
  for (size_t b = 0; b < per_batch.size(); ++b)
    if (len > 0 && per_batch[b] > length_ - len)
      throw Error(std::string(kWho) + "batch element " + str(static_cast<int64_t>(b)) + "'s " + str(len) +
                  " tokens from position " + str(per_batch[b]) + " reach position " + str(per_batch[b] + len - 1) +
                  ", but the tables hold positions 0 to " + str(length_ - 1) + " (seqlen_ro " + str(length_) + ")");
  qkv::detail::rotate_pairs(x, per_batch, rotary_dim_, interleaved_, inverse,
                            [&](int64_t position, int64_t i, double& c, double& s) {
                              c = cos_[static_cast<size_t>(position * half + i)];
                              s = sin_[static_cast<size_t>(position * half + i)];
                            });
}

Tensor RotaryTable::cos() const {
  std::vector<float> values(cos_.begin(), cos_.end());
  return Tensor::from(std::move(values), {length_, rotary_dim_ / 2});
}

Tensor RotaryTable::sin() const {
  std::vector<float> values(sin_.begin(), sin_.end());
  return Tensor::from(std::move(values), {length_, rotary_dim_ / 2});
}

}  // namespace qkv::nn
