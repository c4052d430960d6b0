// qkv::Mask: builders, combination with &, normalisation into one band, and the helper tensors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "attention/problem.hpp"
#include "harness/oracle.hpp"
#include "qkv/attention.hpp"

namespace {

using ::testing::HasSubstr;
using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;
using qkv_test::Random;

constexpr int64_t kUnbounded = Mask::kUnbounded;

// The default mask hides nothing and has no parts.
TEST(Mask, DefaultIsNone) {
  const Mask m;
  EXPECT_TRUE(m.is_none());
  EXPECT_FALSE(m.has_band());
  EXPECT_FALSE(m.has_key_lengths());
  EXPECT_TRUE(m.terms().empty());
  EXPECT_EQ(m.band_lo(), -kUnbounded);
  EXPECT_EQ(m.band_hi(), kUnbounded);
}

// causal(offset) is the band [-unbounded, offset].
TEST(Mask, CausalIsAnUpperBand) {
  Random rng;
  SCOPED_TRACE(rng.note());
  for (int64_t offset : {int64_t{0}, rng.integer(1, 1000)}) {
    const Mask m = Mask::causal(offset);
    EXPECT_FALSE(m.is_none());
    EXPECT_TRUE(m.has_band());
    EXPECT_FALSE(m.has_key_lengths());
    EXPECT_TRUE(m.terms().empty());
    EXPECT_EQ(m.band_lo(), -kUnbounded);
    EXPECT_EQ(m.band_hi(), offset);
  }
  EXPECT_EQ(Mask::causal().band_hi(), 0);
}

// window(left, right, offset) is the band [offset - left, offset + right].
TEST(Mask, WindowIsABand) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t left = rng.integer(0, 50), right = rng.integer(0, 50), offset = rng.integer(0, 50);
  const Mask m = Mask::window(left, right, offset);
  EXPECT_TRUE(m.has_band());
  EXPECT_FALSE(m.is_none());
  EXPECT_EQ(m.band_lo(), offset - left);
  EXPECT_EQ(m.band_hi(), offset + right);
  const Mask defaults = Mask::window(left);
  EXPECT_EQ(defaults.band_lo(), -left);
  EXPECT_EQ(defaults.band_hi(), 0);
}

// Combining bands keeps the larger lower edge and the smaller upper edge, in either order.
TEST(Mask, CombiningBandsIntersects) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t causal_offset = rng.integer(0, 20);
  const int64_t left = rng.integer(0, 20), right = rng.integer(0, 20), offset = rng.integer(0, 20);
  const Mask a = Mask::causal(causal_offset) & Mask::window(left, right, offset);
  const Mask b = Mask::window(left, right, offset) & Mask::causal(causal_offset);
  for (const Mask& m : {a, b}) {
    EXPECT_EQ(m.band_lo(), offset - left);
    EXPECT_EQ(m.band_hi(), std::min(causal_offset, offset + right));
  }
  const Mask two_windows = Mask::window(3, 5) & Mask::window(7, 1, 2);
  EXPECT_EQ(two_windows.band_lo(), std::max<int64_t>(-3, 2 - 7));
  EXPECT_EQ(two_windows.band_hi(), std::min<int64_t>(5, 2 + 1));
}

// key_lengths are kept; combining two takes the elementwise minimum.
TEST(Mask, KeyLengthsCombineByMinimum) {
  Random rng;
  SCOPED_TRACE(rng.note());
  std::vector<int64_t> x, y, want;
  for (int b = 0; b < 5; ++b) {
    x.push_back(rng.integer(0, 100));
    y.push_back(rng.integer(0, 100));
    want.push_back(std::min(x.back(), y.back()));
  }
  const Mask m = Mask::key_lengths(x);
  EXPECT_TRUE(m.has_key_lengths());
  EXPECT_FALSE(m.has_band());
  EXPECT_FALSE(m.is_none());
  EXPECT_EQ(m.lengths(), x);
  EXPECT_EQ((m & Mask::key_lengths(y)).lengths(), want);
  EXPECT_EQ((Mask::key_lengths(y) & m).lengths(), want);
}

