#include "core/layout.h"

#include <algorithm>

#include "core/safetensors.h"

namespace ckptfs {

void Layout::AddLiteral(std::string bytes) {
  Segment s;
  s.kind = Segment::Kind::kLiteral;
  s.offset = size_;
  s.length = bytes.size();
  s.literal = std::make_shared<const std::string>(std::move(bytes));
  size_ += s.length;
  if (s.length) segments_.push_back(std::move(s));
}

Status Layout::AddTensor(std::shared_ptr<const TensorMeta> tensor, const Box& box) {
  if (!InBounds(box, tensor->shape))
    return Status::InvalidArgument("box " + ToString(box) + " is outside tensor '" + tensor->fqn +
                                   "' " + ShapeToString(tensor->shape));
  auto bytes = ByteSize(tensor->dtype, box.numel());
  if (!bytes)
    return Status::NotSupported("box " + ToString(box) + " of " +
                                std::string(DTypeName(tensor->dtype)) + " tensor '" + tensor->fqn +
                                "' is not a whole number of bytes");
  Segment s;
  s.kind = Segment::Kind::kTensor;
  s.offset = size_;
  s.length = *bytes;
  s.tensor = std::move(tensor);
  s.box = box;
  size_ += s.length;
  if (s.length) segments_.push_back(std::move(s));
  return Status::OK();
}

Status Layout::AddTensorAsFloat32(std::shared_ptr<const TensorMeta> tensor, const Box& box) {
  RETURN_IF_ERROR(AddTensor(tensor, box));
  if (segments_.empty() || segments_.back().tensor != tensor) return Status::OK();  // empty box
  Segment& s = segments_.back();
  size_ -= s.length;
  s.convert = true;
  s.as = DType::kF32;
  s.length = box.numel() * 4;
  size_ += s.length;
  return Status::OK();
}

void Layout::AddSource(FileId file, uint64_t file_offset, uint64_t length) {
  Segment s;
  s.kind = Segment::Kind::kSource;
  s.offset = size_;
  s.length = length;
  s.file = file;
  s.file_offset = file_offset;
  size_ += length;
  if (length) segments_.push_back(std::move(s));
}

void SortForSafetensors(SliceList& slices) {
  std::stable_sort(slices.begin(), slices.end(), [](const TensorSlice& a, const TensorSlice& b) {
    int ra = DTypeAlignmentRank(a.tensor->dtype), rb = DTypeAlignmentRank(b.tensor->dtype);
    if (ra != rb) return ra > rb;
    return a.entry_name() < b.entry_name();
  });
}

namespace {

std::vector<SafetensorsEntry> Entries(const SliceList& slices) {
  std::vector<SafetensorsEntry> entries;
  uint64_t at = 0;
  for (const TensorSlice& s : slices) {
    uint64_t n = s.nbytes();
    entries.push_back({s.entry_name(), s.tensor->dtype, s.box.lengths, at, at + n});
    at += n;
  }
  return entries;
}

}  // namespace

Result<Layout> SafetensorsFileLayout(const SliceList& slices, const std::map<std::string, std::string>& metadata) {
  ASSIGN_OR_RETURN(std::string header, EncodeSafetensorsHeader(Entries(slices), metadata, kVirtualDataAlignment));
  Layout layout;
  layout.AddLiteral(std::move(header));
  for (const TensorSlice& s : slices) RETURN_IF_ERROR(layout.AddTensor(s.tensor, s.box));
  return layout;
}

uint64_t SafetensorsHeaderSize(const SliceList& slices, const std::map<std::string, std::string>& metadata) {
  auto h = EncodeSafetensorsHeader(Entries(slices), metadata, kVirtualDataAlignment);
  return h.ok() ? h->size() : kMaxSafetensorsHeader + 1;
}

}  // namespace ckptfs
