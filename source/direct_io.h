// Direct source reads: the bytes of a source range that is not in the page
// cache are read with O_DIRECT into aligned memory the daemon owns, so the
// disk's DMA fills the buffer a reply is sent from and the CPU copies a cold
// byte once (into the FUSE page cache) instead of twice (docs/BENCHMARKS.md,
// "Cold reads"). Ranges already cached are read through the page cache as
// before; filesystems without O_DIRECT fall back to buffered reads per file
// (source/posix_source.cc says how each is told apart).
//
// Memory is bounded: every direct read takes its buffer from one BufferPool
// of `--direct-pool-mib`; when the pool has no room the read goes through the
// page cache into heap memory, counted in DirectStats::pool_full. Reads of
// one request run side by side on a small IoPool (source/io_pool.h), so a
// cold request keeps several reads in the disk's queue without the kernel's
// read-ahead, which O_DIRECT does not get.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "source/io_pool.h"

namespace ckptfs {

// O_DIRECT offsets, lengths and memory are aligned to this. 4 KiB is the
// largest logical block size of common devices and the page size, so it
// satisfies every filesystem whose statx(STATX_DIOALIGN) asks for 4 KiB or
// less; a file asking for more is read buffered.
constexpr uint64_t kDirectAlign = 4096;

inline uint64_t AlignDown(uint64_t x, uint64_t align) { return x - x % align; }
inline uint64_t AlignUp(uint64_t x, uint64_t align) { return AlignDown(x + align - 1, align); }

// The aligned file range a direct read of [offset, offset + length) covers:
// [start, start + length'), the requested bytes beginning `skip` bytes in.
struct AlignedSpan {
  uint64_t start = 0;
  uint64_t length = 0;
  uint64_t skip = 0;
};
AlignedSpan AlignSpan(uint64_t offset, uint64_t length, uint64_t align = kDirectAlign);

class BufferPool;

// Memory a read filled: from a BufferPool (page-aligned, given back when
// destroyed) or from the heap (never read into with O_DIRECT). Move-only.
class Buffer {
 public:
  Buffer() = default;
  // `size` bytes of heap memory.
  static Buffer Heap(size_t size);
  Buffer(Buffer&& o) noexcept;
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  char* data() const { return data_; }
  size_t size() const { return size_; }
  bool pooled() const { return pool_ != nullptr; }

 private:
  friend class BufferPool;
  Buffer(char* data, size_t size, BufferPool* pool) : data_(data), size_(size), pool_(pool) {}
  void Reset();

  char* data_ = nullptr;
  size_t size_ = 0;
  BufferPool* pool_ = nullptr;  // null: heap memory, freed by the destructor
};

// At most `capacity` bytes of page-aligned buffers, in use or kept for
// reuse. Buffers come in power-of-two sizes from kMinBuffer up, so a freed
// one serves the next read of a similar size without a new mapping and its
// page faults (a 1 MiB mmap costs 256 faults on every use). Thread-safe.
// Must outlive its buffers.
class BufferPool {
 public:
  static constexpr size_t kMinBuffer = 64 << 10;

  explicit BufferPool(uint64_t capacity) : capacity_(capacity) {}
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // A buffer of at least `bytes`, or nullopt when taking it would hold more
  // than the capacity even after dropping every kept free buffer.
  std::optional<Buffer> TryTake(uint64_t bytes);

  uint64_t capacity() const { return capacity_; }
  // Bytes mapped now: in use plus kept free.
  uint64_t held() const;
  uint64_t in_use() const;

  // The size of the buffer TryTake(bytes) hands out.
  static size_t ClassSize(uint64_t bytes);

 private:
  friend class Buffer;
  void Give(char* data, size_t size);
  // Unmaps kept free buffers, largest first, until `need` more bytes fit.
  // REQUIRES: mu_ held.
  void DropFreeLocked(uint64_t need);

  const uint64_t capacity_;
  mutable std::mutex mu_;  // guards the fields below; never held during a mapping
  std::map<size_t, std::vector<char*>> free_;  // size -> kept buffers
  uint64_t held_ = 0;    // mapped: in use + free
  uint64_t in_use_ = 0;
};

// What the direct path did, for the log line a mount writes when it ends
// and for tests. Bytes are source bytes.
struct DirectStats {
  std::atomic<uint64_t> direct_reads{0};
  std::atomic<uint64_t> direct_bytes{0};   // read with O_DIRECT
  std::atomic<uint64_t> cached_bytes{0};   // found in the page cache (mincore)
  std::atomic<uint64_t> buffered_bytes{0};  // read buffered: no O_DIRECT for the file, or the pool full
  std::atomic<uint64_t> refused_files{0};  // files whose filesystem has no O_DIRECT
  std::atomic<uint64_t> pool_full{0};      // reads that found no room in the pool

  // "direct reads: 12 (3.0 MiB), cached 1.0 MiB, buffered 0 B, ..."
  std::string Describe() const;
};

// The direct-read machinery one mount shares among its checkpoints' readers
// (ReadOptions::direct).
class DirectIo {
 public:
  // Threads of the IoPool: 8 reads in flight per busy request keep an NVMe
  // queue deep without a thread per FUSE worker (16 by default), and cost
  // nothing while idle.
  static constexpr unsigned kIoThreads = 8;

  explicit DirectIo(uint64_t pool_bytes, unsigned io_threads = kIoThreads)
      : pool_(pool_bytes), io_(io_threads) {}

  BufferPool& pool() { return pool_; }
  IoPool& io() { return io_; }
  DirectStats& stats() { return stats_; }
  const DirectStats& stats() const { return stats_; }

 private:
  BufferPool pool_;
  IoPool io_;
  DirectStats stats_;
};

}  // namespace ckptfs
