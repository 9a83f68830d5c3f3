#include "source/s3_source.h"

#include <algorithm>
#include <functional>
#include <vector>

#include "source/in_parallel.h"

namespace ckptfs {
namespace {

SourceFile IdentityOf(const S3ObjectInfo& o) {
  SourceFile f;
  f.size = o.size;
  // S3 has no ctime: Last-Modified stands for both (as ChangeTimeNs says).
  f.mtime_ns = o.last_modified_ns;
  f.ctime_ns = o.last_modified_ns;
  f.inode = EtagIdentity(o.etag);
  f.version = o.etag;
  return f;
}

// How one version of one object is fetched: from the server with If-Match
// on its ETag, through the disk cache when there is one. Shared by an
// object and the prefetches it queued, which may outlive it.
struct PinnedObject {
  std::shared_ptr<S3Client> client;
  std::shared_ptr<DiskCache> cache;
  S3ObjectInfo info;
  std::string cache_id;  // DiskCacheIdentity, when cached

  Status Get(uint64_t at, uint64_t n, char* out) const {
    if (!cache) return client->Get(info.key, info.etag, at, n, out);
    return cache->Read(cache_id, info.size, at, n, out,
                       [this](uint64_t a, uint64_t m, char* o) { return client->Get(info.key, info.etag, a, m, o); });
  }
};

// One object, pinned to the ETag it had when opened.
class S3Object : public SourceObject {
 public:
  S3Object(std::shared_ptr<const PinnedObject> pinned, std::shared_ptr<PartCache> parts)
      : pinned_(std::move(pinned)), parts_(std::move(parts)) {}

  // Fetches of whole parts queued, not waited for: the reader's next
  // requests find them cached or in flight (PartCache::Share, PartCache::Copy).
  void Prefetch(uint64_t offset, uint64_t len, const std::function<bool()>& go_on) const override {
    if (!go_on()) return;
    std::shared_ptr<const PinnedObject> pinned = pinned_;
    parts_->Prefetch(Version(), info().size, offset, len,
                     [pinned](const std::string&, uint64_t at, uint64_t n, char* out) { return pinned->Get(at, n, out); });
  }

  Result<std::unique_ptr<SourceObject>> Reopen() const override {
    return std::unique_ptr<SourceObject>(std::make_unique<S3Object>(pinned_, parts_));
  }

  // A range inside one part fetched ahead is handed out where it lies in
  // the part, not copied (PartCache::Share); any other as ReadAt reads it.
  Result<FilledRange> ReadFilled(uint64_t offset, uint64_t len, DirectIo* direct) const override {
    if (offset <= info().size && len <= info().size - offset) {
      if (auto shared = parts_->Share(Version(), offset, len)) {
        FilledRange f;
        f.shared = std::move(shared->holder);
        f.data = shared->data;
        return f;
      }
    }
    return SourceObject::ReadFilled(offset, len, direct);
  }

  // Ranges longer than --part-size go out as parts, up to --max-threads
  // in flight; the first failure is the answer.
  Status ReadAt(uint64_t offset, uint64_t len, char* dst) const override {
    if (offset > info().size || len > info().size - offset)
      return Status::Corruption(config().Root() + "/" + Rel() + ": unexpected end of file at byte " +
                                std::to_string(std::min(info().size, offset + len)));
    if (parts_->Copy(Version(), offset, len, dst)) return Status::OK();
    const std::vector<uint64_t> cuts = Cuts(offset, len);
    const uint64_t parts = cuts.size() - 1;
    if (parts <= 1) return pinned_->Get(offset, len, dst);
    return InParallel(parts, config().max_threads, [&](size_t p) {
      return pinned_->Get(offset + cuts[p], cuts[p + 1] - cuts[p], dst + cuts[p]);
    });
  }

  // Up to --max-threads ranges in flight (each as ReadAt reads it).
  Status ReadRanges(const std::vector<std::pair<uint64_t, uint64_t>>& ranges,
                    std::vector<std::string>* out) const override {
    out->assign(ranges.size(), std::string());
    for (size_t i = 0; i < ranges.size(); ++i) (*out)[i].resize(ranges[i].second);
    return InParallel(ranges.size(), config().max_threads,
                      [&](size_t i) { return ReadAt(ranges[i].first, ranges[i].second, (*out)[i].data()); });
  }

  Result<SourceFile> Identity() const override { return IdentityOf(info()); }

 private:
  const S3ObjectInfo& info() const { return pinned_->info; }
  const S3Config& config() const { return pinned_->client->config(); }
  std::string Rel() const { return info().key.substr(config().location.prefix.size()); }
  // Names this version of the object in the part cache.
  std::string Version() const { return info().key + '\0' + info().etag; }

  // Where the parts of [offset, offset + len) begin, relative to offset,
  // then len. With a disk cache parts begin at multiples of the part size
  // (rounded up to whole cache blocks) in the object, so no two parts
  // fetch the same block.
  std::vector<uint64_t> Cuts(uint64_t offset, uint64_t len) const {
    uint64_t step = config().part_size;
    std::vector<uint64_t> cuts{0};
    if (const DiskCache* cache = pinned_->cache.get()) {
      const uint64_t block = cache->block_size();
      step = (step + block - 1) / block * block;
      for (uint64_t at = (offset / step + 1) * step; at < offset + len; at += step) cuts.push_back(at - offset);
    } else {
      for (uint64_t at = step; at < len; at += step) cuts.push_back(at);
    }
    cuts.push_back(len);
    return cuts;
  }

