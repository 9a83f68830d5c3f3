// The Collective over NCCL, for GPU trainers outside Python that already
// hold an ncclComm_t. NCCL moves device memory only, so each call copies
// its few bytes through a small device buffer on a private stream; the
// amounts are rows and lengths (kilobytes), never tensor data.
//
// Include only from code built with NCCL (CKPTFS_HAVE_NCCL).
#pragma once

#include <nccl.h>

#include <memory>

#include "writer/collective.h"

namespace ckptfs {

// Borrows `comm` (the caller destroys it after this collective); `device`
// is the CUDA device the communicator was created on.
Result<std::unique_ptr<Collective>> MakeNcclCollective(ncclComm_t comm, int device);

}  // namespace ckptfs
