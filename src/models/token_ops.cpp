// qkv::models::detail token ops (token_ops.hpp); the activations are in activation.cpp.
#include "models/token_ops.hpp"

#include <algorithm>
#include <cmath>

#include "attention/kernels.hpp"
#include "simd/item_shares.hpp"

namespace qkv::models::detail {

namespace {

// threads_for counts work in FLOPs of one core's vector arithmetic, about 24 a cycle (its
// kMinFlopsToThread, 2^23, is about 100 us of it).
constexpr double kFlopsPerCycle = 24;

// sum over i of f(row[i]) in double, in 8 independent partial sums: one chain would wait on each
// add's latency (a 512-token prefill's norms took about 4 cycles an element), and independent
// chains need no reassociation, so the compiler keeps the order (and vectorises it).
template <class F>
double sum_of(const float* row, int64_t dim, const F& f) {
  double partial[8] = {};
  int64_t i = 0;
  for (; i + 8 <= dim; i += 8)
    for (int j = 0; j < 8; ++j) partial[j] += f(static_cast<double>(row[i + j]));
  for (; i < dim; ++i) partial[0] += f(static_cast<double>(row[i]));
  double sum = 0;
  for (const double p : partial) sum += p;
  return sum;
}

}  // namespace

void for_each_run(int64_t count, int64_t unit, double cycles_per_element,
                  const std::function<void(int64_t first, int64_t last)>& body) {
  const int workers = qkv::detail::threads_for(static_cast<double>(count) * cycles_per_element * kFlopsPerCycle);
  const int64_t units = (count + unit - 1) / unit;
  const int64_t runs = std::min<int64_t>(units, int64_t{4} * workers);
  if (runs <= 1) return body(0, count);
  qkv::detail::for_each_item(workers, runs, [&](int64_t run) {
    body(std::min(count, units * run / runs * unit), std::min(count, units * (run + 1) / runs * unit));
  });
}

void layer_norm(const float* x, int64_t rows, int64_t dim, const std::vector<float>& gamma,
                const std::vector<float>& beta, double eps, float* out) {
  for_each_run(rows * dim, dim, 3, [&](int64_t first, int64_t last) {
    for (int64_t r = first / dim; r < last / dim; ++r) {
      const float* row = x + r * dim;
      const double mean = sum_of(row, dim, [](double v) { return v; }) / static_cast<double>(dim);
      const double squares = sum_of(row, dim, [mean](double v) { return (v - mean) * (v - mean); });
      const double inv = 1.0 / std::sqrt(squares / static_cast<double>(dim) + eps);
      for (int64_t i = 0; i < dim; ++i)
        out[r * dim + i] =
            static_cast<float>((row[i] - mean) * inv) * gamma[static_cast<size_t>(i)] + beta[static_cast<size_t>(i)];
    }
  });
}

void rms_norm(const float* x, int64_t rows, int64_t dim, const std::vector<float>& weight, double eps, float* out) {
  for_each_run(rows * dim, dim, 2, [&](int64_t first, int64_t last) {
    for (int64_t r = first / dim; r < last / dim; ++r) {
      const float* row = x + r * dim;
      const double squares = sum_of(row, dim, [](double v) { return v * v; });
      const double inv = 1.0 / std::sqrt(squares / static_cast<double>(dim) + eps);
      for (int64_t i = 0; i < dim; ++i)
        out[r * dim + i] = static_cast<float>(row[i] * inv) * weight[static_cast<size_t>(i)];
    }
  });
}

void add_into(float* x, const float* y, int64_t count) {
  for_each_run(count, 1024, 0.5, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) x[i] += y[i];
  });
}

void add_bias(float* y, int64_t rows, int64_t dim, const float* bias) {
  for_each_run(rows * dim, dim, 0.5, [&](int64_t first, int64_t last) {
    for (int64_t r = first / dim; r < last / dim; ++r)
      for (int64_t j = 0; j < dim; ++j) y[r * dim + j] += bias[j];
  });
}

}  // namespace qkv::models::detail
