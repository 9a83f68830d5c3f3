// The table of source files an index refers to, with the identity (size,
// mtime, inode) each had when indexed. FileId is the position in the table.
#pragma once

#include <sys/stat.h>

#include <map>
#include <string>
#include <vector>

#include "core/meta.h"
#include "core/status.h"

namespace ckptfs {

class FileTable {
 public:
  explicit FileTable(std::string root) : root_(std::move(root)) {}

  // Stats root/rel and registers it (once). Fails when it is not a regular file.
  Result<FileId> Add(const std::string& rel);
  // Registers the decoded bytes of [offset, offset + length) of `base`.
  FileId AddDerived(FileId base, uint64_t offset, uint64_t length, const std::string& transform,
                    uint64_t decoded_size);

  const std::string& root() const { return root_; }
  std::string Abs(FileId id) const { return root_ + "/" + files_.at(id).path; }
  const SourceFile& at(FileId id) const { return files_.at(id); }
  std::vector<SourceFile> Take() { return std::move(files_); }

 private:
  std::string root_;
  std::vector<SourceFile> files_;
  std::map<std::string, FileId> by_path_;
};

// The identity (size, mtime, ctime, inode) of a stat result, path left empty.
SourceFile IdentityOf(const struct stat& st);

// Stats `abs` into a SourceFile identity (path left empty).
Result<SourceFile> StatSource(const std::string& abs);

// True when root/rel, all symlinks resolved, is strictly inside `root`
// (which must itself be a resolved absolute path).
bool InsideRoot(const std::string& root, const std::string& rel);

// "" when `now` matches what was indexed, else what changed.
std::string DescribeChange(const SourceFile& indexed, const SourceFile& now);

}  // namespace ckptfs
