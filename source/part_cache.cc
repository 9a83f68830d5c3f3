#include "source/part_cache.h"

#include <algorithm>
#include <cstring>

#include "core/uninitialized.h"

namespace ckptfs {

struct PartCache::Part {
  std::string key;
  uint64_t index = 0;
  uint64_t offset = 0;  // in the object
  UninitializedBytes bytes;  // filled once done && ok
  bool done = false;
  bool ok = false;
  std::list<PartKey>::iterator lru;  // valid once done && ok
  std::condition_variable finished;
};

PartCache::PartCache(uint64_t capacity, uint64_t part_size, unsigned threads)
    : capacity_(capacity), part_size_(std::max<uint64_t>(part_size, 1)), threads_(std::max(1u, threads)) {}

PartCache::~PartCache() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_.notify_all();
  for (std::thread& t : pool_) t.join();
}

uint64_t PartCache::held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_;
}

bool PartCache::MakeRoom(uint64_t need) {
  while (held_ + need > capacity_ && !lru_.empty()) {
    auto it = parts_.find(lru_.front());
    held_ -= it->second->bytes.size();
    parts_.erase(it);
    lru_.pop_front();
  }
  return held_ + need <= capacity_;
}

void PartCache::Prefetch(const std::string& key, uint64_t size, uint64_t offset, uint64_t len, Fetch fetch) {
  if (len == 0 || offset >= size) return;
  const uint64_t end = std::min(size, offset + len);
  std::lock_guard<std::mutex> lock(mu_);
  if (stop_) return;
  while (pool_.size() < threads_) pool_.emplace_back([this] { Run(); });
  for (uint64_t i = offset / part_size_; i * part_size_ < end; ++i) {
    PartKey k{key, i};
    if (parts_.count(k)) continue;
    const uint64_t at = i * part_size_, n = std::min(part_size_, size - at);
    if (!MakeRoom(n)) break;  // the rest is fetched by its reader; the parts queued still need a worker
    auto part = std::make_shared<Part>();
    part->key = key;
    part->index = i;
    part->offset = at;
    part->bytes.resize(n);
    held_ += n;
    parts_[k] = part;
    queue_.emplace_back(std::move(part), fetch);
  }
  work_.notify_all();
}

void PartCache::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    auto [part, fetch] = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    const bool ok = fetch(part->key, part->offset, part->bytes.size(), part->bytes.data()).ok();
    lock.lock();
    part->done = true;
    part->ok = ok;
    const PartKey k{part->key, part->index};
    auto it = parts_.find(k);
    if (it != parts_.end() && it->second == part) {
      if (ok) {
        part->lru = lru_.insert(lru_.end(), k);
      } else {  // its reader fetches the bytes itself and reports why
        held_ -= part->bytes.size();
        parts_.erase(it);
      }
    }
    part->finished.notify_all();
  }
}

std::vector<std::shared_ptr<PartCache::Part>> PartCache::Finished(const std::string& key, uint64_t offset,
                                                                uint64_t len, std::unique_lock<std::mutex>& lock) {
  // Every part first: a range half cached is fetched whole by its reader.
  std::vector<std::shared_ptr<Part>> parts;
  for (uint64_t i = offset / part_size_; i * part_size_ < offset + len; ++i) {
    auto it = parts_.find({key, i});
    if (it == parts_.end()) return {};
    parts.push_back(it->second);
  }
  for (const auto& part : parts) {
    part->finished.wait(lock, [&] { return part->done; });
    if (!part->ok) return {};
  }
  return parts;
}

void PartCache::Touch(const std::vector<std::shared_ptr<Part>>& parts) {
  for (const auto& part : parts)
    if (auto it = parts_.find({part->key, part->index}); it != parts_.end() && it->second == part)
      lru_.splice(lru_.end(), lru_, part->lru);
}

bool PartCache::Copy(const std::string& key, uint64_t offset, uint64_t len, char* dst) {
  std::unique_lock<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<Part>> parts = Finished(key, offset, len, lock);
  if (parts.empty()) return false;
  lock.unlock();  // a finished part's bytes never change; the pointers keep them
  for (const auto& part : parts) {
    const uint64_t from = std::max(offset, part->offset);
    const uint64_t to = std::min(offset + len, part->offset + part->bytes.size());
    if (from >= to) return false;  // beyond the object's end
    std::memcpy(dst + (from - offset), part->bytes.data() + (from - part->offset), to - from);
  }
  lock.lock();
  Touch(parts);
  return true;
}

std::optional<PartCache::Shared> PartCache::Share(const std::string& key, uint64_t offset, uint64_t len) {
  if (len == 0 || offset / part_size_ != (offset + len - 1) / part_size_) return std::nullopt;
  std::unique_lock<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<Part>> parts = Finished(key, offset, len, lock);
  if (parts.empty() || offset + len > parts[0]->offset + parts[0]->bytes.size()) return std::nullopt;
  Touch(parts);
  const char* data = parts[0]->bytes.data() + (offset - parts[0]->offset);
  return Shared{std::shared_ptr<const void>(parts[0], data), data};
}

}  // namespace ckptfs
