// Comparing the library's outputs with the float64 oracles.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>

#include <gtest/gtest.h>

#include "oracles.hpp"
#include "qkv/tensor.hpp"

namespace qkv::models::testing {

// Rows [0, want.size()) of batch element b of got (B, N, F) agree with want to `tolerance` relative
// to want's largest magnitude (at least 1).
inline void expect_rows_close(const Tensor& got, int64_t b, const Rows& want, double tolerance,
                              const std::string& what) {
  double scale = 1, worst = 0;
  for (const auto& row : want)
    for (double v : row) scale = std::max(scale, std::abs(v));
  const int64_t n = got.size(1), f = got.size(2);
  ASSERT_EQ(f, static_cast<int64_t>(want[0].size())) << what;
  const float* data = got.contiguous().data() + b * n * f;
  for (size_t i = 0; i < want.size(); ++i)
    for (int64_t j = 0; j < f; ++j)
      worst = std::max(worst, std::abs(data[static_cast<int64_t>(i) * f + j] - want[i][j]));
  EXPECT_LE(worst, tolerance * scale) << what << ": largest difference " << worst << " (scale " << scale << ")";
}

// Layer attention (B, H, N, N) of element b against the oracle's [head] (n, n) weights.
inline void expect_attention_close(const Tensor& got, int64_t b, const std::vector<Rows>& want, double tolerance,
                                   const std::string& what) {
  const int64_t heads = got.size(1), n = got.size(2);
  ASSERT_EQ(heads, static_cast<int64_t>(want.size())) << what;
  double worst = 0;
  for (int64_t h = 0; h < heads; ++h)
    for (size_t i = 0; i < want[h].size(); ++i)
      for (size_t j = 0; j < want[h].size(); ++j)
        worst =
            std::max(worst, std::abs(got.at({b, h, static_cast<int64_t>(i), static_cast<int64_t>(j)}) - want[h][i][j]));
  EXPECT_LE(worst, tolerance) << what << " (" << n << " positions)";
}

}  // namespace qkv::models::testing
