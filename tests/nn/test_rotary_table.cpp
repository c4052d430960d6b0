// RotaryTable (include/qkv/inference.hpp): rotary positions from caller-supplied cos / sin tables
// over a partial rotary_dim, as FlashAttention's kvcache API takes them.
//   - against a float64 evaluation of FlashAttention's formula (out = x * cos + rotate(x) * sin on
//     the first rotary_dim features, the rest passed through) on odd shapes, both layouts,
//     partial dims, per-sequence offsets and strided views;
//   - tables built from a base reproduce RotaryEmbedding bit for bit (kept in double), and within
//     the tables' float32 rounding when the caller hands them over as f32;
//   - the inverse is the transpose; bad tables, shapes and positions are qkv::Errors that name them.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "qkv/error.hpp"
#include "qkv/inference.hpp"

namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using qkv::DType;
using qkv::Tensor;
using qkv::nn::RotaryEmbedding;
using qkv::nn::RotaryEmbeddingOptions;
using qkv::nn::RotaryTable;
using qkv::nn::RotaryTableOptions;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const qkv::Error& e) {
    return e.what();
  }
  return "(no qkv::Error)";
}

// The float64 oracle: FlashAttention's apply_rotary_emb_torch written as loops. cos and sin are
// repeated over the rotated features ("... d -> ... (2 d)" half-split, "(d 2)" interleaved);
// rotate(x) is (-x2, x1) on the halves (rotate_half) or on each adjacent pair.
std::vector<double> oracle(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved,
                           const std::vector<int64_t>& offsets) {
  const Tensor xc = x.contiguous();
  const std::vector<float> xv = xc.to_vector(), cv = cos.to_vector(), sv = sin.to_vector();
  const int64_t B = x.size(0), H = x.size(1), N = x.size(2), D = x.size(3), half = cos.size(1), R = 2 * half;
  std::vector<double> out(xv.begin(), xv.end());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t n = 0; n < N; ++n) {
        const int64_t p = offsets[offsets.size() == 1 ? 0 : static_cast<size_t>(b)] + n;
        const float* row = xv.data() + ((b * H + h) * N + n) * D;
        double* y = out.data() + ((b * H + h) * N + n) * D;
        for (int64_t f = 0; f < R; ++f) {
          const int64_t column = interleaved ? f / 2 : f % half;
          double rotated;  // rotate(x)[f]
          if (interleaved) rotated = f % 2 == 0 ? -double(row[f + 1]) : double(row[f - 1]);
          else rotated = f < half ? -double(row[f + half]) : double(row[f - half]);
          y[f] = double(row[f]) * cv[static_cast<size_t>(p * half + column)] +
                 rotated * sv[static_cast<size_t>(p * half + column)];
        }
      }
  return out;
}

// Distance in float32 ulps between a and the double b.
double ulps(float a, double b) {
  const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::abs(b), 1e-30)) - 23);
  return std::abs(double(a) - b) / ulp;
}

// A (B, H, N, D) f32 tensor, or the same values as a strided view (the (B, N, H, D) layout
// transposed) when strided.
Tensor input(int64_t B, int64_t H, int64_t N, int64_t D, uint64_t seed, bool strided) {
  if (!strided) return Tensor::randn({B, H, N, D}, seed);
  return Tensor::randn({B, N, H, D}, seed).transpose(1, 2);
}

