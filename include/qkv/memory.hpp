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

// Frees the calling thread's kernel workspaces (they are kept between calls so repeated calls
// touch no fresh pages; a long-lived thread that once ran a huge problem can give them back).
void release_workspaces();

}  // namespace qkv
