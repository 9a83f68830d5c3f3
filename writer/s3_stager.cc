// Multipart uploads from the ring (what and why: s3_stager.h).
#include "writer/s3_stager.h"

#include <algorithm>
#include <cstring>

#include "core/crc32c.h"
#include "core/digest.h"
#include "core/zip_crc32.h"

namespace ckptfs {

S3Stager::S3Stager(const S3StagerOptions& options, std::shared_ptr<const S3Client> client,
                   std::unique_ptr<CopyEngine> engine)
    : options_(options), client_(std::move(client)), engine_(std::move(engine)) {}

Result<std::unique_ptr<S3Stager>> S3Stager::Create(const S3StagerOptions& options,
                                                   std::shared_ptr<const S3Client> client,
                                                   std::unique_ptr<CopyEngine> engine) {
  if (options.part_bytes < kS3MinPartBytes || options.buffers < 2 || options.upload_threads < 1)
    return Status::InvalidArgument("S3 stager needs part_bytes >= 5 MiB (S3's smallest part), buffers >= 2 and "
                                   "upload_threads >= 1; got " + std::to_string(options.part_bytes) + ", " +
                                   std::to_string(options.buffers) + ", " + std::to_string(options.upload_threads));
  if (!client) return Status::InvalidArgument("S3 stager needs a client");
  if (!engine) engine = MakeDefaultCopyEngine(options.buffers);
  std::unique_ptr<S3Stager> s(new S3Stager(options, std::move(client), std::move(engine)));
  RETURN_IF_ERROR(s->Start());
  return s;
}

Status S3Stager::Start() {
  RETURN_IF_ERROR(AllocRing(*engine_, options_.buffers, options_.part_bytes, ring_, free_));
  return StartIoThreads(options_.upload_threads, [this] { IoLoop(); }, threads_,
                        "S3 stager: cannot start an upload thread");
}

S3Stager::~S3Stager() {
  (void)Close();
  for (uint8_t* p : ring_) engine_->FreeBuffer(p, options_.part_bytes);
}

Status S3Stager::Close() {
  if (joined_) return FirstError();
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return queue_.empty() && busy_ == 0; });
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
  joined_ = true;
  return FirstError();
}

Status S3Stager::FirstError() {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void S3Stager::Fail(const Status& st) {
  if (error_.ok()) error_ = st;
  cv_.notify_all();
}

Result<int> S3Stager::OpenObject(const std::string& key, uint64_t size) {
  if (joined_) return Status::InvalidArgument("S3 stager: closed");
  ASSIGN_OR_RETURN(Object o, S3UploadPlan::Make(key, size, options_.part_bytes));
  if (size > 0) {
    ASSIGN_OR_RETURN(auto created, client_->CreateMultipartUpload(key));
    o.upload_id = created.first;
    o.check = created.second;
  }
  std::lock_guard<std::mutex> lock(mu_);
  objects_.push_back(std::move(o));
  return int(objects_.size() - 1);
}

Status S3Stager::AddHole(int object, uint64_t offset, uint64_t length, uint64_t tag, uint64_t tag_bytes, HoleFill fill) {
  std::lock_guard<std::mutex> lock(mu_);
  Object& o = objects_.at(object);
  if (length == 0) return Status::OK();
  if (offset + length > o.size)
    return Status::InvalidArgument(o.key + ": a hole at " + std::to_string(offset) + " runs past the object's end");
  const size_t h = o.holes.size();
  o.holes.push_back({offset, length, tag, std::move(fill), false, {}});
  for (uint64_t k = offset / options_.part_bytes; k * options_.part_bytes < offset + length; ++k)
    o.parts[k].holes.push_back(h);
  o.holes_of_tag[tag].push_back(h);
  tag_bytes_[tag] = tag_bytes;
  if (tag_bytes == 0) ResolveTags(object, {tag});
  return Status::OK();
}

Status S3Stager::Acquire(Object& o) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !free_.empty() || !error_.ok(); });
  if (!error_.ok()) return error_;
  o.parts[o.cur].buffer = free_.back();
  free_.pop_back();
  return Status::OK();
}

Status S3Stager::Seal(int object) {
  Object& o = objects_[object];
  if (o.parts[o.cur].buffer < 0) RETURN_IF_ERROR(Acquire(o));  // a part of holes only
  RETURN_IF_ERROR(engine_->Seal(o.parts[o.cur].buffer));
  {
    std::lock_guard<std::mutex> lock(mu_);
    o.parts[o.cur].sealed = true;
    queue_.push_back({object, o.cur, std::move(o.pending), false});
    o.pending.clear();
    ++o.cur;
  }
  cv_.notify_all();
  return Status::OK();
}

