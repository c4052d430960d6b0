// Module backward passes (Linear, LayerNorm, Embedding, CrossEntropyLoss, MultiHeadAttention self,
// cross and grouped-query, the whole AttentionModel) against central finite differences.
//
// Each check takes a scalar loss L = sum(y * R) for a fixed random R (accumulated in float64),
// gets the analytic gradients from one backward(R), then nudges every input and parameter
// element by +-h and compares (L(+h) - L(-h)) / 2h with them. The modules compute in float32,
// so the finite difference carries ~1e-4 of rounding noise: the tolerance is tied to that, and
// every check prints `OK, maxdiff = ...` so the margin is visible.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "harness/kernel_cases.hpp"
#include "harness/oracle.hpp"

namespace {

using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;
using qkv_test::Random;

constexpr double kStep = 1e-2;            // h of the central difference
constexpr double kAbsoluteTolerance = 2e-3;
constexpr double kRelativeTolerance = 1e-2;

// sum(y * r) in float64.
double dot(const Tensor& y, const Tensor& r) {
  const Tensor a = y.contiguous(), b = r.contiguous();
  double sum = 0;
  for (int64_t e = 0; e < a.numel(); ++e) sum += static_cast<double>(a.data()[e]) * b.data()[e];
  return sum;
}

// Compares `analytic` (the gradient backward gave for `values`) with central differences of
// `loss` over every element of `values` (a tensor the loss reads; nudged in place and restored).
void expect_gradient(const std::string& what, const Tensor& values, const Tensor& analytic,
                     const std::function<double()>& loss, int64_t max_elements = 1 << 30) {
  ASSERT_TRUE(analytic.defined()) << what << ": no gradient";
  ASSERT_EQ(analytic.shape(), values.shape()) << what;
  float* v = values.data();
  const Tensor grad = analytic.contiguous();
  double max_diff = 0, max_ratio = 0;
  const int64_t stride = std::max<int64_t>(1, values.numel() / max_elements);
  for (int64_t e = 0; e < values.numel(); e += stride) {
    const float saved = v[e];
    // Central differences at h and h/2, combined by Richardson extrapolation: the h^2 error term
    // cancels, so curved losses (softcap's tanh) stay within tolerance at a step float32 resolves.
    const auto central = [&](double h) {
      v[e] = static_cast<float>(saved + h);
      const double plus = loss();
      v[e] = static_cast<float>(saved - h);
      const double minus = loss();
      v[e] = saved;
      return (plus - minus) / (2 * h);
    };
    const double numeric = (4 * central(kStep / 2) - central(kStep)) / 3;
    const double diff = std::abs(numeric - grad.data()[e]);
    max_diff = std::max(max_diff, diff);
    max_ratio = std::max(max_ratio, diff / (kAbsoluteTolerance + kRelativeTolerance * std::abs(numeric)));
    EXPECT_LE(diff, kAbsoluteTolerance + kRelativeTolerance * std::abs(numeric))
        << what << "[" << e << "]: backward " << grad.data()[e] << ", finite difference " << numeric;
  }
  std::printf("%-44s OK, maxdiff = %.2e (%.0f%% of tolerance)\n", what.c_str(), max_diff, 100 * max_ratio);
}

// Every parameter of a module against central differences of `loss`.
void expect_parameter_gradients(const std::string& module, const std::vector<qkv::nn::NamedTensor>& params,
                                const std::function<double()>& loss, int64_t max_elements = 1 << 30) {
  for (const auto& p : params) expect_gradient(module + " " + p.name, p.tensor, p.grad, loss, max_elements);
}

// ---------------------------------------------------------------------------------------------

TEST(LinearBackward, FiniteDifferences) {
  Random rng;
  SCOPED_TRACE(rng.note());
  for (bool bias : {true, false}) {
    qkv::nn::Linear linear(5, 3, bias, rng.next_u64());
    const Tensor x = rng.randn({2, 4, 5});
    const Tensor r = rng.randn({2, 4, 3});
    const auto loss = [&] { return dot(linear.forward(x), r); };
    linear.zero_grad();
    (void)linear.forward(x);
    const Tensor dx = linear.backward(r);
    expect_gradient(bias ? "Linear x" : "Linear (no bias) x", x, dx, loss);
    expect_parameter_gradients("Linear", linear.parameters(), loss);
  }
}

TEST(LinearBackward, GradientsAccumulateUntilZeroGrad) {
  Random rng;
  SCOPED_TRACE(rng.note());
  qkv::nn::Linear linear(3, 2, true, rng.next_u64());
  const Tensor x = rng.randn({4, 3}), r = rng.randn({4, 2});
  (void)linear.forward(x);
  (void)linear.backward(r);
  const std::vector<float> once = linear.weight_grad.to_vector();
  (void)linear.forward(x);
  (void)linear.backward(r);
  const std::vector<float> twice = linear.weight_grad.to_vector();
  for (size_t e = 0; e < once.size(); ++e) EXPECT_FLOAT_EQ(twice[e], 2 * once[e]);
  const Tensor handle = linear.parameters()[0].grad;
  linear.zero_grad();
  for (float g : handle.to_vector()) EXPECT_EQ(g, 0.0f);  // cleared in place: handles stay valid
  EXPECT_TRUE(handle.shares_storage_with(linear.weight_grad));
}

TEST(LinearBackward, Errors) {
  qkv::nn::Linear linear(3, 2, true, 1);
  EXPECT_THAT([&] { (void)linear.backward(Tensor::zeros({4, 2})); },
              ::testing::ThrowsMessage<qkv::Error>(::testing::HasSubstr("no forward")));
  (void)linear.forward(Tensor::zeros({4, 3}));
  EXPECT_THAT([&] { (void)linear.backward(Tensor::zeros({4, 3})); },
              ::testing::ThrowsMessage<qkv::Error>(::testing::HasSubstr("grad_output is (4, 3) but the forward's output was (4, 2)")));
}

TEST(LayerNormBackward, FiniteDifferences) {
  Random rng;
  SCOPED_TRACE(rng.note());
  qkv::nn::LayerNorm norm(6);
  // Non-trivial affine parameters so that a mistake in either cannot hide behind ones and zeros.
  for (const auto& p : norm.parameters())
    for (int64_t e = 0; e < p.tensor.numel(); ++e) p.tensor.data()[e] = static_cast<float>(1 + 0.5 * rng.normal());
  const Tensor x = rng.randn({3, 2, 6}, 2.0);
  const Tensor r = rng.randn({3, 2, 6});
  const auto loss = [&] { return dot(norm.forward(x), r); };
  norm.zero_grad();
  (void)norm.forward(x);
  const Tensor dx = norm.backward(r);
  expect_gradient("LayerNorm x", x, dx, loss);
  expect_parameter_gradients("LayerNorm", norm.parameters(), loss);
}

TEST(LayerNormBackward, ForwardMatchesFloat64) {
  Random rng;
  SCOPED_TRACE(rng.note());
  qkv::nn::LayerNorm norm(7, 1e-5f);
  const Tensor x = rng.randn({5, 7}, 3.0);
  const Tensor y = norm.forward(x);
  for (int64_t r = 0; r < 5; ++r) {
    double mean = 0, var = 0;
    for (int64_t e = 0; e < 7; ++e) mean += x.at({r, e}) / 7.0;
    for (int64_t e = 0; e < 7; ++e) var += (x.at({r, e}) - mean) * (x.at({r, e}) - mean) / 7.0;
    for (int64_t e = 0; e < 7; ++e) EXPECT_NEAR(y.at({r, e}), (x.at({r, e}) - mean) / std::sqrt(var + 1e-5), 1e-5);
  }
}

TEST(EmbeddingBackward, FiniteDifferencesWithRepeatedIds) {
  Random rng;
  SCOPED_TRACE(rng.note());
  qkv::nn::Embedding embedding(5, 4, rng.next_u64());
  const std::vector<int64_t> ids{3, 1, 3, 0, 3, 1};  // 2 and 4 unused: zero gradient rows
  const Tensor r = rng.randn({2, 3, 4});
  const auto loss = [&] { return dot(embedding.forward(ids, {2, 3}), r); };
  embedding.zero_grad();
  (void)embedding.forward(ids, {2, 3});
  embedding.backward(r);
  expect_parameter_gradients("Embedding", embedding.parameters(), loss);
  for (int64_t e = 0; e < 4; ++e) {
    EXPECT_EQ(embedding.weight_grad.at({2, e}), 0.0f);
    EXPECT_EQ(embedding.weight_grad.at({4, e}), 0.0f);
  }
}

TEST(CrossEntropyLossBackward, FiniteDifferencesAndIgnoredRows) {
  Random rng;
  SCOPED_TRACE(rng.note());
  qkv::nn::CrossEntropyLoss criterion;
  const Tensor logits = rng.randn({2, 3, 5}, 2.0);
  const std::vector<int64_t> targets{4, -100, 0, 2, 2, -100};
  const auto loss = [&] { return static_cast<double>(criterion.forward(logits, targets)); };
  (void)criterion.forward(logits, targets);
  EXPECT_EQ(criterion.count(), 4);
  const Tensor grad = criterion.backward();
  expect_gradient("CrossEntropyLoss logits", logits, grad, loss);
  for (int64_t c = 0; c < 5; ++c) EXPECT_EQ(grad.at({0, 1, c}), 0.0f);  // ignored row

  // The value against float64: mean over counted rows of logsumexp - logit[target].
  double want = 0;
  for (int64_t row = 0; row < 6; ++row) {
    if (targets[static_cast<size_t>(row)] < 0) continue;
    double sum = 0;
    for (int64_t c = 0; c < 5; ++c) sum += std::exp(static_cast<double>(logits.data()[row * 5 + c]));
    want += std::log(sum) - logits.data()[row * 5 + targets[static_cast<size_t>(row)]];
  }
  EXPECT_NEAR(criterion.forward(logits, targets), want / 4, 1e-5);
}

TEST(CrossEntropyLossBackward, Errors) {
  qkv::nn::CrossEntropyLoss criterion;
  EXPECT_THAT([&] { (void)criterion.forward(Tensor::zeros({3, 4}), {0, 1}); },
              ::testing::ThrowsMessage<qkv::Error>(::testing::HasSubstr("3 rows but 2 targets")));
  EXPECT_THAT([&] { (void)criterion.forward(Tensor::zeros({2, 4}), {0, 4}); },
              ::testing::ThrowsMessage<qkv::Error>(::testing::HasSubstr("target 4 at row 1 is outside [0, 4)")));
}

// ---------------------------------------------------------------------------------------------
// MultiHeadAttention: self, cross (Nq != Nk, kdim != vdim, padding), grouped-query, unbatched.

// Every parameter N(0, 0.5^2), biases included, so zero biases cannot hide a mistake.
void randomise(const std::vector<qkv::nn::NamedTensor>& params, Random& rng) {
  for (const auto& p : params)
    for (int64_t e = 0; e < p.tensor.numel(); ++e) p.tensor.data()[e] = static_cast<float>(0.5 * rng.normal());
}

TEST(MultiHeadAttentionBackward, SelfAttentionCausal) {
  Random rng;
  SCOPED_TRACE(rng.note());
  qkv::nn::MultiHeadAttention mha(8, 2, {.causal = true, .seed = rng.next_u64()});
  randomise(mha.parameters(), rng);
  const Tensor x = rng.randn({2, 5, 8});
  const Tensor r = rng.randn({2, 5, 8});
  const auto loss = [&] { return dot(mha.forward(x).output, r); };
  mha.zero_grad();
  (void)mha.forward(x);
  const Tensor dx = mha.backward(r);
  expect_gradient("MHA self causal x", x, dx, loss);
  expect_parameter_gradients("MHA self causal", mha.parameters(), loss);
}

TEST(MultiHeadAttentionBackward, CrossAttentionWithPadding) {
  Random rng;
  SCOPED_TRACE(rng.note());
  qkv::nn::MultiHeadAttention mha(6, 3, {.kdim = 5, .vdim = 4, .seed = rng.next_u64()});
  randomise(mha.parameters(), rng);
  const Tensor query = rng.randn({2, 3, 6}), key = rng.randn({2, 7, 5}), value = rng.randn({2, 7, 4});
  const Mask mask = Mask::key_lengths({7, 4});
  const Tensor r = rng.randn({2, 3, 6});
  const auto loss = [&] { return dot(mha.forward(query, key, value, mask).output, r); };
  mha.zero_grad();
  (void)mha.forward(query, key, value, mask);
  const qkv::nn::MultiHeadAttentionGrads grads = mha.backward_cross(r);
  expect_gradient("MHA cross query", query, grads.query, loss);
  expect_gradient("MHA cross key", key, grads.key, loss);
  expect_gradient("MHA cross value", value, grads.value, loss);
  expect_parameter_gradients("MHA cross", mha.parameters(), loss);
  // Keys hidden by the padding get no gradient.
  for (int64_t j = 4; j < 7; ++j)
    for (int64_t e = 0; e < 5; ++e) EXPECT_EQ(grads.key.at({1, j, e}), 0.0f);
}

TEST(MultiHeadAttentionBackward, GroupedQueryUnbatchedWithKeepMask) {
  Random rng;
  SCOPED_TRACE(rng.note());
  qkv::nn::MultiHeadAttention mha(8, 4, {.num_kv_heads = 2, .bias = false, .seed = rng.next_u64()});
  randomise(mha.parameters(), rng);
  const Tensor x = rng.randn({6, 8});
  Tensor keep = Tensor::zeros({6, 6});
  for (int64_t i = 0; i < 6; ++i)
    for (int64_t j = 0; j < 6; ++j) keep.at({i, j}) = (i + j) % 3 != 1 || i == j ? 1.0f : 0.0f;
  const Mask mask = Mask::keep(keep);
  const Tensor r = rng.randn({6, 8});
  const auto loss = [&] { return dot(mha.forward(x, mask).output, r); };
  mha.zero_grad();
  (void)mha.forward(x, mask);
  const Tensor dx = mha.backward(r);
  EXPECT_EQ(dx.shape(), (Shape{6, 8}));
  expect_gradient("MHA GQA unbatched x", x, dx, loss);
  expect_parameter_gradients("MHA GQA", mha.parameters(), loss);
}

// softcap, ALiBi and learned sinks (a parameter: its gradient is checked with the others), through
// the fused self-attention path and the cross path, with grouped-query heads and a causal mask.
TEST(MultiHeadAttentionBackward, ScoreModifiersAndSinks) {
  Random rng;
  SCOPED_TRACE(rng.note());
  qkv::nn::MultiHeadAttention mha(
      8, 4, {.num_kv_heads = 2, .causal = true, .softcap = 1.5f, .alibi = true, .sinks = true, .seed = rng.next_u64()});
  ASSERT_EQ(mha.parameters().back().name, "sinks");
  EXPECT_EQ(mha.sinks.to_vector(), std::vector<float>(4, 0.0f));
  randomise(mha.parameters(), rng);
  const Tensor x = rng.randn({2, 5, 8}), memory = rng.randn({2, 6, 8});
  const Tensor r = rng.randn({2, 5, 8});
  const auto self_loss = [&] { return dot(mha.forward(x).output, r); };
  mha.zero_grad();
  (void)mha.forward(x);
  const Tensor dx = mha.backward(r);
  expect_gradient("MHA modifiers self x", x, dx, self_loss);
  expect_parameter_gradients("MHA modifiers self", mha.parameters(), self_loss);

  const auto cross_loss = [&] { return dot(mha.forward(x, memory, memory).output, r); };
  mha.zero_grad();
  (void)mha.forward(x, memory, memory);
  const qkv::nn::MultiHeadAttentionGrads grads = mha.backward_cross(r);
  expect_gradient("MHA modifiers cross query", x, grads.query, cross_loss);
  Tensor d_memory = grads.key.clone();  // memory is both key and value: both paths
  for (int64_t e = 0; e < d_memory.numel(); ++e) d_memory.data()[e] += grads.value.data()[e];
  expect_gradient("MHA modifiers cross key + value", memory, d_memory, cross_loss);
  expect_parameter_gradients("MHA modifiers cross", mha.parameters(), cross_loss);
}

// MultiHeadAttentionOptions::precision reaches the attention's forward (with and without a KV
// cache) and backward: at High the output, dL/dx and every parameter gradient stay within 1e-3 (relative to the largest) of the
// Highest module's with the same weights, and where the AMX tiles run (a CPU with AMX) they differ
// from them in both directions; elsewhere they are the same bits. (The backward runs on the
// options the forward saved, Saved::attention, so the precision that reaches the forward reaches
// it; Backward.LowerPrecisionEveryProductOnTheTiles shows the backward's own products on the tiles.)
TEST(MultiHeadAttentionBackward, LowerMatmulPrecision) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const uint64_t seed = rng.next_u64();
  qkv::nn::MultiHeadAttention highest(128, 4, {.causal = true, .seed = seed});
  qkv::nn::MultiHeadAttention high(128, 4, {.causal = true, .seed = seed, .precision = qkv::MatmulPrecision::High});
  const Tensor x = rng.randn({2, 70, 128}), r = rng.randn({2, 70, 128});
  const bool tiles = qkv_test::without_amx().empty();
  const auto compare = [&](const std::string& what, const Tensor& got, const Tensor& want) {
    double largest = 0, diff = 0;
    for (int64_t e = 0; e < want.numel(); ++e) {
      largest = std::max(largest, static_cast<double>(std::abs(want.data()[e])));
      diff = std::max(diff, static_cast<double>(std::abs(got.data()[e] - want.data()[e])));
    }
    EXPECT_LE(diff, 1e-3 * std::max(1.0, largest)) << what;
    if (tiles) EXPECT_GT(diff, 0.0) << what << ": the same bits as Highest";
    else EXPECT_EQ(diff, 0.0) << what;
  };
  Tensor out[2], dx[2];
  qkv::nn::MultiHeadAttention* modules[2] = {&highest, &high};
  for (int n = 0; n < 2; ++n) {
    modules[n]->zero_grad();
    out[n] = modules[n]->forward(x).output.contiguous();
    dx[n] = modules[n]->backward(r).contiguous();
  }
  compare("output", out[1], out[0]);
  compare("dL/dx", dx[1], dx[0]);
  const auto want = highest.parameters(), got = high.parameters();
  for (size_t n = 0; n < want.size(); ++n)
    if (want[n].name.find("bias") == std::string::npos || want[n].name.find("out_proj") == std::string::npos)
      compare(want[n].name, got[n].grad.contiguous(), want[n].grad.contiguous());
  // And inference with a KV cache (a prompt of 70 tokens).
  Tensor cached[2];
  for (int n = 0; n < 2; ++n) {
    modules[n]->eval();
    qkv::nn::KVCache cache = modules[n]->make_cache(2, 80);
    cached[n] = modules[n]->forward(x, cache).output.contiguous();
  }
  compare("output with a KV cache", cached[1], cached[0]);
}