// Tensor terms accumulate in order, keep their kind and share the caller's storage.
TEST(Mask, TensorTermsAccumulate) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const Tensor keep1 = Tensor::full({3, 5}, 1.0f);
  const Tensor add = rng.randn({2, 3, 5});
  const Tensor keep2 = Tensor::full({2, 1, 3, 5}, 1.0f);
  const Mask m = Mask::keep(keep1) & Mask::additive(add) & Mask::causal() & Mask::keep(keep2);
  ASSERT_EQ(m.terms().size(), 3u);
  EXPECT_FALSE(m.terms()[0].additive);
  EXPECT_TRUE(m.terms()[1].additive);
  EXPECT_FALSE(m.terms()[2].additive);
  EXPECT_TRUE(m.terms()[0].values.shares_storage_with(keep1));
  EXPECT_TRUE(m.terms()[1].values.shares_storage_with(add));
  EXPECT_TRUE(m.terms()[2].values.shares_storage_with(keep2));
  EXPECT_EQ(m.band_hi(), 0);
  EXPECT_FALSE(m.is_none());
  EXPECT_FALSE(Mask::keep(keep1).is_none());
  EXPECT_FALSE(Mask::additive(add).is_none());
}

// a &= b gives the same mask as a & b.
TEST(Mask, AndAssignEqualsAnd) {
  Mask m = Mask::causal(3);
  m &= Mask::window(4, 2);
  m &= Mask::key_lengths({9, 2});
  m &= Mask::keep(Tensor::full({3, 5}, 1.0f));
  const Mask want =
      Mask::causal(3) & Mask::window(4, 2) & Mask::key_lengths({9, 2}) & Mask::keep(Tensor::full({3, 5}, 1.0f));
  EXPECT_EQ(m.band_lo(), want.band_lo());
  EXPECT_EQ(m.band_hi(), want.band_hi());
  EXPECT_EQ(m.lengths(), want.lengths());
  EXPECT_EQ(m.terms().size(), want.terms().size());
  EXPECT_EQ(m.str(), want.str());
}

// create_causal_mask(n) is (n, n), ones on and below the diagonal.
TEST(Mask, CreateCausalMaskIsLowerTriangular) {
  for (int64_t n : {1, 3, 17}) {
    const Tensor m = qkv::create_causal_mask(n);
    ASSERT_EQ(m.shape(), (Shape{n, n}));
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) EXPECT_EQ(m.at({i, j}), j <= i ? 1.0f : 0.0f) << i << ", " << j;
  }
}

// create_padding_mask(lengths, max_len) is (B, 1, 1, max_len), 1 for j < lengths[b].
TEST(Mask, CreatePaddingMask) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t max_len = rng.integer(1, 20);
  std::vector<int64_t> lengths{0, max_len};
  for (int b = 0; b < 3; ++b) lengths.push_back(rng.integer(0, max_len));
  const Tensor m = qkv::create_padding_mask(lengths, max_len);
  const int64_t batch = static_cast<int64_t>(lengths.size());
  ASSERT_EQ(m.shape(), (Shape{batch, 1, 1, max_len}));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j < max_len; ++j)
      EXPECT_EQ(m.at({b, 0, 0, j}), j < lengths[static_cast<size_t>(b)] ? 1.0f : 0.0f);
}

// A window reaching a negative distance is an error.
TEST(Mask, NegativeWindowThrows) {
  EXPECT_THROW(Mask::window(-1), qkv::Error);
  EXPECT_THROW(Mask::window(2, -1), qkv::Error);
  EXPECT_NO_THROW(Mask::window(0, 0));
}

// str() says what the user asked for, part by part.
TEST(Mask, StrNamesEveryPart) {
  const std::string s = (Mask::causal() & Mask::key_lengths({2, 5})).str();
  EXPECT_EQ(s, "causal & key_lengths(2, 5)");
  EXPECT_THAT(Mask::causal(7).str(), HasSubstr("7"));
  EXPECT_THAT(Mask::window(3, 1).str(), HasSubstr("window"));
  EXPECT_THAT(Mask::keep(Tensor::full({3, 5}, 1.0f)).str(), HasSubstr("keep"));
  EXPECT_THAT(Mask::additive(Tensor::zeros({3, 5})).str(), HasSubstr("additive"));
  EXPECT_FALSE(Mask().str().empty());
}

