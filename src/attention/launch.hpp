// One kernel launch: the workers a problem pays for, their scratch in the calling thread's
// workspace, and the work dealt to them. Every kernel (flash forward and backward, decode,
// linear attention) launches through it, so each of them says only what its work is: the
// arithmetic of the whole problem, its items, one worker's scratch block and the floats all
// workers share (partials, per-row dots).
//
// Contract:
//  - workers() = min(threads_for(flops), items), at least 1: a problem too small to pay for
//    waking the other threads runs on the calling thread.
//  - One worker never opens an OpenMP region (not even a region of one thread, which costs
//    microseconds in libgomp and would bind a barrier to a region the caller may be in).
//  - The scratch lives in the calling thread's Workspace for `slot` and is kept for the next call
//    (a decode loop touches no fresh pages). The shared floats come first, then one block per
//    worker; each part starts on its own cache line, so workers never share a line and the hot
//    loops never allocate. Contents are undefined on entry.
//  - Bodies find their block by block_of_this_worker() (inside for_each / parallel bodies only).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include <omp.h>

#include "attention/kernels.hpp"
#include "core/allocator.hpp"
#include "simd/item_shares.hpp"

namespace qkv::detail {

class Launch {
 public:
  Launch(WorkspaceSlot slot, double flops, int64_t items, size_t block_floats, size_t shared_floats = 0)
      : workers_(static_cast<int>(std::clamp<int64_t>(std::min<int64_t>(threads_for(flops), items), 1,
                                                      std::max(1, omp_get_max_threads())))),
        block_(round_to_cache_line(block_floats)),
        shared_floats_(round_to_cache_line(shared_floats)) {
    shared_ = thread_workspace(slot).floats(shared_floats_ + static_cast<size_t>(workers_) * block_);
  }

  int workers() const { return workers_; }
  size_t block_floats() const { return block_; }
  // The floats every worker shares (at least shared_floats of the constructor).
  float* shared() const { return shared_; }
  // Worker w's block (w < workers()).
  float* block(int worker) const { return shared_ + shared_floats_ + static_cast<size_t>(worker) * block_; }
  // The block of the worker running a for_each / parallel body.
  float* block_of_this_worker() const { return block(worker_index(workers_)); }

  // body(item) for every item in [0, items), dealt in contiguous shares with stealing
  // (simd/item_shares.hpp).
  template <class Body>
  void for_each(int64_t items, const Body& body) const {
    for_each_item(workers_, items, body);
  }

  // body(first, last) for [0, count) cut into runs of `run` (the last shorter), dealt statically.
  template <class Body>
  void for_each_run(int64_t count, int64_t run, const Body& body) const {
    const int64_t runs = (count + run - 1) / run;
    if (workers_ <= 1) {
      for (int64_t r = 0; r < runs; ++r) body(r * run, std::min(count, (r + 1) * run));
      return;
    }
#pragma omp parallel for schedule(static) num_threads(workers_)
    for (int64_t r = 0; r < runs; ++r) body(r * run, std::min(count, (r + 1) * run));
  }

  // body(worker) once on each worker, in one region (or on the calling thread for one worker),
  // for kernels whose workers meet at a barrier (decode: the items, then the merge). A body
  // that uses OpenMP constructs itself must do so only when workers() > 1.
  template <class Body>
  void parallel(const Body& body) const {
    if (workers_ <= 1) return body(0);
#pragma omp parallel num_threads(workers_)
    body(omp_get_thread_num());
  }

 private:
  int workers_;
  size_t block_, shared_floats_;
  float* shared_ = nullptr;
};

}  // namespace qkv::detail