// backward_cross after a fused self-attention forward gives the three paths apart; their sum is
// backward()'s gradient, and the parameter gradients are the same either way.
TEST(MultiHeadAttentionBackward, FusedSelfAttentionBackwardCross) {
  Random rng;
  SCOPED_TRACE(rng.note());
  qkv::nn::MultiHeadAttention mha(8, 2, {.seed = rng.next_u64()});
  randomise(mha.parameters(), rng);
  const Tensor x = rng.randn({3, 4, 8}), r = rng.randn({3, 4, 8});
  mha.zero_grad();
  (void)mha.forward(x);
  const Tensor dx = mha.backward(r);
  std::vector<std::vector<float>> summed_grads;
  for (const auto& p : mha.parameters()) summed_grads.push_back(p.grad.to_vector());
  mha.zero_grad();
  (void)mha.forward(x);
  const qkv::nn::MultiHeadAttentionGrads parts = mha.backward_cross(r);
  for (int64_t e = 0; e < dx.numel(); ++e)
    EXPECT_NEAR(dx.data()[e], parts.query.data()[e] + parts.key.data()[e] + parts.value.data()[e], 1e-5) << e;
  const auto params = mha.parameters();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(params[i].grad.to_vector(), summed_grads[i]) << params[i].name;
}

// The q/k/v projections are row blocks of one fused weight: writing through q_proj.weight (as
// load_state_dict and optimizers do) changes what forward(x) computes; replacing q_proj.weight
// by another tensor leaves the fused path for the three separate projections, with the same result.
TEST(MultiHeadAttentionBackward, ReplacedProjectionLeavesTheFusedPath) {
  Random rng;
  SCOPED_TRACE(rng.note());
  qkv::nn::MultiHeadAttention mha(8, 2, {.seed = rng.next_u64()});
  randomise(mha.parameters(), rng);
  const Tensor x = rng.randn({2, 3, 8});
  const auto expect_near = [](const std::vector<float>& got, const std::vector<float>& want, const char* what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    for (size_t e = 0; e < want.size(); ++e) EXPECT_NEAR(got[e], want[e], 1e-5) << what << " [" << e << "]";
  };
  const std::vector<float> fused = mha.forward(x).output.to_vector();
  expect_near(mha.forward(x, x, x).output.to_vector(), fused, "cross form");
  mha.q_proj.weight = mha.q_proj.weight.clone();  // no longer a view of the fused weight
  const std::vector<float> separate = mha.forward(x).output.to_vector();
  expect_near(separate, fused, "unfused");
  mha.q_proj.weight.data()[0] += 1.0f;
  EXPECT_NE(mha.forward(x).output.to_vector(), separate);
}

