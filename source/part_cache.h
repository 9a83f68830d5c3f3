// Parts of remote objects fetched ahead of their readers: read-ahead for
// sources without a page cache (object storage).
//
// A part is `part_size` aligned bytes of one version of one object (its key
// names the object and the version, e.g. key + ETag), fetched whole by a
// small pool of threads. Prefetch() queues parts and returns at once, so a
// sequential reader's next parts are all in flight together; Copy() serves
// a range from a cached part, waiting for one still in flight, and says when
// it cannot (the caller then fetches the range itself and reports its
// errors: a failed prefetch is only lost speed). Memory is bounded: parts
// cached or in flight hold at most `capacity` bytes, least recently used
// dropped first; parts beyond that are not prefetched.
//
// Threads start on the first Prefetch (a mount forks to daemonize first) and
// are joined by the destructor.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/status.h"

namespace ckptfs {

class PartCache {
 public:
  // Fills `out` with bytes [offset, offset + len) of object version `key`.
  using Fetch = std::function<Status(const std::string& key, uint64_t offset, uint64_t len, char* out)>;

  PartCache(uint64_t capacity, uint64_t part_size, unsigned threads);
  ~PartCache();
  PartCache(const PartCache&) = delete;
  PartCache& operator=(const PartCache&) = delete;

  // Queues the parts of [offset, offset + len) of `key` (an object of
  // `size` bytes) that are neither cached nor in flight.
  void Prefetch(const std::string& key, uint64_t size, uint64_t offset, uint64_t len, Fetch fetch);
  // Copies [offset, offset + len) of `key` into dst when every part of it
  // is cached or in flight (waited for) and fetched without error; false
  // when it did not (dst may then hold some of the bytes).
  bool Copy(const std::string& key, uint64_t offset, uint64_t len, char* dst);

  // The bytes [offset, offset + len) of `key` where they lie in one part
  // cached or in flight (waited for) and fetched without error, without a
  // copy: `data` points into the part and `holder` keeps it alive (a
  // finished part's bytes never change, even once dropped from the cache).
  struct Shared {
    std::shared_ptr<const void> holder;
    const char* data = nullptr;
  };
  std::optional<Shared> Share(const std::string& key, uint64_t offset, uint64_t len);

  uint64_t part_size() const { return part_size_; }
  // Bytes held by parts cached or in flight (for tests).
  uint64_t held() const;

 private:
  struct Part;
  using PartKey = std::pair<std::string, uint64_t>;  // object version, part index
  void Run();
  // The parts holding [offset, offset + len) of `key`, once every one is
  // fetched; empty when one is missing or failed. `lock` holds mu_.
  std::vector<std::shared_ptr<Part>> Finished(const std::string& key, uint64_t offset, uint64_t len,
                                              std::unique_lock<std::mutex>& lock);
  // Marks `parts` the most recently used, those still cached. REQUIRES: mu_ held.
  void Touch(const std::vector<std::shared_ptr<Part>>& parts);
  // Drops least recently used finished parts until `need` more bytes fit;
  // false when they do not. REQUIRES: mu_ held.
  bool MakeRoom(uint64_t need);

  const uint64_t capacity_;
  const uint64_t part_size_;
  const unsigned threads_;
  mutable std::mutex mu_;
  std::condition_variable work_;
  std::map<PartKey, std::shared_ptr<Part>> parts_;
  std::list<PartKey> lru_;  // finished parts, most recently used last
  std::deque<std::pair<std::shared_ptr<Part>, Fetch>> queue_;
  uint64_t held_ = 0;
  bool stop_ = false;
  std::vector<std::thread> pool_;
};

}  // namespace ckptfs
