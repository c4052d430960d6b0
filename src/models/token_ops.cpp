// qkv::models::detail token ops (token_ops.hpp); the activations are in activation.cpp.
#include "models/token_ops.hpp"

#include <cmath>

namespace qkv::models::detail {

void layer_norm(const float* x, int64_t rows, int64_t dim, const std::vector<float>& gamma,
                const std::vector<float>& beta, double eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * dim;
    double sum = 0, squares = 0;
    for (int64_t i = 0; i < dim; ++i) sum += row[i];
    const double mean = sum / static_cast<double>(dim);
    for (int64_t i = 0; i < dim; ++i) squares += (row[i] - mean) * (row[i] - mean);
    const double inv = 1.0 / std::sqrt(squares / static_cast<double>(dim) + eps);
    for (int64_t i = 0; i < dim; ++i)
      out[r * dim + i] =
          static_cast<float>((row[i] - mean) * inv) * gamma[static_cast<size_t>(i)] + beta[static_cast<size_t>(i)];
  }
}

void rms_norm(const float* x, int64_t rows, int64_t dim, const std::vector<float>& weight, double eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * dim;
    double squares = 0;
    for (int64_t i = 0; i < dim; ++i) squares += static_cast<double>(row[i]) * row[i];
    const double inv = 1.0 / std::sqrt(squares / static_cast<double>(dim) + eps);
    for (int64_t i = 0; i < dim; ++i)
      out[r * dim + i] = static_cast<float>(row[i] * inv) * weight[static_cast<size_t>(i)];
  }
}

void add_into(float* x, const float* y, int64_t count) {
  for (int64_t i = 0; i < count; ++i) x[i] += y[i];
}

}  // namespace qkv::models::detail
