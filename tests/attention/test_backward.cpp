// The backward of the functional core, scaled_dot_product_attention_backward:
//   - both backends against central finite differences in float64 of the loss sum(G * output),
//     the forward being the float64 oracle (harness/oracle.hpp), on small shapes: every mask kind, GQA,
//     Nq != Nk, Dk != Dv, dropout with a fixed seed, ranks 2 and 3;
//   - the flash kernel against the reference kernel on random larger shapes, both measured
//     against an analytic float64 backward (itself checked against the finite differences):
//     flash may be off by at most max(floor, 4 x the reference's own error), outputs poisoned
//     with NaN first, on 1 and 2 threads and on every SIMD target;
//   - the same bits on a repeat; zero gradients for rows that see no key and for keys no query
//     sees; non-finite values at hidden keys; errors that name the shapes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <omp.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "attention/kernels.hpp"
#include "harness/kernel_cases.hpp"
#include "harness/oracle.hpp"

namespace {

using qkv::AttentionGrads;
using qkv::AttentionOptions;
using qkv::AttentionResult;
using qkv::Backend;
using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;
using qkv_test::Case;
using qkv_test::MaskKind;
using qkv_test::Random;
using qkv_test::Sizes;
using qkv_test::kAllMasks;
using qkv_test::make_case;

constexpr double kInf = std::numeric_limits<double>::infinity();

using qkv_test::options_of;

qkv_test::OracleDropout dropout_of(const Case& c) {
  qkv_test::OracleDropout dropout;
  if (c.dropout_p > 0) {
    dropout.p = c.dropout_p;
    dropout.keeps = [seed = c.seed, p = c.dropout_p](int64_t b, int64_t h, int64_t i, int64_t j) {
      return qkv::dropout_keeps(seed, b, h, i, j, p);
    };
  }
  return dropout;
}

// Float64 gradients of sum(G * attention(q, k, v)) in the layout of q, k and v.
struct Grads64 {
  std::vector<double> dq, dk, dv, dsinks;  // dsinks empty without sinks
  // analytic_backward's only: how far float32 logits move each gradient. A logit of magnitude M
  // is known to float32 within about eps M, so a weight recomputed from it (and from row stats
  // another kernel computed) is off by that much relatively, and D = sum_j P dP with it; each
  // gradient then moves by up to eps times the sum of its terms' magnitudes, each term times its
  // row's M (the largest |logit| of a key the row sees: ALiBi over 6000 keys puts whole rows
  // near -600), kept here.
  std::vector<double> dq_weight_terms, dk_weight_terms, dv_weight_terms;
};

// Central finite differences of the float64 oracle, step h on every element of q, k and v.
Grads64 finite_differences(const Case& c, const std::vector<double>& g) {
  const qkv_test::AttentionDims d = qkv_test::dims_of(c.q, c.k, c.v);
  std::vector<double> q = qkv_test::to_doubles(c.q), k = qkv_test::to_doubles(c.k), v = qkv_test::to_doubles(c.v);
  const qkv_test::OracleDropout dropout = dropout_of(c);
  qkv_test::OracleModifiers modifiers = c.modifiers();
  auto loss = [&] {
    const qkv_test::OracleResult r = qkv_test::attention_oracle(d, q, k, v, c.scale, c.bias, dropout, modifiers);
    double total = 0;
    for (size_t n = 0; n < g.size(); ++n) total += g[n] * r.output[n];
    return total;
  };
  constexpr double h = 1e-5;
  auto differentiate = [&](std::vector<double>& x) {
    std::vector<double> grad(x.size());
    for (size_t n = 0; n < x.size(); ++n) {
      const double saved = x[n];
      x[n] = saved + h;
      const double up = loss();
      x[n] = saved - h;
      const double down = loss();
      x[n] = saved;
      grad[n] = (up - down) / (2 * h);
    }
    return grad;
  };
  Grads64 grads;
  grads.dq = differentiate(q);
  grads.dk = differentiate(k);
  grads.dv = differentiate(v);
  grads.dsinks = differentiate(modifiers.sinks);
  return grads;
}

// The analytic backward in float64, written from the textbook formulas independently of the
// kernels: P = softmax(S), P' = dropout(P), dV = P'^T G, dP = dropout'(G V^T),
// dS = P (dP - sum_j P dP), dQ = scale dS K, dK = scale dS^T Q (summed over a group's heads).
Grads64 analytic_backward(const Case& c, const std::vector<double>& g) {
  const qkv_test::AttentionDims d = qkv_test::dims_of(c.q, c.k, c.v);
  const std::vector<double> q = qkv_test::to_doubles(c.q), k = qkv_test::to_doubles(c.k),
                            v = qkv_test::to_doubles(c.v);
  const qkv_test::OracleDropout dropout = dropout_of(c);
  const qkv_test::OracleModifiers modifiers = c.modifiers();
  Grads64 grads{std::vector<double>(q.size()), std::vector<double>(k.size()), std::vector<double>(v.size()),
                std::vector<double>(modifiers.sinks.size())};
  grads.dq_weight_terms.resize(q.size());
  grads.dk_weight_terms.resize(k.size());
  grads.dv_weight_terms.resize(v.size());
  const int64_t group = d.q_heads / d.kv_heads;
  std::vector<double> weights(static_cast<size_t>(d.kv_len)), grad_weights(static_cast<size_t>(d.kv_len));
  std::vector<double> softcap_slope(static_cast<size_t>(d.kv_len), 1.0);
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t h = 0; h < d.q_heads; ++h) {
      const int64_t kv_base = (b * d.kv_heads + h / group) * d.kv_len;
      for (int64_t i = 0; i < d.q_len; ++i) {
        const int64_t row = (b * d.q_heads + h) * d.q_len + i;
        const double* q_row = &q[static_cast<size_t>(row * d.qk_dim)];
        const double* g_row = &g[static_cast<size_t>(row * d.v_dim)];
        const double sink = modifiers.sink(h);
        double row_max = sink, row_logit = std::isfinite(sink) ? std::abs(sink) : 0.0;
        for (int64_t j = 0; j < d.kv_len; ++j) {
          double dot = 0;
          for (int64_t x = 0; x < d.qk_dim; ++x) dot += q_row[x] * k[static_cast<size_t>((kv_base + j) * d.qk_dim + x)];
          // softcap's derivative: d(cap tanh(s / cap))/ds = 1 - tanh^2; ALiBi's is 1
          if (modifiers.softcap > 0) {
            const double t = std::tanh(dot * c.scale / modifiers.softcap);
            softcap_slope[static_cast<size_t>(j)] = 1 - t * t;
          }
          double score = modifiers.modify(dot * c.scale, b, h, i, j, d.q_len, d.kv_len);
          if (c.bias) {
            const double extra = c.bias(b, h, i, j);
            score = extra == -kInf ? -kInf : score + extra;
          }
          weights[static_cast<size_t>(j)] = score;
          row_max = std::max(row_max, score);
          if (std::isfinite(score)) row_logit = std::max(row_logit, std::abs(score));
        }
        if (row_max == -kInf) continue;  // sees no key: zero gradients
        double row_sum = sink == -kInf ? 0.0 : std::exp(sink - row_max);
        for (double& w : weights) row_sum += (w = std::exp(w - row_max));
        double row_dot = 0, row_dot_terms = 0;
        for (int64_t j = 0; j < d.kv_len; ++j) {
          double& w = weights[static_cast<size_t>(j)];
          w /= row_sum;
          const double survivor = !dropout.keeps ? 1.0 : dropout.keeps(b, h, i, j) ? 1.0 / (1.0 - dropout.p) : 0.0;
          double dp = 0;
          for (int64_t x = 0; x < d.v_dim; ++x) {
            const size_t vx = static_cast<size_t>((kv_base + j) * d.v_dim + x);
            dp += g_row[x] * v[vx];
            grads.dv[vx] += survivor * w * g_row[x];
            grads.dv_weight_terms[vx] += row_logit * survivor * w * std::abs(g_row[x]);
          }
          grad_weights[static_cast<size_t>(j)] = survivor * dp;
          row_dot += w * grad_weights[static_cast<size_t>(j)];
          row_dot_terms += w * std::abs(grad_weights[static_cast<size_t>(j)]);
        }
        // The sink's weight exp(sink - max) / sum has dP = 0 (no value): dS_sink = -P_sink D.
        if (sink != -kInf) grads.dsinks[static_cast<size_t>(h)] -= std::exp(sink - row_max) / row_sum * row_dot;
        for (int64_t j = 0; j < d.kv_len; ++j) {
          const double ds = weights[static_cast<size_t>(j)] * (grad_weights[static_cast<size_t>(j)] - row_dot) *
                            softcap_slope[static_cast<size_t>(j)];
          const double ds_terms = row_logit * weights[static_cast<size_t>(j)] *
                                  (std::abs(grad_weights[static_cast<size_t>(j)] - row_dot) + row_dot_terms) *
                                  softcap_slope[static_cast<size_t>(j)];
          for (int64_t x = 0; x < d.qk_dim; ++x) {
            const size_t kx = static_cast<size_t>((kv_base + j) * d.qk_dim + x);
            grads.dq[static_cast<size_t>(row * d.qk_dim + x)] += c.scale * ds * k[kx];
            grads.dk[kx] += c.scale * ds * q_row[x];
            grads.dq_weight_terms[static_cast<size_t>(row * d.qk_dim + x)] += c.scale * ds_terms * std::abs(k[kx]);
            grads.dk_weight_terms[kx] += c.scale * ds_terms * std::abs(q_row[x]);
          }
        }
      }
    }
  return grads;
}

