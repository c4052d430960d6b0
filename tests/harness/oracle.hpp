// The test oracle: attention in float64, written from the textbook formula and independent of
// the library's kernels and of its mask normalisation, plus the random data and the comparator
// every test uses.
//
// Only qkv's public API is used, and no test framework: the consumer program in
// tests/consumer includes this header too. Tests print Random::note() with SCOPED_TRACE so a
// failure names its seed; QKV_TEST_SEED=<seed> in the environment replays it.
#pragma once

#include <qkv/qkv.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace qkv_test {

inline constexpr double kInf = std::numeric_limits<double>::infinity();

// ---------------------------------------------------------------------------------------------
// Random data: a fresh seed for every Random, so each run tries new numbers.

class Random {
 public:
  Random() : Random(fresh_seed()) {}
  explicit Random(uint64_t seed) : seed_(seed), engine_(seed) {}

  uint64_t seed() const { return seed_; }
  // For SCOPED_TRACE: how to replay this run.
  std::string note() const {
    return "random seed " + std::to_string(seed_) + " (replay with QKV_TEST_SEED=" +
           std::to_string(seed_) + ")";
  }

  double normal() { return std::normal_distribution<double>(0.0, 1.0)(engine_); }
  double uniform(double low, double high) {
    return std::uniform_real_distribution<double>(low, high)(engine_);
  }
  int64_t integer(int64_t low, int64_t high) {  // inclusive on both ends
    return std::uniform_int_distribution<int64_t>(low, high)(engine_);
  }
  bool chance(double p) { return std::bernoulli_distribution(p)(engine_); }
  uint64_t next_u64() { return engine_(); }

  std::vector<float> normals(int64_t n, double scale = 1.0) {
    std::vector<float> values(static_cast<size_t>(n));
    for (float& x : values) x = static_cast<float>(scale * normal());
    return values;
  }
  // A standard normal tensor (times scale), built from values drawn here, not by the library.
  qkv::Tensor randn(const qkv::Shape& shape, double scale = 1.0) {
    return qkv::Tensor::from(normals(shape.numel(), scale), shape);
  }
  qkv::Tensor uniform_tensor(const qkv::Shape& shape, double low, double high) {
    std::vector<float> values(static_cast<size_t>(shape.numel()));
    for (float& x : values) x = static_cast<float>(uniform(low, high));
    return qkv::Tensor::from(std::move(values), shape);
  }
  // A random permutation of 0 .. n-1.
  std::vector<int64_t> permutation(int64_t n) {
    std::vector<int64_t> order(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), int64_t{0});
    std::shuffle(order.begin(), order.end(), engine_);
    return order;
  }

 private:
  static uint64_t fresh_seed() {
    if (const char* replay = std::getenv("QKV_TEST_SEED"); replay != nullptr && *replay != 0) {
      return std::stoull(replay);
    }
    std::random_device device;
    return (static_cast<uint64_t>(device()) << 32) ^ static_cast<uint64_t>(device());
  }

  uint64_t seed_;
  std::mt19937_64 engine_;
};

// ---------------------------------------------------------------------------------------------
// Reading tensors. The oracle trusts nothing of the library but its storage: tensors given to
// it must be contiguous (build them with Tensor::from), and data() throws otherwise.

