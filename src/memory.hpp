// The library's own allocations: counted (qkv/memory.hpp) and, for kernels, kept between calls.
#pragma once

#include <cstddef>
#include <cstdint>

namespace qkv::detail {

// 64-byte aligned allocation counted in memory_stats(): one cache line, one AVX-512 register,
// so SIMD rows start aligned and workers never share a line. Throws std::bad_alloc.
float* allocate_floats(size_t count);
void free_floats(float* data, size_t count);

// A grow-only aligned buffer. A kernel asks its thread's workspace for the scratch it needs;
// the same size next call reuses the same pages (first touch of fresh pages costs ~1.6 us per
// 4 KiB here, more than the arithmetic of a small attention call).
class Workspace {
 public:
  Workspace() = default;
  ~Workspace() { release(); }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  float* floats(size_t count);  // at least `count` floats, contents undefined
  void release();

 private:
  float* data_ = nullptr;
  size_t capacity_ = 0;
};

// The calling thread's workspaces, one per use so two kernels' scratch never overlap.
enum class WorkspaceSlot { ReferenceScores, FlashScratch, DecodeScratch, Count };
Workspace& thread_workspace(WorkspaceSlot slot);

}  // namespace qkv::detail
