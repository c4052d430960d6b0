// Score functions (AttentionOptions::score_mod) and mask functions given as options (mask_mod):
// each against the built-in feature it can restate (softcap, an additive bias tensor, a keep
// tensor), forward and backward, on random shapes; and the refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "harness/oracle.hpp"
#include "qkv/qkv.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;
using qkv_test::Random;

struct Run {
  qkv::AttentionResult forward;
  qkv::AttentionGrads grads;
};

Run run(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& grad_output, const AttentionOptions& o) {
  Run r;
  r.forward = qkv::scaled_dot_product_attention(q, k, v, o);
  r.grads = qkv::scaled_dot_product_attention_backward(grad_output, q, k, v, r.forward, o);
  return r;
}

void expect_near(const Tensor& got, const Tensor& want, double tolerance, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  for (int64_t x = 0; x < got.numel(); ++x)
    ASSERT_NEAR(got.data()[x], want.data()[x], tolerance * (1 + std::fabs(want.data()[x]))) << what << " at " << x;
}

void expect_same_run(const Run& got, const Run& want, double tolerance) {
  expect_near(got.forward.output, want.forward.output, tolerance, "output");
  expect_near(got.forward.lse, want.forward.lse, tolerance, "lse");
  expect_near(got.grads.dq, want.grads.dq, tolerance, "dq");
  expect_near(got.grads.dk, want.grads.dk, tolerance, "dk");
  expect_near(got.grads.dv, want.grads.dv, tolerance, "dv");
}

struct Operands {
  Tensor q, k, v, grad_output;
};
Operands random_operands(Random& rng, int64_t b, int64_t hq, int64_t hkv, int64_t nq, int64_t nk, int64_t d) {
  return {rng.randn(Shape{b, hq, nq, d}, 2.0), rng.randn(Shape{b, hkv, nk, d}, 2.0), rng.randn(Shape{b, hkv, nk, d}),
          rng.randn(Shape{b, hq, nq, d})};
}

TEST(ScoreMod, TanhCapIsSoftcapForwardAndBackward) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const Operands x = random_operands(rng, 2, 4, 2, 13, 29, 16);
  AttentionOptions softcap, function;
  softcap.softcap = 3.0f;
  softcap.backend = qkv::Backend::Reference;
  function.score_mod = "3 * tanh(s / 3)";
  expect_same_run(run(x.q, x.k, x.v, x.grad_output, function), run(x.q, x.k, x.v, x.grad_output, softcap), 1e-5);
}

TEST(ScoreMod, RelativeBiasWithAnInputIsAnAdditiveTensor) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t nq = 11, nk = 37;
  const Operands x = random_operands(rng, 2, 3, 3, nq, nk, 8);
  const Tensor bias = rng.randn(Shape{2, nk});  // per batch and key
  std::vector<float> dense(static_cast<size_t>(2 * nq * nk));
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t j = 0; j < nk; ++j)
        dense[static_cast<size_t>((b * nq + i) * nk + j)] =
            -0.1f * static_cast<float>(std::abs(i - j)) + bias.data()[b * nk + j];
  AttentionOptions tensor, function;
  tensor.mask = Mask::causal(nk - nq) & Mask::additive(Tensor::from(std::move(dense), Shape{2, 1, nq, nk}));
  function.mask = Mask::causal(nk - nq);
  function.score_mod = "s - 0.1 * abs(q - k) + bias(k)";
  function.mod_inputs = {{"bias", bias}};
  tensor.backend = function.backend = qkv::Backend::Reference;
  expect_same_run(run(x.q, x.k, x.v, x.grad_output, function), run(x.q, x.k, x.v, x.grad_output, tensor), 1e-5);
}

TEST(ScoreMod, MaskModOptionIsTheKeepTensorItDescribes) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t nq = 40, nk = 40;
  const Operands x = random_operands(rng, 1, 2, 1, nq, nk, 16);
  std::vector<float> docs(static_cast<size_t>(nk)), keep(static_cast<size_t>(nq * nk));
  for (int64_t j = 0; j < nk; ++j) docs[static_cast<size_t>(j)] = static_cast<float>(j / 9);
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t j = 0; j < nk; ++j) keep[static_cast<size_t>(i * nk + j)] = docs[i] == docs[j] && j <= i ? 1.0f : 0.0f;
  for (const qkv::Backend backend : {qkv::Backend::Auto, qkv::Backend::Flash, qkv::Backend::Reference}) {
    AttentionOptions tensor, function;
    tensor.mask = Mask::keep(Tensor::from(keep, Shape{nq, nk}));
    function.mask = Mask::causal();
    function.mask_mod = "doc(q) == doc(k)";
    function.mod_inputs = {{"doc", Tensor::from(docs, Shape{nk})}};
    tensor.backend = function.backend = backend;
    expect_same_run(run(x.q, x.k, x.v, x.grad_output, function), run(x.q, x.k, x.v, x.grad_output, tensor), 1e-6);
  }
}

TEST(ScoreMod, RefusalsNameTheFunctionAndTheBackend) {
  const Tensor q = Tensor::zeros(Shape{1, 2, 4, 8});
  const auto error_of = [&](const AttentionOptions& o) -> std::string {
    try {
      qkv::scaled_dot_product_attention(q, q, q, o);
    } catch (const qkv::Error& e) {
      return e.what();
    }
    return "no error";
  };
  AttentionOptions flash;
  flash.score_mod = "s * 2";
  flash.backend = qkv::Backend::Flash;
  EXPECT_NE(error_of(flash).find("backend Flash does not take score_mod"), std::string::npos) << error_of(flash);
  AttentionOptions unknown;
  unknown.score_mod = "s + bias(k)";
  EXPECT_NE(error_of(unknown).find("score function 's + bias(k)': column 5, found 'bias': unknown function"),
            std::string::npos)
      << error_of(unknown);
  AttentionOptions short_input;
  short_input.score_mod = "s + bias(k)";
  short_input.mod_inputs = {{"bias", Tensor::zeros(Shape{3})}};
  EXPECT_NE(error_of(short_input).find("input 'bias' is (3): indexed by k (Nk = 4) it needs L >= 4"),
            std::string::npos)
      << error_of(short_input);
  AttentionOptions mask_reads_score;
  mask_reads_score.mask_mod = "s > 0";
  EXPECT_NE(error_of(mask_reads_score).find("a mask function does not read the score s"), std::string::npos);
}

}  // namespace
