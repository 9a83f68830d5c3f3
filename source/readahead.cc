#include "source/readahead.h"

#include <algorithm>

namespace ckptfs {

ReadStream::ReadStream()
    : generation_(std::make_shared<std::atomic<uint64_t>>(0)), lifetime_(std::make_shared<std::atomic<uint64_t>>(0)) {}

ReadStream::~ReadStream() {
  generation_->fetch_add(1);
  lifetime_->fetch_add(1);
}

bool ReadStream::ClaimUnit(uint64_t unit) {
  std::lock_guard<std::mutex> lock(mu_);
  // A bound on the set: past it a unit may be pushed twice (speed only).
  if (claimed_.size() >= kMaxClaimed) claimed_.clear();
  return claimed_.insert(unit).second;
}

ReadStream::Window ReadStream::OnRead(uint64_t offset, uint64_t size, uint64_t file_size, uint64_t readahead,
                                      uint64_t unit, uint64_t end_unit) {
  if (readahead == 0 || size == 0) return {};
  const uint64_t end = offset + size;
  std::lock_guard<std::mutex> lock(mu_);
  const bool continues = started_ && offset + kSlack >= frontier_ && offset <= frontier_ + kSlack &&
                         (reading_ahead_ || unit == unit_);
  if (!continues) {
    if (started_) generation_->fetch_add(1);
    started_ = true;
    frontier_ = hinted_ = end;
    unit_ = end_unit;
    reading_ahead_ = false;
    return {0, 0, true};
  }
  reading_ahead_ = true;
  if (end >= frontier_) unit_ = end_unit;
  frontier_ = std::max(frontier_, end);
  const uint64_t target = std::min(file_size, frontier_ + readahead);
  const uint64_t from = std::max(hinted_, frontier_);
  if (target <= from) return {};
  // Hints go out in steps of a quarter window (or the rest of the file):
  // one per 1 MiB request would cost a queue round trip each.
  if (target - from < readahead / 4 && target < file_size) return {};
  hinted_ = target;
  return {from, target - from};
}

void HintQueue::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    jobs_.clear();
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

bool HintQueue::Post(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ || jobs_.size() >= max_pending_) return false;
    jobs_.push_back(std::move(job));
    if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
  }
  cv_.notify_one();
  return true;
}

void HintQueue::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
    if (stop_) return;
    std::function<void()> job = std::move(jobs_.front());
    jobs_.pop_front();
    lock.unlock();
    job();
    lock.lock();
  }
}

}  // namespace ckptfs
