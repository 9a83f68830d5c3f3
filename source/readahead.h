// Read-ahead of source byte ranges for sequential readers of virtual files.
//
// A virtual file is served by preads of its source files, one request at a
// time; a reader streaming it (read() in a loop, or the page faults of a
// mapped file copied front to back) waits for the disk on every request. Here
// each open file's requests are followed (ReadStream) and, while they are
// sequential, the source ranges the next `readahead` bytes of the virtual file
// will need are brought into the page cache by a background thread
// (HintQueue; SourcePrefetch reads them into /dev/null). Read-ahead
// only fills the page cache: the bytes are still pread and identity-checked
// by SourceReader when a request asks for them, so read-ahead can never
// serve stale bytes. Its memory is the kernel's page cache (reclaimable):
// `readahead` bytes per open file beyond what its reader has reached, plus
// what the kernel's own read-ahead of a source file adds (read_ahead_kb of
// its device).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_set>

namespace ckptfs {

// The requests of one open file. Thread-safe: FUSE serves the kernel's
// read-ahead requests of one file from several threads, slightly out of order.
class ReadStream {
 public:
  struct Window {
    uint64_t offset = 0;
    uint64_t length = 0;  // 0: nothing to read ahead now
    bool started = false;  // the request began a new stream (it continued none)
  };
  ReadStream();
  // Cancels the hints still queued for this stream, and the pushes.
  ~ReadStream();

  // Records the request [offset, offset + size) of a file of `file_size`
  // bytes, beginning in `unit` and ending in `end_unit` (the indexes of the
  // layout segments holding its first and last bytes), and returns the
  // range to read ahead now, if any. A request more than kSlack away from
  // the furthest byte requested so far breaks the pattern: the stream
  // starts again there and queued hints are cancelled.
  //
  // A stream starts reading ahead at a request that begins in the unit
  // where the stream's furthest request ended: a reader that touches the
  // ends of neighbouring tensors (transformers' load touches the first and
  // last MiB of each) looks sequential across their boundary, and is not;
  // one that reads a header and goes on into the first tensor is. Once
  // reading ahead, the stream goes on across units.
  Window OnRead(uint64_t offset, uint64_t size, uint64_t file_size, uint64_t readahead, uint64_t unit,
                uint64_t end_unit);

  // Changes whenever the pattern breaks; a queued hint made under another
  // generation is dropped.
  std::shared_ptr<const std::atomic<uint64_t>> generation() const { return generation_; }

  // True the first time it is called for `unit`: the caller then pushes
  // that unit whole (SourceReader::ReadAhead), once per stream.
  bool ClaimUnit(uint64_t unit);

  // Changes only when the stream is destroyed (its file closed): work
  // queued for the file's lifetime, not for one pattern, is dropped then.
  std::shared_ptr<const std::atomic<uint64_t>> lifetime() const { return lifetime_; }

  // Requests may arrive this far apart (the kernel's own read-ahead of the
  // virtual file issues up to a few 1 MiB requests at once) and still count
  // as one sequential stream.
  static constexpr uint64_t kSlack = 4 << 20;
  static constexpr size_t kMaxClaimed = 1 << 16;

 private:
  std::mutex mu_;  // guards the fields below
  uint64_t frontier_ = 0;  // end of the furthest request of this stream
  uint64_t hinted_ = 0;    // read ahead up to here
  uint64_t unit_ = 0;      // the unit where the furthest request ended
  bool reading_ahead_ = false;
  bool started_ = false;
  std::unordered_set<uint64_t> claimed_;  // units ClaimUnit has returned true for
  std::shared_ptr<std::atomic<uint64_t>> generation_;
  std::shared_ptr<std::atomic<uint64_t>> lifetime_;
};

// A bounded queue of background jobs run by one thread, started on the first
// Post (not before: a mount forks to daemonize, and threads do not survive a
// fork). Jobs are hints: when the queue is full a new one is dropped.
class HintQueue {
 public:
  explicit HintQueue(size_t max_pending = 64) : max_pending_(max_pending) {}
  ~HintQueue() { Stop(); }
  HintQueue(const HintQueue&) = delete;
  HintQueue& operator=(const HintQueue&) = delete;

  // False when the queue is full or stopped (the job is dropped).
  bool Post(std::function<void()> job);
  // Drops the jobs not started and waits for the running one; later Posts
  // are refused.
  void Stop();

 private:
  void Run();

  size_t max_pending_;
  std::mutex mu_;  // guards the fields below
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
  std::thread thread_;  // not joinable until the first Post
};

}  // namespace ckptfs