// ---- The symbolic patterns (issue 10) and the text form.

// Every (b, h, i, j) of a small problem under `mask`, as the library's normalised rule says
// (band, key lengths, keep terms and rule, the way build_problem hands them to the kernels),
// against a float64-oracle bias.
void expect_same_visibility(const Mask& mask, const qkv_test::Bias& bias, int64_t batch, int64_t heads, int64_t nq,
                            int64_t nk) {
  qkv::AttentionOptions options;
  options.mask = mask;
  const Tensor q = Tensor::zeros({batch, heads, nq, 4}), k = Tensor::zeros({batch, heads, nk, 4});
  const qkv::detail::BuiltProblem built = qkv::detail::build_problem("test: ", q, k, k, options);
  const qkv::detail::AttentionProblem& p = built.problem;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t j = 0; j < nk; ++j) {
          bool visible = j >= p.first_visible_key(i) && j < p.last_visible_key(b, i);
          for (const auto& term : p.terms) visible = visible && term.at(b, h, i, j) != 0.0f;
          if (!p.rule.empty()) visible = visible && p.rule.visible(b, h, i, j);
          const bool want = !bias || bias(b, h, i, j) != -qkv_test::kInf;
          ASSERT_EQ(visible, want) << mask.str() << " at b " << b << " h " << h << " i " << i << " j " << j;
        }
}

// strided(S, O): (O + i - j) mod S == 0 with a true modulo, for negative i - j too.
TEST(SparseMask, StridedIsATrueModulo) {
  for (int64_t stride : {1, 2, 3, 7})
    for (int64_t offset : {-9, -1, 0, 2, 11})
      expect_same_visibility(Mask::strided(stride, offset), qkv_test::strided_bias(stride, offset), 1, 1, 13, 17);
  // Query 0 sees keys 0, 4, 8 under strided(4): i - j = -4 is a multiple of 4.
  expect_same_visibility(Mask::strided(4), [](int64_t, int64_t, int64_t i, int64_t j) {
    return (i - j) % 4 == 0 ? 0.0 : -qkv_test::kInf;
  }, 1, 1, 3, 9);
}

TEST(SparseMask, GlobalTokensSeeAndAreSeen) {
  for (int64_t count : {0, 1, 3, 20})
    expect_same_visibility(Mask::causal() & (Mask::window(1) | Mask::global_tokens(count)),
                           qkv_test::all_of({qkv_test::causal_bias(),
                                             qkv_test::any_of({qkv_test::window_bias(1), qkv_test::global_bias(count)})}),
                           1, 1, 11, 11);
}

TEST(SparseMask, BlockSparseWithAndWithoutHeads) {
  Random rng;
  SCOPED_TRACE(rng.note());
  for (int repeat = 0; repeat < 6; ++repeat) {
    const int64_t heads = 3, nq = rng.integer(1, 20), nk = rng.integer(1, 20);
    const int64_t bq = rng.integer(1, 5), bk = rng.integer(1, 5);
    const int64_t rows = (nq + bq - 1) / bq, cols = (nk + bk - 1) / bk;
    for (const Shape& shape : {Shape{rows, cols}, Shape{1, rows, cols}, Shape{heads, rows, cols}}) {
      std::vector<float> values(static_cast<size_t>(shape.numel()));
      for (float& x : values) x = rng.chance(0.5) ? 1.0f : 0.0f;
      const Tensor layout = Tensor::from(std::move(values), shape);
      expect_same_visibility(Mask::block_sparse(layout, bq, bk), qkv_test::block_sparse_bias(layout, bq, bk), 2,
                             heads, nq, nk);
    }
  }
}