TEST(RotaryTable, MatchesTheFloat64FormulaOnOddShapes) {
  struct Case {
    int64_t B, H, N, D, R;
    std::vector<int64_t> offsets;
  };
  const std::vector<Case> cases = {{2, 3, 7, 10, 6, {0, 3}}, {1, 1, 5, 9, 4, {11}},  {3, 2, 1, 12, 12, {5, 0, 9}},
                                   {2, 1, 4, 7, 2, {1}},     {1, 4, 13, 16, 8, {0}}, {2, 2, 3, 5, 4, {2, 7}}};
  uint64_t seed = 1;
  for (const Case& c : cases)
    for (bool interleaved : {false, true})
      for (bool strided : {false, true}) {
        SCOPED_TRACE("D " + std::to_string(c.D) + " R " + std::to_string(c.R) + (interleaved ? " interleaved" : "") +
                     (strided ? " strided" : ""));
        int64_t longest = 0;
        for (int64_t o : c.offsets) longest = std::max(longest, o + c.N);
        // Any finite values: FlashAttention does not ask the tables to lie on the unit circle.
        const Tensor cos = Tensor::uniform({longest + 2, c.R / 2}, -1.5f, 1.5f, ++seed);
        const Tensor sin = Tensor::uniform({longest + 2, c.R / 2}, -1.5f, 1.5f, ++seed);
        const RotaryTable table(c.D, {.cos = cos, .sin = sin, .interleaved = interleaved});
        EXPECT_EQ(table.rotary_dim(), c.R);
        EXPECT_EQ(table.length(), longest + 2);
        const Tensor x = input(c.B, c.H, c.N, c.D, ++seed, strided);
        const std::vector<double> expected = oracle(x, cos, sin, interleaved, c.offsets);
        const Tensor before = x.clone();
        table.apply_inplace(x, c.offsets);
        const std::vector<float> got = x.contiguous().to_vector(), was = before.to_vector();
        double worst = 0;
        for (size_t k = 0; k < got.size(); ++k) {
          worst = std::max(worst, ulps(got[k], expected[k]));
          if (static_cast<int64_t>(k) % c.D >= c.R) {
            ASSERT_EQ(got[k], was[k]) << "a passed-through feature changed";
          }
        }
        EXPECT_LE(worst, 1.0);  // one rounding of the double result
      }
}

TEST(RotaryTable, ApplyCopiesAndTakesFewerDims) {
  const Tensor cos = Tensor::uniform({9, 3}, -1, 1, 4), sin = Tensor::uniform({9, 3}, -1, 1, 5);
  const RotaryTable table(8, {.cos = cos, .sin = sin});
  const Tensor x = Tensor::randn({5, 8}, 6);  // (N, D)
  const Tensor y = table.apply(x, 4);
  EXPECT_EQ(x.to_vector(), Tensor::randn({5, 8}, 6).to_vector()) << "apply changed its input";
  const Tensor four = x.clone().reshape({1, 1, 5, 8});
  table.apply_inplace(four, {4});
  EXPECT_EQ(y.to_vector(), four.to_vector());
  EXPECT_EQ(table.cos().to_vector(), cos.to_vector());
  EXPECT_EQ(table.sin().to_vector(), sin.to_vector());
}

TEST(RotaryTable, TablesOfTheBaseReproduceRotaryEmbeddingBitForBit) {
  for (bool interleaved : {false, true})
    for (const RotaryEmbeddingOptions& o :
         {RotaryEmbeddingOptions{.base = 10000, .interleaved = interleaved},
          RotaryEmbeddingOptions{.base = 500000, .interleaved = interleaved},
          RotaryEmbeddingOptions{.interleaved = interleaved, .inverse_frequencies = {1.0, 0.3, 0.05, 1e-3, 2e-5}}}) {
      const int64_t D = 10;
      const RotaryEmbedding base(D, o);
      const RotaryTable table = RotaryTable::from_base(D, 300, o);
      for (const std::vector<int64_t>& offsets : {std::vector<int64_t>{0}, std::vector<int64_t>{17, 250}}) {
        const Tensor a = Tensor::randn({2, 3, 41, D}, 8), b = a.clone();
        base.apply_inplace(a, offsets);
        table.apply_inplace(b, offsets);
        EXPECT_EQ(a.to_vector(), b.to_vector());
        base.apply_inplace(a, offsets, /*inverse=*/true);
        table.apply_inplace(b, offsets, /*inverse=*/true);
        EXPECT_EQ(a.to_vector(), b.to_vector());
      }
    }
  // A partial rotary_dim: the base form of rotary_dim 6 on the first 6 of 11 features.
  for (bool interleaved : {false, true}) {
    const RotaryEmbeddingOptions o{.base = 10000, .interleaved = interleaved};
    const RotaryTable table = RotaryTable::from_base(11, 64, o, 6);
    const Tensor a = Tensor::randn({2, 2, 9, 11}, 9), b = a.clone();
    RotaryEmbedding(6, o).apply_inplace(a.narrow(3, 0, 6), {3, 40});
    table.apply_inplace(b, {3, 40});
    EXPECT_EQ(a.to_vector(), b.to_vector());
  }
}

