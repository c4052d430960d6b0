// Attention summaries (AttentionOptions::summary_top_k) against the exact weights of the
// Reference kernel: each row's entropy, top-k keys (exact, ties to the lower index) and weights,
// and each key's received mass, recomputed here in float64 from the weights (need_weights). The
// flash summary kernel runs on every SIMD target and on 1 and 2 threads, with every mask kind,
// the score modifiers, GQA and odd shapes, its results poisoned before each call; the Reference
// backend's summaries are checked the same way. Plus the option's errors and its routing.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/error.hpp"

#include "harness/kernel_cases.hpp"
#include "harness/oracle.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::AttentionResult;
using qkv::Backend;
using qkv::Shape;
using qkv::Tensor;
using qkv_test::Case;
using qkv_test::MaskKind;
using qkv_test::Random;
using qkv_test::Sizes;

constexpr double kTolerance = 1e-5;

// The summaries, recomputed in float64 from a result's weights (B, Hq, Nq, Nk), and the weights.
struct Expected {
  std::vector<double> entropy, top_weights, received;
  std::vector<int64_t> top_keys;
  std::vector<float> weights;
  int64_t nk = 0, k = 0;
};

// Two kernels' scores differ in their last bits (their sums run in different orders), so two
// keys whose reference weights differ by less than that may come in either order: a key other
// than the expected one is accepted when its reference weight is within 1e-6 of the expected
// weight. Exact ties must go to the lower index: with the reference's own weights, equal weights;
// against another kernel, two equal key rows with nothing per key added to their logits (no float
// mask term, no ALiBi), whose logits every kernel computes in the same order, so a key's lower
// twin comes before it in that kernel's list. Equal reference weights are not enough there: two
// different logits an ulp apart can round to one float weight in the reference and stay apart in
// the other kernel. Nor is the slot: twins an ulp above a third key in one kernel and an ulp below
// it in the other take different slots (seed 14490465335938470176: reference keys 58, 43 at
// weights 0.0292132292, 0.0292132162; flash 43, 53, the twins, first).
constexpr double kNearTie = 1e-6;

bool has_additive_term(const qkv::Mask& mask) {
  for (const qkv::Mask::Term& term : mask.terms())
    if (term.additive) return true;
  return false;
}

// Which keys of a row tie exactly: twin(row, a) == twin(row, b).
struct Twins {
  std::vector<int64_t> first;  // (B, Hkv, Nk): the first key of the head whose row equals this one
  int64_t hq = 1, hkv = 1, nq = 1, nk = 1;
  int64_t of(int64_t row, int64_t key) const {
    const int64_t b = row / (hq * nq), h = row / nq % hq;
    return first[static_cast<size_t>((b * hkv + h / (hq / hkv)) * nk + key)];
  }
};

// Every key its own class when a float mask term or ALiBi adds per-key terms.
Twins twins_of(const Case& c) {
  Twins t;
  t.hq = c.q.size(1), t.hkv = c.k.size(1), t.nq = c.q.size(2), t.nk = c.k.size(2);
  const int64_t dk = c.k.size(3), heads = c.k.size(0) * t.hkv;
  const bool per_key_terms = has_additive_term(c.mask) || c.alibi_slopes.defined();
  const std::vector<float> k = c.k.to_vector();
  for (int64_t g = 0; g < heads; ++g)
    for (int64_t j = 0; j < t.nk; ++j) {
      int64_t first = j;
      for (int64_t i = 0; i < j && !per_key_terms && first == j; ++i)
        if (std::equal(k.begin() + (g * t.nk + i) * dk, k.begin() + (g * t.nk + i + 1) * dk,
                       k.begin() + (g * t.nk + j) * dk))
          first = i;
      t.first.push_back(first);
    }
  return t;
}

