// The FMA peak of the threads `qkv bench` uses, measured: what no kernel can beat.
#pragma once

#include <string>

namespace qkv::cli {

struct FmaPeak {
  double gflops = 0;   // all threads together: 2 x lanes x FMAs / time
  int threads = 0;     // OpenMP threads that ran the loop
  int lanes = 0;       // float lanes of the widest vector the CPU offers (Highway's best target)
  std::string target;  // Highway's name of that target ("AVX3_ZEN4", "AVX2", ...)
};

// Every OpenMP thread runs independent chains of vector FMAs (more chains than the FMA units
// times their latency, so the units never wait) on the best SIMD target; the best of `repeats`.
FmaPeak measure_fma_peak(int repeats);

}  // namespace qkv::cli
