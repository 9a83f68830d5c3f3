#include "source/io_pool.h"

#include <algorithm>
#include <atomic>
#include <exception>

namespace ckptfs {

struct IoPool::Batch {
  size_t n = 0;
  const std::function<Status(size_t)>* task = nullptr;  // valid until done == n
  std::vector<Status> results;
  std::atomic<size_t> next{0};  // first unclaimed index
  std::mutex mu;                // guards done and error
  std::condition_variable cv;
  size_t done = 0;
  std::exception_ptr error;  // the first task that threw (bad_alloc): rethrown by RunAll
};

IoPool::~IoPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void IoPool::Drain(Batch& b) {
  for (;;) {
    const size_t i = b.next.fetch_add(1);
    if (i >= b.n) return;
    // A task that throws still counts as done: RunAll must not return (and
    // free what the tasks use) while another thread runs one.
    std::exception_ptr error;
    try {
      b.results[i] = (*b.task)(i);
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(b.mu);
    if (error && !b.error) b.error = error;
    if (++b.done == b.n) b.cv.notify_all();
  }
}

Status IoPool::RunAll(size_t n, const std::function<Status(size_t)>& task) {
  if (n == 0) return Status::OK();
  auto b = std::make_shared<Batch>();
  b->n = n;
  b->task = &task;
  b->results.resize(n);
  const size_t helpers = std::min<size_t>(n - 1, threads_);
  if (helpers > 0) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (workers_.empty() && !stop_)
        for (unsigned t = 0; t < threads_; ++t) workers_.emplace_back([this] { Run(); });
      for (size_t h = 0; h < helpers; ++h) queue_.push_back(b);
    }
    cv_.notify_all();
  }
  Drain(*b);
  {
    std::unique_lock<std::mutex> lock(b->mu);
    b->cv.wait(lock, [&] { return b->done == b->n; });
  }
  // Tickets still queued find nothing left to claim; they hold `b` alive,
  // never `task`.
  if (b->error) std::rethrow_exception(b->error);  // on the caller's thread (mount: ENOMEM)
  for (Status& s : b->results)
    if (!s.ok()) return s;
  return Status::OK();
}

void IoPool::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    std::shared_ptr<Batch> b = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    Drain(*b);
    lock.lock();
  }
}

}  // namespace ckptfs
