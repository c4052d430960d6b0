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

namespace {

// One round on every OpenMP thread at once: `iterations` FMA rounds each, timed from before the
// threads start to after the last ends. Fills threads and lanes; returns the seconds.
double TimeChains(int64_t iterations, int* threads, int* lanes) {
  volatile float sink = 0;
  int team = 0, width = 0;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel reduction(max : width)
  {
#pragma omp single
    team = omp_get_num_threads();
    const float sum = HWY_DYNAMIC_DISPATCH(FmaChains)(iterations, &width);
#pragma omp critical
    sink = sink + sum;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  *threads = team;
  *lanes = width;
  return seconds;
}

}  // namespace

FmaPeak measure_fma_peak(int repeats) {
  // Each repeat lasts about 50 ms: 20 million rounds at 200 GFLOP/s per thread with 16 lanes,
  // fewer where the loop runs slower (a sanitizer build runs it 50x slower: 5 repeats of 20
  // million rounds took 24 s there). The count doubles from 200 thousand until a round takes 20
  // ms (the first round also starts the threads, and a busy host slows any one round).
  constexpr int64_t kMaxIterations = 20'000'000;
  constexpr double kProbeSeconds = 0.02, kRepeatSeconds = 0.05;
  FmaPeak peak;
  peak.target = HWY_DYNAMIC_DISPATCH(TargetName)();
  int64_t iterations = 200'000;
  double seconds = TimeChains(iterations, &peak.threads, &peak.lanes);
  for (; seconds < kProbeSeconds && iterations < kMaxIterations; iterations *= 2)
    seconds = TimeChains(2 * iterations, &peak.threads, &peak.lanes);
  iterations = std::min(kMaxIterations, static_cast<int64_t>(static_cast<double>(iterations) * kRepeatSeconds / seconds));
  for (int repeat = 0; repeat < repeats; ++repeat) {
    seconds = TimeChains(iterations, &peak.threads, &peak.lanes);
    const double flops = 2.0 * peak.lanes * kChains * static_cast<double>(iterations) * peak.threads;
    peak.gflops = std::max(peak.gflops, flops / seconds * 1e-9);
  }
  return peak;
}

}  // namespace qkv::cli
#endif  // HWY_ONCE
