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

namespace ckptfs {

SourceReader::SourceReader(const Catalog* catalog, GroupPolicy policy)
    : catalog_(catalog),
      policy_(policy),
      fds_(catalog->files.size(), -1),
      bytes_read_(std::make_unique<std::atomic<uint64_t>>(0)) {}

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
