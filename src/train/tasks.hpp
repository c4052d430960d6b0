// What tasks.cpp and train.cpp share beyond include/qkv/train.hpp.
#pragma once

#include <cstdint>

#include "qkv/train.hpp"

namespace qkv::train {

// The target of a position that is not scored: nn::CrossEntropyLoss's default ignore_index.
constexpr int64_t kIgnore = -100;

// Checks a task's options (symbols, pairs, length), throwing qkv::Error that names the bad value.
void check_task(const TaskOptions& task);

}  // namespace qkv::train
