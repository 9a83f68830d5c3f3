// The host copy engine (what and why: copy_engine.h).
#include <cstdlib>
#include <cstring>

#include "writer/copy_engine.h"

namespace ckptfs {
namespace {

class HostCopyEngine : public CopyEngine {
 public:
  const char* name() const override { return "host"; }
  Result<void*> AllocBuffer(uint64_t bytes) override {
    // Page-aligned so pwrite from the ring never straddles more pages than needed.
    void* p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    if (!p) return Status::IOError("cannot allocate a " + std::to_string(bytes) + "-byte ring buffer");
    return p;
  }
  void FreeBuffer(void* p, uint64_t) override { std::free(p); }
  Status Copy(int, void* dst, const Slice& src) override {
    if (src.device != kHostDevice)
      return Status::NotSupported("slice on CUDA device " + std::to_string(src.device) +
                                  ": this stager copies host memory only (" +
                                  (BuiltWithCuda() ? "no CUDA device is visible" : "ckptfs was built without CUDA") + ")");
    std::memcpy(dst, src.ptr, src.size);
    return Status::OK();
  }
  Status Seal(int) override { return Status::OK(); }
  Status WaitSealed(int) override { return Status::OK(); }
  Status FenceProducer(int, uint64_t) override { return Status::OK(); }  // memcpy is done on return
};

}  // namespace

std::unique_ptr<CopyEngine> MakeHostCopyEngine() { return std::make_unique<HostCopyEngine>(); }

std::unique_ptr<CopyEngine> MakeDefaultCopyEngine(int buffers) {
  auto cuda = MakeCudaCopyEngine(buffers);
  if (cuda.ok()) return std::move(cuda).value();
  return MakeHostCopyEngine();
}

#ifndef CKPTFS_HAVE_CUDA
bool BuiltWithCuda() { return false; }
Result<std::unique_ptr<CopyEngine>> MakeCudaCopyEngine(int) {
  return Status::NotSupported("ckptfs was built without CUDA (CKPTFS_WITH_CUDA=OFF or no toolkit found)");
}
#endif

}  // namespace ckptfs
