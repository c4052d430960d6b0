// The shared test cases of the fast kernels (test_flash.cpp, test_decode.cpp): building an
// AttentionProblem as src/attention/attention.cpp does, random cases with every mask kind, the
// float64 oracle and the reference kernel's own error as the measure of a kernel's result, and
// running a kernel on every SIMD target and on 1 and 2 threads.
//
// Tolerance, flash-attention style: the reference and the kernel are measured against the
// float64 oracle and the kernel may be off by at most max(1e-4, 4 x the reference's own error)
// on the same data, or by 4 float epsilons of the largest score: with logits in the thousands a
// score is only known to about an ulp of itself in float32 in any kernel, and each weight
// inherits that error. A kernel's outputs are poisoned with NaN before each call, so an element
// left unwritten fails.
#pragma once

#include <gtest/gtest.h>
#include <hwy/targets.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "attention/flash.hpp"
#include "attention/kernels.hpp"
#include "oracle.hpp"

namespace qkv_test {

using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;
using qkv::detail::AttentionProblem;
using qkv::detail::MaskTermView;

inline constexpr double kToleranceFloor = 1e-4;
inline constexpr double kToleranceFactor = 4.0;
inline constexpr double kScoreEpsilons = 4.0;

// ---------------------------------------------------------------------------------------------
// Building the problem as src/attention/attention.cpp does (arguments are valid by construction).

// How a kernel reads tensor mask `values` broadcast to the scores (B, Hq, Nq, Nk): 2-D is
// (Nq, Nk), 3-D (B, Nq, Nk), 4-D (B, Hq, Nq, Nk); a dim of size 1 gets stride 0.
inline MaskTermView term_view(const Tensor& values, bool additive) {
  const Shape& s = values.shape();
  int64_t sizes[4] = {1, 1, 1, 1};
  if (s.size() == 2) { sizes[2] = s[0]; sizes[3] = s[1]; }
  if (s.size() == 3) { sizes[0] = s[0]; sizes[2] = s[1]; sizes[3] = s[2]; }
  if (s.size() == 4) { for (int d = 0; d < 4; ++d) sizes[d] = s[d]; }
  int64_t strides[4];
  int64_t stride = 1;
  for (int d = 3; d >= 0; --d) {
    strides[d] = sizes[d] == 1 ? 0 : stride;
    stride *= sizes[d];
  }
  return {values.data(), strides[0], strides[1], strides[2], strides[3], additive};
}

// One test case: q (B, Hq, Nq, Dk), k (B, Hkv, Nk, Dk), v (B, Hkv, Nk, Dv), a mask and its
// float64 meaning, a scale and dropout.
struct Case {
  std::string name;
  Tensor q, k, v;
  Mask mask;
  Bias bias;  // the same mask for the oracle
  float scale = 1;
  float dropout_p = 0;
  uint64_t seed = 0;
};

// The kernel's problem for `c`, writing into `output` and `lse` (weights are never asked for).
inline AttentionProblem problem_of(const Case& c, std::vector<float>& output, std::vector<float>& lse) {
  const int64_t batch = c.q.size(0), nk = c.k.size(2);
  std::vector<int64_t> key_lengths(static_cast<size_t>(batch), nk);
  if (c.mask.has_key_lengths()) key_lengths = c.mask.lengths();
  std::vector<MaskTermView> terms;
  for (const Mask::Term& term : c.mask.terms()) terms.push_back(term_view(term.values, term.additive));
  return AttentionProblem{
      .batch = batch, .q_heads = c.q.size(1), .kv_heads = c.k.size(1),
      .q_len = c.q.size(2), .kv_len = nk, .head_dim = c.q.size(3), .value_dim = c.v.size(3),
      .q = c.q.data(), .k = c.k.data(), .v = c.v.data(), .scale = c.scale,
      .band_lo = c.mask.band_lo(), .band_hi = c.mask.band_hi(),
      .key_lengths = std::move(key_lengths), .terms = std::move(terms),
      .dropout_p = c.dropout_p, .seed = c.seed,
      .output = output.data(), .weights = nullptr, .lse = lse.data(),
  };
}

// ---------------------------------------------------------------------------------------------
// Random cases

enum class MaskKind {
  None, Causal, CausalOffset, CausalNegative, Window, WindowRight, KeyLengths, Keep2D, Keep2DRow,
  Keep3D, Keep4D, Keep4DHeads, Additive2D, Additive4D, EmptyRows, Combined, BandAndTerms,
};
inline constexpr MaskKind kAllMasks[] = {
    MaskKind::None, MaskKind::Causal, MaskKind::CausalOffset, MaskKind::CausalNegative, MaskKind::Window,
    MaskKind::WindowRight, MaskKind::KeyLengths, MaskKind::Keep2D, MaskKind::Keep2DRow, MaskKind::Keep3D,
    MaskKind::Keep4D, MaskKind::Keep4DHeads, MaskKind::Additive2D, MaskKind::Additive4D,
    MaskKind::EmptyRows, MaskKind::Combined, MaskKind::BandAndTerms,
};

inline std::string to_string(MaskKind kind) {
  switch (kind) {
    case MaskKind::None: return "none";
    case MaskKind::Causal: return "causal";
    case MaskKind::CausalOffset: return "causal_offset";
    case MaskKind::CausalNegative: return "causal_negative_offset";
    case MaskKind::Window: return "window";
    case MaskKind::WindowRight: return "window_right";
    case MaskKind::KeyLengths: return "key_lengths";
    case MaskKind::Keep2D: return "keep_2d";
    case MaskKind::Keep2DRow: return "keep_2d_row";
    case MaskKind::Keep3D: return "keep_3d";
    case MaskKind::Keep4D: return "keep_4d";
    case MaskKind::Keep4DHeads: return "keep_4d_heads";
    case MaskKind::Additive2D: return "additive_2d";
    case MaskKind::Additive4D: return "additive_4d";
    case MaskKind::EmptyRows: return "empty_rows";
    case MaskKind::Combined: return "combined";
    case MaskKind::BandAndTerms: return "band_and_terms";
  }
  return "?";
}

// A keep tensor of `shape`, each element 1 with probability `density`.
inline Tensor random_keep(Random& rng, const Shape& shape, double density) {
  std::vector<float> values(static_cast<size_t>(shape.numel()));
  for (float& x : values) x = rng.chance(density) ? 1.0f : 0.0f;
  return Tensor::from(std::move(values), shape);
}

// An additive tensor of `shape`: normal values, -inf with probability 0.2.
inline Tensor random_additive(Random& rng, const Shape& shape) {
  std::vector<float> values(static_cast<size_t>(shape.numel()));
  for (float& x : values) x = rng.chance(0.2) ? -std::numeric_limits<float>::infinity() : static_cast<float>(rng.normal());
  return Tensor::from(std::move(values), shape);
}

inline std::vector<int64_t> random_lengths(Random& rng, int64_t batch, int64_t nk) {
  std::vector<int64_t> lengths(static_cast<size_t>(batch));
  for (int64_t& n : lengths) n = rng.chance(0.2) ? (rng.chance(0.5) ? 0 : nk) : rng.integer(0, nk);
  return lengths;
}

inline void set_mask(Case& c, MaskKind kind, Random& rng) {
  const int64_t batch = c.q.size(0), heads = c.q.size(1), nq = c.q.size(2), nk = c.k.size(2);
  switch (kind) {
    case MaskKind::None:
      c.mask = Mask();
      c.bias = {};
      return;
    case MaskKind::Causal:
      c.mask = Mask::causal();
      c.bias = qkv_test::causal_bias();
      return;
    case MaskKind::CausalOffset: {
      const int64_t offset = rng.integer(1, std::max<int64_t>(1, nk));
      c.mask = Mask::causal(offset);
      c.bias = qkv_test::causal_bias(offset);
      return;
    }
    case MaskKind::CausalNegative: {  // the first queries see no key at all
      const int64_t offset = -rng.integer(1, std::max<int64_t>(1, nq));
      c.mask = Mask::causal(offset);
      c.bias = qkv_test::causal_bias(offset);
      return;
    }
    case MaskKind::Window: {
      const int64_t left = rng.integer(0, std::max<int64_t>(0, nk / 3));
      c.mask = Mask::window(left);
      c.bias = qkv_test::window_bias(left);
      return;
    }
    case MaskKind::WindowRight: {
      const int64_t left = rng.integer(0, nk), right = rng.integer(1, nk), offset = rng.integer(-nq, nk);
      c.mask = Mask::window(left, right, offset);
      c.bias = qkv_test::window_bias(left, right, offset);
      return;
    }
    case MaskKind::KeyLengths: {
      const std::vector<int64_t> lengths = random_lengths(rng, batch, nk);
      c.mask = Mask::key_lengths(lengths);
      c.bias = qkv_test::key_lengths_bias(lengths);
      return;
    }
    case MaskKind::Keep2D: {
      const Tensor keep = random_keep(rng, Shape{nq, nk}, 0.7);
      c.mask = Mask::keep(keep);
      c.bias = qkv_test::keep_bias(keep);
      return;
    }
    case MaskKind::Keep2DRow: {
      const Tensor keep = random_keep(rng, Shape{1, nk}, 0.6);
      c.mask = Mask::keep(keep);
      c.bias = qkv_test::keep_bias(keep);
      return;
    }
    case MaskKind::Keep3D: {
      const Tensor keep = random_keep(rng, Shape{batch, nq, nk}, 0.5);
      c.mask = Mask::keep(keep);
      c.bias = qkv_test::keep_bias(keep);
      return;
    }
    case MaskKind::Keep4D: {
      const Tensor keep = random_keep(rng, Shape{batch, heads, nq, nk}, 0.8);
      c.mask = Mask::keep(keep);
      c.bias = qkv_test::keep_bias(keep);
      return;
    }
    case MaskKind::Keep4DHeads: {
      const Tensor keep = random_keep(rng, Shape{1, heads, nq, nk}, 0.3);
      c.mask = Mask::keep(keep);
      c.bias = qkv_test::keep_bias(keep);
      return;
    }
    case MaskKind::Additive2D: {
      const Tensor add = random_additive(rng, Shape{nq, nk});
      c.mask = Mask::additive(add);
      c.bias = qkv_test::additive_bias(add);
      return;
    }
    case MaskKind::Additive4D: {
      const Tensor add = random_additive(rng, Shape{1, heads, nq, nk});
      c.mask = Mask::additive(add);
      c.bias = qkv_test::additive_bias(add);
      return;
    }
    case MaskKind::EmptyRows: {  // a keep tensor with whole rows of zeros, and key length 0
      std::vector<float> values(static_cast<size_t>(nq * nk), 1.0f);
      for (int64_t i = 0; i < nq; ++i)
        if (rng.chance(0.3)) std::fill_n(values.begin() + i * nk, nk, 0.0f);
      const Tensor keep = Tensor::from(std::move(values), Shape{nq, nk});
      std::vector<int64_t> lengths = random_lengths(rng, batch, nk);
      lengths[0] = 0;
      c.mask = Mask::keep(keep) & Mask::key_lengths(lengths);
      c.bias = qkv_test::all_of({qkv_test::keep_bias(keep), qkv_test::key_lengths_bias(lengths)});
      return;
    }
    case MaskKind::Combined: {
      const int64_t offset = rng.integer(-2, 3);
      const std::vector<int64_t> lengths = random_lengths(rng, batch, nk);
      const Tensor keep = random_keep(rng, Shape{batch, 1, nq, nk}, 0.8);
      const Tensor add = random_additive(rng, Shape{nq, nk});
      c.mask = Mask::causal(offset) & Mask::key_lengths(lengths) & Mask::keep(keep) & Mask::additive(add);
      c.bias = qkv_test::all_of({qkv_test::causal_bias(offset), qkv_test::key_lengths_bias(lengths),
                                 qkv_test::keep_bias(keep), qkv_test::additive_bias(add)});
      return;
    }
    case MaskKind::BandAndTerms: {  // window & additive (B, Nq, Nk) & keep (1, Nk)
      const int64_t left = rng.integer(0, nk), right = rng.integer(0, 3);
      const Tensor add = random_additive(rng, Shape{batch, nq, nk});
      const Tensor keep = random_keep(rng, Shape{1, nk}, 0.9);
      c.mask = Mask::window(left, right) & Mask::additive(add) & Mask::keep(keep);
      c.bias = qkv_test::all_of({qkv_test::window_bias(left, right), qkv_test::additive_bias(add),
                                 qkv_test::keep_bias(keep)});
      return;
    }
  }
}

struct Sizes {
  int64_t batch, q_heads, kv_heads, nq, nk, dk, dv;
};

inline std::string describe(const Sizes& s) {
  return "B=" + std::to_string(s.batch) + " Hq=" + std::to_string(s.q_heads) + " Hkv=" +
         std::to_string(s.kv_heads) + " Nq=" + std::to_string(s.nq) + " Nk=" + std::to_string(s.nk) +
         " Dk=" + std::to_string(s.dk) + " Dv=" + std::to_string(s.dv);
}

// q, k, v standard normal times `logit_scale` for q and k (30: scores in the thousands).
inline Case make_case(Random& rng, const Sizes& s, MaskKind kind, double logit_scale, float dropout_p) {
  Case c;
  c.q = rng.randn(Shape{s.batch, s.q_heads, s.nq, s.dk}, logit_scale);
  c.k = rng.randn(Shape{s.batch, s.kv_heads, s.nk, s.dk}, logit_scale);
  c.v = rng.randn(Shape{s.batch, s.kv_heads, s.nk, s.dv});
  c.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.dk)));
  c.dropout_p = dropout_p;
  c.seed = rng.next_u64();
  set_mask(c, kind, rng);
  c.name = describe(s) + " mask=" + to_string(kind) + " logits x" + std::to_string(logit_scale) +
           " dropout=" + std::to_string(dropout_p);
  return c;
}

