// qkv::detail::rows_gemm (src/gemm/rows.hpp), the models' decode kernel: y = x W^T with W read in
// its stored dtype, against a float64 loop over the stored values, on odd shapes (1-5 rows, and
// 6 and 9: several passes over W; in/out dims not multiples of any vector width; some large
// enough to run threaded), every dtype,
// both layouts, 1 and 2 threads, on every SIMD target Highway compiled that the CPU runs; y is
// poisoned with NaN first, so every output must be written.
#include <gtest/gtest.h>
#include <hwy/targets.h>
#include <omp.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gemm/rows.hpp"
#include "harness/kernel_cases.hpp"
#include "qkv/dtype.hpp"

namespace {

using qkv::DType;

struct Shape {
  int64_t rows, k, n;
};

// Stored W (element_size(dtype) bytes each) and the float64 values it holds.
struct Stored {
  std::vector<unsigned char> bytes;
  std::vector<double> values;
};

Stored store(const std::vector<float>& w, DType dtype) {
  Stored s;
  s.bytes.resize(w.size() * qkv::element_size(dtype));
  qkv::convert(w.data(), DType::F32, s.bytes.data(), dtype, w.size());
  std::vector<float> back(w.size());
  qkv::convert(s.bytes.data(), dtype, back.data(), DType::F32, w.size());
  s.values.assign(back.begin(), back.end());
  return s;
}

TEST(RowsGemm, EqualsAFloat64LoopOnEveryTargetDtypeAndLayout) {
  const std::vector<Shape> shapes = {{1, 1, 1},   {1, 3, 5},    {2, 17, 9},   {3, 33, 31},  {4, 65, 47},
                                     {5, 70, 129}, {1, 576, 193}, {2, 100, 257}, {6, 37, 41}, {9, 19, 300},
                                     {1, 1000, 3}, {3, 7, 1030},
                                     // enough work for threads (rows_gemm_threads)
                                     {1, 1030, 1031}, {2, 1001, 601}};
  const std::vector<int64_t> targets = qkv_test::runnable_targets();
  ASSERT_FALSE(targets.empty());
  const int threads_before = omp_get_max_threads();
  omp_set_num_threads(2);
  EXPECT_TRUE(qkv::detail::rows_gemm_threads(1, 1031, 1030)) << "no shape runs threaded";
  qkv_test::Random random(12345);
  for (const Shape& s : shapes) {
    std::vector<float> x(static_cast<size_t>(s.rows * s.k)), w(static_cast<size_t>(s.n * s.k));
    for (float& v : x) v = static_cast<float>(random.uniform(-1, 1));
    for (float& v : w) v = static_cast<float>(random.uniform(-1, 1));
    for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
      const Stored stored = store(w, dtype);
      for (bool in_out : {false, true}) {
        // W's element (o, i) of y = x W^T: at o * k + i as (n, k), at i * n + o as (k, n).
        std::vector<double> expected(static_cast<size_t>(s.rows * s.n));
        std::vector<unsigned char> laid(stored.bytes.size());
        const size_t bytes = qkv::element_size(dtype);
        for (int64_t o = 0; o < s.n; ++o) {
          for (int64_t i = 0; i < s.k; ++i) {
            const int64_t from = o * s.k + i, to = in_out ? i * s.n + o : from;
            std::copy_n(stored.bytes.begin() + from * static_cast<int64_t>(bytes), bytes,
                        laid.begin() + to * static_cast<int64_t>(bytes));
          }
        }
        double scale = 0;
        for (int64_t r = 0; r < s.rows; ++r) {
          for (int64_t o = 0; o < s.n; ++o) {
            double sum = 0;
            for (int64_t i = 0; i < s.k; ++i)
              sum += static_cast<double>(x[static_cast<size_t>(r * s.k + i)]) *
                     stored.values[static_cast<size_t>(o * s.k + i)];
            expected[static_cast<size_t>(r * s.n + o)] = sum;
          }
        }
        scale = std::sqrt(static_cast<double>(s.k));  // |sum| of k terms in [-1, 1]: about sqrt(k)
        for (int64_t target : targets) {
          qkv_test::ForcedTarget forced(target);
          for (int threads : {1, 2}) {
            omp_set_num_threads(threads);
            SCOPED_TRACE("rows " + std::to_string(s.rows) + ", k " + std::to_string(s.k) + ", n " +
                         std::to_string(s.n) + ", " + std::string(qkv::to_string(dtype)) +
                         (in_out ? ", (k, n)" : ", (n, k)") + ", " + hwy::TargetName(target) + ", threads " +
                         std::to_string(threads));
            std::vector<float> y(expected.size(), std::numeric_limits<float>::quiet_NaN());
            qkv::detail::rows_gemm(x.data(), s.rows, s.k, laid.data(), dtype, in_out, s.n, y.data());
            int bad = 0;
            for (size_t j = 0; j < y.size() && bad < 3; ++j) {
              if (!(std::abs(y[j] - expected[j]) <= 1e-5 * scale)) {
                ++bad;
                ADD_FAILURE() << "y[" << j << "] = " << y[j] << ", expected " << expected[j];
              }
            }
          }
        }
      }
    }
  }
  omp_set_num_threads(threads_before);
}

TEST(RowsGemm, ZeroTermsWriteZerosAndEmptyOutputsNothing) {
  std::vector<float> y(6, std::numeric_limits<float>::quiet_NaN());
  const float x = 1;
  const uint16_t w = 0;
  qkv::detail::rows_gemm(&x, 2, 0, &w, DType::BF16, false, 3, y.data());
  for (float v : y) EXPECT_EQ(v, 0.0f);
  qkv::detail::rows_gemm(&x, 0, 1, &w, DType::BF16, true, 3, y.data());
  qkv::detail::rows_gemm(&x, 1, 1, &w, DType::BF16, true, 0, y.data());
}

}  // namespace
