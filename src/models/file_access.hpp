// The file system as the model loaders use it: regular files only (a FIFO, device or folder is
// refused before it is opened for reading, so nothing blocks), read-only private mappings,
// bounded reads of text files, and atomic writes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

namespace qkv::models::detail {

// A regular file mapped read-only and private; unmapped when destroyed.
class MappedFile {
 public:
  explicit MappedFile(const std::filesystem::path& path);
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&&) = delete;
  MappedFile(const MappedFile&) = delete;
  ~MappedFile();

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// "'<path>'", as errors name files.
std::string quoted(const std::filesystem::path& path);

// Throws qkv::Error unless `path` names an existing regular file (symbolic links followed).
// `what` says what the file is for: "tokenizer", "config".
void require_regular_file(const std::filesystem::path& path, const std::string& what);

// The whole of a regular file of at most `max_bytes` bytes.
std::string read_text_file(const std::filesystem::path& path, size_t max_bytes, const std::string& what);

// Writes `bytes` to `path` atomically: a temporary file beside it, fsynced, renamed over it.
void write_file_atomically(const std::filesystem::path& path, const std::string& bytes);

}  // namespace qkv::models::detail