// ---------------------------------------------------------------------------------------------
// Running and comparing

// A case's expected values, computed once: the float64 oracle, the reference kernel's error and
// the largest |scaled score| (masks ignored).
struct Expected {
  qkv_test::OracleResult oracle;
  double reference_output_error = 0, reference_lse_error = 0;
  double max_abs_score = 0;
};

inline double max_abs_score(const Case& c) {
  const int64_t batch = c.q.size(0), hq = c.q.size(1), hkv = c.k.size(1);
  const int64_t nq = c.q.size(2), nk = c.k.size(2), dk = c.q.size(3);
  const float* q = c.q.data();
  const float* k = c.k.data();
  double largest = 0;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < hq; ++h)
      for (int64_t i = 0; i < nq; ++i) {
        const float* q_row = q + ((b * hq + h) * nq + i) * dk;
        for (int64_t j = 0; j < nk; ++j) {
          const float* k_row = k + ((b * hkv + h / (hq / hkv)) * nk + j) * dk;
          double dot = 0;
          for (int64_t d = 0; d < dk; ++d) dot += static_cast<double>(q_row[d]) * k_row[d];
          largest = std::max(largest, std::abs(dot) * c.scale);
        }
      }
  return largest;
}

inline Expected expect(const Case& c) {
  Expected e;
  e.max_abs_score = max_abs_score(c);
  qkv_test::OracleDropout dropout;
  if (c.dropout_p > 0) {
    dropout.p = c.dropout_p;
    dropout.keeps = [&c](int64_t b, int64_t h, int64_t i, int64_t j) {
      return qkv::dropout_keeps(c.seed, b, h, i, j, c.dropout_p);
    };
  }
  e.oracle = qkv_test::attention_oracle(c.q, c.k, c.v, c.scale, c.bias, dropout);
  std::vector<float> output(e.oracle.output.size()), lse(e.oracle.lse.size());
  qkv::detail::reference_attention(problem_of(c, output, lse));
  const qkv_test::Comparison out = qkv_test::compare(output, e.oracle.output, 1e30);
  const qkv_test::Comparison l = qkv_test::compare(lse, e.oracle.lse, 1e30);
  EXPECT_TRUE(std::isfinite(out.max_rel_diff) && std::isfinite(l.max_rel_diff))
      << "the reference kernel itself is off: " << c.name;
  e.reference_output_error = out.max_rel_diff;
  e.reference_lse_error = l.max_rel_diff;
  return e;
}

