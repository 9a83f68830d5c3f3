// The stager for object storage: a rank's files go to S3 as multipart
// uploads, each part sent straight from a ring buffer (UploadPart), never
// through a local file or a second copy.
//
//   Write(object, offset, slice) ─► ring buffer = part k of the object, at
//                                    offset - k·P (the producer writes in
//                                    offset order; framing left as holes)
//   part sealed + its holes filled ─► I/O thread: CRC32C, UploadPart
//
// Why a ring buffer is exactly one part: a part must be contiguous bytes of
// the object, and S3 takes parts in any order, so a buffer holding the
// object's bytes [k·P, (k+1)·P) is sent as part k+1 as it is, with no
// assembly copy. Host memory is the ring: `buffers` × `part_bytes`.
//
// Framing (a torch.save archive's zip head and tail) depends on the zip
// CRC-32 of the item's data, known only once every piece of the item has
// been checksummed. The producer leaves the framing's byte ranges as holes
// (AddHole); when the last piece of an item is checksummed, the item's
// holes are generated and copied into the parts that hold them, and a part
// is uploaded once it is sealed (the producer has moved past it) and has no
// hole left. Only the part holding the head of the item being written waits
// for bytes still to come, so at most one part per object is held back
// beyond the pieces in flight; with >= 2 buffers the producer always gets
// one (proof: a held part waits for one item; that item's later parts need
// no hole of an earlier item, so they are sent and their buffers come back).
//
// Part size: objects of up to 10,000 parts (S3's limit); parts are >= 5 MiB
// (S3's minimum for all but the last), chosen by the caller from the
// expected sizes (PartBytesFor). Each object's parts, holes and pieces are
// its S3UploadPlan (s3_upload_plan.h); this class moves bytes through them.
//
// Part checksums: x-amz-checksum-crc32c per part, combined from the pieces'
// CRC32Cs and the holes' (Crc32cCombine: no second pass), and listed in the
// completion; a server that takes no CRC32C (CreateMultipartUpload names no
// algorithm) gets Content-MD5, computed over the part before it is sent.
//
// Uploads are retried by the client (S3Client: backoff and jitter, bounded
// in attempts and time). The first error stops the stager: later writes and
// FinishObject return it; Abort aborts an object's upload. Nothing is
// completed here: FinishObject returns the parts, and the caller completes
// (the save's commit protocol decides when an object may appear).
//
// Threading: one producer calls Write/AddHole/FinishObject/TakeChecksums
// (REQUIRES). Lock order: mu_ only; the copy engine has its own lock,
// never taken while mu_ is held; no S3 call is made while mu_ is held.
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
#include "source/s3_client.h"
#include "writer/copy_engine.h"
#include "writer/s3_upload_plan.h"
#include "writer/stager.h"

namespace ckptfs {

struct S3StagerOptions {
  uint64_t part_bytes = 16ull << 20;  // one ring buffer; >= 5 MiB
  int buffers = 32;                   // the ring: buffers × part_bytes
  int upload_threads = 8;             // parts in flight
  bool zip_crc32 = true;
};

class S3Stager {
 public:
  using HoleFill = S3HoleFill;

  static Result<std::unique_ptr<S3Stager>> Create(const S3StagerOptions& options,
                                                  std::shared_ptr<const S3Client> client,
                                                  std::unique_ptr<CopyEngine> engine = nullptr);
  ~S3Stager();  // Close()
  S3Stager(const S3Stager&) = delete;
  S3Stager& operator=(const S3Stager&) = delete;

  // Starts the multipart upload of `key` (a full key), `size` bytes.
  Result<int> OpenObject(const std::string& key, uint64_t size);
  // [offset, offset + length) of `object` holds bytes the producer does not
  // write: `fill` makes them once the pieces of `tag` tile [0, tag_bytes)
  // (at once when tag_bytes is 0). Holes are added before any Write.
  Status AddHole(int object, uint64_t offset, uint64_t length, uint64_t tag, uint64_t tag_bytes, HoleFill fill);
  // As Stager::Write, always through the ring; offsets of one object must
  // not decrease from one call to the next.
  Status Write(int object, uint64_t offset, const Slice& src, uint64_t tag, uint64_t tag_offset);
  // Seals the object's last parts and waits until every part is uploaded.
  Result<S3ObjectUpload> FinishObject(int object);
  // As Stager::TakeChecksums (after FinishObject).
  Result<Checksums> TakeChecksums(uint64_t tag);
  // Aborts the object's multipart upload (after a failure), once.
  Status Abort(int object);
  // Waits for the uploads in flight, then stops and joins the threads.
  Status Close();

  Status FenceProducer(int device, uint64_t stream) { return engine_->FenceProducer(device, stream); }
  uint64_t part_bytes() const { return options_.part_bytes; }

 private:
  using Object = S3UploadPlan;
  using Piece = S3UploadPlan::Piece;
  using Hole = S3UploadPlan::Hole;
  using Part = S3UploadPlan::Part;
  struct Job {
    int object = 0, part = 0;
    std::vector<Piece> pieces;  // empty for an upload-only job
    bool upload = false;        // the part is ready: send it
  };
  S3Stager(const S3StagerOptions& options, std::shared_ptr<const S3Client> client, std::unique_ptr<CopyEngine> engine);
  Status Start();
  Status Seal(int object);                        // REQUIRES: producer; the current part
  Status Acquire(Object& o);                      // REQUIRES: producer; a buffer for o.parts[o.cur]
  void IoLoop();
  Status Checksum(const Job& job);
  void ResolveTags(int object, const std::vector<uint64_t>& tags);  // REQUIRES: mu_ held
  void QueueReady(int object, int part);                // REQUIRES: mu_ held
  Status Upload(int object, int part);
  Status FirstError();
  void Fail(const Status& st);                          // REQUIRES: mu_ held

  const S3StagerOptions options_;
  std::shared_ptr<const S3Client> client_;
  std::unique_ptr<CopyEngine> engine_;
  std::vector<uint8_t*> ring_;
  std::vector<std::thread> threads_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Object> objects_;  // GUARDED_BY(mu_) (parts, holes); key/size fixed once opened
  std::vector<int> free_;        // GUARDED_BY(mu_)
  std::deque<Job> queue_;        // GUARDED_BY(mu_)
  int busy_ = 0;                 // GUARDED_BY(mu_): jobs taken by threads
  bool stop_ = false;            // GUARDED_BY(mu_)
  bool joined_ = false;          // producer-only
  Status error_;                 // GUARDED_BY(mu_)
  std::map<uint64_t, std::vector<PieceSum>> sums_;  // GUARDED_BY(mu_)
  std::map<uint64_t, uint64_t> tag_bytes_;          // GUARDED_BY(mu_): tags with holes
};

}  // namespace ckptfs