Status S3Stager::Write(int object, uint64_t offset, const Slice& src, uint64_t tag, uint64_t tag_offset) {
  if (joined_) return Status::InvalidArgument("S3 stager: closed; no more writes");
  RETURN_IF_ERROR(FirstError());
  Object& o = objects_.at(object);
  if (offset + src.size > o.size)
    return Status::InvalidArgument(o.key + ": a write at " + std::to_string(offset) + " runs past the object's end");
  const auto* p = static_cast<const uint8_t*>(src.ptr);
  for (uint64_t done = 0; done < src.size;) {
    const uint64_t at = offset + done;
    const int k = int(at / options_.part_bytes);
    if (k < o.cur)
      return Status::InvalidArgument(o.key + ": a write at " + std::to_string(at) + " goes back to a part already sealed");
    while (o.cur < k) RETURN_IF_ERROR(Seal(object));
    if (o.parts[k].buffer < 0) RETURN_IF_ERROR(Acquire(o));
    const uint64_t in_part = at - uint64_t(k) * options_.part_bytes;
    const uint64_t n = std::min(src.size - done, o.PartSize(k) - in_part);
    const int buffer = o.parts[k].buffer;
    RETURN_IF_ERROR(engine_->Copy(buffer, ring_[buffer] + in_part, Slice{p + done, n, src.device, src.stream}));
    o.pending.push_back({in_part, n, tag, tag_offset + done});
    done += n;
    if (in_part + n == o.PartSize(k)) RETURN_IF_ERROR(Seal(object));
  }
  return Status::OK();
}

void S3Stager::IoLoop() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
      ++busy_;
    }
    Status st = FirstError();
    if (st.ok()) st = job.upload ? Upload(job.object, job.part) : Checksum(job);
    {
      std::lock_guard<std::mutex> lock(mu_);
      Part& part = objects_[job.object].parts[job.part];
      if (!st.ok()) Fail(st);
      // After a failure every buffer comes back, so the producer wakes.
      if (!error_.ok() && part.buffer >= 0) {
        free_.push_back(part.buffer);
        part.buffer = -1;
      }
      --busy_;
    }
    cv_.notify_all();
  }
}

Status S3Stager::Checksum(const Job& job) {
  int buffer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    buffer = objects_[job.object].parts[job.part].buffer;
  }
  RETURN_IF_ERROR(engine_->WaitSealed(buffer));
  std::vector<std::pair<uint64_t, PieceSum>> sums;
  std::vector<Part::Span> spans;
  for (const Piece& pc : job.pieces) {
    const uint8_t* d = ring_[buffer] + pc.offset_in_part;
    const uint32_t c = Crc32c(0, d, pc.size);
    sums.push_back({pc.tag, {pc.tag_offset, pc.size, c, options_.zip_crc32 ? ZipCrc32(0, d, pc.size) : 0}});
    spans.push_back({pc.offset_in_part, pc.size, c});
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uint64_t> tags;
  for (auto& [tag, s] : sums) {
    sums_[tag].push_back(s);
    if (tag_bytes_.count(tag)) tags.push_back(tag);
  }
  Part& part = objects_[job.object].parts[job.part];
  part.spans = std::move(spans);
  part.checksummed = true;
  ResolveTags(job.object, tags);
  QueueReady(job.object, job.part);
  return Status::OK();
}

void S3Stager::ResolveTags(int object, const std::vector<uint64_t>& tags) {
  Object& o = objects_[object];
  for (uint64_t tag : tags) {
    auto holes = o.holes_of_tag.find(tag);
    if (holes == o.holes_of_tag.end()) continue;
    std::vector<PieceSum> pieces = sums_[tag];
    std::sort(pieces.begin(), pieces.end(), [](const PieceSum& a, const PieceSum& b) { return a.tag_offset < b.tag_offset; });
    Checksums c;
    for (const PieceSum& p : pieces) {
      if (p.tag_offset != c.bytes) break;  // not all there yet (or overlapping: TakeChecksums says so)
      c.crc32c = Crc32cCombine(c.crc32c, p.crc32c, p.size);
      c.zip_crc32 = options_.zip_crc32 ? ZipCrc32Combine(c.zip_crc32, p.zip_crc32, p.size) : 0;
      c.bytes += p.size;
    }
    if (c.bytes != tag_bytes_[tag]) continue;
    for (size_t h : holes->second) {
      Hole& hole = o.holes[h];
      hole.bytes = hole.fill(c);
      if (hole.bytes.size() != hole.length) {
        Fail(Status::IOError(o.key + ": framing of " + std::to_string(hole.bytes.size()) + " bytes for a hole of " +
                              std::to_string(hole.length)));
        return;
      }
      hole.filled = true;
      for (uint64_t k = hole.offset / options_.part_bytes; k * options_.part_bytes < hole.offset + hole.length; ++k)
        QueueReady(object, int(k));
    }
    o.holes_of_tag.erase(holes);
  }
}

