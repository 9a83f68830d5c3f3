// The CLI's shared machinery (tools/cli.h).
#include <fcntl.h>
#include <sys/stat.h>
#include <syslog.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "fs/mount.h"
#include "fs/virtual_fs.h"
#include "indexer/index_store.h"
#include "indexer/scan.h"
#include "tools/progress.h"

#include "indexer/posix_io.h"
#include "tools/cli.h"

namespace ckptfs {

void Error(const std::string& msg) { std::fprintf(stderr, "ckptfs: error: %s\n", msg.c_str()); }

// "5GB" -> 5e9, "512MiB" -> 512*2^20, "1000" -> 1000.
std::optional<uint64_t> ParseSize(const std::string& s) {
  size_t pos = 0;
  double v;
  try {
    v = std::stod(s, &pos);
  } catch (...) {
    return std::nullopt;
  }
  std::string unit = s.substr(pos);
  for (auto& c : unit) c = std::toupper(c);
  static const std::pair<const char*, double> kUnits[] = {
      {"", 1}, {"B", 1}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12},
      {"KIB", 1024.0}, {"MIB", 1048576.0}, {"GIB", 1073741824.0}, {"TIB", 1099511627776.0}};
  for (const auto& [name, mult] : kUnits)
    if (unit == name && v > 0) return uint64_t(v * mult);
  return std::nullopt;
}

std::string AbsRoot(const std::string& root) {
  char real[PATH_MAX];
  return ::realpath(root.c_str(), real) ? std::string(real) : root;
}

std::string IndexPath(const Common& c) { return c.index.empty() ? DefaultIndexPath(AbsRoot(c.root)) : c.index; }

static void PrintProblems(const Catalog& catalog) {
  for (const Checkpoint& ck : catalog.checkpoints)
    for (const std::string& p : ck.problems)
      std::fprintf(stderr, "ckptfs: problem in %s: %s\n", ck.dir.empty() ? "." : ck.dir.c_str(), p.c_str());
}

size_t CountProblems(const Catalog& catalog) {
  size_t n = 0;
  for (const Checkpoint& ck : catalog.checkpoints) n += ck.problems.size();
  return n;
}

// Scans the source and writes the index. Returns an exit code.
int BuildIndex(const Common& c, bool quiet) {
  auto t0 = std::chrono::steady_clock::now();
  ScanOptions so;
  so.file_index_mapping = c.mapping;
  Progress progress("indexing " + c.root, 0, "dirs scanned");
  so.progress = [&](size_t dirs, size_t) { progress.Update(dirs); };
  auto catalog = ScanSource(c.root, so);
  if (!catalog.ok()) {
    Error(catalog.status().message());
    return kExitNoSource;
  }
  const std::string path = IndexPath(c);
  Status st = WriteIndex(*catalog, path);
  if (!st.ok()) {
    Error(st.message());
    return kExitIndexError;
  }
  size_t tensors = 0, chunks = 0;
  for (const Checkpoint& ck : catalog->checkpoints)
    for (const auto& t : ck.tensors) {
      ++tensors;
      chunks += t->chunks.size();
    }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!quiet || CountProblems(*catalog))
    std::fprintf(stderr, "ckptfs: indexed %s: %zu checkpoint(s), %zu tensors, %zu chunks, %zu files in %.2f s -> %s\n",
                 catalog->root.c_str(), catalog->checkpoints.size(), tensors, chunks, catalog->files.size(), secs,
                 path.c_str());
  if (catalog->checkpoints.empty())
    std::fprintf(stderr, "ckptfs: warning: no checkpoint recognised under %s (looked for *.safetensors)\n",
                 catalog->root.c_str());
  PrintProblems(*catalog);
  if (size_t n = CountProblems(*catalog)) {
    std::fprintf(stderr, "ckptfs: %zu problem(s); the affected tensors read as EIO. Fix the source and re-run `ckptfs index`.\n", n);
    return kExitProblems;
  }
  return kExitOk;
}

