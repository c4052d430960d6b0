// qkv::detail::bf16_dot_gemm (src/gemm/bf16_dot.hpp), the models' bf16 prefill product: y =
// bf16(x) W^T against a float64 loop over x rounded to bfloat16 and the stored W, on odd shapes
// (rows, k and n not multiples of any vector or block), both layouts, 1 and 2 threads, y poisoned
// with NaN first; and its CPU-feature switch: off, it says so and refuses to run.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gemm/bf16_dot.hpp"
#include "harness/kernel_cases.hpp"
#include "qkv/dtype.hpp"
#include "qkv/error.hpp"

namespace {

using qkv::DType;

struct Shape {
  int64_t rows, k, n;
};

// values rounded to bfloat16 (their bits, and the float64 values they hold).
void round_bf16(const std::vector<float>& values, std::vector<uint16_t>& bits, std::vector<double>& held) {
  bits.resize(values.size());
  qkv::convert(values.data(), DType::F32, bits.data(), DType::BF16, values.size());
  std::vector<float> back(values.size());
  qkv::convert(bits.data(), DType::BF16, back.data(), DType::F32, values.size());
  held.assign(back.begin(), back.end());
}

TEST(Bf16DotGemm, EqualsAFloat64LoopOnRoundedXInBothLayouts) {
  if (!qkv::detail::bf16_dot_gemm_available()) GTEST_SKIP() << "no oneDNN or no bfloat16 dot products on this CPU";
  const std::vector<Shape> shapes = {{1, 1, 1}, {17, 3, 5}, {33, 65, 47}, {70, 129, 31}, {129, 100, 257},
                                     {300, 37, 41}, {511, 576, 193}, {65, 1030, 77}};
  const int threads_before = omp_get_max_threads();
  qkv_test::Random random(2718);
  for (const Shape& s : shapes) {
    std::vector<float> x(static_cast<size_t>(s.rows * s.k)), w(static_cast<size_t>(s.n * s.k));
    for (float& v : x) v = static_cast<float>(random.uniform(-1, 1));
    for (float& v : w) v = static_cast<float>(random.uniform(-1, 1));
    std::vector<uint16_t> x_bits, w_bits;
    std::vector<double> x_held, w_held;
    round_bf16(x, x_bits, x_held);
    round_bf16(w, w_bits, w_held);
    std::vector<double> expected(static_cast<size_t>(s.rows * s.n));
    for (int64_t r = 0; r < s.rows; ++r)
      for (int64_t o = 0; o < s.n; ++o) {
        double sum = 0;
        for (int64_t i = 0; i < s.k; ++i)
          sum += x_held[static_cast<size_t>(r * s.k + i)] * w_held[static_cast<size_t>(o * s.k + i)];
        expected[static_cast<size_t>(r * s.n + o)] = sum;
      }
    // The products are exact in float32; the float32 sums of k terms in [-1, 1] err by about
    // sqrt(k) 2^-24 each step, far below 1e-5 sqrt(k). x's rounding (2^-9 of a term) is far above.
    const double bound = 1e-5 * std::sqrt(static_cast<double>(s.k));
    for (bool in_out : {false, true}) {
      // W's element (o, i) of y = x W^T: at o * k + i as (n, k), at i * n + o as (k, n).
      std::vector<uint16_t> laid(w_bits.size());
      for (int64_t o = 0; o < s.n; ++o)
        for (int64_t i = 0; i < s.k; ++i)
          laid[static_cast<size_t>(in_out ? i * s.n + o : o * s.k + i)] = w_bits[static_cast<size_t>(o * s.k + i)];
      for (int threads : {1, 2}) {
        omp_set_num_threads(threads);
        SCOPED_TRACE("rows " + std::to_string(s.rows) + ", k " + std::to_string(s.k) + ", n " +
                     std::to_string(s.n) + (in_out ? ", (k, n)" : ", (n, k)") + ", threads " +
                     std::to_string(threads));
        std::vector<float> y(expected.size(), std::numeric_limits<float>::quiet_NaN());
        qkv::detail::bf16_dot_gemm(x.data(), s.rows, s.k, laid.data(), in_out, s.n, y.data());
        int bad = 0;
        for (size_t j = 0; j < y.size() && bad < 3; ++j) {
          if (!(std::abs(y[j] - expected[j]) <= bound)) {
            ++bad;
            ADD_FAILURE() << "y[" << j << "] = " << y[j] << ", expected " << expected[j];
          }
        }
      }
    }
  }
  omp_set_num_threads(threads_before);
}

TEST(Bf16DotGemm, ZeroTermsWriteZerosAndEmptyOutputsNothing) {
  if (!qkv::detail::bf16_dot_gemm_available()) GTEST_SKIP() << "no oneDNN or no bfloat16 dot products on this CPU";
  std::vector<float> y(6, std::numeric_limits<float>::quiet_NaN());
  const float x[2] = {1, 2};
  const uint16_t w = 0;
  qkv::detail::bf16_dot_gemm(x, 2, 0, &w, false, 3, y.data());
  for (float v : y) EXPECT_EQ(v, 0.0f);
  qkv::detail::bf16_dot_gemm(x, 0, 1, &w, true, 3, y.data());
  qkv::detail::bf16_dot_gemm(x, 1, 1, &w, true, 0, y.data());
  EXPECT_THROW(qkv::detail::bf16_dot_gemm(x, -1, 1, &w, true, 1, y.data()), qkv::Error);
}

TEST(Bf16DotGemm, SwitchedOffItIsUnavailableAndRefuses) {
  qkv::detail::set_bf16_dot_gemm_for_test(false);
  EXPECT_FALSE(qkv::detail::bf16_dot_gemm_available());
  const float x = 1;
  const uint16_t w = 0x3f80;  // 1.0
  float y = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(qkv::detail::bf16_dot_gemm(&x, 1, 1, &w, false, 1, &y), qkv::Error);
  qkv::detail::set_bf16_dot_gemm_for_test(true);
}

}  // namespace
