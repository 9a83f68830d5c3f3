#include "fs/source_tree.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <map>
#include <mutex>
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

// A POSIX directory, every path resolved beneath a descriptor of the root.
class PosixTree : public SourceTree {
 public:
  PosixTree(std::shared_ptr<const Source> source, int fd) : SourceTree(std::move(source)), fd_(fd) {}
  ~PosixTree() override { ::close(fd_); }
  PosixTree(const PosixTree&) = delete;
  PosixTree& operator=(const PosixTree&) = delete;

  bool watchable() const override { return true; }
  FsResult<std::unique_ptr<TreeFile>> OpenFile(const std::string& rel) const override;
  FsResult<struct stat> Lstat(const std::string& rel) const override;
  FsResult<std::vector<std::string>> List(const std::string& rel) const override;
  FsResult<std::string> ReadLink(const std::string& rel) const override;

 private:
  FsResult<int> OpenAt(const std::string& rel, int flags) const;
  // A descriptor of the directory holding rel's last component, and that name.
  FsResult<int> OpenParent(const std::string& rel, std::string* name) const;

  int fd_;
};

class FdFile : public TreeFile {
 public:
  FdFile(int fd, std::string rel) : fd_(fd), rel_(std::move(rel)) {}
  ~FdFile() override { ::close(fd_); }
  FdFile(const FdFile&) = delete;
  FdFile& operator=(const FdFile&) = delete;

  FsResult<size_t> Read(char* buf, size_t size, uint64_t offset) const override {
    size_t done = 0;
    while (done < size) {
      ssize_t r = ::pread(fd_, buf + done, size - done, offset + done);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) return FsError(errno, rel_ + ": " + std::strerror(errno));
      if (r == 0) break;
      done += r;
    }
    return done;
  }

 private:
  int fd_;
  std::string rel_;
};

FsResult<int> PosixTree::OpenAt(const std::string& rel, int flags) const {
  int fd = OpenAt2(fd_, rel, flags);
  if (fd < 0) return Errno(rel, errno);
  return fd;
}

FsResult<std::unique_ptr<TreeFile>> PosixTree::OpenFile(const std::string& rel) const {
  ASSIGN_OR_RETURN(int fd, OpenAt(rel, O_RDONLY));
  return std::unique_ptr<TreeFile>(std::make_unique<FdFile>(fd, rel));
}

FsResult<int> PosixTree::OpenParent(const std::string& rel, std::string* name) const {
  size_t slash = rel.rfind('/');
  *name = slash == std::string::npos ? rel : rel.substr(slash + 1);
  const std::string parent = slash == std::string::npos ? "" : rel.substr(0, slash);
  int fd = OpenAt2(fd_, parent, O_PATH | O_DIRECTORY);
  if (fd < 0) return Errno(parent, errno);
  return fd;
}

