// nn::RelativePositionBias (T5's learned bias per head and distance bucket) and
// MultiHeadAttentionOptions::relative_position_bias: the buckets against the T5 formula written
// again in float64 and its properties; the bias table's gradient, reduced from the fused
// backward's dbias, against central finite differences of the module's loss (bidirectional and
// causal, batched); a student learning a teacher's bias through it; the bias of queries after
// cached tokens and a layer over a KV cache against its full forward; the refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "harness/oracle.hpp"
#include "qkv/nn.hpp"

namespace {

using qkv::Shape;
using qkv::Tensor;
using qkv::nn::MultiHeadAttention;
using qkv::nn::MultiHeadAttentionOptions;
using qkv::nn::RelativePositionBias;
using qkv::nn::RelativePositionBiasOptions;

// T5's bucketing (Raffel et al., transformers' _relative_position_bucket) in float64.
int64_t t5_bucket(int64_t relative, int64_t num_buckets, int64_t max_distance, bool bidirectional) {
  int64_t result = 0, n = relative;
  if (bidirectional) {
    num_buckets /= 2;
    if (n > 0) result += num_buckets;
    n = std::abs(n);
  } else {
    n = -std::min<int64_t>(n, 0);
  }
  const int64_t max_exact = num_buckets / 2;
  if (n < max_exact) return result + n;
  const double large = max_exact + std::log(static_cast<double>(n) / max_exact) /
                                       std::log(static_cast<double>(max_distance) / max_exact) *
                                       (num_buckets - max_exact);
  return result + std::min<int64_t>(static_cast<int64_t>(large), num_buckets - 1);
}

TEST(RelativePositionBias, BucketsAreT5s) {
  for (const bool bidirectional : {true, false})
    for (const auto& [buckets, distance] : {std::pair<int64_t, int64_t>{32, 128}, {8, 20}, {16, 16}}) {
      const RelativePositionBiasOptions o{buckets, distance, bidirectional};
      for (int64_t r = -300; r <= 300; ++r) {
        const int64_t got = RelativePositionBias::bucket(r, o);
        ASSERT_EQ(got, t5_bucket(r, buckets, distance, bidirectional)) << "relative position " << r;
        ASSERT_GE(got, 0);
        ASSERT_LT(got, buckets);
        if (r < 0) ASSERT_GE(got, RelativePositionBias::bucket(r + 1, o)) << "farther back, a nearer bucket: " << r;
      }
      EXPECT_EQ(RelativePositionBias::bucket(-1000, o), (bidirectional ? buckets / 2 : buckets) - 1);
      if (!bidirectional) EXPECT_EQ(RelativePositionBias::bucket(5, o), 0) << "keys after the query share bucket 0";
    }
}

double loss_of(const MultiHeadAttention& m, const Tensor& x, const std::vector<float>& g) {
  const std::vector<float> out = m.forward(x).output.to_vector();
  double total = 0;
  for (size_t n = 0; n < out.size(); ++n) total += static_cast<double>(out[n]) * g[n];
  return total;
}

TEST(RelativePositionBias, GradientMatchesFiniteDifferences) {
  qkv_test::Random rng;
  SCOPED_TRACE(rng.note());
  for (const bool causal : {false, true}) {
    MultiHeadAttentionOptions o;
    o.causal = causal;
    o.relative_position_bias = RelativePositionBiasOptions{8, 9, !causal};
    o.seed = 7;
    MultiHeadAttention m(8, 2, o);
    RelativePositionBias& bias = *m.relative_position_bias;
    const std::vector<float> start = rng.randn(bias.weight.shape()).to_vector();
    std::copy(start.begin(), start.end(), bias.weight.data());
    const Tensor x = rng.randn(Shape{2, 13, 8});
    const Tensor g = rng.randn(Shape{2, 13, 8});
    m.zero_grad();
    m.forward(x);
    m.backward(g);
    const std::vector<float> analytic = bias.weight_grad.to_vector();
    const std::vector<float> g_values = g.to_vector();
    m.eval();
    const float h = 1e-2f;
    double largest = 1e-3;
    for (float a : analytic) largest = std::max(largest, static_cast<double>(std::fabs(a)));
    for (int64_t e = 0; e < bias.weight.numel(); ++e) {
      float& w = bias.weight.data()[e];
      const float saved = w;
      w = saved + h;
      const double up = loss_of(m, x, g_values);
      w = saved - h;
      const double down = loss_of(m, x, g_values);
      w = saved;
      const double numeric = (up - down) / (2.0 * h);
      EXPECT_NEAR(analytic[static_cast<size_t>(e)], numeric, 2e-3 * largest)
          << (causal ? "causal" : "bidirectional") << " bucket " << e / 2 << " head " << e % 2;
    }
    m.train();
  }
}

// bias(len, keys, offset) is the rows offset .. offset + len of bias(offset + len, keys): the
// queries after `offset` cached tokens see the bias the full sequence gives them.
TEST(RelativePositionBias, QueryOffsetGivesTheFullSequencesRows) {
  qkv_test::Random rng;
  SCOPED_TRACE(rng.note());
  for (const bool bidirectional : {false, true}) {
    RelativePositionBias bias(3, RelativePositionBiasOptions{8, 12, bidirectional});
    const std::vector<float> table = rng.randn(bias.weight.shape()).to_vector();
    std::copy(table.begin(), table.end(), bias.weight.data());
    const int64_t offset = 23, len = 5, keys = 31;  // distances past max_distance included
    const Tensor full = bias.bias(offset + len, keys), moved = bias.bias(len, keys, offset);
    ASSERT_EQ(moved.shape(), Shape({1, 3, len, keys}));
    for (int64_t h = 0; h < 3; ++h)
      for (int64_t i = 0; i < len; ++i)
        for (int64_t j = 0; j < keys; ++j)
          ASSERT_EQ(moved.at({0, h, i, j}), full.at({0, h, offset + i, j}))
              << "head " << h << " query " << i << " key " << j << (bidirectional ? " bidirectional" : " causal");
  }
}

// A layer with the bias over a KV cache: fed in chunks (prefill and decode steps), its outputs
// are the full forward's; ragged prompts in one batch give each element its own sequence's.
TEST(RelativePositionBias, CachedForwardEqualsTheFullForward) {
  qkv_test::Random rng;
  SCOPED_TRACE(rng.note());
  MultiHeadAttentionOptions o;
  o.causal = true;
  o.num_kv_heads = 2;
  o.relative_position_bias = RelativePositionBiasOptions{8, 12, false};
  o.seed = 5;
  MultiHeadAttention m(24, 4, o);
  const std::vector<float> table = rng.randn(m.relative_position_bias->weight.shape(), 2.0).to_vector();
  std::copy(table.begin(), table.end(), m.relative_position_bias->weight.data());
  m.eval();
  const Tensor x = rng.randn(Shape{2, 29, 24});
  const Tensor full = m.forward(x).output;
  for (const int64_t chunk : {1, 4, 29}) {
    qkv::nn::KVCache cache = m.make_cache(2, 29);
    for (int64_t start = 0; start < 29; start += chunk) {
      const int64_t len = std::min(chunk, 29 - start);
      const Tensor got = m.forward(x.narrow(1, start, len), cache).output;
      EXPECT_LT(qkv_test::max_rel_diff(got, full.narrow(1, start, len)), 2e-5) << "chunk " << chunk << " at " << start;
    }
  }
  // Ragged: element 0's prompt is 6 tokens, element 1's 11 (the rest padding), then 3 steps each.
  const std::vector<int64_t> prompt = {6, 11};
  qkv::nn::KVCache cache = m.make_cache(2, 16);
  const Tensor prefill = m.forward(x.narrow(1, 0, 11), cache, prompt).output;
  for (int64_t b = 0; b < 2; ++b) {
    const Tensor alone = m.forward(x.narrow(0, b, 1).narrow(1, 0, prompt[b] + 3)).output;
    EXPECT_LT(qkv_test::max_rel_diff(prefill.narrow(0, b, 1).narrow(1, 0, prompt[b]), alone.narrow(1, 0, prompt[b])),
              2e-5) << "element " << b;
  }
  std::vector<Tensor> steps;
  for (int64_t s = 0; s < 3; ++s) {
    Tensor token = Tensor::empty(Shape{2, 1, 24});
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t c = 0; c < 24; ++c) token.at({b, 0, c}) = x.at({b, prompt[b] + s, c});
    steps.push_back(m.forward(token, cache).output);
  }
  for (int64_t b = 0; b < 2; ++b) {
    const Tensor alone = m.forward(x.narrow(0, b, 1).narrow(1, 0, prompt[b] + 3)).output;
    for (int64_t s = 0; s < 3; ++s)
      EXPECT_LT(qkv_test::max_rel_diff(steps[s].narrow(0, b, 1), alone.narrow(1, prompt[b] + s, 1)), 2e-5)
          << "element " << b << " step " << s;
  }
  // The bias matters: a zero table gives other outputs.
  MultiHeadAttention zero(24, 4, o);
  zero.eval();
  EXPECT_GT(qkv_test::max_rel_diff(zero.forward(x).output, full), 1e-3);
}

