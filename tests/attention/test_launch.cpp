// The launch helper every kernel uses (src/attention/launch.hpp): how many workers, where their
// scratch lies, and that each item runs exactly once, with no OpenMP region for one worker.
#include <atomic>
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>
#include <omp.h>

#include "attention/launch.hpp"

namespace qkv::detail {
namespace {

// Lowers the threading threshold for one test, restoring it after.
struct ThreadThreshold {
  explicit ThreadThreshold(double flops) : before(set_min_flops_to_thread_for_test(flops)) {}
  ~ThreadThreshold() { set_min_flops_to_thread_for_test(before); }
  double before;
};

TEST(Launch, WorkersNeverExceedItemsNorThreads) {
  const ThreadThreshold every_problem(0);
  const int threads = omp_get_max_threads();
  EXPECT_EQ(Launch(WorkspaceSlot::FlashScratch, 1e12, 1, 16).workers(), 1);
  EXPECT_EQ(Launch(WorkspaceSlot::FlashScratch, 1e12, 1000, 16).workers(), threads);
  EXPECT_EQ(Launch(WorkspaceSlot::FlashScratch, 1e12, 0, 16).workers(), 1);
}

TEST(Launch, SmallProblemRunsOnTheCallerWithoutARegion) {
  const Launch launch(WorkspaceSlot::FlashScratch, 10.0, 100, 16);  // far below kMinFlopsToThread
  ASSERT_EQ(launch.workers(), 1);
  int in_region = 0;
  launch.for_each(5, [&](int64_t) { in_region += omp_in_parallel(); });
  launch.for_each_run(5, 2, [&](int64_t, int64_t) { in_region += omp_in_parallel(); });
  launch.parallel([&](int worker) { in_region += omp_in_parallel() + worker; });
  EXPECT_EQ(in_region, 0);
}

TEST(Launch, BlocksAreAlignedDisjointAndAfterTheSharedFloats) {
  const ThreadThreshold every_problem(0);
  const Launch launch(WorkspaceSlot::FlashScratch, 1e12, 64, 17, 5);
  EXPECT_EQ(launch.block_floats() % kCacheLineFloats, 0u);
  EXPECT_GE(launch.block_floats(), 17u);
  EXPECT_GE(launch.block(0), launch.shared() + 5);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(launch.shared()) % 64, 0u);
  for (int w = 0; w + 1 < launch.workers(); ++w) {
    EXPECT_EQ(launch.block(w + 1) - launch.block(w), static_cast<std::ptrdiff_t>(launch.block_floats()));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(launch.block(w + 1)) % 64, 0u);
  }
}

TEST(Launch, EveryItemAndRunOnceOnItsWorkersBlock) {
  const ThreadThreshold every_problem(0);
  for (const int64_t items : {1, 2, 7, 1000}) {
    const Launch launch(WorkspaceSlot::FlashScratch, 1e12, items, 8);
    std::vector<std::atomic<int>> seen(static_cast<size_t>(items));
    std::atomic<int> foreign_blocks{0};
    launch.for_each(items, [&](int64_t item) {
      ++seen[static_cast<size_t>(item)];
      const float* block = launch.block_of_this_worker();
      if (block < launch.block(0) || block > launch.block(launch.workers() - 1)) ++foreign_blocks;
    });
    for (const auto& count : seen) EXPECT_EQ(count.load(), 1) << items << " items";
    EXPECT_EQ(foreign_blocks.load(), 0);

    std::vector<std::atomic<int>> covered(static_cast<size_t>(items));
    launch.for_each_run(items, 3, [&](int64_t first, int64_t last) {
      EXPECT_LE(last - first, 3);
      for (int64_t i = first; i < last; ++i) ++covered[static_cast<size_t>(i)];
    });
    for (const auto& count : covered) EXPECT_EQ(count.load(), 1) << items << " items";
  }
}

TEST(Launch, ParallelRunsEachWorkerOnce) {
  const ThreadThreshold every_problem(0);
  const Launch launch(WorkspaceSlot::FlashScratch, 1e12, 1000, 8);
  std::vector<std::atomic<int>> ran(static_cast<size_t>(launch.workers()));
  launch.parallel([&](int worker) { ++ran[static_cast<size_t>(worker)]; });
  for (const auto& count : ran) EXPECT_EQ(count.load(), 1);
}

}  // namespace
}  // namespace qkv::detail