void S3Stager::QueueReady(int object, int k) {
  Object& o = objects_[object];
  Part& part = o.parts[k];
  if (!part.sealed || !part.checksummed || part.sent) return;
  for (size_t h : part.holes)
    if (!o.holes[h].filled) return;
  part.sent = true;
  queue_.push_back({object, k, {}, true});
  cv_.notify_all();
}

Status S3Stager::Upload(int object, int k) {
  std::string key, upload_id;
  S3PartCheck check;
  uint64_t size;
  uint8_t* data;
  std::vector<Part::Span> spans;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Object& o = objects_[object];
    Part& part = o.parts[k];
    key = o.key, upload_id = o.upload_id, check = o.check;
    size = o.PartSize(k);
    data = ring_[part.buffer];
    spans = part.spans;
    // The holes' bytes into the buffer (immutable once filled).
    const uint64_t base = uint64_t(k) * options_.part_bytes;
    for (size_t h : part.holes) {
      const Hole& hole = o.holes[h];
      const uint64_t from = std::max(hole.offset, base), to = std::min(hole.offset + hole.length, base + size);
      std::memcpy(data + (from - base), hole.bytes.data() + (from - hole.offset), to - from);
      spans.push_back({from - base, to - from, Crc32c(0, data + (from - base), to - from)});
    }
  }
  std::sort(spans.begin(), spans.end(), [](const Part::Span& a, const Part::Span& b) { return a.offset < b.offset; });
  uint32_t crc = 0;
  uint64_t covered = 0;
  for (const Part::Span& s : spans) {
    if (s.offset != covered)
      return Status::IOError(key + ": part " + std::to_string(k + 1) + " has " +
                              (s.offset < covered ? "overlapping" : "unwritten") + " bytes at " +
                              std::to_string(std::min(s.offset, covered)) + "; nothing unwritten is uploaded");
    crc = Crc32cCombine(crc, s.crc32c, s.size);
    covered += s.size;
  }
  if (covered != size)
    return Status::IOError(key + ": part " + std::to_string(k + 1) + " has unwritten bytes from " +
                            std::to_string(covered) + "; nothing unwritten is uploaded");
  std::string md5;
  if (check == S3PartCheck::kMd5) {
    Md5 m;
    m.Update(data, size);
    const auto d = m.Final();
    md5 = Base64(d.data(), d.size());
  }
  S3Body body{{{reinterpret_cast<const char*>(data), size}}};
  ASSIGN_OR_RETURN(std::string etag, client_->UploadPart(key, upload_id, k + 1, body, check, crc, md5));
  std::lock_guard<std::mutex> lock(mu_);
  Object& o = objects_[object];
  o.done.push_back({k + 1, etag, crc});
  free_.push_back(o.parts[k].buffer);
  o.parts[k].buffer = -1;
  return Status::OK();
}

Result<S3ObjectUpload> S3Stager::FinishObject(int object) {
  Object& o = objects_.at(object);
  if (o.size == 0) {
    RETURN_IF_ERROR(client_->Put(o.key, S3Body{}));
    return S3ObjectUpload{o.key, "", o.check, {}};
  }
  Status sealed;
  while (sealed.ok() && o.cur < int(o.parts.size())) sealed = Seal(object);
  std::unique_lock<std::mutex> lock(mu_);
  // Done, failed, or idle with parts still held: a hole whose item never
  // got all its bytes (never filled: the part is not sent).
  cv_.wait(lock, [&] { return o.done.size() == o.parts.size() || !error_.ok() || (queue_.empty() && busy_ == 0); });
  if (!error_.ok()) return error_;
  RETURN_IF_ERROR(sealed);
  if (o.done.size() != o.parts.size())
    return Status::InvalidArgument(o.key + ": " + std::to_string(o.parts.size() - o.done.size()) +
                                   " part(s) wait for framing of items that did not get all their bytes");
  S3ObjectUpload up{o.key, o.upload_id, o.check, o.done};
  // A pooled stager serves many saves: what this object planned goes.
  for (const Hole& h : o.holes) tag_bytes_.erase(h.tag);
  o.holes.clear();
  o.parts.clear();
  std::sort(up.parts.begin(), up.parts.end(), [](const S3CompletedPart& a, const S3CompletedPart& b) { return a.number < b.number; });
  return up;
}

Result<Checksums> S3Stager::TakeChecksums(uint64_t tag) {
  return TakePieceSums(mu_, sums_, tag, options_.zip_crc32, "S3 stager");
}

Status S3Stager::Abort(int object) {
  std::string key, id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Object& o = objects_.at(object);
    if (o.aborted || o.upload_id.empty()) return Status::OK();
    o.aborted = true;
    key = o.key, id = o.upload_id;
  }
  return client_->AbortMultipartUpload(key, id);
}

}  // namespace ckptfs
