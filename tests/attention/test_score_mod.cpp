// Score functions (AttentionOptions::score_mod) and mask functions given as options (mask_mod):
// each against the built-in feature it can restate (softcap, an additive bias tensor, a keep
// tensor), forward and backward, on random shapes; the fused flash forward and backward against
// the reference kernel (itself checked against the restated features above) with every mask kind,
// the modifiers, GQA, on every SIMD target and 1 and 2 threads; and the refusals.
#include <gtest/gtest.h>
#include <hwy/targets.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <type_traits>
#include <string>
#include <vector>

#include "harness/kernel_cases.hpp"
#include "harness/oracle.hpp"
#include "qkv/qkv.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;
using qkv_test::Random;

struct Result {
  qkv::AttentionResult forward;
  qkv::AttentionGrads grads;
};

Result run(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& grad_output, const AttentionOptions& o) {
  Result r;
  r.forward = qkv::scaled_dot_product_attention(q, k, v, o);
  r.grads = qkv::scaled_dot_product_attention_backward(grad_output, q, k, v, r.forward, o);
  return r;
}

void expect_near(const Tensor& got, const Tensor& want, double tolerance, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  for (int64_t x = 0; x < got.numel(); ++x)
    ASSERT_NEAR(got.data()[x], want.data()[x], tolerance * (1 + std::fabs(want.data()[x]))) << what << " at " << x;
}

void expect_same_run(const Result& got, const Result& want, double tolerance) {
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

// ---- The fused flash kernels against the reference.

// Score functions covering every operation and every kind of input (per key and batch, per query,
// per head), each differentiable where it is evaluated (log's argument stays positive).
const char* const kScoreFunctions[] = {
    "s - 0.1 * abs(q - k)",
    "3 * tanh(s / 3) + bias(k)",
    "where(q >= k, s * 1.5, s - 1) + slope(h) * k / 100",
    "max(s, -0.5) * exp(-0.01 * abs(q - k)) + min(s, 1)",
    "s + doc(q) * 0.25 - log(1 + abs(s)) + sqrt(s * s + 1)",
    "s / (2 + (q < k) + (k == q) * (b + 1)) - floor(k / 8) * 0.1 + (!(s > 0) || s > 1) * 0.5",
    "-s * -1 + (s != 0 && h >= 1) * bias(k) + tanh(s) / 7",
};

// A case of the flash harness (harness/kernel_cases.hpp) with a score function and its inputs:
// bias (B, L), doc (L), slope (Hq), L = max(Nq, Nk).
AttentionOptions with_score_function(const qkv_test::Case& c, const char* function, Random& rng,
                                     qkv::Backend backend) {
  AttentionOptions o = qkv_test::options_of(c, backend);
  const int64_t length = std::max(c.q.size(2), c.k.size(2));
  o.score_mod = function;
  o.mod_inputs = {{"bias", rng.randn(Shape{c.q.size(0), length})},
                  {"doc", rng.uniform_tensor(Shape{length}, 0.0, 3.0)},
                  {"slope", rng.uniform_tensor(Shape{c.q.size(1)}, -1.0, 1.0)}};
  return o;
}

// Forward and backward into outputs poisoned with NaN (an element left unwritten fails).
Result poisoned_run(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& grad_output,
                 const AttentionOptions& o) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t b = q.size(0), hq = q.size(1), nq = q.size(2), hkv = k.size(1), nk = k.size(2);
  Result r;
  r.forward.output = Tensor::full(Shape{b, hq, nq, v.size(3)}, nan);
  r.forward.lse = Tensor::full(Shape{b, hq, nq}, nan);
  qkv::scaled_dot_product_attention_into(q, k, v, r.forward, o);
  r.grads.dq = Tensor::full(q.shape(), nan);
  r.grads.dk = Tensor::full(Shape{b, hkv, nk, k.size(3)}, nan);
  r.grads.dv = Tensor::full(Shape{b, hkv, nk, v.size(3)}, nan);
  qkv::scaled_dot_product_attention_backward_into(grad_output, q, k, v, r.forward, r.grads, o);
  return r;
}

// |got - want| <= tolerance * max(1, the largest |want|), elementwise.
void expect_close(const Tensor& got, const Tensor& want, double tolerance, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  double largest = 1;
  for (int64_t x = 0; x < want.numel(); ++x)
    if (std::isfinite(want.data()[x])) largest = std::max(largest, static_cast<double>(std::fabs(want.data()[x])));
  for (int64_t x = 0; x < got.numel(); ++x) {
    const float g = got.data()[x], w = want.data()[x];
    if (std::isinf(w) && g == w) continue;  // a row that saw nothing: lse -inf in both
    ASSERT_NEAR(g, w, tolerance * largest) << what << " at " << x;
  }
}

