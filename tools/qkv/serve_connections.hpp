// How `qkv serve` holds its connections, so that slow and idle clients cannot lock out new ones.
//
// cpp-httplib (Debian 12: 0.11.4, a compiled library) serves each connection on one thread of
// its task queue from the first byte of a request to the end of keep-alive, and its own pool has
// 8 threads and a listen backlog of 5, both fixed when the library was built. ServerConnections
// replaces the pool with ElasticPool (threads started as connections need them, up to `workers`),
// sets a short pause limit within a request (read_timeout) and a short idle time between requests
// (keep_alive_seconds), turns Nagle's algorithm off (TCP_NODELAY: an answer's last segment would
// otherwise wait up to 40 ms for the client's delayed ACK on a kept-alive connection), and listens
// with a backlog sized for a burst of connections.
//
// What remains: httplib has no deadline for a whole request, so a client sending a byte every
// read_timeout holds its thread indefinitely; such clients are bounded by `workers`, and beyond
// that new connections wait in order for a thread.
#pragma once

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace qkv::cli {

struct ConnectionLimits {
  size_t workers = 256;                          // connections served at once
  std::chrono::milliseconds read_timeout{2000};  // the longest pause within a request
  time_t keep_alive_seconds = 2;                 // the longest idle time between two requests
  size_t keep_alive_requests = 1000;             // requests on one connection before it is closed
  int backlog = 1024;                            // connections the kernel queues before accept
};

// An httplib::TaskQueue that starts a thread whenever a task arrives and no thread is idle, up to
// max_threads; beyond, tasks wait in order. Threads stay until shutdown(), which runs the tasks
// still queued and joins them all.
class ElasticPool : public httplib::TaskQueue {
 public:
  explicit ElasticPool(size_t max_threads) : max_threads_(max_threads) {}
  ~ElasticPool() override;
  void enqueue(std::function<void()> task) override;
  void shutdown() override;

  size_t threads() const;  // started so far

 private:
  void work();

  const size_t max_threads_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> tasks_;
  std::vector<std::thread> threads_;
  size_t idle_ = 0;  // threads waiting for a task, or started and about to
  bool stopping_ = false;
};

// Applies ConnectionLimits to a server before it binds; listen_with_backlog() after it bound.
class ServerConnections {
 public:
  ServerConnections(httplib::Server& server, const ConnectionLimits& limits);

  // Listens again on the bound socket with limits.backlog (Linux resizes a listening socket's
  // queue on a second listen()). Throws qkv::Error if the server has not bound or listen fails.
  void listen_with_backlog() const;

 private:
  ConnectionLimits limits_;
  std::shared_ptr<std::atomic<int>> listening_fd_ = std::make_shared<std::atomic<int>>(-1);
};

}  // namespace qkv::cli
