// The rate the threads `qkv bench` uses read memory at, measured: the bound of decode, which reads
// each byte of K and V once and does too little arithmetic per byte to hide anything behind it.
#pragma once

#include <cstddef>

namespace qkv::cli {

struct ReadPeak {
  double gbs = 0;           // bytes read per second (1e9), all threads together: the better form
  double plain_gbs = 0;     // vector loads alone (the hardware prefetchers)
  double prefetch_gbs = 0;  // with a software prefetch into L2 kReadPrefetchBytes ahead
  int threads = 0;          // OpenMP threads that read
};

// Every OpenMP thread sums its contiguous share of the `count` floats at `floats` (aligned to
// the widest vector, as a qkv::Tensor's data is: ReadSum's loads are aligned) with vector
// loads on the best SIMD target, in two forms: plain, and with every line prefetched into L2
// ahead of the loads, as decode prefetches K and V (src/attention/decode/tiles-inl.h). The caller
// gives memory already written, not zeros (an untouched page, and a huge page of zeros the
// kernel may split, reads as the shared zero page, from cache), on the kind of pages decode's K and V are on (`qkv bench`: huge pages, as W4's).
// Each form's rate is the best of `repeats` passes, timed from before the threads start to after
// the last ends; `gbs` is the better form's.
ReadPeak measure_read_peak(const float* floats, size_t count, int repeats);

}  // namespace qkv::cli
