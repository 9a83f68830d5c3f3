// What ranks must agree on during a save, for trainers outside Python (the
// Python path uses torch.distributed): every rank's rows reach the
// coordinator, and nobody commits before every rank's files are durable.
//
// Implementations: a group of threads in one process (tests, and trainers
// that run ranks as threads), and NCCL over an ncclComm_t the trainer
// already has (nccl_collective.h; built when NCCL's headers are found). The
// conformance suite (tests/writer/collective_test.cc) runs against every
// implementation this build and machine can run.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"

namespace ckptfs {

class Collective {
 public:
  virtual ~Collective() = default;
  virtual const char* name() const = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Every rank's `mine`, in rank order. All ranks call it; sizes may differ.
  virtual Result<std::vector<std::string>> AllGather(const std::string& mine) = 0;
  // The root's `*data` on every rank.
  virtual Status Broadcast(std::string* data, int root);
  virtual Status Barrier();
};

// `size` Collectives sharing one in-process group; member i is rank i and
// must be driven by its own thread. A collective call that waits longer
// than `timeout` for the other ranks fails (IOError) instead of hanging.
std::vector<std::unique_ptr<Collective>> MakeThreadGroup(int size,
                                                         std::chrono::milliseconds timeout = std::chrono::minutes(5));

// The NCCL functions live in the ckptfs_writer_nccl library (NCCL itself,
// or stand-ins saying it is absent), so what does not use NCCL, such as
// the Python module, never loads libnccl.
//
// One NCCL communicator per local GPU 0..size-1 (ncclCommInitAll), for the
// conformance suite and tools/gpu_test.sh. NotSupported without NCCL or
// with fewer GPUs.
Result<std::vector<std::unique_ptr<Collective>>> MakeLocalNcclGroup(int size);
bool BuiltWithNccl();
int VisibleCudaDevices();  // 0 without CUDA

}  // namespace ckptfs
