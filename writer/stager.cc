// The stager's ring and I/O threads (what and why: stager.h).
#include "writer/stager.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <system_error>

#include "core/crc32c.h"
#include "core/zip_crc32.h"

namespace ckptfs {
namespace {

Status Errno(const std::string& what) { return Status::IOError(what + ": " + std::strerror(errno)); }

Status PwriteFull(int fd, const uint8_t* p, uint64_t n, uint64_t offset, const std::string& path) {
  while (n > 0) {
    ssize_t w = ::pwrite(fd, p, std::min<uint64_t>(n, 1ull << 30), offset);
    if (w < 0) {
      if (errno == EINTR) continue;
      return Errno("pwrite " + std::to_string(n) + " bytes at " + std::to_string(offset) + " of " + path);
    }
    p += w, n -= w, offset += w;
  }
  return Status::OK();
}

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

Status SyncDir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Errno("open directory " + dir + " to fsync it");
  int rc = ::fsync(fd);
  Status st = rc == 0 ? Status::OK() : Errno("fsync directory " + dir);
  ::close(fd);
  return st;
}

Stager::Stager(const StagerOptions& options, std::unique_ptr<CopyEngine> engine)
    : options_(options), engine_(std::move(engine)) {}

Result<std::unique_ptr<Stager>> Stager::Create(const StagerOptions& options, std::unique_ptr<CopyEngine> engine) {
  if (options.buffer_bytes == 0 || options.buffers < 1 || options.io_threads < 1 || options.direct_piece_bytes == 0)
    return Status::InvalidArgument("stager needs buffer_bytes > 0, buffers >= 1, io_threads >= 1, direct_piece_bytes > 0");
  if (!engine) engine = MakeDefaultCopyEngine(options.buffers);
  std::unique_ptr<Stager> s(new Stager(options, std::move(engine)));
  RETURN_IF_ERROR(s->Start());
  return s;
}

Status AllocRing(CopyEngine& engine, int buffers, uint64_t bytes, std::vector<uint8_t*>& ring,
                 std::vector<int>& free) {
  for (int i = 0; i < buffers; ++i) {
    ASSIGN_OR_RETURN(void* p, engine.AllocBuffer(bytes));
    ring.push_back(static_cast<uint8_t*>(p));
    free.push_back(i);
  }
  return Status::OK();
}

Status StartIoThreads(int count, const std::function<void()>& loop, std::vector<std::thread>& threads,
                      const std::string& what) {
  try {
    for (int i = 0; i < count; ++i) {
      threads.emplace_back(loop);
      ::pthread_setname_np(threads.back().native_handle(), "ckptfs-io");
    }
  } catch (const std::system_error& e) {
    return Status::IOError(what + ": " + e.what());
  }
  return Status::OK();
}

Status Stager::Start() {
  RETURN_IF_ERROR(AllocRing(*engine_, options_.buffers, options_.buffer_bytes, ring_, free_));
  // The threads started before a failure are joined by the destructor.
  return StartIoThreads(options_.io_threads, [this] { IoLoop(); }, threads_, "stager: cannot start an I/O thread");
}

Status Stager::Close() {
  if (joined_) return FirstError();
  Status drained = Drain();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();  // IoLoop returns once stop_ is set and the queue is empty
  threads_.clear();
  joined_ = true;
  return drained;
}

Stager::~Stager() {
  (void)Close();
  for (uint8_t* p : ring_) engine_->FreeBuffer(p, options_.buffer_bytes);
  for (auto& f : files_)
    if (f.fd >= 0) ::close(f.fd);
}

Result<int> Stager::OpenFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("create " + path);
  files_.push_back({path, fd});
  return int(files_.size() - 1);
}

Status Stager::SyncFile(int file) {
  if (::fsync(files_[file].fd) != 0) return Errno("fsync " + files_[file].path);
  return Status::OK();
}

