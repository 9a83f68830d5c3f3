#include "source/posix_source.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "source/posix_io.h"

namespace ckptfs {
namespace {

// statfs f_type values (linux/magic.h, and CIFS's own headers).
constexpr long kFuseMagic = 0x65735546;  // every FUSE filesystem: s3fs, gcsfuse, sshfs ...
constexpr long kCifsMagic = 0xFF534D42;  // cifs mounted without serverino numbers inodes itself
constexpr long kSmb2Magic = 0xFE534D42;
constexpr long kV9fsMagic = 0x01021997;  // 9p: inode numbers are hashed qid paths, may collide or change

// Whether inodes of the filesystem holding a stat result are stable, from
// fstatfs/statfs of the same file, cached per device: one statfs per
// filesystem, not per check.
bool InodeStable(dev_t dev, const std::function<int(struct statfs*)>& do_statfs) {
  static std::mutex mu;
  static std::map<dev_t, bool> stable;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = stable.find(dev); it != stable.end()) return it->second;
  }
  struct statfs fs;
  // Unknown: the inode stays in the identity, as it always did.
  if (do_statfs(&fs) != 0) return true;
  const bool ok = !RenumbersInodes(long(fs.f_type));
  std::lock_guard<std::mutex> lock(mu);
  stable[dev] = ok;
  return ok;
}

// Bytes per sendfile() of Prefetch: the kernel reads ahead of each in large
// folios; one call per 512 KiB keeps a cancelled prefetch quick to stop.
constexpr uint64_t kPrefetchStep = 512 << 10;

// Whether mincore() tells us which pages of the file open on `fd` are
// cached: only for a file the caller owns or may open for writing (or as
// root); for any other it answers "all cached" (mm/mincore.c,
// can_do_mincore), and CachedPrefix would never see a cold page.
bool MincoreTells(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return false;
  if (::geteuid() == 0 || st.st_uid == ::geteuid()) return true;
  return ::faccessat(AT_FDCWD, ("/proc/self/fd/" + std::to_string(fd)).c_str(), W_OK, AT_EACCESS) == 0;
}

// A second descriptor of the file open on `fd`, with O_DIRECT, or -1 when
// it is read buffered: its filesystem reports no STATX_DIOALIGN (tmpfs,
// FUSE and most network filesystems) or an alignment above kDirectAlign,
// mincore() would not say which of its pages are cached (MincoreTells), or
// the open is refused. Opened through /proc/self/fd, so it is the same
// open file whatever its path names now.
int OpenDirect(int fd) {
  if (!MincoreTells(fd)) return -1;
  struct statx sx;
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) != 0) return -1;
  if (!(sx.stx_mask & STATX_DIOALIGN) || sx.stx_dio_offset_align == 0 ||
      sx.stx_dio_offset_align > kDirectAlign || sx.stx_dio_mem_align > kDirectAlign)
    return -1;
  return ::open(("/proc/self/fd/" + std::to_string(fd)).c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
}

// Bytes of [offset, offset + len) in the page cache from its start: up to
// the first page that is not, by mincore() over a mapping of the range.
// Not preadv2(RWF_NOWAIT): on a page not cached it starts the kernel's
// read-ahead before answering EAGAIN, which would read the cold range into
// the page cache as well as into our buffer. 0 when the range cannot be
// mapped (then it is read with O_DIRECT, which is correct either way).
uint64_t CachedPrefix(int fd, uint64_t offset, uint64_t len) {
  static const uint64_t page = uint64_t(::sysconf(_SC_PAGESIZE));
  const AlignedSpan span = AlignSpan(offset, len, page);
  void* map = ::mmap(nullptr, span.length, PROT_READ, MAP_SHARED, fd, off_t(span.start));
  if (map == MAP_FAILED) return 0;
  std::vector<unsigned char> resident(span.length / page);
  const int rc = ::mincore(map, span.length, resident.data());
  ::munmap(map, span.length);
  if (rc != 0) return 0;
  size_t pages = 0;
  while (pages < resident.size() && (resident[pages] & 1)) ++pages;
  return std::min(len, pages * page > span.skip ? pages * page - span.skip : 0);
}

// A range pinned under a read lease (PosixObject::Pin). Leases belong to an
// open file description, so each pin has a descriptor of its own and pins
// of one file never end each other's lease. Closing it ends the lease.
class LeasedRange : public PinnedRange {
 public:
  explicit LeasedRange(int fd) { fd_ = fd; }
  ~LeasedRange() override {
    if (map_) ::munmap(map_, length_);
    ::close(fd_);
  }
  LeasedRange(const LeasedRange&) = delete;
  LeasedRange& operator=(const LeasedRange&) = delete;
  // The mapping of the range (unmapped with this); `data`: its first byte.
  void Keep(void* map, size_t length, const char* data) {
    map_ = map;
    length_ = length;
    data_ = data;
  }

