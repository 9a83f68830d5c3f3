#include "core/meta.h"

#include <algorithm>

namespace ckptfs {

uint64_t TensorMeta::numel() const { return Box::Whole(shape).numel(); }

uint64_t TensorMeta::nbytes() const { return ByteSize(dtype, numel()).value_or(0); }

static_assert(sizeof(Chunk) == 48, "a million chunks should fit in 48 MB");

// What does not fit a chunk's packed fields.
struct Chunk::Extra {
  Box box;          // kWideBox
  ByteMeta bytes;   // kWideBytes
  std::vector<uint64_t> strides;
  std::string unavailable;
  std::shared_ptr<ItemCheck> check;
};

namespace {

constexpr uint64_t k48Bits = (uint64_t{1} << 48) - 1;

bool FitsInline(const Box& box) {
  if (box.rank() > 2) return false;
  for (size_t d = 0; d < box.rank(); ++d)
    if (box.offsets[d] > UINT32_MAX || box.lengths[d] > UINT32_MAX) return false;
  return true;
}

}  // namespace

Chunk::Chunk(const Box& box, const ByteMeta& bytes, DType dtype) : dtype_(dtype) {
  set_box(box);
  set_bytes(bytes);
}

Chunk::Chunk(const Chunk& o) { *this = o; }

Chunk& Chunk::operator=(const Chunk& o) {
  if (this == &o) return *this;
  std::unique_ptr<Extra> copy = o.extra_ ? std::make_unique<Extra>(*o.extra_) : nullptr;
  std::copy(o.offsets_, o.offsets_ + 2, offsets_);
  std::copy(o.lengths_, o.lengths_ + 2, lengths_);
  offset_lo_ = o.offset_lo_, length_lo_ = o.length_lo_, offset_hi_ = o.offset_hi_, length_hi_ = o.length_hi_;
  file_ = o.file_, crc32c_ = o.crc32c_, dtype_ = o.dtype_, rank_ = o.rank_, flags_ = o.flags_;
  extra_ = std::move(copy);
  return *this;
}

Chunk::Chunk() = default;
Chunk::Chunk(Chunk&&) noexcept = default;
Chunk& Chunk::operator=(Chunk&&) noexcept = default;
Chunk::~Chunk() = default;

Chunk::Extra& Chunk::extra() {
  if (!extra_) extra_ = std::make_unique<Extra>();
  return *extra_;
}

// The heap block goes once nothing in it is used.
void Chunk::DropEmptyExtra() {
  if (extra_ && !(flags_ & (kWideBox | kWideBytes)) && extra_->strides.empty() && extra_->unavailable.empty() &&
      !extra_->check)
    extra_.reset();
}

Box Chunk::box() const {
  if (flags_ & kWideBox) return extra_->box;
  Box b;
  b.offsets.assign(rank_, 0);
  b.lengths.assign(rank_, 0);
  for (size_t d = 0; d < rank_; ++d) {
    b.offsets[d] = offsets_[d];
    b.lengths[d] = lengths_[d];
  }
  return b;
}

size_t Chunk::rank() const { return (flags_ & kWideBox) ? extra_->box.rank() : rank_; }

void Chunk::set_box(const Box& box) {
  flags_ &= ~kWideBox;
  rank_ = 0;
  offsets_[0] = offsets_[1] = lengths_[0] = lengths_[1] = 0;
  if (FitsInline(box)) {
    rank_ = uint8_t(box.rank());
    for (size_t d = 0; d < box.rank(); ++d) {
      offsets_[d] = uint32_t(box.offsets[d]);
      lengths_[d] = uint32_t(box.lengths[d]);
    }
    if (extra_) extra_->box = Box{};
  } else {
    flags_ |= kWideBox;
    extra().box = box;
  }
  DropEmptyExtra();
}

ByteMeta Chunk::bytes() const { return {file_, offset(), length()}; }

uint64_t Chunk::offset() const {
  if (flags_ & kWideBytes) return extra_->bytes.offset;
  return uint64_t{offset_hi_} << 32 | offset_lo_;
}

uint64_t Chunk::length() const {
  if (flags_ & kWideBytes) return extra_->bytes.length;
  return uint64_t{length_hi_} << 32 | length_lo_;
}

void Chunk::set_bytes(const ByteMeta& bytes) {
  file_ = bytes.file;
  flags_ &= ~kWideBytes;
  offset_lo_ = length_lo_ = offset_hi_ = length_hi_ = 0;
  if (bytes.offset <= k48Bits && bytes.length <= k48Bits) {
    offset_lo_ = uint32_t(bytes.offset), offset_hi_ = uint16_t(bytes.offset >> 32);
    length_lo_ = uint32_t(bytes.length), length_hi_ = uint16_t(bytes.length >> 32);
  } else {
    flags_ |= kWideBytes;
    extra().bytes = bytes;
  }
  DropEmptyExtra();
}

const std::vector<uint64_t>& Chunk::strides() const {
  static const std::vector<uint64_t> kRowMajor;
  return extra_ ? extra_->strides : kRowMajor;
}

void Chunk::set_strides(std::vector<uint64_t> strides) {
  if (strides.empty() && !extra_) return;
  extra().strides = std::move(strides);
  DropEmptyExtra();
}

const std::string& Chunk::unavailable() const {
  static const std::string kAvailable;
  return extra_ ? extra_->unavailable : kAvailable;
}

void Chunk::set_unavailable(std::string why) {
  if (why.empty() && !extra_) return;
  extra().unavailable = std::move(why);
  DropEmptyExtra();
}

const std::shared_ptr<ItemCheck>& Chunk::item_check() const {
  static const std::shared_ptr<ItemCheck> kNone;
  return extra_ ? extra_->check : kNone;
}

void Chunk::set_item_check(std::shared_ptr<ItemCheck> check) {
  if (!check && !extra_) return;
  extra().check = std::move(check);
  DropEmptyExtra();
}

void ItemCheck::Settle(bool as_predicted, ByteMeta actual, std::vector<uint64_t> strides, std::string why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (state_.load(std::memory_order_relaxed) != kUnchecked) return;
  if (!as_predicted) {
    actual_ = actual;
    actual_strides_ = std::move(strides);
    why_ = std::move(why);
  }
  state_.store(as_predicted ? kVerified : kWrong, std::memory_order_release);
}

std::shared_ptr<ItemCheck> ItemCheck::Renumbered(FileId by) const {
  auto out = std::make_shared<ItemCheck>();
  out->item = item;
  out->item.file += by;
  out->predicted = predicted;
  out->predicted.file += by;
  out->shape = shape;
  out->dtype = dtype;
  out->windows = windows;
  out->verify = verify;
  return out;
}

std::vector<ByteMeta> BytesOutsideChunks(const Checkpoint& ckpt, FileId file, uint64_t size) {
  std::vector<std::pair<uint64_t, uint64_t>> used;  // [begin, end)
  for (const auto& t : ckpt.tensors)
    for (const Chunk& c : t->chunks)
      if (c.file() == file && c.length() > 0) used.emplace_back(c.offset(), c.offset() + c.length());
  std::sort(used.begin(), used.end());
  std::vector<ByteMeta> out;
  uint64_t at = 0;
  for (const auto& [begin, end] : used) {
    if (begin > at) out.push_back({file, at, std::min(begin, size) - at});
    at = std::max(at, end);
    if (at >= size) break;
  }
  if (at < size) out.push_back({file, at, size - at});
  return out;
}

}  // namespace ckptfs
