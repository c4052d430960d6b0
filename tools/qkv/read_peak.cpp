// measure_read_peak (read_peak.hpp): a Highway loop of vector loads into independent sums,
// compiled for every SIMD target and run on the best one the CPU offers, on each OpenMP thread at
// once over its own share of one buffer.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "read_peak.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/highway.h"

#ifndef QKV_CLI_READ_PEAK_ONCE
#define QKV_CLI_READ_PEAK_ONCE
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>

#include "read_peak.hpp"

namespace qkv::cli {
// How far ahead of its loads the prefetched form asks for lines, in bytes: a few lines past what
// the hardware prefetchers already fetch (the distances tried: docs/performance-log.md).
constexpr size_t kReadPrefetchBytes = 2048;
// Independent sums per thread: enough loads in flight that the adds never wait on each other.
constexpr size_t kReadSums = 4;
}  // namespace qkv::cli
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::cli {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Sums floats [begin, begin + count), count a multiple of ReadBlock(), `begin` vector-aligned;
// with `prefetch`, the lines kReadPrefetchBytes past each block are requested into L2 first
// (past the end too: a prefetch never faults; the address is an integer, never a pointer past
// the buffer). Returns the sum, which the caller keeps.
float ReadSum(const float* HWY_RESTRICT begin, size_t count, bool prefetch) {
  const hn::ScalableTag<float> df;
  const size_t lanes = hn::Lanes(df);
  hn::Vec<decltype(df)> sum[kReadSums];
  for (size_t s = 0; s < kReadSums; ++s) sum[s] = hn::Zero(df);
  const size_t block_bytes = kReadSums * lanes * sizeof(float);
  for (size_t i = 0; i < count; i += kReadSums * lanes) {
    if (prefetch) {
      const uintptr_t ahead = reinterpret_cast<uintptr_t>(begin + i) + kReadPrefetchBytes;
      for (uintptr_t line = ahead; line < ahead + block_bytes; line += 64)
        __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 2);
    }
    for (size_t s = 0; s < kReadSums; ++s) sum[s] = hn::Add(sum[s], hn::Load(df, begin + i + s * lanes));
  }
  for (size_t s = 1; s < kReadSums; ++s) sum[0] = hn::Add(sum[0], sum[s]);
  return hn::GetLane(hn::SumOfLanes(df, sum[0]));
}

// Floats per step of ReadSum: a thread's share is a multiple of it.
size_t ReadBlock() { return kReadSums * hn::Lanes(hn::ScalableTag<float>()); }

}  // namespace HWY_NAMESPACE
}  // namespace qkv::cli
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::cli {

HWY_EXPORT(ReadSum);
HWY_EXPORT(ReadBlock);

namespace {

// One pass on every OpenMP thread at once, each over its share of `floats`; the seconds from
// before the threads start to after the last ends. Fills the team's size.
double TimePass(const float* floats, size_t count, bool prefetch, int* threads) {
  volatile float sink = 0;
  int team = 1;
  const size_t block = HWY_DYNAMIC_DISPATCH(ReadBlock)();
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel
  {
#pragma omp single
    team = omp_get_num_threads();
    // Shares of whole blocks; the last thread takes what the others leave.
    const size_t n = static_cast<size_t>(omp_get_num_threads()), t = static_cast<size_t>(omp_get_thread_num());
    const size_t share = count / block / n * block;
    const size_t first = t * share, last = t + 1 == n ? count / block * block : first + share;
    const float sum = HWY_DYNAMIC_DISPATCH(ReadSum)(floats + first, last - first, prefetch);
#pragma omp critical
    sink = sink + sum;
  }
  *threads = team;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

ReadPeak measure_read_peak(const float* floats, size_t count, int repeats) {
  const size_t block = HWY_DYNAMIC_DISPATCH(ReadBlock)();
  const double read_bytes = static_cast<double>(count / block * block * sizeof(float));  // what a pass reads
  ReadPeak peak;
  for (int repeat = 0; repeat <= repeats; ++repeat) {
    for (const bool prefetch : {false, true}) {
      const double seconds = TimePass(floats, count, prefetch, &peak.threads);
      if (repeat == 0) continue;  // the first pass of each form starts the threads: a warm-up
      double& best = prefetch ? peak.prefetch_gbs : peak.plain_gbs;
      best = std::max(best, read_bytes / seconds * 1e-9);
    }
  }
  peak.gbs = std::max(peak.plain_gbs, peak.prefetch_gbs);
  return peak;
}

}  // namespace qkv::cli
#endif  // HWY_ONCE
