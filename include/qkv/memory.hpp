// How much memory qkv itself holds: tensor storage and kernel workspaces, counted as they are
// allocated and freed. For measuring, e.g. that the flash path's extra memory stays O(N d)
// while the reference's grows as N^2:
//
//   qkv::reset_peak_memory();
//   auto r = qkv::scaled_dot_product_attention(q, k, v);
//   int64_t extra = qkv::memory_stats().peak_bytes - before.current_bytes;
#pragma once

#include <cstdint>

namespace qkv {

struct MemoryStats {
  int64_t current_bytes;  // held now
  int64_t peak_bytes;     // the most held at once since the last reset_peak_memory()
};

MemoryStats memory_stats();
void reset_peak_memory();  // peak := current

// A cap on what qkv itself holds (tensor storage + kernel workspaces, as memory_stats counts):
// an allocation that would take current_bytes past it throws qkv::Error naming the bytes asked,
// the limit and, for a tensor, its shape; nothing is allocated. 0 (the default) means no cap
// beyond the machine: a single request larger than its physical memory is refused the same way
// (before the allocator is asked), and an allocation the system refuses becomes a qkv::Error too,
// so std::bad_alloc never escapes qkv's tensors and attention calls. The limit is global, shared
// by all threads.
void set_memory_limit(int64_t bytes);
int64_t memory_limit();  // 0: none set

// Frees the calling thread's kernel workspaces (they are kept between calls so repeated calls
// touch no fresh pages; a long-lived thread that once ran a huge problem can give them back).
// nn::MultiHeadAttention's inference forward of few rows runs its calls on OpenMP's threads,
// whose small workspaces (a few rows' scratch) this does not reach.
void release_workspaces();

}  // namespace qkv
