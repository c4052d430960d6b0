// qkv::nn: Linear, MultiHeadAttention, SinusoidalPositionalEncoding and Embedding, checked
// against float64 computations and against the manual composition through the functional core.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "harness/oracle.hpp"

namespace {

using ::testing::HasSubstr;
using qkv::AttentionOptions;
using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;
using qkv::nn::Linear;
using qkv::nn::MultiHeadAttention;
using qkv::nn::MultiHeadAttentionOptions;
using qkv::nn::Weights;
using qkv_test::Bias;
using qkv_test::Random;

// ---------------------------------------------------------------------------------------------
// float64 building blocks

// y = x W^T + b for x (rows, in), W (out, in), b (out) or empty.
std::vector<double> linear64(const std::vector<double>& x, int64_t rows, int64_t in, const std::vector<double>& w,
                             const std::vector<double>& b, int64_t out) {
  std::vector<double> y(static_cast<size_t>(rows * out));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double sum = b.empty() ? 0.0 : b[static_cast<size_t>(o)];
      for (int64_t c = 0; c < in; ++c) sum += x[static_cast<size_t>(r * in + c)] * w[static_cast<size_t>(o * in + c)];
      y[static_cast<size_t>(r * out + o)] = sum;
    }
  return y;
}

// Raw parameters of a multi-head attention, PyTorch layout; empty biases mean none.
struct MhaParams {
  std::vector<double> wq, bq, wk, bk, wv, bv, wo, bo;
};

MhaParams params_of(const MultiHeadAttention& mha) {
  const auto bias = [](const Linear& l) { return l.bias.defined() ? qkv_test::to_doubles(l.bias) : std::vector<double>{}; };
  return {qkv_test::to_doubles(mha.q_proj.weight), bias(mha.q_proj), qkv_test::to_doubles(mha.k_proj.weight),
          bias(mha.k_proj), qkv_test::to_doubles(mha.v_proj.weight), bias(mha.v_proj),
          qkv_test::to_doubles(mha.out_proj.weight), bias(mha.out_proj)};
}

struct MhaOracle {
  std::vector<double> output;   // (B, Nq, E)
  std::vector<double> weights;  // (B, H, Nq, Nk)
};

// Multi-head attention in float64: project, split heads (feature h * hd + d is head h, dim d),
// attend with the oracle, concatenate, project.
MhaOracle mha_oracle(const MhaParams& p, int64_t E, int64_t H, int64_t Hkv, const Tensor& query, const Tensor& key,
                     const Tensor& value, const Bias& bias) {
  const int64_t B = query.size(0), Nq = query.size(1), Nk = key.size(1), kdim = key.size(2), vdim = value.size(2);
  const int64_t hd = E / H, kv_features = Hkv * hd;
  const std::vector<double> Q = linear64(qkv_test::to_doubles(query), B * Nq, E, p.wq, p.bq, E);
  const std::vector<double> K = linear64(qkv_test::to_doubles(key), B * Nk, kdim, p.wk, p.bk, kv_features);
  const std::vector<double> V = linear64(qkv_test::to_doubles(value), B * Nk, vdim, p.wv, p.bv, kv_features);
  const auto split = [&](const std::vector<double>& x, int64_t N, int64_t heads) {
    std::vector<double> y(x.size());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t d = 0; d < hd; ++d)
            y[static_cast<size_t>(((b * heads + h) * N + n) * hd + d)] = x[static_cast<size_t>((b * N + n) * heads * hd + h * hd + d)];
    return y;
  };
  qkv_test::AttentionDims dims{B, H, Hkv, Nq, Nk, hd, hd};
  const qkv_test::OracleResult attn = qkv_test::attention_oracle(dims, split(Q, Nq, H), split(K, Nk, Hkv),
                                                                 split(V, Nk, Hkv), 1.0 / std::sqrt(double(hd)), bias);
  std::vector<double> merged(static_cast<size_t>(B * Nq * E));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t n = 0; n < Nq; ++n)
        for (int64_t d = 0; d < hd; ++d)
          merged[static_cast<size_t>((b * Nq + n) * E + h * hd + d)] = attn.output[static_cast<size_t>(((b * H + h) * Nq + n) * hd + d)];
  return {linear64(merged, B * Nq, E, p.wo, p.bo, E), attn.weights};
}

// Every parameter of the module overwritten with N(0, 0.3^2) values, biases included, so that
// zero-initialised biases cannot hide a mistake.
void randomise(const std::vector<qkv::nn::NamedTensor>& parameters, Random& rng) {
  for (const qkv::nn::NamedTensor& p : parameters) {
    float* data = p.tensor.data();
    for (int64_t n = 0; n < p.tensor.numel(); ++n) data[n] = static_cast<float>(0.3 * rng.normal());
  }
}

