// The CLI's range checks (bounds.hpp).
#include "bounds.hpp"

#include <cmath>

#include <fmt/core.h>

#include "qkv/error.hpp"

namespace qkv::cli {

void check_range(const std::string& flag, int64_t value, int64_t lo, int64_t hi) {
  if (value < lo || value > hi) throw Error(fmt::format("{} must be in [{}, {}], got {}", flag, lo, hi, value));
}

void check_real_range(const std::string& flag, double value, double lo, double hi) {
  if (!(value >= lo && value <= hi) || !std::isfinite(value))
    throw Error(fmt::format("{} must be in [{}, {}], got {}", flag, lo, hi, value));
}

}  // namespace qkv::cli
