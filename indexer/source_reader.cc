#include "indexer/source_reader.h"

#include <fcntl.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "core/convert.h"
#include "indexer/checksums.h"
#include "indexer/file_table.h"
#include "indexer/posix_io.h"
#include "indexer/transform.h"

namespace ckptfs {
namespace {

// Bytes per posix_fadvise(WILLNEED). One call reads at most
// max(read_ahead_kb, max_sectors_kb) of the source's device (4 MiB and
// 8 MiB on the benchmark disk; commonly 512 KiB or more); on a device with
// less, part of each piece is not read ahead (a loss of speed only).
constexpr uint64_t kHintChunk = 512 << 10;

// Read-ahead is planned and hinted this much of the virtual file at a time,
// in file order (one FUSE request's worth).
constexpr uint64_t kHintSlice = 1 << 20;

}  // namespace

SourceReader::SourceReader(std::string root, const std::vector<SourceFile>* files, GroupPolicy policy,
                           uint64_t decoded_cache_bytes, ReadOptions read)
    : root_(std::move(root)),
      files_(files),
      policy_(policy),
      fds_(files->size(), -1),
      stale_(files->size()),
      bytes_read_(std::make_unique<std::atomic<uint64_t>>(0)),
      any_stale_(std::make_unique<std::atomic<bool>>(false)),
      decoded_budget_(decoded_cache_bytes),
      read_(read) {}

Result<std::shared_ptr<const std::string>> SourceReader::Decoded(FileId id) {
  {
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (auto it = cache_.find(id); it != cache_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second.second);
      return it->second.first;
    }
  }
  const SourceFile& f = (*files_)[id];
  ASSIGN_OR_RETURN(int fd, Fd(f.base));
  ASSIGN_OR_RETURN(std::string bytes, DecodeItem(f.transform, fd, f.base_offset, f.base_length, f.size, f.path));
  RETURN_IF_ERROR(CheckUnchanged(f.base, fd));
  if (bytes.size() != f.size)
    return Status::Stale(f.path + ": decodes to " + std::to_string(bytes.size()) + " bytes, indexed as " +
                         std::to_string(f.size) + "; run `ckptfs index` again");
  bytes_read_->fetch_add(f.base_length, std::memory_order_relaxed);
  auto value = std::make_shared<const std::string>(std::move(bytes));
  std::lock_guard<std::mutex> lock(cache_mu_);
  if (!cache_.count(id)) {
    lru_.push_front(id);
    cache_[id] = {value, lru_.begin()};
    cached_bytes_ += value->size();
    // Evict least recently used items, keeping at least the one just added.
    while (cached_bytes_ > decoded_budget_ && lru_.size() > 1) {
      FileId victim = lru_.back();
      lru_.pop_back();
      cached_bytes_ -= cache_[victim].first->size();
      cache_.erase(victim);
    }
  }
  return value;
}

SourceReader::~SourceReader() {
  hints_.Stop();
  for (int fd : fds_)
    if (fd >= 0) ::close(fd);
  for (const auto& [id, fd] : prefetch_fds_) ::close(fd);
  if (null_fd_ >= 0) ::close(null_fd_);
}

uint64_t SourceReader::bytes_read() const { return bytes_read_->load(); }

Result<int> SourceReader::Fd(FileId id) {
  if (id >= fds_.size()) return Status::Corruption("read plan names unknown file " + std::to_string(id));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stale_[id].empty()) return Status::Stale(stale_[id]);
    if (fds_[id] >= 0) return fds_[id];
  }
  const std::string path = root_ + "/" + PathOf(id);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::IOError(PathOf(id) + ": " + std::strerror(errno));
  Status unchanged = CheckUnchanged(id, fd);
  if (!unchanged.ok()) {
    ::close(fd);
    return unchanged;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (fds_[id] >= 0) {  // another thread won the race
    ::close(fd);
    return fds_[id];
  }
  fds_[id] = fd;
  return fd;
}

Status SourceReader::CheckUnchanged(FileId id, int fd) {
  const SourceFile& f = (*files_)[id];
  struct stat by_fd, by_path;
  if (::fstat(fd, &by_fd) != 0) return Status::IOError(f.path + ": " + std::strerror(errno));
  std::string what = DescribeChange(f, IdentityOf(by_fd));
  // The path is checked too: a file renamed over the source or deleted
  // leaves our descriptor on the old inode, whose bytes are no longer the
  // source's.
  if (what.empty()) {
    if (::stat((root_ + "/" + f.path).c_str(), &by_path) != 0)
      what = std::string("gone (") + std::strerror(errno) + ")";
    else
      what = DescribeChange(f, IdentityOf(by_path));
  }
  if (what.empty()) return Status::OK();
  std::string why = f.path + ": " + what + " since indexing; run `ckptfs index` again";
  std::lock_guard<std::mutex> lock(mu_);
  if (stale_[id].empty()) stale_[id] = why;
  any_stale_->store(true);
  return Status::Stale(why);
}