// Compares library gradients with float64 ones at `tolerance` (relative, absolute below 1).
void expect_close(const AttentionGrads& got, const Grads64& want, double tolerance, const std::string& what) {
  EXPECT_EQ(got.dsinks.defined(), !want.dsinks.empty()) << what << ": dsinks";
  for (auto [name, tensor, values] : {std::tuple{"dq", &got.dq, &want.dq}, {"dk", &got.dk, &want.dk},
                                      {"dv", &got.dv, &want.dv}, {"dsinks", &got.dsinks, &want.dsinks}}) {
    if (values->empty() && !tensor->defined()) continue;
    const qkv_test::Comparison c = qkv_test::compare(*tensor, *values, tolerance);
    EXPECT_TRUE(c.ok) << what << " " << name << ":\n" << c.detail;
  }
}

// ---------------------------------------------------------------------------------------------
// Finite differences

// Small sizes: GQA (Hq = 2 Hkv), Nq != Nk, Dk != Dv.
constexpr Sizes kSmall{2, 4, 2, 5, 7, 4, 3};
// Gradients of O(1) values in float32 against float64 differences with h = 1e-5 (error ~1e-10).
constexpr double kFiniteDifferenceTolerance = 2e-4;

void check_against_finite_differences(const Case& c) {
  Random rng(c.seed);
  const Shape output_shape{c.q.size(0), c.q.size(1), c.q.size(2), c.v.size(3)};
  const Tensor grad_output = rng.randn(output_shape);
  const Grads64 want = finite_differences(c, qkv_test::to_doubles(grad_output));
  const Grads64 analytic = analytic_backward(c, qkv_test::to_doubles(grad_output));
  // The test's own analytic backward, used on larger shapes below, agrees with the differences.
  for (auto [name, mine, theirs] : {std::tuple{"dq", &analytic.dq, &want.dq}, {"dk", &analytic.dk, &want.dk},
                                    {"dv", &analytic.dv, &want.dv}, {"dsinks", &analytic.dsinks, &want.dsinks}})
    for (size_t n = 0; n < mine->size(); ++n)
      ASSERT_NEAR((*mine)[n], (*theirs)[n], 1e-6 * std::max(1.0, std::abs((*theirs)[n])))
          << c.name << ": the test's analytic backward disagrees with finite differences at " << name << "[" << n << "]";
  for (Backend backend : {Backend::Reference, Backend::Flash, Backend::Auto}) {
    const AttentionOptions options = options_of(c, backend);
    const AttentionResult forward = qkv::scaled_dot_product_attention(c.q, c.k, c.v, options);
    const AttentionGrads grads = qkv::scaled_dot_product_attention_backward(grad_output, c.q, c.k, c.v, forward, options);
    ASSERT_EQ(grads.dq.shape(), c.q.shape());
    ASSERT_EQ(grads.dk.shape(), c.k.shape());
    ASSERT_EQ(grads.dv.shape(), c.v.shape());
    expect_close(grads, want, kFiniteDifferenceTolerance, c.name + " backend " + std::string(qkv::to_string(backend)));
  }
}

TEST(Backward, FiniteDifferencesEveryMaskKind) {
  Random rng;
  SCOPED_TRACE(rng.note());
  for (MaskKind kind : kAllMasks)
    for (int repeat = 0; repeat < 2; ++repeat) check_against_finite_differences(make_case(rng, kSmall, kind, 1.0, 0.0f));
}

// Each modifier alone and all together: dq, dk, dv and dsinks against central differences of the
// float64 oracle, on every backend.
TEST(Backward, FiniteDifferencesScoreModifiers) {
  Random rng;
  SCOPED_TRACE(rng.note());
  for (qkv_test::Modifier m : qkv_test::kAllModifiers)
    for (MaskKind kind : {MaskKind::None, MaskKind::Causal, MaskKind::EmptyRows, MaskKind::Combined})
      check_against_finite_differences(make_case(rng, kSmall, kind, 1.0, 0.0f, m));
  check_against_finite_differences(make_case(rng, kSmall, MaskKind::Causal, 1.0, 0.3f, qkv_test::Modifier::All));
}

// Strided keys gathered by residues (a stride >= 64, so sequences past it), each kind of rest.
TEST(Backward, FiniteDifferencesStridedResidues) {
  Random rng;
  SCOPED_TRACE(rng.note());
  for (int variant : {0, 1, 3, 5})
    check_against_finite_differences(qkv_test::strided_residue_case(rng, {1, 1, 1, 130, 140, 2, 2}, variant, 0.0f,
                                                                    variant == 1 ? qkv_test::Modifier::Alibi
                                                                                 : qkv_test::Modifier::None));
}

TEST(Backward, FiniteDifferencesShapes) {
  Random rng;
  SCOPED_TRACE(rng.note());
  for (const Sizes& s : {Sizes{1, 1, 1, 1, 1, 1, 1}, Sizes{1, 3, 1, 9, 4, 5, 2}, Sizes{2, 2, 2, 3, 11, 2, 6},
                         Sizes{1, 6, 2, 4, 4, 3, 3}, Sizes{1, 1, 1, 6, 6, 8, 1}})
    for (MaskKind kind : {MaskKind::None, MaskKind::Causal, MaskKind::Combined})
      check_against_finite_differences(make_case(rng, s, kind, 1.0, 0.0f));
}

