// qkv::Mask: builders, combination with &, normalisation into one band, and the helper tensors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "oracle.hpp"

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
  EXPECT_THAT(s, HasSubstr("causal(offset=0)"));
  EXPECT_THAT(s, HasSubstr("key_lengths(2, 5)"));
  EXPECT_THAT(s, HasSubstr(" & "));
  EXPECT_THAT(Mask::causal(7).str(), HasSubstr("7"));
  EXPECT_THAT(Mask::window(3, 1).str(), HasSubstr("window"));
  EXPECT_THAT(Mask::keep(Tensor::full({3, 5}, 1.0f)).str(), HasSubstr("keep"));
  EXPECT_THAT(Mask::additive(Tensor::zeros({3, 5})).str(), HasSubstr("additive"));
  EXPECT_FALSE(Mask().str().empty());
}

}  // namespace