 private:
  void* map_ = nullptr;
  size_t length_ = 0;
};

// Reads [from, end) of the file with O_DIRECT on `dfd` into `base`, which
// holds the file from byte `start` (both aligned), starting at the aligned
// offset at or below `from`. A tail left unaligned by a short read (the end
// of the file) is read buffered on `fd`, which reports the short file.
Status PreadDirect(int dfd, int fd, char* base, uint64_t start, uint64_t from, uint64_t end,
                   const std::string& what) {
  uint64_t pos = AlignDown(from, kDirectAlign);
  const uint64_t stop = AlignUp(end, kDirectAlign);
  while (pos < end) {
    if (pos % kDirectAlign != 0) return PreadFull(fd, base + (pos - start), end - pos, pos, what);
    ssize_t n = ::pread(dfd, base + (pos - start), stop - pos, off_t(pos));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      return Status::IOError(what + ": direct read at " + std::to_string(pos) + ": " + std::strerror(errno));
    if (n == 0) return Status::Corruption(what + ": unexpected end of file at byte " + std::to_string(pos));
    pos += n;
  }
  return Status::OK();
}

// A source file open for reading: buffered preads on `fd_`, and O_DIRECT
// reads of cold ranges on a second descriptor opened on first use.
class PosixObject : public SourceObject {
 public:
  PosixObject(int fd, std::string abs) : fd_(fd), abs_(std::move(abs)) {}
  ~PosixObject() override;

  Status ReadAt(uint64_t offset, uint64_t len, char* dst) const override;
  Result<FilledRange> ReadFilled(uint64_t offset, uint64_t len, DirectIo* direct) const override;
  Status ReadAtVia(uint64_t offset, uint64_t len, char* dst, DirectIo* direct) const override;
  Result<uint64_t> ReadOnce(uint64_t offset, uint64_t len, char* dst) const override;
  Result<SourceFile> Identity() const override;
  Result<std::unique_ptr<PinnedRange>> Pin(uint64_t offset, uint64_t len) const override;
  void WillNeed(uint64_t offset, uint64_t len) const override;
  void Prefetch(uint64_t offset, uint64_t len, const std::function<bool()>& go_on) const override;
  Result<std::unique_ptr<SourceObject>> Reopen() const override;

 private:
  // The O_DIRECT descriptor, opened on first use (-1: this file is read
  // buffered; see OpenDirect, counted in `stats` when given).
  int DirectFd(DirectStats* stats) const;
  Result<FilledRange> Buffered(uint64_t offset, uint64_t len, DirectIo* direct) const;

  int fd_;
  std::string abs_;
  mutable std::once_flag direct_once_;
  mutable std::once_flag random_once_;  // ReadOnce turns off the kernel's read-ahead
  mutable int direct_fd_ = -1;  // set once, under direct_once_
};

PosixObject::~PosixObject() {
  ::close(fd_);
  if (direct_fd_ >= 0) ::close(direct_fd_);
}

Status PosixObject::ReadAt(uint64_t offset, uint64_t len, char* dst) const {
  return PreadFull(fd_, dst, len, offset, abs_);
}

Result<FilledRange> PosixObject::ReadFilled(uint64_t offset, uint64_t len, DirectIo* direct) const {
  if (!direct || len == 0 || DirectFd(&direct->stats()) < 0) return Buffered(offset, len, direct);
  const AlignedSpan span = AlignSpan(offset, len);
  std::optional<Buffer> pooled = direct->pool().TryTake(span.length);
  if (!pooled) {
    direct->stats().pool_full.fetch_add(1, std::memory_order_relaxed);
    return Buffered(offset, len, direct);
  }
  FilledRange out;
  out.buffer = std::move(*pooled);
  char* at = out.buffer.data() + span.skip;
  out.data = at;
  const uint64_t cached = CachedPrefix(fd_, offset, len);
  RETURN_IF_ERROR(PreadFull(fd_, at, cached, offset, abs_));
  DirectStats& stats = direct->stats();
  stats.cached_bytes.fetch_add(cached, std::memory_order_relaxed);
  if (cached == len) return out;
  RETURN_IF_ERROR(PreadDirect(direct_fd_, fd_, out.buffer.data(), span.start, offset + cached, offset + len, abs_));
  stats.direct_reads.fetch_add(1, std::memory_order_relaxed);
  stats.direct_bytes.fetch_add(len - cached, std::memory_order_relaxed);
  return out;
}

