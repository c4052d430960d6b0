#include "models/file_access.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "qkv/error.hpp"

namespace qkv::models::detail {
namespace {

[[noreturn]] void fail_errno(const std::filesystem::path& path, const std::string& doing, int error) {
  throw Error(quoted(path) + ": " + doing + ": " + std::strerror(error));
}

std::string kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a folder";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// Opens a regular file for reading; O_NONBLOCK so that a FIFO swapped in after the check cannot
// block the open, and the type checked again on the open descriptor.
int open_regular(const std::filesystem::path& path, const std::string& what, struct stat& info) {
  require_regular_file(path, what);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail_errno(path, "cannot open the " + what, errno);
  if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    ::close(fd);
    throw Error(quoted(path) + ": the " + what + " is not a regular file");
  }
  return fd;
}

}  // namespace

std::string quoted(const std::filesystem::path& path) {
  std::string text(1, '\'');
  text += path.string();
  text += '\'';
  return text;
}

void require_regular_file(const std::filesystem::path& path, const std::string& what) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) {
    if (errno == ENOENT) throw Error(quoted(path) + ": no such file (the " + what + ")");
    fail_errno(path, "cannot read the " + what, errno);
  }
  if (!S_ISREG(info.st_mode)) throw Error(quoted(path) + ": the " + what + " is " + kind_of(info.st_mode) + ", not a regular file");
}

MappedFile::MappedFile(const std::filesystem::path& path) : path_(path) {
  struct stat info {};
  const int fd = open_regular(path, "safetensors file", info);
  size_ = static_cast<size_t>(info.st_size);
  if (size_ > 0) {
    void* map = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    const int error = errno;
    ::close(fd);
    if (map == MAP_FAILED) fail_errno(path, "cannot map the file", error);
    data_ = static_cast<const uint8_t*>(map);
  } else {
    ::close(fd);
  }
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)), data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

std::string read_text_file(const std::filesystem::path& path, size_t max_bytes, const std::string& what) {
  struct stat info {};
  const int fd = open_regular(path, what, info);
  if (static_cast<uint64_t>(info.st_size) > max_bytes) {
    ::close(fd);
    throw Error(quoted(path) + ": the " + what + " is " + std::to_string(info.st_size) + " bytes, more than the " +
                std::to_string(max_bytes) + " allowed");
  }
  std::string text(static_cast<size_t>(info.st_size), '\0');
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t got = ::read(fd, text.data() + done, text.size() - done);
    if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (got < 0) {
      const int error = errno;
      ::close(fd);
      fail_errno(path, "reading the " + what + " failed", error);
    }
    if (got == 0) break;  // shrank while read: what is there
    done += static_cast<size_t>(got);
  }
  ::close(fd);
  text.resize(done);
  return text;
}

void write_file_atomically(const std::filesystem::path& path, const std::string& bytes) {
  if (path.filename().empty()) throw Error(quoted(path) + ": the path names a folder, not a file");
  const std::filesystem::path folder = path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
  std::string temp = (folder / (path.filename().string() + ".tmp-XXXXXX")).string();
  const int fd = ::mkstemp(temp.data());
  if (fd < 0) fail_errno(folder, "cannot create a temporary file", errno);
  ::fchmod(fd, 0644);
  auto abandon = [&](const std::string& doing, int error) {
    ::close(fd);
    ::unlink(temp.c_str());
    fail_errno(temp, doing, error);
  };
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t wrote = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote <= 0) abandon("writing failed", wrote < 0 ? errno : ENOSPC);
    done += static_cast<size_t>(wrote);
  }
  if (::fsync(fd) != 0) abandon("fsync failed", errno);
  if (::close(fd) != 0) {
    ::unlink(temp.c_str());
    fail_errno(temp, "closing failed", errno);
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(temp.c_str());
    fail_errno(path, "cannot rename the temporary file over it", error);
  }
}

}  // namespace qkv::models::detail