std::optional<Catalog> LoadCatalog(const Common& c, bool allow_stale, int* exit_code) {
  struct stat st;
  if (::stat(c.root.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    Error(c.root + ": not a directory");
    *exit_code = kExitNoSource;
    return std::nullopt;
  }
  const std::string path = IndexPath(c);
  auto catalog = LoadIndex(path);
  if (c.reindex || (!catalog.ok() && catalog.status().code() == Status::Code::kNotFound)) {
    int rc = BuildIndex(c, /*quiet=*/true);
    if (rc != kExitOk && rc != kExitProblems) {
      *exit_code = rc;
      return std::nullopt;
    }
    catalog = LoadIndex(path);
  }
  if (!catalog.ok()) {
    Error(catalog.status().message());
    *exit_code = kExitIndexError;
    return std::nullopt;
  }
  if (catalog->root != AbsRoot(c.root)) {
    Error("index " + path + " was built for " + catalog->root + ", not " + AbsRoot(c.root));
    *exit_code = kExitIndexError;
    return std::nullopt;
  }
  if (!allow_stale) {
    Status fresh = CheckSources(*catalog);
    if (!fresh.ok()) {
      Error(fresh.message());
      *exit_code = kExitStale;
      return std::nullopt;
    }
  }
  return std::move(*catalog);
}

std::unique_ptr<VirtualFs> OpenFs(const Common& c, int* exit_code, std::function<void(const std::string&)> log) {
  auto catalog = LoadCatalog(c, /*allow_stale=*/false, exit_code);
  if (!catalog) return nullptr;
  FsOptions fo;
  fo.consolidated.max_file_bytes = c.max_file_bytes;
  if (!c.rules.empty()) {
    std::ifstream f(c.rules);
    if (!f) {
      Error(c.rules + ": cannot read the rules file");
      *exit_code = kExitUsage;
      return nullptr;
    }
    std::stringstream text;
    text << f.rdbuf();
    fo.rules_json = text.str();
  }
  if (!c.names.empty()) {
    auto text = ReadWholeFile(c.names);
    auto j = text.ok() ? nlohmann::json::parse(*text, nullptr, false) : nlohmann::json();
    bool ok = j.is_object();
    for (auto it = j.begin(); ok && it != j.end(); ++it) ok = it->is_string();
    if (!ok) {
      Error(c.names + ": expected a JSON object {fqn: name} (" +
            (text.ok() ? "not an object of strings" : text.status().message()) + ")");
      *exit_code = kExitUsage;
      return nullptr;
    }
    for (auto& [fqn, name] : j.items()) fo.consolidated.names[fqn] = name.get<std::string>();
  }
  fo.uid = ::getuid();
  fo.gid = ::getgid();
  fo.log = log ? log : [](const std::string& line) { std::fprintf(stderr, "ckptfs: %s\n", line.c_str()); };
  auto fs = VirtualFs::Create(std::move(*catalog), fo);
  if (!fs.ok()) {
    Error(fs.status().message());
    *exit_code = kExitIndexError;
    return nullptr;
  }
  return std::move(*fs);
}

// Streams a virtual file to `out` (a FILE*), returning an exit code.
int CopyOut(VirtualFs& fs, const Attr& a, const std::string& vpath, std::FILE* out, Progress* progress,
            uint64_t* done) {
  auto h = fs.Open(a.ino, O_RDONLY);
  if (!h.ok()) {
    Error(vpath + ": " + h.status().message());
    return kExitReadError;
  }
  constexpr size_t kBuf = 8 << 20;
  std::unique_ptr<char[]> buf(new char[kBuf]);
  int rc = kExitOk;
  for (uint64_t off = 0; off < a.size;) {
    auto n = fs.Read(*h, buf.get(), kBuf, off);
    if (!n.ok()) {
      Error(vpath + ": " + std::strerror(n.status().err()) + ": " + n.status().message());
      rc = kExitReadError;
      break;
    }
    if (*n == 0) break;
    if (std::fwrite(buf.get(), 1, *n, out) != *n) {
      Error(std::string("write failed: ") + std::strerror(errno));
      rc = kExitReadError;
      break;
    }
    off += *n;
    if (progress) progress->Update(*done += *n);
  }
  fs.Release(*h);
  return rc;
}


}  // namespace ckptfs
