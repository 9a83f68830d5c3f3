// SourceTree: the daemon's only way into the source tree it mirrors.
//
// The daemon often runs as root and serves other users (`--allow-other`), so
// a path it resolves must never leave the root: every operation resolves
// `rel` beneath a descriptor of the root with openat2(RESOLVE_BENEATH |
// RESOLVE_NO_SYMLINKS). A symlink is never followed by the daemon: it is
// shown as a symlink and the kernel follows it for the caller, with the
// caller's own permissions. A directory swapped for a symlink between a
// lookup and an open fails (ELOOP/EXDEV) instead of being followed.
#pragma once

#include <sys/stat.h>

#include <string>
#include <vector>

#include "core/meta.h"
#include "fs/fs_error.h"

namespace ckptfs {

class SourceTree {
 public:
  // Opens `root` (an absolute, resolved path). Fails when it is not a directory.
  static FsResult<SourceTree> Open(const std::string& root);
  SourceTree(SourceTree&& other) noexcept;
  SourceTree& operator=(SourceTree&&) = delete;
  SourceTree(const SourceTree&) = delete;
  ~SourceTree();

  const std::string& root() const { return root_; }

  // open(2) of root/rel ("" = the root) with `flags` (O_CLOEXEC added);
  // never follows a symlink on the way or at the end.
  FsResult<int> OpenFile(const std::string& rel, int flags) const;
  // lstat(2) of root/rel: a symlink is reported as one.
  FsResult<struct stat> Lstat(const std::string& rel) const;
  // Names in directory root/rel, without "." and "..", unsorted.
  FsResult<std::vector<std::string>> List(const std::string& rel) const;
  // The target text of symlink root/rel.
  FsResult<std::string> ReadLink(const std::string& rel) const;

 private:
  SourceTree(std::string root, int fd) : root_(std::move(root)), fd_(fd) {}
  // A descriptor of the directory holding rel's last component, and that name.
  FsResult<int> OpenParent(const std::string& rel, std::string* name) const;

  std::string root_;
  int fd_ = -1;
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
