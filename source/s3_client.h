// HTTP to an S3 server: the only code that knows libcurl. What requests
// and answers carry, and how keys, URLs and bodies are spelled, is
// source/s3_wire.h (no libcurl there).
//
// Requests are signed by libcurl (CURLOPT_AWS_SIGV4); we send
// x-amz-content-sha256 ourselves (the hash of the empty body for GET, HEAD
// and DELETE; UNSIGNED-PAYLOAD for a body, whose integrity a checksum header
// the server verifies carries instead: x-amz-checksum-crc32c, or
// Content-MD5 where the server takes no CRC32C), and x-amz-security-token
// for session credentials.
// Easy handles are pooled, so connections are kept alive and reused.
//
// Failures that may pass (HTTP 5xx, 429 and SlowDown, timeouts, stalls,
// connection resets, bodies shorter than announced) are retried with
// exponential backoff and full jitter, at most kMaxAttempts times and for at
// most config().retry_budget_ms in all (--request-timeout-s, default 60 s),
// the attempt in flight included; a server
// trickling bytes is cut off when the budget ends. A stall is no byte for
// 2 s in a ranged GET (the window doubles with each stall of the same GET,
// up to 15 s; 15 s for listings and HEADs), and its retry, like that of a
// broken connection, goes out on a new connection;
// then the request fails with IOError naming the key, the byte range and
// the cause. Others are answered at once:
// 403 → PermissionDenied (the message names the credentials' source),
// 404 → NotFound, 412 → Stale (the object changed since it was indexed;
// also a GET answered with another ETag, from a server ignoring If-Match),
// 301, 307 or 400 naming another region (x-amz-bucket-region) → sent again
// at once, signed for that region (and, on AWS's own endpoint, to that
// region's endpoint), which later requests use too.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"
#include "source/s3_config.h"
#include "source/s3_wire.h"

namespace ckptfs {

class S3Client {
 public:
  explicit S3Client(S3Config config);
  ~S3Client();
  S3Client(const S3Client&) = delete;
  S3Client& operator=(const S3Client&) = delete;

  const S3Config& config() const { return config_; }

  // Every object and common prefix directly under `prefix` (delimiter '/'),
  // all pages.
  Result<S3ListPage> List(const std::string& prefix) const;

  // HEAD of `key`.
  Result<S3ObjectInfo> Head(const std::string& key) const;

  // Bytes [offset, offset + len) of `key` into dst, with If-Match: `etag`
  // (none when empty). An object the server no longer has is Stale: it was
  // listed, so it was deleted since.
  Status Get(const std::string& key, const std::string& etag, uint64_t offset, uint64_t len, char* dst) const;

  // --- Uploads (the writer's side). Each is retried as a GET is (below);
  // an answer the server gave in full is not sent again.

  // CreateMultipartUpload of `key`, asking for CRC32C part checksums
  // (unless `ask_crc32c` is false: tests reach the Content-MD5 path so).
  // Returns the upload id and how parts are to be checked: kCrc32c when
  // the server named the algorithm back, else kMd5.
  Result<std::pair<std::string, S3PartCheck>> CreateMultipartUpload(const std::string& key,
                                                                    bool ask_crc32c = true) const;
  // UploadPart `number` (1..10000) of `body`, checked by `crc32c` (the
  // body's CRC32C) or by `md5_base64` as `check` says. Returns its ETag.
  Result<std::string> UploadPart(const std::string& key, const std::string& upload_id, int number, const S3Body& body,
                                 S3PartCheck check, uint32_t crc32c, const std::string& md5_base64) const;
  // CompleteMultipartUpload: `key` appears, whole, at once. `parts` in
  // ascending number. A completion whose answer was lost and is retried
  // finds the upload gone (NoSuchUpload): then the object is HEADed, and
  // an object of as many parts counts as completed.
  Status CompleteMultipartUpload(const std::string& key, const std::string& upload_id,
                                 const std::vector<S3CompletedPart>& parts, S3PartCheck check) const;
  // AbortMultipartUpload; an upload already gone (404) is OK.
  Status AbortMultipartUpload(const std::string& key, const std::string& upload_id) const;
  // Every multipart upload in progress under `prefix` (all pages).
  Result<std::vector<S3MultipartUploadInfo>> ListMultipartUploads(const std::string& prefix) const;
  // PutObject of a small object, with both Content-MD5 and
  // x-amz-checksum-crc32c (a server checks what it knows).
  Status Put(const std::string& key, const S3Body& body) const;
  // DeleteObject; a key that is not there is OK (S3 answers 204 either way).
  Status Delete(const std::string& key) const;

  // What a mount checks first: a wrong endpoint, secret or bucket, or
  // credentials that may list but not read, fail at once (no server at all
  // is not retried; a busy one is). Lists the prefix and HEADs its first key;
  // true when there is one.
  Result<bool> Probe(const std::string& prefix) const;

  // Ranged GETs answered in full so far, and their bytes (what a mount
  // fetched: logged when it ends, read by bench/bench_s3.py).
  struct Stats {
    uint64_t gets = 0;
    uint64_t bytes = 0;
    std::string Describe() const;  // "s3: 807 ranged GETs, 3.86 GB received"
  };
  Stats stats() const { return {gets_.load(), get_bytes_.load()}; }

  static constexpr int kMaxAttempts = 8;

  // One request and its answer (defined in the .cc).
  struct Request;
  struct Response;

 private:
  struct Handle;
  // One attempt: ended after `timeout_ms`, or once no byte came for
  // `stall_ms`; on a connection of its own when `fresh_connection`.
  Response Perform(const Request& r, int64_t timeout_ms, int64_t stall_ms, bool fresh_connection) const;
  Response PerformWithRetries(const Request& r, int max_attempts, bool retry_connect = true) const;
  // The region requests are signed for and the endpoint they go to: the
  // configured ones until a redirect names the bucket's region.
  std::pair<std::string, std::string> RegionAndEndpoint() const;
  // True when `resp` redirects to another region, now the one used.
  bool FollowRegion(const Response& resp) const;
  std::unique_ptr<Handle> Borrow() const;
  void Return(std::unique_ptr<Handle> h) const;
  Status Explain(const Request& r, const Response& resp) const;
  // What to do about libcurl error `curl` (a CURLcode), for Explain: ""
  // or "; ...".
  std::string Hint(int curl) const;
  Status CheckEtag(const Request& r, const Response& resp) const;

  S3Config config_;
  mutable std::mutex where_mu_;  // guards region_ and endpoint_
  mutable std::string region_;
  mutable std::string endpoint_;
  mutable std::atomic<uint64_t> gets_{0};
  mutable std::atomic<uint64_t> get_bytes_{0};
  mutable std::mutex mu_;  // guards pool_
  mutable std::vector<std::unique_ptr<Handle>> pool_;
};

}  // namespace ckptfs
