// Deterministic, platform-independent random numbers: the same seed gives the same numbers
// with every compiler and standard library (std::normal_distribution would not).
#pragma once

#include <cstdint>

namespace qkv::detail {

// SplitMix64's finaliser: a bijective mix of all 64 bits, the building block of the
// counter-based hashes below.
constexpr uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

// A sequential generator (SplitMix64): fills tensors at creation.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() { return mix64(state_ += 0x9e3779b97f4a7c15ULL); }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  double normal();  // standard normal (Box-Muller)

 private:
  uint64_t state_;
};

// The next seed of the global sequence that qkv::nn::manual_seed restarts.
uint64_t next_seed();

// Uniform in [0, 1) from a hash of (seed, a, b, c, d): random access, no state, so every
// kernel and every thread finds the same number for the same coordinates.
double counter_uniform(uint64_t seed, uint64_t a, uint64_t b, uint64_t c, uint64_t d);

}  // namespace qkv::detail
