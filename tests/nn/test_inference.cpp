// Inference: the KV cache (append in place, lengths, reset, capacity, ring buffer), the cached
// MultiHeadAttention forward against the full causal forward (prefill in chunks of 1, 3 and 17
// tokens; grouped-query heads; rotary positions; bf16 / f16 caches; ragged prompt lengths; a
// ring buffer against window attention), and RotaryEmbedding against a float64 evaluation of
// its formula in both conventions.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "harness/oracle.hpp"
#include "qkv/nn.hpp"

namespace {

using qkv::DType;
using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;
using qkv::nn::KVCache;
using qkv::nn::MultiHeadAttention;
using qkv::nn::MultiHeadAttentionOptions;
using qkv::nn::RotaryEmbedding;
using qkv::nn::RotaryEmbeddingOptions;

// Largest |a - b| / max(1, |b|) over the elements.
double max_error(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  const std::vector<float> x = a.to_vector(), y = b.to_vector();
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) return INFINITY;
    worst = std::max(worst, std::abs(double(x[i]) - y[i]) / std::max(1.0, std::abs(double(y[i]))));
  }
  return worst;
}

MultiHeadAttention make_layer(int64_t kv_heads, bool rotary, bool interleaved = false, bool sinks = false) {
  MultiHeadAttentionOptions o;
  o.num_kv_heads = kv_heads;
  o.causal = true;
  o.seed = 7;
  o.sinks = sinks;
  if (rotary) o.rotary = RotaryEmbeddingOptions{.base = 10000, .interleaved = interleaved};
  MultiHeadAttention m(48, 6, o);
  if (sinks) m.sinks = Tensor::from({0.5f, -1.0f, 2.0f, 0.0f, 1.0f, -0.5f}, Shape{6});
  m.eval();
  return m;
}

// The sequence fed through the cache `chunk` tokens at a time, outputs concatenated.
Tensor incremental(const MultiHeadAttention& m, const Tensor& x, KVCache& cache, int64_t chunk) {
  const int64_t len = x.size(1);
  std::vector<float> out;
  for (int64_t start = 0; start < len; start += chunk) {
    const int64_t n = std::min(chunk, len - start);
    const std::vector<float> part = m.forward(x.narrow(1, start, n), cache).output.to_vector();
    // (B, n, E) pieces into (B, len, E)
    const int64_t batch = x.size(0), e = m.embed_dim();
    if (out.empty()) out.assign(static_cast<size_t>(batch * len * e), NAN);
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t t = 0; t < n; ++t)
        for (int64_t c = 0; c < e; ++c)
          out[static_cast<size_t>((b * len + start + t) * e + c)] = part[static_cast<size_t>((b * n + t) * e + c)];
  }
  return Tensor::from(out, x.shape().dims().size() == 3 ? Shape{x.size(0), len, m.embed_dim()} : x.shape());
}