Status Stager::CloseFile(int file) {
  int fd = files_[file].fd;
  files_[file].fd = -1;
  if (fd >= 0 && ::close(fd) != 0) return Errno("close " + files_[file].path);
  return Status::OK();
}

Status Stager::Write(int file, uint64_t offset, const Slice& src, uint64_t tag, uint64_t tag_offset, bool copy_host) {
  if (joined_) return Status::InvalidArgument("stager: closed; no more writes");
  if (file < 0 || file >= int(files_.size()) || files_[file].fd < 0)
    return Status::InvalidArgument("stager: file id " + std::to_string(file) + " is not open");
  RETURN_IF_ERROR(FirstError());
  if (src.size == 0) return Status::OK();
  if (src.device == kHostDevice && !copy_host) return WriteDirect(file, offset, src, tag, tag_offset);
  return StageCopy(file, offset, src, tag, tag_offset);
}

Status Stager::WriteDirect(int file, uint64_t offset, const Slice& src, uint64_t tag, uint64_t tag_offset) {
  const auto* p = static_cast<const uint8_t*>(src.ptr);
  for (uint64_t done = 0; done < src.size;) {
    uint64_t n = std::min(src.size - done, options_.direct_piece_bytes);
    Job job;
    job.pieces.push_back({file, offset + done, p + done, n, tag, tag_offset + done});
    RETURN_IF_ERROR(Enqueue(std::move(job)));
    done += n;
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.direct_bytes += src.size;
  return Status::OK();
}

Status Stager::StageCopy(int file, uint64_t offset, const Slice& src, uint64_t tag, uint64_t tag_offset) {
  const auto* p = static_cast<const uint8_t*>(src.ptr);
  for (uint64_t done = 0; done < src.size;) {
    if (cur_ < 0) RETURN_IF_ERROR(AcquireBuffer());
    uint64_t n = std::min(src.size - done, options_.buffer_bytes - cur_fill_);
    uint8_t* dst = ring_[cur_] + cur_fill_;
    Slice piece{p + done, n, src.device, src.stream};
    RETURN_IF_ERROR(engine_->Copy(cur_, dst, piece));
    cur_pieces_.push_back({file, offset + done, dst, n, tag, tag_offset + done});
    cur_fill_ += n;
    done += n;
    if (cur_fill_ == options_.buffer_bytes) RETURN_IF_ERROR(SubmitCurrent());
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.staged_bytes += src.size;
  return Status::OK();
}

Status Stager::AcquireBuffer() {
  std::unique_lock<std::mutex> lock(mu_);
  int64_t t0 = NowNs();
  cv_.wait(lock, [&] { return !free_.empty() || !error_.ok(); });
  stats_.producer_wait_ns += NowNs() - t0;
  if (!error_.ok()) return error_;
  cur_ = free_.back();
  free_.pop_back();
  cur_fill_ = 0;
  return Status::OK();
}

Status Stager::SubmitCurrent() {
  Job job;
  job.buffer = cur_;
  job.pieces.swap(cur_pieces_);
  cur_ = -1;
  cur_fill_ = 0;
  if (Status st = engine_->Seal(job.buffer); !st.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(job.buffer);
    if (error_.ok()) error_ = st;
    return st;
  }
  return Enqueue(std::move(job));
}

Status Stager::Enqueue(Job job) {
  // Buffer jobs are bounded by the ring; this bound adds room for direct
  // writes so every I/O thread can have one while the ring is full.
  const size_t limit = size_t(options_.buffers + options_.io_threads);
  std::unique_lock<std::mutex> lock(mu_);
  int64_t t0 = NowNs();
  cv_.wait(lock, [&] { return queue_.size() < limit || !error_.ok(); });
  stats_.producer_wait_ns += NowNs() - t0;
  if (!error_.ok()) {
    if (job.buffer >= 0) free_.push_back(job.buffer);
    return error_;
  }
  queue_.push_back(std::move(job));
  cv_.notify_all();
  return Status::OK();
}

Status Stager::Drain() {
  if (cur_ >= 0) {
    if (cur_pieces_.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      free_.push_back(cur_);
      cur_ = -1;
    } else {
      (void)SubmitCurrent();
    }
  }
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return queue_.empty() && in_flight_ == 0; });
  return error_;
}

