// How bytes reach the stager's ring: the one place that knows about device
// memory. The host engine copies with memcpy and refuses device pointers;
// the CUDA engine (cuda_copy_engine.cc, built when the toolkit is found)
// allocates the ring with cudaHostAlloc (pinned, so a D2H copy runs at DMA
// speed and never through a bounce buffer) and copies with cudaMemcpyAsync
// on its own non-blocking stream, ordered after the producer's stream by an
// event, so the training stream is never blocked by the copy.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/status.h"

namespace ckptfs {

// Device ordinal of host memory in a Slice.
inline constexpr int kHostDevice = -1;

// A byte range to save: host memory (device == kHostDevice) or memory of a
// CUDA device, produced on `stream` (a cudaStream_t as an integer; 0 is the
// legacy default stream). Nothing here is torch: callers pass data_ptr(),
// nbytes, device index and stream handle.
struct Slice {
  const void* ptr = nullptr;
  uint64_t size = 0;
  int device = kHostDevice;
  uint64_t stream = 0;
};

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  virtual const char* name() const = 0;  // "host", "cuda"
  virtual Result<void*> AllocBuffer(uint64_t bytes) = 0;
  virtual void FreeBuffer(void* p, uint64_t bytes) = 0;
  // Starts copying `src` into dst, a place in ring buffer `buffer`; may
  // return before the bytes land.
  virtual Status Copy(int buffer, void* dst, const Slice& src) = 0;
  // Marks everything copied into ring buffer `buffer` so far; WaitSealed
  // (called from an I/O thread) returns once those bytes have landed.
  virtual Status Seal(int buffer) = 0;
  virtual Status WaitSealed(int buffer) = 0;
  // Makes work submitted later to the producer's `stream` on `device` wait
  // for every copy started so far, without blocking the caller: after it,
  // the training loop may overwrite the source tensors (async saves).
  virtual Status FenceProducer(int device, uint64_t stream) = 0;
};

// memcpy into malloc'd (page-aligned) buffers; device slices are refused.
std::unique_ptr<CopyEngine> MakeHostCopyEngine();

// True when this build has the CUDA engine (CKPTFS_WITH_CUDA and the toolkit).
bool BuiltWithCuda();

// The CUDA engine when built with CUDA and a device is visible, else
// NotSupported saying which of the two is missing. `buffers` is the ring's
// buffer count (one event each).
Result<std::unique_ptr<CopyEngine>> MakeCudaCopyEngine(int buffers);

// The CUDA engine when available, else the host engine.
std::unique_ptr<CopyEngine> MakeDefaultCopyEngine(int buffers);

}  // namespace ckptfs