Status SourceReader::Recheck() {
  for (FileId id = 0; id < files_->size(); ++id) {
    const SourceFile& f = (*files_)[id];
    if (f.derived()) continue;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!stale_[id].empty()) return Status::Stale(stale_[id]);
    }
    auto now = StatSource(root_ + "/" + f.path);
    std::string what = now.ok() ? DescribeChange(f, *now) : "gone (" + now.status().message() + ")";
    if (what.empty()) continue;
    std::string why = f.path + ": " + what + " since indexing; run `ckptfs index` again";
    std::lock_guard<std::mutex> lock(mu_);
    if (stale_[id].empty()) stale_[id] = why;
    any_stale_->store(true);
    return Status::Stale(why);
  }
  return Status::OK();
}

Status SourceReader::ReadOne(const SourceRead& r, char* dst, char* converted, std::vector<char>& scratch) {
  if ((*files_)[r.file].derived()) {
    ASSIGN_OR_RETURN(auto bytes, Decoded(r.file));
    if (r.offset + r.length > bytes->size())
      return Status::Corruption(PathOf(r.file) + ": read past the decoded item");
    for (const auto& g : r.gathers)
      std::memcpy((g.to_scratch ? converted : dst) + g.dst_offset, bytes->data() + r.offset + g.read_offset, g.length);
    return Status::OK();
  }
  ASSIGN_OR_RETURN(int fd, Fd(r.file));
  if (r.direct()) {
    RETURN_IF_ERROR(PreadFull(fd, dst + r.gathers[0].dst_offset, r.length, r.offset, PathOf(r.file)));
  } else {
    scratch.resize(r.length);
    RETURN_IF_ERROR(PreadFull(fd, scratch.data(), r.length, r.offset, PathOf(r.file)));
    for (const auto& g : r.gathers)
      std::memcpy((g.to_scratch ? converted : dst) + g.dst_offset, scratch.data() + g.read_offset, g.length);
  }
  bytes_read_->fetch_add(r.length, std::memory_order_relaxed);
  return Status::OK();
}

void SourceReader::Hint(const std::vector<SourceRead>& reads, size_t first) {
  for (size_t i = first; i < reads.size(); ++i) {
    const SourceRead& r = reads[i];
    if ((*files_)[r.file].derived()) continue;  // decoded whole, on first read
    auto fd = Fd(r.file);
    // A hint that cannot be given costs nothing but speed; the read that
    // needs the bytes reports the problem.
    if (!fd.ok()) continue;
    // The kernel reads at most max(read_ahead_kb, max_sectors_kb) of one
    // WILLNEED and drops the rest (force_page_cache_ra), so long ranges go
    // in pieces (kHintChunk).
    for (uint64_t at = 0; at < r.length; at += kHintChunk)
      ::posix_fadvise(*fd, off_t(r.offset + at), off_t(std::min(kHintChunk, r.length - at)), POSIX_FADV_WILLNEED);
  }
}

// Read-ahead reads the ranges with sendfile() into /dev/null on a second
// descriptor of each source: the kernel's own sequential read-ahead fills
// the page cache in large folios and nothing is copied. WILLNEED, which the
// request overlap uses, allocates the cache in 4 KiB folios and cost the
// daemon about twice the CPU per byte (docs/BENCHMARKS.md). The bytes are
// only cached here; the request that needs them still preads and checks them.
void SourceReader::Prefetch(const std::vector<SourceRead>& reads, const std::atomic<uint64_t>& generation,
                            uint64_t want) {
  for (const SourceRead& r : reads) {
    if ((*files_)[r.file].derived()) continue;
    int fd = PrefetchFd(r.file);
    if (fd < 0) continue;  // only speed is lost; the read reports any problem
    off_t at = off_t(r.offset);
    const off_t end = off_t(r.offset + r.length);
    while (at < end && generation.load(std::memory_order_relaxed) == want) {
      ssize_t n = ::sendfile(null_fd_, fd, &at, size_t(std::min<off_t>(end - at, kHintChunk)));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;  // end of a truncated file, or an error the read will meet
    }
  }
}

