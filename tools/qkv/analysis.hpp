// Small analysis formulas the seeing-attention tools share (viz, memory, scaling), kept apart
// from the drawing and the command lines so tests can check them on known inputs.
// (Issue 5 asks for a library-level qkv::analysis; until it lands, these are the tools' copies.)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace qkv::cli {

// -sum_j w_j ln w_j over one row of attention weights, in nats (0 * ln 0 = 0).
// 0 when the row puts all weight on one key; ln(n) when it spreads evenly over n keys.
double row_entropy(const float* weights, int64_t n);

// The least-squares line through (log x, log y): y ~ exp(intercept) * x^slope.
// Needs at least two points with distinct x; points with x <= 0 or y <= 0 are skipped.
struct PowerLawFit {
  double slope = 0;
  double intercept = 0;  // natural log of the prefactor
  int points = 0;        // how many points were used (slope is NaN when fewer than 2)
};
PowerLawFit fit_power_law(const std::vector<double>& x, const std::vector<double>& y);

// Bytes per element of the dtypes `qkv memory` knows: f32 4, f16 2, bf16 2, f64 8.
// Throws qkv::Error naming the choices for anything else.
int64_t dtype_bytes(const std::string& dtype);

// The attention memory of a transformer, as `qkv memory` explains it. All counts exact.
struct AttentionMemoryModel {
  int64_t seq = 0, layers = 0, heads = 0, batch = 0, head_dim = 0, dtype_bytes = 4;
};
struct AttentionMemory {
  int64_t matrix_elements = 0;  // seq^2: one head's weights for one sequence
  int64_t matrix_bytes = 0;
  int64_t layer_elements = 0;   // batch * heads * seq^2: every head of one layer
  int64_t layer_bytes = 0;
  int64_t model_elements = 0;   // layers * layer_elements: every layer's matrices kept at once
  int64_t model_bytes = 0;
  int64_t course_model_bytes = 0;  // layers * matrix_bytes: the course's figure, ONE head per layer
  // The flash path: per layer it keeps the output (batch * heads * seq * head_dim) and the
  // log-sum-exp (batch * heads * seq) and never forms a seq x seq matrix.
  int64_t flash_layer_elements = 0;
  int64_t flash_layer_bytes = 0;
  int64_t flash_model_bytes = 0;
};
// Throws qkv::Error when a size is not positive or the counts overflow int64.
AttentionMemory attention_memory(const AttentionMemoryModel& model);

// "1,610,612,736"
std::string group_thousands(int64_t n);
// Binary units: "16 MiB", "1.5 GiB", "144 GiB", "512 B".
std::string human_bytes(double bytes);

}  // namespace qkv::cli
