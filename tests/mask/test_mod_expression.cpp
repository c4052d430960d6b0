// Score and mask functions as text (src/mask/mod_expression.hpp): each expression against a C++
// lambda twin on random lines of odd lengths and steps, its derivative against a float64 central
// difference of the twin, the folding of constants, and every error naming its column.
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "mask/mod_expression.hpp"
#include "qkv/qkv.hpp"

namespace qkv::detail {
namespace {

using Twin = std::function<double(double s, double q, double k, double b, double h)>;

struct Case {
  const char* text;
  Twin twin;
};

// Random lines: (query_step, key_step) as flash's key lines (1, 0), decode's (0, 1), a strided
// residue's (S, 0), of odd lengths.
std::vector<std::pair<ModLine, size_t>> random_lines(std::mt19937& rng) {
  std::vector<std::pair<ModLine, size_t>> lines;
  const int64_t steps[][2] = {{1, 0}, {0, 1}, {7, 0}, {0, 5}};
  for (const auto& step : steps)
    for (const size_t n : {1u, 13u, 48u, 67u})
      lines.push_back({{static_cast<int64_t>(rng() % 3), static_cast<int64_t>(rng() % 5),
                        static_cast<int64_t>(rng() % 100), static_cast<int64_t>(rng() % 100), step[0], step[1]},
                       n});
  return lines;
}

TEST(ModExpression, ScoreFunctionsMatchTheirTwinsAndDerivatives) {
  const Case cases[] = {
      {"s - 0.1 * abs(q - k)", [](double s, double q, double k, double, double) { return s - 0.1 * std::fabs(q - k); }},
      {"30 * tanh(s / 30)", [](double s, double, double, double, double) { return 30 * std::tanh(s / 30); }},
      {"s * s / 4 - exp(-s) + h", [](double s, double, double, double, double h) { return s * s / 4 - std::exp(-s) + h; }},
      {"where(k <= q, s, -s / 2)", [](double s, double q, double k, double, double) { return k <= q ? s : -s / 2; }},
      {"max(s, 0.5) + min(s, -1) * b", [](double s, double, double, double b, double) {
         return std::fmax(s, 0.5) + std::fmin(s, -1) * b; }},
      {"sqrt(s * s + 1) + log(s * s + 2) - floor(q / 3)", [](double s, double q, double, double, double) {
         return std::sqrt(s * s + 1) + std::log(s * s + 2) - std::floor(q / 3); }},
      {"-(2 * 3) + s", [](double s, double, double, double, double) { return -6 + s; }},
  };
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    const ModExpression e = ModExpression::parse(c.text, ModKind::Score);
    for (const auto& [line, n] : random_lines(rng)) {
      std::vector<float> s(n), out(n, NAN), d(n, NAN), scratch(e.scratch_floats(n), NAN);
      for (float& x : s) x = normal(rng);
      e.evaluate(line, n, s.data(), nullptr, out.data(), d.data(), scratch.data());
      for (size_t x = 0; x < n; ++x) {
        const double q = static_cast<double>(line.i0 + static_cast<int64_t>(x) * line.query_step);
        const double k = static_cast<double>(line.j0 + static_cast<int64_t>(x) * line.key_step);
        const double b = static_cast<double>(line.b), h = static_cast<double>(line.h), sx = s[x];
        const double want = c.twin(sx, q, k, b, h);
        EXPECT_NEAR(out[x], want, 1e-5 * (1 + std::fabs(want))) << "x " << x;
        // Away from kinks (abs, where, min, max): the central difference of the twin.
        const double eps = 1e-4;
        const double slope = (c.twin(sx + eps, q, k, b, h) - c.twin(sx - eps, q, k, b, h)) / (2 * eps);
        const double left = (want - c.twin(sx - eps, q, k, b, h)) / eps;
        const double right = (c.twin(sx + eps, q, k, b, h) - want) / eps;
        if (std::fabs(left - right) < 1e-3 * (1 + std::fabs(slope)))
          EXPECT_NEAR(d[x], slope, 1e-3 * (1 + std::fabs(slope))) << "x " << x;
      }
    }
  }
}

TEST(ModExpression, ConstantsFoldIntoOneOperation) {
  // 2 * 3 + s: one constant, s, the sum.
  EXPECT_EQ(ModExpression::parse("2 * 3 + s", ModKind::Score).scratch_floats(1), 2u * 3u);
  EXPECT_EQ(ModExpression::parse("tanh(1) * exp(0) - 1", ModKind::Score).scratch_floats(1), 2u * 1u);
  EXPECT_FALSE(ModExpression::parse("q - k", ModKind::Score).reads_score());
  EXPECT_TRUE(ModExpression::parse("s", ModKind::Score).reads_score());
}

TEST(ModExpression, MaskFunctionsReadInputsByQueryKeyHeadAndBatch) {
  // Two batches of 10 tokens: documents by token, and one flag per head.
  const std::vector<float> doc = {0, 0, 0, 1, 1, 2, 2, 2, 2, 3, /* batch 1 */ 0, 1, 1, 1, 1, 1, 1, 2, 2, 2};
  const std::vector<float> head_on = {1, 0, 1};
  const ModInput inputs[] = {{doc.data(), 10, 10}, {head_on.data(), 0, 3}};
  const ModExpression e =
      ModExpression::parse("doc(q) == doc(k) && k <= q || on(h) == 0", ModKind::Mask, {"doc", "on"});
  ASSERT_EQ(e.uses().size(), 3u);
  EXPECT_EQ(e.uses()[2].index, ModExpression::Index::Head);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 3; ++h)
      for (int64_t i = 0; i < 10; ++i) {
        std::vector<float> out(10, NAN), scratch(e.scratch_floats(10), NAN);
        e.evaluate({b, h, i, 0, 0, 1}, 10, nullptr, inputs, out.data(), nullptr, scratch.data());
        for (int64_t j = 0; j < 10; ++j) {
          const bool shown = (doc[b * 10 + i] == doc[b * 10 + j] && j <= i) || head_on[h] == 0;
          EXPECT_EQ(out[j], shown ? 1.0f : 0.0f) << b << " " << h << " " << i << " " << j;
        }
      }
}

