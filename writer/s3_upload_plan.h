// One object's multipart upload as the S3 stager (s3_stager.h) plans it:
// part k is the object's bytes [k·P, (k+1)·P), held in one ring buffer and
// sent as part k+1; the framing's byte ranges are holes, filled once the
// checksums of their tag are known; a part is sent once it is sealed,
// checksummed and has no hole left. Also S3's limits on parts and the part
// size that keeps an object within them.
//
// Plain data and arithmetic, sending nothing. The S3 stager keeps one plan
// per object under its mutex; the fields marked "producer" only its
// producer thread touches.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/status.h"
#include "source/s3_wire.h"
#include "writer/stager.h"

namespace ckptfs {

// S3's limits on multipart uploads.
inline constexpr uint64_t kS3MinPartBytes = 5ull << 20;
inline constexpr uint64_t kS3MaxParts = 10'000;

// The smallest part size >= `preferred` (and >= 5 MiB) that puts an object
// of `largest_object` bytes in at most 10,000 parts, rounded up to a MiB.
uint64_t PartBytesFor(uint64_t largest_object, uint64_t preferred);

// What S3Stager::FinishObject returns: the parts to complete the upload with.
struct S3ObjectUpload {
  std::string key;
  std::string upload_id;  // "" when the object was empty: it was PUT whole
  S3PartCheck check = S3PartCheck::kCrc32c;
  std::vector<S3CompletedPart> parts;
};

// Fills the bytes of a hole, given the combined checksums of its tag.
using S3HoleFill = std::function<std::string(const Checksums&)>;

struct S3UploadPlan {
  // Bytes of one Write in one part, filed under the caller's tag.
  struct Piece {
    uint64_t offset_in_part, size, tag, tag_offset;
  };
  struct Hole {
    uint64_t offset = 0, length = 0, tag = 0;
    S3HoleFill fill;
    bool filled = false;
    std::string bytes;
  };
  struct Part {
    int buffer = -1;
    bool sealed = false;      // the producer moved past it
    bool checksummed = false; // its pieces' sums filed
    bool sent = false;        // uploaded, or taken by a thread to upload
    std::vector<size_t> holes;  // into S3UploadPlan::holes
    struct Span {
      uint64_t offset, size;  // within the part
      uint32_t crc32c;
    };
    std::vector<Span> spans;  // its pieces', once checksummed
  };

  // The plan of `size` bytes of `key` in parts of `part_bytes`, none sent;
  // InvalidArgument when that is more than kS3MaxParts parts.
  static Result<S3UploadPlan> Make(const std::string& key, uint64_t size, uint64_t part_bytes);
  // The bytes of part k: part_bytes, the last part what is left.
  uint64_t PartSize(int k) const;

  std::string key, upload_id;
  S3PartCheck check = S3PartCheck::kCrc32c;
  uint64_t size = 0;
  uint64_t part_bytes = 0;
  std::vector<Part> parts;
  std::vector<Hole> holes;
  std::map<uint64_t, std::vector<size_t>> holes_of_tag;
  std::vector<S3CompletedPart> done;
  int cur = 0;  // producer: the part being filled
  std::vector<Piece> pending;  // producer: the current part's pieces
  bool aborted = false;
};

}  // namespace ckptfs