Expected summaries_of(const Tensor& weights, int64_t k) {
  const int64_t nk = weights.size(-1), rows = weights.numel() / nk, nq = weights.size(-2);
  const std::vector<float> w = weights.to_vector();
  Expected e;
  e.weights = w;
  e.nk = nk;
  e.k = k;
  e.received.assign(static_cast<size_t>(rows / nq * nk), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = w.data() + r * nk;
    double h = 0;
    std::vector<int64_t> keys;
    for (int64_t j = 0; j < nk; ++j) {
      e.received[static_cast<size_t>(r / nq * nk + j)] += row[j];
      if (row[j] > 0) {
        h -= row[j] * std::log(static_cast<double>(row[j]));
        keys.push_back(j);
      }
    }
    std::stable_sort(keys.begin(), keys.end(), [&](int64_t a, int64_t b) { return row[a] > row[b]; });
    e.entropy.push_back(h);
    for (int64_t x = 0; x < k; ++x) {
      const bool any = x < static_cast<int64_t>(keys.size());
      e.top_keys.push_back(any ? keys[static_cast<size_t>(x)] : -1);
      e.top_weights.push_back(any ? row[keys[static_cast<size_t>(x)]] : 0.0);
    }
  }
  return e;
}

// A result whose summary tensors (and output, lse, row stats) hold NaN and keys -7, so anything
// the kernel leaves unwritten fails.
AttentionResult poisoned(const Case& c, int64_t k) {
  const int64_t b = c.q.size(0), h = c.q.size(1), nq = c.q.size(2), nk = c.k.size(2), dv = c.v.size(3);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  AttentionResult r;
  r.output = Tensor::full(Shape{b, h, nq, dv}, nan);
  r.lse = Tensor::full(Shape{b, h, nq}, nan);
  r.row_max = Tensor::full(Shape{b, h, nq}, nan);
  r.row_sum = Tensor::full(Shape{b, h, nq}, nan);
  r.entropy = Tensor::full(Shape{b, h, nq}, nan);
  r.top_weights = Tensor::full(Shape{b, h, nq, k}, nan);
  r.received = Tensor::full(Shape{b, h, nk}, nan);
  r.top_keys.assign(static_cast<size_t>(b * h * nq * k), -7);
  return r;
}

// twins null: the summaries come from the same weights as e (the reference's own), where equal
// weights are exact ties.
void expect_summaries(const Expected& e, const AttentionResult& r, const std::string& what,
                      const Twins* twins = nullptr) {
  const std::vector<float> entropy = r.entropy.to_vector(), weights = r.top_weights.to_vector(),
                           received = r.received.to_vector();
  ASSERT_EQ(entropy.size(), e.entropy.size()) << what;
  ASSERT_EQ(r.top_keys.size(), e.top_keys.size()) << what;
  ASSERT_EQ(received.size(), e.received.size()) << what;
  for (size_t x = 0; x < entropy.size(); ++x)
    ASSERT_NEAR(entropy[x], e.entropy[x], kTolerance * std::max(1.0, std::abs(e.entropy[x]))) << what << " row " << x;
  for (size_t x = 0; x < weights.size(); ++x) {
    const int64_t row = static_cast<int64_t>(x) / e.k, slot = static_cast<int64_t>(x) % e.k;
    if (twins != nullptr && r.top_keys[x] >= 0) {
      // Distinct keys, and the key's lower twin (if any, and not hidden from this row by a mask:
      // a visible twin has the key's own reference weight) in an earlier slot.
      const int64_t first = twins->of(row, r.top_keys[x]);
      const float weight = e.weights[static_cast<size_t>(row * e.nk + r.top_keys[x])];
      bool lower_twin_before =
          first == r.top_keys[x] || weight == 0 || e.weights[static_cast<size_t>(row * e.nk + first)] != weight;
      for (int64_t y = 0; y < slot; ++y) {
        const int64_t earlier = r.top_keys[static_cast<size_t>(row * e.k + y)];
        ASSERT_NE(earlier, r.top_keys[x]) << what << " top entry " << x << ": key listed twice";
        lower_twin_before = lower_twin_before || earlier == first;
      }
      ASSERT_TRUE(lower_twin_before) << what << " top entry " << x << ": key " << r.top_keys[x]
                                     << " without its exact twin " << first << " before it";
    }
    if (r.top_keys[x] != e.top_keys[x] && r.top_keys[x] >= 0 && e.top_keys[x] >= 0) {
      const double got = e.weights[static_cast<size_t>(row * e.nk + r.top_keys[x])];
      const bool exact_tie = twins == nullptr && got == e.top_weights[x];
      ASSERT_TRUE(!exact_tie && std::abs(got - e.top_weights[x]) <= kNearTie)
          << what << " top entry " << x << ": key " << r.top_keys[x] << " (reference weight " << got
          << ") where key " << e.top_keys[x] << " (" << e.top_weights[x] << ") was expected";
      continue;
    }
    ASSERT_EQ(r.top_keys[x], e.top_keys[x]) << what << " top entry " << x;
    ASSERT_NEAR(weights[x], e.top_weights[x], kTolerance) << what << " top entry " << x;
  }
  for (size_t x = 0; x < received.size(); ++x)
    ASSERT_NEAR(received[x], e.received[x], kTolerance * std::max(1.0, e.received[x])) << what << " key " << x;
}