Status Stager::FirstError() {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void Stager::IoLoop() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and nothing left
      job = std::move(queue_.front());
      queue_.pop_front();
      ++in_flight_;
    }
    cv_.notify_all();  // the queue shrank
    Status st;
    {
      std::lock_guard<std::mutex> lock(mu_);
      st = error_;
    }
    if (st.ok()) st = RunJob(job);  // after a failure, later jobs only give their buffers back
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!st.ok() && error_.ok()) error_ = st;
      if (job.buffer >= 0) free_.push_back(job.buffer);
      --in_flight_;
    }
    cv_.notify_all();
  }
}

Status Stager::RunJob(const Job& job) {
  if (job.buffer >= 0) RETURN_IF_ERROR(engine_->WaitSealed(job.buffer));
  std::vector<std::pair<uint64_t, PieceSum>> sums;
  for (size_t i = 0; i < job.pieces.size();) {
    // Pieces adjacent in the buffer and in the file go out in one pwrite.
    size_t j = i + 1;
    uint64_t run = job.pieces[i].size;
    while (j < job.pieces.size() && job.pieces[j].file == job.pieces[i].file &&
           job.pieces[j].file_offset == job.pieces[i].file_offset + run &&
           job.pieces[j].data == job.pieces[i].data + run) {
      run += job.pieces[j].size;
      ++j;
    }
    for (size_t k = i; k < j; ++k) {
      const Piece& pc = job.pieces[k];
      uint32_t zc = options_.zip_crc32 ? ZipCrc32(0, pc.data, pc.size) : 0;
      sums.push_back({pc.tag, {pc.tag_offset, pc.size, Crc32c(0, pc.data, pc.size), zc}});
    }
    const Piece& first = job.pieces[i];
    RETURN_IF_ERROR(PwriteFull(files_[first.file].fd, first.data, run, first.file_offset, files_[first.file].path));
    i = j;
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [tag, s] : sums) sums_[tag].push_back(s);
  return Status::OK();
}

Result<Checksums> CombinePieceSums(std::vector<PieceSum> pieces, bool zip_crc32, const std::string& who,
                                   uint64_t tag) {
  std::sort(pieces.begin(), pieces.end(), [](const PieceSum& a, const PieceSum& b) { return a.tag_offset < b.tag_offset; });
  Checksums c;
  for (const PieceSum& p : pieces) {
    if (p.tag_offset != c.bytes)
      return Status::InvalidArgument(who + ": tag " + std::to_string(tag) + " has " +
                                     (p.tag_offset < c.bytes ? "overlapping" : "missing") + " bytes at " +
                                     std::to_string(std::min(p.tag_offset, c.bytes)));
    c.crc32c = Crc32cCombine(c.crc32c, p.crc32c, p.size);
    c.zip_crc32 = zip_crc32 ? ZipCrc32Combine(c.zip_crc32, p.zip_crc32, p.size) : 0;
    c.bytes += p.size;
  }
  return c;
}

Result<Checksums> TakePieceSums(std::mutex& mu, std::map<uint64_t, std::vector<PieceSum>>& sums, uint64_t tag,
                                bool zip_crc32, const std::string& who) {
  std::vector<PieceSum> pieces;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = sums.find(tag);
    if (it == sums.end()) return Status::NotFound(who + ": nothing was written under tag " + std::to_string(tag));
    pieces = std::move(it->second);
    sums.erase(it);
  }
  return CombinePieceSums(std::move(pieces), zip_crc32, who, tag);
}

Result<Checksums> Stager::TakeChecksums(uint64_t tag) {
  return TakePieceSums(mu_, sums_, tag, options_.zip_crc32, "stager");
}

StagerStats Stager::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace ckptfs
