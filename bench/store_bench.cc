// Store benchmark (driven by bench/bench_store.py; figures in
// docs/BENCHMARKS.md). Prints one JSON object.
//
//   store_bench synth TENSORS CHUNKS INDEX   commit one synthetic checkpoint of
//                                            TENSORS x CHUNKS (root "/bench-root")
//                                            into a new store at INDEX and close it
//   store_bench load ROOT INDEX              List() + Load() every checkpoint of
//                                            the store at INDEX (a fresh process,
//                                            so its RSS is the load's alone)
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "indexer/index_store.h"

namespace ckptfs {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double Since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// VmRSS or VmHWM of this process, in MiB.
double MemMiB(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.compare(0, field.size() + 1, field + ":") == 0) return std::atof(line.c_str() + field.size() + 1) / 1024;
  return -1;
}

uint64_t DirBytes(const std::string& dir) {
  uint64_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.is_regular_file()) n += e.file_size();
  return n;
}

// An MoE-like checkpoint: fqns "model.layers.L.mlp.experts.E.w" (~40 bytes),
// each tensor row-split over CHUNKS rank files, BF16 rows of 1024.
Checkpoint Synthetic(uint64_t tensors, uint64_t chunks) {
  Checkpoint c;
  c.dir = "bench";
  c.format = "sharded-safetensors";
  for (uint64_t r = 0; r < chunks; ++r) {
    SourceFile f;
    f.path = "bench/shard-" + std::to_string(r) + ".safetensors";
    f.size = tensors * 4 * 1024 * 2 + 8;
    f.inode = 1000 + r;
    c.files.push_back(f);
  }
  std::vector<std::string> names;
  for (uint64_t i = 0; i < tensors; ++i)
    names.push_back("model.layers." + std::to_string(i / 1000) + ".mlp.experts." + std::to_string(i % 1000) + ".w");
  std::sort(names.begin(), names.end());
  for (uint64_t i = 0; i < tensors; ++i) {
    auto t = std::make_shared<TensorMeta>();
    t->fqn = names[i];
    t->dtype = DType::kBF16;
    t->shape = {4 * chunks, 1024};
    for (uint64_t r = 0; r < chunks; ++r) {
      t->chunks.emplace_back(Box{{4 * r, 0}, {4, 1024}}, ByteMeta{FileId(r), 8 + i * 8192, 8192}, t->dtype);
    }
    c.tensors.push_back(std::move(t));
  }
  return c;
}

// List() + Load() of every checkpoint, timed, with memory before and after.
json LoadAll(const std::string& index, const std::string& root) {
  json out;
  out["rss_before_mib"] = MemMiB("VmRSS");
  auto t0 = Clock::now();
  auto store = Store::Open(index, root, Store::Access::kReadOnly);
  if (!store.ok()) return {{"error", store.status().ToString()}};
  out["open_s"] = Since(t0);
  auto entries = (*store)->List();
  out["list_s"] = Since(t0);
  uint64_t tensors = 0, chunks = 0;
  std::vector<Checkpoint> kept;
  for (const CheckpointEntry& e : entries) {
    auto ck = (*store)->Load(e.dir);
    if (!ck.ok()) return {{"error", ck.status().ToString()}};
    tensors += ck->tensors.size();
    for (const auto& t : ck->tensors) chunks += t->chunks.size();
    kept.push_back(std::move(*ck));
  }
  out["list_and_load_s"] = Since(t0);
  out["checkpoints"] = entries.size();
  out["tensors"] = tensors;
  out["chunks"] = chunks;
  out["rss_after_mib"] = MemMiB("VmRSS");
  out["hwm_mib"] = MemMiB("VmHWM");
  return out;
}

int Synth(uint64_t tensors, uint64_t chunks, const std::string& index) {
  const std::string root = "/bench-root";
  Checkpoint ckpt = Synthetic(tensors, chunks);
  json out;
  auto t0 = Clock::now();
  {
    auto store = Store::Open(index, root, Store::Access::kReadWrite);
    if (!store.ok()) return std::fprintf(stderr, "%s\n", store.status().ToString().c_str()), 1;
    Status st = (*store)->Commit(ckpt);
    if (!st.ok()) return std::fprintf(stderr, "%s\n", st.ToString().c_str()), 1;
    out["commit_s"] = Since(t0);
  }
  out["commit_and_close_s"] = Since(t0);
  out["store_bytes"] = DirBytes(index);
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace
}  // namespace ckptfs

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "synth" && argc == 5) return ckptfs::Synth(std::stoull(argv[2]), std::stoull(argv[3]), argv[4]);
  if (mode == "load" && argc == 4) {
    std::printf("%s\n", ckptfs::LoadAll(argv[3], argv[2]).dump().c_str());
    return 0;
  }
  std::fprintf(stderr, "usage: store_bench synth TENSORS CHUNKS INDEX | store_bench load ROOT INDEX\n");
  return 2;
}
