// A small fixed pool of threads that run the reads of one request side by
// side (source/direct_io.h says why). The caller takes part: it claims work
// from its own batch like any pool thread, so a batch finishes even when
// every pool thread is busy with other requests, and no request waits on a
// queue behind another's.
//
// Threads start on first use, not before: a mount forks to daemonize and
// threads do not survive a fork.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/status.h"

namespace ckptfs {

class IoPool {
 public:
  explicit IoPool(unsigned threads) : threads_(threads) {}
  ~IoPool();
  IoPool(const IoPool&) = delete;
  IoPool& operator=(const IoPool&) = delete;

  // Runs task(0) ... task(n - 1), each once, on the pool's threads and the
  // caller's, and returns when all have returned: OK, or the failure of the
  // lowest index that failed. `task` must be safe to call concurrently.
  Status RunAll(size_t n, const std::function<Status(size_t)>& task);

  unsigned threads() const { return threads_; }

 private:
  struct Batch;
  void Run();
  // Claims and runs tasks of `b` until none is left unclaimed.
  static void Drain(Batch& b);

  const unsigned threads_;
  std::mutex mu_;  // guards the fields below
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Batch>> queue_;  // one ticket per helper wanted
  bool stop_ = false;
  std::vector<std::thread> workers_;  // empty until the first RunAll
};

}  // namespace ckptfs