// A teacher with a random bias table; a student with the same projections and a zero table
// learns the teacher's outputs by SGD on the table alone.
TEST(RelativePositionBias, StudentLearnsTheTeachersBias) {
  qkv_test::Random rng;
  SCOPED_TRACE(rng.note());
  MultiHeadAttentionOptions o;
  o.causal = true;
  o.relative_position_bias = RelativePositionBiasOptions{16, 32, false};
  o.seed = 11;
  MultiHeadAttention teacher(16, 4, o), student(16, 4, o);
  const std::vector<float> table = rng.randn(teacher.relative_position_bias->weight.shape(), 2.0).to_vector();
  std::copy(table.begin(), table.end(), teacher.relative_position_bias->weight.data());
  teacher.eval();
  auto step = [&](bool update) {
    const Tensor x = rng.randn(Shape{4, 24, 16});
    const std::vector<float> want = teacher.forward(x).output.to_vector();
    student.zero_grad();
    const std::vector<float> got = student.forward(x).output.to_vector();
    std::vector<float> grad(got.size());
    double loss = 0;
    for (size_t n = 0; n < got.size(); ++n) {
      loss += (got[n] - want[n]) * (got[n] - want[n]) / static_cast<double>(got.size());
      grad[n] = 2.0f * (got[n] - want[n]) / static_cast<float>(got.size());
    }
    student.backward(Tensor::from(std::move(grad), Shape{4, 24, 16}));
    if (update) {
      RelativePositionBias& b = *student.relative_position_bias;
      for (int64_t e = 0; e < b.weight.numel(); ++e) b.weight.data()[e] -= 200.0f * b.weight_grad.data()[e];
    }
    return loss;
  };
  const double first = step(false);
  for (int n = 0; n < 150; ++n) step(true);
  double last = 0;
  for (int n = 0; n < 5; ++n) last += step(false) / 5;
  EXPECT_LT(last, 0.2 * first) << "loss " << first << " -> " << last;
}