void expect_close(const Tensor& got, const std::vector<double>& want, double tolerance, const char* what) {
  const qkv_test::Comparison c = qkv_test::compare(got, want, tolerance);
  EXPECT_TRUE(c.ok) << what << ": " << c.detail;
}

// ---------------------------------------------------------------------------------------------
// Linear

// forward is x W^T + b in float64 within 1e-5, for 2-D and 3-D inputs, with and without bias.
TEST(Linear, MatchesFloat64) {
  Random rng;
  SCOPED_TRACE(rng.note());
  for (bool bias : {true, false}) {
    Linear linear(7, 13, bias, rng.next_u64());
    EXPECT_EQ(linear.in_features(), 7);
    EXPECT_EQ(linear.out_features(), 13);
    EXPECT_EQ(linear.weight.shape(), (Shape{13, 7}));
    EXPECT_EQ(linear.bias.defined(), bias);
    if (bias) randomise(linear.parameters(), rng);  // the bias starts random anyway; be sure
    const std::vector<double> w = qkv_test::to_doubles(linear.weight);
    const std::vector<double> b = bias ? qkv_test::to_doubles(linear.bias) : std::vector<double>{};
    for (const Shape& shape : {Shape{5, 7}, Shape{2, 3, 7}, Shape{1, 7}}) {
      const Tensor x = rng.randn(shape);
      const Tensor y = linear.forward(x);
      std::vector<int64_t> out_dims = shape.dims();
      out_dims.back() = 13;
      EXPECT_EQ(y.shape(), Shape(out_dims));
      expect_close(y, linear64(qkv_test::to_doubles(x), x.numel() / 7, 7, w, b, 13), 1e-5, "linear");
    }
  }
}

// Both GEMM paths of Linear::forward (the Small kernel for few rows, a library sgemm beyond) against
// float64, on shapes that leave remainders everywhere: rows not a multiple of the register tile,
// in_features not a multiple of any vector width, out_features not a multiple of the output tile
// or of a thread's block; and one large enough to run on threads.
TEST(Linear, SmallAndLargeRowCountsMatchFloat64) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const std::vector<std::array<int64_t, 3>> shapes = {  // rows, in, out
      {1, 1, 1}, {4, 17, 5}, {7, 33, 50}, {13, 100, 99}, {20, 512, 1537}, {64, 31, 7}, {65, 31, 7}, {130, 70, 49}};
  for (const auto& [rows, in, out] : shapes) {
    for (bool bias : {true, false}) {
      SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(in) + " -> " + std::to_string(out) +
                   (bias ? " with bias" : " without bias"));
      Linear linear(in, out, bias, rng.next_u64());
      randomise(linear.parameters(), rng);
      const Tensor x = rng.randn({rows, in});
      const std::vector<double> b = bias ? qkv_test::to_doubles(linear.bias) : std::vector<double>{};
      expect_close(linear.forward(x), linear64(qkv_test::to_doubles(x), rows, in, qkv_test::to_doubles(linear.weight), b, out),
                   2e-5 * std::sqrt(static_cast<double>(in)), "linear");
    }
  }
}

// Initialised as torch: W and b uniform within 1/sqrt(in), spread over that range; seeded.
TEST(Linear, DefaultInitRange) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const uint64_t seed = rng.next_u64();
  const Linear linear(64, 300, true, seed);
  const double bound = 1.0 / std::sqrt(64.0);
  for (const Tensor& t : {linear.weight, linear.bias}) {
    float largest = 0;
    for (float x : t.to_vector()) {
      EXPECT_LE(std::abs(x), bound);
      largest = std::max(largest, std::abs(x));
    }
    EXPECT_GT(largest, 0.9 * bound);  // uniform over the whole range, not squeezed near 0
  }
  EXPECT_EQ(Linear(64, 300, true, seed).weight.to_vector(), linear.weight.to_vector());
  EXPECT_NE(Linear(64, 300, true, seed + 1).weight.to_vector(), linear.weight.to_vector());
}

// parameters() names weight and bias under the prefix and shares the module's storage.
TEST(Linear, Parameters) {
  const Linear linear(4, 3);
  const std::vector<qkv::nn::NamedTensor> params = linear.parameters("fc.");
  ASSERT_EQ(params.size(), 2u);
  EXPECT_EQ(params[0].name, "fc.weight");
  EXPECT_EQ(params[1].name, "fc.bias");
  EXPECT_TRUE(params[0].tensor.shares_storage_with(linear.weight));
  EXPECT_TRUE(params[1].tensor.shares_storage_with(linear.bias));
  const Linear no_bias(4, 3, false);
  ASSERT_EQ(no_bias.parameters().size(), 1u);
  EXPECT_EQ(no_bias.parameters()[0].name, "weight");
}

