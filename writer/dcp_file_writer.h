// One rank's DCP data file (`__R_0.distcp`), written through the stager.
//
// Items are planned first (AddTensor / AddBytes lay them out back to back,
// in call order) and then written, each as one or more slices in order, so
// every byte's file offset is known before it is copied and the stager can
// write buffers in any order. A tensor item is a torch.save archive
// (torch_save_framing.h) whose framing is written at Finish, once the data's zip
// CRC-32 is known; a BYTE_IO item is its bytes as given (torch's writer
// stores torch.save'd objects raw the same way).
//
// Finish drains the stager, writes the framing, fsyncs the file and returns
// per item what DCP's `_StorageInfo` needs (offset, length of the item) and
// what a commit row needs (where the raw tensor bytes lie and their CRC32C).
//
// On object storage (CreateS3) the file is an S3 multipart upload through
// an S3Stager: Seal, once every item is planned, opens the upload (its size
// is known then) and leaves each archive's framing as holes the stager
// fills once the item's zip CRC-32 is known; Finish waits until every part
// is uploaded, and `upload()` holds the parts to complete it with (the
// caller completes it when the save's protocol says; Abort, after a failure).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "writer/s3_stager.h"
#include "writer/stager.h"
#include "indexer/torch_save_framing.h"

namespace ckptfs {

struct DcpItemResult {
  uint64_t offset = 0, length = 0;            // the DCP item (archive or raw bytes)
  uint64_t data_offset = 0, data_length = 0;  // the tensor's raw bytes (== the item for BYTE_IO)
  uint32_t crc32c = 0;                        // of the raw bytes
};

class DcpFileWriter {
 public:
  // Creates `path` through `stager` (which must outlive this writer).
  static Result<std::unique_ptr<DcpFileWriter>> Create(Stager* stager, const std::string& path);
  // An S3 object `key` (a full key) through `stager` (which must outlive this writer).
  static Result<std::unique_ptr<DcpFileWriter>> CreateS3(S3Stager* stager, const std::string& key);

  // After the last Add*: S3 opens the upload and plans the framing holes
  // (a POSIX file needs nothing). Writes need it on S3.
  Status Seal();
  // S3: the uploaded parts, after Finish.
  const S3ObjectUpload& upload() const { return upload_; }
  // S3: aborts the upload (after a failure); a POSIX file: nothing.
  Status Abort();

  // Planning. `dtype` is torch's name ("bfloat16"); the bytes are row-major.
  Result<uint32_t> AddTensor(const std::string& dtype, const std::vector<uint64_t>& shape, uint64_t nbytes,
                             bool force_zip64 = false);
  Result<uint32_t> AddBytes(uint64_t nbytes);

  // The next `src.size` bytes of `item` (see Stager::Write for copy_host).
  Status Write(uint32_t item, const Slice& src, bool copy_host);

  // Drains, writes the framing, fsyncs and closes the file.
  Result<std::vector<DcpItemResult>> Finish();

  uint64_t file_size() const { return end_; }
  const std::string& path() const { return path_; }

 private:
  struct Item {
    uint64_t offset = 0, length = 0, data_offset = 0, data_length = 0, written = 0;
    std::optional<TorchSaveFraming> archive;  // tensors only
  };
  DcpFileWriter(Stager* stager, int file, std::string path) : stager_(stager), file_(file), path_(std::move(path)) {}
  uint64_t Tag(uint32_t item) const { return (uint64_t(file_) << 40) | item; }
  Status FinishS3(std::vector<DcpItemResult>* out);

  Stager* stager_;
  S3Stager* s3_ = nullptr;
  S3ObjectUpload upload_;
  bool sealed_ = false;
  int file_;
  std::string path_;
  std::vector<Item> items_;
  uint64_t end_ = 0;
  bool finished_ = false;
};

}  // namespace ckptfs
