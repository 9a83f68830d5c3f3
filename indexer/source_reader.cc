#include "indexer/source_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "core/convert.h"
#include "indexer/file_table.h"
#include "indexer/posix_io.h"
#include "indexer/transform.h"

namespace ckptfs {

SourceReader::SourceReader(const Catalog* catalog, GroupPolicy policy, uint64_t decoded_cache_bytes)
    : catalog_(catalog),
      policy_(policy),
      fds_(catalog->files.size(), -1),
      bytes_read_(std::make_unique<std::atomic<uint64_t>>(0)),
      decoded_budget_(decoded_cache_bytes) {}

Result<std::shared_ptr<const std::string>> SourceReader::Decoded(FileId id) {
  {
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (auto it = cache_.find(id); it != cache_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second.second);
      return it->second.first;
    }
  }
  const SourceFile& f = catalog_->files[id];
  ASSIGN_OR_RETURN(int fd, Fd(f.base));
  RETURN_IF_ERROR(CheckUnchanged(f.base, fd));
  ASSIGN_OR_RETURN(std::string bytes, DecodeItem(f.transform, fd, f.base_offset, f.base_length, f.size, f.path));
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
  for (int fd : fds_)
    if (fd >= 0) ::close(fd);
}

uint64_t SourceReader::bytes_read() const { return bytes_read_->load(); }

Result<int> SourceReader::Fd(FileId id) {
  if (id >= fds_.size()) return Status::Corruption("read plan names unknown file " + std::to_string(id));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (fds_[id] >= 0) return fds_[id];
  }
  const SourceFile& f = catalog_->files[id];
  const std::string path = catalog_->root + "/" + f.path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::IOError(f.path + ": " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0 || st.st_ino != f.inode) {
    ::close(fd);
    return Status::Stale(f.path + ": replaced since indexing; run `ckptfs index` again");
  }
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
  const SourceFile& f = catalog_->files[id];
  struct stat st;
  if (::fstat(fd, &st) != 0) return Status::IOError(f.path + ": " + std::strerror(errno));
  SourceFile now;
  now.size = st.st_size;
  now.mtime_ns = int64_t(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec;
  now.inode = f.inode;
  std::string what = DescribeChange(f, now);
  if (!what.empty()) return Status::Stale(f.path + ": " + what + "; run `ckptfs index` again");
  return Status::OK();
}

Status SourceReader::Execute(const ReadPlan& plan, char* dst) {
  for (const LiteralOp& l : plan.literals) std::memcpy(dst + l.dst_offset, l.data, l.length);
  if (plan.copies.empty()) return Status::OK();
  std::vector<SourceRead> reads = GroupReads(plan.copies, policy_);
  std::vector<char> converted(plan.scratch_size);  // source bytes of ConvertOps
  std::vector<char> scratch;
  FileId checked = static_cast<FileId>(-1);
  for (const SourceRead& r : reads) {
    if (catalog_->files[r.file].derived()) {
      ASSIGN_OR_RETURN(auto bytes, Decoded(r.file));
      if (r.offset + r.length > bytes->size())
        return Status::Corruption(catalog_->files[r.file].path + ": read past the decoded item");
      for (const auto& g : r.gathers)
        std::memcpy((g.to_scratch ? converted.data() : dst) + g.dst_offset, bytes->data() + r.offset + g.read_offset,
                    g.length);
      continue;
    }
    ASSIGN_OR_RETURN(int fd, Fd(r.file));
    if (r.file != checked) {  // reads are grouped by file: one fstat per file
      RETURN_IF_ERROR(CheckUnchanged(r.file, fd));
      checked = r.file;
    }
    const std::string& what = catalog_->files[r.file].path;
    if (r.direct()) {
      RETURN_IF_ERROR(PreadFull(fd, dst + r.gathers[0].dst_offset, r.length, r.offset, what));
    } else {
      scratch.resize(r.length);
      RETURN_IF_ERROR(PreadFull(fd, scratch.data(), r.length, r.offset, what));
      for (const auto& g : r.gathers)
        std::memcpy((g.to_scratch ? converted.data() : dst) + g.dst_offset, scratch.data() + g.read_offset, g.length);
    }
    bytes_read_->fetch_add(r.length, std::memory_order_relaxed);
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
