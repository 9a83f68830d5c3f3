// The NCCL collective (what and why: nccl_collective.h).
//
// AllGather of strings of any length: an ncclAllGather of the lengths, then
// one of the strings padded to the longest.
#include "writer/nccl_collective.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

namespace ckptfs {
namespace {

Status CudaStatus(cudaError_t e, const char* what) {
  return e == cudaSuccess ? Status::OK() : Status::IOError(std::string(what) + ": " + cudaGetErrorString(e));
}
Status NcclStatus(ncclResult_t r, const char* what) {
  return r == ncclSuccess ? Status::OK() : Status::IOError(std::string(what) + ": " + ncclGetErrorString(r));
}

class NcclCollective : public Collective {
 public:
  NcclCollective(ncclComm_t comm, int device, bool owns) : comm_(comm), device_(device), owns_(owns) {}
  ~NcclCollective() override {
    int saved = 0;
    cudaGetDevice(&saved);
    cudaSetDevice(device_);
    if (buf_) cudaFree(buf_);
    if (stream_) cudaStreamDestroy(stream_);
    if (owns_) ncclCommDestroy(comm_);
    cudaSetDevice(saved);
  }
  Status Init() {
    RETURN_IF_ERROR(NcclStatus(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank"));
    RETURN_IF_ERROR(NcclStatus(ncclCommCount(comm_, &size_), "ncclCommCount"));
    int saved = 0;
    cudaGetDevice(&saved);
    Status st = CudaStatus(cudaSetDevice(device_), "cudaSetDevice");
    if (st.ok()) st = CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    cudaSetDevice(saved);
    return st;
  }
  const char* name() const override { return "nccl"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Result<std::vector<std::string>> AllGather(const std::string& mine) override {
    int saved = 0;
    cudaGetDevice(&saved);
    auto out = AllGatherOnDevice(mine);
    cudaSetDevice(saved);
    return out;
  }

 private:
  Result<std::vector<std::string>> AllGatherOnDevice(const std::string& mine) {
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
    std::vector<uint64_t> lens(size_);
    lens[rank_] = mine.size();
    RETURN_IF_ERROR(Exchange(lens.data(), sizeof(uint64_t)));
    const uint64_t width = std::max<uint64_t>(1, *std::max_element(lens.begin(), lens.end()));
    std::vector<char> all(width * size_, 0);
    std::memcpy(all.data() + width * rank_, mine.data(), mine.size());
    RETURN_IF_ERROR(Exchange(all.data(), width));
    std::vector<std::string> out(size_);
    for (int r = 0; r < size_; ++r) out[r].assign(all.data() + width * r, lens[r]);
    return out;
  }

  // In place: host[rank*width, +width) in, every rank's block out.
  Status Exchange(void* host, uint64_t width) {
    const uint64_t total = width * size_;
    if (total > cap_) {
      if (buf_) cudaFree(buf_);
      buf_ = nullptr;
      RETURN_IF_ERROR(CudaStatus(cudaMalloc(&buf_, total), "cudaMalloc"));
      cap_ = total;
    }
    char* dev = static_cast<char*>(buf_);
    const char* h = static_cast<const char*>(host);
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(dev + width * rank_, h + width * rank_, width, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync H2D"));
    RETURN_IF_ERROR(NcclStatus(ncclAllGather(dev + width * rank_, dev, width, ncclChar, comm_, stream_), "ncclAllGather"));
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(host, dev, total, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync D2H"));
    return CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

  ncclComm_t comm_;
  int device_;
  bool owns_;
  int rank_ = 0, size_ = 1;
  cudaStream_t stream_ = nullptr;
  void* buf_ = nullptr;
  uint64_t cap_ = 0;
};

}  // namespace

bool BuiltWithNccl() { return true; }

Result<std::unique_ptr<Collective>> MakeNcclCollective(ncclComm_t comm, int device) {
  auto c = std::make_unique<NcclCollective>(comm, device, false);
  RETURN_IF_ERROR(c->Init());
  return std::unique_ptr<Collective>(std::move(c));
}

Result<std::vector<std::unique_ptr<Collective>>> MakeLocalNcclGroup(int size) {
  const int gpus = VisibleCudaDevices();
  if (size < 1 || size > gpus)
    return Status::NotSupported("an NCCL group of " + std::to_string(size) + " needs as many GPUs; " +
                                std::to_string(gpus) + " visible");
  std::vector<ncclComm_t> comms(size);
  std::vector<int> devs(size);
  for (int i = 0; i < size; ++i) devs[i] = i;
  RETURN_IF_ERROR(NcclStatus(ncclCommInitAll(comms.data(), size, devs.data()), "ncclCommInitAll"));
  std::vector<std::unique_ptr<Collective>> out;
  for (int i = 0; i < size; ++i) {
    auto c = std::make_unique<NcclCollective>(comms[i], i, true);
    RETURN_IF_ERROR(c->Init());
    out.push_back(std::move(c));
  }
  return out;
}

}  // namespace ckptfs