TEST(RotaryTable, Float32TablesOfTheBaseAreWithinTheirRounding) {
  // A caller's f32 tables (cos(), sin()) round each entry once: |c - c32| <= 2^-25 for |c| <= 1.
  // So each output is within 2^-25 (|x1| + |x2|) of the base form's, plus the two results' own
  // roundings (half an ulp each, of the larger: one ulp).
  for (bool interleaved : {false, true}) {
    const RotaryEmbeddingOptions o{.base = 10000, .interleaved = interleaved};
    const RotaryTable exact = RotaryTable::from_base(16, 2048, o);
    const RotaryTable f32(16, {.cos = exact.cos(), .sin = exact.sin(), .interleaved = interleaved});
    const Tensor x = Tensor::randn({1, 2, 2048, 16}, 10), a = x.clone(), b = x.clone();
    RotaryEmbedding(16, o).apply_inplace(a, {0});
    f32.apply_inplace(b, {0});
    const std::vector<float> xv = x.to_vector(), av = a.to_vector(), bv = b.to_vector();
    int64_t differ = 0;
    for (size_t k = 0; k < xv.size(); ++k) {
      const size_t f = k % 16, row = k - f;
      const size_t partner = interleaved ? row + (f ^ 1) : row + (f + 8) % 16;
      const float larger = std::max({std::abs(av[k]), std::abs(bv[k]), 1e-30f});
      const double bound = std::ldexp(std::abs(double(xv[k])) + std::abs(double(xv[partner])), -25) +
                           std::ldexp(1.0, std::ilogb(larger) - 23);
      ASSERT_LE(std::abs(double(av[k]) - bv[k]), bound) << "element " << k;
      differ += av[k] != bv[k];
    }
    EXPECT_GT(differ, 0);  // f32 tables are not the double ones: the bound is what holds, not bits
  }
}

TEST(RotaryTable, InverseIsTheTranspose) {
  const RotaryTable table(9, {.cos = Tensor::uniform({20, 4}, -1, 1, 11), .sin = Tensor::uniform({20, 4}, -1, 1, 12),
                              .interleaved = true});
  const Tensor x = Tensor::randn({2, 2, 6, 9}, 13), y = Tensor::randn({2, 2, 6, 9}, 14);
  const Tensor rx = x.clone(), ty = y.clone();
  table.apply_inplace(rx, {1, 14});
  table.apply_inplace(ty, {1, 14}, /*inverse=*/true);
  double a = 0, b = 0;  // <R x, y> = <x, R^T y>
  const std::vector<float> rxv = rx.to_vector(), yv = y.to_vector(), xv = x.to_vector(), tyv = ty.to_vector();
  for (size_t k = 0; k < xv.size(); ++k) a += double(rxv[k]) * yv[k], b += double(xv[k]) * tyv[k];
  EXPECT_NEAR(a, b, 1e-5 * std::abs(a) + 1e-5);
}

