// qkv::models::detail token ops (token_ops.hpp).
#include "models/token_ops.hpp"

#include <cmath>
#include <numbers>

namespace qkv::models::detail {

namespace {
float apply(float x, Activation act) {
  switch (act) {
    case Activation::GeluTanh: {
      const float inner = static_cast<float>(std::sqrt(2.0 / std::numbers::pi)) * (x + 0.044715f * x * x * x);
      return 0.5f * x * (1.0f + std::tanh(inner));
    }
    case Activation::GeluErf: return 0.5f * x * (1.0f + std::erf(x * static_cast<float>(1.0 / std::numbers::sqrt2)));
    case Activation::Silu: return x / (1.0f + std::exp(-x));
    case Activation::Relu: return x > 0 ? x : 0.0f;
  }
  return x;
}
}  // namespace

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

void activate(float* x, int64_t count, Activation act) {
  for (int64_t i = 0; i < count; ++i) x[i] = apply(x[i], act);
}

void gated_activate(float* gate, const float* up, int64_t count, Activation act) {
  for (int64_t i = 0; i < count; ++i) gate[i] = apply(gate[i], act) * up[i];
}

void add_into(float* x, const float* y, int64_t count) {
  for (int64_t i = 0; i < count; ++i) x[i] += y[i];
}

}  // namespace qkv::models::detail
