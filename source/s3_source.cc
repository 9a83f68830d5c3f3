#include "source/s3_source.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

namespace ckptfs {
namespace {

SourceFile IdentityOf(const S3ObjectInfo& o) {
  SourceFile f;
  f.size = o.size;
  f.mtime_ns = o.last_modified_ns;
  f.inode = EtagIdentity(o.etag);
  return f;
}

// One object, pinned to the ETag it had when opened.
class S3Object : public SourceObject {
 public:
  S3Object(std::shared_ptr<S3Client> client, std::shared_ptr<PartCache> parts, S3ObjectInfo info)
      : client_(std::move(client)), parts_(std::move(parts)), info_(std::move(info)) {}

  // Fetches of whole parts queued, not waited for: the reader's next
  // requests find them cached or in flight (PartCache::Copy).
  void Prefetch(uint64_t offset, uint64_t len, const std::function<bool()>& go_on) const override {
    if (!go_on()) return;
    std::shared_ptr<S3Client> client = client_;
    const std::string key = info_.key, etag = info_.etag;
    parts_->Prefetch(Version(), info_.size, offset, len,
                     [client, key, etag](const std::string&, uint64_t at, uint64_t n, char* out) {
                       return client->Get(key, etag, at, n, out);
                     });
  }

  Result<std::unique_ptr<SourceObject>> Reopen() const override {
    return std::unique_ptr<SourceObject>(std::make_unique<S3Object>(client_, parts_, info_));
  }

  // Ranges longer than --part-size go out as parts, up to --max-threads
  // in flight; the first failure is the answer.
  Status ReadAt(uint64_t offset, uint64_t len, char* dst) const override {
    if (offset > info_.size || len > info_.size - offset)
      return Status::Corruption(client_->config().Root() + "/" + Rel() + ": unexpected end of file at byte " +
                                std::to_string(std::min(info_.size, offset + len)));
    if (parts_->Copy(Version(), offset, len, dst)) return Status::OK();
    const uint64_t part = client_->config().part_size;
    const uint64_t parts = (len + part - 1) / part;
    if (parts <= 1) return client_->Get(info_.key, info_.etag, offset, len, dst);
    std::atomic<uint64_t> next{0};
    std::vector<Status> errors(parts);
    auto work = [&] {
      for (uint64_t p; (p = next.fetch_add(1)) < parts;) {
        const uint64_t at = p * part, n = std::min(part, len - at);
        errors[p] = client_->Get(info_.key, info_.etag, offset + at, n, dst + at);
      }
    };
    const unsigned threads = unsigned(std::min<uint64_t>(parts, client_->config().max_threads));
    std::vector<std::thread> pool;
    for (unsigned t = 1; t < threads; ++t) pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
    for (const Status& s : errors)
      if (!s.ok()) return s;
    return Status::OK();
  }

  Result<SourceFile> Identity() const override { return IdentityOf(info_); }

 private:
  std::string Rel() const { return info_.key.substr(client_->config().location.prefix.size()); }
  // Names this version of the object in the part cache.
  std::string Version() const { return info_.key + '\0' + info_.etag; }

  std::shared_ptr<S3Client> client_;
  std::shared_ptr<PartCache> parts_;
  S3ObjectInfo info_;
};

}  // namespace

uint64_t EtagIdentity(const std::string& etag) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a: stable across runs and builds
  for (unsigned char c : etag)
    if (c != '"') h = (h ^ c) * 1099511628211ull;
  return h ? h : 1;
}

S3Source::S3Source(S3Config config)
    : client_(std::make_shared<S3Client>(std::move(config))),
      root_(client_->config().Root()),
      parts_(std::make_shared<PartCache>(kReadAheadBytes, client_->config().part_size, client_->config().max_threads)) {}

Status S3Source::Probe() const {
  RETURN_IF_ERROR(client_->Probe(client_->config().location.prefix));
  ASSIGN_OR_RETURN(SourceListing l, List(""));
  if (l.files.empty() && l.dirs.empty())
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
  return std::unique_ptr<SourceObject>(std::make_unique<S3Object>(client_, parts_, std::move(o)));
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

}  // namespace ckptfs
