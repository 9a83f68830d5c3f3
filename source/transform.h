// Decoding of transformed items (DCP `transform_descriptors`, torch >= 2.7):
// today "stream.zstd/1", a zstd stream around the item's bytes.
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"
#include "source/source.h"

namespace ckptfs {

// "zstd" for a descriptor this build decodes ("stream.zstd/1"); "" otherwise.
std::string TransformName(const std::string& descriptor);

// Decodes [offset, offset + length) of `in` with `transform`. Fails
// (Corruption) on a malformed stream or one decoding to more than
// `max_bytes` (a bound on memory for hostile input).
Result<std::string> DecodeItem(const std::string& transform, const SourceObject& in, uint64_t offset, uint64_t length,
                               uint64_t max_bytes, const std::string& what);

}  // namespace ckptfs
