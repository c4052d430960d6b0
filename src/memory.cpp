#include "memory.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <new>

#include "qkv/memory.hpp"

namespace qkv {

namespace {
std::atomic<int64_t> current_bytes{0};
std::atomic<int64_t> peak_bytes{0};

constexpr size_t kAlignment = 64;
}  // namespace

MemoryStats memory_stats() { return {current_bytes.load(), peak_bytes.load()}; }

void reset_peak_memory() { peak_bytes.store(current_bytes.load()); }

namespace detail {

float* allocate_floats(size_t count) {
  const size_t bytes = std::max<size_t>((count * sizeof(float) + kAlignment - 1) / kAlignment * kAlignment, kAlignment);
  auto* data = static_cast<float*>(std::aligned_alloc(kAlignment, bytes));
  if (data == nullptr) throw std::bad_alloc();
  const int64_t now = current_bytes.fetch_add(static_cast<int64_t>(count * sizeof(float))) +
                      static_cast<int64_t>(count * sizeof(float));
  int64_t peak = peak_bytes.load();
  while (now > peak && !peak_bytes.compare_exchange_weak(peak, now)) {
  }
  return data;
}

void free_floats(float* data, size_t count) {
  if (data == nullptr) return;
  std::free(data);
  current_bytes.fetch_sub(static_cast<int64_t>(count * sizeof(float)));
}

float* Workspace::floats(size_t count) {
  if (count > capacity_) {
    release();
    data_ = allocate_floats(count);
    capacity_ = count;
  }
  return data_;
}

void Workspace::release() {
  free_floats(data_, capacity_);
  data_ = nullptr;
  capacity_ = 0;
}

Workspace& thread_workspace(WorkspaceSlot slot) {
  thread_local std::array<Workspace, static_cast<size_t>(WorkspaceSlot::Count)> workspaces;
  return workspaces[static_cast<size_t>(slot)];
}

}  // namespace detail

void release_workspaces() {
  for (size_t slot = 0; slot < static_cast<size_t>(detail::WorkspaceSlot::Count); ++slot)
    detail::thread_workspace(static_cast<detail::WorkspaceSlot>(slot)).release();
}

}  // namespace qkv
