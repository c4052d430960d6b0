// The lock behind nn::detail::ModuleLock (include/qkv/nn.hpp), and the hold a forward takes on it.
#pragma once

#include <mutex>
#include <shared_mutex>

#include "qkv/nn.hpp"

namespace qkv::detail {

struct ModuleMutex {
  std::shared_mutex mutex;
};

// A forward's hold on its module: shared while `training` is false (the forward only reads the
// module), exclusive while it is true (the forward writes what backward needs). `training` is
// read under the shared hold, and is written only under an exclusive one, so it cannot change
// while the forward runs under either hold (a module switched to eval() between the two holds
// then runs in eval mode under the exclusive one: correct, only not in parallel).
class ForwardHold {
 public:
  ForwardHold(ModuleMutex& m, const bool& training) : shared_(m.mutex) {
    if (!training) return;
    shared_.unlock();
    exclusive_ = std::unique_lock(m.mutex);
  }

 private:
  std::shared_lock<std::shared_mutex> shared_;
  std::unique_lock<std::shared_mutex> exclusive_;
};

}  // namespace qkv::detail