// ---------------------------------------------------------------------------------------------
// MultiHeadAttention against the manual composition and the float64 oracle

struct MhaCase {
  std::string name;
  int64_t embed_dim, num_heads, num_kv_heads, kdim, vdim;
  int64_t batch, q_len, kv_len;
  bool cross;   // separate key/value inputs
  bool causal;  // MultiHeadAttentionOptions::causal
  bool masked;  // a key_lengths & keep mask argument
};

std::vector<MhaCase> mha_cases() {
  return {
      {"self", 12, 3, 0, 0, 0, 2, 7, 7, false, false, false},
      {"self_masked", 12, 3, 0, 0, 0, 2, 7, 7, false, false, true},
      {"self_causal", 16, 4, 0, 0, 0, 3, 9, 9, false, true, false},
      {"self_causal_masked", 16, 4, 0, 0, 0, 2, 9, 9, false, true, true},
      {"cross", 12, 2, 0, 0, 0, 2, 5, 11, true, false, false},
      {"cross_kdim_vdim", 12, 3, 0, 5, 7, 2, 5, 9, true, false, true},
      {"gqa_2_kv_heads", 16, 4, 2, 0, 0, 2, 6, 6, false, true, false},
      {"gqa_1_kv_head_cross", 24, 6, 1, 10, 3, 2, 4, 13, true, false, true},
  };
}

// How gtest shows a case (instead of its raw bytes).
void PrintTo(const MhaCase& c, std::ostream* os) { *os << c.name; }

class MhaVsComposition : public ::testing::TestWithParam<MhaCase> {};

// forward equals q_proj/k_proj/v_proj -> reshape (B, N, H, hd) -> transpose(1, 2) ->
// scaled_dot_product_attention -> transpose back -> out_proj within 1e-5, and the float64
// oracle within 1e-4; per-head weights too.
TEST_P(MhaVsComposition, Forward) {
  const MhaCase& c = GetParam();
  Random rng;
  SCOPED_TRACE(rng.note());
  MultiHeadAttentionOptions options;
  options.num_kv_heads = c.num_kv_heads;
  options.kdim = c.kdim;
  options.vdim = c.vdim;
  options.causal = c.causal;
  options.seed = rng.next_u64();
  const MultiHeadAttention mha(c.embed_dim, c.num_heads, options);
  randomise(mha.parameters(), rng);
  const int64_t E = c.embed_dim, H = c.num_heads, Hkv = c.num_kv_heads ? c.num_kv_heads : H, hd = E / H;
  const int64_t B = c.batch, Nq = c.q_len, Nk = c.kv_len;
  EXPECT_EQ(mha.head_dim(), hd);
  EXPECT_EQ(mha.num_kv_heads(), Hkv);
  const int64_t kdim = c.kdim ? c.kdim : E, vdim = c.vdim ? c.vdim : E;

  const Tensor query = rng.randn({B, Nq, E});
  const Tensor key = c.cross ? rng.randn({B, Nk, kdim}) : query;
  const Tensor value = c.cross ? rng.randn({B, Nk, vdim}) : query;
  Mask mask;
  std::vector<Bias> bias_parts;
  if (c.masked) {
    std::vector<int64_t> lengths;
    for (int64_t b = 0; b < B; ++b) lengths.push_back(rng.integer(1, Nk));
    std::vector<float> keep(static_cast<size_t>(B * Nq * Nk));
    for (float& x : keep) x = rng.chance(0.8) ? 1.0f : 0.0f;
    const Tensor keep_tensor = Tensor::from(keep, {B, 1, Nq, Nk});
    mask = Mask::key_lengths(lengths) & Mask::keep(keep_tensor);
    bias_parts = {qkv_test::key_lengths_bias(lengths), qkv_test::keep_bias(keep_tensor)};
  }
  if (c.causal) bias_parts.push_back(qkv_test::causal_bias());

  const qkv::nn::MultiHeadAttentionOutput got =
      c.cross ? mha.forward(query, key, value, mask, Weights::PerHead) : mha.forward(query, mask, Weights::PerHead);
  ASSERT_EQ(got.output.shape(), (Shape{B, Nq, E}));
  ASSERT_EQ(got.weights.shape(), (Shape{B, H, Nq, Nk}));

  // The manual composition through the functional core.
  const auto split = [&](const Tensor& x, int64_t N, int64_t heads) { return x.reshape({B, N, heads, hd}).transpose(1, 2); };
  AttentionOptions core;
  core.mask = c.causal ? Mask::causal() & mask : mask;
  core.need_weights = true;
  const qkv::AttentionResult attn = qkv::scaled_dot_product_attention(
      split(mha.q_proj.forward(query), Nq, H), split(mha.k_proj.forward(key), Nk, Hkv),
      split(mha.v_proj.forward(value), Nk, Hkv), core);
  const Tensor composed = mha.out_proj.forward(attn.output.transpose(1, 2).reshape({B, Nq, E}));
  EXPECT_LE(qkv_test::max_rel_diff(got.output, composed), 1e-5);
  EXPECT_LE(qkv_test::max_rel_diff(got.weights, attn.weights), 1e-5);

  const MhaOracle want = mha_oracle(params_of(mha), E, H, Hkv, query, key, value, qkv_test::all_of(bias_parts));
  expect_close(got.output, want.output, 1e-4, "output");
  expect_close(got.weights, want.weights, 1e-4, "weights");
}

