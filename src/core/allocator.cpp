#include "core/allocator.hpp"
#include "core/huge_pages.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstdint>
#include <string>
#include <unistd.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <cstdio>
#include <cstdlib>
#include <new>

#include "qkv/error.hpp"
#include "qkv/memory.hpp"

namespace qkv {

namespace {
std::atomic<int64_t> current_bytes{0};
std::atomic<int64_t> peak_bytes{0};
std::atomic<int64_t> limit_bytes{0};  // 0: none

// The machine's physical memory, read once.
int64_t physical_bytes() {
  static const int64_t bytes = [] {
    const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : int64_t{1} << 62;
  }();
  return bytes;
}

constexpr size_t kAlignment = 64;
}  // namespace

MemoryStats memory_stats() { return {current_bytes.load(), peak_bytes.load()}; }

void reset_peak_memory() { peak_bytes.store(current_bytes.load()); }

void set_memory_limit(int64_t bytes) {
  if (bytes < 0) throw Error("set_memory_limit: bytes must be >= 0 (0: no limit), got " + std::to_string(bytes));
  limit_bytes.store(bytes);
}

int64_t memory_limit() { return limit_bytes.load(); }

namespace detail {

std::string human_bytes(int64_t bytes) {
  char text[64];
  if (bytes >= (int64_t{1} << 30)) {
    std::snprintf(text, sizeof text, "%.1f GiB", static_cast<double>(bytes) / (1 << 30));
  } else if (bytes >= (int64_t{1} << 20)) {
    std::snprintf(text, sizeof text, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  } else {
    std::snprintf(text, sizeof text, "%lld bytes", static_cast<long long>(bytes));
  }
  return text;
}

int64_t bytes_available() {
  const int64_t limit = limit_bytes.load();
  return limit > 0 ? std::max<int64_t>(0, limit - current_bytes.load()) : physical_bytes();
}

namespace {
// A need as bytes: exact below 2^62, where every caller's sizes are exact, and in floating
// point above it, so that a refusal never prints a cap in place of the need.
std::string bytes_text(double bytes) {
  if (bytes < 0x1p62) return std::to_string(static_cast<int64_t>(bytes)) + " bytes (" +
                             human_bytes(static_cast<int64_t>(bytes));
  char text[64];
  std::snprintf(text, sizeof text, "%.3e bytes (%.3e GiB", bytes, bytes / 0x1p30);
  return text;
}
}  // namespace

void check_request(const char* who, const std::string& shapes, RequestBytes bytes, const std::string& parts,
                   const std::string& advice) {
  // Under a limit the tensors answer to it (which may exceed the machine, as allocate_floats
  // allows) and the rest to the machine; without one, the whole answers to the machine.
  const int64_t limit = limit_bytes.load();
  const int64_t available = bytes_available();
  const bool over_limit = limit > 0 && bytes.counted > static_cast<double>(available);
  const double machine_part = limit > 0 ? bytes.uncounted : bytes.counted + bytes.uncounted;
  if (!over_limit && machine_part <= static_cast<double>(physical_bytes())) return;
  std::string prefix(who);  // "scaled_dot_product_attention: " or a bare name
  if (prefix.size() < 2 || prefix.compare(prefix.size() - 2, 2, ": ") != 0) prefix += ": ";
  // Each refusal names the bytes of the bound that refused it.
  const std::string need =
      over_limit ? bytes_text(bytes.counted) + ": " + parts +
                       (bytes.uncounted > 0 ? "; the limit counts the tensors only" : "") + ")"
                 : bytes_text(machine_part) + ": " + parts +
                       (limit > 0 && bytes.counted > 0 ? "; the tensors, under the limit, apart" : "") + ")";
  throw Error(prefix + shapes + " need " + need + " but " +
              (over_limit ? "the memory limit leaves " + std::to_string(available) + " bytes (limit " +
                                std::to_string(limit) + ", qkv holds " + std::to_string(current_bytes.load()) + ")"
                          : "the machine has " + std::to_string(physical_bytes()) + " bytes (" +
                                human_bytes(physical_bytes()) + ") of physical memory") +
              (advice.empty() ? "" : "; " + advice));
}

void check_request(const char* who, const std::string& shapes, int64_t needed, const std::string& parts,
                   const std::string& advice) {
  check_request(who, shapes, RequestBytes{static_cast<double>(needed), 0.0}, parts, advice);
}

float* allocate_floats(size_t count) {
  constexpr size_t kMaxCount = (size_t{1} << 62) / sizeof(float);
  const int64_t asked = count > kMaxCount ? INT64_MAX : static_cast<int64_t>(count * sizeof(float));
  const int64_t limit = limit_bytes.load();
  if (count > kMaxCount || (limit > 0 && asked > limit - current_bytes.load()) || (limit == 0 && asked > physical_bytes()))
    throw Error("qkv: cannot allocate " + std::to_string(asked) + " bytes (" + human_bytes(asked) + "): " +
                (limit > 0 ? "over the memory limit of " + std::to_string(limit) + " bytes with " +
                                 std::to_string(current_bytes.load()) + " held"
                           : "more than the machine's " + std::to_string(physical_bytes()) + " bytes of physical memory"));
  const size_t bytes = std::max<size_t>((count * sizeof(float) + kAlignment - 1) / kAlignment * kAlignment, kAlignment);
  auto* data = static_cast<float*>(std::aligned_alloc(kAlignment, bytes));
  if (data == nullptr)
    throw Error("qkv: cannot allocate " + std::to_string(asked) + " bytes (" + human_bytes(asked) +
                "): the system refused (out of memory)");
  const int64_t now = current_bytes.fetch_add(static_cast<int64_t>(count * sizeof(float))) +
                      static_cast<int64_t>(count * sizeof(float));
  int64_t peak = peak_bytes.load();
  while (now > peak && !peak_bytes.compare_exchange_weak(peak, now)) {
  }
  return data;
}

void advise_huge_pages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHugePage - 1);
  if (begin < end) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
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
