// One rank's safetensors file of the HF layout (torch's
// HuggingFaceStorageWriter with save_distributed=True: docs/WRITER.md),
// written through the stager.
//
// The file is what safetensors' reference serializer (`safetensors.torch.save`,
// which torch's writer calls) makes of the same tensors: data sorted by
// dtype, descending in the crate's dtype order, then by name; entries
// abutting from 0; the JSON header (core/safetensors.h) padded with spaces
// so the data starts at a multiple of 8. Only the order of `__metadata__`'s
// keys differs: the reference writes them from a hash map (any order, it
// changes between processes), this writer sorts them.
//
// Tensors are planned first (AddTensor), then Seal lays the file out and
// queues the header, then each tensor's bytes are written (Write, in
// slices, in order). The bytes lie back to back as raw items of a
// DcpFileWriter, which does the staging, draining, truncation and fsync;
// the header is its first item. Finish returns per tensor, in AddTensor
// order, where its raw bytes lie and their CRC32C.
//
// On object storage (CreateS3) the file is an S3 multipart upload through
// an S3Stager, as DcpFileWriter's: Seal opens the upload (the file's size
// is known then) before the header is queued; Finish waits until every
// part is uploaded and `upload()` holds the parts to complete it with. The
// caller completes it when the save's protocol says (the HF layout on S3
// completes every rank's shard at commit, rank 1's last), or Aborts it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "core/safetensors.h"
#include "core/status.h"
#include "writer/dcp_file_writer.h"
#include "writer/stager.h"

namespace ckptfs {

struct SafetensorsItemResult {
  uint64_t offset = 0, length = 0;  // the tensor's raw bytes in the file
  uint32_t crc32c = 0;              // of those bytes
};

// The position of `t` in the safetensors crate's dtype order (its `Dtype`
// enum; a file holds larger positions first).
int SafetensorsDTypeOrder(DType t);

// How safetensors.torch.save stores a tensor of torch dtype `torch_dtype`
// and `shape`: its dtype and header shape. torch.float4_e2m1fn_x2 (bytes of
// two E2M1 values) is F4 with the last dim doubled, counted in values.
// NotSupported (naming the dtype) for what safetensors cannot hold, as
// torch's HuggingFaceStorageWriter fails on it too: complex128, complex32,
// a 0-d float4_e2m1fn_x2, sub-byte/bits/quantized dtypes. Lets a save be
// refused before anything is written.
struct SafetensorsType {
  DType dtype;
  std::vector<uint64_t> shape;
};
Result<SafetensorsType> SafetensorsTypeOf(const std::string& torch_dtype, std::vector<uint64_t> shape);

class SafetensorsFileWriter {
 public:
  // Creates `path` through `stager` (which must outlive this writer).
  static Result<std::unique_ptr<SafetensorsFileWriter>> Create(Stager* stager, const std::string& path);
  // An S3 object `key` (a full key) through `stager` (which must outlive this writer).
  static Result<std::unique_ptr<SafetensorsFileWriter>> CreateS3(S3Stager* stager, const std::string& key);

  // Planning. `dtype` is torch's name ("bfloat16"), `shape` torch's; the
  // bytes are row-major. Fails for a dtype safetensors cannot hold
  // (SafetensorsTypeOf), a size that does not match
  // the shape, a name given twice, or after Seal.
  Result<uint32_t> AddTensor(const std::string& name, const std::string& dtype, const std::vector<uint64_t>& shape,
                             uint64_t nbytes);
  // Lays the file out with `metadata` as `__metadata__` and queues the header.
  Status Seal(const std::map<std::string, std::string>& metadata);

  // The next `src.size` bytes of tensor `item` (see Stager::Write for copy_host).
  Status Write(uint32_t item, const Slice& src, bool copy_host);

  // Drains, fsyncs and closes the file.
  Result<std::vector<SafetensorsItemResult>> Finish();

  const std::string& path() const { return file_->path(); }
  // After Seal: where each tensor's bytes begin in the data section, in
  // AddTensor order. An S3 file takes its bytes in file order (a part is
  // contiguous bytes of the object), so its writer writes tensors by this.
  std::vector<uint64_t> DataBegins() const;
  // S3: the uploaded parts, after Finish.
  const S3ObjectUpload& upload() const { return file_->upload(); }
  // S3: aborts the upload (after a failure); a POSIX file: nothing.
  Status Abort() { return file_->Abort(); }
  uint64_t file_size() const { return file_->file_size(); }

 private:
  explicit SafetensorsFileWriter(std::unique_ptr<DcpFileWriter> file) : file_(std::move(file)) {}

  std::unique_ptr<DcpFileWriter> file_;
  std::vector<SafetensorsEntry> entries_;  // AddTensor order; begin/end set by Seal
  std::unordered_set<std::string> names_;
  std::vector<uint32_t> items_;            // the DcpFileWriter item of each entry
  std::string header_;                     // written from here: kept until Finish
  bool sealed_ = false;
};

}  // namespace ckptfs
