// measure_fma_peak (fma_peak.hpp): a Highway loop of independent FMA chains, compiled for every
// SIMD target and run on the best one the CPU offers, on each OpenMP thread at once.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "fma_peak.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/highway.h"

#ifndef QKV_CLI_FMA_PEAK_ONCE
#define QKV_CLI_FMA_PEAK_ONCE
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>

#include "fma_peak.hpp"

namespace qkv::cli {
// 14 chains: AVX-512 cores with two FMA units of latency 4 need 8 in flight; 14 leaves margin
// and, with the two operands, fills AVX2's 16 registers without spilling.
constexpr int kChains = 14;
}  // namespace qkv::cli
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::cli {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// `iterations` rounds of kChains independent FMAs; returns a sum the caller keeps (so the loop is
// not optimised away). *lanes gets the vector's float lanes.
float FmaChains(int64_t iterations, int* lanes) {
  const hn::ScalableTag<float> df;
  *lanes = static_cast<int>(hn::Lanes(df));
  // Values that stay finite forever: x <- x * 0.999999 + 1e-7 converges to 1e-1.
  const auto m = hn::Set(df, 0.999999f), a = hn::Set(df, 1e-7f);
  hn::Vec<decltype(df)> acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = hn::Set(df, static_cast<float>(c));
  for (int64_t i = 0; i < iterations; ++i) {
    HWY_UNROLL(16)
    for (int c = 0; c < kChains; ++c) acc[c] = hn::MulAdd(acc[c], m, a);
  }
  for (int c = 1; c < kChains; ++c) acc[0] = hn::Add(acc[0], acc[c]);
  return hn::GetLane(hn::SumOfLanes(df, acc[0]));
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace qkv::cli
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::cli {

HWY_EXPORT(FmaChains);
HWY_EXPORT(TargetName);

FmaPeak measure_fma_peak(int repeats) {
  // About 50 ms per repeat at 200 GFLOP/s per thread with 16 lanes.
  constexpr int64_t kIterations = 20'000'000;
  FmaPeak peak;
  peak.target = HWY_DYNAMIC_DISPATCH(TargetName)();
  volatile float sink = 0;
  for (int repeat = 0; repeat < repeats; ++repeat) {
    int lanes = 0, threads = 0;
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel reduction(max : lanes)
    {
#pragma omp single
      threads = omp_get_num_threads();
      const float sum = HWY_DYNAMIC_DISPATCH(FmaChains)(kIterations, &lanes);
#pragma omp critical
      sink = sink + sum;
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double flops = 2.0 * lanes * kChains * kIterations * threads;
    peak.gflops = std::max(peak.gflops, flops / seconds * 1e-9);
    peak.threads = threads;
    peak.lanes = lanes;
  }
  return peak;
}

}  // namespace qkv::cli
#endif  // HWY_ONCE
