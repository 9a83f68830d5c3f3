// torch.save archives, read in place: where each tensor's bytes are.
//
// A torch.save file (`pytorch_model.bin`, `*.pt`, and each TORCH_SAVE item
// inside a DCP `.distcp` file) is a zip whose entries are all stored
// (uncompressed): `<root>/data.pkl` describes the object, `<root>/data/<key>`
// holds one storage's raw bytes (format: docs/FORMATS.md, "torch.save
// archives"). Because entries are stored, a tensor is a strided view of a
// byte range of the file, and nothing needs to be decompressed or copied to
// index it. This reader:
//   - works on a byte range [base, base + length) of a file, because DCP
//     items are archives embedded at an offset;
//   - finds the end-of-central-directory record (and the zip64 locator and
//     record, which torch always writes), reads the central directory, and
//     takes sizes from it: torch writes zero sizes and CRCs in local headers;
//   - takes each entry's data offset from its local header (30 bytes + name
//     + extra, the extra holding the `FB` padding that 64-byte-aligns data);
//   - requires stored, unencrypted entries, and keeps every offset inside the
//     range (Corruption otherwise);
//   - unpickles data.pkl with the restricted unpickler (indexer/pickle.h; no
//     code runs) and finds the tensors by walking dicts, lists and tuples.
//
// Tensors are `torch._utils._rebuild_tensor_v2(storage, storage_offset,
// size, stride, requires_grad, backward_hooks[, metadata])` with a typed
// storage (`torch.BFloat16Storage`, numel in elements), or
// `_rebuild_tensor_v3(..., dtype[, metadata])` with `UntypedStorage` (numel in
// bytes; torch uses it for float8 and uint16+). nn.Parameter wrappers
// (`_rebuild_parameter*`, `_rebuild_from_type_v2`) are looked through.
// Storages are persistent ids ('storage', StorageClass, key, location, numel).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "indexer/pickle.h"
#include "source/source.h"

