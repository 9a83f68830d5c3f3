// A one-chunk u8 tensor whose bytes are a range of one source file: the
// read-path tests lay such tensors out to know each virtual byte's source.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/layout.h"

namespace ckptfs {

// Tensor `fqn` of `length` u8 values, bytes [offset, offset + length) of `file`.
inline std::shared_ptr<TensorMeta> U8Tensor(const std::string& fqn, FileId file, uint64_t offset,
                                            uint64_t length) {
  auto tensor = std::make_shared<TensorMeta>();
  tensor->fqn = fqn;
  tensor->dtype = DType::kU8;
  tensor->shape = {length};
  Chunk c;
  c.set_box(Box::Whole(tensor->shape));
  c.set_dtype(DType::kU8);
  c.set_bytes({file, offset, length});
  tensor->chunks.push_back(c);
  return tensor;
}

}  // namespace ckptfs
