#include "core/layout.h"

#include <algorithm>

#include "core/safetensors.h"

namespace ckptfs {

size_t Layout::SegmentAt(uint64_t offset) const {
  auto it = std::upper_bound(segments_.begin(), segments_.end(), offset,
                             [](uint64_t off, const Segment& s) { return off < s.offset; });
  return it == segments_.begin() ? 0 : size_t(it - segments_.begin()) - 1;
}

void Layout::AddLiteral(std::string bytes) {
  Segment s;
  s.kind = Segment::Kind::kLiteral;
  s.offset = size_;
  s.length = bytes.size();
  bytes.shrink_to_fit();  // a header built by appending has up to twice its size allocated
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

void Layout::AddComputed(std::shared_ptr<const Computation> c) {
  Segment s;
  s.kind = Segment::Kind::kComputed;
  s.offset = size_;
  s.length = c->nbytes();
  s.computed = std::move(c);
  size_ += s.length;
  if (s.length) segments_.push_back(std::move(s));
}

Shape TensorSlice::shape() const {
  if (joined.empty()) return box.lengths;
  Shape s = joined[0].lengths;
  for (size_t i = 1; i < joined.size(); ++i) s[join_dim] += joined[i].lengths[join_dim];
  return s;
}

uint64_t TensorSlice::nbytes() const {
  uint64_t n = 1;
  for (uint64_t d : shape()) n *= d;
  return ByteSize(dtype(), n).value_or(0);
}

std::vector<Box> TensorSlice::ByteOrder() const {
  if (joined.empty()) return {box};
  if (join_dim == 0) return joined;
  // One pass per index of the leading dims (all parts share them).
  const Box& first = joined[0];
  Shape outer(first.lengths.begin(), first.lengths.begin() + join_dim);
  uint64_t count = 1;
  for (uint64_t d : outer) count *= d;
  std::vector<Box> out;
  out.reserve(count * joined.size());
  std::vector<uint64_t> at(outer.size(), 0);
  for (uint64_t i = 0; i < count; ++i) {
    for (const Box& part : joined) {
      Box b = part;
      for (size_t d = 0; d < outer.size(); ++d) {
        b.offsets[d] = part.offsets[d] + at[d];
        b.lengths[d] = 1;
      }
      out.push_back(std::move(b));
    }
    for (size_t d = outer.size(); d-- > 0;)
      if (++at[d] < outer[d]) break;
      else at[d] = 0;
  }
  return out;
}

void SortForSafetensors(SliceList& slices) {
  std::stable_sort(slices.begin(), slices.end(), [](const TensorSlice& a, const TensorSlice& b) {
    int ra = DTypeAlignmentRank(a.dtype()), rb = DTypeAlignmentRank(b.dtype());
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
    entries.push_back({s.entry_name(), s.dtype(), s.shape(), at, at + n});
    at += n;
  }
  return entries;
}

}  // namespace

Result<Layout> SafetensorsFileLayout(const SliceList& slices, const std::map<std::string, std::string>& metadata) {
  ASSIGN_OR_RETURN(std::string header, EncodeSafetensorsHeader(Entries(slices), metadata, kVirtualDataAlignment));
  Layout layout;
  layout.Reserve(slices.size() + 1);  // exact unless tensors are joined
  layout.AddLiteral(std::move(header));
  for (const TensorSlice& s : slices) {
    if (s.computed) {
      layout.AddComputed(s.computed);
      continue;
    }
    for (const Box& b : s.ByteOrder()) {
      if (s.cast && *s.cast != s.tensor->dtype) {
        if (!InBounds(b, s.tensor->shape))
          return Status::InvalidArgument("box " + ToString(b) + " is outside tensor '" + s.tensor->fqn + "'");
        layout.AddComputed(MakeCast(s.tensor, b, *s.cast));
      } else {
        RETURN_IF_ERROR(layout.AddTensor(s.tensor, b));
      }
    }
  }
  return layout;
}

uint64_t SafetensorsHeaderSize(const SliceList& slices, const std::map<std::string, std::string>& metadata) {
  auto h = EncodeSafetensorsHeader(Entries(slices), metadata, kVirtualDataAlignment);
  return h.ok() ? h->size() : kMaxSafetensorsHeader + 1;
}

}  // namespace ckptfs