FsResult<struct stat> PosixTree::Lstat(const std::string& rel) const {
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

FsResult<std::vector<std::string>> PosixTree::List(const std::string& rel) const {
  ASSIGN_OR_RETURN(int fd, OpenAt(rel, O_RDONLY | O_DIRECTORY));
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

FsResult<std::string> PosixTree::ReadLink(const std::string& rel) const {
  std::string name;
  ASSIGN_OR_RETURN(int dir, OpenParent(rel, &name));
  char buf[PATH_MAX];
  ssize_t n = ::readlinkat(dir, name.c_str(), buf, sizeof buf);
  int err = errno;
  ::close(dir);
  if (n < 0) return Errno(rel, err == EINVAL ? EINVAL : err);
  return std::string(buf, n);
}

// Any other Source: directories are its listings, each kept kListingTtl so
// that the lookups following a readdir cost no request.
class ListedTree : public SourceTree {
 public:
  explicit ListedTree(std::shared_ptr<const Source> source) : SourceTree(std::move(source)) {}

  bool watchable() const override { return false; }
  FsResult<std::unique_ptr<TreeFile>> OpenFile(const std::string& rel) const override;
  FsResult<struct stat> Lstat(const std::string& rel) const override;
  FsResult<std::vector<std::string>> List(const std::string& rel) const override;
  FsResult<std::string> ReadLink(const std::string& rel) const override {
    return FsError(EINVAL, rel + " is not a symlink");
  }

 private:
  static constexpr auto kListingTtl = std::chrono::seconds(1);
  FsResult<std::shared_ptr<const SourceListing>> Listing(const std::string& rel) const;

  mutable std::mutex mu_;
  mutable std::map<std::string, std::pair<std::shared_ptr<const SourceListing>, std::chrono::steady_clock::time_point>>
      cache_;
};

// A source object read as a file: reads stop at its end.
class ObjectFile : public TreeFile {
 public:
  ObjectFile(std::unique_ptr<SourceObject> object, uint64_t size, std::string rel)
      : object_(std::move(object)), size_(size), rel_(std::move(rel)) {}

  FsResult<size_t> Read(char* buf, size_t size, uint64_t offset) const override {
    if (offset >= size_) return size_t(0);
    const uint64_t n = std::min<uint64_t>(size, size_ - offset);
    Status st = object_->ReadAt(offset, n, buf);
    if (!st.ok()) return FsError::From(st);
    return size_t(n);
  }

 private:
  std::unique_ptr<SourceObject> object_;
  uint64_t size_;
  std::string rel_;
};

FsResult<std::shared_ptr<const SourceListing>> ListedTree::Listing(const std::string& rel) const {
  const auto now = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = cache_.find(rel); it != cache_.end() && now - it->second.second < kListingTtl)
      return it->second.first;
  }
  auto listed = source()->List(rel);
  if (!listed.ok()) return FsError::From(listed.status());
  auto shared = std::make_shared<const SourceListing>(std::move(*listed));
  std::lock_guard<std::mutex> lock(mu_);
  if (cache_.size() > 4096) cache_.clear();  // a bound, not a policy: entries live a second
  // Kept from when the listing ended: one of 10^5 keys takes 100 pages and
  // longer than the TTL, and stamped with its start it was stale on arrival,
  // so each lookup of its entries listed the whole prefix again.
  cache_[rel] = {shared, std::chrono::steady_clock::now()};
  return shared;
}

FsResult<struct stat> ListedTree::Lstat(const std::string& rel) const {
  struct stat st {};
  st.st_uid = ::getuid();
  st.st_gid = ::getgid();
  st.st_nlink = 1;
  st.st_mode = S_IFDIR | 0555;
  if (rel.empty()) return st;
  const size_t slash = rel.rfind('/');
  const std::string parent = slash == std::string::npos ? "" : rel.substr(0, slash);
  const std::string name = rel.substr(slash == std::string::npos ? 0 : slash + 1);
  ASSIGN_OR_RETURN(std::shared_ptr<const SourceListing> l, Listing(parent));
  if (std::binary_search(l->dirs.begin(), l->dirs.end(), name)) return st;
  auto it = l->known.find(name);
  if (it == l->known.end()) return FsError(ENOENT, rel + ": no such file or directory");
  st.st_mode = S_IFREG | 0444;
  st.st_size = off_t(it->second.size);
  st.st_mtim.tv_sec = it->second.mtime_ns / 1'000'000'000;
  st.st_mtim.tv_nsec = it->second.mtime_ns % 1'000'000'000;
  st.st_ctim = st.st_mtim;
  return st;
}

FsResult<std::vector<std::string>> ListedTree::List(const std::string& rel) const {
  ASSIGN_OR_RETURN(std::shared_ptr<const SourceListing> l, Listing(rel));
  std::vector<std::string> names = l->files;
  names.insert(names.end(), l->dirs.begin(), l->dirs.end());
  return names;
}

FsResult<std::unique_ptr<TreeFile>> ListedTree::OpenFile(const std::string& rel) const {
  auto object = source()->Open(rel);
  if (!object.ok()) return FsError::From(object.status());
  auto id = (*object)->Identity();
  if (!id.ok()) return FsError::From(id.status());
  return std::unique_ptr<TreeFile>(std::make_unique<ObjectFile>(std::move(*object), id->size, rel));
}

}  // namespace

FsResult<std::unique_ptr<SourceTree>> SourceTree::Open(std::shared_ptr<const Source> source) {
  const std::string local = source->LocalPath("");
  if (local.empty()) return std::unique_ptr<SourceTree>(std::make_unique<ListedTree>(std::move(source)));
  int fd = ::open(local.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return FsError(errno, local + ": " + std::strerror(errno));
  return std::unique_ptr<SourceTree>(std::make_unique<PosixTree>(std::move(source), fd));
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
