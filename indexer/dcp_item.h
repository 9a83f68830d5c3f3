// One DCP tensor item (a torch.save archive inside a `.distcp` file) and the
// chunk it holds: placed by its framing (PlaceItemChunk), or predicted from
// the metadata alone and checked against the framing later (PredictItem,
// ItemCheck in core/meta.h).
//
// Why predict. The framing holds the tensor's strides and where its bytes
// start, which a plan needs before any byte is served. Read when the step
// is indexed, it costs one small GET per gap between items over object
// storage (~290 for a 1 GiB step), most of a fresh mount's start. But
// torch.save of a contiguous tensor into DCP's stream is deterministic
// (its records, their 64-byte padding, the pickle TorchTensorPickle writes):
// from the item's extent, dtype and shape the bytes' place is known, and the framing arrives with them when the
// item is read in source order (source/ordered_fetch.h). A prediction is
// only a plan: nothing is served before VerifyItem read the framing, with
// the same parser as an eager index, and found the chunk where predicted;
// found elsewhere (a transposed view saved as it is, another torch), the
// chunk is planned where the framing says.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/meta.h"
#include "indexer/torch_zip.h"

namespace ckptfs {

// Points `c` at the archive's one tensor (file `data_file`), or marks it
// unavailable saying why (`rel` names the item): the tensor must be of
// `tensor_dtype` (or float4_e2m1fn_x2 bytes of an F4 one) and of the
// chunk's box shape.
void PlaceItemChunk(const TorchArchive& archive, const std::string& rel, FileId data_file, DType tensor_dtype,
                    Chunk& c);

// The check of a chunk whose bytes torch.save would put at a place known
// without reading (a contiguous `dtype` tensor of `shape` saved alone in
// `item`), or null when the place is not known: a dtype the framing model
// does not write, an item whose length is not what torch.save writes for
// it. The chunk's ByteMeta is then check->predicted.
std::shared_ptr<ItemCheck> PredictItem(const ByteMeta& item, DType dtype, const Shape& shape);

// The check of a chunk read back from the index (predicted at
// check->predicted), to be settled again.
std::shared_ptr<ItemCheck> ItemCheckOf(const Chunk& c, const ByteMeta& item, DType dtype);

// The two windows of `item` (file offset, length) whose bytes VerifyItem
// reads when torch wrote the item: its head and its tail.
std::vector<std::pair<uint64_t, uint64_t>> FramingWindows(const ByteMeta& item);

// ItemCheck::Verify: parses the item's framing through `obj` and settles
// `check`. A read failure (I/O, a changed source, a refusal) is returned
// and settles nothing; anything wrong with the bytes settles it wrong with
// the reason.
Status VerifyItem(const SourceObject& obj, ItemCheck& check, const std::string& what);

}  // namespace ckptfs