// A 16-bit float's value, from the IEEE formulas (not the library's conversion).
inline double value_of_bits(uint16_t bits, qkv::DType dtype) {
  if (dtype == qkv::DType::BF16) {  // the top half of a float32
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  const int exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
  const double sign = (bits & 0x8000) ? -1.0 : 1.0;
  if (exponent == 0x1f) return mantissa ? std::numeric_limits<double>::quiet_NaN() : sign * kInf;
  if (exponent == 0) return sign * std::ldexp(mantissa, -24);
  return sign * std::ldexp(1024 + mantissa, exponent - 25);
}

inline std::vector<double> to_doubles(const qkv::Tensor& t) {
  if (t.numel() == 0) return {};
  if (t.dtype() != qkv::DType::F32) {  // bf16 / f16: each element's exact value
    const auto* bits = static_cast<const uint16_t*>(t.raw_data());
    std::vector<double> values(static_cast<size_t>(t.numel()));
    for (size_t i = 0; i < values.size(); ++i) values[i] = value_of_bits(bits[i], t.dtype());
    return values;
  }
  const float* p = t.data();
  return std::vector<double>(p, p + t.numel());
}

// ---------------------------------------------------------------------------------------------
// Visibility, said per score element. A Bias returns 0 (visible), -inf (hidden) or a finite
// value added to the scaled score. b is the batch, h the query head, i the query, j the key.

using Bias = std::function<double(int64_t b, int64_t h, int64_t i, int64_t j)>;

// Mask::causal(offset): query i sits at absolute position offset + i and sees keys j <= it.
inline Bias causal_bias(int64_t offset = 0) {
  return [offset](int64_t, int64_t, int64_t i, int64_t j) {
    return j <= offset + i ? 0.0 : -kInf;
  };
}

// Mask::window(left, right, offset): offset + i - left <= j <= offset + i + right.
inline Bias window_bias(int64_t left, int64_t right = 0, int64_t offset = 0) {
  return [=](int64_t, int64_t, int64_t i, int64_t j) {
    return (j >= offset + i - left && j <= offset + i + right) ? 0.0 : -kInf;
  };
}

// Mask::key_lengths(lengths): batch b sees keys j < lengths[b].
inline Bias key_lengths_bias(std::vector<int64_t> lengths) {
  return [lengths = std::move(lengths)](int64_t b, int64_t, int64_t, int64_t j) {
    return j < lengths.at(static_cast<size_t>(b)) ? 0.0 : -kInf;
  };
}

namespace detail {
// The element of a mask tensor that covers score (b, h, i, j). A 2-D mask is (Nq, Nk), a 3-D
// one (B, Nq, Nk) and a 4-D one (B, Hq, Nq, Nk); a dim of size 1 repeats along that axis.
struct BroadcastMask {
  std::vector<double> values;
  std::vector<int64_t> dims;

  double at(int64_t b, int64_t h, int64_t i, int64_t j) const {
    std::vector<int64_t> coords;
    if (dims.size() == 2) coords = {i, j};
    else if (dims.size() == 3) coords = {b, i, j};
    else if (dims.size() == 4) coords = {b, h, i, j};
    else throw std::logic_error("oracle: a mask tensor must be 2-D, 3-D or 4-D");
    int64_t index = 0;
    for (size_t d = 0; d < dims.size(); ++d) {
      const int64_t c = dims[d] == 1 ? 0 : coords[d];
      if (c >= dims[d]) throw std::logic_error("oracle: mask tensor does not cover the scores");
      index = index * dims[d] + c;
    }
    return values[static_cast<size_t>(index)];
  }
};

inline BroadcastMask read_mask(const qkv::Tensor& t) {
  return {to_doubles(t), t.shape().dims()};
}
}  // namespace detail

// Mask::keep(t): nonzero = visible, 0 = hidden.
inline Bias keep_bias(const qkv::Tensor& keep) {
  return [mask = detail::read_mask(keep)](int64_t b, int64_t h, int64_t i, int64_t j) {
    return mask.at(b, h, i, j) != 0.0 ? 0.0 : -kInf;
  };
}

// Mask::additive(t): the value is added to the scaled score.
inline Bias additive_bias(const qkv::Tensor& scores) {
  return [mask = detail::read_mask(scores)](int64_t b, int64_t h, int64_t i, int64_t j) {
    return mask.at(b, h, i, j);
  };
}

// Mask::strided(stride, offset): visible when offset + i - j is a multiple of stride (true modulo).
inline Bias strided_bias(int64_t stride, int64_t offset = 0) {
  return [=](int64_t, int64_t, int64_t i, int64_t j) {
    int64_t r = (offset + i - j) % stride;
    if (r < 0) r += stride;
    return r == 0 ? 0.0 : -kInf;
  };
}

// Mask::global_tokens(count): the first count keys and the first count queries see everything.
inline Bias global_bias(int64_t count) {
  return [=](int64_t, int64_t, int64_t i, int64_t j) { return j < count || i < count ? 0.0 : -kInf; };
}

// Mask::block_sparse(layout, bq, bk): layout (QB, KB) or (H, QB, KB), H = Hq or 1.
inline Bias block_sparse_bias(const qkv::Tensor& layout, int64_t block_q, int64_t block_k) {
  const std::vector<int64_t> dims = layout.shape().dims();
  return [values = to_doubles(layout), dims, block_q, block_k](int64_t, int64_t h, int64_t i, int64_t j) {
    const int64_t rows = dims[dims.size() - 2], cols = dims.back();
    const int64_t head = dims.size() == 3 && dims[0] > 1 ? h : 0;
    const int64_t a = i / block_q, c = j / block_k;
    if (a >= rows || c >= cols) throw std::logic_error("oracle: block layout does not cover the scores");
    return values[static_cast<size_t>((head * rows + a) * cols + c)] != 0.0 ? 0.0 : -kInf;
  };
}

// A union (Mask's |) of parts that each say visible (not -inf) or hidden (-inf).
inline Bias any_of(std::vector<Bias> parts) {
  return [parts = std::move(parts)](int64_t b, int64_t h, int64_t i, int64_t j) {
    for (const Bias& part : parts)
      if (!part || part(b, h, i, j) != -kInf) return 0.0;
    return -kInf;
  };
}

// A score is visible only where every part allows it; additive values add up.
inline Bias all_of(std::vector<Bias> parts) {
  return [parts = std::move(parts)](int64_t b, int64_t h, int64_t i, int64_t j) {
    double total = 0;
    for (const Bias& part : parts) {
      if (!part) continue;  // none
      const double value = part(b, h, i, j);
      if (value == -kInf) return -kInf;
      total += value;
    }
    return total;
  };
}

// ---------------------------------------------------------------------------------------------
// The oracle itself.

// Sizes of one problem: q (B, Hq, Nq, Dk), k (B, Hkv, Nk, Dk), v (B, Hkv, Nk, Dv).
struct AttentionDims {
  int64_t batch = 1, q_heads = 1, kv_heads = 1;
  int64_t q_len = 0, kv_len = 0, qk_dim = 0, v_dim = 0;
};

// Dropout as the oracle applies it: a weight w becomes keeps(b, h, i, j) ? w / (1 - p) : 0.
struct OracleDropout {
  double p = 0;
  std::function<bool(int64_t b, int64_t h, int64_t i, int64_t j)> keeps;  // empty: no dropout
};

// Score modifiers as the oracle applies them to each scaled score s, before the bias:
// s <- softcap tanh(s / softcap) (softcap > 0), s <- s - slope(b, h) |i + Nk - Nq - j| with the
// slopes (Hq) or, alibi_batch_stride = Hq, (B, Hq); and sinks[h], a logit in each row's softmax
// denominator with no value. Empty vectors: off.
struct OracleModifiers {
  double softcap = 0;
  std::vector<double> alibi_slopes, sinks;
  int64_t alibi_batch_stride = 0;

  double modify(double score, int64_t b, int64_t h, int64_t i, int64_t j, int64_t nq, int64_t nk) const {
    if (softcap > 0) score = softcap * std::tanh(score / softcap);
    if (!alibi_slopes.empty())
      score -= alibi_slopes[static_cast<size_t>(b * alibi_batch_stride + h)] * std::abs(double(i + nk - nq - j));
    return score;
  }
  double sink(int64_t h) const { return sinks.empty() ? -kInf : sinks[static_cast<size_t>(h)]; }
};

// All row-major: output (B, Hq, Nq, Dv), weights (B, Hq, Nq, Nk), lse (B, Hq, Nq).
struct OracleResult {
  AttentionDims dims;
  std::vector<double> output, weights, lse;
  // The largest |row maximum| of the logits (modifiers and bias included) over rows that see a
  // key: float32 holds a logit only to eps |logit|, so this bounds what a kernel can reach.
  double max_abs_row_max = 0;
};

// softmax(q k^T * scale + bias) v, one query row at a time, in float64. Query head h reads
// key/value head h / (Hq / Hkv). A row that sees no key gets output 0, weights 0, lse -inf.
inline OracleResult attention_oracle(const AttentionDims& d, const std::vector<double>& q,
                                     const std::vector<double>& k, const std::vector<double>& v,
                                     double scale, const Bias& bias = {},
                                     const OracleDropout& dropout = {}, const OracleModifiers& modifiers = {}) {
  const auto expect_size = [](const std::vector<double>& x, int64_t n, const char* what) {
    if (static_cast<int64_t>(x.size()) != n) {
      throw std::logic_error(std::string("oracle: ") + what + " has the wrong number of values");
    }
  };
  if (d.kv_heads <= 0 || d.q_heads % d.kv_heads != 0) {
    throw std::logic_error("oracle: query heads must be a multiple of key/value heads");
  }
  expect_size(q, d.batch * d.q_heads * d.q_len * d.qk_dim, "q");
  expect_size(k, d.batch * d.kv_heads * d.kv_len * d.qk_dim, "k");
  expect_size(v, d.batch * d.kv_heads * d.kv_len * d.v_dim, "v");

  OracleResult result;
  result.dims = d;
  result.output.assign(static_cast<size_t>(d.batch * d.q_heads * d.q_len * d.v_dim), 0.0);
  result.weights.assign(static_cast<size_t>(d.batch * d.q_heads * d.q_len * d.kv_len), 0.0);
  result.lse.assign(static_cast<size_t>(d.batch * d.q_heads * d.q_len), -kInf);

  const int64_t group = d.q_heads / d.kv_heads;
  std::vector<double> scores(static_cast<size_t>(d.kv_len));
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t h = 0; h < d.q_heads; ++h) {
      const int64_t kv_head = h / group;
      const int64_t kv_base = (b * d.kv_heads + kv_head) * d.kv_len;
      for (int64_t i = 0; i < d.q_len; ++i) {
        const int64_t row = (b * d.q_heads + h) * d.q_len + i;
        const double* q_row = &q[static_cast<size_t>(row * d.qk_dim)];

        // 1. Scaled, modified, masked scores and their maximum (the sink's logit included).
        const double sink = modifiers.sink(h);
        double row_max = sink;
        for (int64_t j = 0; j < d.kv_len; ++j) {
          const double* k_row = &k[static_cast<size_t>((kv_base + j) * d.qk_dim)];
          double dot = 0;
          for (int64_t c = 0; c < d.qk_dim; ++c) dot += q_row[c] * k_row[c];
          double score = modifiers.modify(dot * scale, b, h, i, j, d.q_len, d.kv_len);
          if (bias) {
            const double extra = bias(b, h, i, j);
            score = extra == -kInf ? -kInf : score + extra;
          }
          scores[static_cast<size_t>(j)] = score;
          row_max = std::max(row_max, score);
        }
        if (row_max == -kInf) continue;  // no visible key: zeros and lse = -inf
        result.max_abs_row_max = std::max(result.max_abs_row_max, std::abs(row_max));

        // 2. Softmax, shifted by the maximum; the sink joins the denominator only.
        double row_sum = sink == -kInf ? 0.0 : std::exp(sink - row_max);
        for (int64_t j = 0; j < d.kv_len; ++j) {
          const double e = std::exp(scores[static_cast<size_t>(j)] - row_max);
          scores[static_cast<size_t>(j)] = e;
          row_sum += e;
        }
        result.lse[static_cast<size_t>(row)] = row_max + std::log(row_sum);

        // 3. Weights (after dropout) times V.
        double* weights = &result.weights[static_cast<size_t>(row * d.kv_len)];
        double* out = &result.output[static_cast<size_t>(row * d.v_dim)];
        for (int64_t j = 0; j < d.kv_len; ++j) {
          double w = scores[static_cast<size_t>(j)] / row_sum;
          if (dropout.keeps) w = dropout.keeps(b, h, i, j) ? w / (1.0 - dropout.p) : 0.0;
          weights[j] = w;
          const double* v_row = &v[static_cast<size_t>((kv_base + j) * d.v_dim)];
          for (int64_t c = 0; c < d.v_dim; ++c) out[c] += w * v_row[c];
        }
      }
    }
  }
  return result;
}

