// How a kernel's work items are dealt to its threads: each worker starts with its own
// contiguous share of the items and takes them from the front; a worker whose share runs out
// takes items one at a time from the back of the share with the most left.
//
// Why not OpenMP's schedule(dynamic): items are (batch, head, query tile) in order, so a
// contiguous share keeps a head's query tiles on one core, whose L2 then reads that head's K and
// V once, and the same share goes to the same thread from call to call, so the rows of Q and of
// the output it touches are still in its caches. Dynamic scheduling deals neighbouring items to
// alternate threads: both cores pull every head's K and V, and output lines move between them
// from one call to the next. Stealing from the back keeps dynamic scheduling's balance when
// items differ in cost (causal tiles, per-batch key lengths, a busy core); it measured faster
// than schedule(dynamic) on the flash and decode workloads (docs/performance-log.md, "flash/").
// OpenMP's guided schedule is not used: it deals a first chunk of half the items to one thread,
// which a costly first batch would leave working alone.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include <omp.h>

namespace qkv::detail {

class ItemShares {
 public:
  // Items are dealt in units of one item, or of several when there are 2^31 or more (a share's
  // range of units packs into one 64-bit atomic). At most kMaxShares shares: with more workers,
  // workers w and w + kMaxShares start on the same share.
  static constexpr int kMaxShares = 64;
  static constexpr int64_t kMaxUnits = (int64_t{1} << 31) - 1;

  ItemShares(int workers, int64_t items)
      : items_(items),
        unit_(std::max<int64_t>(1, (items + kMaxUnits - 1) / kMaxUnits)),
        shares_count_(std::clamp(workers, 1, kMaxShares)) {
    const int64_t units = (items + unit_ - 1) / unit_;
    for (int w = 0; w < shares_count_; ++w)
      shares_[w].range.store(pack(units * w / shares_count_, units * (w + 1) / shares_count_),
                             std::memory_order_relaxed);
  }

  // The next run of items [first, last) for `worker` (from its share's front, else from the back
  // of the share with the most left); false when none is left anywhere.
  bool next(int worker, int64_t& first, int64_t& last) {
    int64_t unit = 0;
    if (!take(shares_[worker % shares_count_].range, true, unit) && !steal(unit)) return false;
    first = unit * unit_;
    last = std::min(items_, first + unit_);
    return true;
  }

  // Runs body(item) for every item `worker` gets from next(), until none is left anywhere.
  template <class Body>
  void run(int worker, const Body& body) {
    for (int64_t first = 0, last = 0; next(worker, first, last);)
      for (int64_t item = first; item < last; ++item) body(item);
  }

 private:
  static uint64_t pack(int64_t begin, int64_t end) {
    return static_cast<uint64_t>(begin) << 32 | static_cast<uint64_t>(end);
  }
  static int64_t begin_of(uint64_t range) { return static_cast<int64_t>(range >> 32); }
  static int64_t end_of(uint64_t range) { return static_cast<int64_t>(range & 0xffffffffu); }

  bool steal(int64_t& unit) {
    for (;;) {
      int fullest = -1;
      int64_t most = 0;
      for (int w = 0; w < shares_count_; ++w) {
        const uint64_t range = shares_[w].range.load(std::memory_order_relaxed);
        if (end_of(range) - begin_of(range) > most) most = end_of(range) - begin_of(range), fullest = w;
      }
      if (fullest < 0) return false;
      if (take(shares_[fullest].range, false, unit)) return true;
    }
  }

  // Takes the front (or back) unit of a range; false when it is empty.
  static bool take(std::atomic<uint64_t>& range, bool front, int64_t& unit) {
    uint64_t seen = range.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t begin = begin_of(seen), end = end_of(seen);
      if (begin >= end) return false;
      const uint64_t rest = front ? pack(begin + 1, end) : pack(begin, end - 1);
      if (range.compare_exchange_weak(seen, rest, std::memory_order_relaxed)) {
        unit = front ? begin : end - 1;
        return true;
      }
    }
  }

  struct alignas(64) Share {  // one cache line each: owners never share a line
    std::atomic<uint64_t> range;
  };
  int64_t items_, unit_;
  int shares_count_;
  Share shares_[kMaxShares];
};

// The index of the worker running a for_each_item body, for its scratch block: its thread's
// number in for_each_item's region, and 0 on the serial path (one worker, no region), where
// omp_get_thread_num() would give the caller's number in a region of its own.
inline int worker_index(int workers) { return workers > 1 ? omp_get_thread_num() : 0; }

// Runs body(item) for every item in [0, items) on `workers` threads, each starting on its own
// contiguous share and then helping the others (ItemShares). One worker runs them on the
// calling thread with no parallel region at all: even a region of one thread costs microseconds
// in libgomp (a decode step of a small model went from 6.4 to 1.8 us). Bodies find their scratch
// by worker_index(workers): omp_get_thread_num() there is the caller's number, not 0, when the
// caller runs in an OpenMP region of its own.
template <class Body>
void for_each_item(int workers, int64_t items, const Body& body) {
  if (workers <= 1) {
    for (int64_t item = 0; item < items; ++item) body(item);
    return;
  }
  ItemShares shares(workers, items);
#pragma omp parallel num_threads(workers)
  {
    // A region given fewer threads than asked leaves some shares ownerless: the others take them.
    shares.run(omp_get_thread_num(), body);
  }
}

}  // namespace qkv::detail