TEST(Backward, FiniteDifferencesDropout) {
  Random rng;
  SCOPED_TRACE(rng.note());
  for (MaskKind kind : {MaskKind::None, MaskKind::Causal, MaskKind::KeyLengths, MaskKind::EmptyRows, MaskKind::Combined})
    for (float p : {0.2f, 0.6f}) {
      Case c = make_case(rng, kSmall, kind, 1.0, p);
      c.seed = 1234;  // a fixed dropout pattern
      check_against_finite_differences(c);
    }
}

TEST(Backward, FiniteDifferencesRanks2And3) {
  Random rng;
  SCOPED_TRACE(rng.note());
  // (N, D) and (B, N, D): one head; the gradients come back in the inputs' shapes.
  for (int rank : {2, 3}) {
    const int64_t batch = rank == 2 ? 1 : 2;
    Case c = make_case(rng, {batch, 1, 1, 4, 6, 3, 2}, MaskKind::Causal, 1.0, 0.0f);
    const Tensor grad_output = rng.randn(Shape{batch, 1, 4, 2});
    const Grads64 want = finite_differences(c, qkv_test::to_doubles(grad_output));
    auto drop_heads = [&](const Tensor& t) {
      return rank == 2 ? t.reshape(Shape{t.size(2), t.size(3)}) : t.reshape(Shape{t.size(0), t.size(2), t.size(3)});
    };
    const Tensor q = drop_heads(c.q), k = drop_heads(c.k), v = drop_heads(c.v), g = drop_heads(grad_output);
    for (Backend backend : {Backend::Reference, Backend::Flash}) {
      const AttentionOptions options = options_of(c, backend);
      const AttentionResult forward = qkv::scaled_dot_product_attention(q, k, v, options);
      const AttentionGrads grads = qkv::scaled_dot_product_attention_backward(g, q, k, v, forward, options);
      EXPECT_EQ(grads.dq.shape(), q.shape());
      EXPECT_EQ(grads.dk.shape(), k.shape());
      EXPECT_EQ(grads.dv.shape(), v.shape());
      expect_close(grads, want, kFiniteDifferenceTolerance, "rank " + std::to_string(rank));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Flash against reference, kernels called directly

// A case with its forward (reference kernel), a random dO and the float64 gradients.
struct BackwardCase {
  Case c;
  qkv_test::KernelOutputs forward;
  std::vector<float> grad_output, row_shift, row_scale;
  Grads64 want;
  double reference_error[3] = {0, 0, 0};  // dq, dk, dv against `want`
  double precision_allowance = 0;         // at a lower matmul precision: see precision_allowance()
};

struct GradVectors {
  std::vector<float> dq, dk, dv, dsinks;
};

qkv::detail::AttentionBackwardProblem backward_problem_of(const BackwardCase& bc, GradVectors& g) {
  qkv_test::KernelOutputs unused;
  qkv::detail::AttentionProblem forward = qkv_test::problem_of(bc.c, unused);
  forward.output = {};
  forward.lse = forward.row_max = forward.row_sum = nullptr;
  const int64_t hq = bc.c.q.size(1), hkv = bc.c.k.size(1), nq = bc.c.q.size(2), nk = bc.c.k.size(2);
  const int64_t dk = bc.c.q.size(3), dv = bc.c.v.size(3);
  using qkv_test::packed_rows;
  return {std::move(forward), packed_rows(bc.forward.output.data(), hq, nq, dv),
          packed_rows(bc.grad_output.data(), hq, nq, dv), bc.row_shift.data(), bc.row_scale.data(),
          packed_rows(g.dq.data(), hq, nq, dk), packed_rows(g.dk.data(), hkv, nk, dk), packed_rows(g.dv.data(), hkv, nk, dv),
          bc.c.sinks.defined() ? g.dsinks.data() : nullptr};
}

// Runs a backward kernel into NaN-poisoned gradients (dsinks through sink_gradients, as the library does).
GradVectors run_backward(void (*kernel)(const qkv::detail::AttentionBackwardProblem&), const BackwardCase& bc) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  GradVectors g{std::vector<float>(bc.want.dq.size(), nan), std::vector<float>(bc.want.dk.size(), nan),
                std::vector<float>(bc.want.dv.size(), nan), std::vector<float>(bc.want.dsinks.size(), nan)};
  const qkv::detail::AttentionBackwardProblem problem = backward_problem_of(bc, g);
  kernel(problem);
  qkv::detail::sink_gradients(problem);
  return g;
}

// At a lower matmul precision (c.precision: the products on AMX tiles) each operand of a product
// is kept to e relative (qkv_test::operand_error), so a recomputed score is off by about
// 2 e scale sum_d |q_d k_d| and dP by 2 e sum_c |dO_c v_c|, and P, dS and the gradients follow:
// the allowance, relative as compare() measures, is 2 e (1 + the largest of each sum). Measured
// over this file's cases (High and Medium, 2520 comparisons, logits up to x10) the gradients
// were off by at most 0.13 of it; with one of High's cross products dropped, by up to 78.
double precision_allowance(const Case& c, const std::vector<float>& grad_output) {
  if (c.precision == qkv::MatmulPrecision::Highest) return 0;
  const Tensor g = Tensor::from(grad_output, Shape{c.q.size(0), c.q.size(1), c.q.size(2), c.v.size(3)});
  return 2 * qkv_test::operand_error(c.precision) *
         (1 + c.scale * qkv_test::max_abs_dot_sum(c.q, c.k) + qkv_test::max_abs_dot_sum(g, c.v));
}

BackwardCase prepare(Case c, Random& rng) {
  BackwardCase bc;
  bc.c = std::move(c);
  const int64_t rows = bc.c.q.size(0) * bc.c.q.size(1) * bc.c.q.size(2);
  qkv::detail::reference_attention(qkv_test::problem_of(bc.c, bc.forward));
  bc.row_shift.resize(static_cast<size_t>(rows));
  bc.row_scale.resize(static_cast<size_t>(rows));
  qkv::detail::weight_row_stats(bc.forward.row_max.data(), bc.forward.row_sum.data(), static_cast<size_t>(rows),
                                bc.row_shift.data(), bc.row_scale.data());
  bc.grad_output = rng.normals(rows * bc.c.v.size(3));
  bc.want = analytic_backward(bc.c, std::vector<double>(bc.grad_output.begin(), bc.grad_output.end()));
  bc.precision_allowance = precision_allowance(bc.c, bc.grad_output);
  const GradVectors reference = run_backward(qkv::detail::reference_attention_backward, bc);
  const std::vector<float>* got[3] = {&reference.dq, &reference.dk, &reference.dv};
  const std::vector<double>* want[3] = {&bc.want.dq, &bc.want.dk, &bc.want.dv};
  for (int n = 0; n < 3; ++n) {
    bc.reference_error[n] = qkv_test::compare(*got[n], *want[n], kInf).max_rel_diff;
    EXPECT_TRUE(std::isfinite(bc.reference_error[n])) << "the reference backward itself is off: " << bc.c.name;
  }
  return bc;
}

// Flash's tolerance: the forward tests' (harness/kernel_cases.hpp), per gradient: a floor, a multiple of
// the reference's own error, and what float32 logits allow (Grads64's weight terms). Flash
// recomputes each weight from its own logit and the reference forward's row stats, so where
// logits are huge its weights differ from the reference's by their logits' rounding (a row whose
// largest logit was -626, from ALiBi, got P = 1 +- 1e-4 there, where the reference, computing it
// as its forward did, got exactly 1).
constexpr double kFlashFloor = 2e-4;

// The largest sum of weight-term magnitudes, relative as compare() measures (to max(1, |want|)).
double largest_weight_terms(const std::vector<double>& terms, const std::vector<double>& want) {
  double largest = 0;
  for (size_t n = 0; n < terms.size(); ++n) largest = std::max(largest, terms[n] / std::max(1.0, std::abs(want[n])));
  return largest;
}

void check_flash(const BackwardCase& bc) {
  const GradVectors flash = run_backward(qkv::detail::flash_attention_backward, bc);
  const char* names[4] = {"dq", "dk", "dv", "dsinks"};
  const std::vector<float>* got[4] = {&flash.dq, &flash.dk, &flash.dv, &flash.dsinks};
  const std::vector<double>* want[4] = {&bc.want.dq, &bc.want.dk, &bc.want.dv, &bc.want.dsinks};
  const std::vector<double>* weight_terms[3] = {&bc.want.dq_weight_terms, &bc.want.dk_weight_terms,
                                                &bc.want.dv_weight_terms};
  const double logit_error = qkv_test::kScoreEpsilons * std::numeric_limits<float>::epsilon();
  for (int n = 0; n < 4; ++n) {
    // dsinks sums over every row of a head: as dQ's error, times the rows it adds.
    const double error = n < 3 ? bc.reference_error[n] : bc.reference_error[0] * static_cast<double>(bc.c.q.size(2));
    const double from_logits = n < 3 ? logit_error * largest_weight_terms(*weight_terms[n], *want[n]) : 0.0;
    // dsinks comes from the forward's row stats and D, no product: no precision allowance.
    const double from_precision = n < 3 ? bc.precision_allowance : 0.0;
    const double tolerance =
        std::max({kFlashFloor, qkv_test::kToleranceFactor * error, from_logits, from_precision});
    const qkv_test::Comparison c = qkv_test::compare(*got[n], *want[n], tolerance);
    EXPECT_TRUE(c.ok) << bc.c.name << " " << names[n] << " (reference error " << bc.reference_error[n] << "):\n"
                      << c.detail;
  }
}

void check_flash_everywhere(const std::vector<BackwardCase>& cases) {
  qkv_test::on_every_target_and_thread_count([&] {
    for (const BackwardCase& bc : cases) check_flash(bc);
  });
}

Sizes random_sizes(Random& rng) {
  const int64_t lengths[] = {1, 3, 17, 65, 113};
  auto length = [&] { return rng.chance(0.5) ? lengths[rng.integer(0, 4)] : rng.integer(1, 150); };
  const int64_t dims[] = {1, 7, 16, 33, 64};
  auto dim = [&] { return rng.chance(0.6) ? dims[rng.integer(0, 4)] : rng.integer(1, 80); };
  const int64_t kv_heads = rng.integer(1, 2);
  return {rng.integer(1, 2), kv_heads * rng.integer(1, 3), kv_heads, length(), length(), dim(), dim()};
}

TEST(Backward, FlashMatchesReferenceEveryMaskKind) {
  Random rng;
  SCOPED_TRACE(rng.note());
  std::vector<BackwardCase> cases;
  for (MaskKind kind : kAllMasks) cases.push_back(prepare(make_case(rng, random_sizes(rng), kind, 1.0, 0.0f), rng));
  check_flash_everywhere(cases);
}

TEST(Backward, FlashMatchesReferenceWithScoreModifiers) {
  Random rng;
  SCOPED_TRACE(rng.note());
  std::vector<BackwardCase> cases;
  for (qkv_test::Modifier m : qkv_test::kAllModifiers)
    for (MaskKind kind : kAllMasks)
      cases.push_back(prepare(make_case(rng, random_sizes(rng), kind, 1.0, rng.chance(0.3) ? 0.2f : 0.0f, m), rng));
  check_flash_everywhere(cases);
}

TEST(Backward, FlashMatchesReferenceLargerShapesAndDropout) {
  Random rng;
  SCOPED_TRACE(rng.note());
  std::vector<BackwardCase> cases;
  // Big enough to run threaded, with one (b, g) pair (so the keys split into chunks and dQ
  // partials) and with several.
  cases.push_back(prepare(make_case(rng, {1, 2, 1, 300, 333, 64, 48}, MaskKind::Causal, 1.0, 0.0f), rng));
  cases.push_back(prepare(make_case(rng, {2, 4, 2, 150, 130, 32, 32}, MaskKind::Combined, 1.0, 0.0f), rng));
  cases.push_back(prepare(make_case(rng, {1, 1, 1, 129, 400, 40, 24}, MaskKind::WindowRight, 1.0, 0.0f), rng));
  for (MaskKind kind : {MaskKind::None, MaskKind::Causal, MaskKind::EmptyRows})
    for (float p : {0.1f, 0.5f}) cases.push_back(prepare(make_case(rng, random_sizes(rng), kind, 1.0, p), rng));
  cases.push_back(prepare(make_case(rng, {1, 2, 1, 200, 260, 64, 64}, MaskKind::Causal, 1.0, 0.3f), rng));
  check_flash_everywhere(cases);
}

// The strided residues (flash/backward.cpp, as the forward's): long enough for many residue and
// key tiles, every kind of `rest`, GQA, Nq != Nk, modifiers and dropout, against the float64
// analytic backward on every target.
TEST(Backward, FlashStridedResiduesOnLongSequences) {
  Random rng;
  SCOPED_TRACE(rng.note());
  using qkv_test::Modifier;
  using qkv_test::strided_residue_case;
  std::vector<BackwardCase> cases;
  cases.push_back(prepare(strided_residue_case(rng, {1, 2, 1, 1500, 1500, 16, 24}, 0, 0.0f), rng));
  cases.push_back(prepare(strided_residue_case(rng, {2, 2, 2, 900, 1300, 8, 8}, 0, 0.2f, Modifier::All), rng));
  cases.push_back(prepare(strided_residue_case(rng, {1, 4, 2, 70, 6000, 16, 8}, 1, 0.0f, Modifier::Alibi), rng));
  cases.push_back(prepare(strided_residue_case(rng, {1, 1, 1, 1000, 900, 24, 24}, 2, 0.0f, Modifier::Sinks), rng));
  cases.push_back(prepare(strided_residue_case(rng, {1, 2, 1, 800, 800, 7, 9}, 3, 0.1f, Modifier::Softcap), rng));
  cases.push_back(prepare(strided_residue_case(rng, {2, 2, 1, 700, 900, 12, 12}, 4, 0.0f), rng));
  cases.push_back(prepare(strided_residue_case(rng, {1, 2, 2, 1100, 1100, 8, 1}, 5, 0.0f, Modifier::All), rng));
  check_flash_everywhere(cases);
}

TEST(Backward, FlashIsBitIdenticalOnRepeat) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int threads_before = omp_get_max_threads();
  for (const Sizes& s : {Sizes{1, 2, 1, 300, 300, 64, 64}, Sizes{2, 4, 2, 200, 180, 32, 40}}) {
    const BackwardCase bc = prepare(make_case(rng, s, MaskKind::Causal, 1.0, 0.1f), rng);
    for (int threads : {1, 2}) {
      omp_set_num_threads(threads);
      const GradVectors first = run_backward(qkv::detail::flash_attention_backward, bc);
      for (int repeat = 0; repeat < 3; ++repeat) {
        const GradVectors again = run_backward(qkv::detail::flash_attention_backward, bc);
        EXPECT_EQ(std::memcmp(first.dq.data(), again.dq.data(), first.dq.size() * sizeof(float)), 0) << "dq, threads " << threads;
        EXPECT_EQ(std::memcmp(first.dk.data(), again.dk.data(), first.dk.size() * sizeof(float)), 0) << "dk, threads " << threads;
        EXPECT_EQ(std::memcmp(first.dv.data(), again.dv.data(), first.dv.size() * sizeof(float)), 0) << "dv, threads " << threads;
      }
    }
  }
  omp_set_num_threads(threads_before);
}

// ---------------------------------------------------------------------------------------------
// Lower matmul precision (MatmulPrecision High, Medium): the five products on AMX tiles, against
// the float64 backward with precision_allowance's tolerance. Dims that are multiples of 16 take
// the tiles, others stay float32; lengths past a key block (256) and odd ones, so pairs start
// and end mid-block and mid-tile.

using qkv_test::with_precision;

Sizes amx_sizes(Random& rng) {
  const int64_t lengths[] = {1, 17, 100, 257, 300};
  auto length = [&] { return rng.chance(0.5) ? lengths[rng.integer(0, 4)] : rng.integer(1, 320); };
  const int64_t dims[] = {16, 32, 64, 80, 128};
  auto dim = [&] { return rng.chance(0.9) ? dims[rng.integer(0, 4)] : rng.integer(1, 130); };
  const int64_t kv_heads = rng.integer(1, 2);
  return {rng.integer(1, 2), kv_heads * rng.integer(1, 3), kv_heads, length(), length(), dim(), dim()};
}

TEST(Backward, LowerPrecisionEveryMaskKind) {
  QKV_SKIP_WITHOUT_AMX();
  Random rng;
  SCOPED_TRACE(rng.note());
  std::vector<BackwardCase> cases;
  for (qkv::MatmulPrecision precision : {qkv::MatmulPrecision::High, qkv::MatmulPrecision::Medium})
    for (MaskKind kind : kAllMasks)
      cases.push_back(prepare(with_precision(make_case(rng, amx_sizes(rng), kind, 1.0, 0.0f), precision), rng));
  check_flash_everywhere(cases);
}

TEST(Backward, LowerPrecisionModifiersDropoutAndLongRows) {
  QKV_SKIP_WITHOUT_AMX();
  Random rng;
  SCOPED_TRACE(rng.note());
  using qkv_test::Modifier;
  std::vector<BackwardCase> cases;
  for (qkv::MatmulPrecision precision : {qkv::MatmulPrecision::High, qkv::MatmulPrecision::Medium}) {
    for (Modifier m : qkv_test::kAllModifiers)
      cases.push_back(prepare(
          with_precision(make_case(rng, amx_sizes(rng), MaskKind::Causal, 1.0, rng.chance(0.5) ? 0.2f : 0.0f, m),
                         precision),
          rng));
    cases.push_back(
        prepare(with_precision(make_case(rng, {1, 2, 1, 600, 600, 64, 64}, MaskKind::Causal, 1.0, 0.0f), precision), rng));
    cases.push_back(
        prepare(with_precision(make_case(rng, {2, 4, 2, 150, 530, 48, 32}, MaskKind::Window, 1.0, 0.1f), precision), rng));
    cases.push_back(prepare(
        with_precision(qkv_test::strided_residue_case(rng, {1, 2, 1, 700, 700, 32, 32}, 0, 0.0f, Modifier::Alibi),
                       precision),
        rng));
  }
  // Scores in the tens: High only (Medium's bound is then no test).
  cases.push_back(prepare(
      with_precision(make_case(rng, {1, 2, 2, 200, 333, 96, 32}, MaskKind::None, 10.0, 0.0f), qkv::MatmulPrecision::High),
      rng));
  check_flash_everywhere(cases);
}

// The tiles ran: High's gradients differ from Highest's somewhere, by little; Medium's by more.
TEST(Backward, LowerPrecisionTheTilesRun) {
  QKV_SKIP_WITHOUT_AMX();
  Random rng;
  SCOPED_TRACE(rng.note());
  const BackwardCase base = prepare(make_case(rng, {1, 2, 1, 300, 300, 64, 64}, MaskKind::Causal, 1.0, 0.0f), rng);
  const qkv::MatmulPrecision levels[3] = {qkv::MatmulPrecision::Highest, qkv::MatmulPrecision::High,
                                          qkv::MatmulPrecision::Medium};
  GradVectors grads[3];
  for (int n = 0; n < 3; ++n) {
    BackwardCase at = base;
    at.c.precision = levels[n];
    grads[n] = run_backward(qkv::detail::flash_attention_backward, at);
  }
  for (auto [name, member] : {std::pair{"dq", &GradVectors::dq}, {"dk", &GradVectors::dk}, {"dv", &GradVectors::dv}})
    qkv_test::expect_tiles_ran(grads[0].*member, grads[1].*member, grads[2].*member, 1e-2, name);
}

// Where the tiles do not run the precision is only a permission: Highest's bits (dims that are
// no multiple of 16; every case on a CPU without AMX).
TEST(Backward, LowerPrecisionChangesNothingWhereTheTilesDoNotRun) {
  Random rng;
  SCOPED_TRACE(rng.note());
  std::vector<Sizes> sizes{{1, 2, 1, 130, 300, 33, 40}};
  if (!qkv_test::without_amx().empty()) sizes.push_back({1, 2, 1, 130, 300, 64, 64});
  for (const Sizes& s : sizes) {
    const BackwardCase highest = prepare(make_case(rng, s, MaskKind::Causal, 1.0, 0.0f), rng);
    BackwardCase high = highest;
    high.c.precision = qkv::MatmulPrecision::High;
    const GradVectors a = run_backward(qkv::detail::flash_attention_backward, highest);
    const GradVectors b = run_backward(qkv::detail::flash_attention_backward, high);
    EXPECT_EQ(std::memcmp(a.dq.data(), b.dq.data(), a.dq.size() * sizeof(float)), 0) << qkv_test::describe(s);
    EXPECT_EQ(std::memcmp(a.dk.data(), b.dk.data(), a.dk.size() * sizeof(float)), 0) << qkv_test::describe(s);
    EXPECT_EQ(std::memcmp(a.dv.data(), b.dv.data(), a.dv.size() * sizeof(float)), 0) << qkv_test::describe(s);
  }
}

// Each of the five products runs on the tiles. With every value of Q, K, V and dO a multiple of
// 1/8 below 1 (exact in one bf16) and d = 32, S^T = K Qt and dP'^T = V dOt are exact on tiles and
// in float32 alike, so P and dS are Highest's bits; then dV = P'^T dO, dK = dS^T Q and
// dQ = dS K each differ from Highest's only if that product ran on the tiles, on P'^T's and dS^T's
// parts.
TEST(Backward, LowerPrecisionEveryProductOnTheTiles) {
  QKV_SKIP_WITHOUT_AMX();
  Random rng;
  SCOPED_TRACE(rng.note());
  BackwardCase highest = prepare(make_case(rng, {1, 2, 1, 100, 150, 32, 32}, MaskKind::Causal, 1.0, 0.0f), rng);
  const auto eighths = [&](Tensor& t) {
    t = t.clone();
    for (int64_t e = 0; e < t.numel(); ++e) t.data()[e] = static_cast<float>(rng.integer(-7, 7)) / 8;
  };
  eighths(highest.c.q);
  eighths(highest.c.k);
  eighths(highest.c.v);
  for (float& g : highest.grad_output) g = static_cast<float>(rng.integer(-7, 7)) / 8;
  highest.c.scale = 1.0;  // scale * Q stays exact
  qkv::detail::reference_attention(qkv_test::problem_of(highest.c, highest.forward));
  const int64_t rows = 2 * 100;
  qkv::detail::weight_row_stats(highest.forward.row_max.data(), highest.forward.row_sum.data(),
                                static_cast<size_t>(rows), highest.row_shift.data(), highest.row_scale.data());
  BackwardCase high = highest;
  high.c.precision = qkv::MatmulPrecision::High;
  const GradVectors a = run_backward(qkv::detail::flash_attention_backward, highest);
  const GradVectors b = run_backward(qkv::detail::flash_attention_backward, high);
  for (auto [name, x, y] : {std::tuple{"dQ = dS K", &a.dq, &b.dq}, {"dK = dS^T Q", &a.dk, &b.dk},
                            {"dV = P'^T dO", &a.dv, &b.dv}}) {
    const double diff = qkv_test::largest_difference(*y, *x);
    const double largest = qkv_test::largest_difference(*x, std::vector<float>(x->size(), 0.0f));
    EXPECT_GT(diff, 0.0) << name << ": Highest's bits, not the tiles'";
    EXPECT_LT(diff, 1e-4 * std::max(1.0, largest)) << name;
  }
}

// NaN and infinities: in K and V at hidden keys (a KV cache's unwritten slots) the gradients stay
// as the clean case's, to the precision; in Q and dO (seen) they land where Highest puts them, a
// key block or query tile holding one keeping to float32.
TEST(Backward, LowerPrecisionNonFiniteValues) {
  QKV_SKIP_WITHOUT_AMX();
  Random rng;
  SCOPED_TRACE(rng.note());
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const Sizes s{1, 2, 1, 100, 600, 32, 16};
  Case clean = with_precision(make_case(rng, s, MaskKind::None, 1.0, 0.0f), qkv::MatmulPrecision::High);
  std::vector<float> keep_values(static_cast<size_t>(s.nq * s.nk), 1.0f);
  for (int64_t i = 0; i < s.nq; ++i)
    for (int64_t key : {3, 520}) keep_values[static_cast<size_t>(i * s.nk + key)] = 0.0f;
  clean.mask = Mask::keep(Tensor::from(keep_values, Shape{s.nq, s.nk}));
  Case dirty = clean;
  dirty.k = clean.k.clone();
  dirty.v = clean.v.clone();
  for (int64_t x = 0; x < s.dk; ++x) dirty.k.at({0, 0, 3, x}) = nan;
  for (int64_t x = 0; x < s.dv; ++x) dirty.v.at({0, 0, 520, x}) = inf;
  const Tensor grad_output = rng.randn(Shape{s.batch, s.q_heads, s.nq, s.dv});
  auto gradients = [&](const Case& c, const Tensor& g) {
    const AttentionOptions options = options_of(c, Backend::Flash);
    const AttentionResult forward = qkv::scaled_dot_product_attention(c.q, c.k, c.v, options);
    return qkv::scaled_dot_product_attention_backward(g, c.q, c.k, c.v, forward, options);
  };
  const AttentionGrads want = gradients(clean, grad_output), got = gradients(dirty, grad_output);
  EXPECT_LT(qkv_test::max_rel_diff(got.dq, want.dq), 1e-3);
  EXPECT_LT(qkv_test::max_rel_diff(got.dk, want.dk), 1e-3);
  EXPECT_LT(qkv_test::max_rel_diff(got.dv, want.dv), 1e-3);

  // Seen: NaN in query 40 of head 0, inf in dO of query 70 of head 1; and, in another case, a V
  // row and a dO row of 1e19 (bf16 holds them, so every split of K, V, Q and dO fits), whose dP
  // overflows to inf in one pair only: that pair's dS^T cannot be split, so its dK and dQ go the
  // float32 way while the tile's other pairs stay on the tiles.
  Case seen = with_precision(make_case(rng, s, MaskKind::Causal, 1.0, 0.0f), qkv::MatmulPrecision::High);
  seen.q = seen.q.clone();
  seen.q.at({0, 0, 40, 5}) = nan;
  Tensor grad_seen = grad_output.clone();
  grad_seen.at({0, 1, 70, 2}) = inf;
  Case highest = seen;
  highest.precision = qkv::MatmulPrecision::Highest;
  Case huge = seen;
  huge.q = clean.q;
  huge.v = clean.v.clone();
  for (int64_t x = 0; x < s.dv; ++x) huge.v.at({0, 0, 70, x}) = 1e19f;
  Tensor grad_huge = grad_output.clone();
  for (int64_t x = 0; x < s.dv; ++x) grad_huge.at({0, 1, 80, x}) = 1e19f;
  Case huge_highest = huge;
  huge_highest.precision = qkv::MatmulPrecision::Highest;
  // And an lse that its caller got wrong, 100 below query 40's true one: its P' overflows to inf,
  // which the weights' truncated parts would hold as inf and inf - inf = NaN (float32: inf).
  Case low = with_precision(make_case(rng, s, MaskKind::None, 1.0, 0.0f), qkv::MatmulPrecision::High);
  Case low_highest = low;
  low_highest.precision = qkv::MatmulPrecision::Highest;
  auto with_low_lse = [&](const Case& c) {
    const AttentionOptions options = options_of(c, Backend::Flash);
    AttentionResult forward = qkv::scaled_dot_product_attention(c.q, c.k, c.v, options);
    forward.lse = forward.lse.clone();
    forward.lse.at({0, 0, 40}) -= 100.0f;
    forward.row_max = Tensor(), forward.row_sum = Tensor();  // the weights from lse alone
    return qkv::scaled_dot_product_attention_backward(grad_output, c.q, c.k, c.v, forward, options);
  };
  for (const auto& [what, lower, exact] :
       {std::tuple{"NaN in Q, inf in dO", gradients(seen, grad_seen), gradients(highest, grad_seen)},
        {"dP overflowing in one pair", gradients(huge, grad_huge), gradients(huge_highest, grad_huge)},
        {"P' overflowing: an lse too low", with_low_lse(low), with_low_lse(low_highest)}}) {
    int64_t non_finite = 0;
    for (auto [name, a, b] : {std::tuple{"dq", &lower.dq, &exact.dq}, {"dk", &lower.dk, &exact.dk},
                              {"dv", &lower.dv, &exact.dv}}) {
      // The precision's error scales with the terms summed, not with a sum that cancels: 1e-3 of
      // the value, plus 1e-4 of the gradient's largest finite value (1e19 rows give sums of 1e34).
      double largest = 0;
      for (int64_t x = 0; x < b->numel(); ++x)
        if (std::isfinite(b->data()[x])) largest = std::max(largest, static_cast<double>(std::abs(b->data()[x])));
      for (int64_t x = 0; x < a->numel(); ++x) {
        const float want_x = b->data()[x], got_x = a->data()[x];
        if (std::isfinite(want_x)) {
          EXPECT_NEAR(got_x, want_x, 1e-3 * std::max(1.0f, std::abs(want_x)) + 1e-4 * largest)
              << what << ": " << name << " " << x;
        } else {
          ++non_finite;
          EXPECT_TRUE(std::isnan(want_x) ? std::isnan(got_x) : got_x == want_x) << what << ": " << name << " " << x;
        }
      }
    }
    EXPECT_GT(non_finite, 0) << what;
  }
}

// ---------------------------------------------------------------------------------------------
// Rows that see no key, keys that no query sees

TEST(Backward, RowsThatSeeNoKeyGetZeroGradients) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const Sizes s{2, 2, 1, 70, 90, 16, 24};
  // Batch 0 sees no key (length 0); in batch 1 the keys past 40 are hidden and a causal offset
  // hides every key from the first 10 queries.
  Case c = make_case(rng, s, MaskKind::None, 1.0, 0.0f);
  c.mask = Mask::key_lengths({0, 40}) & Mask::causal(-10);
  c.bias = qkv_test::all_of({qkv_test::key_lengths_bias({0, 40}), qkv_test::causal_bias(-10)});
  const Tensor grad_output = rng.randn(Shape{s.batch, s.q_heads, s.nq, s.dv});
  for (Backend backend : {Backend::Reference, Backend::Flash}) {
    SCOPED_TRACE(std::string(qkv::to_string(backend)));
    const AttentionOptions options = options_of(c, backend);
    const AttentionResult forward = qkv::scaled_dot_product_attention(c.q, c.k, c.v, options);
    const AttentionGrads grads = qkv::scaled_dot_product_attention_backward(grad_output, c.q, c.k, c.v, forward, options);
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t h = 0; h < s.q_heads; ++h)
        for (int64_t i = 0; i < s.nq; ++i) {
          const bool sees_nothing = b == 0 || i < 10;
          for (int64_t x = 0; x < s.dk; ++x) {
            const float value = grads.dq.at({b, h, i, x});
            ASSERT_TRUE(std::isfinite(value));
            if (sees_nothing) ASSERT_EQ(value, 0.0f) << "dq at b=" << b << " h=" << h << " i=" << i;
          }
        }
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t j = 0; j < s.nk; ++j) {
        const bool seen = b == 1 && j < 40;
        for (int64_t x = 0; x < s.dk; ++x) {
          ASSERT_TRUE(std::isfinite(grads.dk.at({b, 0, j, x})));
          if (!seen) ASSERT_EQ(grads.dk.at({b, 0, j, x}), 0.0f) << "dk at b=" << b << " j=" << j;
        }
        for (int64_t x = 0; x < s.dv; ++x) {
          ASSERT_TRUE(std::isfinite(grads.dv.at({b, 0, j, x})));
          if (!seen) ASSERT_EQ(grads.dv.at({b, 0, j, x}), 0.0f) << "dv at b=" << b << " j=" << j;
        }
      }
  }
}

