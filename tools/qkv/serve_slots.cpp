// The computation slots of `qkv serve`; see serve_slots.hpp.
#include "serve_slots.hpp"

#include <algorithm>

namespace qkv::cli {

bool FairSlots::acquire_for(std::chrono::duration<double> wait) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::nanoseconds>(wait);
  std::unique_lock<std::mutex> lock(mutex_);
  if (line_.empty() && free_ > 0) {
    --free_;
    return true;
  }
  Waiter me;
  line_.push_back(&me);
  const bool taken = me.wake.wait_until(lock, deadline, [&] { return line_.front() == &me && free_ > 0; });
  line_.erase(std::find(line_.begin(), line_.end(), &me));
  if (taken) --free_;
  wake_first();  // the next in line may take another free slot, or the one this waiter gave up
  return taken;
}

void FairSlots::release() {
  const std::lock_guard<std::mutex> lock(mutex_);
  ++free_;
  wake_first();
}

size_t FairSlots::waiting() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return line_.size();
}

void FairSlots::wake_first() {
  if (!line_.empty() && free_ > 0) line_.front()->wake.notify_one();
}

}  // namespace qkv::cli
