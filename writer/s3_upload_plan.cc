// The arithmetic of a multipart upload's parts (what and why: s3_upload_plan.h).
#include "writer/s3_upload_plan.h"

#include <algorithm>

namespace ckptfs {

uint64_t PartBytesFor(uint64_t largest_object, uint64_t preferred) {
  constexpr uint64_t kMiB = 1ull << 20;
  uint64_t p = std::max(preferred, kS3MinPartBytes);
  p = std::max(p, (largest_object + kS3MaxParts - 1) / kS3MaxParts);
  return (p + kMiB - 1) / kMiB * kMiB;
}

Result<S3UploadPlan> S3UploadPlan::Make(const std::string& key, uint64_t size, uint64_t part_bytes) {
  const uint64_t nparts = (size + part_bytes - 1) / part_bytes;
  if (nparts > kS3MaxParts)
    return Status::InvalidArgument(key + ": " + std::to_string(size) + " bytes in parts of " +
                                   std::to_string(part_bytes) + " is " + std::to_string(nparts) +
                                   " parts, more than S3's 10,000; use a larger part size");
  S3UploadPlan o;
  o.key = key;
  o.size = size;
  o.part_bytes = part_bytes;
  o.parts.resize(nparts);
  return o;
}

uint64_t S3UploadPlan::PartSize(int k) const { return std::min(part_bytes, size - uint64_t(k) * part_bytes); }

}  // namespace ckptfs