TEST(RelativePositionBias, Refusals) {
  MultiHeadAttentionOptions o;
  o.relative_position_bias = RelativePositionBiasOptions{2, 10, true};
  EXPECT_THROW(MultiHeadAttention(8, 2, o), qkv::Error) << "one bucket per direction";
  o.relative_position_bias = RelativePositionBiasOptions{8, 10, true};
  o.attention = qkv::nn::AttentionKind::Linear;
  EXPECT_THROW(MultiHeadAttention(8, 2, o), qkv::Error) << "linear attention";
  o.attention = qkv::nn::AttentionKind::Softmax;
  MultiHeadAttention m(8, 2, o);
  qkv_test::Random rng;
  const Tensor x = rng.randn(Shape{1, 5, 8});
  EXPECT_THROW(m.forward(x, qkv::Mask::additive(rng.randn(Shape{5, 5}))), qkv::Error) << "a second additive term";
  qkv::nn::KVCache ring = m.make_cache(1, 4, qkv::DType::F32, /*window=*/4);
  try {
    m.forward(x, ring);
    ADD_FAILURE() << "a ring-buffer cache";
  } catch (const qkv::Error& e) {
    EXPECT_NE(std::string(e.what()).find("not with a ring-buffer cache"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)m.relative_position_bias->bias(2, 3, -1), qkv::Error) << "a negative query offset";
  bool named = false;
  for (const auto& p : m.parameters()) named = named || p.name == "relative_position_bias.weight";
  EXPECT_TRUE(named);
}

}  // namespace
