// MPI for ring attention: a private communicator, outstanding requests that are always waited
// for, and MPI errors as qkv::Error. Every ring message has its own tag (below), on the private
// duplicate of the caller's communicator, so they never meet the caller's messages.
#pragma once

#include <chrono>
#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "qkv/dist.hpp"

namespace qkv::dist::ring {

constexpr int kTagKv = 1;      // a K/V block going round the ring
constexpr int kTagGrad = 2;    // a dK/dV accumulator going round the ring
constexpr int kTagZigzag = 16; // + 2 * tensor index + slot: the zigzag exchange on entry and exit

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Throws qkv::Error when an MPI call fails (MPI_ERRORS_RETURN is set on the duplicated comm).
inline void check_mpi(int code, const char* what) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  throw Error(std::string("ring_attention: ") + what + " failed: " + std::string(text, static_cast<size_t>(len)));
}

// A private duplicate of the caller's communicator, so our tags never meet the caller's messages.
class Comm {
 public:
  explicit Comm(MPI_Comm parent) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) throw Error("ring_attention: MPI is not initialised (call MPI_Init first)");
    if (parent == MPI_COMM_NULL) throw Error("ring_attention: the communicator is MPI_COMM_NULL");
    check_mpi(MPI_Comm_dup(parent, &comm_), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~Comm() { MPI_Comm_free(&comm_); }
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;
  MPI_Comm get() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
};

// Outstanding requests; the destructor waits for them, so an exception thrown between a post and
// its wait (every rank throws at the same step: shapes were checked collectively) leaves no
// message pending and no buffer freed under MPI.
class Requests {
 public:
  ~Requests() { if (!list_.empty()) MPI_Waitall(static_cast<int>(list_.size()), list_.data(), MPI_STATUSES_IGNORE); }
  void send(const float* data, int64_t count, int dest, int tag, MPI_Comm comm, RingStats& stats) {
    list_.push_back(MPI_REQUEST_NULL);
    check_mpi(MPI_Isend(data, to_int(count), MPI_FLOAT, dest, tag, comm, &list_.back()), "MPI_Isend");
    stats.bytes_sent += count * static_cast<int64_t>(sizeof(float));
  }
  void recv(float* data, int64_t count, int source, int tag, MPI_Comm comm) {
    list_.push_back(MPI_REQUEST_NULL);
    check_mpi(MPI_Irecv(data, to_int(count), MPI_FLOAT, source, tag, comm, &list_.back()), "MPI_Irecv");
  }
  // Lets MPI progress the transfers between two kernel calls (no waiting).
  void poke() {
    if (list_.empty()) return;
    int done = 0;
    MPI_Testall(static_cast<int>(list_.size()), list_.data(), &done, MPI_STATUSES_IGNORE);
  }
  void wait(RingStats& stats) {
    if (list_.empty()) return;
    const auto start = Clock::now();
    const int code = MPI_Waitall(static_cast<int>(list_.size()), list_.data(), MPI_STATUSES_IGNORE);
    list_.clear();
    stats.wait_seconds += seconds_since(start);
    check_mpi(code, "MPI_Waitall");
  }

 private:
  static int to_int(int64_t count) {
    if (count > INT_MAX)
      throw Error("ring_attention: a message of " + std::to_string(count) +
                  " floats exceeds MPI's int count; use more ranks or smaller batches");
    return static_cast<int>(count);
  }
  std::vector<MPI_Request> list_;
};

}  // namespace qkv::dist::ring