INSTANTIATE_TEST_SUITE_P(Cases, MhaVsComposition, ::testing::ValuesIn(mha_cases()),
                         [](const ::testing::TestParamInfo<MhaCase>& info) { return info.param.name; });

// Weights::Averaged is the mean over heads of Weights::PerHead; Weights::None returns none; the
// output does not depend on which was asked for.
TEST(MultiHeadAttention, AveragedWeightsAreTheMeanOfPerHead) {
  Random rng;
  SCOPED_TRACE(rng.note());
  MultiHeadAttentionOptions options;
  options.seed = rng.next_u64();
  const MultiHeadAttention mha(16, 4, options);
  const Tensor x = rng.randn({2, 7, 16});
  const auto none = mha.forward(x, Mask::causal(), Weights::None);
  const auto per_head = mha.forward(x, Mask::causal(), Weights::PerHead);
  const auto averaged = mha.forward(x, Mask::causal(), Weights::Averaged);
  EXPECT_FALSE(none.weights.defined());
  ASSERT_EQ(per_head.weights.shape(), (Shape{2, 4, 7, 7}));
  ASSERT_EQ(averaged.weights.shape(), (Shape{2, 7, 7}));
  std::vector<double> mean(2 * 7 * 7, 0.0);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 4; ++h)
      for (int64_t i = 0; i < 7; ++i)
        for (int64_t j = 0; j < 7; ++j) mean[static_cast<size_t>((b * 7 + i) * 7 + j)] += per_head.weights.at({b, h, i, j}) / 4.0;
  expect_close(averaged.weights, mean, 1e-6, "averaged weights");
  EXPECT_LE(qkv_test::max_rel_diff(none.output, per_head.output), 1e-6);
  EXPECT_LE(qkv_test::max_rel_diff(none.output, averaged.output), 1e-6);
}

// Unbatched (N, E) input gives (N, E), equal to the batch of one; cross-attention too.
TEST(MultiHeadAttention, UnbatchedInput) {
  Random rng;
  SCOPED_TRACE(rng.note());
  MultiHeadAttentionOptions options;
  options.kdim = 6;
  options.vdim = 5;
  options.seed = rng.next_u64();
  const MultiHeadAttention self(12, 3, MultiHeadAttentionOptions{.seed = options.seed});
  const MultiHeadAttention cross(12, 3, options);
  const Tensor x = rng.randn({7, 12}), key = rng.randn({9, 6}), value = rng.randn({9, 5});
  const Tensor self_out = self.forward(x).output;
  ASSERT_EQ(self_out.shape(), (Shape{7, 12}));
  EXPECT_LE(qkv_test::max_rel_diff(self_out.unsqueeze(0), self.forward(x.unsqueeze(0)).output), 1e-6);
  const Tensor cross_out = cross.forward(x, key, value, Mask::key_lengths({4})).output;
  ASSERT_EQ(cross_out.shape(), (Shape{7, 12}));
  EXPECT_LE(qkv_test::max_rel_diff(cross_out.unsqueeze(0),
                                   cross.forward(x.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), Mask::key_lengths({4})).output),
            1e-6);
}

