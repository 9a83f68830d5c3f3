// The S3 backend of source/source.h: a root `s3://BUCKET/PREFIX` whose
// "directories" are key prefixes up to '/' (ListObjectsV2 with a delimiter)
// and whose files are objects, read with ranged GETs (source/s3_client.h).
//
// Identity of an object: its size and ETag. SourceFile has no field for an
// ETag, so its 64-bit FNV-1a hash is kept in `inode` (never 0) and the
// Last-Modified time in mtime_ns (informative; not compared). An object is
// opened with a HEAD whose ETag must hash to the indexed one, and every GET
// of it carries If-Match on that ETag: bytes of two versions never mix, and
// an object overwritten after indexing fails its next read (412 → Stale).
//
// Read-ahead: a sequential reader's next parts are fetched ahead, whole
// --part-size parts --max-threads at a time, into memory (PartCache, keyed
// by key and ETag, so a part is only ever served to readers of its version);
// a read served from there waits for no round trip, and one inside a single
// part is handed to the reply where it lies, without a copy.
//
// Disk cache (--cache DIR): with one, every range fetched from the server
// goes through a DiskCache (source/disk_cache.h) keyed by endpoint, bucket,
// key, ETag and size, so a version's bytes fetched once, by this process or
// another sharing DIR, are read from local disk afterwards; each cached
// block is checked against its CRC32C and identity before it is served.
#pragma once

#include <memory>
#include <string>

#include "source/disk_cache.h"
#include "source/part_cache.h"
#include "source/s3_client.h"
#include "source/source.h"

namespace ckptfs {

class S3Source : public Source {
 public:
  // Resolves `config`'s client; Probe() says whether it can be reached.
  // Objects are read through `cache` when one is given.
  explicit S3Source(S3Config config, std::shared_ptr<DiskCache> cache = nullptr);

  // One request, no retries: a wrong endpoint, secret or bucket fails here
  // at once with a message saying what to fix. An empty prefix (no object
  // below it) is NotFound.
  Status Probe() const;

  const std::string& root() const override { return root_; }
  Result<SourceListing> List(const std::string& rel) const override;
  Result<SourceFile> Identify(const std::string& rel) const override;
  Result<std::unique_ptr<SourceObject>> Open(const std::string& rel) const override;
  // Pinned to the indexed ETag (SourceFile::version), no HEAD: a GET of an
  // object replaced since is answered 412, and the read fails Stale.
  // With a disk cache, Open (its blocks are served without a GET).
  Result<std::unique_ptr<SourceObject>> OpenIndexed(const SourceFile& indexed) const override;
  std::string DescribeChange(const SourceFile& indexed, const SourceFile& now) const override;
  bool Contains(const std::string& rel) const override;
  // Both are the object's Last-Modified (S3 has no ctime).
  std::optional<int64_t> ChangeTimeNs(const std::string& rel) const override;
  std::optional<int64_t> ModifyTimeNs(const std::string& rel) const override { return ChangeTimeNs(rel); }
  bool ReadsArePinned() const override { return true; }
  bool ListingsIdentify() const override { return true; }
  bool CachesReads() const override { return false; }
  // The client's part size and threads.
  std::optional<FetchShape> PreferredFetch() const override;
  // Requests and bytes fetched, and the disk cache's counts when there is one.
  std::vector<std::string> DescribeTraffic() const override;

  const S3Config& config() const { return client_->config(); }
  // What the client fetched so far.
  S3Client::Stats fetched() const { return client_->stats(); }
  // The disk cache objects are read through, or null.
  const std::shared_ptr<DiskCache>& disk_cache() const { return cache_; }

 private:
  std::string Key(const std::string& rel) const { return client_->config().location.prefix + rel; }
  // An object reading version `o` (o.etag) of its key.
  Result<std::unique_ptr<SourceObject>> Pin(S3ObjectInfo o) const;

  std::shared_ptr<S3Client> client_;
  std::string root_;
  // Read-ahead of sequential readers (SourceObject::Prefetch): whole parts
  // fetched --max-threads at a time, at most kReadAheadBytes held.
  std::shared_ptr<PartCache> parts_;
  std::shared_ptr<DiskCache> cache_;
};

inline constexpr uint64_t kReadAheadBytes = 256ull << 20;

// The identity value kept in SourceFile::inode for an ETag.
uint64_t EtagIdentity(const std::string& etag);

// What names one version of one object in the disk cache: endpoint, bucket,
// key, ETag and size, each field length-prefixed so that no two differ
// only in where one field ends.
std::string DiskCacheIdentity(const S3Config& config, const S3ObjectInfo& object);

}  // namespace ckptfs