void expect_error(const std::string& text, ModKind kind, size_t column, const std::string& words,
                  const std::vector<std::string>& inputs = {}) {
  try {
    ModExpression::parse(text, kind, inputs);
    ADD_FAILURE() << text << " parsed";
  } catch (const MaskParseError& e) {
    EXPECT_EQ(e.column(), column) << e.what();
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

TEST(ModExpression, ErrorsNameTheColumnAndTheToken) {
  expect_error("s - 0.1 * abz(q - k)", ModKind::Score, 11, "'abz': unknown function");
  expect_error("s + x", ModKind::Score, 5, "'x': unknown name; the variables are s, q, k, b, h (no inputs");
  expect_error("tanh(s, 2)", ModKind::Score, 1, "tanh takes 1 argument, found 2");
  expect_error("where(s, 1)", ModKind::Score, 1, "where takes 3 arguments, found 2");
  expect_error("s / (2 - 2)", ModKind::Score, 3, "division by zero");
  expect_error("s + log(-1)", ModKind::Score, 5, "outside the function's domain");
  expect_error("s > 0", ModKind::Mask, 1, "a mask function does not read the score s");
  expect_error("q < k < 3", ModKind::Mask, 7, "expected an operator or the end");
  expect_error("s # 2", ModKind::Score, 3, "'#': not part of an expression");
  expect_error("s +", ModKind::Score, 4, "the end: expected a number");
  expect_error("(s", ModKind::Score, 3, "expected ')'");
  expect_error("", ModKind::Score, 1, "expected an expression");
  expect_error("doc(s) == doc(k)", ModKind::Mask, 5, "an input is indexed by q, k, h or b", {"doc"});
  expect_error("s + 1e99", ModKind::Score, 5, "not a finite number");
  expect_error("s + \x1b", ModKind::Score, 5, "'?'");
  expect_error(std::string(100, '(') + "s" + std::string(100, ')'), ModKind::Score, 66, "nested deeper than 64");
}

TEST(ModExpression, InputNamesAreCheckedOnce) {
  EXPECT_THROW(ModExpression::parse("s", ModKind::Score, {"tanh"}), Error);
  EXPECT_THROW(ModExpression::parse("s", ModKind::Score, {"q"}), Error);
  EXPECT_THROW(ModExpression::parse("s", ModKind::Score, {"doc", "doc"}), Error);
  EXPECT_THROW(ModExpression::parse("s", ModKind::Score, {"two words"}), Error);
  EXPECT_NO_THROW(ModExpression::parse("s + bias(k)", ModKind::Score, {"bias"}));
}

}  // namespace
}  // namespace qkv::detail