// parameters() lists q, k, v, out projections' weight and bias with their shapes, sharing the
// module's storage; parameter_count() adds them up: 4 * (E^2 + E) for (512, 8).
TEST(MultiHeadAttention, ParametersAndCount) {
  const int64_t E = 512;
  const MultiHeadAttention mha(E, 8);
  const std::vector<qkv::nn::NamedTensor> params = mha.parameters();
  const std::vector<std::pair<std::string, Shape>> want = {
      {"q_proj.weight", {E, E}}, {"q_proj.bias", {E}},   {"k_proj.weight", {E, E}},   {"k_proj.bias", {E}},
      {"v_proj.weight", {E, E}}, {"v_proj.bias", {E}},   {"out_proj.weight", {E, E}}, {"out_proj.bias", {E}}};
  ASSERT_EQ(params.size(), want.size());
  int64_t total = 0;
  for (size_t n = 0; n < want.size(); ++n) {
    EXPECT_EQ(params[n].name, want[n].first);
    EXPECT_EQ(params[n].tensor.shape(), want[n].second) << want[n].first;
    total += params[n].tensor.numel();
  }
  EXPECT_EQ(mha.parameter_count(), 4 * (E * E + E));
  EXPECT_EQ(total, mha.parameter_count());
  EXPECT_TRUE(params[0].tensor.shares_storage_with(mha.q_proj.weight));
  EXPECT_TRUE(params[7].tensor.shares_storage_with(mha.out_proj.bias));

  // Grouped-query and kdim/vdim shapes; no biases.
  MultiHeadAttentionOptions options;
  options.num_kv_heads = 2;
  options.kdim = 40;
  options.vdim = 24;
  options.bias = false;
  const MultiHeadAttention gqa(64, 8, options);  // head_dim 8, kv features 16
  const std::vector<qkv::nn::NamedTensor> gqa_params = gqa.parameters();
  ASSERT_EQ(gqa_params.size(), 4u);
  EXPECT_EQ(gqa_params[0].name, "q_proj.weight");
  EXPECT_EQ(gqa_params[0].tensor.shape(), (Shape{64, 64}));
  EXPECT_EQ(gqa_params[1].name, "k_proj.weight");
  EXPECT_EQ(gqa_params[1].tensor.shape(), (Shape{16, 40}));
  EXPECT_EQ(gqa_params[2].name, "v_proj.weight");
  EXPECT_EQ(gqa_params[2].tensor.shape(), (Shape{16, 24}));
  EXPECT_EQ(gqa_params[3].name, "out_proj.weight");
  EXPECT_EQ(gqa_params[3].tensor.shape(), (Shape{64, 64}));
  EXPECT_EQ(gqa.parameter_count(), 64 * 64 * 2 + 16 * 40 + 16 * 24);
}

// Initialised as torch.nn.MultiheadAttention: biases 0, q/k/v weights xavier-uniform over the
// packed (3E, E) in_proj_weight (bound sqrt(6 / (E + 3E))), out_proj as nn.Linear (bound
// 1 / sqrt(E)); the seed decides the weights.
TEST(MultiHeadAttention, TorchInitialisation) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t E = 512;
  MultiHeadAttentionOptions options;
  options.seed = rng.next_u64();
  const MultiHeadAttention mha(E, 8, options);
  const double xavier = std::sqrt(6.0 / (E + 3 * E));
  for (const Linear* proj : {&mha.q_proj, &mha.k_proj, &mha.v_proj, &mha.out_proj}) {
    for (float x : proj->bias.to_vector()) ASSERT_EQ(x, 0.0f);
  }
  for (const Linear* proj : {&mha.q_proj, &mha.k_proj, &mha.v_proj}) {
    float largest = 0;
    for (float x : proj->weight.to_vector()) largest = std::max(largest, std::abs(x));
    EXPECT_LE(largest, xavier);
    EXPECT_GT(largest, 0.99 * xavier);
  }
  float largest = 0;
  for (float x : mha.out_proj.weight.to_vector()) largest = std::max(largest, std::abs(x));
  EXPECT_LE(largest, 1.0 / std::sqrt(double(E)));
  EXPECT_GT(largest, 0.9 / std::sqrt(double(E)));
  // Different projections get different draws; the same seed gives the same module.
  EXPECT_NE(mha.q_proj.weight.to_vector(), mha.k_proj.weight.to_vector());
  const MultiHeadAttention again(E, 8, options);
  EXPECT_EQ(again.q_proj.weight.to_vector(), mha.q_proj.weight.to_vector());
  EXPECT_EQ(again.out_proj.weight.to_vector(), mha.out_proj.weight.to_vector());
  options.seed = *options.seed + 1;
  EXPECT_NE(MultiHeadAttention(E, 8, options).q_proj.weight.to_vector(), mha.q_proj.weight.to_vector());
}

