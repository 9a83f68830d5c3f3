// GPU check for tools/gpu_test.sh (built with CUDA, run only where a GPU is
// present; CI builds it but has no GPU to run it on):
//   1. pinned D2H bandwidth of device 0 (cudaMemcpyAsync into cudaHostAlloc);
//   2. the stager with the CUDA engine: a device buffer of a known pattern
//      saved into a file, bytes and CRC32C checked, throughput printed;
//   3. the NCCL collective at world size 1.
// Usage: ckptfs_gpu_check DIR [GIB]. Exit status 0 when every check passes.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <vector>

#include "writer/collective.h"
#include "core/crc32c.h"
#include "writer/stager.h"

using namespace ckptfs;

namespace {

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

#define CHECK_CUDA(x)                                                       \
  do {                                                                      \
    cudaError_t e = (x);                                                    \
    if (e != cudaSuccess) {                                                 \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e));          \
      return 1;                                                             \
    }                                                                       \
  } while (0)

int PinnedBandwidth(const void* dev, uint64_t n) {
  void* host = nullptr;
  CHECK_CUDA(cudaHostAlloc(&host, n, cudaHostAllocDefault));
  cudaStream_t s;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CHECK_CUDA(cudaMemcpyAsync(host, dev, n, cudaMemcpyDeviceToHost, s));  // warm-up
  CHECK_CUDA(cudaStreamSynchronize(s));
  auto t0 = std::chrono::steady_clock::now();
  const int reps = 3;
  for (int i = 0; i < reps; ++i) CHECK_CUDA(cudaMemcpyAsync(host, dev, n, cudaMemcpyDeviceToHost, s));
  CHECK_CUDA(cudaStreamSynchronize(s));
  std::printf("pinned D2H bandwidth: %.2f GB/s (%d x %.2f GiB)\n", reps * n / Seconds(t0) / 1e9, reps, n / double(1 << 30));
  cudaStreamDestroy(s);
  cudaFreeHost(host);
  return 0;
}

int StagerThroughput(const void* dev, const std::vector<uint8_t>& pattern, const std::string& dir) {
  auto engine = MakeCudaCopyEngine(2);
  if (!engine.ok()) return std::fprintf(stderr, "%s\n", engine.status().ToString().c_str()), 1;
  auto st = Stager::Create(StagerOptions{}, std::move(engine).value());
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.status().ToString().c_str()), 1;
  const std::string path = dir + "/gpu_check.bin";
  auto file = (*st)->OpenFile(path);
  if (!file.ok()) return std::fprintf(stderr, "%s\n", file.status().ToString().c_str()), 1;
  auto t0 = std::chrono::steady_clock::now();
  Status s = (*st)->Write(*file, 0, Slice{dev, pattern.size(), 0, 0}, 0, 0, true);
  if (s.ok()) s = (*st)->Drain();
  const double staged = Seconds(t0);
  if (s.ok()) s = (*st)->SyncFile(*file);
  const double synced = Seconds(t0);
  if (!s.ok()) return std::fprintf(stderr, "%s\n", s.ToString().c_str()), 1;
  auto sums = (*st)->TakeChecksums(0);
  const uint32_t want = Crc32c(0, pattern.data(), pattern.size());
  std::printf("stager (cuda engine, 2 x 256 MiB ring): %.2f GB/s to page cache, %.2f GB/s with fsync\n",
              pattern.size() / staged / 1e9, pattern.size() / synced / 1e9);
  std::ifstream f(path, std::ios::binary);
  std::vector<uint8_t> back(pattern.size());
  f.read(reinterpret_cast<char*>(back.data()), back.size());
  std::remove(path.c_str());
  if (!sums.ok() || sums->crc32c != want || back != pattern)
    return std::fprintf(stderr, "stager: bytes or CRC32C differ from the device buffer\n"), 1;
  std::printf("stager: bytes and CRC32C match (0x%08x)\n", want);
  return 0;
}

int NcclWorldOne() {
  auto g = MakeLocalNcclGroup(1);
  if (!g.ok()) return std::fprintf(stderr, "%s\n", g.status().ToString().c_str()), 1;
  Collective& c = *(*g)[0];
  auto all = c.AllGather("rows of rank 0");
  std::string b = "root";
  Status bs = c.Broadcast(&b, 0), bar = c.Barrier();
  if (!all.ok() || all->size() != 1 || (*all)[0] != "rows of rank 0" || !bs.ok() || b != "root" || !bar.ok())
    return std::fprintf(stderr, "nccl collective (world 1) failed\n"), 1;
  std::printf("nccl collective (world 1): allgather, broadcast, barrier ok\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return std::fprintf(stderr, "usage: %s DIR [GIB]\n", argv[0]), 2;
  const double gib = argc > 2 ? std::atof(argv[2]) : 2.0;
  const uint64_t n = uint64_t(gib * (1ull << 30)) / 4096 * 4096;
  std::vector<uint8_t> pattern(n);
  for (uint64_t i = 0; i < n; ++i) pattern[i] = uint8_t((i * 2654435761u) >> 13);
  void* dev = nullptr;
  CHECK_CUDA(cudaMalloc(&dev, n));
  CHECK_CUDA(cudaMemcpy(dev, pattern.data(), n, cudaMemcpyHostToDevice));
  int rc = PinnedBandwidth(dev, n);
  rc |= StagerThroughput(dev, pattern, argv[1]);
  rc |= NcclWorldOne();
  cudaFree(dev);
  return rc;
}