// Random odd sizes, GQA included.
Sizes random_sizes(Random& rng) {
  const int64_t lengths[] = {1, 3, 17, 113, 130};
  auto length = [&] { return rng.chance(0.5) ? lengths[rng.integer(0, 4)] : rng.integer(1, 200); };
  const int64_t kv_heads = rng.integer(1, 2);
  return {rng.integer(1, 2), kv_heads * rng.integer(1, 3), kv_heads, length(), length(), rng.integer(1, 70),
          rng.integer(1, 70)};
}

// Keys repeated (equal logits, equal weights): the top k must break the ties to the lower index.
void add_ties(Case& c, Random& rng) {
  const int64_t nk = c.k.size(2), dk = c.k.size(3);
  if (nk < 2) return;
  std::vector<float> k = c.k.to_vector();
  const int64_t heads = c.k.numel() / (nk * dk);
  for (int64_t g = 0; g < heads; ++g)
    for (int64_t j = 1; j < nk; ++j)
      if (rng.chance(0.3)) {
        const int64_t from = rng.integer(0, j - 1);
        std::copy_n(k.begin() + (g * nk + from) * dk, dk, k.begin() + (g * nk + j) * dk);
      }
  c.k = Tensor::from(std::move(k), c.k.shape());
  c.name += " ties";
}

std::vector<Case> random_cases(Random& rng) {
  std::vector<Case> cases;
  for (MaskKind kind : qkv_test::kAllMasks)
    for (int repeat = 0; repeat < 2; ++repeat) {
      const qkv_test::Modifier modifier =
          repeat == 1 ? qkv_test::kAllModifiers[rng.integer(0, 3)] : qkv_test::Modifier::None;
      Case c = qkv_test::make_case(rng, random_sizes(rng), kind, 1.0, 0.0f, modifier);
      if (rng.chance(0.5)) add_ties(c, rng);
      cases.push_back(c);
    }
  cases.push_back(qkv_test::make_case(rng, {1, 4, 2, 300, 500, 64, 64}, MaskKind::Causal, 1.0, 0.0f));
  return cases;
}

AttentionOptions summary_options(const Case& c, Backend backend, int64_t k) {
  AttentionOptions options = qkv_test::options_of(c, backend);
  options.summary_top_k = k;
  return options;
}

TEST(Summary, FlashMatchesReferenceWeightsEverywhere) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const std::vector<Case> cases = random_cases(rng);
  std::vector<Expected> expected;
  std::vector<Twins> twins;
  std::vector<int64_t> ks;
  for (const Case& c : cases) {
    twins.push_back(twins_of(c));
    AttentionOptions options = qkv_test::options_of(c, Backend::Reference);
    options.need_weights = true;
    ks.push_back(rng.chance(0.3) ? rng.integer(1, 3) : rng.integer(4, 40));
    expected.push_back(summaries_of(qkv::scaled_dot_product_attention(c.q, c.k, c.v, options).weights, ks.back()));
  }
  qkv_test::on_every_target_and_thread_count([&] {
    for (size_t n = 0; n < cases.size(); ++n) {
      const Case& c = cases[n];
      AttentionResult r = poisoned(c, ks[n]);
      qkv::scaled_dot_product_attention_into(c.q, c.k, c.v, r, summary_options(c, Backend::Flash, ks[n]));
      expect_summaries(expected[n], r, c.name + " k=" + std::to_string(ks[n]), &twins[n]);
      // The output is flash's: against the reference's to the kernels' tolerance.
      const AttentionResult plain =
          qkv::scaled_dot_product_attention(c.q, c.k, c.v, qkv_test::options_of(c, Backend::Reference));
      const std::vector<float> got = r.output.to_vector(), want = plain.output.to_vector();
      for (size_t x = 0; x < got.size(); ++x) ASSERT_NEAR(got[x], want[x], 1e-4) << c.name << " output " << x;
    }
  });
}