TEST(RotaryTable, BadTablesShapesAndPositionsAreErrors) {
  const Tensor c = Tensor::uniform({6, 3}, -1, 1, 1), s = Tensor::uniform({6, 3}, -1, 1, 2);
  EXPECT_THAT(error_of([&] { RotaryTable::from_base(8, 10, {}, 5); }),
              AllOf(HasSubstr("rotary_dim 5"), HasSubstr("even")));
  EXPECT_THAT(error_of([&] { RotaryTable::from_base(8, 10, {}, 10); }),
              HasSubstr("rotary_dim 10 is more than head_dim 8"));
  EXPECT_THAT(error_of([&] { RotaryTable(4, {.cos = c, .sin = s}); }),
              AllOf(HasSubstr("(6, 3)"), HasSubstr("rotary_dim 6"), HasSubstr("head_dim 4")));
  EXPECT_THAT(error_of([&] { RotaryTable(8, {.cos = c, .sin = Tensor::zeros({6, 2})}); }),
              AllOf(HasSubstr("cos is (6, 3) but sin is (6, 2)"), HasSubstr("same shape")));
  EXPECT_THAT(error_of([&] { RotaryTable(8, {.cos = Tensor::zeros({6}), .sin = Tensor::zeros({6})}); }),
              HasSubstr("(seqlen_ro, rotary_dim / 2)"));
  EXPECT_THAT(error_of([&] { RotaryTable(8, {.cos = c}); }), HasSubstr("sin is undefined"));
  EXPECT_THAT(error_of([&] { RotaryTable(8, {.cos = Tensor::zeros({6, 0}), .sin = Tensor::zeros({6, 0})}); }),
              HasSubstr("no column"));
  Tensor bad = c.clone();
  bad.at({4, 1}) = NAN;
  EXPECT_THAT(error_of([&] { RotaryTable(8, {.cos = c, .sin = bad}); }),
              AllOf(HasSubstr("sin[4, 1] is nan"), HasSubstr("finite")));

  const RotaryTable table(8, {.cos = c, .sin = s});  // positions 0 to 5
  EXPECT_THAT(error_of([&] { table.apply_inplace(Tensor::zeros({2, 1, 4, 8}), {0, 3}); }),
              AllOf(HasSubstr("batch element 1's 4 tokens from position 3 reach position 6"),
                    HasSubstr("positions 0 to 5 (seqlen_ro 6)")));
  EXPECT_THAT(error_of([&] { table.apply(Tensor::zeros({7, 8})); }), HasSubstr("reach position 6"));
  EXPECT_THAT(error_of([&] { table.apply_inplace(Tensor::zeros({1, 1, 2, 6}), {0}); }),
              HasSubstr("x is (1, 1, 2, 6) but should be (B, H, N, 8)"));
  EXPECT_THAT(error_of([&] { table.apply_inplace(Tensor::zeros({3, 1, 2, 8}), {0, 1}); }),
              HasSubstr("2 position offsets for a batch of 3"));
  EXPECT_THAT(error_of([&] { table.apply_inplace(Tensor::zeros({1, 1, 2, 8}), {-1}); }),
              HasSubstr("position offset -1 is negative"));
  EXPECT_THAT(error_of([&] { table.apply_inplace(Tensor::zeros({1, 1, 2, 8}, DType::BF16), {0}); }),
              HasSubstr("f32"));
  // Nothing was rotated by a call that failed: every check comes first.
  const Tensor x = Tensor::randn({2, 1, 4, 8}, 3), copy = x.clone();
  EXPECT_THAT(error_of([&] { table.apply_inplace(x, {0, 3}); }), HasSubstr("reach position 6"));
  EXPECT_EQ(x.to_vector(), copy.to_vector());
}

TEST(RotaryTable, SixteenBitTablesWidenExactly) {
  const Tensor c = Tensor::uniform({5, 2}, -1, 1, 21), s = Tensor::uniform({5, 2}, -1, 1, 22);
  const RotaryTable wide(4, {.cos = c.to(DType::BF16).to(DType::F32), .sin = s.to(DType::BF16).to(DType::F32)});
  const RotaryTable narrow(4, {.cos = c.to(DType::BF16), .sin = s.to(DType::BF16)});
  const Tensor x = Tensor::randn({1, 1, 5, 4}, 23);
  EXPECT_EQ(wide.apply(x).to_vector(), narrow.apply(x).to_vector());
}

}  // namespace
