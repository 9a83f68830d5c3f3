// The stager: copies the bytes a rank saves into a bounded ring of buffers
// and hands each full buffer to I/O threads that pwrite it into the rank's
// files, so copying (D2H or memcpy) and writing overlap.
//
//   Write(slices...) ─► ring buffer 0 ─┐          ┌─► I/O thread: wait copy, CRC, pwrite
//                       ring buffer 1 ─┼─ queue ──┤
//                       (blocks when   ┘ (≤ ring) └─► I/O thread ...
//                        none is free)
//
// Memory is bounded by the ring (default 2 × 256 MiB: two buffers let one
// fill while the other drains; 256 MiB per pwrite amortises syscalls and
// keeps a device copy long enough to run at full PCIe speed). Nothing is
// queued without bound: Write blocks while every buffer is full or being
// written (back-pressure), and direct host writes wait for a free slot in a
// queue of fixed length.
//
// Host memory is written without staging (the I/O thread pwrites from the
// caller's pointer) unless the caller asks for a copy (`copy_host`), which
// it must when the memory may change before Drain returns (async saves).
//
// Checksums: each piece's CRC32C (crc32c.h; and zip's CRC-32 when asked,
// for torch.save archives) is computed on the staged bytes by the I/O thread
// that writes it, and filed under the caller's tag; TakeChecksums combines a
// tag's pieces in order.
//
// Threading: one producer thread calls Write/Drain/TakeChecksums (REQUIRES).
// Lock order: mu_ only; the copy engine has its own lock, never taken
// while mu_ is held.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/status.h"
#include "writer/copy_engine.h"

namespace ckptfs {

struct StagerOptions {
  uint64_t buffer_bytes = 256ull << 20;
  int buffers = 2;
  int io_threads = 2;
  bool zip_crc32 = true;  // also compute zip's CRC-32 per tag
  // Direct (unstaged) host writes are cut into pieces of this size, so the
  // I/O threads share a large tensor and its CRC overlaps its write.
  uint64_t direct_piece_bytes = 64ull << 20;
};

struct Checksums {
  uint64_t bytes = 0;
  uint32_t crc32c = 0;
  uint32_t zip_crc32 = 0;  // 0 unless StagerOptions::zip_crc32
};

// The checksums of one piece of a tag's bytes, as an I/O thread computed them.
struct PieceSum {
  uint64_t tag_offset, size;
  uint32_t crc32c, zip_crc32;
};

// The checksums of a tag's pieces combined in order (zip's CRC-32 only with
// `zip_crc32`); InvalidArgument, naming `who` and `tag`, unless the pieces
// tile [0, n) exactly once.
Result<Checksums> CombinePieceSums(std::vector<PieceSum> pieces, bool zip_crc32, const std::string& who,
                                   uint64_t tag);

// What the stager and the S3 stager (s3_stager.h) both start with and
// both answer TakeChecksums from.
//
// `buffers` ring buffers of `bytes` from `engine`, every one free. Those
// allocated before a failure stay in `ring` for the caller to free.
Status AllocRing(CopyEngine& engine, int buffers, uint64_t bytes, std::vector<uint8_t*>& ring,
                 std::vector<int>& free);
// Starts `count` threads running `loop`, each named "ckptfs-io" (in top -H,
// gdb and /proc/PID/task/*/comm). A thread that cannot be started is an
// IOError starting with `what`, not an exception; those started so far stay
// in `threads` for the caller to join.
Status StartIoThreads(int count, const std::function<void()>& loop, std::vector<std::thread>& threads,
                      const std::string& what);
// Takes the pieces filed under `tag` out of `sums` (holding `mu` only for
// that) and combines them (CombinePieceSums); NotFound, naming `who`, when
// nothing was written under the tag.
Result<Checksums> TakePieceSums(std::mutex& mu, std::map<uint64_t, std::vector<PieceSum>>& sums, uint64_t tag,
                                bool zip_crc32, const std::string& who);

struct StagerStats {
  uint64_t staged_bytes = 0;  // through the ring
  uint64_t direct_bytes = 0;  // written from the caller's memory
  uint64_t producer_wait_ns = 0;  // Write blocked on a full ring (back-pressure)
};

class Stager {
 public:
  // `engine` null: MakeDefaultCopyEngine.
  static Result<std::unique_ptr<Stager>> Create(const StagerOptions& options,
                                                std::unique_ptr<CopyEngine> engine = nullptr);
  ~Stager();  // Close(), then frees the ring; files are closed
  Stager(const Stager&) = delete;
  Stager& operator=(const Stager&) = delete;