// A torch state dict (packed in_proj_weight (3E, E) and in_proj_bias (3E)) loads rows [0, E) into
// q, [E, 2E) into k, [2E, 3E) into v; forward then matches float64 from the raw arrays.
TEST(MultiHeadAttention, LoadTorchPackedStateDict) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t E = 12, H = 3, B = 2, N = 6;
  MultiHeadAttention mha(E, H);
  const std::vector<float> in_w = rng.normals(3 * E * E, 0.3), in_b = rng.normals(3 * E, 0.3);
  const std::vector<float> out_w = rng.normals(E * E, 0.3), out_b = rng.normals(E, 0.3);
  mha.load_state_dict({{"in_proj_weight", Tensor::from(in_w, {3 * E, E})},
                       {"in_proj_bias", Tensor::from(in_b, {3 * E})},
                       {"out_proj.weight", Tensor::from(out_w, {E, E})},
                       {"out_proj.bias", Tensor::from(out_b, {E})}});
  const auto slice = [](const std::vector<float>& v, int64_t begin, int64_t count) {
    return std::vector<float>(v.begin() + begin, v.begin() + begin + count);
  };
  EXPECT_EQ(mha.q_proj.weight.to_vector(), slice(in_w, 0, E * E));
  EXPECT_EQ(mha.k_proj.weight.to_vector(), slice(in_w, E * E, E * E));
  EXPECT_EQ(mha.v_proj.weight.to_vector(), slice(in_w, 2 * E * E, E * E));
  EXPECT_EQ(mha.q_proj.bias.to_vector(), slice(in_b, 0, E));
  EXPECT_EQ(mha.k_proj.bias.to_vector(), slice(in_b, E, E));
  EXPECT_EQ(mha.v_proj.bias.to_vector(), slice(in_b, 2 * E, E));
  EXPECT_EQ(mha.out_proj.weight.to_vector(), out_w);
  EXPECT_EQ(mha.out_proj.bias.to_vector(), out_b);

  const auto doubles = [](const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); };
  const MhaParams raw{doubles(slice(in_w, 0, E * E)),     doubles(slice(in_b, 0, E)),
                      doubles(slice(in_w, E * E, E * E)), doubles(slice(in_b, E, E)),
                      doubles(slice(in_w, 2 * E * E, E * E)), doubles(slice(in_b, 2 * E, E)),
                      doubles(out_w),                     doubles(out_b)};
  const Tensor x = rng.randn({B, N, E});
  const std::vector<int64_t> lengths{N, 2};
  const auto got = mha.forward(x, Mask::key_lengths(lengths), Weights::PerHead);
  const MhaOracle want = mha_oracle(raw, E, H, H, x, x, x, qkv_test::key_lengths_bias(lengths));
  expect_close(got.output, want.output, 1e-4, "output");
  expect_close(got.weights, want.weights, 1e-4, "weights");
}

// torch's separate q_proj_weight / k_proj_weight / v_proj_weight (kdim, vdim != E) load too.
TEST(MultiHeadAttention, LoadTorchSeparateStateDict) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t E = 12, H = 2, kdim = 5, vdim = 7;
  MultiHeadAttentionOptions options;
  options.kdim = kdim;
  options.vdim = vdim;
  MultiHeadAttention mha(E, H, options);
  const std::vector<float> wq = rng.normals(E * E, 0.3), wk = rng.normals(E * kdim, 0.3), wv = rng.normals(E * vdim, 0.3);
  const std::vector<float> in_b = rng.normals(3 * E, 0.3), wo = rng.normals(E * E, 0.3), bo = rng.normals(E, 0.3);
  mha.load_state_dict({{"q_proj_weight", Tensor::from(wq, {E, E})},
                       {"k_proj_weight", Tensor::from(wk, {E, kdim})},
                       {"v_proj_weight", Tensor::from(wv, {E, vdim})},
                       {"in_proj_bias", Tensor::from(in_b, {3 * E})},
                       {"out_proj.weight", Tensor::from(wo, {E, E})},
                       {"out_proj.bias", Tensor::from(bo, {E})}});
  EXPECT_EQ(mha.k_proj.weight.to_vector(), wk);
  EXPECT_EQ(mha.v_proj.bias.to_vector(), std::vector<float>(in_b.begin() + 2 * E, in_b.end()));
  const Tensor query = rng.randn({2, 4, E}), key = rng.randn({2, 9, kdim}), value = rng.randn({2, 9, vdim});
  const MhaOracle want = mha_oracle(params_of(mha), E, H, H, query, key, value, {});
  expect_close(mha.forward(query, key, value).output, want.output, 1e-4, "output");
}

