// Re-reading a checkpoint's chunks against the CRC32C their writer
// recorded (Chunk::crc32c; ckptfs's own writer records one per chunk,
// a scan none): all of them at once (`ckptfs verify`), or each on its
// first read (ChecksumGate, `ckptfs mount --verify-checksums`).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/meta.h"
#include "core/planner.h"
#include "indexer/source_reader.h"

namespace ckptfs {

struct ChecksumReport {
  uint64_t chunks = 0;  // chunks with a recorded checksum, all read
  uint64_t files = 0;   // files whose other bytes (SourceFile::rest_crc32c) were read
  uint64_t bytes = 0;
  // One line per chunk that differs or cannot be read: tensor, chunk, file,
  // byte range, and the two values.
  std::vector<std::string> problems;
};

// Reads each chunk of `ckpt` that carries a checksum through `reader` (so a
// changed source is an error, not a mismatch) and compares; then, for each
// file with a recorded SourceFile::rest_crc32c, its bytes outside the
// chunks. `on_bytes`, when
// set, is told the bytes read so far.
ChecksumReport VerifyChunkChecksums(const Checkpoint& ckpt, SourceReader& reader,
                                    const std::function<void(uint64_t)>& on_bytes = {});

// Verify-on-first-read. Before any byte of a checksummed chunk is served,
// the whole chunk is read and its CRC32C compared with the recorded one;
// the verdict is kept, so later reads of a good chunk cost nothing more and
// every read touching a bad one fails (Corruption: EIO through the mount),
// while the checkpoint's other chunks keep serving. The first read of a
// chunk therefore costs a read of all of it. Two threads reading a chunk
// for the first time may both verify it (same verdict). Chunks without a
// checksum pass unchecked.
//
// Thread-safe. `ckpt` must outlive the gate (it names chunks in messages).
class ChecksumGate {
 public:
  // Reads [offset, offset + length) of `file` into `dst` with the reader's
  // own checks (identity, short reads), without passing through the gate.
  using RawRead = std::function<Status(FileId file, uint64_t offset, uint64_t length, char* dst)>;

  explicit ChecksumGate(const Checkpoint& ckpt);

  // OK when every checksummed chunk overlapping one of `copies`' source
  // ranges is good, verifying the ones not seen yet through `read`.
  Status Check(const std::vector<CopyOp>& copies, const RawRead& read);

  uint64_t chunks() const { return entries_.size(); }

 private:
  enum State : uint8_t { kUnknown = 0, kGood = 1, kBad = 2 };
  struct Entry {
    uint64_t offset, length;
    uint32_t crc32c;
    const TensorMeta* tensor;  // for the message
    uint32_t chunk;
  };
  Status CheckRange(FileId file, uint64_t offset, uint64_t length, const RawRead& read);
  Status Verify(size_t e, const RawRead& read);
  std::string Describe(size_t e) const;

  const Checkpoint& ckpt_;
  std::vector<Entry> entries_;         // by (file, offset)
  std::vector<size_t> file_begin_;     // entries of file f: [file_begin_[f], file_begin_[f + 1])
  std::unique_ptr<std::atomic<uint8_t>[]> state_;  // State, per entry
  std::mutex bad_mu_;                  // guards bad_
  std::map<size_t, std::string> bad_;  // why entry e is kBad
};

}  // namespace ckptfs
