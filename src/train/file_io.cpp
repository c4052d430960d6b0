// The .qkv file's way to and from the disk (file_io.hpp): atomic durable writes, bounded reads.
#include "train/file_io.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <new>

namespace qkv::train {

namespace {

// What a non-regular file is, for the errors of load and save.
std::string file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// The file a save to `path` replaces: `path` itself, or through symbolic links the file they
// point to (so the link stays a link and its target is updated). Refuses what is not a regular
// file or a new one: renaming over a device, a FIFO or a directory would replace it.
std::string save_target(const std::string& path) {
  std::filesystem::path target(path);
  if (target.filename().empty() || target.filename() == "." || target.filename() == "..")
    save_failure(path, "the path names a folder, not a file");
  for (int hops = 0;; ++hops) {
    struct stat st {};
    if (::lstat(target.c_str(), &st) != 0) {
      if (errno == ENOENT) return target.string();  // a new file
      save_failure(path, "cannot stat '" + target.string() + "' (" + std::strerror(errno) + ")");
    }
    if (S_ISREG(st.st_mode)) return target.string();
    if (!S_ISLNK(st.st_mode))
      save_failure(path, (target == path ? std::string("it") : "its link's target '" + target.string() + "'") +
                             " is " + file_kind(st.st_mode) + ": a model is saved only to a regular file or a new one");
    if (hops == 40) save_failure(path, "too many levels of symbolic links");
    std::error_code error;
    const std::filesystem::path link = std::filesystem::read_symlink(target, error);
    if (error) save_failure(path, "cannot read the link '" + target.string() + "' (" + error.message() + ")");
    target = link.is_absolute() ? link : target.parent_path() / link;
    if (target.filename().empty()) save_failure(path, "the link '" + link.string() + "' names a folder, not a file");
  }
}

}  // namespace

[[noreturn]] void save_failure(const std::string& path, const std::string& what) {
  throw Error("AttentionModel::save: '" + path + "': " + what + "; the previous file, if any, is unchanged");
}

std::vector<char> read_model_file(const std::string& path) {
  const std::string who = "AttentionModel::load: '" + path + "': ";
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw Error("AttentionModel::load: cannot open '" + path + "' (" + std::strerror(errno) + ")");
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw Error(who + "cannot stat it (" + std::strerror(errno) + ")");
  if (!S_ISREG(st.st_mode)) throw Error(who + "is " + file_kind(st.st_mode) + ", not a model file");
  if (st.st_size > kMaxModelFileBytes)
    throw Error(who + "is " + std::to_string(st.st_size) + " bytes, over the limit of " +
                std::to_string(kMaxModelFileBytes) + " for a model file");
  std::vector<char> data;
  try {
    data.resize(static_cast<size_t>(st.st_size));
  } catch (const std::bad_alloc&) {
    throw Error(who + "cannot hold its " + std::to_string(st.st_size) + " bytes in memory");
  }
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t got = ::read(fd, data.data() + done, data.size() - done);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) throw Error(who + "reading failed (" + std::strerror(errno) + ")");
    if (got == 0) break;  // shrank while read: the checks below see a truncated file
    done += static_cast<size_t>(got);
  }
  data.resize(done);
  return data;
}

BlockFileSizeSignal::BlockFileSizeSignal() {
  sigemptyset(&only_);
  sigaddset(&only_, SIGXFSZ);
  pthread_sigmask(SIG_BLOCK, &only_, &previous_);
}

BlockFileSizeSignal::~BlockFileSizeSignal() {
  if (!sigismember(&previous_, SIGXFSZ)) {
    const timespec now{0, 0};
    while (sigtimedwait(&only_, nullptr, &now) == SIGXFSZ) {
    }
  }
  pthread_sigmask(SIG_SETMASK, &previous_, nullptr);
}

AtomicWriter::AtomicWriter(const std::string& path) : path_(path), target_(save_target(path)) {
  const std::filesystem::path target(target_);
  folder_ = target.parent_path().empty() ? std::filesystem::path(".") : target.parent_path();
  temp_ = (folder_ / (target.filename().string() + ".tmp-XXXXXX")).string();
  fd_ = ::mkstemp(temp_.data());
  if (fd_ < 0) fail("cannot create a temporary file in '" + folder_.string() + "'", errno);
  // mkstemp makes it 0600; give the new file the old one's mode, or rw-r--r--.
  struct stat old {};
  ::fchmod(fd_, ::stat(target_.c_str(), &old) == 0 ? (old.st_mode & 07777) : 0644);
  buffer_.reserve(kBuffer);
}

AtomicWriter::~AtomicWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(temp_.c_str());
}

void AtomicWriter::die_here() {
  flush();
  ::raise(SIGKILL);
}

void AtomicWriter::commit() {
  const uint32_t crc = crc_;
  bytes(&crc, sizeof crc);
  flush();
  if (::fsync(fd_) != 0) fail("fsync of '" + temp_ + "' failed", errno);
  if (::close(fd_) != 0) {
    fd_ = -1;
    fail("closing '" + temp_ + "' failed", errno);
  }
  fd_ = -1;
  if (::rename(temp_.c_str(), target_.c_str()) != 0) fail("cannot rename '" + temp_ + "' over it", errno);
  committed_ = true;
  // The rename itself is durable once the folder's entry is on disk.
  const int folder = ::open(folder_.c_str(), O_RDONLY | O_DIRECTORY);
  if (folder >= 0) {
    ::fsync(folder);
    ::close(folder);
  }
}

void AtomicWriter::flush() {
  const char* p = buffer_.data();
  size_t left = buffer_.size();
  while (left > 0) {
    const ssize_t wrote = ::write(fd_, p, left);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote <= 0) fail("writing '" + temp_ + "' failed", wrote < 0 ? errno : ENOSPC);
    p += wrote;
    left -= static_cast<size_t>(wrote);
  }
  buffer_.clear();
}

void AtomicWriter::fail(const std::string& what, int error) const {
  throw Error("AttentionModel::save: '" + path_ + "': " + what +
              (error ? std::string(" (") + std::strerror(error) + ")" : std::string()) +
              "; the previous file, if any, is unchanged");
}

}  // namespace qkv::train