// Loading another module's parameters() by qkv's own names reproduces it bit for bit.
TEST(MultiHeadAttention, LoadOwnNames) {
  Random rng;
  SCOPED_TRACE(rng.note());
  MultiHeadAttentionOptions a_options, b_options;
  a_options.seed = rng.next_u64();
  b_options.seed = *a_options.seed + 1;
  a_options.num_kv_heads = b_options.num_kv_heads = 2;
  const MultiHeadAttention a(16, 4, a_options);
  MultiHeadAttention b(16, 4, b_options);
  randomise(a.parameters(), rng);
  std::map<std::string, Tensor> state;
  for (const auto& p : a.parameters()) state[p.name] = p.tensor.clone();
  b.load_state_dict(state);
  const Tensor x = rng.randn({2, 5, 16});
  EXPECT_EQ(b.forward(x, Mask::causal()).output.to_vector(), a.forward(x, Mask::causal()).output.to_vector());
}

// A wrong shape, an unknown name or a missing parameter is an error naming the parameter.
TEST(MultiHeadAttention, LoadStateDictErrors) {
  const int64_t E = 12;
  MultiHeadAttention mha(E, 3);
  const std::vector<float> before = mha.q_proj.weight.to_vector();
  std::map<std::string, Tensor> good = {{"in_proj_weight", Tensor::zeros({3 * E, E})},
                                        {"in_proj_bias", Tensor::zeros({3 * E})},
                                        {"out_proj.weight", Tensor::zeros({E, E})},
                                        {"out_proj.bias", Tensor::zeros({E})}};
  auto wrong_shape = good;
  wrong_shape["in_proj_weight"] = Tensor::zeros({3 * E, E + 1});
  auto unknown = good;
  unknown["encoder.bias"] = Tensor::zeros({E});
  auto missing = good;
  missing.erase("out_proj.bias");
  for (const auto& [state, name] : {std::pair{wrong_shape, "in_proj_weight"}, std::pair{unknown, "encoder.bias"},
                                    std::pair{missing, "out_proj.bias"}}) {
    try {
      mha.load_state_dict(state);
      ADD_FAILURE() << "no error for " << name;
    } catch (const qkv::Error& e) {
      EXPECT_THAT(e.what(), HasSubstr(name));
    }
  }
  EXPECT_NO_THROW(mha.load_state_dict(good));
  EXPECT_NE(mha.q_proj.weight.to_vector(), before);  // the good one did load
}

// Dropout acts only while training: eval() is deterministic and equals the undropped
// composition; training output differs from eval and from one call to the next.
TEST(MultiHeadAttention, DropoutOnlyWhileTraining) {
  Random rng;
  SCOPED_TRACE(rng.note());
  MultiHeadAttentionOptions options;
  options.dropout = 0.5f;
  options.seed = rng.next_u64();
  MultiHeadAttention mha(16, 4, options);
  MultiHeadAttentionOptions plain_options = options;
  plain_options.dropout = 0;
  MultiHeadAttention plain(16, 4, plain_options);
  std::map<std::string, Tensor> state;
  for (const auto& p : mha.parameters()) state[p.name] = p.tensor;
  plain.load_state_dict(state);
  plain.eval();

  const Tensor x = rng.randn({2, 6, 16});
  EXPECT_TRUE(mha.is_training());  // the default, as in PyTorch
  const std::vector<float> train1 = mha.forward(x).output.to_vector();
  const std::vector<float> train2 = mha.forward(x).output.to_vector();
  mha.eval();
  EXPECT_FALSE(mha.is_training());
  const std::vector<float> eval1 = mha.forward(x).output.to_vector();
  const std::vector<float> eval2 = mha.forward(x).output.to_vector();
  EXPECT_EQ(eval1, eval2);
  EXPECT_EQ(eval1, plain.forward(x).output.to_vector());
  EXPECT_NE(train1, eval1);
  EXPECT_NE(train1, train2);
  mha.train();
  EXPECT_TRUE(mha.is_training());
  EXPECT_NE(mha.forward(x).output.to_vector(), eval1);
}

// ---------------------------------------------------------------------------------------------
// SinusoidalPositionalEncoding and Embedding