// The sizes of q, k, v as the library reads them: rank 4 (B, H, N, D), rank 3 (B, N, D) and
// rank 2 (N, D) with the missing dims 1.
inline AttentionDims dims_of(const qkv::Tensor& q, const qkv::Tensor& k, const qkv::Tensor& v) {
  AttentionDims d;
  d.batch = q.dim() == 2 ? 1 : q.size(0);
  d.q_heads = q.dim() == 4 ? q.size(1) : 1;
  d.kv_heads = k.dim() == 4 ? k.size(1) : 1;
  d.q_len = q.size(-2);
  d.kv_len = k.size(-2);
  d.qk_dim = q.size(-1);
  d.v_dim = v.size(-1);
  return d;
}

// The oracle on library tensors (contiguous ones, see to_doubles).
inline OracleResult attention_oracle(const qkv::Tensor& q, const qkv::Tensor& k,
                                     const qkv::Tensor& v, double scale, const Bias& bias = {},
                                     const OracleDropout& dropout = {}, const OracleModifiers& modifiers = {}) {
  return attention_oracle(dims_of(q, k, v), to_doubles(q), to_doubles(k), to_doubles(v), scale,
                          bias, dropout, modifiers);
}

// ---------------------------------------------------------------------------------------------
// Comparing a float32 result with the float64 oracle.