// Every mask kind of the harness, with random modifiers, GQA, odd shapes and sometimes dropout:
// flash's forward and backward (Backend::Flash) against the reference's, on every SIMD target
// flash was compiled for and 1 and 2 threads.
TEST(ScoreMod, FlashForwardAndBackwardMatchTheReferenceEverywhere) {
  Random rng;
  SCOPED_TRACE(rng.note());
  struct Checked {
    qkv_test::Case c;
    Tensor grad_output;
    AttentionOptions flash;
    Result want;
  };
  std::vector<Checked> cases;
  const qkv_test::Modifier modifiers[] = {qkv_test::Modifier::None, qkv_test::Modifier::Softcap,
                                          qkv_test::Modifier::Alibi, qkv_test::Modifier::All};
  size_t n = 0;
  for (qkv_test::MaskKind kind : qkv_test::kAllMasks) {
    const int64_t kv_heads = rng.integer(1, 2);
    const qkv_test::Sizes sizes{rng.integer(1, 2), kv_heads * rng.integer(1, 3), kv_heads, rng.integer(1, 150),
                                rng.integer(1, 150), rng.integer(1, 70), rng.integer(1, 70)};
    const qkv_test::Modifier modifier = modifiers[rng.integer(0, 3)];
    qkv_test::Case c = qkv_test::make_case(rng, sizes, kind, 1.0, rng.chance(0.2) ? 0.2f : 0.0f, modifier);
    const char* function = kScoreFunctions[n++ % std::size(kScoreFunctions)];
    c.name += std::string(" score_mod=") + function;
    AttentionOptions reference = with_score_function(c, function, rng, qkv::Backend::Reference);
    AttentionOptions flash = reference;
    flash.backend = qkv::Backend::Flash;
    const Tensor grad_output = rng.randn(Shape{sizes.batch, sizes.q_heads, sizes.nq, sizes.dv});
    const Result want = run(c.q, c.k, c.v, grad_output, reference);
    cases.push_back({std::move(c), grad_output, flash, want});
  }
  qkv_test::on_every_target_and_thread_count([&] {
    for (const Checked& x : cases) {
      SCOPED_TRACE(x.c.name);
      const Result got = poisoned_run(x.c.q, x.c.k, x.c.v, x.grad_output, x.flash);
      expect_close(got.forward.output, x.want.forward.output, 1e-4, "output");
      expect_close(got.forward.lse, x.want.forward.lse, 1e-4, "lse");
      expect_close(got.grads.dq, x.want.grads.dq, 2e-4, "dq");
      expect_close(got.grads.dk, x.want.grads.dk, 2e-4, "dk");
      expect_close(got.grads.dv, x.want.grads.dv, 2e-4, "dv");
    }
  });
}

// Auto with a score function (flash, where decode would serve few queries) agrees with the
// reference in both directions.
TEST(ScoreMod, AutoAgreesWithTheReferenceForFewAndManyQueries) {
  Random rng;
  SCOPED_TRACE(rng.note());
  for (const int64_t nq : {1, 3, 97}) {
    const Operands x = random_operands(rng, 1, 4, 2, nq, 300, 32);
    AttentionOptions automatic, reference;
    automatic.score_mod = reference.score_mod = "s - 0.05 * abs(q - k)";
    automatic.mask = reference.mask = Mask::causal(300 - nq);
    reference.backend = qkv::Backend::Reference;
    const Result got = poisoned_run(x.q, x.k, x.v, x.grad_output, automatic);
    const Result want = run(x.q, x.k, x.v, x.grad_output, reference);
    expect_close(got.forward.output, want.forward.output, 1e-4, "output");
    expect_close(got.grads.dq, want.grads.dq, 2e-4, "dq");
    expect_close(got.grads.dk, want.grads.dk, 2e-4, "dk");
  }
}

// ---- C++ callables (qkv/flex.hpp): each text function against its lambda twin.

// c as the type of s: a float, or a Dual constant (flat in s).
template <class S>
S constant(float c) {
  if constexpr (std::is_same_v<S, qkv::Dual>) {
    return qkv::Dual{c, 0.0f};
  } else {
    return c;
  }
}

