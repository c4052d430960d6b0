// qkv::analysis: see include/qkv/analysis.hpp for every formula.
#include "qkv/analysis.hpp"

#include <cmath>
#include <string>
#include <utility>

namespace qkv::analysis {

Tensor row_entropy(const Tensor& weights) {
  if (!weights.defined() || weights.dim() < 2)
    throw Error("row_entropy: weights are " + (weights.defined() ? weights.shape().str() : std::string("undefined")) +
                ", expected (..., Nq, Nk)");
  const Tensor packed = weights.contiguous();
  const int64_t keys = weights.size(-1);
  std::vector<int64_t> dims(weights.shape().begin(), weights.shape().end() - 1);
  Tensor entropy = Tensor::empty(Shape(std::move(dims)));
  const float* w = packed.data();
  float* out = entropy.data();
  for (int64_t row = 0; row < entropy.numel(); ++row) {
    double h = 0;
    for (int64_t j = 0; j < keys; ++j) {
      const double p = w[row * keys + j];
      if (p > 0) h -= p * std::log(p);
    }
    out[row] = static_cast<float>(h);
  }
  return entropy;
}

Tensor head_entropy(const Tensor& weights) {
  if (!weights.defined() || weights.dim() < 3 || weights.dim() > 4)
    throw Error("head_entropy: weights are " + (weights.defined() ? weights.shape().str() : std::string("undefined")) +
                ", expected (B, H, Nq, Nk) or (H, Nq, Nk)");
  const Tensor rows = row_entropy(weights);  // (..., H, Nq)
  const int64_t queries = rows.size(-1);
  std::vector<int64_t> dims(rows.shape().begin(), rows.shape().end() - 1);
  Tensor mean = Tensor::zeros(Shape(std::move(dims)));
  const float* h = rows.data();
  float* out = mean.data();
  for (int64_t head = 0; head < mean.numel(); ++head) {
    double sum = 0;
    for (int64_t i = 0; i < queries; ++i) sum += h[head * queries + i];
    out[head] = queries > 0 ? static_cast<float>(sum / static_cast<double>(queries)) : 0.0f;
  }
  return mean;
}

double forward_flops(const Workload& w) {
  const double pairs = static_cast<double>(w.batch) * static_cast<double>(w.q_heads) * static_cast<double>(w.q_len) *
                       static_cast<double>(w.kv_len);
  return pairs * (2.0 * static_cast<double>(w.head_dim) + 2.0 * static_cast<double>(w.value_dim)) *
         (w.causal ? 0.5 : 1.0);
}

double fused_bytes(const Workload& w) {
  const double dims = static_cast<double>(w.head_dim + w.value_dim);
  const double query_rows = static_cast<double>(w.batch) * static_cast<double>(w.q_heads) * static_cast<double>(w.q_len);
  const double key_rows = static_cast<double>(w.batch) * static_cast<double>(w.kv_heads) * static_cast<double>(w.kv_len);
  return sizeof(float) * (query_rows * (dims + 1) + key_rows * dims);
}

double materialised_bytes(const Workload& w) {
  const double scores = static_cast<double>(w.batch) * static_cast<double>(w.q_heads) * static_cast<double>(w.q_len) *
                        static_cast<double>(w.kv_len);
  return fused_bytes(w) + 2.0 * sizeof(float) * scores;
}

int64_t attention_ffn_crossover(int64_t model_width, int64_t ffn_multiplier, bool causal) {
  if (model_width < 1 || ffn_multiplier < 1)
    throw Error("attention_ffn_crossover: model_width (" + std::to_string(model_width) + ") and ffn_multiplier (" +
                std::to_string(ffn_multiplier) + ") must be at least 1");
  return model_width * ffn_multiplier * (causal ? 2 : 1);
}

namespace {
// a * b, or a qkv::Error when it does not fit in int64.
int64_t times(int64_t a, int64_t b) {
  int64_t product = 0;
  if (__builtin_mul_overflow(a, b, &product))
    throw Error("attention_memory: the sizes are too large: " + std::to_string(a) + " x " + std::to_string(b) +
                " overflows a 64-bit count");
  return product;
}
}  // namespace

AttentionMemory attention_memory(const AttentionMemoryModel& m) {
  const std::pair<const char*, int64_t> sizes[] = {
      {"seq", m.seq}, {"layers", m.layers}, {"heads", m.heads}, {"batch", m.batch}, {"head_dim", m.head_dim},
      {"dtype_bytes", m.dtype_bytes}};
  for (const auto& [name, value] : sizes)
    if (value <= 0) throw Error(std::string("attention_memory: ") + name + " must be positive, got " + std::to_string(value));
  AttentionMemory r;
  r.matrix_elements = times(m.seq, m.seq);
  r.matrix_bytes = times(r.matrix_elements, m.dtype_bytes);
  r.layer_elements = times(times(m.batch, m.heads), r.matrix_elements);
  r.layer_bytes = times(r.layer_elements, m.dtype_bytes);
  r.model_elements = times(m.layers, r.layer_elements);
  r.model_bytes = times(r.model_elements, m.dtype_bytes);
  r.course_model_bytes = times(m.layers, r.matrix_bytes);
  const int64_t rows = times(times(m.batch, m.heads), m.seq);  // one per (batch, head, query)
  r.flash_layer_elements = times(rows, m.head_dim) + rows;      // output + log-sum-exp
  r.flash_layer_bytes = times(r.flash_layer_elements, m.dtype_bytes);
  r.flash_model_bytes = times(m.layers, r.flash_layer_bytes);
  return r;
}

}  // namespace qkv::analysis
