#include "core/random.hpp"

#include <atomic>
#include <cmath>
#include <initializer_list>
#include <numbers>

namespace qkv::detail {

double SplitMix64::normal() {
  // Box-Muller; 1 - u keeps the logarithm's argument in (0, 1].
  const double u1 = 1.0 - uniform();
  const double u2 = uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

namespace {
std::atomic<uint64_t> seed_counter{0};
}  // namespace

uint64_t next_seed() { return mix64(seed_counter.fetch_add(1) + 0x5eed); }

double counter_uniform(uint64_t seed, uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  // Each coordinate is folded in after a full mix, so neighbouring coordinates give
  // unrelated numbers (no (a, b) + (b, a) collisions).
  constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;
  uint64_t h = mix64(seed + kGolden);
  for (uint64_t coordinate : {a, b, c, d}) h = mix64(h ^ (coordinate + kGolden));
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

}  // namespace qkv::detail

namespace qkv::nn {
void manual_seed(uint64_t seed) { detail::seed_counter.store(seed); }
}  // namespace qkv::nn