// An element matches when |got - want| <= tolerance * max(1, |want|): relative for large
// values, absolute for small ones. An infinite `want` must be matched exactly; NaN never
// matches.
struct Comparison {
  bool ok = true;
  double max_rel_diff = 0;  // max over elements of |got - want| / max(1, |want|)
  int64_t mismatches = 0;
  std::string detail;  // the first mismatches, for the failure message
};

inline Comparison compare(const std::vector<float>& got, const std::vector<double>& want,
                          double tolerance = 1e-4) {
  Comparison c;
  std::ostringstream report;
  if (got.size() != want.size()) {
    c.ok = false;
    report << "got " << got.size() << " values, want " << want.size();
    c.detail = report.str();
    return c;
  }
  for (size_t n = 0; n < got.size(); ++n) {
    const double g = got[n];
    const double w = want[n];
    double diff;
    if (std::isnan(g) || std::isnan(w)) diff = kInf;
    else if (std::isinf(w) || std::isinf(g)) diff = g == w ? 0.0 : kInf;
    else diff = std::abs(g - w) / std::max(1.0, std::abs(w));
    c.max_rel_diff = std::max(c.max_rel_diff, diff);
    if (diff > tolerance) {
      if (c.mismatches < 5) report << "  [" << n << "] got " << g << ", want " << w << "\n";
      ++c.mismatches;
    }
  }
  c.ok = c.mismatches == 0;
  if (!c.ok) {
    c.detail = std::to_string(c.mismatches) + " of " + std::to_string(got.size()) +
               " elements differ by more than " + std::to_string(tolerance) +
               " (max relative difference " + std::to_string(c.max_rel_diff) + "):\n" +
               report.str();
  }
  return c;
}

inline Comparison compare(const qkv::Tensor& got, const std::vector<double>& want,
                          double tolerance = 1e-4) {
  if (!got.defined()) return {false, kInf, -1, "the tensor is undefined"};
  return compare(got.to_vector(), want, tolerance);
}

// The largest |a - b| / max(1, |b|) between two float tensors of the same shape (inf when the
// shapes differ or a NaN appears).
inline double max_rel_diff(const qkv::Tensor& a, const qkv::Tensor& b) {
  if (a.shape() != b.shape()) return kInf;
  const std::vector<float> x = a.to_vector();
  const std::vector<float> y = b.to_vector();
  return compare(x, std::vector<double>(y.begin(), y.end()), kInf).max_rel_diff;
}

}  // namespace qkv_test
