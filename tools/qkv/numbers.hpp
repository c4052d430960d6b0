// What the seeing-attention tools (viz, memory, scaling) share beyond the library's
// qkv::analysis: the slope fit of a measured curve, dtype sizes and number formatting, kept
// apart from the drawing and the command lines so tests can check them on known inputs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace qkv::cli {

// The least-squares line through (log x, log y): y ~ exp(intercept) * x^slope.
// Needs at least two points with distinct x; points with x <= 0 or y <= 0 are skipped.
struct PowerLawFit {
  double slope = 0;
  double intercept = 0;  // natural log of the prefactor
  int points = 0;        // how many points were used (slope is NaN when fewer than 2)
};
PowerLawFit fit_power_law(const std::vector<double>& x, const std::vector<double>& y);

// Where a `fast` cost curve overtakes a `slow` one, both measured at the same increasing x:
//   first_x         the first x from which fast < slow at every later point (NaN: not at the last)
//   interpolated_x  where the two cross between first_x and the point before it, interpolating
//                   log(fast / slow) linearly in log x (NaN when fast is already below at the
//                   first point, or never stays below)
// Points where either cost is not positive are treated as "not below".
struct Crossover {
  double first_x = 0;
  double interpolated_x = 0;
};
Crossover find_crossover(const std::vector<double>& x, const std::vector<double>& slow, const std::vector<double>& fast);

// Bytes per element of the dtypes `qkv memory` knows: f32 4, f16 2, bf16 2, f64 8.
// Throws qkv::Error naming the choices for anything else.
int64_t dtype_bytes(const std::string& dtype);

// "1,610,612,736"
std::string group_thousands(int64_t n);
// Binary units: "16 MiB", "1.5 GiB", "144 GiB", "512 B".
std::string human_bytes(double bytes);

}  // namespace qkv::cli
