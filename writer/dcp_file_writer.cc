// One rank's DCP data file (what and why: dcp_file_writer.h).
#include "writer/dcp_file_writer.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

namespace ckptfs {
namespace {

// torch writes a 40-digit serialization id per archive; readers only
// compare ids between archives, so any distinct digits do.
std::string SerializationId(uint64_t seed, uint64_t n) {
  std::string a = std::to_string(seed), b = std::to_string(n);
  return std::string(20 - std::min<size_t>(20, a.size()), '0') + a + std::string(20 - std::min<size_t>(20, b.size()), '0') + b;
}

uint64_t ProcessSeed() {
  static const uint64_t seed = std::random_device{}() % 10000000000000000000ull;
  return seed;
}

Status PwriteAll(int fd, const std::string& s, uint64_t offset, const std::string& path) {
  for (size_t done = 0; done < s.size();) {
    ssize_t w = ::pwrite(fd, s.data() + done, s.size() - done, offset + done);
    if (w < 0) {
      if (errno == EINTR) continue;
      return Status::IOError("pwrite framing at " + std::to_string(offset + done) + " of " + path + ": " + std::strerror(errno));
    }
    done += size_t(w);
  }
  return Status::OK();
}

}  // namespace

Result<std::unique_ptr<DcpFileWriter>> DcpFileWriter::Create(Stager* stager, const std::string& path) {
  ASSIGN_OR_RETURN(int file, stager->OpenFile(path));
  return std::unique_ptr<DcpFileWriter>(new DcpFileWriter(stager, file, path));
}

Result<std::unique_ptr<DcpFileWriter>> DcpFileWriter::CreateS3(S3Stager* stager, const std::string& key) {
  std::unique_ptr<DcpFileWriter> w(new DcpFileWriter(nullptr, -1, key));
  w->s3_ = stager;
  return w;
}

Status DcpFileWriter::Seal() {
  if (!s3_ || sealed_) return Status::OK();
  ASSIGN_OR_RETURN(file_, s3_->OpenObject(path_, end_));
  sealed_ = true;
  for (uint32_t i = 0; i < items_.size(); ++i) {
    const Item& it = items_[i];
    if (!it.archive) continue;
    const TorchSaveFraming archive = *it.archive;
    RETURN_IF_ERROR(s3_->AddHole(file_, it.offset, it.data_offset - it.offset, Tag(i), it.data_length,
                                 [archive](const Checksums& c) { return archive.Head(c.zip_crc32); }));
    RETURN_IF_ERROR(s3_->AddHole(file_, it.data_offset + it.data_length, it.offset + it.length - it.data_offset - it.data_length,
                                 Tag(i), it.data_length,
                                 [archive](const Checksums& c) { return archive.Tail(c.zip_crc32); }));
  }
  return Status::OK();
}

Status DcpFileWriter::Abort() {
  if (!s3_ || !sealed_) return Status::OK();
  return s3_->Abort(file_);
}

Result<uint32_t> DcpFileWriter::AddTensor(const std::string& dtype, const std::vector<uint64_t>& shape, uint64_t nbytes,
                                          bool force_zip64) {
  TorchSaveSpec spec{dtype, shape, nbytes, end_, SerializationId(ProcessSeed(), items_.size()), force_zip64};
  ASSIGN_OR_RETURN(TorchSaveFraming archive, TorchSaveFraming::Plan(spec));
  Item it;
  it.offset = end_;
  it.length = archive.total_size();
  it.data_offset = end_ + archive.data_offset();
  it.data_length = nbytes;
  it.archive = std::move(archive);
  end_ += it.length;
  items_.push_back(std::move(it));
  return uint32_t(items_.size() - 1);
}

Result<uint32_t> DcpFileWriter::AddBytes(uint64_t nbytes) {
  Item it;
  it.offset = it.data_offset = end_;
  it.length = it.data_length = nbytes;
  end_ += nbytes;
  items_.push_back(std::move(it));
  return uint32_t(items_.size() - 1);
}

Status DcpFileWriter::Write(uint32_t item, const Slice& src, bool copy_host) {
  if (finished_) return Status::InvalidArgument(path_ + ": write after Finish");
  if (item >= items_.size()) return Status::InvalidArgument(path_ + ": no item " + std::to_string(item));
  Item& it = items_[item];
  if (src.size > it.data_length - it.written)
    return Status::InvalidArgument(path_ + ": item " + std::to_string(item) + " is " + std::to_string(it.data_length) +
                                   " bytes; a slice of " + std::to_string(src.size) + " after " +
                                   std::to_string(it.written) + " overruns it");
  if (s3_) {
    if (!sealed_) return Status::InvalidArgument(path_ + ": write before Seal");
    RETURN_IF_ERROR(s3_->Write(file_, it.data_offset + it.written, src, Tag(item), it.written));
  } else {
    RETURN_IF_ERROR(stager_->Write(file_, it.data_offset + it.written, src, Tag(item), it.written, copy_host));
  }
  it.written += src.size;
  return Status::OK();
}

Result<std::vector<DcpItemResult>> DcpFileWriter::Finish() {
  if (finished_) return Status::InvalidArgument(path_ + ": Finish called twice");
  finished_ = true;
  std::vector<DcpItemResult> out;
  if (s3_) {
    RETURN_IF_ERROR(FinishS3(&out));
    return out;
  }
  RETURN_IF_ERROR(stager_->Drain());
  const int fd = stager_->fd(file_);
  for (uint32_t i = 0; i < items_.size(); ++i) {
    Item& it = items_[i];
    if (it.written != it.data_length)
      return Status::InvalidArgument(path_ + ": item " + std::to_string(i) + " got " + std::to_string(it.written) +
                                     " of its " + std::to_string(it.data_length) + " bytes");
    Checksums c;
    if (it.data_length > 0) {
      ASSIGN_OR_RETURN(c, stager_->TakeChecksums(Tag(i)));
    }
    if (it.archive) {
      RETURN_IF_ERROR(PwriteAll(fd, it.archive->Head(c.zip_crc32), it.offset, path_));
      RETURN_IF_ERROR(PwriteAll(fd, it.archive->Tail(c.zip_crc32), it.data_offset + it.data_length, path_));
    }
    out.push_back({it.offset, it.length, it.data_offset, it.data_length, c.crc32c});
  }
  if (::ftruncate(fd, off_t(end_)) != 0)  // an empty trailing item leaves no byte behind to set the size
    return Status::IOError("ftruncate " + path_ + ": " + std::strerror(errno));
  RETURN_IF_ERROR(stager_->SyncFile(file_));
  RETURN_IF_ERROR(stager_->CloseFile(file_));
  return out;
}

// Every item got its bytes, then the stager sealed the last parts and
// uploaded every part (the framing filled in as CRCs became known).
Status DcpFileWriter::FinishS3(std::vector<DcpItemResult>* out) {
  RETURN_IF_ERROR(Seal());  // an object with no item written
  for (uint32_t i = 0; i < items_.size(); ++i)
    if (items_[i].written != items_[i].data_length)
      return Status::InvalidArgument(path_ + ": item " + std::to_string(i) + " got " + std::to_string(items_[i].written) +
                                     " of its " + std::to_string(items_[i].data_length) + " bytes");
  ASSIGN_OR_RETURN(upload_, s3_->FinishObject(file_));
  for (uint32_t i = 0; i < items_.size(); ++i) {
    const Item& it = items_[i];
    Checksums c;
    if (it.data_length > 0) {
      ASSIGN_OR_RETURN(c, s3_->TakeChecksums(Tag(i)));
    }
    out->push_back({it.offset, it.length, it.data_offset, it.data_length, c.crc32c});
  }
  return Status::OK();
}

}  // namespace ckptfs
