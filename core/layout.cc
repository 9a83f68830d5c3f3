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

void SortForSafetensors(std::vector<std::shared_ptr<const TensorMeta>>& tensors) {
  std::stable_sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) {
    int ra = DTypeAlignmentRank(a->dtype), rb = DTypeAlignmentRank(b->dtype);
    if (ra != rb) return ra > rb;
    return a->fqn < b->fqn;
  });
}

namespace {

std::vector<SafetensorsEntry> Entries(const std::vector<std::shared_ptr<const TensorMeta>>& tensors) {
  std::vector<SafetensorsEntry> entries;
  uint64_t at = 0;
  for (const auto& t : tensors) {
    uint64_t n = t->nbytes();
    entries.push_back({t->fqn, t->dtype, t->shape, at, at + n});
    at += n;
  }
  return entries;
}

}  // namespace

Result<Layout> SafetensorsFileLayout(const std::vector<std::shared_ptr<const TensorMeta>>& tensors,
                                     const std::map<std::string, std::string>& metadata) {
  ASSIGN_OR_RETURN(std::string header, EncodeSafetensorsHeader(Entries(tensors), metadata));
  Layout layout;
  layout.AddLiteral(std::move(header));
  for (const auto& t : tensors) RETURN_IF_ERROR(layout.AddTensor(t, Box::Whole(t->shape)));
  return layout;
}

uint64_t SafetensorsHeaderSize(const std::vector<std::shared_ptr<const TensorMeta>>& tensors,
                               const std::map<std::string, std::string>& metadata) {
  auto h = EncodeSafetensorsHeader(Entries(tensors), metadata);
  return h.ok() ? h->size() : kMaxSafetensorsHeader + 1;
}

}  // namespace ckptfs
