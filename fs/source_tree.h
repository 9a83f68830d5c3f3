// SourceTree: the daemon's only way into the source tree it mirrors: the
// directories and files of the root shown as they are, next to the views.
//
// Two kinds, chosen by the root's Source (source/source.h):
//  - a POSIX directory. The daemon often runs as root and serves other users
//    (`--allow-other`), so a path it resolves must never leave the root:
//    every operation resolves `rel` beneath a descriptor of the root with
//    openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS). A symlink is never
//    followed by the daemon: it is shown as a symlink and the kernel follows
//    it for the caller, with the caller's own permissions. A directory
//    swapped for a symlink between a lookup and an open fails (ELOOP/EXDEV)
//    instead of being followed.
//  - any other Source (object storage): directories are its listings, kept
//    for a second so that a `ls -l` costs one listing, not a request per
//    name; files are read through its objects. Entries are owned by the
//    mounting user, files 0444 and directories 0555 (as mountpoint-s3 shows
//    a bucket); there are no links.
#pragma once

#include <sys/stat.h>

#include <memory>
#include <string>
#include <vector>

#include "core/meta.h"
#include "fs/fs_error.h"
#include "source/source.h"

namespace ckptfs {

// A source file opened through the tree (shown as it is, not a view).
class TreeFile {
 public:
  virtual ~TreeFile() = default;
  // Up to `size` bytes at `offset`; fewer only at the end of the file.
  virtual FsResult<size_t> Read(char* buf, size_t size, uint64_t offset) const = 0;
};

class SourceTree {
 public:
  // The tree of `source`'s root. Fails when the root is not a directory.
  static FsResult<std::unique_ptr<SourceTree>> Open(std::shared_ptr<const Source> source);
  virtual ~SourceTree() = default;

  const std::string& root() const { return source_->root(); }
  // What the read path of the views reads through.
  const std::shared_ptr<const Source>& source() const { return source_; }
  // True when root() + "/" + rel names a local directory that inotify can watch.
  virtual bool watchable() const = 0;

  // Opens regular file root/rel for reading; never follows a symlink.
  virtual FsResult<std::unique_ptr<TreeFile>> OpenFile(const std::string& rel) const = 0;
  // lstat(2) of root/rel: a symlink is reported as one.
  virtual FsResult<struct stat> Lstat(const std::string& rel) const = 0;
  // Names in directory root/rel, without "." and "..", unsorted.
  virtual FsResult<std::vector<std::string>> List(const std::string& rel) const = 0;
  // The target text of symlink root/rel.
  virtual FsResult<std::string> ReadLink(const std::string& rel) const = 0;

 protected:
  explicit SourceTree(std::shared_ptr<const Source> source) : source_(std::move(source)) {}

 private:
  std::shared_ptr<const Source> source_;
};

// Who may read a checkpoint's virtual files: at most what every source they
// are built from grants. A class (owner, group, other) keeps its read bit
// only when every source file grants it and every directory between the
// checkpoint and the file grants search; owner and group are kept only when
// all sources share them (otherwise the class is dropped, and root owns the
// views). With `default_permissions` the kernel enforces it, so
// `--allow-other` never shows a user bytes the sources would refuse them.
struct ViewAccess {
  uid_t uid = 0;
  gid_t gid = 0;
  uint32_t read_bits = 0444;  // a subset of 0444
  uint32_t file_mode() const { return S_IFREG | read_bits; }
  uint32_t dir_mode() const { return S_IFDIR | read_bits | (read_bits >> 2); }
};

// Stats every source of `ckpt` now (a source that cannot be stated grants nothing).
ViewAccess AccessOf(const SourceTree& tree, const Checkpoint& ckpt);

}  // namespace ckptfs