TEST(KVCache, AppendsInPlaceAndResets) {
  qkv_test::Random rng;
  KVCache cache(2, 3, 10, 8, DType::BF16);
  const void* storage = cache.key_storage().raw_data();
  const Tensor k = rng.randn(Shape{2, 3, 4, 8}), v = rng.randn(Shape{2, 3, 4, 8});
  cache.append(k, v);
  cache.append(k.narrow(2, 0, 3), v.narrow(2, 0, 3), {3, 1});
  EXPECT_EQ(cache.lengths(), (std::vector<int64_t>{7, 5}));
  EXPECT_EQ(cache.length(), 7);
  EXPECT_EQ(cache.key_storage().raw_data(), storage);  // never reallocated
  // Slots hold the bf16 rounding of what was appended, at the right positions.
  const Tensor keys = cache.keys(7).to(DType::F32);
  EXPECT_EQ(keys.at({1, 2, 4, 5}), k.to(DType::BF16).to(DType::F32).at({1, 2, 0, 5}));
  EXPECT_EQ(keys.at({0, 1, 6, 0}), k.to(DType::BF16).to(DType::F32).at({0, 1, 2, 0}));
  // Over capacity: an error naming the sizes, and the cache unchanged.
  try {
    cache.append(k, v);
    ADD_FAILURE() << "no error";
  } catch (const qkv::Error& e) {
    EXPECT_NE(std::string(e.what()).find("exceed the capacity 10"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cache.lengths(), (std::vector<int64_t>{7, 5}));
  EXPECT_THROW(cache.append(k, v.narrow(2, 0, 2)), qkv::Error);
  EXPECT_THROW(cache.append(rng.randn(Shape{2, 2, 1, 8}), rng.randn(Shape{2, 2, 1, 8})), qkv::Error);
  cache.reset();
  EXPECT_EQ(cache.length(), 0);
  EXPECT_EQ(cache.key_storage().raw_data(), storage);
  EXPECT_THROW(KVCache(1, 1, 8, 4, DType::F32, 4), qkv::Error);  // a ring holds exactly its window
}

// The cached forward returns what the full causal forward returns, whatever the chunks.
TEST(KVCache, IncrementalEqualsFullCausalForward) {
  qkv_test::Random rng;
  SCOPED_TRACE(rng.note());
  const Tensor x = rng.randn(Shape{2, 40, 48});
  for (int64_t kv_heads : {6, 2}) {
    for (bool rotary : {false, true}) {
      for (bool sinks : {false, true}) {
        const MultiHeadAttention m = make_layer(kv_heads, rotary, false, sinks);
        const Tensor full = m.forward(x).output;
        for (int64_t chunk : {1, 3, 17}) {
          SCOPED_TRACE("kv_heads " + std::to_string(kv_heads) + " rotary " + std::to_string(rotary) + " sinks " +
                       std::to_string(sinks) + " chunk " + std::to_string(chunk));
          KVCache cache = m.make_cache(2, 50);
          EXPECT_LT(max_error(incremental(m, x, cache, chunk), full), 2e-5);
          EXPECT_EQ(cache.length(), 40);
        }
      }
    }
  }
}

// A 16-bit cache: the same, to the precision of the rounded keys and values.
TEST(KVCache, HalfPrecisionCaches) {
  qkv_test::Random rng;
  SCOPED_TRACE(rng.note());
  const Tensor x = rng.randn(Shape{2, 30, 48});
  const MultiHeadAttention m = make_layer(2, true);
  const Tensor full = m.forward(x).output;
  for (DType dtype : {DType::BF16, DType::F16}) {
    for (int64_t chunk : {1, 17}) {
      KVCache cache = m.make_cache(2, 30, dtype);
      const double error = max_error(incremental(m, x, cache, chunk), full);
      EXPECT_LT(error, dtype == DType::BF16 ? 2e-2 : 3e-3) << qkv::to_string(dtype) << " chunk " << chunk;
    }
  }
}

// Prompts of different lengths, right-padded in one batch, then decode steps: each element's
// outputs are those of its own sequence run alone.
TEST(KVCache, RaggedPromptLengths) {
  qkv_test::Random rng;
  SCOPED_TRACE(rng.note());
  for (bool rotary : {false, true}) {
    const MultiHeadAttention m = make_layer(3, rotary);
    const std::vector<int64_t> prompt = {5, 9, 1};
    const int64_t steps = 4, batch = 3, e = 48;
    std::vector<Tensor> sequences;  // each element's real tokens, (1, prompt + steps, E)
    for (int64_t b = 0; b < batch; ++b) sequences.push_back(rng.randn(Shape{1, prompt[b] + steps, e}));
    // The padded prompt batch: element b's first prompt[b] tokens, then garbage.
    Tensor padded = rng.randn(Shape{batch, 9, e});
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t t = 0; t < prompt[b]; ++t)
        for (int64_t c = 0; c < e; ++c) padded.at({b, t, c}) = sequences[b].at({0, t, c});
    KVCache cache = m.make_cache(batch, 16, DType::F32);
    const Tensor prefill = m.forward(padded, cache, prompt).output;
    EXPECT_EQ(cache.lengths(), prompt);
    std::vector<Tensor> step_outputs;
    for (int64_t s = 0; s < steps; ++s) {
      Tensor token = Tensor::empty(Shape{batch, 1, e});
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t c = 0; c < e; ++c) token.at({b, 0, c}) = sequences[b].at({0, prompt[b] + s, c});
      step_outputs.push_back(m.forward(token, cache).output);
    }
    for (int64_t b = 0; b < batch; ++b) {
      SCOPED_TRACE("element " + std::to_string(b) + " rotary " + std::to_string(rotary));
      const Tensor alone = m.forward(sequences[b]).output;  // (1, prompt + steps, E)
      EXPECT_LT(max_error(prefill.narrow(0, b, 1).narrow(1, 0, prompt[b]), alone.narrow(1, 0, prompt[b])), 2e-5);
      for (int64_t s = 0; s < steps; ++s)
        EXPECT_LT(max_error(step_outputs[s].narrow(0, b, 1), alone.narrow(1, prompt[b] + s, 1)), 2e-5) << "step " << s;
    }
  }
}