TEST(ScoreMod, CallablesMatchTheirTextTwinsForwardAndBackward) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t batch = 2, nq = 37, nk = 101;
  const Operands x = random_operands(rng, batch, 4, 2, nq, nk, 24);
  const Tensor bias = rng.randn(Shape{batch, nk}), slope = rng.uniform_tensor(Shape{4}, -1.0, 1.0);
  const float* bias_data = bias.data();
  const float* slope_data = slope.data();
  struct Twin {
    const char* text;
    std::shared_ptr<const qkv::ScoreFunction> callable;
  };
  using qkv::exp;
  using qkv::max;
  using qkv::min;
  using qkv::tanh;
  const Twin twins[] = {
      {"s - 0.1 * abs(q - k)", qkv::score_function([](auto s, int64_t, int64_t, int64_t q, int64_t k) {
         return s - 0.1f * static_cast<float>(q > k ? q - k : k - q);
       })},
      {"3 * tanh(s / 3) + bias(k)", qkv::score_function([=](auto s, int64_t b, int64_t, int64_t, int64_t k) {
         return 3.0f * tanh(s / 3.0f) + bias_data[b * nk + k];
       })},
      {"where(q >= k, s * 1.5, s - 1) + slope(h) * k / 100 + max(s, -0.5) * exp(-0.01 * abs(q - k)) + min(s, 1)",
       qkv::score_function([=](auto s, int64_t, int64_t h, int64_t q, int64_t k) {
         using S = decltype(s);
         const float distance = static_cast<float>(q > k ? q - k : k - q);
         return (q >= k ? s * 1.5f : s - 1.0f) + slope_data[h] * static_cast<float>(k) / 100.0f +
                max(s, constant<S>(-0.5f)) * std::exp(-0.01f * distance) + min(s, constant<S>(1.0f));
       })},
  };
  for (const Twin& twin : twins)
    for (const qkv::Backend backend : {qkv::Backend::Flash, qkv::Backend::Reference, qkv::Backend::Auto}) {
      SCOPED_TRACE(std::string(twin.text) + " backend " + std::string(qkv::to_string(backend)));
      AttentionOptions text, callable;
      text.mask = callable.mask = Mask::causal(nk - nq);
      text.backend = callable.backend = backend;
      text.softcap = callable.softcap = 4.0f;
      text.score_mod = twin.text;
      text.mod_inputs = {{"bias", bias}, {"slope", slope}};
      callable.score_function = twin.callable;
      const Result want = run(x.q, x.k, x.v, x.grad_output, text);
      const Result got = poisoned_run(x.q, x.k, x.v, x.grad_output, callable);
      expect_close(got.forward.output, want.forward.output, 2e-5, "output");
      expect_close(got.forward.lse, want.forward.lse, 2e-5, "lse");
      expect_close(got.grads.dq, want.grads.dq, 1e-4, "dq");
      expect_close(got.grads.dk, want.grads.dk, 1e-4, "dk");
      expect_close(got.grads.dv, want.grads.dv, 1e-4, "dv");
    }
  AttentionOptions both;
  both.score_mod = "s";
  both.score_function = twins[0].callable;
  EXPECT_THROW(qkv::scaled_dot_product_attention(x.q, x.k, x.v, both), qkv::Error);
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
  AttentionOptions decode;
  decode.score_mod = "s * 2";
  decode.backend = qkv::Backend::Decode;
  EXPECT_NE(error_of(decode).find("backend Decode does not take score_mod"), std::string::npos) << error_of(decode);
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

// A callable's loops are compiled once per instruction set (qkv/flex.hpp, flex_detail::run):
// every copy this CPU runs gives, line by line (scores and slopes) and a tile at a time, what the
// function gives element by element in float64, on a line with odd steps and a ragged count.
TEST(ScoreMod, CallableCopiesPerInstructionSetAgree) {
  using qkv::flex_detail::Isa;
  Random rng;
  SCOPED_TRACE(rng.note());
  const auto f = [](auto s, int64_t, int64_t h, int64_t q, int64_t k) {
    return s * (1.0f + 0.5f * static_cast<float>(h)) - 0.1f * static_cast<float>(std::abs(q - k));
  };
  const qkv::ScoreLine at{1, 2, 7, 40, 3, -2};
  const size_t n = 48, count = 37, lines = 5;
  const int64_t line_key_step = 11;
  const std::vector<float> start = rng.randn(qkv::Shape{static_cast<int64_t>(n * lines)}).to_vector();
  const auto want = [&](size_t l, size_t x) {  // element x of line l, in float64
    const double q = static_cast<double>(at.i0 + static_cast<int64_t>(x) * at.query_step);
    const double k = static_cast<double>(at.j0 + static_cast<int64_t>(x) * at.key_step +
                                         static_cast<int64_t>(l) * line_key_step);
    return static_cast<double>(start[l * n + x]) * 2.0 - 0.1 * std::fabs(q - k);
  };
  for (const Isa isa : {Isa::Baseline, Isa::Avx2, Isa::Avx512}) {
    if (static_cast<int>(isa) > static_cast<int>(qkv::flex_detail::best_isa())) continue;
    SCOPED_TRACE("instruction set " + std::to_string(static_cast<int>(isa)));
    const qkv::ScoreCallable<decltype(f)> callable(f, isa);
    std::vector<float> s(start.begin(), start.begin() + n), slope(n, std::numeric_limits<float>::quiet_NaN());
    callable.line(at, n, count, s.data(), slope.data(), nullptr);
    for (size_t x = 0; x < n; ++x) {
      EXPECT_NEAR(s[x], x < count ? want(0, x) : start[x], 1e-5 * (1 + std::fabs(want(0, x)))) << "element " << x;
      if (x < count) EXPECT_EQ(slope[x], 2.0f) << "element " << x;
    }
    std::vector<float> tile = start;
    callable.tile(at, line_key_step, lines, n, count, tile.data(), nullptr);
    for (size_t l = 0; l < lines; ++l)
      for (size_t x = 0; x < n; ++x)
        EXPECT_NEAR(tile[l * n + x], x < count ? want(l, x) : start[l * n + x], 1e-5 * (1 + std::fabs(want(l, x))))
            << "line " << l << " element " << x;
  }
}
