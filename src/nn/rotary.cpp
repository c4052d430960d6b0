// qkv::nn::RotaryEmbedding (include/qkv/inference.hpp): rotates pairs of head features by an
// angle proportional to the token's position, in either pairing convention.
#include <cmath>
#include <cstdint>
#include <string>

#include "core/allocator.hpp"
#include "core/rotary_rows.hpp"
#include "qkv/error.hpp"
#include "qkv/inference.hpp"

namespace qkv::nn {

RotaryEmbedding::RotaryEmbedding(int64_t head_dim, const RotaryEmbeddingOptions& options)
    : head_dim_(head_dim), options_(options) {
  if (head_dim < 2 || head_dim % 2 != 0)
    throw Error("RotaryEmbedding: head_dim must be even and at least 2, got " + std::to_string(head_dim));
  if (!(options.base > 1) || !std::isfinite(options.base))
    throw Error("RotaryEmbedding: base must be finite and > 1, got " + std::to_string(options.base));
  // The table holds a double per pair of features: counted against the memory limit before it grows.
  const int64_t pairs = head_dim / 2;
  const int64_t bytes = pairs > INT64_MAX / 8 ? INT64_MAX : pairs * static_cast<int64_t>(sizeof(double));
  detail::check_request("RotaryEmbedding", "head_dim " + std::to_string(head_dim), bytes,
                        "a table of " + std::to_string(pairs) + " inverse frequencies", "");
  if (!options.inverse_frequencies.empty()) {
    if (static_cast<int64_t>(options.inverse_frequencies.size()) != head_dim / 2)
      throw Error("RotaryEmbedding: " + std::to_string(options.inverse_frequencies.size()) +
                  " inverse frequencies for head_dim " + std::to_string(head_dim) + " (need head_dim / 2)");
    for (double f : options.inverse_frequencies)
      if (!(f > 0) || !std::isfinite(f))
        throw Error("RotaryEmbedding: inverse frequency " + std::to_string(f) + " is not finite and > 0");
    inverse_frequency_ = options.inverse_frequencies;
    return;
  }
  inverse_frequency_.reserve(static_cast<size_t>(pairs));
  for (int64_t i = 0; i < pairs; ++i)
    inverse_frequency_.push_back(std::pow(options.base, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim)));
}

Tensor RotaryEmbedding::apply(const Tensor& x, int64_t position_offset) const {
  return qkv::detail::rotated_copy("RotaryEmbedding::apply: ", x, position_offset,
                                   [&](const Tensor& four, const std::vector<int64_t>& offsets) {
                                     apply_inplace(four, offsets);
                                   });
}

void RotaryEmbedding::apply_inplace(const Tensor& x, const std::vector<int64_t>& offsets, bool inverse) const {
  const std::vector<int64_t> per_batch = qkv::detail::rotary_offsets("RotaryEmbedding: ", x, head_dim_, offsets);
  qkv::detail::rotate_pairs(x, per_batch, head_dim_, options_.interleaved, inverse,
                       [&](int64_t position, int64_t i, double& c, double& s) {
                         const double angle = static_cast<double>(position) * inverse_frequency_[static_cast<size_t>(i)];
                         c = std::cos(angle);
                         s = std::sin(angle);
                       });
}

}  // namespace qkv::nn
