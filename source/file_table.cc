#include "source/file_table.h"

#include <sys/stat.h>

#include <climits>
#include <cstdlib>
#include <cerrno>
#include <cstring>

namespace ckptfs {

SourceFile IdentityOf(const struct stat& st) {
  SourceFile f;
  f.size = st.st_size;
  f.mtime_ns = int64_t(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec;
  f.ctime_ns = int64_t(st.st_ctim.tv_sec) * 1'000'000'000 + st.st_ctim.tv_nsec;
  f.inode = st.st_ino;
  return f;
}

Result<SourceFile> StatSource(const std::string& abs) {
  struct stat st;
  if (::stat(abs.c_str(), &st) != 0)
    return Status::IOError(abs + ": " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return Status::InvalidArgument(abs + ": not a regular file");
  return IdentityOf(st);
}

std::string DescribeChange(const SourceFile& a, const SourceFile& b) {
  if (a.size != b.size)
    return "size changed from " + std::to_string(a.size) + " to " + std::to_string(b.size);
  if (a.inode != b.inode) return "replaced (inode changed)";
  if (a.mtime_ns != b.mtime_ns) return "modified (mtime changed)";
  if (a.ctime_ns != b.ctime_ns) return "modified (ctime changed: rewritten, or its mtime set back)";
  return "";
}

bool InsideRoot(const std::string& root, const std::string& rel) {
  char real[PATH_MAX];
  const std::string abs = root + "/" + rel;
  if (!::realpath(abs.c_str(), real)) return false;
  const std::string r = real;
  return r.size() > root.size() && r.compare(0, root.size(), root) == 0 && r[root.size()] == '/';
}

Result<FileId> FileTable::Add(const std::string& rel) {
  if (auto it = by_path_.find(rel); it != by_path_.end()) return it->second;
  // A symlink may point anywhere; only files inside the root are sources,
  // so a mount never serves bytes from outside what it was given.
  if (!InsideRoot(root_, rel))
    return Status::InvalidArgument(rel + ": resolves outside the source root (a symlink?); not used");
  ASSIGN_OR_RETURN(SourceFile f, StatSource(root_ + "/" + rel));
  f.path = rel;
  FileId id = files_.size();
  files_.push_back(std::move(f));
  by_path_[rel] = id;
  return id;
}

FileId FileTable::AddDerived(FileId base, uint64_t offset, uint64_t length, const std::string& transform,
                             uint64_t decoded_size) {
  SourceFile f = files_.at(base);
  f.path += "@" + std::to_string(offset);
  f.size = decoded_size;
  f.transform = transform;
  f.base = base;
  f.base_offset = offset;
  f.base_length = length;
  FileId id = files_.size();
  files_.push_back(std::move(f));
  return id;
}

}  // namespace ckptfs
