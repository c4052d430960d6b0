// The connection handling of `qkv serve`; see serve_connections.hpp.
#include "serve_connections.hpp"

#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include <fmt/core.h>

#include "qkv/error.hpp"

namespace qkv::cli {

ElasticPool::~ElasticPool() { shutdown(); }

void ElasticPool::enqueue(std::function<void()> task) {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    tasks_.push_back(std::move(task));
    if (idle_ < tasks_.size() && threads_.size() < max_threads_) {
      ++idle_;  // counted from now, so the next task does not start another thread for this one
      threads_.emplace_back([this] { work(); });
    }
  }
  wake_.notify_one();
}

void ElasticPool::work() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [this] { return !tasks_.empty() || stopping_; });
    --idle_;
    if (tasks_.empty()) return;  // stopping, nothing left
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    lock.unlock();
    task();
    lock.lock();
    ++idle_;
  }
}

void ElasticPool::shutdown() {
  std::vector<std::thread> threads;
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    threads.swap(threads_);
  }
  wake_.notify_all();
  for (std::thread& thread : threads) thread.join();
}

size_t ElasticPool::threads() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return threads_.size();
}

ServerConnections::ServerConnections(httplib::Server& server, const ConnectionLimits& limits) : limits_(limits) {
  const size_t workers = limits.workers;
  server.new_task_queue = [workers] { return new ElasticPool(workers); };
  server.set_tcp_nodelay(true);  // set on the listening socket; Linux gives accepted ones the same
  server.set_read_timeout(limits.read_timeout);
  server.set_keep_alive_timeout(limits.keep_alive_seconds);
  server.set_keep_alive_max_count(limits.keep_alive_requests);
  // Called on each socket httplib tries to bind; the last one is the one that bound. Only
  // SO_REUSEADDR (a restart binds while old connections linger in TIME_WAIT), not httplib's
  // default SO_REUSEPORT, with which a second server on the same port would bind too and the
  // kernel would split the connections between the two.
  server.set_socket_options([fd = listening_fd_](socket_t socket) {
    const int yes = 1;
    ::setsockopt(socket, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    fd->store(socket);
  });
}

void ServerConnections::listen_with_backlog() const {
  const int fd = listening_fd_->load();
  if (fd < 0 || ::listen(fd, limits_.backlog) != 0) {
    throw Error(fmt::format("cannot set the listen backlog to {}: {}", limits_.backlog,
                            fd < 0 ? "the server has no socket" : std::strerror(errno)));
  }
}

}  // namespace qkv::cli
