// The library's own allocations: counted (qkv/memory.hpp) and, for kernels, kept between calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "qkv/tensor.hpp"

namespace qkv::detail {

// 64-byte aligned allocation counted in memory_stats(): one cache line, one AVX-512 register,
// so SIMD rows start aligned and workers never share a line. Throws qkv::Error naming the bytes
// (never std::bad_alloc) when they exceed the memory limit (qkv/memory.hpp) or the system says no.
float* allocate_floats(size_t count);

// The bytes still allowed: memory limit minus what qkv holds, or without a limit the machine's
// physical memory (one request can never use more).
int64_t bytes_available();

// A request's bytes, in doubles so that no product of sizes can overflow. `counted` is tensor
// storage, which the memory limit counts; `uncounted` is what it does not (std::vectors of
// lengths, ids, page lists), which physical memory bounds (check_request says how).
struct RequestBytes {
  double counted = 0;
  double uncounted = 0;
};

// Before a call allocates anything: `bytes` (the sum of the parts, described in `parts`, e.g.
// "output (2, 8, 4096, 64) 8.0 MiB + weights (2, 8, 4096, 4096) 1.0 GiB"). Under a memory limit
// the counted part against what it leaves (bytes_available()) and the uncounted part against
// physical memory; without one, the whole against physical memory. Throws qkv::Error
// "<who>: <shapes> need <bytes> ...; <advice>" naming the bound that refused.
void check_request(const char* who, const std::string& shapes, RequestBytes bytes, const std::string& parts,
                   const std::string& advice);
// The same for tensors alone.
void check_request(const char* who, const std::string& shapes, int64_t needed, const std::string& parts,
                   const std::string& advice);

// "1.5 GiB", "12.0 MiB", "640 bytes": for error messages.
std::string human_bytes(int64_t bytes);
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
enum class WorkspaceSlot {
  ReferenceScores,
  FlashScratch,
  FlashAmx,
  DecodeScratch,
  LinearScratch,
  GemmPanels,
  GemmRows,  // the Small GEMM's aligned copies of x (gemm/small.cpp)
  Count
};
Workspace& thread_workspace(WorkspaceSlot slot);

}  // namespace qkv::detail