int SourceReader::PrefetchFd(FileId id) {
  for (const auto& [open_id, fd] : prefetch_fds_)
    if (open_id == id) return fd;
  if (null_fd_ < 0) null_fd_ = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
  auto fd = Fd(id);  // the checked descriptor: the second one must be its file
  if (!fd.ok() || null_fd_ < 0) return -1;
  if (prefetch_fds_.size() == kPrefetchFds) {  // closed first: never one more than the bound
    ::close(prefetch_fds_.front().second);
    prefetch_fds_.erase(prefetch_fds_.begin());
  }
  int second = ::open((root_ + "/" + PathOf(id)).c_str(), O_RDONLY | O_CLOEXEC);
  if (second < 0) return -1;
  struct stat a, b;
  if (::fstat(*fd, &a) != 0 || ::fstat(second, &b) != 0 || a.st_dev != b.st_dev || a.st_ino != b.st_ino) {
    ::close(second);
    return -1;
  }
  prefetch_fds_.emplace_back(id, second);
  return second;
}

void SourceReader::ReadAhead(ReadStream& stream, const std::shared_ptr<const Layout>& layout, uint64_t offset,
                             uint64_t length) {
  ReadStream::Window w = stream.OnRead(offset, length, layout->size(), read_.readahead_bytes);
  if (w.length == 0) return;
  auto generation = stream.generation();
  const uint64_t want = generation->load();
  // Planned on the hint thread: the request that got here is answered first.
  hints_.Post([this, layout, w, generation, want] { HintWindow(*layout, w, generation.get(), want); });
}

void SourceReader::HintWindow(const Layout& layout, ReadStream::Window w, const std::atomic<uint64_t>* generation,
                              uint64_t want) {
  // A slice at a time, in the virtual file's order. Grouped by source file
  // over the whole window, the hints queued all of one file's pieces before
  // the next file's: the reader's next request, which needs a piece of
  // every file, waited behind most of the window's I/O.
  const uint64_t end = w.offset + w.length;
  for (uint64_t at = w.offset; at < end; at += kHintSlice) {
    if (generation->load(std::memory_order_relaxed) != want) return;
    auto plan = Plan(layout, at, std::min(kHintSlice, end - at));
    if (!plan.ok()) return;  // the read of those bytes will say why
    Prefetch(GroupReads(plan->copies, policy_), *generation, want);
  }
}

void SourceReader::SetChecksumGate(std::unique_ptr<ChecksumGate> gate) { gate_ = std::move(gate); }

Status SourceReader::Execute(const ReadPlan& plan, char* dst) {
  if (gate_) {
    RETURN_IF_ERROR(gate_->Check(plan.copies, [this](FileId file, uint64_t offset, uint64_t length, char* out) {
      ReadPlan whole;
      whole.length = length;
      whole.copies.push_back({file, offset, 0, length});
      return ExecuteUngated(whole, out);
    }));
  }
  return ExecuteUngated(plan, dst);
}

Status SourceReader::CheckSources(const std::vector<FileId>& ids) {
  for (FileId raw : ids) {
    const SourceFile& f = (*files_)[raw];
    const FileId id = f.derived() ? f.base : raw;
    ASSIGN_OR_RETURN(int fd, Fd(id));
    RETURN_IF_ERROR(CheckUnchanged(id, fd));
  }
  return Status::OK();
}

Status SourceReader::ExecuteUngated(const ReadPlan& plan, char* dst) {
  for (const LiteralOp& l : plan.literals) std::memcpy(dst + l.dst_offset, l.data, l.length);
  if (plan.copies.empty()) return Status::OK();
  std::vector<SourceRead> reads = GroupReads(plan.copies, policy_);
  // The first read starts at once; hinting the others first lets the disk
  // fetch them while it is waited for.
  if (read_.overlap && reads.size() > 1) Hint(reads, 1);
  std::vector<char> converted(plan.scratch_size);  // source bytes of ConvertOps
  std::vector<char> scratch;
  for (const SourceRead& r : reads) RETURN_IF_ERROR(ReadOne(r, dst, converted.data(), scratch));
  // Identity checked after the reads (see the header): reads are grouped by
  // file, so this is one fstat + stat per file touched.
  // A derived source's bytes may come from the decoded cache: its base file
  // is checked instead.
  FileId last = static_cast<FileId>(-1);
  for (const SourceRead& r : reads) {
    const SourceFile& f = (*files_)[r.file];
    FileId id = f.derived() ? f.base : r.file;
    if (id == last) continue;
    last = id;
    ASSIGN_OR_RETURN(int fd, Fd(id));
    RETURN_IF_ERROR(CheckUnchanged(id, fd));
  }
  std::vector<float> values;
  for (const ConvertOp& c : plan.converts) {
    values.resize(c.count);
    DecodeToFloat32(c.from, reinterpret_cast<const uint8_t*>(converted.data() + c.scratch_offset), c.first, c.count,
                    values.data());
    std::memcpy(dst + c.dst_offset, reinterpret_cast<const char*>(values.data()) + c.skip, c.length);
  }
  return Status::OK();
}

}  // namespace ckptfs
