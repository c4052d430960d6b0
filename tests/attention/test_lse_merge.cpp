// The log-sum-exp merge and the sink gradient (src/attention/lse_merge.hpp), which decode's chunk
// merge, ring attention's block and sink merges and every sink gradient call, against float64
// loops over the whole row: random rows cut into parts at random, parts that saw no key (-inf),
// rows no part saw, a part that saw NaN, sinks (parts with no output), several float64 blocks of
// columns, and the merge written over its first part.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "attention/lse_merge.hpp"

namespace qkv::detail {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// One row: scores s_j (-inf: hidden key) and values v_j (dv each), optionally a sink.
struct Row {
  std::vector<double> s;
  std::vector<std::vector<double>> v;
  bool has_sink = false;
  double sink = 0;
};

// The float64 softmax of the whole row: output and lse (0 and -inf when nothing is visible).
void whole_row(const Row& row, size_t dv, std::vector<double>& out, double& lse) {
  double m = row.has_sink ? row.sink : -kInf;
  for (double x : row.s) m = std::max(m, x);
  out.assign(dv, 0.0);
  if (m == -kInf) {
    lse = -kInf;
    return;
  }
  double l = row.has_sink ? std::exp(row.sink - m) : 0.0;
  for (size_t j = 0; j < row.s.size(); ++j) {
    if (row.s[j] == -kInf) continue;
    const double w = std::exp(row.s[j] - m);
    l += w;
    for (size_t c = 0; c < dv; ++c) out[c] += w * row.v[j][c];
  }
  for (double& x : out) x /= l;
  lse = m + std::log(l);
}

// The online-softmax state of keys [begin, end), in float as a kernel leaves it.
struct Part {
  float max = -std::numeric_limits<float>::infinity(), sum = 0;
  std::vector<float> out;
};
Part part_of(const Row& row, size_t dv, size_t begin, size_t end) {
  Part p;
  p.out.assign(dv, 0.0f);
  double m = -kInf;
  for (size_t j = begin; j < end; ++j) m = std::max(m, row.s[j]);
  if (m == -kInf) return p;
  double l = 0;
  std::vector<double> o(dv, 0.0);
  for (size_t j = begin; j < end; ++j) {
    if (row.s[j] == -kInf) continue;
    const double w = std::exp(row.s[j] - m);
    l += w;
    for (size_t c = 0; c < dv; ++c) o[c] += w * row.v[j][c];
  }
  p.max = static_cast<float>(m);
  p.sum = static_cast<float>(l);
  for (size_t c = 0; c < dv; ++c) p.out[c] = static_cast<float>(o[c]);
  return p;
}

MergedRow merge(const std::vector<Part>& parts, const Row& row, size_t dv, float* out) {
  const float sink = static_cast<float>(row.sink);
  const int64_t n = static_cast<int64_t>(parts.size()) + (row.has_sink ? 1 : 0);
  return merge_softmax_parts(
      n,
      [&](int64_t c) {
        if (c == static_cast<int64_t>(parts.size())) return SoftmaxPart{sink, 1.0f, nullptr};
        const Part& p = parts[static_cast<size_t>(c)];
        return SoftmaxPart{p.max, p.sum, p.out.data()};
      },
      dv, out);
}

TEST(LseMerge, RandomRowsCutIntoPartsMatchTheWholeRowInFloat64) {
  std::mt19937 rng(40);
  for (int trial = 0; trial < 400; ++trial) {
    const size_t keys = 1 + rng() % 200, dv = 1 + rng() % 150;
    Row row;
    const double spread = trial % 4 == 0 ? 60.0 : 4.0;  // some rows with large logits
    std::uniform_real_distribution<double> score(-spread, spread), value(-2.0, 2.0);
    const int hide = static_cast<int>(rng() % 4);  // 0: none hidden; 3: every key hidden
    for (size_t j = 0; j < keys; ++j) {
      const bool hidden = hide == 3 || (hide > 0 && rng() % 3 == 0) || (hide == 2 && j < keys / 2);
      row.s.push_back(hidden ? -kInf : score(rng));
      row.v.emplace_back(dv);
      for (double& x : row.v.back()) x = value(rng);
    }
    row.has_sink = trial % 3 == 0;
    row.sink = score(rng);
    // Parts: cut at random points (some empty), as decode's chunks or ring's blocks.
    std::vector<size_t> cuts{0, keys};
    for (size_t c = rng() % 6; c > 0; --c) cuts.push_back(rng() % (keys + 1));
    std::sort(cuts.begin(), cuts.end());
    std::vector<Part> parts;
    for (size_t c = 0; c + 1 < cuts.size(); ++c) parts.push_back(part_of(row, dv, cuts[c], cuts[c + 1]));
    // The merge writes over the first part's output when asked to.
    std::vector<float> separate(dv);
    float* out = trial % 2 ? parts[0].out.data() : separate.data();
    const MergedRow merged = merge(parts, row, dv, out);

    std::vector<double> want;
    double want_lse = 0;
    whole_row(row, dv, want, want_lse);
    SCOPED_TRACE(::testing::Message() << "trial " << trial << ", keys " << keys << ", dv " << dv << ", parts "
                                      << parts.size() << ", sink " << row.has_sink);
    if (want_lse == -kInf) {
      EXPECT_EQ(merged.lse, -std::numeric_limits<float>::infinity());
      EXPECT_EQ(merged.sum, 0.0f);
      for (size_t c = 0; c < dv; ++c) EXPECT_EQ(out[c], 0.0f);
      continue;
    }
    EXPECT_NEAR(merged.lse, want_lse, 1e-5 * std::max(1.0, std::abs(want_lse)));
    EXPECT_NEAR(merged.max + std::log(static_cast<double>(merged.sum)), want_lse, 1e-5 * std::max(1.0, std::abs(want_lse)));
    for (size_t c = 0; c < dv; ++c) ASSERT_NEAR(out[c], want[c], 1e-5) << "column " << c;
  }
}

TEST(LseMerge, APartThatSawNanMakesTheRowNan) {
  const size_t dv = 5;
  std::vector<float> good(dv, 1.0f), bad(dv, std::nanf("")), out(dv, 0.0f);
  for (const float first : {-std::numeric_limits<float>::infinity(), 0.5f}) {
    const SoftmaxPart parts[3] = {{first, 1.0f, good.data()}, {std::nanf(""), 1.0f, bad.data()}, {0.0f, 1.0f, nullptr}};
    const MergedRow merged = merge_softmax_parts(3, [&](int64_t c) { return parts[c]; }, dv, out.data());
    EXPECT_TRUE(std::isnan(merged.lse));
    EXPECT_TRUE(std::isnan(merged.max));
    EXPECT_TRUE(std::isnan(merged.sum));
    for (float x : out) EXPECT_TRUE(std::isnan(x));
  }
}

TEST(LseMerge, PartsThatSawNothingAreNeverRead) {
  const size_t dv = 3;
  std::vector<float> poison(dv, std::nanf("")), seen{1.0f, 2.0f, 3.0f}, out(dv);
  const SoftmaxPart parts[2] = {{-std::numeric_limits<float>::infinity(), 0.0f, poison.data()}, {2.0f, 4.0f, seen.data()}};
  const MergedRow merged = merge_softmax_parts(2, [&](int64_t c) { return parts[c]; }, dv, out.data());
  EXPECT_FLOAT_EQ(merged.lse, 2.0f + std::log(4.0f));
  for (size_t c = 0; c < dv; ++c) EXPECT_FLOAT_EQ(out[c], seen[c] / 4.0f);
}

TEST(LseMerge, ASinkAloneGivesZerosAndItsLogit) {
  std::vector<float> out(4, 7.0f);
  const SoftmaxPart parts[2] = {{-std::numeric_limits<float>::infinity(), 0.0f, nullptr}, {-1.5f, 1.0f, nullptr}};
  const MergedRow merged = merge_softmax_parts(2, [&](int64_t c) { return parts[c]; }, out.size(), out.data());
  EXPECT_EQ(merged.lse, -1.5f);
  for (float x : out) EXPECT_EQ(x, 0.0f);
}

// d/dsink of L = dO . O(sink) in float64 by central differences, against sink_gradient_of_row
// given the row stats either way (shift = lse, scale = 1; shift = max, scale = 1 / sum).
TEST(LseMerge, SinkGradientOfRowIsTheDerivativeOfTheLoss) {
  std::mt19937 rng(41);
  std::uniform_real_distribution<double> u(-3.0, 3.0);
  for (int trial = 0; trial < 50; ++trial) {
    const size_t keys = 1 + rng() % 40, dv = 1 + rng() % 20;
    Row row;
    row.has_sink = true;
    row.sink = u(rng);
    for (size_t j = 0; j < keys; ++j) {
      row.s.push_back(rng() % 5 == 0 ? -kInf : u(rng));
      row.v.emplace_back(dv);
      for (double& x : row.v.back()) x = u(rng);
    }
    std::vector<double> dout(dv);
    for (double& x : dout) x = u(rng);
    const auto loss = [&](double sink) {
      Row r = row;
      r.sink = sink;
      std::vector<double> o;
      double lse = 0;
      whole_row(r, dv, o, lse);
      double l = 0;
      for (size_t c = 0; c < dv; ++c) l += dout[c] * o[c];
      return l;
    };
    const double h = 1e-5, want = (loss(row.sink + h) - loss(row.sink - h)) / (2 * h);
    std::vector<double> o;
    double lse = 0;
    whole_row(row, dv, o, lse);
    const std::vector<float> of(o.begin(), o.end()), gof(dout.begin(), dout.end());
    const float sink = static_cast<float>(row.sink);
    const int64_t n = static_cast<int64_t>(dv);
    EXPECT_NEAR(sink_gradient_of_row(sink, static_cast<float>(lse), 1.0f, gof.data(), of.data(), n), want, 1e-4);
    double m = row.sink, l = 0;
    for (double x : row.s) m = std::max(m, x);
    l = std::exp(row.sink - m);
    for (double x : row.s) l += x == -kInf ? 0.0 : std::exp(x - m);
    EXPECT_NEAR(sink_gradient_of_row(sink, static_cast<float>(m), static_cast<float>(1 / l), gof.data(), of.data(), n),
                want, 1e-4);
  }
  // A row that saw nothing, not even a sink, adds nothing (even with NaN in dO or O).
  const float nan = std::nanf("");
  EXPECT_EQ(sink_gradient_of_row(0.0f, -std::numeric_limits<float>::infinity(), 1.0f, &nan, &nan, 1), 0.0);
  EXPECT_EQ(sink_gradient_of_row(0.0f, std::numeric_limits<float>::infinity(), 0.0f, &nan, &nan, 1), 0.0);
}

}  // namespace
}  // namespace qkv::detail