// AttentionKind::Linear: the heads run linear_attention (causal, GQA, cross with Nq != Nk), the
// fused self-attention path and the separate projections. elu+1 only: relu's kink at 0 is within
// this file's step (1e-2) of some projection, which breaks the finite differences, not the
// backward (relu is checked with a 1e-6 step in float64 in linear/test_linear_attention.cpp).
TEST(MultiHeadAttentionBackward, LinearAttentionKind) {
  Random rng;
  SCOPED_TRACE(rng.note());
  using qkv::nn::AttentionKind;
  qkv::nn::MultiHeadAttention self(8, 2, {.causal = true, .seed = rng.next_u64(), .attention = AttentionKind::Linear});
  randomise(self.parameters(), rng);
  const Tensor x = rng.randn({2, 5, 8}), r = rng.randn({2, 5, 8});
  const auto self_loss = [&] { return dot(self.forward(x).output, r); };
  self.zero_grad();
  (void)self.forward(x);
  expect_gradient("MHA linear self causal x", x, self.backward(r), self_loss);
  expect_parameter_gradients("MHA linear self causal", self.parameters(), self_loss);

  qkv::nn::MultiHeadAttention cross(8, 4, {.num_kv_heads = 2, .kdim = 5, .vdim = 3, .seed = rng.next_u64(),
                                           .attention = AttentionKind::Linear});
  randomise(cross.parameters(), rng);
  const Tensor query = rng.randn({2, 3, 8}), key = rng.randn({2, 7, 5}), value = rng.randn({2, 7, 3});
  const auto cross_loss = [&] { return dot(cross.forward(query, key, value).output, r.narrow(1, 0, 3)); };
  cross.zero_grad();
  (void)cross.forward(query, key, value);
  const qkv::nn::MultiHeadAttentionGrads grads = cross.backward_cross(r.narrow(1, 0, 3).contiguous());
  expect_gradient("MHA linear cross query", query, grads.query, cross_loss);
  expect_gradient("MHA linear cross key", key, grads.key, cross_loss);
  expect_gradient("MHA linear cross value", value, grads.value, cross_loss);
  expect_parameter_gradients("MHA linear cross", cross.parameters(), cross_loss);

  // Its forward is linear_attention over the projections' heads.
  self.eval();
  const Tensor q = self.q_proj.apply(x).reshape({2, 5, 2, 4}).transpose(1, 2);
  const Tensor k = self.k_proj.apply(x).reshape({2, 5, 2, 4}).transpose(1, 2);
  const Tensor v = self.v_proj.apply(x).reshape({2, 5, 2, 4}).transpose(1, 2);
  qkv::LinearAttentionOptions options;
  options.causal = true;
  const Tensor heads = qkv::linear_attention(q, k, v, options).transpose(1, 2).contiguous().reshape({2, 5, 8});
  // Equal up to rounding: the module projects q, k and v in one GEMM of 3 E outputs, which a
  // library may sum in another order than three GEMMs of E (oneDNN does).
  const std::vector<float> got = self.forward(x).output.to_vector(), want = self.out_proj.apply(heads).to_vector();
  ASSERT_EQ(got.size(), want.size());
  for (size_t e = 0; e < want.size(); ++e) EXPECT_NEAR(got[e], want[e], 1e-5 * (1 + std::abs(want[e]))) << e;
  // What only softmax attention has is refused with a reason.
  EXPECT_THROW(self.forward(x, Mask::key_lengths({5, 3})), qkv::Error);
  EXPECT_THROW(self.forward(x, {}, qkv::nn::Weights::PerHead), qkv::Error);
  EXPECT_THROW(qkv::nn::MultiHeadAttention(8, 2, {.dropout = 0.1f, .attention = AttentionKind::Linear}), qkv::Error);
}