// A ring buffer of W slots gives the full forward under a sliding window of W positions, and
// never grows.
TEST(KVCache, RingBufferEqualsWindowAttention) {
  qkv_test::Random rng;
  SCOPED_TRACE(rng.note());
  const Tensor x = rng.randn(Shape{2, 45, 48});
  for (bool rotary : {false, true}) {
    const MultiHeadAttention m = make_layer(2, rotary);
    for (int64_t window : {1, 4, 16}) {
      const Tensor full = m.forward(x, Mask::window(window - 1)).output;
      for (int64_t chunk : {1, 3, 17}) {
        SCOPED_TRACE("window " + std::to_string(window) + " chunk " + std::to_string(chunk) + " rotary " +
                     std::to_string(rotary));
        KVCache cache = m.make_cache(2, window, DType::F32, window);
        const void* storage = cache.key_storage().raw_data();
        EXPECT_LT(max_error(incremental(m, x, cache, chunk), full), 2e-5);
        EXPECT_EQ(cache.length(), 45);
        EXPECT_EQ(cache.capacity(), window);
        EXPECT_EQ(cache.key_storage().raw_data(), storage);
      }
    }
  }
}

TEST(KVCache, Errors) {
  const MultiHeadAttention m = make_layer(2, false);
  KVCache wrong(2, 3, 8, 8);
  EXPECT_THROW(m.forward(Tensor::zeros(Shape{2, 1, 48}), wrong), qkv::Error);
  KVCache cache = m.make_cache(1, 4);
  EXPECT_THROW(m.forward(Tensor::zeros(Shape{1, 5, 48}), cache), qkv::Error);  // over capacity
  EXPECT_EQ(cache.length(), 0);
  EXPECT_THROW(m.forward(Tensor::zeros(Shape{1, 2, 40}), cache), qkv::Error);
}

// ---- RotaryEmbedding

// The formula in float64: pair (a, b) of the convention rotated by position * base^(-2i/D).
std::vector<double> rotary_oracle(const Tensor& x, int64_t offset, double base, bool interleaved) {
  const int64_t batch = x.size(0), heads = x.size(1), len = x.size(2), d = x.size(3), half = d / 2;
  const std::vector<double> in = qkv_test::to_doubles(x.contiguous());
  std::vector<double> out(in.size());
  for (int64_t r = 0; r < batch * heads * len; ++r) {
    const int64_t n = r % len;
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(offset + n) * std::pow(base, -2.0 * i / d);
      const int64_t a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
      const double xa = in[r * d + a], xb = in[r * d + b];
      out[r * d + a] = xa * std::cos(angle) - xb * std::sin(angle);
      out[r * d + b] = xb * std::cos(angle) + xa * std::sin(angle);
    }
  }
  return out;
}

