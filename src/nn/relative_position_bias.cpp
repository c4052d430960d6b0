// qkv::nn::RelativePositionBias: T5's learned bias per head and distance bucket. The forward
// expands the (num_buckets, H) table into a (1, H, Nq, Nk) additive mask; the gradient comes from
// the attention backward's dbias (already summed over the batch when the bias is broadcast,
// attention/bias_gradient.hpp) summed into the buckets here.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "nn/grad.hpp"
#include "qkv/nn.hpp"

namespace qkv::nn {

namespace {
constexpr const char* kWho = "RelativePositionBias: ";

// The bucket of every k - q of a (q_len, kv_len) problem whose query i sits at position
// query_offset + i, at index k - i + q_len - 1 (the relative position k - q plus query_offset +
// q_len - 1).
std::vector<int64_t> buckets_of(int64_t q_len, int64_t kv_len, const RelativePositionBiasOptions& o,
                                int64_t query_offset = 0) {
  std::vector<int64_t> out(static_cast<size_t>(std::max<int64_t>(0, q_len + kv_len - 1)));
  for (size_t n = 0; n < out.size(); ++n)
    out[n] = RelativePositionBias::bucket(static_cast<int64_t>(n) - (q_len - 1) - query_offset, o);
  return out;
}
}  // namespace

RelativePositionBias::RelativePositionBias(int64_t num_heads, const RelativePositionBiasOptions& options)
    : num_heads_(num_heads), options_(options) {
  const int64_t per_direction = options.bidirectional ? options.num_buckets / 2 : options.num_buckets;
  // T5's logarithmic buckets need at least one exact bucket and max_distance past it.
  if (num_heads < 1 || per_direction < 2 || options.max_distance <= per_direction / 2)
    throw Error(std::string(kWho) + "num_heads (" + std::to_string(num_heads) + ") must be >= 1, num_buckets (" +
                std::to_string(options.num_buckets) + ") >= " + (options.bidirectional ? "4" : "2") +
                " and max_distance (" + std::to_string(options.max_distance) + ") > half the buckets per direction");
  weight = Tensor::zeros({options.num_buckets, num_heads});
  weight_grad = Tensor::zeros({options.num_buckets, num_heads});
}

// As T5 (transformers' T5Attention._relative_position_bucket), relative_position = k - q.
int64_t RelativePositionBias::bucket(int64_t relative_position, const RelativePositionBiasOptions& o) {
  int64_t buckets = o.num_buckets, first = 0, distance = 0;
  if (o.bidirectional) {
    buckets /= 2;
    first = relative_position > 0 ? buckets : 0;
    distance = relative_position < 0 ? -relative_position : relative_position;
  } else {
    distance = std::max<int64_t>(0, -relative_position);
  }
  const int64_t max_exact = buckets / 2;
  if (distance < max_exact) return first + distance;
  const double scaled = std::log(static_cast<double>(distance) / static_cast<double>(max_exact)) /
                        std::log(static_cast<double>(o.max_distance) / static_cast<double>(max_exact)) *
                        static_cast<double>(buckets - max_exact);
  // torch's .to(long) truncates the float32 value toward zero.
  const int64_t large = max_exact + static_cast<int64_t>(static_cast<float>(scaled));
  return first + std::min(large, buckets - 1);
}

Tensor RelativePositionBias::bias(int64_t q_len, int64_t kv_len, int64_t query_offset) const {
  if (q_len < 0 || kv_len < 0 || query_offset < 0)
    throw Error(std::string(kWho) + "bias: q_len (" + std::to_string(q_len) + "), kv_len (" + std::to_string(kv_len) +
                ") and query_offset (" + std::to_string(query_offset) + ") must be >= 0");
  Tensor out = Tensor::empty({1, num_heads_, q_len, kv_len});
  const float* table = weight.data();
  float* to = out.data();
  const std::vector<int64_t> buckets = buckets_of(q_len, kv_len, options_, query_offset);
  for (int64_t i = 0; i < q_len; ++i)
    for (int64_t j = 0; j < kv_len; ++j) {
      const int64_t b = buckets[static_cast<size_t>(j - i + q_len - 1)];
      for (int64_t h = 0; h < num_heads_; ++h) to[(h * q_len + i) * kv_len + j] = table[b * num_heads_ + h];
    }
  return out;
}

void RelativePositionBias::backward(const Tensor& dbias) {
  if (!dbias.defined() || dbias.dim() != 4 || dbias.size(1) != num_heads_)
    throw Error(std::string(kWho) + "backward: dbias is " + (dbias.defined() ? dbias.shape().str() : "undefined") +
                " but should be (B or 1, " + std::to_string(num_heads_) + ", Nq, Nk)");
  const Tensor d = dbias.contiguous();
  const int64_t batch = d.size(0), q_len = d.size(2), kv_len = d.size(3);
  const float* from = d.data();
  float* grad = weight_grad.data();
  const std::vector<int64_t> buckets = buckets_of(q_len, kv_len, options_);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < num_heads_; ++h)
      for (int64_t i = 0; i < q_len; ++i) {
        const float* row = from + ((b * num_heads_ + h) * q_len + i) * kv_len;
        for (int64_t j = 0; j < kv_len; ++j) grad[buckets[static_cast<size_t>(j - i + q_len - 1)] * num_heads_ + h] += row[j];
      }
}

void RelativePositionBias::zero_grad() { grad::reset_grad(weight_grad, weight); }

}  // namespace qkv::nn