// & binds tighter than |, as in C++; unions of unions and with key lengths and keep tensors.
TEST(SparseMask, UnionsAndIntersections) {
  namespace t = qkv_test;
  const Tensor keep = Tensor::from(std::vector<float>(9 * 10, 0.0f), Shape{9, 10});
  keep.data()[5] = 1.0f;  // query 0 sees key 5
  const Mask m = Mask::strided(3) & Mask::causal() | Mask::window(0, 1) & Mask::key_lengths({7, 4}) | Mask::keep(keep);
  const t::Bias want = t::any_of({t::all_of({t::strided_bias(3), t::causal_bias()}),
                                  t::all_of({t::window_bias(0, 1), t::key_lengths_bias({7, 4})}), t::keep_bias(keep)});
  expect_same_visibility(m, want, 2, 1, 9, 10);
  // Anything | none sees everything; none & x is x.
  EXPECT_TRUE((Mask::strided(3) | Mask()).is_none());
  EXPECT_EQ((Mask() & Mask::strided(3)).str(), "strided(3)");
  // A top-level & of a union still normalises its band.
  const Mask sparse = Mask::causal() & (Mask::window(127) | Mask::strided(128));
  EXPECT_EQ(sparse.band_hi(), 0);
  EXPECT_NE(sparse.rule(), nullptr);
}

