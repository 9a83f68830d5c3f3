#include "indexer/dcp_item.h"

#include <algorithm>
#include <optional>
#include <string_view>

#include "core/coverage.h"
#include "indexer/readers.h"
#include "indexer/torch_save_framing.h"

namespace ckptfs {
namespace {

// A float4_e2m1fn_x2 item (bytes of two F4 values): the metadata's F4 box
// counts values, so its last dim is twice the item's.
void PlacePackedF4(const TorchTensorRecord& r, const std::string& rel, FileId data_file, Chunk& c) {
  std::vector<uint64_t> values = r.shape;
  if (!values.empty()) values.back() *= 2;
  if (values != c.box().lengths)
    c.set_unavailable(rel + ": the item's shape " + ShapeToString(r.shape) + " (float4_e2m1fn_x2) is not the chunk's " +
                      ShapeToString(c.box().lengths) + " F4 values");
  else if (!NormalizeStrides(r.shape, r.strides).empty())
    c.set_unavailable(rel + ": a non-contiguous float4_e2m1fn_x2 item is not supported");
  else
    c.set_bytes({data_file, r.data_offset, r.storage_bytes_available});
}

// Where torch.save puts a contiguous tensor's bytes when it writes to a
// stream it cannot seek, as DCP's FileSystemWriter has it do for each item
// (torch 2.x's PyTorchStreamWriter): every record's local header carries no
// sizes but an `FB` extra field that pads its data to 64 bytes, and a data
// descriptor of 16 bytes follows the data; then the central directory (46
// bytes and the name per record) and the zip64 end records (98 bytes).
// data.pkl is the one TorchTensorPickle writes plus the pickler's memo
// (a BINPUT of 2 bytes per global, string, non-empty tuple and reduce).
struct StreamedArchive {
  uint64_t data_offset = 0;  // of the tensor's bytes, from the archive's start
  uint64_t total = 0;
};

std::optional<StreamedArchive> StreamedLayout(std::string_view dtype, const Shape& shape, uint64_t nbytes) {
  constexpr uint64_t kAlign = 64, kLocal = 30, kField = 4, kDescriptor = 16, kCentral = 46, kEnd = 56 + 20 + 22;
  constexpr uint64_t kZip32 = 0xFFFFFFFFull;
  auto pickle = TorchTensorPickle(std::string(dtype), shape);
  if (!pickle.ok()) return std::nullopt;
  const bool v3 = pickle->find("_rebuild_tensor_v3") != std::string::npos;
  const uint64_t memo = (v3 ? 13 : 12) - (shape.empty() ? 2 : 0);
  const std::pair<std::string_view, uint64_t> records[] = {
      {"archive/data.pkl", pickle->size() + 2 * memo}, {"archive/.format_version", 1},
      {"archive/.storage_alignment", 2}, {"archive/byteorder", 6}, {"archive/data/0", nbytes},
      {"archive/version", 2}, {"archive/.data/serialization_id", 40}};
  StreamedArchive out;
  uint64_t at = 0, central = kEnd;
  for (const auto& [name, size] : records) {
    if (size >= kZip32 || at >= kZip32) return std::nullopt;  // zip64 extras: not predicted
    const uint64_t start = at + kLocal + name.size() + kField;
    const uint64_t data = start + (kAlign - start % kAlign) % kAlign;
    if (name == "archive/data/0") out.data_offset = data;
    at = data + size + kDescriptor;
    central += kCentral + name.size();
  }
  out.total = at + central;
  return out;
}

}  // namespace

void PlaceItemChunk(const TorchArchive& archive, const std::string& rel, FileId data_file, DType tensor_dtype,
                    Chunk& c) {
  if (archive.tensors.size() != 1) {
    c.set_unavailable(rel + ": the item holds " + std::to_string(archive.tensors.size()) + " tensors, not 1");
    return;
  }
  const TorchTensorRecord& r = archive.tensors[0];
  if (r.torch_dtype == "float4_e2m1fn_x2" && tensor_dtype == DType::kF4) return PlacePackedF4(r, rel, data_file, c);
  if (r.dtype != tensor_dtype) {
    c.set_unavailable(rel + ": the item is " + std::string(DTypeName(r.dtype)) + ", the metadata says " +
                      std::string(DTypeName(tensor_dtype)));
  } else if (r.shape != c.box().lengths) {
    c.set_unavailable(rel + ": the item's shape " + ShapeToString(r.shape) + " is not the chunk's " +
                      ShapeToString(c.box().lengths));
  } else {
    c.set_bytes({data_file, r.data_offset, r.storage_bytes_available});
    c.set_strides(NormalizeStrides(r.shape, r.strides));
  }
}

std::shared_ptr<ItemCheck> PredictItem(const ByteMeta& item, DType dtype, const Shape& shape) {
  if (PackGroup(dtype) != 1) return nullptr;  // sub-byte dtypes: packed, placed by their framing
  const std::string_view name = TorchNameOf(dtype);
  uint64_t numel = 1;
  for (uint64_t d : shape) {
    if (d != 0 && numel > UINT64_MAX / d) return nullptr;
    numel *= d;
  }
  const uint64_t size = DTypeBits(dtype) / 8;
  if (name.empty() || numel > UINT64_MAX / size || numel * size > item.length) return nullptr;
  auto framing = StreamedLayout(name, shape, numel * size);
  if (!framing || framing->total != item.length) return nullptr;
  auto check = std::make_shared<ItemCheck>();
  check->item = item;
  check->predicted = {item.file, item.offset + framing->data_offset, numel * size};
  check->shape = shape;
  check->dtype = dtype;
  check->windows = FramingWindows(item);
  check->verify = &VerifyItem;
  return check;
}

std::shared_ptr<ItemCheck> ItemCheckOf(const Chunk& c, const ByteMeta& item, DType dtype) {
  auto check = std::make_shared<ItemCheck>();
  check->item = item;
  check->predicted = c.bytes();
  check->shape = c.box().lengths;
  check->dtype = dtype;
  check->windows = FramingWindows(item);
  check->verify = &VerifyItem;
  return check;
}

std::vector<std::pair<uint64_t, uint64_t>> FramingWindows(const ByteMeta& item) {
  const uint64_t head = std::min(item.length, kTorchArchiveHeadBytes);
  const uint64_t tail = std::min(item.length, kTorchArchiveTailBytes);
  return {{item.offset, head}, {item.offset + item.length - tail, tail}};
}

Status VerifyItem(const SourceObject& obj, ItemCheck& check, const std::string& what) {
  Box box;
  box.offsets.assign(check.shape.size(), 0);
  box.lengths = check.shape;
  Chunk c(box, check.item, check.dtype);
  auto archive = ReadTorchArchive(obj, check.item.offset, check.item.length, what);
  if (!archive.ok()) {
    switch (archive.status().code()) {
      case Status::Code::kIOError:
      case Status::Code::kStale:
      case Status::Code::kPermissionDenied: return archive.status();
      default: check.Settle(false, {}, {}, archive.status().message()); return Status::OK();
    }
  }
  PlaceItemChunk(*archive, what, check.item.file, check.dtype, c);
  // Found elsewhere, the chunk passes the indexer's bounds check before any
  // read is planned there (its strides could reach past its item).
  if (c.unavailable().empty())
    if (auto problem = ChunkBytesProblem(c, check.dtype)) c.set_unavailable(what + ":" + *problem);
  if (!c.unavailable().empty()) {
    check.Settle(false, {}, {}, c.unavailable());
  } else if (c.offset() == check.predicted.offset && c.strides().empty() && c.length() >= check.predicted.length) {
    check.Settle(true);
  } else {
    check.Settle(false, c.bytes(), c.strides());
  }
  return Status::OK();
}

}  // namespace ckptfs
