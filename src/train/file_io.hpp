// How the .qkv file (model_file.cpp) reaches the disk: an atomic, checksummed, durable write and a
// bounded read that refuses what is not a regular file.
#pragma once

#include <signal.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "core/crc32c.hpp"
#include "qkv/train.hpp"

namespace qkv::train {

// Throws the qkv::Error of a failed AttentionModel::save to `path`.
[[noreturn]] void save_failure(const std::string& path, const std::string& what);

// The bytes of a model file. Opened without blocking (a FIFO would wait for a writer) and
// checked to be a regular file of at most kMaxModelFileBytes before anything is read or allocated.
std::vector<char> read_model_file(const std::string& path);

// While it lives, SIGXFSZ is blocked in the calling thread, so a write past the file size limit
// (ulimit -f) fails with EFBIG, which the save reports, instead of killing the process; the
// signal such a write left pending is taken back before the thread's mask is restored.
class BlockFileSizeSignal {
 public:
  BlockFileSizeSignal();
  ~BlockFileSizeSignal();
  BlockFileSizeSignal(const BlockFileSizeSignal&) = delete;
  BlockFileSizeSignal& operator=(const BlockFileSizeSignal&) = delete;

 private:
  sigset_t only_{}, previous_{};
};

// Writes a file atomically: bytes go to a temporary file beside the target (same folder, so the
// rename cannot cross file systems), with a running CRC-32C; commit() appends the CRC, fsyncs,
// renames over the target and fsyncs the folder. Destroyed without commit(): the temporary is
// removed and the target untouched.
class AtomicWriter {
 public:
  explicit AtomicWriter(const std::string& path);
  ~AtomicWriter();
  AtomicWriter(const AtomicWriter&) = delete;
  AtomicWriter& operator=(const AtomicWriter&) = delete;

  void bytes(const void* data, size_t n) {
    crc_ = detail::crc32c_update(crc_, data, n);
    const auto* p = static_cast<const char*>(data);
    while (n > 0) {
      const size_t take = std::min(n, kBuffer - buffer_.size());
      buffer_.insert(buffer_.end(), p, p + take);
      p += take;
      n -= take;
      if (buffer_.size() == kBuffer) flush();
    }
  }
  template <typename T>
  void value(T v) { bytes(&v, sizeof v); }

  // The test hook's crash: what is buffered reaches the temporary file, then the process dies.
  void die_here();

  void commit();

 private:
  static constexpr size_t kBuffer = size_t{1} << 16;

  void flush();
  [[noreturn]] void fail(const std::string& what, int error = 0) const;

  std::string path_, target_, temp_;
  std::filesystem::path folder_;
  BlockFileSizeSignal no_sigxfsz_;
  int fd_ = -1;
  bool committed_ = false;
  uint32_t crc_ = 0;
  std::vector<char> buffer_;
};

}  // namespace qkv::train
