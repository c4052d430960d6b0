// The ranges of the CLI's numeric options, and the check every command runs on them before any
// work: a value outside its range is a qkv::Error naming the flag, the value and the range, never
// a crash in a library below (libgomp with 100000 threads), an absurd allocation or a run that
// never ends. Ranges are generous for what each command is for; a command whose options depend
// on each other (d_model divisible by heads, ...) checks that itself.
#pragma once

#include <cstdint>
#include <string>

namespace qkv::cli {

// OpenMP / OpenBLAS threads (libgomp crashes when it cannot create the threads asked for).
inline constexpr int64_t kMaxThreads = 1024;

// Throws qkv::Error "<flag> must be in [lo, hi], got <value>" unless lo <= value <= hi.
void check_range(const std::string& flag, int64_t value, int64_t lo, int64_t hi);
// The same for a real value; NaN and infinities are refused too.
void check_real_range(const std::string& flag, double value, double lo, double hi);

}  // namespace qkv::cli
