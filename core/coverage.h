// Coverage check: the chunks of a tensor must tile it exactly once.
//
// Indexers call this after collecting chunks (replicated copies already
// dropped). Each problem names the fqn and a box so `ckptfs check` and read
// errors can say exactly which elements are missing or doubly stored.
#pragma once

#include <string>
#include <vector>

#include "core/meta.h"

namespace ckptfs {

// Problems with `t`'s chunks: out-of-bounds boxes, dtype mismatches, byte
// lengths that disagree with the box, overlaps and holes. Empty when the
// chunks tile the tensor exactly once.
std::vector<std::string> CheckCoverage(const TensorMeta& t);

// Drops chunks whose box equals an earlier chunk's box (replicas); returns
// how many were dropped.
size_t DropReplicas(TensorMeta& t);

}  // namespace ckptfs