Status PosixObject::ReadAtVia(uint64_t offset, uint64_t len, char* dst, DirectIo* direct) const {
  if (!direct || len == 0 || DirectFd(&direct->stats()) < 0) {
    if (direct) direct->stats().buffered_bytes.fetch_add(len, std::memory_order_relaxed);
    return ReadAt(offset, len, dst);
  }
  // Cached bytes go straight to `dst`; only the cold rest needs a buffer.
  const uint64_t cached = CachedPrefix(fd_, offset, len);
  RETURN_IF_ERROR(PreadFull(fd_, dst, cached, offset, abs_));
  direct->stats().cached_bytes.fetch_add(cached, std::memory_order_relaxed);
  if (cached == len) return Status::OK();
  ASSIGN_OR_RETURN(FilledRange rest, ReadFilled(offset + cached, len - cached, direct));
  std::memcpy(dst + cached, rest.data, len - cached);
  return Status::OK();
}

// The cached prefix through the page cache, the rest with O_DIRECT
// straight into the caller's memory (the contract lets it overwrite the
// aligned span around the range).
Result<uint64_t> PosixObject::ReadOnce(uint64_t offset, uint64_t len, char* dst) const {
  if (len == 0 || DirectFd(nullptr) < 0) {
    RETURN_IF_ERROR(ReadAt(offset, len, dst));
    return uint64_t(0);
  }
  // From the first such range on, this file's cold ranges are read with
  // O_DIRECT: the kernel's read-ahead after a buffered read of it (a
  // cached prefix here, a reader's request elsewhere) would read them again
  // into the page cache, racing the direct reads. Reads of the buffered
  // descriptor read what they ask for from here on.
  std::call_once(random_once_, [this] { ::posix_fadvise(fd_, 0, 0, POSIX_FADV_RANDOM); });
  const uint64_t cached = CachedPrefix(fd_, offset, len);
  RETURN_IF_ERROR(PreadFull(fd_, dst, cached, offset, abs_));
  if (cached == len) return uint64_t(0);
  const uint64_t start = AlignDown(offset, kDirectAlign);
  RETURN_IF_ERROR(PreadDirect(direct_fd_, fd_, dst - (offset - start), start, offset + cached, offset + len, abs_));
  return len - cached;
}