namespace ckptfs {

struct TorchZipLimits {
  // The central directory is read whole; torch writes ~100 bytes per entry,
  // so 256 MiB is ~2.5M entries.
  uint64_t max_central_directory_bytes = 256ull << 20;
  uint64_t max_entries = 10'000'000;
  // data.pkl is read whole before unpickling.
  uint64_t max_pickle_bytes = 1ull << 30;
  UnpickleLimits pickle;
};

struct ZipEntry {
  std::string name;
  uint64_t data_offset = 0;  // absolute offset in the file of the first data byte
  uint64_t size = 0;         // from the central directory
  uint32_t crc32 = 0;        // as recorded; not verified (torch may leave it 0)
};

struct ZipDirectory {
  std::vector<ZipEntry> entries;  // central directory order
  const ZipEntry* Find(std::string_view name) const;  // linear: for a few lookups
};

// Reads the directory of the zip occupying [base, base + length) of `fd`.
// `what` names the file (and item) in error messages.
Result<ZipDirectory> ReadZipDirectory(int fd, uint64_t base, uint64_t length, const std::string& what,
                                      const TorchZipLimits& limits = {});

// One tensor found in the archive's object.
struct TorchTensorRecord {
  // Key path from the root object: dict keys (str; int keys in decimal),
  // list/tuple indices in decimal. {"model", "layer.weight"}; {} when the
  // archive holds a bare tensor.
  std::vector<std::string> path;
  DType dtype = DType::kF32;
  std::string torch_dtype;        // "bfloat16", ...
  std::vector<uint64_t> shape;
  std::vector<uint64_t> strides;  // in elements, as saved (need not be contiguous)
  uint64_t storage_offset = 0;    // in elements
  std::string storage_key;        // `<root>/data/<key>`
  // Absolute file offset of element `storage_offset` (the tensor's first
  // element), and the bytes of storage from there to its end. Every element
  // the shape and strides reach lies inside that span (checked).
  uint64_t data_offset = 0;
  uint64_t storage_bytes_available = 0;
};

struct TorchArchive {
  std::string root;  // the entries' common folder ("archive", "pytorch_model", ...)
  ZipDirectory zip;
  // The whole inert object, for non-tensor values (DCP BYTE_IO items, step
  // counters, `_metadata`). Tensors appear in it as Reduce nodes.
  std::shared_ptr<const PickleDocument> pickle;
  std::vector<TorchTensorRecord> tensors;  // in the order the walk meets them
};

// The bytes at either end of a torch.save archive that ReadTorchArchive
// reads when torch wrote it (one tensor): at the head, the local headers,
// data.pkl and byteorder before the first storage's bytes (about 640
// bytes); at the tail, the records after the last storage, the central
// directory and the end records (under 1 KiB). A reader that fetches
// these ahead (ReadTorchArchive over a WindowedObject) answers it without a
// round trip; an archive that needs more still reads it, just not ahead.
constexpr uint64_t kTorchArchiveHeadBytes = 2048;
constexpr uint64_t kTorchArchiveTailBytes = 2048;

// Reads the torch.save archive occupying [base, base + length) of `fd`.
// Errors: Corruption (malformed zip, pickle or tensor; a tensor reaching past
// its storage), NotSupported (compressed or encrypted entries, big-endian
// archives, dtypes safetensors cannot name such as complex128), IOError.
// Tensors are found through dicts (incl. OrderedDict), lists, tuples and the
// objects BUILD wrapped; ones inside other objects' arguments or state are
// not reported. Globals outside the allowlist do not fail the read; see
// pickle->unknown_globals().
Result<TorchArchive> ReadTorchArchive(const SourceObject& src, uint64_t base, uint64_t length,
                                      const std::string& what, const TorchZipLimits& limits = {});
// The same over descriptor `fd` (tests, fuzzing, the writer's checks).
Result<TorchArchive> ReadTorchArchive(int fd, uint64_t base, uint64_t length, const std::string& what,
                                      const TorchZipLimits& limits = {});

// Opens `path` and reads the archive that is the whole file.
Result<TorchArchive> ReadTorchArchiveFile(const std::string& path, const TorchZipLimits& limits = {});

// ---- Helpers other torch readers share (DCP .metadata, ByteCheckpoint). ----

// A torch dtype name (`bfloat16`, the name of the `torch bfloat16` global;
// aliases `float`, `half`, `long` ... accepted) as a safetensors dtype;
// nullopt for dtypes safetensors cannot name.
std::optional<DType> DTypeFromTorchName(std::string_view torch_name);
// The canonical torch name of `dtype` (`bfloat16`), "" when torch has none.
std::string_view TorchNameOf(DType dtype);
// The dtype of a typed storage class (`FloatStorage` ...); nullopt otherwise.
std::optional<DType> DTypeFromTorchStorage(std::string_view class_name);

// A tensor rebuild call, independent of where its storage lives.
struct TorchTensorRef {
  DType dtype = DType::kF32;
  std::string torch_dtype;
  std::vector<uint64_t> shape;
  std::vector<uint64_t> strides;
  uint64_t storage_offset = 0;  // elements
  std::string storage_key;
  std::string location;         // "cpu", "cuda:0"
  uint64_t storage_nbytes = 0;  // as declared by the persistent id
};

// nullopt when `v` is not a tensor rebuild call (after looking through
// Parameter wrappers); Corruption when it is one but malformed, including a
// shape/stride/offset that reaches past the declared storage.
Result<std::optional<TorchTensorRef>> MatchTorchTensor(const PickleValue& v);

// A tuple of non-negative ints, or torch.Size(tuple) (how DCP metadata spells
// sizes and offsets); nullopt otherwise.
std::optional<std::vector<uint64_t>> AsShape(const PickleValue& v);

}  // namespace ckptfs