  // Creates (truncates) `path` for writing; returns its file id.
  Result<int> OpenFile(const std::string& path);
  int fd(int file) const { return files_[file].fd; }

  // Queues `src` to be written at `offset` of `file`. Checksums go under
  // `tag`, with `tag_offset` the position of src's first byte within the
  // tag's bytes (pieces of a tag must tile [0, n) once Drain returns).
  // Returns when src may be reused: at once for staged bytes, after Drain
  // for direct host writes. Blocks while the ring is full.
  Status Write(int file, uint64_t offset, const Slice& src, uint64_t tag, uint64_t tag_offset,
               bool copy_host);

  // Flushes the partly filled buffer and waits until every queued write is
  // done. Returns the first error any write met.
  Status Drain();

  // Orders later work on the producer's stream after the copies issued so
  // far (CopyEngine::FenceProducer); host slices need nothing.
  Status FenceProducer(int device, uint64_t stream) { return engine_->FenceProducer(device, stream); }

  // The combined checksums of `tag` (after Drain), removed from the stager.
  Result<Checksums> TakeChecksums(uint64_t tag);

  // Drains, then stops and joins the I/O threads; later writes fail. Safe
  // to call again. Callers that may end their process soon after a failure
  // (a Python interpreter exiting through an exception) call it rather than
  // leave the threads to whatever order teardown destroys things in.
  // Returns Drain's error, if any.
  Status Close();

  // fsync(file). The caller fsyncs the directory (SyncDir) once per save.
  Status SyncFile(int file);
  Status CloseFile(int file);

  const char* engine_name() const { return engine_->name(); }
  StagerStats stats() const;

 private:
  struct Piece {
    int file = 0;
    uint64_t file_offset = 0;
    const uint8_t* data = nullptr;  // into a ring buffer, or the caller's memory
    uint64_t size = 0;
    uint64_t tag = 0, tag_offset = 0;
  };
  struct Job {
    int buffer = -1;  // -1: a direct host write
    std::vector<Piece> pieces;
  };
  struct File {
    std::string path;
    int fd = -1;
  };

  Stager(const StagerOptions& options, std::unique_ptr<CopyEngine> engine);
  Status Start();
  Status StageCopy(int file, uint64_t offset, const Slice& src, uint64_t tag, uint64_t tag_offset);
  Status WriteDirect(int file, uint64_t offset, const Slice& src, uint64_t tag, uint64_t tag_offset);
  Status AcquireBuffer();                   // REQUIRES: producer; sets cur_
  Status SubmitCurrent();                   // seals and queues cur_
  Status Enqueue(Job job);                  // blocks while the queue is full
  void IoLoop();
  Status RunJob(const Job& job);
  Status FirstError();

  const StagerOptions options_;
  std::unique_ptr<CopyEngine> engine_;
  std::vector<uint8_t*> ring_;
  std::vector<File> files_;
  std::vector<std::thread> threads_;

  // Producer-only state.
  int cur_ = -1;
  uint64_t cur_fill_ = 0;
  std::vector<Piece> cur_pieces_;

  mutable std::mutex mu_;
  std::condition_variable cv_;  // free_ grew, queue_ shrank, a job finished, stop_
  std::vector<int> free_;       // GUARDED_BY(mu_)
  std::deque<Job> queue_;       // GUARDED_BY(mu_); at most buffers + io_threads jobs
  int in_flight_ = 0;           // GUARDED_BY(mu_): jobs taken by I/O threads
  bool stop_ = false;           // GUARDED_BY(mu_); set by Close: no more writes
  bool joined_ = false;         // producer-only: Close joined threads_
  Status error_;                // GUARDED_BY(mu_): the first failure
  std::map<uint64_t, std::vector<PieceSum>> sums_;  // GUARDED_BY(mu_)
  StagerStats stats_;           // GUARDED_BY(mu_)
};

// fsync of a directory, so entries created or renamed in it are durable.
Status SyncDir(const std::string& dir);

}  // namespace ckptfs
