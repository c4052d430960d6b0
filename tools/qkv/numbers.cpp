// The numbers behind `qkv viz`, `qkv memory` and `qkv scaling` (a power-law fit, dtype sizes, number formatting); see numbers.hpp.
#include "numbers.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include <fmt/core.h>

#include "qkv/error.hpp"

namespace qkv::cli {

PowerLawFit fit_power_law(const std::vector<double>& x, const std::vector<double>& y) {
  // Ordinary least squares on (u, v) = (ln x, ln y): slope = cov(u, v) / var(u).
  double sum_u = 0, sum_v = 0;
  std::vector<double> us, vs;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
    if (!(x[i] > 0) || !(y[i] > 0)) continue;
    us.push_back(std::log(x[i]));
    vs.push_back(std::log(y[i]));
    sum_u += us.back();
    sum_v += vs.back();
  }
  PowerLawFit fit;
  fit.points = static_cast<int>(us.size());
  const double mean_u = sum_u / static_cast<double>(us.size()), mean_v = sum_v / static_cast<double>(vs.size());
  double covariance = 0, variance = 0;
  for (size_t i = 0; i < us.size(); ++i) {
    covariance += (us[i] - mean_u) * (vs[i] - mean_v);
    variance += (us[i] - mean_u) * (us[i] - mean_u);
  }
  if (us.size() < 2 || variance == 0) {
    fit.slope = fit.intercept = std::numeric_limits<double>::quiet_NaN();
    return fit;
  }
  fit.slope = covariance / variance;
  fit.intercept = mean_v - fit.slope * mean_u;
  return fit;
}

Crossover find_crossover(const std::vector<double>& x, const std::vector<double>& slow, const std::vector<double>& fast) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const size_t n = std::min({x.size(), slow.size(), fast.size()});
  const auto below = [&](size_t i) { return slow[i] > 0 && fast[i] > 0 && fast[i] < slow[i]; };
  size_t first = n;  // the start of the run of points where fast stays below, to the end
  while (first > 0 && below(first - 1)) --first;
  Crossover c{nan, nan};
  if (first == n) return c;
  c.first_x = x[first];
  if (first == 0) return c;
  const size_t before = first - 1;
  if (!(slow[before] > 0 && fast[before] > 0 && x[before] > 0 && x[first] > 0)) return c;
  // r = log(fast / slow) goes from r0 >= 0 at `before` to r1 < 0 at `first`: its zero.
  const double r0 = std::log(fast[before] / slow[before]), r1 = std::log(fast[first] / slow[first]);
  const double t = r0 / (r0 - r1);
  c.interpolated_x = std::exp(std::log(x[before]) + t * (std::log(x[first]) - std::log(x[before])));
  return c;
}

int64_t dtype_bytes(const std::string& dtype) {
  if (dtype == "f32" || dtype == "float32" || dtype == "fp32") return 4;
  if (dtype == "f16" || dtype == "float16" || dtype == "fp16" || dtype == "bf16" || dtype == "bfloat16") return 2;
  if (dtype == "f64" || dtype == "float64" || dtype == "fp64") return 8;
  throw Error(fmt::format("unknown --dtype '{}': use f32 (4 bytes), f16 or bf16 (2 bytes), or f64 (8 bytes)", dtype));
}

std::string group_thousands(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n);
  for (int pos = static_cast<int>(digits.size()) - 3; pos > 0; pos -= 3) digits.insert(static_cast<size_t>(pos), 1, ',');
  if (n < 0) digits.insert(digits.begin(), '-');
  return digits;
}

std::string human_bytes(double bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int unit = 0;
  while (std::abs(bytes) >= 1024 && unit < 6) {
    bytes /= 1024;
    ++unit;
  }
  if (unit == 0) return fmt::format("{:.0f} B", bytes);
  // Whole numbers print without decimals (16 MiB), others with up to 3 significant decimals.
  if (bytes == std::floor(bytes)) return fmt::format("{:.0f} {}", bytes, kUnits[unit]);
  std::string text = fmt::format("{:.{}f}", bytes, bytes < 10 ? 2 : bytes < 100 ? 1 : 0);
  if (text.find('.') != std::string::npos) {
    while (text.back() == '0') text.pop_back();
    if (text.back() == '.') text.pop_back();
  }
  return fmt::format("{} {}", text, kUnits[unit]);
}

}  // namespace qkv::cli
