// The CUDA copy engine (what and why: copy_engine.h). Compiled only when
// CMake finds the CUDA toolkit and CKPTFS_WITH_CUDA is on.
//
// Ordering: for each slice, an event recorded on the producer's stream is
// waited on by this engine's copy stream (one non-blocking stream per
// device), then cudaMemcpyAsync D2H into the pinned ring. Seal(b) records
// one event per device used since b was last sealed; the I/O thread
// synchronizes on those before it checksums and writes the buffer. The
// caller's current device is restored after every call.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "writer/copy_engine.h"

namespace ckptfs {
namespace {

Status CudaError(cudaError_t e, const std::string& what) {
  return Status::IOError(what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}
#define CUDA_RETURN(expr, what)                          \
  do {                                                   \
    cudaError_t _e = (expr);                             \
    if (_e != cudaSuccess) return CudaError(_e, (what)); \
  } while (0)

class DeviceGuard {
 public:
  DeviceGuard() { ok_ = cudaGetDevice(&saved_) == cudaSuccess; }
  ~DeviceGuard() {
    if (ok_) cudaSetDevice(saved_);
  }

 private:
  int saved_ = 0;
  bool ok_ = false;
};

class CudaCopyEngine : public CopyEngine {
 public:
  explicit CudaCopyEngine(int buffers) : pending_(buffers), sealed_(buffers) {}
  ~CudaCopyEngine() override {
    DeviceGuard guard;
    for (auto& [dev, d] : devices_) {
      cudaSetDevice(dev);
      cudaStreamSynchronize(d.copy_stream);
      cudaStreamDestroy(d.copy_stream);
      cudaEventDestroy(d.producer_event);
      for (cudaEvent_t e : d.buffer_events) cudaEventDestroy(e);
    }
  }
  const char* name() const override { return "cuda"; }

  Result<void*> AllocBuffer(uint64_t bytes) override {
    void* p = nullptr;
    // Portable: pinned for every device's context, so one ring serves all.
    CUDA_RETURN(cudaHostAlloc(&p, bytes, cudaHostAllocPortable),
                "cudaHostAlloc of a " + std::to_string(bytes) + "-byte ring buffer");
    return p;
  }
  void FreeBuffer(void* p, uint64_t) override { cudaFreeHost(p); }

  Status Copy(int buffer, void* dst, const Slice& src) override {
    if (src.device == kHostDevice) {
      std::memcpy(dst, src.ptr, src.size);
      return Status::OK();
    }
    DeviceGuard guard;
    ASSIGN_OR_RETURN(Device * d, GetDevice(src.device));
    auto producer = reinterpret_cast<cudaStream_t>(src.stream);
    CUDA_RETURN(cudaEventRecord(d->producer_event, producer), "cudaEventRecord on the producer stream");
    CUDA_RETURN(cudaStreamWaitEvent(d->copy_stream, d->producer_event, 0), "cudaStreamWaitEvent");
    CUDA_RETURN(cudaMemcpyAsync(dst, src.ptr, src.size, cudaMemcpyDeviceToHost, d->copy_stream),
                "cudaMemcpyAsync of " + std::to_string(src.size) + " bytes from device " + std::to_string(src.device));
    std::lock_guard<std::mutex> lock(mu_);
    pending_[buffer].push_back(src.device);
    return Status::OK();
  }

  Status Seal(int buffer) override;

  Status FenceProducer(int device, uint64_t stream) override {
    if (device == kHostDevice) return Status::OK();
    DeviceGuard guard;
    ASSIGN_OR_RETURN(Device * d, GetDevice(device));
    CUDA_RETURN(cudaEventRecord(d->producer_event, d->copy_stream), "cudaEventRecord on the copy stream");
    CUDA_RETURN(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), d->producer_event, 0),
                "cudaStreamWaitEvent on the producer stream");
    return Status::OK();
  }

  Status WaitSealed(int buffer) override {
    std::vector<cudaEvent_t> events;
    {
      std::lock_guard<std::mutex> lock(mu_);
      events.swap(sealed_[buffer]);
    }
    for (cudaEvent_t e : events) CUDA_RETURN(cudaEventSynchronize(e), "cudaEventSynchronize (D2H copy into the ring)");
    return Status::OK();
  }

 private:
  struct Device {
    cudaStream_t copy_stream = nullptr;
    cudaEvent_t producer_event = nullptr;
    std::vector<cudaEvent_t> buffer_events;
  };

  // REQUIRES: called from the producer thread (devices_ is only grown there).
  Result<Device*> GetDevice(int dev);

  std::mutex mu_;  // guards pending_ and sealed_ (Seal/Copy on the producer, WaitSealed on I/O threads)
  std::vector<std::vector<int>> pending_;  // per buffer: devices copied into it since its last Seal
  std::vector<std::vector<cudaEvent_t>> sealed_;
  std::map<int, Device> devices_;
};

Status CudaCopyEngine::Seal(int buffer) {
  DeviceGuard guard;
  std::vector<cudaEvent_t> events;
  std::vector<int> devs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    devs.swap(pending_[buffer]);
  }
  std::sort(devs.begin(), devs.end());
  devs.erase(std::unique(devs.begin(), devs.end()), devs.end());
  for (int dev : devs) {
    ASSIGN_OR_RETURN(Device * d, GetDevice(dev));
    CUDA_RETURN(cudaEventRecord(d->buffer_events[buffer], d->copy_stream), "cudaEventRecord on the copy stream");
    events.push_back(d->buffer_events[buffer]);
  }
  std::lock_guard<std::mutex> lock(mu_);
  sealed_[buffer] = std::move(events);
  return Status::OK();
}

Result<CudaCopyEngine::Device*> CudaCopyEngine::GetDevice(int dev) {
  auto it = devices_.find(dev);
  if (it != devices_.end()) return &it->second;
  CUDA_RETURN(cudaSetDevice(dev), "cudaSetDevice(" + std::to_string(dev) + ")");
  Device d;
  CUDA_RETURN(cudaStreamCreateWithFlags(&d.copy_stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  // Timing off: these events only order and fence, and timing makes them slower.
  CUDA_RETURN(cudaEventCreateWithFlags(&d.producer_event, cudaEventDisableTiming), "cudaEventCreate");
  d.buffer_events.resize(pending_.size());
  for (auto& e : d.buffer_events) CUDA_RETURN(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  return &devices_.emplace(dev, d).first->second;
}

}  // namespace

bool BuiltWithCuda() { return true; }

Result<std::unique_ptr<CopyEngine>> MakeCudaCopyEngine(int buffers) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0)
    return Status::NotSupported(std::string("no CUDA device is visible (") +
                                (e != cudaSuccess ? cudaGetErrorName(e) : "0 devices") + ")");
  return std::unique_ptr<CopyEngine>(new CudaCopyEngine(buffers));
}

}  // namespace ckptfs

namespace ckptfs {
int VisibleCudaDevices() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}
}  // namespace ckptfs
