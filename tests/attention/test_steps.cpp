// The pipeline's steps (src/attention/steps/pipeline-inl.h, gemm/micro_kernel-inl.h) one by one, on every SIMD
// target this CPU runs, against scalar loops in float64: the softmax's exponential over its whole
// domain, the transposes that pack queries into the lanes and unpack the output, the
// micro-GEMM with its folded rescale, and the band mask. Outputs are poisoned with NaN first, so an element left
// unwritten (or one written that should not be) fails. The kernels built of these steps are
// tested whole in attention/test_flash.cpp, attention/test_decode.cpp and attention/test_backward.cpp.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/test_steps.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "attention/steps/pipeline-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv_test {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
namespace step = qkv::detail::HWY_NAMESPACE::pipeline;
namespace tile_gemm = qkv::detail::HWY_NAMESPACE::tile_gemm;

size_t Lanes() { return hn::Lanes(hn::ScalableTag<float>()); }
bool NativeFma() { return HWY_NATIVE_FMA; }

// y = ExpSoftmax(x), n a whole number of vectors.
void ExpSoftmaxOf(const float* x, float* y, size_t n) {
  const hn::ScalableTag<float> df;
  for (size_t i = 0; i < n; i += hn::Lanes(df)) hn::StoreU(step::ExpSoftmax(df, hn::LoadU(df, x + i)), df, y + i);
}

void Pack(const qkv::detail::Rows<const float>& a, int64_t i0, size_t rows, size_t d, size_t br, float factor,
          float* a_t) {
  step::PackTransposed(a, 0, 0, i0, rows, d, br, factor, a_t);
}

void Unpack(const float* a_t, size_t br, size_t rows, size_t d, const float* factor,
            const qkv::detail::Rows<float>& out, int64_t i0, bool add) {
  step::UnpackTransposed(a_t, br, rows, d, factor, out, 0, 0, i0, add);
}

// C (m x kTileVectors vectors) = c_scale * C + A B, A read with strides (a_row, a_depth).
void PanelScaled(size_t m, size_t depth, const float* a, size_t a_row, size_t a_depth, const float* b, size_t ldb,
                 float* c, size_t ldc, const float* c_scale) {
  tile_gemm::PanelGemm<tile_gemm::kTileVectors>(m, depth, a, a_row, a_depth, b, ldb, c, ldc, true, c_scale);
}
size_t PanelWidth() { return tile_gemm::kTileVectors * Lanes(); }

// C (m x n, n whole vectors) (+)= A B by Gemm's choice of panels (3-vector ones, then 4, 2 or 1).
void GemmOf(size_t m, size_t n, size_t depth, const float* a, size_t a_row, size_t a_depth, const float* b, size_t ldb,
            float* c, size_t ldc, bool accumulate) {
  tile_gemm::Gemm(m, n, depth, a, a_row, a_depth, b, ldb, c, ldc, accumulate);
}

// Softcap on n floats (a whole number of vectors), slope too when given.
void SoftcapOf(float cap, float* s, size_t n, float* slope) {
  qkv::detail::AttentionProblem p{};
  p.softcap = cap;
  step::Softcap(p, s, n, slope);
}

// MaskBand on a line of n floats (a whole number of vectors) of batch 0, band and key length given.
void MaskBandOf(int64_t band_lo, int64_t band_hi, int64_t key_length, int64_t i0, int64_t j0, int64_t query_step,
                int64_t key_step, float* s, size_t n) {
  qkv::detail::AttentionProblem p{};
  p.band_lo = band_lo;
  p.band_hi = band_hi;
  p.key_lengths = {key_length};
  step::MaskBand(p, {0, 0, i0, j0, query_step, key_step}, s, n);
}