  std::shared_ptr<const PinnedObject> pinned_;
  std::shared_ptr<PartCache> parts_;
};

}  // namespace

uint64_t EtagIdentity(const std::string& etag) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a: stable across runs and builds
  for (unsigned char c : etag)
    if (c != '"') h = (h ^ c) * 1099511628211ull;
  return h ? h : 1;
}

std::string DiskCacheIdentity(const S3Config& config, const S3ObjectInfo& object) {
  auto field = [](const std::string& s) { return std::to_string(s.size()) + ":" + s; };
  return "s3 " + field(config.endpoint) + field(config.location.bucket) + field(object.key) + field(object.etag) +
         std::to_string(object.size);
}

S3Source::S3Source(S3Config config, std::shared_ptr<DiskCache> cache)
    : client_(std::make_shared<S3Client>(std::move(config))),
      root_(client_->config().Root()),
      parts_(std::make_shared<PartCache>(kReadAheadBytes, client_->config().part_size, client_->config().max_threads)),
      cache_(std::move(cache)) {}

Status S3Source::Probe() const {
  ASSIGN_OR_RETURN(bool any, client_->Probe(client_->config().location.prefix));
  if (!any)
    return Status::NotFound(root_ + ": no object under this prefix at " + client_->config().endpoint +
                            "; check the prefix (keys are case-sensitive)");
  return Status::OK();
}

Result<SourceListing> S3Source::List(const std::string& rel) const {
  const std::string prefix = rel.empty() ? Key("") : Key(rel) + "/";
  ASSIGN_OR_RETURN(S3ListPage page, client_->List(prefix));
  SourceListing l;
  for (const S3ObjectInfo& o : page.objects) {
    std::string name = o.key.substr(prefix.size());
    // "dir/" placeholder objects some tools write are not files.
    if (name.empty() || name.find('/') != std::string::npos) continue;
    l.known[name] = IdentityOf(o);
    l.files.push_back(std::move(name));
  }
  for (const std::string& p : page.common_prefixes) {
    std::string name = p.substr(prefix.size());
    if (name.ends_with('/')) name.pop_back();
    if (!name.empty() && name != "." && name != "..") l.dirs.push_back(std::move(name));
  }
  std::sort(l.files.begin(), l.files.end());
  std::sort(l.dirs.begin(), l.dirs.end());
  return l;
}

Result<SourceFile> S3Source::Identify(const std::string& rel) const {
  ASSIGN_OR_RETURN(S3ObjectInfo o, client_->Head(Key(rel)));
  return IdentityOf(o);
}

Result<std::unique_ptr<SourceObject>> S3Source::Open(const std::string& rel) const {
  ASSIGN_OR_RETURN(S3ObjectInfo o, client_->Head(Key(rel)));
  return Pin(std::move(o));
}

Result<std::unique_ptr<SourceObject>> S3Source::OpenIndexed(const SourceFile& indexed) const {
  // A version that is not the ETag the identity was taken from (a store
  // row written by hand) is not trusted: the object is asked for its own.
  // Nor is one read through the disk cache, whose blocks are served
  // without a GET to catch a replaced object: the HEAD at open does.
  if (cache_ || indexed.derived() || indexed.version.empty() || EtagIdentity(indexed.version) != indexed.inode)
    return Open(indexed.path);
  S3ObjectInfo o;
  o.key = Key(indexed.path);
  o.size = indexed.size;
  o.etag = indexed.version;
  o.last_modified_ns = indexed.mtime_ns;
  return Pin(std::move(o));
}

Result<std::unique_ptr<SourceObject>> S3Source::Pin(S3ObjectInfo o) const {
  auto pinned = std::make_shared<PinnedObject>();
  pinned->client = client_;
  pinned->cache = cache_;
  if (cache_) pinned->cache_id = DiskCacheIdentity(client_->config(), o);
  pinned->info = std::move(o);
  return std::unique_ptr<SourceObject>(std::make_unique<S3Object>(std::move(pinned), parts_));
}

std::string S3Source::DescribeChange(const SourceFile& a, const SourceFile& b) const {
  if (a.size != b.size) return "size changed from " + std::to_string(a.size) + " to " + std::to_string(b.size);
  if (a.inode != b.inode) return "replaced (ETag changed)";
  return "";
}

bool S3Source::Contains(const std::string& rel) const {
  // Keys have no links; only a path that climbs out is refused.
  return rel != ".." && !rel.starts_with("../") && rel.find("/../") == std::string::npos && !rel.ends_with("/..");
}

std::optional<int64_t> S3Source::ChangeTimeNs(const std::string& rel) const {
  auto o = client_->Head(Key(rel));
  if (!o.ok()) return std::nullopt;
  return o->last_modified_ns;
}

std::optional<Source::FetchShape> S3Source::PreferredFetch() const {
  return FetchShape{config().part_size, config().max_threads};
}

std::vector<std::string> S3Source::DescribeTraffic() const {
  const S3Client::Stats stats = fetched();
  // The exact byte count too, for comparing with per-checkpoint counts.
  std::vector<std::string> lines = {stats.Describe(), "s3: " + std::to_string(stats.bytes) + " bytes received"};
  if (cache_) lines.push_back(cache_->stats().Describe());
  return lines;
}

}  // namespace ckptfs
