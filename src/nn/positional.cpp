// qkv::nn::SinusoidalPositionalEncoding: the fixed sin/cos table of "Attention Is All You Need".
#include <algorithm>
#include <cmath>

#include "qkv/nn.hpp"

namespace qkv::nn {

SinusoidalPositionalEncoding::SinusoidalPositionalEncoding(int64_t max_len, int64_t d_model) {
  if (max_len < 1 || d_model < 1)
    throw Error("SinusoidalPositionalEncoding: max_len (" + std::to_string(max_len) + ") and d_model (" +
                std::to_string(d_model) + ") must be at least 1");
  encoding_ = Tensor::empty({max_len, d_model});
  float* pe = encoding_.data();
  for (int64_t pos = 0; pos < max_len; ++pos) {
    for (int64_t i = 0; i < d_model; i += 2) {
      // Wavelengths grow geometrically from 2*pi to 10000*2*pi across the dims.
      const double angle = static_cast<double>(pos) / std::pow(10000.0, static_cast<double>(i) / d_model);
      pe[pos * d_model + i] = static_cast<float>(std::sin(angle));
      if (i + 1 < d_model) pe[pos * d_model + i + 1] = static_cast<float>(std::cos(angle));
    }
  }
}

Tensor SinusoidalPositionalEncoding::forward(const Tensor& x) const {
  const int64_t max_len = encoding_.size(0), d_model = encoding_.size(1);
  if (!x.defined() || x.dim() < 2 || x.dim() > 3 || x.size(-1) != d_model || x.size(-2) > max_len)
    throw Error("SinusoidalPositionalEncoding: x is " + (x.defined() ? x.shape().str() : std::string("undefined")) +
                " but expected (B, N, " + std::to_string(d_model) + ") or (N, " + std::to_string(d_model) +
                ") with N <= max_len (" + std::to_string(max_len) + ")");
  Tensor y = x.clone();
  if (y.numel() == 0) return y;
  const int64_t rows = x.size(-2), sequences = x.numel() / (rows * d_model);
  float* out = y.data();
  const float* pe = encoding_.data();
  for (int64_t s = 0; s < sequences; ++s)
    for (int64_t e = 0; e < rows * d_model; ++e) out[s * rows * d_model + e] += pe[e];
  return y;
}

}  // namespace qkv::nn
