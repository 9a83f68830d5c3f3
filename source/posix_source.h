// The POSIX backend of source/source.h: a directory tree on a local or
// network filesystem, read with pread.
//
// Identity of a file: size, mtime, ctime and inode, except on filesystems
// that may give a file a new inode number while it is unchanged (FUSE
// filesystems such as s3fs and gcsfuse number inodes per lookup; CIFS
// without serverino; 9p): there the inode is recorded as 0 and never
// compared, and a change is seen by size, mtime and ctime (docs/SEMANTICS.md).
#pragma once

#include <sys/stat.h>

#include <memory>
#include <string>

#include "source/source.h"

namespace ckptfs {

class PosixSource : public Source {
 public:
  // `root` must be a directory; it is resolved (realpath) first.
  static Result<std::shared_ptr<PosixSource>> OpenRoot(const std::string& root);
  // Over `abs_root` taken as it is (absolute and resolved).
  explicit PosixSource(std::string abs_root) : root_(std::move(abs_root)) {}

  const std::string& root() const override { return root_; }
  Result<SourceListing> List(const std::string& rel) const override;
  Result<SourceFile> Identify(const std::string& rel) const override;
  Result<std::unique_ptr<SourceObject>> Open(const std::string& rel) const override;
  std::string DescribeChange(const SourceFile& indexed, const SourceFile& now) const override;
  bool Contains(const std::string& rel) const override;
  std::optional<int64_t> ChangeTimeNs(const std::string& rel) const override;
  std::optional<int64_t> ModifyTimeNs(const std::string& rel) const override;
  std::string DirKey(const std::string& rel) const override;
  std::string LocalPath(const std::string& rel) const override { return Abs(rel); }
  bool PinsRanges() const override { return true; }

  std::string Abs(const std::string& rel) const { return rel.empty() ? root_ : root_ + "/" + rel; }

 private:
  std::string root_;
};

// A SourceObject over descriptor `fd`, which it does not own; errors name
// `what`.
class FdObject : public SourceObject {
 public:
  FdObject(int fd, std::string what) : fd_(fd), what_(std::move(what)) {}
  Status ReadAt(uint64_t offset, uint64_t len, char* dst) const override;
  Result<SourceFile> Identity() const override;

 private:
  int fd_;
  std::string what_;
};

// A Source over `root` taken as it is (absolute and resolved: a root read
// back from a store, say), for callers that hold only a path.
std::shared_ptr<PosixSource> PosixSourceAt(const std::string& abs_root);

// True when files on a filesystem of this statfs f_type may change inode
// number without changing (see the header comment).
bool RenumbersInodes(long f_type);

// The identity of a stat result, path left empty; the inode is 0 when
// `inode_stable` is false.
SourceFile IdentityOf(const struct stat& st, bool inode_stable);

// Stats `abs` into a SourceFile identity (path left empty), the inode
// left out where its filesystem renumbers inodes.
Result<SourceFile> StatSource(const std::string& abs);

// True when root/rel, all symlinks resolved, is strictly inside `root`
// (which must itself be a resolved absolute path).
bool InsideRoot(const std::string& root, const std::string& rel);

// "" when `now` matches what was indexed, else what changed. An inode of 0
// on either side (a filesystem that renumbers inodes) is not compared.
std::string DescribeChange(const SourceFile& indexed, const SourceFile& now);

}  // namespace ckptfs
