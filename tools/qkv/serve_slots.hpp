// The computation slots of `qkv serve` (--max-concurrent): at most `count` computations at once,
// the requests beyond waiting in arrival order, each up to a deadline (then the server answers
// 503). First come, first served: a semaphore lets whichever waiter wakes first take a freed
// slot, so under a steady queue some requests waited many times longer than the rest (wrk with
// 50 connections on 2 cores: p99 several times the median).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <mutex>

namespace qkv::cli {

class FairSlots {
 public:
  explicit FairSlots(int count) : free_(count) {}

  // Takes a slot, waiting in line at most `wait`; false when the wait ran out (no slot taken).
  bool acquire_for(std::chrono::duration<double> wait);
  void release();

  size_t waiting() const;  // requests in line now

 private:
  struct Waiter {
    std::condition_variable wake;
  };
  void wake_first();  // the first in line, if a slot is free; under mutex_

  mutable std::mutex mutex_;
  int free_;
  std::deque<Waiter*> line_;
};

}  // namespace qkv::cli