TEST(Rotary, MatchesTheFormulaInBothConventions) {
  qkv_test::Random rng;
  SCOPED_TRACE(rng.note());
  const Tensor x = rng.randn(Shape{2, 3, 11, 16});
  for (bool interleaved : {false, true}) {
    for (double base : {10000.0, 500000.0}) {
      for (int64_t offset : {0, 7, 4000}) {
        const RotaryEmbedding rope(16, {.base = base, .interleaved = interleaved});
        const auto c = qkv_test::compare(rope.apply(x, offset), rotary_oracle(x, offset, base, interleaved), 1e-5);
        EXPECT_TRUE(c.ok) << "interleaved " << interleaved << " base " << base << " offset " << offset << "\n" << c.detail;
      }
    }
  }
  // Half-split and interleaved differ (for D > 2), and position 0 is the identity.
  const RotaryEmbedding half(16), pairs(16, {.interleaved = true});
  EXPECT_GT(max_error(half.apply(x, 3), pairs.apply(x, 3)), 1e-3);
  EXPECT_EQ(half.apply(x.narrow(2, 0, 1), 0).to_vector(), x.narrow(2, 0, 1).to_vector());
}

// q.k after rotation depends only on the distance of their positions; the inverse undoes it.
TEST(Rotary, RelativePositionsAndInverse) {
  qkv_test::Random rng;
  const RotaryEmbedding rope(8);
  const Tensor q = rng.randn(Shape{1, 1, 1, 8}), k = rng.randn(Shape{1, 1, 1, 8});
  auto dot = [&](int64_t pq, int64_t pk) {
    const std::vector<float> a = rope.apply(q, pq).to_vector(), b = rope.apply(k, pk).to_vector();
    double s = 0;
    for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) * b[i];
    return s;
  };
  EXPECT_NEAR(dot(10, 3), dot(107, 100), 1e-4);
  EXPECT_NEAR(dot(0, 5), dot(50, 55), 1e-4);
  const Tensor y = rope.apply(q, 37);
  rope.apply_inplace(y, {37}, /*inverse=*/true);
  EXPECT_LT(max_error(y, q), 1e-6);
  EXPECT_THROW(RotaryEmbedding(7), qkv::Error);
  EXPECT_THROW(rope.apply(rng.randn(Shape{1, 1, 2, 6})), qkv::Error);
}

// A head_dim whose table cannot fit is refused before the table grows (it used to grow for a
// minute before std::bad_alloc), naming the size; one that fits under the limit still works.
TEST(Rotary, RefusesATableOverTheMemoryLimit) {
  const int64_t huge = int64_t{1} << 40;
  try {
    const RotaryEmbedding rope(huge);
    ADD_FAILURE() << "RotaryEmbedding(2^40) was built";
  } catch (const qkv::Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("RotaryEmbedding: head_dim 1099511627776 need 4398046511104 bytes"), std::string::npos)
        << message;
  }
  EXPECT_THROW(RotaryEmbedding(std::numeric_limits<int64_t>::max() - 1), qkv::Error);
  EXPECT_EQ(RotaryEmbedding(1 << 12).head_dim(), 1 << 12);
}

// A linear-attention layer has no softmax K/V to cache: forward(x, cache) says so.
TEST(KVCache, LinearAttentionLayerRefusesACache) {
  MultiHeadAttention m(16, 2, MultiHeadAttentionOptions{.attention = qkv::nn::AttentionKind::Linear});
  KVCache cache = m.make_cache(1, 8);
  const Tensor x = Tensor::randn({1, 3, 16}, 7);
  EXPECT_THROW((void)m.forward(x, cache), qkv::Error);
}

}  // namespace