// TileLogits on `lines` key lines of br floats (line l: key j0 + l key_step over queries i0 + x
// query_step) of batch 0, head 0: band and key length given, ALiBi with `slope` when non-zero
// (offset alibi_offset); `alibi_only` runs just the ALiBi step per line instead, the first half of
// what TileLogits must give.
void TileLogitsOf(int64_t band_lo, int64_t band_hi, int64_t key_length, float slope, int64_t alibi_offset, int64_t i0,
                  int64_t j0, int64_t query_step, int64_t key_step, float* s, size_t br, size_t lines,
                  bool alibi_only) {
  qkv::detail::AttentionProblem p{};
  p.band_lo = band_lo;
  p.band_hi = band_hi;
  p.key_lengths = {key_length};
  p.alibi_slopes = slope != 0.0f ? &slope : nullptr;
  p.q_len = 0;
  p.kv_len = alibi_offset;
  if (alibi_only) {
    for (size_t l = 0; l < lines; ++l)
      step::Alibi(p, {0, 0, i0, j0 + static_cast<int64_t>(l) * key_step, query_step, 0}, s + l * br, br);
    return;
  }
  step::TileLogits(p, {query_step, key_step, false}, {true, -1}, 0, 0, i0, br, j0, lines, br, s);
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv_test
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <gtest/gtest.h>
#include <hwy/aligned_allocator.h>
#include <hwy/targets.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "harness/kernel_cases.hpp"

namespace qkv_test {
HWY_EXPORT(Lanes);
HWY_EXPORT(NativeFma);
HWY_EXPORT(ExpSoftmaxOf);
HWY_EXPORT(Pack);
HWY_EXPORT(Unpack);
HWY_EXPORT(PanelScaled);
HWY_EXPORT(PanelWidth);
HWY_EXPORT(GemmOf);
HWY_EXPORT(MaskBandOf);
HWY_EXPORT(TileLogitsOf);
HWY_EXPORT(SoftcapOf);

namespace {
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kFloatInf = std::numeric_limits<float>::infinity();

// A band edge for the mask tests: unbounded either way (a quarter of the time), else inside,
// before or past the lines they draw.
int64_t random_edge(Random& random) {
  const int64_t far = qkv::Mask::kUnbounded, pick = random.integer(0, 7);
  return pick == 0 ? -far : pick == 1 ? far : random.integer(-150, 150);
}

// Runs body() once per SIMD target this CPU can run, that target forced.
template <class Body>
void on_every_target(const Body& body) {
  const std::vector<int64_t> targets = runnable_targets();
  ASSERT_FALSE(targets.empty());
  for (int64_t target : targets) {
    ForcedTarget forced(target);
    SCOPED_TRACE(std::string("SIMD target ") + hwy::TargetName(target));
    body();
  }
}

// Rounds n up to a whole number of vectors of the forced target, padding x with `fill`.
std::vector<float> padded(std::vector<float> x, float fill) {
  const size_t lanes = HWY_DYNAMIC_DISPATCH(Lanes)();
  x.resize((x.size() + lanes - 1) / lanes * lanes, fill);
  return x;
}

TEST(Steps, ExpSoftmaxWithinOneUlpOverItsDomain) {
  on_every_target([] {
    // Softmax's s - max: a dense sweep of [-87.33, 0], and small magnitudes down to 1e-9.
    std::vector<float> x;
    for (double v = 0.0; v > -87.33; v -= 0.000173) x.push_back(static_cast<float>(v));
    for (double v = -1.0; v < -1e-9; v *= 0.9993) x.push_back(static_cast<float>(v));
    x = padded(x, 0.0f);
    std::vector<float> y(x.size(), kNaN);
    HWY_DYNAMIC_DISPATCH(ExpSoftmaxOf)(x.data(), y.data(), x.size());
    double worst = 0;
    float worst_at = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      const double exact = std::exp(static_cast<double>(x[i]));
      const double ulp = std::nextafter(static_cast<float>(exact), kFloatInf) - static_cast<float>(exact);
      const double error = std::abs(y[i] - exact) / ulp;
      if (error > worst) worst = error, worst_at = x[i];
    }
    // Within 1 ulp where MulAdd is one rounding (FMA); a target without FMA rounds each
    // product and sum of the polynomial apart (1.14 ulp at worst seen).
    EXPECT_LE(worst, HWY_DYNAMIC_DISPATCH(NativeFma)() ? 1.0 : 1.25) << "at x = " << worst_at;
  });
}

TEST(Steps, ExpSoftmaxEdges) {
  on_every_target([] {
    std::vector<float> x = padded({0.0f, -0.0f, -87.5f, -100.0f, -1e30f, -kFloatInf, kNaN, 1.0f, 10.0f, 88.0f}, 0.0f);
    std::vector<float> y(x.size(), kNaN);
    HWY_DYNAMIC_DISPATCH(ExpSoftmaxOf)(x.data(), y.data(), x.size());
    EXPECT_EQ(y[0], 1.0f);  // the max of a row weighs exactly 1
    EXPECT_EQ(y[1], 1.0f);
    for (size_t i = 2; i <= 5; ++i) EXPECT_EQ(y[i], 0.0f) << "x = " << x[i];  // hidden keys: exactly 0
    EXPECT_TRUE(std::isnan(y[6]));
    for (size_t i = 7; i <= 9; ++i) EXPECT_NEAR(y[i], std::exp(static_cast<double>(x[i])), 2e-7 * std::exp(x[i]));
  });
}

// cap * tanh(s / cap) and its slope 1 - tanh^2, for caps from tiny to huge (past [1e-30, 1e30],
// where the cap is not folded into the numerator, up to float's largest), over scores from 0
// to past the rational function's clamp, against float64: within 4e-7 x cap (tanh's float32
// spacing near 1 is 6e-8) and within a few ulp of small normal results; +-inf give +-cap, NaN
// stays NaN (a case x86's min and max order decides), 0 and -0 keep their sign.
TEST(Steps, SoftcapAgainstFloat64) {
  on_every_target([] {
    for (float cap : {1e-37f, 1e-3f, 0.5f, 1.0f, 30.0f, 50.0f, 1e30f, 1e36f, 3e38f}) {
      std::ostringstream trace;
      trace << "cap " << cap;
      SCOPED_TRACE(trace.str());
      std::vector<float> s;
      for (double r = 1e-6; r < 12.0; r *= 1.0007) {
        s.push_back(static_cast<float>(r * cap));
        s.push_back(static_cast<float>(-r * cap));
      }
      const size_t swept = s.size();
      for (float edge : {0.0f, -0.0f, kFloatInf, -kFloatInf, kNaN, std::numeric_limits<float>::max(),
                         -std::numeric_limits<float>::max()})
        s.push_back(edge);
      s = padded(s, 0.0f);
      // Softcap's loads and stores are aligned.
      const hwy::AlignedFreeUniquePtr<float[]> capped = hwy::AllocateAligned<float>(s.size());
      const hwy::AlignedFreeUniquePtr<float[]> slope = hwy::AllocateAligned<float>(s.size());
      std::copy(s.begin(), s.end(), capped.get());
      std::fill(slope.get(), slope.get() + s.size(), kNaN);
      HWY_DYNAMIC_DISPATCH(SoftcapOf)(cap, capped.get(), s.size(), slope.get());
      double worst_abs = 0, worst_ulp = 0, worst_slope = 0;
      for (size_t i = 0; i < swept; ++i) {
        const double t = std::tanh(static_cast<double>(s[i]) / cap), exact = cap * t;
        const float rounded = std::abs(static_cast<float>(exact));
        const double ulp = std::nextafter(rounded, kFloatInf) - rounded;
        worst_abs = std::max(worst_abs, std::abs(capped[i] - exact) / cap);
        if (std::abs(t) < 0.5 && std::abs(exact) >= std::numeric_limits<float>::min())
          worst_ulp = std::max(worst_ulp, std::abs(capped[i] - exact) / ulp);
        worst_slope = std::max(worst_slope, std::abs(slope[i] - (1 - t * t)));
      }
      EXPECT_LE(worst_abs, 4e-7);
      EXPECT_LE(worst_ulp, 6.0);
      EXPECT_LE(worst_slope, 1e-6);
      const float* edges = capped.get() + swept;
      EXPECT_EQ(edges[0], 0.0f);
      EXPECT_FALSE(std::signbit(edges[0]));
      EXPECT_TRUE(std::signbit(edges[1]) && edges[1] == 0.0f);
      EXPECT_FLOAT_EQ(edges[2], cap);
      EXPECT_FLOAT_EQ(edges[3], -cap);
      EXPECT_TRUE(std::isnan(edges[4]));
      EXPECT_TRUE(std::isnan(slope[swept + 4]));
      const double at_max = cap * std::tanh(std::numeric_limits<float>::max() / static_cast<double>(cap));
      EXPECT_NEAR(edges[5], at_max, 4e-7 * cap);
      EXPECT_NEAR(edges[6], -at_max, 4e-7 * cap);
      EXPECT_NEAR(slope[swept + 2], 0.0f, 1e-6);  // the slope of a capped score
      EXPECT_EQ(slope[swept], 1.0f);
    }
  });
}

// The band and key length against their rule, element by element: random lines of every step the
// kernels use (flash's and its backward's (1, 0), and (S, 0) in strided residues; decode's (0, 1),
// and (0, S) for gathered strided keys), bands from empty (lo > hi, about half the trials) to
// unbounded, edges inside, before and past the line; a hidden element is -inf whatever it held
// (NaN too), a visible one keeps its bits.
TEST(Steps, MaskBandAgainstItsRule) {
  on_every_target([] {
    const size_t lanes = HWY_DYNAMIC_DISPATCH(Lanes)();
    Random random;
    SCOPED_TRACE(random.note());
    const int64_t steps[][2] = {{1, 0}, {0, 1}, {3, 0}, {0, 5}, {64, 0}};
    for (int trial = 0; trial < 3000; ++trial) {
      const size_t n = lanes * static_cast<size_t>(random.integer(1, 4));
      const int64_t lo = random_edge(random), hi = random_edge(random);
      const int64_t key_length = random.integer(0, 199);
      const int64_t i0 = random.integer(0, 199), j0 = random.integer(0, 199);
      const auto& step = steps[random.integer(0, 4)];
      const hwy::AlignedFreeUniquePtr<float[]> s = hwy::AllocateAligned<float>(n);  // MaskBand's loads are aligned
      std::vector<float> expected(n);
      for (size_t x = 0; x < n; ++x) s[x] = random.chance(0.1) ? kNaN : static_cast<float>(random.uniform(-3.0, 3.0));
      for (size_t x = 0; x < n; ++x) {
        const int64_t i = i0 + static_cast<int64_t>(x) * step[0], j = j0 + static_cast<int64_t>(x) * step[1];
        expected[x] = (lo <= j - i && j - i <= hi && j < key_length) ? s[x] : -kFloatInf;
      }
      HWY_DYNAMIC_DISPATCH(MaskBandOf)(lo, hi, key_length, i0, j0, step[0], step[1], s.get(), n);
      for (size_t x = 0; x < n; ++x)
        ASSERT_EQ(std::memcmp(&s[x], &expected[x], sizeof(float)), 0)
            << "x = " << x << " of " << n << ", band [" << lo << ", " << hi << "], key length " << key_length
            << ", i0 " << i0 << ", j0 " << j0 << ", steps (" << step[0] << ", " << step[1] << "): " << s[x]
            << " where " << expected[x];
    }
  });
}

// A tile's logits (TileLogits: ALiBi per line, then the band of every line at once) against ALiBi
// alone followed by the band's rule element by element: tiles of 1-70 key lines, each line's key
// key_step past the last one, the walks the kernels use ((1, 1) in the tiles, (S, S) in strided
// residues), bands empty to unbounded, key lengths cutting the tile; a hidden element is -inf
// whatever it held (NaN too), a visible one has exactly ALiBi's bits.
TEST(Steps, TileLogitsAgainstTheBandRule) {
  on_every_target([] {
    const size_t lanes = HWY_DYNAMIC_DISPATCH(Lanes)();
    Random random;
    SCOPED_TRACE(random.note());
    for (int trial = 0; trial < 600; ++trial) {
      const size_t br = lanes * static_cast<size_t>(random.integer(1, 4));
      const size_t lines = static_cast<size_t>(random.integer(1, 70));
      const int64_t lo = random_edge(random), hi = random_edge(random), key_length = random.integer(0, 260);
      const int64_t step = random.chance(0.7) ? 1 : random.integer(2, 70);
      const int64_t i0 = random.integer(0, 199), j0 = random.integer(0, 199);
      const float slope = random.chance(0.5) ? static_cast<float>(random.uniform(-1.0, 1.0)) : 0.0f;
      const int64_t offset = random.integer(-50, 50);
      const size_t n = br * lines;
      const hwy::AlignedFreeUniquePtr<float[]> s = hwy::AllocateAligned<float>(n);
      const hwy::AlignedFreeUniquePtr<float[]> expected = hwy::AllocateAligned<float>(n);
      for (size_t x = 0; x < n; ++x) s[x] = random.chance(0.1) ? kNaN : static_cast<float>(random.uniform(-3.0, 3.0));
      std::copy_n(s.get(), n, expected.get());
      HWY_DYNAMIC_DISPATCH(TileLogitsOf)(lo, hi, key_length, slope, offset, i0, j0, step, step, expected.get(), br,
                                         lines, true);
      for (size_t l = 0; l < lines; ++l)
        for (size_t x = 0; x < br; ++x) {
          const int64_t i = i0 + static_cast<int64_t>(x) * step, j = j0 + static_cast<int64_t>(l) * step;
          if (!(lo <= j - i && j - i <= hi && j < key_length)) expected[l * br + x] = -kFloatInf;
        }
      HWY_DYNAMIC_DISPATCH(TileLogitsOf)(lo, hi, key_length, slope, offset, i0, j0, step, step, s.get(), br, lines,
                                         false);
      for (size_t x = 0; x < n; ++x)
        ASSERT_EQ(std::memcmp(&s[x], &expected[x], sizeof(float)), 0)
            << "line " << x / br << ", lane " << x % br << " of " << lines << " x " << br << ", band [" << lo << ", "
            << hi << "], key length " << key_length << ", i0 " << i0 << ", j0 " << j0 << ", step " << step
            << ", slope " << slope << ": " << s[x] << " where " << expected[x];
    }
  });
}

// Tiles of 1 to 3 whole vectors (a flash query tile narrowed to the vectors its rows fill: the
// padding in the last vector, zeroed by one store a column) and, now and then, widths of no whole
// vector count (the padding filled lane by lane).
TEST(Steps, PackAndUnpackTransposedAgainstScalarLoops) {
  Random rng;
  SCOPED_TRACE(rng.note());
  on_every_target([&] {
    const size_t lanes = HWY_DYNAMIC_DISPATCH(Lanes)();
    for (int repeat = 0; repeat < 60; ++repeat) {
      const size_t br = rng.chance(0.8) ? lanes * static_cast<size_t>(rng.integer(1, 3))
                                        : static_cast<size_t>(rng.integer(1, static_cast<int64_t>(3 * lanes)));
      const size_t rows = static_cast<size_t>(rng.integer(1, static_cast<int64_t>(br)));
      const size_t d = static_cast<size_t>(rng.integer(1, 70));
      const int64_t stride = static_cast<int64_t>(d) + rng.integer(0, 5), i0 = rng.integer(0, 3);
      const float factor = rng.chance(0.5) ? 1.0f : static_cast<float>(rng.uniform(-2, 2));
      std::vector<float> a(static_cast<size_t>(i0 + static_cast<int64_t>(rows)) * static_cast<size_t>(stride));
      for (float& v : a) v = static_cast<float>(rng.uniform(-3, 3));
      std::vector<float> a_t(d * br, kNaN);
      HWY_DYNAMIC_DISPATCH(Pack)({a.data(), 0, 0, stride}, i0, rows, d, br, factor, a_t.data());
      for (size_t c = 0; c < d; ++c)
        for (size_t i = 0; i < br; ++i) {
          const float want = i < rows ? factor * a[static_cast<size_t>((i0 + static_cast<int64_t>(i)) * stride) + c] : 0.0f;
          ASSERT_EQ(std::memcmp(&a_t[c * br + i], &want, sizeof(float)), 0)  // +0 in the padding, not -0
              << "rows " << rows << " d " << d << " br " << br << " at column " << c << ", lane " << i << ": "
              << a_t[c * br + i] << " where " << want;
        }
      // Back: into rows of another stride, each row's padding left as it was.
      std::vector<float> row_factor(br);
      for (float& v : row_factor) v = static_cast<float>(rng.uniform(0.5, 2));
      const bool scaled = rng.chance(0.5);
      std::vector<float> out(a.size(), kNaN);
      HWY_DYNAMIC_DISPATCH(Unpack)(a_t.data(), br, rows, d, scaled ? row_factor.data() : nullptr,
                                   {out.data(), 0, 0, stride}, i0, false);
      for (size_t r = 0; r < out.size() / static_cast<size_t>(stride); ++r)
        for (size_t c = 0; c < static_cast<size_t>(stride); ++c) {
          const float got = out[r * static_cast<size_t>(stride) + c];
          const int64_t i = static_cast<int64_t>(r) - i0;
          if (i < 0 || c >= d) {
            ASSERT_TRUE(std::isnan(got)) << "written outside the rows: row " << r << ", column " << c;
          } else {
            const float value = a_t[c * br + static_cast<size_t>(i)];
            ASSERT_EQ(got, scaled ? value * row_factor[static_cast<size_t>(i)] : value) << "row " << i << ", column " << c;
          }
        }
      // Added back (the backward's dbias by rows): each element of the rows plus its column's
      // value, one rounding; the padding left as it was.
      std::vector<float> sum = out;
      HWY_DYNAMIC_DISPATCH(Unpack)(a_t.data(), br, rows, d, nullptr, {sum.data(), 0, 0, stride}, i0, true);
      for (size_t r = 0; r < sum.size() / static_cast<size_t>(stride); ++r)
        for (size_t c = 0; c < static_cast<size_t>(stride); ++c) {
          const size_t at = r * static_cast<size_t>(stride) + c;
          const int64_t i = static_cast<int64_t>(r) - i0;
          if (i < 0 || c >= d) {
            ASSERT_TRUE(std::isnan(sum[at])) << "added outside the rows: row " << r << ", column " << c;
          } else {
            ASSERT_EQ(sum[at], out[at] + a_t[c * br + static_cast<size_t>(i)]) << "add: row " << i << ", column " << c;
          }
        }
    }
  });
}

TEST(Steps, MicroGemmFoldsTheRescaleIntoItsLoad) {
  Random rng;
  SCOPED_TRACE(rng.note());
  on_every_target([&] {
    const size_t n = HWY_DYNAMIC_DISPATCH(PanelWidth)();
    for (int repeat = 0; repeat < 20; ++repeat) {
      const size_t m = static_cast<size_t>(rng.integer(1, 40)), depth = static_cast<size_t>(rng.integer(1, 70));
      const bool transposed_a = rng.chance(0.5);  // A read down its columns, as flash's V^T
      std::vector<float> a(m * depth), b(depth * n), c(m * n), scale(n);
      for (auto* v : {&a, &b, &c, &scale})
        for (float& x : *v) x = static_cast<float>(rng.uniform(-1, 1));
      std::vector<double> want(m * n);
      for (size_t r = 0; r < m; ++r)
        for (size_t x = 0; x < n; ++x) {
          double sum = static_cast<double>(c[r * n + x]) * scale[x];
          for (size_t k = 0; k < depth; ++k)
            sum += static_cast<double>(transposed_a ? a[k * m + r] : a[r * depth + k]) * b[k * n + x];
          want[r * n + x] = sum;
        }
      HWY_DYNAMIC_DISPATCH(PanelScaled)(m, depth, a.data(), transposed_a ? 1 : depth, transposed_a ? m : 1, b.data(),
                                        n, c.data(), n, scale.data());
      for (size_t i = 0; i < m * n; ++i) ASSERT_NEAR(c[i], want[i], 1e-5 * (1 + static_cast<double>(depth))) << i;
    }
  });
}

// Every panel split Gemm makes: 1 to 9 vectors wide (on AVX-512: 3-vector panels, then a 4-vector
// one, 2 + 2, a 2 or a 1), m from 1 to 17 (every register tile's tails), A either way round. C's rows are wider than n: the columns past n must keep their sentinel, and without
// accumulate C starts as NaN, so an element left unwritten fails.
TEST(Steps, MicroGemmEveryPanelSplit) {
  Random rng;
  SCOPED_TRACE(rng.note());
  on_every_target([&] {
    const size_t lanes = HWY_DYNAMIC_DISPATCH(Lanes)();
    for (size_t vectors = 1; vectors <= 9; ++vectors)
      for (size_t m = 1; m <= 17; ++m) {  // every tail of the 4-, 6- and 8-row tiles, and two whole panels
        const size_t n = vectors * lanes, ldc = n + lanes;
        const size_t depth = static_cast<size_t>(rng.integer(1, 40));
        const bool transposed_a = rng.chance(0.5), accumulate = rng.chance(0.5);
        std::vector<float> a(m * depth), b(depth * n), c(m * ldc);
        for (auto* v : {&a, &b, &c})
          for (float& x : *v) x = static_cast<float>(rng.uniform(-1, 1));
        std::vector<double> want(m * ldc);
        for (size_t r = 0; r < m; ++r)
          for (size_t x = 0; x < ldc; ++x) {
            if (x >= n) {
              want[r * ldc + x] = c[r * ldc + x];
              continue;
            }
            double sum = accumulate ? static_cast<double>(c[r * ldc + x]) : 0.0;
            for (size_t k = 0; k < depth; ++k)
              sum += static_cast<double>(transposed_a ? a[k * m + r] : a[r * depth + k]) * b[k * n + x];
            want[r * ldc + x] = sum;
          }
        if (!accumulate)
          for (size_t r = 0; r < m; ++r)
            std::fill_n(c.begin() + static_cast<std::ptrdiff_t>(r * ldc), n, std::numeric_limits<float>::quiet_NaN());
        HWY_DYNAMIC_DISPATCH(GemmOf)(m, n, depth, a.data(), transposed_a ? 1 : depth, transposed_a ? m : 1, b.data(),
                                     n, c.data(), ldc, accumulate);
        for (size_t i = 0; i < m * ldc; ++i)
          ASSERT_NEAR(c[i], want[i], 1e-5 * (1 + static_cast<double>(depth)))
              << "vectors " << vectors << ", m " << m << ", depth " << depth << ", row " << i / ldc << ", column "
              << i % ldc;
      }
  });
}

}  // namespace
}  // namespace qkv_test
#endif  // HWY_ONCE