// ---- The mask function as a qkv::Mask (Mask::expression, Mask::parse's "mask:").
namespace qkv {
namespace {

TEST(MaskFunction, ParseTakesAWholeMaskFunctionAndCountsColumnsInTheWholeText) {
  const Mask m = Mask::parse("  mask: k < 4 || k <= q");
  ASSERT_TRUE(m.rule());
  EXPECT_EQ(m.rule()->kind, Mask::Rule::Kind::Expression);
  EXPECT_EQ(m.str(), "mask: k < 4 || k <= q");
  try {
    Mask::parse("mask: k <= q && s > 0");
    ADD_FAILURE() << "parsed";
  } catch (const MaskParseError& e) {
    EXPECT_EQ(e.column(), 17u) << e.what();
  }
}

TEST(MaskFunction, InputsAreCheckedAgainstTheProblem) {
  const Tensor q = Tensor::zeros(Shape{2, 3, 5, 4}), kv = Tensor::zeros(Shape{2, 3, 7, 4});
  const auto attend = [&](const Mask& mask) {
    AttentionOptions options;
    options.mask = mask;
    return scaled_dot_product_attention(q, kv, kv, options);
  };
  const auto expect_error = [&](const Mask& mask, const std::string& words) {
    try {
      attend(mask);
      ADD_FAILURE() << "no error for " << mask.str();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  // doc(k) needs Nk = 7 entries; (B, L) needs B = 2; b-indexed inputs are (L).
  expect_error(Mask::expression("doc(q) == doc(k)", {{"doc", Tensor::zeros(Shape{5})}}),
               "input 'doc' is (5): indexed by k (Nk = 7) it needs L >= 7");
  expect_error(Mask::expression("doc(q) == doc(k)", {{"doc", Tensor::zeros(Shape{3, 7})}}),
               "input 'doc' is (3, 7) but should be a float32 (L) or (B, L) with B = 2");
  expect_error(Mask::expression("p(b) > 0", {{"p", Tensor::zeros(Shape{2, 7})}}), "indexed by b it should be (L)");
  expect_error(Mask::expression("on(h) > 0", {{"on", Tensor::zeros(Shape{2})}}), "indexed by h (Hq = 3)");
  EXPECT_THROW(Mask::expression("doc(q) == doc(k)"), MaskParseError);  // no input named doc
  // Every key hidden from every query: zeros, as an empty row gives, never NaN.
  const AttentionResult hidden = attend(Mask::expression("q < 0"));
  for (int64_t x = 0; x < hidden.output.numel(); ++x) EXPECT_EQ(hidden.output.data()[x], 0.0f);
}

}  // namespace
}  // namespace qkv

namespace qkv::detail {
namespace {
TEST(ModExpression, LongUnaryChainsAreRefusedNotRecursedThrough) {
  EXPECT_THROW(ModExpression::parse(std::string(100000, '-') + "s", ModKind::Score), MaskParseError);
  EXPECT_THROW(ModExpression::parse(std::string(100000, '!') + "q", ModKind::Mask), MaskParseError);
}
}  // namespace
}  // namespace qkv::detail