// A read lease: the kernel grants it only while no one has the file open
// for writing (shared writable mappings included), and while it is held a
// writer's open or truncate waits for its release (or, at worst, for
// /proc/sys/fs/lease-break-time, 45 s by default, against the milliseconds
// a pin is held). The lease is taken on a second open of the same file
// (through /proc/self/fd: whatever the path names now), then the range is
// mapped under it, not read in: the pin's user splices its pages from the
// page cache (PinnedRange::fd), and reads through the mapping fault in only
// what they copy. A writer asking meanwhile is signalled to us as SIGURG,
// ignored unless a handler is installed, where the default SIGIO would end
// the process. Anything refused (not the file's owner and no CAP_LEASE, a
// network filesystem, a writer, a file shorter than the range) is
// NotSupported: the caller reads the range with ReadAt, which reports a
// real problem.
Result<std::unique_ptr<PinnedRange>> PosixObject::Pin(uint64_t offset, uint64_t len) const {
  if (len == 0) return Status::NotSupported(abs_ + ": an empty range is not pinned");
  const int fd = ::open(("/proc/self/fd/" + std::to_string(fd_)).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::NotSupported(abs_ + ": cannot open it again: " + std::strerror(errno));
  auto pin = std::make_unique<LeasedRange>(fd);  // from here on, returning ends the lease
  if (::fcntl(fd, F_SETSIG, SIGURG) != 0 || ::fcntl(fd, F_SETLEASE, F_RDLCK) != 0)
    return Status::NotSupported(abs_ + ": no read lease: " + std::strerror(errno));
  // Its size cannot change under the lease; a page past the end would fault.
  struct stat st;
  if (::fstat(fd, &st) != 0 || uint64_t(st.st_size) < offset + len)
    return Status::NotSupported(abs_ + ": the range ends past the end of the file");
  static const uint64_t page = uint64_t(::sysconf(_SC_PAGESIZE));
  const AlignedSpan span = AlignSpan(offset, len, page);
  void* map = ::mmap(nullptr, span.length, PROT_READ, MAP_SHARED, fd, off_t(span.start));
  if (map == MAP_FAILED) return Status::NotSupported(abs_ + ": cannot map it: " + std::strerror(errno));
  pin->Keep(map, span.length, static_cast<const char*>(map) + span.skip);
  return std::unique_ptr<PinnedRange>(std::move(pin));
}

Result<SourceFile> PosixObject::Identity() const {
  struct stat st;
  if (::fstat(fd_, &st) != 0) return Status::IOError(abs_ + ": " + std::strerror(errno));
  return IdentityOf(st, InodeStable(st.st_dev, [&](struct statfs* fs) { return ::fstatfs(fd_, fs); }));
}

void PosixObject::WillNeed(uint64_t offset, uint64_t len) const {
  ::posix_fadvise(fd_, off_t(offset), off_t(len), POSIX_FADV_WILLNEED);
}

// sendfile() into /dev/null: the kernel's own sequential read-ahead fills
// the page cache in large folios and nothing is copied. WILLNEED
// allocates the cache in 4 KiB folios and cost the daemon about twice the
// CPU per byte (docs/BENCHMARKS.md).
// /dev/null is opened per call (a few microseconds next to the I/O), so
// read-ahead holds no descriptor beyond its bound between calls.
void PosixObject::Prefetch(uint64_t offset, uint64_t len, const std::function<bool()>& go_on) const {
  ScopedFd null(::open("/dev/null", O_WRONLY | O_CLOEXEC));
  if (null.get() < 0) return;
  off_t at = off_t(offset);
  const off_t end = off_t(offset + len);
  while (at < end && go_on()) {
    ssize_t n = ::sendfile(null.get(), fd_, &at, size_t(std::min<off_t>(end - at, kPrefetchStep)));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // end of a truncated file, or an error the read will meet
  }
}

// A second descriptor by path, refused unless it is the same file as
// this one (same device and, where stable, inode; same size and times).
Result<std::unique_ptr<SourceObject>> PosixObject::Reopen() const {
  int fd = ::open(abs_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::IOError(abs_ + ": " + std::strerror(errno));
  auto second = std::make_unique<PosixObject>(fd, abs_);
  struct stat a, b;
  if (::fstat(fd_, &a) != 0 || ::fstat(fd, &b) != 0 || a.st_dev != b.st_dev)
    return Status::Stale(abs_ + ": no longer the file that was opened");
  ASSIGN_OR_RETURN(SourceFile mine, Identity());
  ASSIGN_OR_RETURN(SourceFile theirs, second->Identity());
  if (!ckptfs::DescribeChange(mine, theirs).empty())
    return Status::Stale(abs_ + ": no longer the file that was opened");
  return std::unique_ptr<SourceObject>(std::move(second));
}

int PosixObject::DirectFd(DirectStats* stats) const {
  std::call_once(direct_once_, [&] {
    direct_fd_ = OpenDirect(fd_);
    if (direct_fd_ < 0 && stats) stats->refused_files.fetch_add(1, std::memory_order_relaxed);
  });
  return direct_fd_;
}

Result<FilledRange> PosixObject::Buffered(uint64_t offset, uint64_t len, DirectIo* direct) const {
  if (direct) direct->stats().buffered_bytes.fetch_add(len, std::memory_order_relaxed);
  return SourceObject::ReadFilled(offset, len, direct);
}

int64_t Ns(const struct timespec& t) { return int64_t(t.tv_sec) * 1'000'000'000 + t.tv_nsec; }

}  // namespace

Status FdObject::ReadAt(uint64_t offset, uint64_t len, char* dst) const {
  return PreadFull(fd_, dst, len, offset, what_);
}

Result<SourceFile> FdObject::Identity() const {
  struct stat st;
  if (::fstat(fd_, &st) != 0) return Status::IOError(what_ + ": " + std::strerror(errno));
  return IdentityOf(st, InodeStable(st.st_dev, [&](struct statfs* fs) { return ::fstatfs(fd_, fs); }));
}

bool RenumbersInodes(long f_type) {
  const uint32_t t = uint32_t(f_type);
  return t == uint32_t(kFuseMagic) || t == uint32_t(kCifsMagic) || t == uint32_t(kSmb2Magic) ||
         t == uint32_t(kV9fsMagic);
}

SourceFile IdentityOf(const struct stat& st, bool inode_stable) {
  SourceFile f;
  f.size = st.st_size;
  f.mtime_ns = Ns(st.st_mtim);
  f.ctime_ns = Ns(st.st_ctim);
  f.inode = inode_stable ? st.st_ino : 0;
  return f;
}

Result<SourceFile> StatSource(const std::string& abs) {
  struct stat st;
  if (::stat(abs.c_str(), &st) != 0)
    return errno == ENOENT || errno == ENOTDIR ? Status::NotFound(abs + ": " + std::strerror(errno))
                                               : Status::IOError(abs + ": " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return Status::InvalidArgument(abs + ": not a regular file");
  return IdentityOf(st, InodeStable(st.st_dev, [&](struct statfs* fs) { return ::statfs(abs.c_str(), fs); }));
}

std::string DescribeChange(const SourceFile& a, const SourceFile& b) {
  if (a.size != b.size)
    return "size changed from " + std::to_string(a.size) + " to " + std::to_string(b.size);
  if (a.inode != 0 && b.inode != 0 && a.inode != b.inode) return "replaced (inode changed)";
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

Result<std::shared_ptr<PosixSource>> PosixSource::OpenRoot(const std::string& root) {
  char real[PATH_MAX];
  if (!::realpath(root.c_str(), real))
    return Status::IOError(root + (errno == ENOENT ? ": not a directory: it does not exist"
                                                   : ": not a directory (" + std::string(std::strerror(errno)) + ")"));
  struct stat st;
  if (::stat(real, &st) != 0 || !S_ISDIR(st.st_mode)) return Status::InvalidArgument(root + ": not a directory");
  return std::make_shared<PosixSource>(real);
}

std::shared_ptr<PosixSource> PosixSourceAt(const std::string& abs_root) {
  return std::make_shared<PosixSource>(abs_root);
}

Result<SourceListing> PosixSource::List(const std::string& rel) const {
  const std::string abs = Abs(rel);
  DIR* dir = ::opendir(abs.c_str());
  if (!dir) return Status::IOError(abs + ": " + std::strerror(errno));
  SourceListing d;
  while (struct dirent* e = ::readdir(dir)) {
    std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    // A symlinked directory is never walked: inside the root it is indexed
    // once under its target's name (and the mount shows the link, which the
    // kernel follows to the same views); outside the root it is not ours to
    // serve. A symlinked file is listed; FileTable refuses one that resolves
    // outside the root.
    struct stat st;
    if (::lstat((abs + "/" + name).c_str(), &st) != 0) continue;
    if (S_ISDIR(st.st_mode)) d.dirs.push_back(name);
    else if (S_ISREG(st.st_mode)) d.files.push_back(name);
    else if (S_ISLNK(st.st_mode) && ::stat((abs + "/" + name).c_str(), &st) == 0) {
      if (S_ISREG(st.st_mode)) d.files.push_back(name);
      else if (S_ISDIR(st.st_mode)) d.linked_dirs.push_back(name);
    }
  }
  ::closedir(dir);
  std::sort(d.files.begin(), d.files.end());
  std::sort(d.dirs.begin(), d.dirs.end());
  std::sort(d.linked_dirs.begin(), d.linked_dirs.end());
  return d;
}

Result<SourceFile> PosixSource::Identify(const std::string& rel) const { return StatSource(Abs(rel)); }

Result<std::unique_ptr<SourceObject>> PosixSource::Open(const std::string& rel) const {
  const std::string abs = Abs(rel);
  int fd = ::open(abs.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return errno == ENOENT || errno == ENOTDIR ? Status::NotFound(abs + ": " + std::strerror(errno))
                                               : Status::IOError(abs + ": " + std::strerror(errno));
  return std::unique_ptr<SourceObject>(std::make_unique<PosixObject>(fd, abs));
}

std::string PosixSource::DescribeChange(const SourceFile& indexed, const SourceFile& now) const {
  return ckptfs::DescribeChange(indexed, now);
}

bool PosixSource::Contains(const std::string& rel) const { return InsideRoot(root_, rel); }

std::optional<int64_t> PosixSource::ChangeTimeNs(const std::string& rel) const {
  struct stat st;
  if (::lstat(Abs(rel).c_str(), &st) != 0) return std::nullopt;
  return Ns(st.st_ctim);
}

std::optional<int64_t> PosixSource::ModifyTimeNs(const std::string& rel) const {
  struct stat st;
  if (::lstat(Abs(rel).c_str(), &st) != 0) return std::nullopt;
  return Ns(st.st_mtim);
}

std::string PosixSource::DirKey(const std::string& rel) const {
  struct stat st;
  if (::stat(Abs(rel).c_str(), &st) != 0) return "?" + rel;
  return std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
}

}  // namespace ckptfs