// A fast kernel under test: flash_attention, decode_attention.
using Kernel = void (*)(const AttentionProblem&);

// Runs `kernel` on `c` into NaN-poisoned outputs and compares with the oracle.
inline void check_kernel(Kernel kernel, const Case& c, const Expected& e) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> output(e.oracle.output.size(), nan), lse(e.oracle.lse.size(), nan);
  kernel(problem_of(c, output, lse));
  const double score_error = kScoreEpsilons * std::numeric_limits<float>::epsilon() * e.max_abs_score;
  const double output_tolerance =
      std::max({kToleranceFloor, kToleranceFactor * e.reference_output_error, score_error});
  const double lse_tolerance = std::max({kToleranceFloor, kToleranceFactor * e.reference_lse_error, score_error});
  const qkv_test::Comparison out = qkv_test::compare(output, e.oracle.output, output_tolerance);
  const qkv_test::Comparison l = qkv_test::compare(lse, e.oracle.lse, lse_tolerance);
  EXPECT_TRUE(out.ok) << c.name << "\noutput (reference error " << e.reference_output_error << "):\n" << out.detail;
  EXPECT_TRUE(l.ok) << c.name << "\nlse (reference error " << e.reference_lse_error << "):\n" << l.detail;
}

// Sets the SIMD targets the kernels dispatch to for its lifetime, then restores the real CPU's.
class ForcedTarget {
 public:
  explicit ForcedTarget(int64_t target) { hwy::SetSupportedTargetsForTest(target); }
  ~ForcedTarget() { hwy::SetSupportedTargetsForTest(0); }
  ForcedTarget(const ForcedTarget&) = delete;
  ForcedTarget& operator=(const ForcedTarget&) = delete;
};

