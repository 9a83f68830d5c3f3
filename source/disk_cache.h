// A local disk cache of byte ranges of remote objects (`--cache DIR
// --max-cache-size SIZE`): bytes fetched once are read from local disk the
// next time, by this process or by another one sharing DIR.
//
// What is cached. An object version is named by an opaque identity string
// (for S3: endpoint, bucket, key, ETag and size; source/s3_source.cc). Its
// bytes are cached in blocks of `block_size` aligned bytes (the last block
// may be shorter), one file per block, fetched whole: a read that misses
// fetches the missing blocks it touches, consecutive ones in one request.
//
// Never wrong bytes. Each block file carries, in a header, the identity in
// full, the block's offset and length, and CRC32Cs of the header and of the
// bytes (format below). A block whose file is truncated, longer, corrupt,
// or names another identity or offset is discarded (unlinked) and fetched
// again; it is never served. File names carry only a hash of the identity
// (the raw key never appears in a path), so a hash collision is a miss.
//
// Layout of DIR:
//   CACHEDIR.TAG      marks DIR as a cache (the standard tag, so backup
//                     tools skip it) and as ckptfs's own;
//   usage             bytes held by block files, in decimal; flock()ed while
//                     a block is reserved or blocks are evicted;
//   blocks/HHHH…-IIII….blk   block I (16 hex digits) of the version whose
//                     identity hashes to H (32 hex digits);
//   blocks/.<name>.<pid>.<n>.tmp   a block being written, renamed into place.
// DIR must be new, empty, or already a ckptfs cache (Open refuses anything
// else), and ckptfs only ever deletes files in blocks/ named as above.
//
// Block file format (integers little-endian, as the host writes them; a
// cache moved to a big-endian host fails its checks and is refetched):
//   0   8  magic "ckptfsCB"
//   8   4  format version (1)
//   12  4  identity length L
//   16  8  offset of the block in the object
//   24  8  byte count N
//   32  4  CRC32C of the N bytes
//   36  4  CRC32C of bytes [0, 36) followed by the identity
//   40  L  identity
//   40+L N the bytes
//
// Bound and LRU. The block files (each counted at its size rounded up to
// 4 KiB, as the filesystem allocates it; blocks being written at a full
// block's size) hold at most `max_bytes`. A block's room is reserved in
// `usage` under its flock before its file is created; when it would not fit,
// the least recently used blocks (oldest mtime: a hit touches its file) are
// deleted until the cache is at 7/8 of the bound, so evictions come in
// batches. Every eviction recounts the files, which corrects `usage` after a
// crash or a block written twice.
//
// Sharing. Block files appear by rename (atomic) and are never modified in
// place; a block deleted under a reader is a miss (or, once opened, still
// read whole). Several processes and threads may share DIR.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"

namespace ckptfs {

// What the cache did, for the log line a mount writes when it ends and for
// tests. Counts are blocks.
struct DiskCacheStats {
  std::atomic<uint64_t> hits{0};
  std::atomic<uint64_t> misses{0};      // fetched (and stored when they fit)
  std::atomic<uint64_t> discarded{0};   // corrupt, truncated or of another identity
  std::atomic<uint64_t> evicted{0};
  std::atomic<uint64_t> not_stored{0};  // fetched but not written: no room, or the write failed
  // "disk cache: 12 hits, 3 misses, ..."
  std::string Describe() const;
};

class DiskCache {
 public:
  // Fills `out` with bytes [offset, offset + len) of the object.
  using Fetch = std::function<Status(uint64_t offset, uint64_t len, char* out)>;

  static constexpr uint64_t kBlockSize = 1ull << 20;
  static constexpr uint64_t kDefaultMaxBytes = 10ull << 30;  // as mount-s3's default
  // Identities longer than this are not cached (an S3 key is at most 1 KiB).
  static constexpr size_t kMaxIdentity = 4096;

  // Opens (creating it when missing) the cache in `dir`. InvalidArgument
  // when `dir` holds files ckptfs did not write, or `max_bytes` is under
  // four blocks; IOError when it cannot be created.
  static Result<std::shared_ptr<DiskCache>> Open(const std::string& dir, uint64_t max_bytes,
                                                 uint64_t block_size = kBlockSize);
  ~DiskCache();
  DiskCache(const DiskCache&) = delete;
  DiskCache& operator=(const DiskCache&) = delete;

  // Bytes [offset, offset + len) of object version `identity` (of `size`
  // bytes) into dst: blocks from the cache where they are valid, the others
  // through `fetch`, then stored. Fails only when `fetch` fails (with its
  // status); a block that cannot be stored is served all the same.
  // Thread-safe.
  Status Read(const std::string& identity, uint64_t size, uint64_t offset, uint64_t len, char* dst,
              const Fetch& fetch);

  // The file block `index` of `identity` lives in (for tests and tools).
  std::string BlockPath(const std::string& identity, uint64_t index) const;
  // Bytes of block files counted now (recounted from the directory).
  uint64_t Recount();

  const std::string& dir() const { return dir_; }
  uint64_t max_bytes() const { return max_bytes_; }
  uint64_t block_size() const { return block_size_; }
  const DiskCacheStats& stats() const { return stats_; }

 private:
  struct Want;
  struct Entry;
  DiskCache(std::string dir, uint64_t max_bytes, uint64_t block_size, int usage_fd);

  bool Load(const Want& w, uint64_t index);
  Status FetchRun(const Want& w, uint64_t first, uint64_t end, const Fetch& fetch);
  void Store(const Want& w, uint64_t index, const char* bytes, uint64_t n);
  void Discard(const std::string& path, uint64_t ino, uint64_t size);
  // Reserves `bytes` and creates temp file `tmp` for them; -1 when they do
  // not fit or the file cannot be created (nothing then stays reserved).
  int Reserve(uint64_t bytes, const std::string& tmp);
  void Release(uint64_t bytes);
  // REQUIRES: the usage lock held (mu_ and the flock).
  std::optional<uint64_t> ReadUsage();  // nullopt: unknown (new, or cut short)
  void WriteUsage(uint64_t bytes);
  uint64_t Evict(uint64_t need);
  std::vector<Entry> Scan(uint64_t* total);

  const std::string dir_, blocks_;
  const uint64_t max_bytes_, block_size_;
  const int usage_fd_;
  // flock() excludes other open files, not threads sharing one: mu_ first,
  // then the flock on usage_fd_.
  std::mutex mu_;
  std::atomic<uint64_t> temp_counter_{0};
  DiskCacheStats stats_;
};

}  // namespace ckptfs
