// Coverage check: the chunks of a tensor must tile it exactly once.
//
// Indexers call this after collecting chunks (replicated copies already
// dropped). Each problem names the fqn and a box so `ckptfs check` and read
// errors can say exactly which elements are missing or doubly stored.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/meta.h"

namespace ckptfs {

// Problems with `t`'s chunks: out-of-bounds boxes, dtype mismatches, byte
// lengths that disagree with the box, overlaps and holes. Empty when the
// chunks tile the tensor exactly once.
std::vector<std::string> CheckCoverage(const TensorMeta& t);

// Whether chunk `c` (of a tensor of `dtype`) fits the bytes it names: its
// strides and box reach no byte past its length. nullopt when it fits;
// else " needs N bytes but its item holds M", to follow the chunk's name.
// The indexer's check (CheckCoverage) and a predicted item settled
// elsewhere (indexer/dcp_item.h) both apply it.
std::optional<std::string> ChunkBytesProblem(const Chunk& c, DType dtype);

// Drops chunks whose box equals an earlier chunk's box (replicas); returns
// how many were dropped.
size_t DropReplicas(TensorMeta& t);

}  // namespace ckptfs
