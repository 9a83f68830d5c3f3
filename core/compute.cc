#include "core/compute.h"

#include <algorithm>
#include <atomic>

#include "core/cast.h"

namespace ckptfs {
namespace {

std::atomic<uint64_t> next_id{1};

class Cast : public Computation {
 public:
  Cast(std::shared_ptr<const TensorMeta> t, const Box& box, DType to)
      : tensor_(std::move(t)), box_(box), shape_(Shape(box.lengths)), to_(to) {}
  DType dtype() const override { return to_; }
  const Shape& shape() const override { return shape_; }
  std::string what() const override {
    return "cast of '" + tensor_->fqn + "' " + ToString(box_) + " to " + std::string(DTypeName(to_));
  }

  std::vector<ComputeInput> InputsOf(uint64_t b) const override {
    Box in = box_;
    const Box out = BlockBox(b);
    for (size_t d = 0; d < in.rank(); ++d) {
      in.offsets[d] += out.offsets[d];
      in.lengths[d] = out.lengths[d];
    }
    return {{tensor_, std::move(in)}};
  }

  Result<BlockBytes> Compute(uint64_t b, const std::vector<BlockBytes>& inputs) const override {
    const uint64_t n = (block_end(b) - block_begin(b)) * 8 / DTypeBits(to_);
    if (inputs.size() != 1 || inputs[0].size() != ByteSize(tensor_->dtype, n).value_or(~0ull))
      return Status::Corruption(what() + ": block " + std::to_string(b) + " got inputs of the wrong size");
    BlockBytes out(n * DTypeBits(to_) / 8);
    CastElements(tensor_->dtype, to_, reinterpret_cast<const uint8_t*>(inputs[0].data()), n,
                 reinterpret_cast<uint8_t*>(out.data()));
    return out;
  }

 private:
  std::shared_ptr<const TensorMeta> tensor_;
  Box box_;
  Shape shape_;  // box_.lengths as a Shape
  DType to_;
};

}  // namespace

Computation::Computation() : id_(next_id++) {}

uint64_t Computation::nbytes() const {
  uint64_t n = 1;
  for (uint64_t d : shape()) n *= d;
  return ByteSize(dtype(), n).value_or(0);
}

// How the output is cut: the dims before `dim` one index per block, `per`
// indices of `dim` per block, the dims after it whole (`inner` bytes for one
// index of `dim`).
struct Computation::Blocking {
  size_t dim = 0;
  uint64_t per = 1;
  uint64_t inner = 0;
  uint64_t span = 1;       // indices of `dim`
  uint64_t per_group = 1;  // blocks per index of the dims before `dim`
  uint64_t groups = 1;
};

Computation::Blocking Computation::blocking() const {
  const Shape& s = shape();
  Blocking k;
  if (s.empty() || nbytes() == 0) {
    k.span = k.per = s.empty() ? 1 : std::max<uint64_t>(s[0], 1);
    k.inner = 0;
    return k;
  }
  uint64_t inner_elements = 1;
  for (size_t d = 1; d < s.size(); ++d) inner_elements *= s[d];
  const size_t last = KeepsRowsWhole() ? 0 : s.size() - 1;
  // The first dim one index of which fits a block. Sub-byte dtypes cut rows only.
  while (k.dim < last) {
    auto bytes = ByteSize(dtype(), inner_elements);
    if (!bytes || *bytes <= kComputeBlockBytes) break;
    k.groups *= s[k.dim];
    ++k.dim;
    inner_elements /= s[k.dim];
  }
  k.inner = ByteSize(dtype(), inner_elements).value_or(0);
  k.span = s[k.dim];
  k.per = std::clamp<uint64_t>(k.inner ? kComputeBlockBytes / k.inner : k.span, 1, k.span);
  k.per_group = (k.span + k.per - 1) / k.per;
  return k;
}

uint64_t Computation::block_count() const {
  const Blocking k = blocking();
  return k.groups * k.per_group;
}

uint64_t Computation::block_begin(uint64_t b) const {
  const Blocking k = blocking();
  return (b / k.per_group) * k.span * k.inner + std::min((b % k.per_group) * k.per, k.span) * k.inner;
}

uint64_t Computation::block_end(uint64_t b) const {
  if (shape().empty()) return nbytes();
  const Blocking k = blocking();
  const uint64_t first = std::min((b % k.per_group) * k.per, k.span);
  return (b / k.per_group) * k.span * k.inner + std::min(first + k.per, k.span) * k.inner;
}

uint64_t Computation::BlockAt(uint64_t offset) const {
  const Blocking k = blocking();
  if (k.inner == 0) return 0;
  const uint64_t group_bytes = k.span * k.inner;
  return offset / group_bytes * k.per_group + offset % group_bytes / (k.per * k.inner);
}

Box Computation::BlockBox(uint64_t b) const {
  const Shape& s = shape();
  Box box = Box::Whole(s);
  if (s.empty() || nbytes() == 0) return box;
  const Blocking k = blocking();
  uint64_t group = b / k.per_group;
  for (size_t d = k.dim; d-- > 0;) {
    box.offsets[d] = group % s[d];
    box.lengths[d] = 1;
    group /= s[d];
  }
  box.offsets[k.dim] = std::min((b % k.per_group) * k.per, k.span);
  box.lengths[k.dim] = std::min(k.per, k.span - box.offsets[k.dim]);
  return box;
}

std::shared_ptr<const Computation> MakeCast(std::shared_ptr<const TensorMeta> tensor, const Box& box, DType to) {
  return std::make_shared<const Cast>(std::move(tensor), box, to);
}

}  // namespace ckptfs