TEST(Summary, ReferenceBackendAndAutoWithWeights) {
  Random rng;
  SCOPED_TRACE(rng.note());
  for (const Case& c : random_cases(rng)) {
    const int64_t k = rng.integer(1, 20);
    AttentionOptions options = summary_options(c, Backend::Auto, k);
    options.need_weights = true;  // Auto runs the reference, which returns weights and summaries
    AttentionResult r = poisoned(c, k);
    r.weights = Tensor::full(Shape{c.q.size(0), c.q.size(1), c.q.size(2), c.k.size(2)}, 0.5f);
    qkv::scaled_dot_product_attention_into(c.q, c.k, c.v, r, options);
    expect_summaries(summaries_of(r.weights, k), r, c.name + " auto+weights");
    AttentionResult alone = poisoned(c, k);
    qkv::scaled_dot_product_attention_into(c.q, c.k, c.v, alone, summary_options(c, Backend::Reference, k));
    expect_summaries(summaries_of(r.weights, k), alone, c.name + " reference");
  }
}

// Rank 3 and rank 2 inputs: the summaries take q's leading dims.
TEST(Summary, ShapesFollowTheLeadingDims) {
  Random rng;
  const Tensor q = rng.randn(Shape{2, 5, 8}), k = rng.randn(Shape{2, 70, 8}), v = rng.randn(Shape{2, 70, 4});
  AttentionOptions options;
  options.summary_top_k = 3;
  const AttentionResult r = qkv::scaled_dot_product_attention(q, k, v, options);
  EXPECT_EQ(r.entropy.shape(), (Shape{2, 5}));
  EXPECT_EQ(r.top_weights.shape(), (Shape{2, 5, 3}));
  EXPECT_EQ(r.top_keys.size(), 30u);
  EXPECT_EQ(r.received.shape(), (Shape{2, 70}));
  const AttentionResult one = qkv::scaled_dot_product_attention(q.narrow(0, 0, 1).squeeze(0), k.narrow(0, 0, 1).squeeze(0),
                                                                v.narrow(0, 0, 1).squeeze(0), options);
  EXPECT_EQ(one.received.shape(), (Shape{70}));
  // Without summaries the fields are reset.
  AttentionResult reused = r;
  options.summary_top_k = 0;
  qkv::scaled_dot_product_attention_into(q, k, v, reused, options);
  EXPECT_FALSE(reused.entropy.defined());
  EXPECT_TRUE(reused.top_keys.empty());
}

void expect_error(const AttentionOptions& options, const std::string& needle) {
  Random rng;
  const Tensor q = rng.randn(Shape{1, 2, 4, 8}), k = rng.randn(Shape{1, 2, 6, 8}), v = rng.randn(Shape{1, 2, 6, 8});
  try {
    qkv::scaled_dot_product_attention(q, k, v, options);
    FAIL() << "no error for " << needle;
  } catch (const qkv::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Summary, BadOptionsAreClearErrors) {
  AttentionOptions options;
  options.summary_top_k = -1;
  expect_error(options, "summary_top_k must be in [0, 256], got -1");
  options.summary_top_k = 257;
  expect_error(options, "got 257");
  options.summary_top_k = 4;
  options.dropout_p = 0.1f;
  expect_error(options, "take no dropout");
  options.dropout_p = 0;
  options.backend = Backend::Decode;
  expect_error(options, "backend Decode does not compute summaries");
}

}  // namespace