TEST(SparseMask, BadArgumentsAreClearErrors) {
  auto message = [](auto f) {
    try {
      f();
    } catch (const qkv::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_THAT(message([] { Mask::strided(0); }), HasSubstr("stride 0 must be >= 1"));
  EXPECT_THAT(message([] { Mask::strided(-2); }), HasSubstr("stride -2"));
  EXPECT_THAT(message([] { Mask::global_tokens(-1); }), HasSubstr("count -1"));
  EXPECT_THAT(message([] { Mask::block_sparse(Tensor::full({2, 2}, 1.0f), 0, 4); }), HasSubstr("block sizes (0, 4)"));
  EXPECT_THAT(message([] { Mask::block_sparse(Tensor::full({2}, 1.0f), 4, 4); }), HasSubstr("layout is (2)"));
  EXPECT_THAT(message([] { (void)(Mask::strided(2) | Mask::additive(Tensor::zeros({3, 3}))); }),
              HasSubstr("union of 'strided(2)' and 'additive(3, 3)'"));
  // An additive term beside a union (&) is fine; only inside one is it refused.
  EXPECT_NO_THROW((void)((Mask::strided(2) | Mask::causal()) & Mask::additive(Tensor::zeros({3, 3}))));
  // The layout is checked against the problem when attention runs, naming both shapes.
  const Tensor q = Tensor::zeros({1, 2, 10, 4});
  qkv::AttentionOptions options;
  options.mask = Mask::block_sparse(Tensor::full({3, 3}, 1.0f), 4, 4);
  EXPECT_NO_THROW(qkv::scaled_dot_product_attention(q, q, q, options));
  options.mask = Mask::block_sparse(Tensor::full({4, 3}, 1.0f), 4, 4);
  EXPECT_THAT(message([&] { qkv::scaled_dot_product_attention(q, q, q, options); }),
              HasSubstr("layout is (4, 3) but blocks of 4 x 4 over Nq = 10, Nk = 10 need (3, 3)"));
  options.mask = Mask::block_sparse(Tensor::full({2, 3}, 1.0f), 4, 4);
  EXPECT_THAT(message([&] { qkv::scaled_dot_product_attention(q, q, q, options); }),
              HasSubstr("layout is (2, 3) but blocks of 4 x 4 over Nq = 10, Nk = 10 need (3, 3) or (2, 3, 3)"));
  options.mask = Mask::block_sparse(Tensor::full({3, 3, 3}, 1.0f), 4, 4);
  EXPECT_THAT(message([&] { qkv::scaled_dot_product_attention(q, q, q, options); }), HasSubstr("layout is (3, 3, 3)"));
  options.mask = Mask::strided(2) | Mask::key_lengths({3, 4});
  EXPECT_THAT(message([&] { qkv::scaled_dot_product_attention(q, q, q, options); }),
              HasSubstr("key_lengths has 2 lengths but the batch is 1"));
}

// Mask::parse reads what str() prints, with the usual precedence.
TEST(SparseMask, ParseRoundTrips) {
  for (const std::string text :
       {"causal", "window(3)", "window(3, 1)", "padding(4)", "strided(128)", "strided(8, 3)", "global(16)",
        "causal & (window(127) | strided(128)) | global(16)", "causal & window(4) | strided(3) & global(2)",
        "(strided(4) | global(1)) & (window(2) | strided(5, 1))", "key_lengths(0, 5)"}) {
    const Mask m = Mask::parse(text);
    EXPECT_EQ(m.str(), text);
    EXPECT_EQ(Mask::parse(m.str()).str(), m.str());
  }
  EXPECT_TRUE(Mask::parse("").is_none());
  EXPECT_TRUE(Mask::parse(" none & none ").is_none());
  EXPECT_EQ(Mask::parse(" causal&(window( 3 ,1 )|strided(4))").str(), "causal & (window(3, 1) | strided(4))");
  // The parsed mask means what the builders mean: & before |.
  namespace t = qkv_test;
  expect_same_visibility(Mask::parse("causal & window(2) | strided(5) & global(3)"),
                         t::any_of({t::all_of({t::causal_bias(), t::window_bias(2)}),
                                    t::all_of({t::strided_bias(5), t::global_bias(3)})}),
                         1, 1, 12, 14);
  // Built masks print the same syntax back; forms outside the grammar say so by not parsing.
  const Mask built = Mask::causal() & (Mask::window(255) | Mask::strided(256)) | Mask::global_tokens(4);
  EXPECT_EQ(Mask::parse(built.str()).str(), built.str());
  for (const Mask& other : {Mask::causal(3), Mask::keep(Tensor::full({2, 2}, 1.0f)),
                            Mask::block_sparse(Tensor::full({2, 2}, 1.0f), 4, 4)})
    EXPECT_THROW(Mask::parse(other.str()), qkv::MaskParseError) << other.str();
  EXPECT_EQ(Mask::block_sparse(Tensor::full({3, 2, 2}, 1.0f), 4, 8).str(), "block_sparse(3, 2, 2; 4, 8)");
}

void expect_parse_error(const std::string& expression, size_t column, const std::string& message) {
  try {
    Mask::parse(expression);
    ADD_FAILURE() << "'" << expression << "' parsed";
  } catch (const qkv::MaskParseError& e) {
    EXPECT_EQ(e.column(), column) << e.what();
    EXPECT_THAT(e.what(), HasSubstr(message));
    EXPECT_THAT(e.what(), HasSubstr("mask '" + expression + "'"));
  }
}

TEST(SparseMask, ParseErrorsPointAtTheBadToken) {
  expect_parse_error("strided(0)", 9, "column 9, found '0': strided's stride must be at least 1");
  expect_parse_error("causal & (window(3) | strided(4)", 33, "found the end: expected &, | or ')' to close the '(' at column 10");
  expect_parse_error("causal | | global(2)", 10, "found '|': expected a mask");
  expect_parse_error("global(2) strided(3)", 11, "found 'strided': expected &, | or the end");
  expect_parse_error("strided(3,)", 11, "expected strided's offset");
  expect_parse_error("glob(2)", 1, "found 'glob': unknown mask");
  expect_parse_error("()", 2, "found ')': expected a mask");
  expect_parse_error("key_lengths(1, 2) & key_lengths(3)", 19, "column 19, found '&': Mask: cannot combine");
  expect_parse_error("window(99999999999)", 8, "window's left is at most 1000000000");
  expect_parse_error("causal ^ window(2)", 8, "found '^': not part of a mask");
  expect_parse_error(std::string(70, '(') + "causal" + std::string(70, ')'), 65, "parentheses nest deeper than 64");
}

TEST(SparseMask, ParseErrorsShowControlCharactersEscaped) {
  // A NUL would end what() there: the message quotes it as \0 and goes on past it.
  using namespace std::string_literals;
  const auto message = [](const std::string& expression) {
    try {
      Mask::parse(expression);
    } catch (const qkv::MaskParseError& e) {
      return std::string(e.what());
    }
    return std::string("parsed");
  };
  EXPECT_THAT(message("causal\0 & window(2)"s), HasSubstr("mask 'causal\\0 & window(2)': column 7, found '\\0'"));
  EXPECT_THAT(message("causal &\x1b[2J"), HasSubstr("mask 'causal &\\x1b[2J': column 9, found '\\x1b'"));
}

}  // namespace