TEST(MultiHeadAttentionBackward, Errors) {
  qkv::nn::MultiHeadAttention mha(4, 2, {.seed = 1});
  EXPECT_THAT([&] { (void)mha.backward(Tensor::zeros({1, 2, 4})); },
              ::testing::ThrowsMessage<qkv::Error>(::testing::HasSubstr("no forward")));
  const Tensor x = Tensor::zeros({1, 2, 4}), memory = Tensor::zeros({1, 3, 4});
  (void)mha.forward(x, memory, memory);
  EXPECT_THAT([&] { (void)mha.backward(Tensor::zeros({1, 2, 4})); },
              ::testing::ThrowsMessage<qkv::Error>(::testing::HasSubstr("use backward_cross()")));
  EXPECT_THAT([&] { (void)mha.backward_cross(Tensor::zeros({1, 3, 4})); },
              ::testing::ThrowsMessage<qkv::Error>(::testing::HasSubstr("grad_output is (1, 3, 4) but the forward's output was (1, 2, 4)")));
}

// ---------------------------------------------------------------------------------------------
// The whole model: residuals, norms, two attention layers, head and the loss together.

TEST(AttentionModelBackward, FiniteDifferencesThroughTheLoss) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const qkv::train::ModelConfig config{.vocab_size = 7, .max_len = 6, .d_model = 8, .num_heads = 2, .num_layers = 2};
  qkv::train::AttentionModel model(config, rng.next_u64());
  std::vector<int64_t> ids, targets;
  for (int i = 0; i < 2 * 6; ++i) {
    ids.push_back(rng.integer(0, 6));
    targets.push_back(i % 3 == 0 ? -100 : rng.integer(0, 6));
  }
  qkv::nn::CrossEntropyLoss criterion;
  const auto loss = [&] { return static_cast<double>(criterion.forward(model.forward(ids, 2, 6), targets)); };
  model.zero_grad();
  (void)loss();
  model.backward(criterion.backward());
  // A sample of each tensor's elements keeps this quick; every tensor is covered.
  expect_parameter_gradients("AttentionModel", model.parameters(), loss, 12);
}

}  // namespace
