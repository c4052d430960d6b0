// The per-token arithmetic between the matrix products of a transformer block: norms, activations,
// residual adds. Rows of `dim` floats, packed; computed in float32 with double sums, as the
// reference implementations do in float32 upcasts.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "qkv/models/config.hpp"

namespace qkv::models::detail {

// out (rows, dim) = (x - mean) / sqrt(var + eps) * gamma + beta per row (biased variance).
void layer_norm(const float* x, int64_t rows, int64_t dim, const std::vector<float>& gamma,
                const std::vector<float>& beta, double eps, float* out);
// out (rows, dim) = x / sqrt(mean(x^2) + eps) * weight per row (Llama's RMSNorm).
void rms_norm(const float* x, int64_t rows, int64_t dim, const std::vector<float>& weight, double eps, float* out);
// x (count) <- act(x).
void activate(float* x, int64_t count, Activation act);
// gate (rows, dim) <- act(gate) * up, the gated MLP's product (SwiGLU with Silu); up (rows, dim).
void gated_activate(float* gate, const float* up, int64_t count, Activation act);
// x (count) += y (count).
void add_into(float* x, const float* y, int64_t count);
// y (rows, dim) += bias (dim) on every row.
void add_bias(float* y, int64_t rows, int64_t dim, const float* bias);

// body(first, last) over [0, count) in runs of whole `unit`s (rows), on every thread when the work
// (count elements of about `cycles_per_element` each) pays for a parallel region (a prefill's
// rows), on the calling thread otherwise (a decode step's one row). Runs are disjoint.
void for_each_run(int64_t count, int64_t unit, double cycles_per_element,
                  const std::function<void(int64_t first, int64_t last)>& body);

}  // namespace qkv::models::detail