// The targets the kernels hold code for that this CPU can run, one bit each. Every kernel file
// is compiled with the same flags, so flash.cpp's targets are every kernel's.
inline std::vector<int64_t> runnable_targets() {
  std::vector<int64_t> targets;
  const int64_t bits = qkv::detail::flash_attention_compiled_targets() & hwy::SupportedTargets();
  for (int64_t rest = bits; rest != 0; rest &= rest - 1) targets.push_back(rest & -rest);
  return targets;
}

// Runs `kernel` on every case, on every runnable target and on 1 and 2 threads.
inline void check_everywhere(Kernel kernel, const std::vector<Case>& cases) {
  std::vector<Expected> expected;
  for (const Case& c : cases) expected.push_back(expect(c));
  const std::vector<int64_t> targets = runnable_targets();
  ASSERT_FALSE(targets.empty());
  const int threads_before = omp_get_max_threads();
  for (int64_t target : targets) {
    ForcedTarget forced(target);
    SCOPED_TRACE(std::string("SIMD target ") + hwy::TargetName(target));
    // Highway's chosen target is one for the whole library: what flash dispatches to, every kernel does.
    ASSERT_EQ(qkv::detail::flash_attention_target(), target) << "the target was not forced";
    for (int threads : {1, 2}) {
      omp_set_num_threads(threads);
      SCOPED_TRACE("threads " + std::to_string(threads));
      for (size_t n = 0; n < cases.size(); ++n) check_kernel(kernel, cases[n], expected[n]);
    }
  }
  omp_set_num_threads(threads_before);
}

}  // namespace qkv_test