TEST(Backward, NonFiniteValuesAtHiddenKeysStayHidden) {
  Random rng;
  SCOPED_TRACE(rng.note());
  // A keep mask hides keys 3, 70 and 520 from every query; their K and V hold NaN and Inf (as a
  // KV cache's unwritten slots may). Every gradient stays finite and equals the clean case's.
  // Flash's key blocks of 256: the first and third hold a non-finite K (K copied, dQ skipping
  // zero dS), the second none (K read in place); on every SIMD target.
  const Sizes s{1, 2, 1, 100, 600, 16, 8};
  const int64_t hidden[] = {3, 70, 520};
  Case clean = make_case(rng, s, MaskKind::None, 1.0, 0.0f);
  std::vector<float> keep_values(static_cast<size_t>(s.nq * s.nk), 1.0f);
  for (int64_t i = 0; i < s.nq; ++i)
    for (int64_t key : hidden) keep_values[static_cast<size_t>(i * s.nk + key)] = 0.0f;
  clean.mask = Mask::keep(Tensor::from(keep_values, Shape{s.nq, s.nk}));
  Case dirty = clean;
  dirty.k = clean.k.clone();
  dirty.v = clean.v.clone();
  for (size_t n = 0; n < std::size(hidden); ++n) {
    const float poison = n % 2 == 0 ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
    for (int64_t x = 0; x < s.dk; ++x) dirty.k.at({0, 0, hidden[n], x}) = poison;
    for (int64_t x = 0; x < s.dv; ++x) dirty.v.at({0, 0, hidden[n], x}) = -poison;
  }
  const Tensor grad_output = rng.randn(Shape{s.batch, s.q_heads, s.nq, s.dv});
  for (int64_t target : qkv_test::runnable_targets()) {
    qkv_test::ForcedTarget forced(target);
    SCOPED_TRACE(std::string("SIMD target ") + hwy::TargetName(target));
    for (Backend backend : {Backend::Reference, Backend::Flash}) {
      SCOPED_TRACE(std::string(qkv::to_string(backend)));
      auto gradients = [&](const Case& c) {
        const AttentionOptions options = options_of(c, backend);
        const AttentionResult forward = qkv::scaled_dot_product_attention(c.q, c.k, c.v, options);
        return qkv::scaled_dot_product_attention_backward(grad_output, c.q, c.k, c.v, forward, options);
      };
      const AttentionGrads want = gradients(clean), got = gradients(dirty);
      EXPECT_LT(qkv_test::max_rel_diff(got.dq, want.dq), 1e-5);
      EXPECT_LT(qkv_test::max_rel_diff(got.dv, want.dv), 1e-5);
      // dK of the hidden keys is 0; of the others, as in the clean case.
      EXPECT_LT(qkv_test::max_rel_diff(got.dk, want.dk), 1e-5);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Dispatch and errors

// Scores near 137 (an ulp is 1.5e-5 there): q and k share a large first feature.
struct LargeScores {
  Tensor q, k, v;
  int64_t dk;
};
LargeScores large_scores(Random& rng, int64_t hq, int64_t hkv, int64_t nq, int64_t nk, int64_t dk) {
  LargeScores x{rng.randn(Shape{1, hq, nq, dk}), rng.randn(Shape{1, hkv, nk, dk}), rng.randn(Shape{1, hkv, nk, 8}), dk};
  const float first = static_cast<float>(std::sqrt(137.0 * std::sqrt(static_cast<double>(dk))));
  for (int64_t h = 0; h < hq; ++h)
    for (int64_t i = 0; i < nq; ++i) x.q.at({0, h, i, 0}) = first;
  for (int64_t h = 0; h < hkv; ++h)
    for (int64_t j = 0; j < nk; ++j) x.k.at({0, h, j, 0}) = first;
  return x;
}

// The backward recomputes the scores the forward's kernel computed, summed in its order: after
// Auto's decode, Decode, Flash, and Auto with weights (the reference). Per row (b, h, i), a
// dO that is 1 at (i, 0) alone makes dV's column 0 that row's recomputed weights, so
//   - at the key with the largest score, exp(s - row_max) / row_sum = exactly 1 / row_sum (the
//     recomputed score is row_max, bit for bit; summed in another order it was an ulp off);
//   - sum_j P_j v_j, in float64, is the forward's output to float32's rounding (1.5e-5 off
//     relative when each weight carried its score's ulp, a flash backward after a decode forward).
// On every SIMD target: decode's order is each target's own. Two shapes: groups of six rows, and
// one row a group (decode reads K key after key there, dot_scores::KeyOrder).
class RecomputedScores : public ::testing::TestWithParam<std::array<int64_t, 3>> {};

TEST_P(RecomputedScores, AreTheForwardKernelsOwn) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const auto [hq, hkv, nq] = GetParam();
  const int64_t nk = 70;
  const LargeScores x = large_scores(rng, hq, hkv, nq, nk, 37);
  const std::vector<double> q = qkv_test::to_doubles(x.q), k = qkv_test::to_doubles(x.k), v = qkv_test::to_doubles(x.v);
  struct Run {
    Backend backend;
    bool need_weights;
  };
  const int threads_before = omp_get_max_threads();
  for (int64_t target : qkv_test::runnable_targets()) {
    qkv_test::ForcedTarget forced(target);
    for (int threads : {1, 2}) {
      omp_set_num_threads(threads);
      ASSERT_TRUE(qkv::detail::decode_is_faster(
          qkv::detail::build_problem("test: ", x.q, x.k, x.v, AttentionOptions{}).problem))
          << "Auto would not run decode on these shapes";
      for (const Run& run : {Run{Backend::Auto, false}, Run{Backend::Decode, false}, Run{Backend::Flash, false},
                             Run{Backend::Auto, true}, Run{Backend::Reference, false}}) {
        AttentionOptions options;
        options.backend = run.backend;
        options.need_weights = run.need_weights;
        options.mask = Mask::causal(nk - nq);
        const AttentionResult forward = qkv::scaled_dot_product_attention(x.q, x.k, x.v, options);
        const std::string what = std::string(hwy::TargetName(target)) + ", " + std::to_string(threads) +
                                 " threads, " + std::string(qkv::to_string(run.backend)) +
                                 (run.need_weights ? " with weights" : "");
        for (int64_t h = 0; h < hq; ++h)
          for (int64_t i = 0; i < nq; ++i) {
            Tensor grad_output = Tensor::zeros(forward.output.shape());
            grad_output.at({0, h, i, 0}) = 1;
            const AttentionGrads grads =
                qkv::scaled_dot_product_attention_backward(grad_output, x.q, x.k, x.v, forward, options);
            const int64_t g = h / (hq / hkv), visible = i + nk - nq + 1;
            int64_t top = 0;
            double top_score = -INFINITY;
            for (int64_t j = 0; j < visible; ++j) {
              double dot = 0;
              for (int64_t d = 0; d < x.dk; ++d)
                dot += q[static_cast<size_t>((h * nq + i) * x.dk + d)] * k[static_cast<size_t>((g * nk + j) * x.dk + d)];
              if (dot > top_score) top_score = dot, top = j;
            }
            const float row_sum = forward.row_sum.at({0, h, i});
            EXPECT_EQ(grads.dv.at({0, g, top, 0}), 1.0f / row_sum) << what << ", row " << h << "," << i;
            double largest = 0;
            for (int64_t c = 0; c < 8; ++c) {
              double out = 0;
              for (int64_t j = 0; j < nk; ++j)
                out += double{grads.dv.at({0, g, j, 0})} * v[static_cast<size_t>((g * nk + j) * 8 + c)];
              largest = std::max(largest, std::abs(out - forward.output.at({0, h, i, c})));
            }
            EXPECT_LT(largest, 2e-6) << what << ", row " << h << "," << i;
          }
      }
    }
  }
  omp_set_num_threads(threads_before);
}

// (Hq, Hkv, Nq).
INSTANTIATE_TEST_SUITE_P(Backward, RecomputedScores,
                         ::testing::Values(std::array<int64_t, 3>{4, 2, 3}, std::array<int64_t, 3>{2, 2, 1}));

std::string backward_error(const std::function<void()>& call) {
  try {
    call();
  } catch (const qkv::Error& e) {
    return e.what();
  }
  return "no qkv::Error thrown";
}

TEST(Backward, ErrorsNameTheShapes) {
  using ::testing::HasSubstr;
  const std::string who = "scaled_dot_product_attention_backward: ";
  const Tensor q = Tensor::zeros({2, 4, 5, 8}), k = Tensor::zeros({2, 2, 6, 8}), v = Tensor::zeros({2, 2, 6, 3});
  const AttentionResult forward = qkv::scaled_dot_product_attention(q, k, v);
  const Tensor grad_output = Tensor::zeros({2, 4, 5, 3});
  auto backward = [&](const Tensor& g, const Tensor& q_, const Tensor& k_, const Tensor& v_, const AttentionResult& f,
                      const AttentionOptions& options = {}) {
    return backward_error([&] { qkv::scaled_dot_product_attention_backward(g, q_, k_, v_, f, options); });
  };
  EXPECT_EQ(backward(grad_output, q, k, v, forward), "no qkv::Error thrown");
  EXPECT_THAT(backward(Tensor::zeros({2, 4, 5, 8}), q, k, v, forward),
              HasSubstr(who + "grad_output is (2, 4, 5, 8) but should be (2, 4, 5, 3)"));
  EXPECT_THAT(backward(Tensor(), q, k, v, forward), HasSubstr(who + "grad_output is undefined"));
  AttentionResult bad_lse = forward;
  bad_lse.lse = Tensor::zeros({2, 4, 6});
  EXPECT_THAT(backward(grad_output, q, k, v, bad_lse), HasSubstr(who + "forward.lse is (2, 4, 6) but should be (2, 4, 5)"));
  AttentionResult no_lse = forward;
  no_lse.lse = Tensor();
  EXPECT_THAT(backward(grad_output, q, k, v, no_lse), HasSubstr(who + "forward.lse is undefined"));
  AttentionResult bad_output = forward;
  bad_output.output = Tensor::zeros({2, 4, 3});
  EXPECT_THAT(backward(grad_output, q, k, v, bad_output),
              HasSubstr(who + "forward.output is (2, 4, 3) but should be (2, 4, 5, 3)"));
  // The forward's checks, shared, under the backward's name.
  EXPECT_THAT(backward(grad_output, q, Tensor::zeros({2, 2, 6, 7}), v, forward),
              HasSubstr(who + "q is (2, 4, 5, 8) but k is (2, 2, 6, 7): head dims differ"));
  EXPECT_THAT(backward(grad_output, q, k, Tensor::zeros({2, 2, 5, 3}), forward),
              HasSubstr(who + "k is (2, 2, 6, 8) but v is (2, 2, 5, 3): key and value lengths differ"));
  AttentionOptions dropout;
  dropout.dropout_p = 1.0f;
  EXPECT_THAT(backward(grad_output, q, k, v, forward, dropout), HasSubstr(who + "dropout_p must be in [0, 1), got 1"));
  AttentionOptions mask;
  mask.mask = Mask::keep(Tensor::full(Shape{3, 5}, 1.0f));
  EXPECT_THAT(backward(grad_output, q, k, v, forward, mask),
              HasSubstr(who + "mask keep (3, 5) does not broadcast to the scores (2, 4, 5, 6)"));
}

}  // namespace
