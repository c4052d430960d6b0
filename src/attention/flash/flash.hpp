// Test hooks of the flash kernel (src/attention/flash/forward.cpp), whose entry point flash_attention
// is declared with the other kernels in kernels.hpp.
#pragma once

#include <cstdint>

#include "attention/kernels.hpp"

namespace qkv::detail {

// For tests: the Highway targets (HWY_TARGETS bits) flash/forward.cpp was compiled for, so a test can
// force each in turn with hwy::SetSupportedTargetsForTest whatever flags the test was built with.
int64_t flash_attention_compiled_targets();
// For tests: the target (one HWY_TARGETS bit) the next flash_attention call dispatches to.
int64_t flash_attention_target();

}  // namespace qkv::detail
