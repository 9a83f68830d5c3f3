#include "core/compute.h"

#include <algorithm>
#include <atomic>

#include "core/cast.h"

namespace ckptfs {
namespace {

std::atomic<uint64_t> next_id{1};

uint64_t RowBytes(const Computation& c) {
  const Shape& s = c.shape();
  uint64_t n = 1;
  for (size_t d = 1; d < s.size(); ++d) n *= s[d];
  return ByteSize(c.dtype(), n).value_or(0);
}

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
    if (in.rank() > 0) {
      uint64_t first, count;
      BlockRows(b, &first, &count);
      in.offsets[0] += first;
      in.lengths[0] = count;
    }
    return {{tensor_, std::move(in)}};
  }

  Result<std::string> Compute(uint64_t b, const std::vector<std::string>& inputs) const override {
    const uint64_t n = (block_end(b) - block_begin(b)) * 8 / DTypeBits(to_);
    if (inputs.size() != 1 || inputs[0].size() != ByteSize(tensor_->dtype, n).value_or(~0ull))
      return Status::Corruption(what() + ": block " + std::to_string(b) + " got inputs of the wrong size");
    std::string out(n * DTypeBits(to_) / 8, '\0');
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

uint64_t Computation::block_rows() const {
  const Shape& s = shape();
  if (s.empty()) return 1;
  const uint64_t row = RowBytes(*this);
  if (row == 0) return std::max<uint64_t>(s[0], 1);
  return std::clamp<uint64_t>(kComputeBlockBytes / row, 1, std::max<uint64_t>(s[0], 1));
}

uint64_t Computation::block_count() const {
  const Shape& s = shape();
  if (s.empty()) return 1;
  return std::max<uint64_t>((s[0] + block_rows() - 1) / block_rows(), 1);
}

void Computation::BlockRows(uint64_t b, uint64_t* first, uint64_t* count) const {
  const uint64_t rows = shape().empty() ? 1 : shape()[0];
  *first = std::min(b * block_rows(), rows);
  *count = std::min(block_rows(), rows - *first);
}

uint64_t Computation::block_begin(uint64_t b) const {
  if (shape().empty()) return 0;
  return std::min(b * block_rows(), shape()[0]) * RowBytes(*this);
}

uint64_t Computation::block_end(uint64_t b) const {
  if (shape().empty()) return nbytes();
  return std::min((b + 1) * block_rows(), shape()[0]) * RowBytes(*this);
}

std::shared_ptr<const Computation> MakeCast(std::shared_ptr<const TensorMeta> tensor, const Box& box, DType to) {
  return std::make_shared<const Cast>(std::move(tensor), box, to);
}

}  // namespace ckptfs
