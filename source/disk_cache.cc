#include "source/disk_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <optional>
#include <string_view>
#include <tuple>

#include "core/crc32c.h"
#include "source/posix_io.h"

namespace ckptfs {

// One Read: the range asked for and where it goes.
struct DiskCache::Want {
  const std::string& identity;
  std::string hash;  // the stem of its block files' names
  uint64_t size;     // of the object
  uint64_t offset, len;
  char* dst;
};

// A block file found by a scan.
struct DiskCache::Entry {
  int64_t mtime_ns;
  uint64_t bytes;  // as counted
  std::string name;
};

namespace {

constexpr char kMagic[8] = {'c', 'k', 'p', 't', 'f', 's', 'C', 'B'};
constexpr uint32_t kFormatVersion = 1;
constexpr size_t kFixedHeader = 40;
constexpr size_t kHeaderCrcAt = 36;
// Files are counted as the filesystem allocates them (ext4, xfs: 4 KiB).
constexpr uint64_t kAllocUnit = 4096;
// A temp file this old belongs to a process that died while writing it
// (writing one block takes milliseconds).
constexpr int64_t kStaleTempNs = 3600ll * 1'000'000'000;
constexpr char kTagName[] = "CACHEDIR.TAG";
// The first line is the standard CACHEDIR.TAG signature (bford.info/cachedir).
constexpr char kTag[] =
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file marks a ckptfs block cache (ckptfs --cache DIR). ckptfs deletes\n"
    "# only files under blocks/ named as it names them (docs/CLI.md).\n";
constexpr char kTagMark[] = "ckptfs block cache";
constexpr size_t kHashDigits = 32, kIndexDigits = 16;
constexpr size_t kBlockNameLen = kHashDigits + 1 + kIndexDigits + 4;  // H-I.blk

uint64_t RoundUp(uint64_t n, uint64_t unit) { return (n + unit - 1) / unit * unit; }

std::string Hex(uint64_t v, size_t digits) {
  static const char kDigits[] = "0123456789abcdef";
  std::string s(digits, '0');
  for (size_t i = digits; i-- > 0; v >>= 4) s[i] = kDigits[v & 15];
  return s;
}

uint64_t Fnv1a(const std::string& s, uint64_t h) {
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// 128 bits of hash, so that two versions sharing a name is rare; when they
// do, the identity in the header tells them apart.
std::string HashName(const std::string& identity) {
  return Hex(Fnv1a(identity, 14695981039346656037ull), 16) + Hex(Fnv1a(identity, 0x9e3779b97f4a7c15ull), 16);
}

std::string BlockName(const std::string& hash, uint64_t index) { return hash + "-" + Hex(index, kIndexDigits) + ".blk"; }

bool IsHex(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

bool IsBlockName(std::string_view n) {
  return n.size() == kBlockNameLen && IsHex(n.substr(0, kHashDigits)) && n[kHashDigits] == '-' &&
         IsHex(n.substr(kHashDigits + 1, kIndexDigits)) && n.ends_with(".blk");
}

// ".<block name>.<pid>.<n>.tmp"
bool IsTempName(std::string_view n) {
  if (n.size() < 1 + kBlockNameLen + 8 || n[0] != '.' || !n.ends_with(".tmp")) return false;
  if (!IsBlockName(n.substr(1, kBlockNameLen)) || n[1 + kBlockNameLen] != '.') return false;
  std::string_view rest = n.substr(2 + kBlockNameLen, n.size() - 2 - kBlockNameLen - 4);
  return !rest.empty() && std::count(rest.begin(), rest.end(), '.') == 1 &&
         std::all_of(rest.begin(), rest.end(), [](char c) { return (c >= '0' && c <= '9') || c == '.'; });
}

template <typename T>
void Put(std::string& s, size_t at, T v) {
  std::memcpy(s.data() + at, &v, sizeof v);
}

// The header a block file of these bytes starts with (format in the .h).
// A file is valid when its header equals the one its bytes call for.
std::string Header(const std::string& identity, uint64_t offset, uint64_t n, uint32_t data_crc) {
  std::string h(kFixedHeader, '\0');
  std::memcpy(h.data(), kMagic, sizeof kMagic);
  Put<uint32_t>(h, 8, kFormatVersion);
  Put<uint32_t>(h, 12, uint32_t(identity.size()));
  Put<uint64_t>(h, 16, offset);
  Put<uint64_t>(h, 24, n);
  Put<uint32_t>(h, 32, data_crc);
  Put<uint32_t>(h, kHeaderCrcAt, Crc32c(Crc32c(0, h.data(), kHeaderCrcAt), identity.data(), identity.size()));
  return h + identity;
}

bool WriteAll(int fd, const char* p, uint64_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= uint64_t(w);
  }
  return true;
}


// The first entry of `dir` other than . and .., or "".
std::string FirstEntry(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (!d) return "";
  std::string first;
  while (dirent* e = ::readdir(d)) {
    std::string_view n = e->d_name;
    if (n != "." && n != "..") {
      first = n;
      break;
    }
  }
  ::closedir(d);
  return first;
}

// Makes `dir` (locked by the caller) a ckptfs cache, or says why it cannot be one.
Status ClaimDir(const std::string& dir) {
  const std::string tag = dir + "/" + kTagName;
  struct stat st;
  if (::lstat(tag.c_str(), &st) == 0) {
    auto text = ReadWholeFile(tag);
    if (!S_ISREG(st.st_mode) || !text.ok() || text->find(kTagMark) == std::string::npos)
      return Status::InvalidArgument(dir + " is another program's cache (its CACHEDIR.TAG is not ckptfs's); give "
                                     "ckptfs a new or empty directory of its own");
  } else if (std::string first = FirstEntry(dir); !first.empty()) {
    return Status::InvalidArgument(dir + " is not empty and not a ckptfs cache (it holds '" + first +
                                   "'); give a new or empty directory (ckptfs shares no directory with files it "
                                   "did not write)");
  } else {
    ScopedFd fd(::open(tag.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
    if (fd.get() < 0 || !WriteAll(fd.get(), kTag, sizeof kTag - 1))
      return Status::IOError(tag + ": cannot write: " + std::strerror(errno));
  }
  // Cached bytes are the checkpoint's: readable by their owner only.
  const std::string blocks = dir + "/blocks";
  if (::mkdir(blocks.c_str(), 0700) != 0 && errno != EEXIST)
    return Status::IOError(blocks + ": cannot create: " + std::strerror(errno));
  return Status::OK();
}

// mu_ then the flock, released in reverse order.
class UsageLock {
 public:
  UsageLock(std::mutex& mu, int fd) : lock_(mu), fd_(fd) {
    int r;
    while ((r = ::flock(fd_, LOCK_EX)) != 0 && errno == EINTR) {
    }
    locked_ = r == 0;
  }
  ~UsageLock() {
    if (locked_) ::flock(fd_, LOCK_UN);
  }
  bool locked() const { return locked_; }

 private:
  std::unique_lock<std::mutex> lock_;
  int fd_;
  bool locked_ = false;
};

}  // namespace

std::string DiskCacheStats::Describe() const {
  return "disk cache: " + std::to_string(hits.load()) + " hits, " + std::to_string(misses.load()) + " misses, " +
         std::to_string(discarded.load()) + " discarded (corrupt, truncated or of another version), " +
         std::to_string(evicted.load()) + " evicted, " + std::to_string(not_stored.load()) +
         " not stored (no room or write failed)";
}

Result<std::shared_ptr<DiskCache>> DiskCache::Open(const std::string& dir, uint64_t max_bytes, uint64_t block_size) {
  if (block_size == 0 || max_bytes / 4 < block_size)
    return Status::InvalidArgument("a cache of " + std::to_string(max_bytes) + " bytes holds fewer than four " +
                                   std::to_string(block_size) + "-byte blocks; give a larger size (at least " +
                                   std::to_string(4 * block_size) + " bytes)");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IOError(dir + ": cannot create the cache directory: " + ec.message());
  ScopedFd dfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dfd.get() < 0) return Status::IOError(dir + ": " + std::strerror(errno));
  // Two processes opening a new DIR at once: one writes the tag, the other finds it.
  if (::flock(dfd.get(), LOCK_EX) != 0) return Status::IOError(dir + ": cannot lock: " + std::strerror(errno));
  RETURN_IF_ERROR(ClaimDir(dir));
  const std::string usage = dir + "/usage";
  int fd = ::open(usage.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return Status::IOError(usage + ": " + std::strerror(errno));
  std::shared_ptr<DiskCache> cache(new DiskCache(dir, max_bytes, block_size, fd));
  cache->Recount();  // also brings a cache opened with a smaller bound under it
  return cache;
}

DiskCache::DiskCache(std::string dir, uint64_t max_bytes, uint64_t block_size, int usage_fd)
    : dir_(std::move(dir)), blocks_(dir_ + "/blocks"), max_bytes_(max_bytes), block_size_(block_size),
      usage_fd_(usage_fd) {}

DiskCache::~DiskCache() { ::close(usage_fd_); }

std::string DiskCache::BlockPath(const std::string& identity, uint64_t index) const {
  return blocks_ + "/" + BlockName(HashName(identity), index);
}

Status DiskCache::Read(const std::string& identity, uint64_t size, uint64_t offset, uint64_t len, char* dst,
                       const Fetch& fetch) {
  if (len == 0) return Status::OK();
  if (offset > size || len > size - offset)
    return Status::InvalidArgument("disk cache: bytes [" + std::to_string(offset) + ", " +
                                   std::to_string(offset + len) + ") of a " + std::to_string(size) +
                                   "-byte object");
  const Want w{identity, HashName(identity), size, offset, len, dst};
  const uint64_t first = offset / block_size_, last = (offset + len - 1) / block_size_;
  uint64_t run = first;  // the first block of the current run of misses
  bool missing = false;
  for (uint64_t i = first; i <= last; ++i) {
    if (!Load(w, i)) {
      if (!missing) run = i, missing = true;
      continue;
    }
    if (missing) RETURN_IF_ERROR(FetchRun(w, run, i, fetch));
    missing = false;
  }
  if (missing) return FetchRun(w, run, last + 1, fetch);
  return Status::OK();
}

bool DiskCache::Load(const Want& w, uint64_t index) {
  const uint64_t begin = index * block_size_, n = std::min(block_size_, w.size - begin);
  const uint64_t from = std::max(begin, w.offset), to = std::min(begin + n, w.offset + w.len);
  const bool whole = from == begin && to == begin + n;
  std::unique_ptr<char[]> scratch;
  char* out = whole ? w.dst + (begin - w.offset) : (scratch = std::make_unique_for_overwrite<char[]>(n)).get();
  const std::string path = blocks_ + "/" + BlockName(w.hash, index);
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (fd.get() < 0) return false;  // not cached, or evicted by another process
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return false;
  std::string header(kFixedHeader + w.identity.size(), '\0');
  // A block is read whole and checked before any of it is served: into
  // dst only where dst wants all of it, which a bad block then leaves for
  // the fetch to overwrite.
  bool good = S_ISREG(st.st_mode) && uint64_t(st.st_size) == header.size() + n &&
              PreadFull(fd.get(), header.data(), header.size(), 0, path).ok() &&
              PreadFull(fd.get(), out, n, header.size(), path).ok() &&
              header == Header(w.identity, begin, n, Crc32c(0, out, n));
  if (!good) {
    Discard(path, st.st_ino, st.st_size);
    return false;
  }
  ::futimens(fd.get(), nullptr);  // just used: the last to be evicted
  if (!whole) std::memcpy(w.dst + (from - w.offset), out + (from - begin), to - from);
  ++stats_.hits;
  return true;
}

Status DiskCache::FetchRun(const Want& w, uint64_t first, uint64_t end, const Fetch& fetch) {
  const uint64_t begin = first * block_size_, stop = std::min(w.size, end * block_size_);
  // Straight into dst when it wants every byte of the run.
  const bool inside = begin >= w.offset && stop <= w.offset + w.len;
  std::unique_ptr<char[]> buf;
  char* out = inside ? w.dst + (begin - w.offset) : (buf = std::make_unique_for_overwrite<char[]>(stop - begin)).get();
  RETURN_IF_ERROR(fetch(begin, stop - begin, out));
  if (!inside) {
    const uint64_t from = std::max(begin, w.offset), to = std::min(stop, w.offset + w.len);
    std::memcpy(w.dst + (from - w.offset), out + (from - begin), to - from);
  }
  stats_.misses += end - first;
  for (uint64_t i = first; i < end; ++i) {
    const uint64_t at = i * block_size_;
    Store(w, i, out + (at - begin), std::min(block_size_, stop - at));
  }
  return Status::OK();
}

void DiskCache::Store(const Want& w, uint64_t index, const char* bytes, uint64_t n) {
  if (w.identity.size() > kMaxIdentity) {
    ++stats_.not_stored;
    return;
  }
  const std::string name = BlockName(w.hash, index);
  const std::string tmp = blocks_ + "/." + name + "." + std::to_string(::getpid()) + "." +
                          std::to_string(temp_counter_.fetch_add(1)) + ".tmp";
  const std::string header = Header(w.identity, index * block_size_, n, Crc32c(0, bytes, n));
  const uint64_t need = RoundUp(header.size() + n, kAllocUnit);
  const int fd = Reserve(need, tmp);
  if (fd < 0) {
    ++stats_.not_stored;
    return;
  }
  bool ok = WriteAll(fd, header.data(), header.size()) && WriteAll(fd, bytes, n);
  ok = ::close(fd) == 0 && ok;
  // No fsync: a block cut short by a crash fails its checks and is refetched.
  if (ok && ::rename(tmp.c_str(), (blocks_ + "/" + name).c_str()) == 0) return;
  ::unlink(tmp.c_str());
  Release(need);
  ++stats_.not_stored;
}

void DiskCache::Discard(const std::string& path, uint64_t ino, uint64_t size) {
  struct stat now;
  // Only the file judged bad: another process may have renamed a good one into its place since.
  if (::lstat(path.c_str(), &now) != 0 || now.st_ino != ino || ::unlink(path.c_str()) != 0) return;
  ++stats_.discarded;
  Release(RoundUp(size, kAllocUnit));
}

int DiskCache::Reserve(uint64_t bytes, const std::string& tmp) {
  UsageLock lock(mu_, usage_fd_);
  if (!lock.locked()) return -1;
  std::optional<uint64_t> used = ReadUsage();
  if (!used || *used + bytes > max_bytes_) used = Evict(bytes);
  if (*used + bytes > max_bytes_) return -1;
  // Created under the lock, so an eviction's count from now on includes it.
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd >= 0) WriteUsage(*used + bytes);
  return fd;
}

void DiskCache::Release(uint64_t bytes) {
  UsageLock lock(mu_, usage_fd_);
  if (!lock.locked()) return;
  std::optional<uint64_t> used = ReadUsage();
  if (!used) {
    Evict(0);
    return;
  }
  WriteUsage(*used - std::min(*used, bytes));
}

uint64_t DiskCache::Recount() {
  UsageLock lock(mu_, usage_fd_);
  if (lock.locked()) return Evict(0);
  uint64_t total = 0;
  Scan(&total);
  return total;
}

std::optional<uint64_t> DiskCache::ReadUsage() {
  char buf[32];
  ssize_t n = ::pread(usage_fd_, buf, sizeof buf, 0);
  if (n <= 1 || buf[n - 1] != '\n') return std::nullopt;  // new, or cut short by a crash
  uint64_t v = 0;
  for (ssize_t i = 0; i < n - 1; ++i) {
    if (buf[i] < '0' || buf[i] > '9') return std::nullopt;
    v = v * 10 + uint64_t(buf[i] - '0');
  }
  return v;
}

void DiskCache::WriteUsage(uint64_t bytes) {
  const std::string text = std::to_string(bytes) + "\n";
  // A short or failed write reads back as unknown, which a recount repairs.
  if (::ftruncate(usage_fd_, 0) != 0) return;
  [[maybe_unused]] ssize_t n = ::pwrite(usage_fd_, text.data(), text.size(), 0);
}

uint64_t DiskCache::Evict(uint64_t need) {
  uint64_t total = 0;
  std::vector<Entry> entries = Scan(&total);
  if (total + need > max_bytes_) {
    const uint64_t target = max_bytes_ - max_bytes_ / 8;
    std::sort(entries.begin(), entries.end(),
              [](const Entry& a, const Entry& b) { return std::tie(a.mtime_ns, a.name) < std::tie(b.mtime_ns, b.name); });
    for (const Entry& e : entries) {
      if (total + need <= target) break;
      if (::unlink((blocks_ + "/" + e.name).c_str()) == 0)
        ++stats_.evicted;
      else if (errno != ENOENT)
        continue;  // still there: still counted
      total -= e.bytes;
    }
  }
  WriteUsage(total);
  return total;
}

std::vector<DiskCache::Entry> DiskCache::Scan(uint64_t* total) {
  std::vector<Entry> entries;
  *total = 0;
  DIR* d = ::opendir(blocks_.c_str());
  if (!d) return entries;
  const int64_t now = WallClockNs();
  // A block being written counts as a full one (its writer reserved that much).
  const uint64_t in_flight = RoundUp(kFixedHeader + kMaxIdentity + block_size_, kAllocUnit);
  while (dirent* e = ::readdir(d)) {
    const std::string_view name = e->d_name;
    const bool block = IsBlockName(name);
    if (!block && !IsTempName(name)) continue;  // not ours: neither counted nor touched
    struct stat st;
    if (::fstatat(::dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) continue;
    const int64_t mtime = int64_t(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec;
    if (block) {
      entries.push_back({mtime, RoundUp(uint64_t(st.st_size), kAllocUnit), std::string(name)});
      *total += entries.back().bytes;
    } else if (now - mtime > kStaleTempNs) {
      ::unlinkat(::dirfd(d), e->d_name, 0);
    } else {
      *total += in_flight;
    }
  }
  ::closedir(d);
  return entries;
}

}  // namespace ckptfs