// pe[pos, 2i] = sin(pos / 10000^(2i / d)), pe[pos, 2i + 1] = cos(same); forward adds pe[:N].
TEST(SinusoidalPositionalEncoding, ValuesAndForward) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t max_len = 50, d = 16;
  const qkv::nn::SinusoidalPositionalEncoding pe(max_len, d);
  ASSERT_EQ(pe.encoding().shape(), (Shape{max_len, d}));
  std::vector<double> want(static_cast<size_t>(max_len * d));
  for (int64_t pos = 0; pos < max_len; ++pos)
    for (int64_t i = 0; 2 * i < d; ++i) {
      const double angle = pos / std::pow(10000.0, 2.0 * i / d);
      want[static_cast<size_t>(pos * d + 2 * i)] = std::sin(angle);
      want[static_cast<size_t>(pos * d + 2 * i + 1)] = std::cos(angle);
    }
  expect_close(pe.encoding(), want, 2e-5, "encoding");

  const int64_t N = rng.integer(1, max_len);
  for (const Tensor& x : {rng.randn({3, N, d}), rng.randn({N, d})}) {
    const Tensor y = pe.forward(x);
    ASSERT_EQ(y.shape(), x.shape());
    const std::vector<double> xs = qkv_test::to_doubles(x);
    std::vector<double> sum(xs.size());
    for (size_t n = 0; n < xs.size(); ++n) sum[n] = xs[n] + want[n % static_cast<size_t>(N * d)];
    expect_close(y, sum, 2e-5, "x + pe");
  }
  EXPECT_NO_THROW(pe.forward(rng.randn({max_len, d})));
}

// Embedding returns rows of its weight, shaped (n, dim) or leading + (dim); initialised N(0, 1).
TEST(Embedding, LookupShapesAndInit) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t vocab = 1000, dim = 16;
  const qkv::nn::Embedding embedding(vocab, dim, rng.next_u64());
  ASSERT_EQ(embedding.weight.shape(), (Shape{vocab, dim}));
  std::vector<int64_t> ids;
  for (int n = 0; n < 6; ++n) ids.push_back(rng.integer(0, vocab - 1));
  ids.push_back(0);
  ids.push_back(vocab - 1);
  const Tensor flat = embedding.forward(ids);
  ASSERT_EQ(flat.shape(), (Shape{8, dim}));
  const Tensor shaped = embedding.forward(ids, {2, 4});
  ASSERT_EQ(shaped.shape(), (Shape{2, 4, dim}));
  for (size_t n = 0; n < ids.size(); ++n)
    for (int64_t c = 0; c < dim; ++c) {
      EXPECT_EQ(flat.at({static_cast<int64_t>(n), c}), embedding.weight.at({ids[n], c}));
      EXPECT_EQ(shaped.at({static_cast<int64_t>(n) / 4, static_cast<int64_t>(n) % 4, c}), embedding.weight.at({ids[n], c}));
    }
  double sum = 0, sum_sq = 0;
  for (float x : embedding.weight.to_vector()) {
    sum += x;
    sum_sq += double{x} * x;
  }
  const double n = static_cast<double>(vocab * dim);
  EXPECT_NEAR(sum / n, 0.0, 5.0 / std::sqrt(n));
  EXPECT_NEAR(sum_sq / n, 1.0, 0.06);  // 5 standard deviations: sqrt(2 / n) = 0.011
  const auto params = embedding.parameters("tok.");
  ASSERT_EQ(params.size(), 1u);
  EXPECT_EQ(params[0].name, "tok.weight");
  EXPECT_TRUE(params[0].tensor.shares_storage_with(embedding.weight));
}

// Modules built without a seed differ from each other (stacked layers must not start
// identical), and manual_seed makes the sequence repeat.
TEST(Seeds, UnseededModulesDifferAndManualSeedRepeats) {
  qkv::nn::manual_seed(123);
  const MultiHeadAttention first(16, 4), second(16, 4);
  const Linear linear_a(8, 8), linear_b(8, 8);
  EXPECT_NE(first.q_proj.weight.to_vector(), second.q_proj.weight.to_vector());
  EXPECT_NE(linear_a.weight.to_vector(), linear_b.weight.to_vector());
  qkv::nn::manual_seed(123);
  const MultiHeadAttention again(16, 4);
  EXPECT_EQ(again.q_proj.weight.to_vector(), first.q_proj.weight.to_vector());
}

// A zero-length sequence passes through the positional encoding unchanged.
TEST(SinusoidalPositionalEncoding, EmptySequence) {
  const qkv::nn::SinusoidalPositionalEncoding pe(16, 8);
  EXPECT_EQ(pe.forward(Tensor::zeros({0, 8})).shape(), (qkv::Shape{0, 8}));
  EXPECT_EQ(pe.forward(Tensor::zeros({3, 0, 8})).shape(), (qkv::Shape{3, 0, 8}));
}

}  // namespace
