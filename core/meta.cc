#include "core/meta.h"

namespace ckptfs {

uint64_t TensorMeta::numel() const { return Box::Whole(shape).numel(); }

uint64_t TensorMeta::nbytes() const { return ByteSize(dtype, numel()).value_or(0); }

}  // namespace ckptfs
