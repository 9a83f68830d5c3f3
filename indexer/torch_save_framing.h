// torch.save archives around raw tensor bytes, written without torch.
//
// Stock DCP (`FileSystemReader`) torch.loads every tensor item of a
// `.distcp` file, so each item must be a torch.save zip (docs/FORMATS.md,
// "torch.save archives"). The writer streams a tensor's bytes straight from
// the ring into the `data/0` entry and writes the few hundred bytes of zip
// framing around them afterwards, when the zip CRC-32 is known:
//
//   [head: data.pkl, .format_version, .storage_alignment, byteorder,
//          data/0's local header + `FB` padding] [tensor bytes, 64-aligned]
//   [tail: version, .data/serialization_id, central directory, zip64 end
//          record + locator, end record]
//
// The entries, their order and contents are those torch.save 2.x writes;
// data.pkl is `_rebuild_tensor_v2` with a typed storage for the legacy
// dtypes and `_rebuild_tensor_v3` with UntypedStorage for the others,
// exactly as torch pickles them, so torch.load(weights_only=True) and the
// ckptfs indexer (indexer/torch_zip.h) read them. Entries are stored; zip64
// extra fields appear when a size or offset needs them (or when forced, so
// tests reach that branch with small tensors).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace ckptfs {

struct TorchSaveSpec {
  std::string dtype;            // torch's name: "float32", "bfloat16", "float8_e4m3fn", ...
  std::vector<uint64_t> shape;  // the bytes are row-major (contiguous)
  uint64_t nbytes = 0;          // must equal numel * element size
  uint64_t file_offset = 0;     // where the archive starts in its file (the data is 64-aligned in the file)
  std::string serialization_id; // torch writes 40 decimal digits
  bool force_zip64 = false;
};

class TorchSaveFraming {
 public:
  static Result<TorchSaveFraming> Plan(const TorchSaveSpec& spec);

  uint64_t data_offset() const { return data_offset_; }  // relative to the archive's start
  uint64_t data_size() const { return spec_.nbytes; }
  uint64_t total_size() const { return total_size_; }

  // Bytes [0, data_offset) and [data_offset + data_size, total_size), given
  // the zip CRC-32 of the tensor bytes.
  std::string Head(uint32_t data_crc32) const;
  std::string Tail(uint32_t data_crc32) const;

  // Element size of a torch dtype name; 0 when unknown. Known: every dtype
  // torch's FileSystemWriter saves (torch 2.x: the legacy typed storages,
  // uint16/32/64, complex32, the float8 variants, float4_e2m1fn_x2).
  static uint64_t ElementSize(const std::string& dtype);

 private:
  struct Entry {
    std::string name;
    std::string data;     // small entries; data/0's bytes are the tensor's
    uint64_t offset = 0;  // of its local header, relative to the archive
    uint64_t size = 0;
    uint32_t crc = 0;
    uint16_t pad = 0;     // `FB` extra field length (data/0 only)
    bool zip64 = false;   // data/0: sizes need zip64; after Layout: the central entry needs zip64
  };
  std::string LocalHeader(const Entry& e, uint32_t crc) const;
  std::string CentralDirectory(uint32_t data_crc) const;
  void Layout();

  TorchSaveSpec spec_;
  std::vector<Entry> entries_;  // data/0 is entries_[kDataEntry]
  uint64_t data_offset_ = 0, total_size_ = 0, cd_offset_ = 0, cd_size_ = 0;
};

// data.pkl for one contiguous tensor (exposed for tests).
Result<std::string> TorchTensorPickle(const std::string& dtype, const std::vector<uint64_t>& shape);

}  // namespace ckptfs
