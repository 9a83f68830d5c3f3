#include "fs/source_tree.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <cstring>
#include <map>
#include <set>

namespace ckptfs {
namespace {

// glibc 2.36 has no openat2() wrapper.
int OpenAt2(int dirfd, const std::string& rel, uint64_t flags) {
  struct open_how how;
  std::memset(&how, 0, sizeof how);
  how.flags = flags | O_CLOEXEC;
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
  const char* path = rel.empty() ? "." : rel.c_str();
  int fd;
  do fd = static_cast<int>(::syscall(SYS_openat2, dirfd, path, &how, sizeof how));
  while (fd < 0 && errno == EINTR);
  return fd;
}

FsError Errno(const std::string& rel, int err) {
  // ELOOP/EXDEV: a symlink (or a path leaving the root) where a directory
  // or file was expected; to the caller it is simply not there.
  if (err == ELOOP || err == EXDEV) return FsError(ENOENT, rel + ": not a path inside the source root");
  return FsError(err, (rel.empty() ? std::string("source root") : rel) + ": " + std::strerror(err));
}

}  // namespace

FsResult<SourceTree> SourceTree::Open(const std::string& root) {
  int fd = ::open(root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return FsError(errno, root + ": " + std::strerror(errno));
  return SourceTree(root, fd);
}

SourceTree::SourceTree(SourceTree&& other) noexcept : root_(std::move(other.root_)), fd_(other.fd_) {
  other.fd_ = -1;
}

SourceTree::~SourceTree() {
  if (fd_ >= 0) ::close(fd_);
}

FsResult<int> SourceTree::OpenFile(const std::string& rel, int flags) const {
  int fd = OpenAt2(fd_, rel, flags);
  if (fd < 0) return Errno(rel, errno);
  return fd;
}

FsResult<int> SourceTree::OpenParent(const std::string& rel, std::string* name) const {
  size_t slash = rel.rfind('/');
  *name = slash == std::string::npos ? rel : rel.substr(slash + 1);
  const std::string parent = slash == std::string::npos ? "" : rel.substr(0, slash);
  int fd = OpenAt2(fd_, parent, O_PATH | O_DIRECTORY);
  if (fd < 0) return Errno(parent, errno);
  return fd;
}

FsResult<struct stat> SourceTree::Lstat(const std::string& rel) const {
  struct stat st;
  if (rel.empty()) {
    if (::fstat(fd_, &st) != 0) return Errno(rel, errno);
    return st;
  }
  std::string name;
  ASSIGN_OR_RETURN(int dir, OpenParent(rel, &name));
  int rc = ::fstatat(dir, name.c_str(), &st, AT_SYMLINK_NOFOLLOW);
  int err = errno;
  ::close(dir);
  if (rc != 0) return Errno(rel, err);
  return st;
}

FsResult<std::vector<std::string>> SourceTree::List(const std::string& rel) const {
  ASSIGN_OR_RETURN(int fd, OpenFile(rel, O_RDONLY | O_DIRECTORY));
  DIR* d = ::fdopendir(fd);
  if (!d) {
    int err = errno;
    ::close(fd);
    return Errno(rel, err);
  }
  std::vector<std::string> names;
  while (struct dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(std::move(name));
  }
  ::closedir(d);
  return names;
}

FsResult<std::string> SourceTree::ReadLink(const std::string& rel) const {
  std::string name;
  ASSIGN_OR_RETURN(int dir, OpenParent(rel, &name));
  char buf[PATH_MAX];
  ssize_t n = ::readlinkat(dir, name.c_str(), buf, sizeof buf);
  int err = errno;
  ::close(dir);
  if (n < 0) return Errno(rel, err == EINVAL ? EINVAL : err);
  return std::string(buf, n);
}

namespace {

// Read bits (0444) of the classes that `st` lets read (a file) or search (a directory).
uint32_t Grants(const struct stat& st) {
  const uint32_t bits = S_ISDIR(st.st_mode) ? (st.st_mode & 0111) << 2 : st.st_mode & 0444;
  return bits & 0444;
}

}  // namespace

ViewAccess AccessOf(const SourceTree& tree, const Checkpoint& ckpt) {
  ViewAccess a;
  std::set<uid_t> uids;
  std::set<gid_t> gids;
  std::map<std::string, uint32_t> dir_grants;  // each directory stated once
  auto fold = [&](const struct stat& st) {
    a.read_bits &= Grants(st);
    uids.insert(st.st_uid);
    gids.insert(st.st_gid);
  };
  for (const SourceFile& f : ckpt.files) {
    if (f.derived()) continue;  // its base file is folded in
    auto st = tree.Lstat(f.path);
    if (!st.ok()) return ViewAccess{0, 0, 0};
    fold(*st);
    for (size_t slash = f.path.rfind('/'); slash != std::string::npos && slash > ckpt.dir.size();
         slash = f.path.rfind('/', slash - 1)) {
      const std::string dir = f.path.substr(0, slash);
      if (auto it = dir_grants.find(dir); it != dir_grants.end()) {
        a.read_bits &= it->second;
        continue;
      }
      auto ds = tree.Lstat(dir);
      if (!ds.ok()) return ViewAccess{0, 0, 0};
      a.read_bits &= dir_grants[dir] = Grants(*ds);
    }
  }
  if (uids.size() == 1) a.uid = *uids.begin(); else a.read_bits &= ~0400u;
  if (gids.size() == 1) a.gid = *gids.begin(); else a.read_bits &= ~0040u;
  return a;
}

}  // namespace ckptfs
