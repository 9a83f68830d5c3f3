// What S3 requests and answers carry (objects, bodies, upload parts,
// listing pages) and how requests are spelled: keys percent-encoded, URLs
// addressed by path or by host, the body of CompleteMultipartUpload. Pure
// functions of their arguments, no I/O: S3Client (source/s3_client.h) sends
// them.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "source/s3_config.h"

namespace ckptfs {

struct S3ObjectInfo {
  std::string key;  // full key
  uint64_t size = 0;
  std::string etag;  // as the server sends it, quotes included
  int64_t last_modified_ns = 0;
};

// A request body: spans of memory sent in order, never copied (an upload
// part straight from the writer's ring). They must stay unchanged until the
// call returns (a retried request sends them again).
struct S3Body {
  std::vector<std::pair<const char*, uint64_t>> spans;
  uint64_t size() const;
};

// How an upload's parts are checked by the server.
enum class S3PartCheck {
  kCrc32c,  // x-amz-checksum-crc32c per part, ChecksumCRC32C in the completion
  kMd5,     // Content-MD5 per part (a server that ignores the CRC32C headers)
};

struct S3CompletedPart {
  int number = 0;       // 1..10000
  std::string etag;     // as UploadPart's answer sent it
  uint32_t crc32c = 0;  // sent in the completion with S3PartCheck::kCrc32c
};

struct S3MultipartUploadInfo {
  std::string key;
  std::string upload_id;
};

struct S3ListPage {
  std::vector<S3ObjectInfo> objects;
  std::vector<std::string> common_prefixes;  // full prefixes, ending in '/'
};

// Percent-encodes `s` as S3 wants it (RFC 3986 unreserved kept; '/' kept
// when `keep_slash`).
std::string S3Encode(const std::string& s, bool keep_slash);
// The URL of `key` (with `query`, if any) at `endpoint`, addressed by path
// (endpoint/bucket/key) or by host name (bucket.endpoint/key) as
// `config.path_style` says.
std::string S3Url(const S3Config& config, const std::string& endpoint, const std::string& key,
                  const std::string& query);
// The XML body of CompleteMultipartUpload: `parts` in the order given, each
// with its CRC32C when `check` is kCrc32c.
std::string S3CompletionXml(const std::vector<S3CompletedPart>& parts, S3PartCheck check);

}  // namespace ckptfs
