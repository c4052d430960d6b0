// qkv::nn::RotaryEmbedding (include/qkv/inference.hpp): rotates pairs of head features by an
// angle proportional to the token's position, in either pairing convention.
#include <cmath>
#include <cstdint>
#include <string>

#include "core/allocator.hpp"
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
  if (!x.defined() || x.dim() < 2 || x.dim() > 4)
    throw Error("RotaryEmbedding::apply: x is " + (x.defined() ? x.shape().str() : std::string("undefined")) +
                ": expected (B, H, N, D), (H, N, D) or (N, D)");
  Tensor out = x.clone();
  Tensor four = out;
  while (four.dim() < 4) four = four.unsqueeze(0);
  apply_inplace(four, {position_offset});
  return out;
}

void RotaryEmbedding::apply_inplace(const Tensor& x, const std::vector<int64_t>& offsets, bool inverse) const {
  const std::string who = "RotaryEmbedding: ";
  if (!x.defined() || x.dim() != 4 || x.size(3) != head_dim_)
    throw Error(who + "x is " + (x.defined() ? x.shape().str() : std::string("undefined")) +
                " but should be (B, H, N, " + std::to_string(head_dim_) + ")");
  if (x.strides()[3] != 1) throw Error(who + "x " + x.shape().str() + " has a strided last dim");
  const int64_t batch = x.size(0), heads = x.size(1), len = x.size(2), half = head_dim_ / 2;
  if (offsets.size() != 1 && static_cast<int64_t>(offsets.size()) != batch)
    throw Error(who + std::to_string(offsets.size()) + " position offsets for a batch of " + std::to_string(batch));
  float* data = x.view_data();  // checks f32
  const auto& st = x.strides();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t offset = offsets[offsets.size() == 1 ? 0 : static_cast<size_t>(b)];
    if (offset < 0) throw Error(who + "position offset " + std::to_string(offset) + " is negative");
    for (int64_t n = 0; n < len; ++n) {
      const double position = static_cast<double>(offset + n);
      for (int64_t i = 0; i < half; ++i) {
        const double angle = position * inverse_frequency_[static_cast<size_t>(i)];
        const double c = std::cos(angle), s = inverse ? -std::sin(angle) : std::sin(angle);
        const int64_t first = options_.interleaved ? 2 * i : i, second = options_.interleaved ? 2 * i + 1 : i + half;
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

}  // namespace qkv::nn
