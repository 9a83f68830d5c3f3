// The CLI's shared machinery (cli/cli.h).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "fs/mount.h"
#include "fs/virtual_fs.h"
#include "indexer/format_reader.h"
#include "indexer/index_lifecycle.h"
#include "indexer/index_store.h"
#include "indexer/scan.h"
#include "indexer/source_check.h"
#include "cli/progress.h"
#include "cli/store_loader.h"

#include "source/posix_io.h"
#include "source/posix_source.h"
#include "source/s3_source.h"
#include "cli/cli.h"

namespace ckptfs {

void Error(const std::string& msg) { std::fprintf(stderr, "ckptfs: error: %s\n", msg.c_str()); }

// "5GB" -> 5e9, "512MiB" and "512M" -> 512*2^20, "1000" -> 1000.
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
      {"KIB", 1024.0}, {"MIB", 1048576.0}, {"GIB", 1073741824.0}, {"TIB", 1099511627776.0},
      // One letter, as du and sort -S read them: binary.
      {"K", 1024.0}, {"M", 1048576.0}, {"G", 1073741824.0}, {"T", 1099511627776.0}};
  for (const auto& [name, mult] : kUnits)
    if (unit == name && v > 0) return uint64_t(v * mult);
  return std::nullopt;
}

std::string AbsRoot(const std::string& root) {
  if (IsS3Url(root)) {
    auto loc = ParseS3Url(root);
    if (!loc.ok()) return root;
    std::string p = loc->prefix;
    if (!p.empty()) p.pop_back();
    return "s3://" + loc->bucket + (p.empty() ? "" : "/" + p);
  }
  char real[PATH_MAX];
  return ::realpath(root.c_str(), real) ? std::string(real) : root;
}

// An s3:// root's store is keyed by endpoint, bucket and prefix: the same
// bucket name on two servers gets two stores.
static std::string StoreKey(const Common& c) {
  if (!IsS3Url(c.root)) return AbsRoot(c.root);
  S3Flags flags = c.s3;
  flags.no_sign_request = true;  // the key needs no credentials
  auto config = ResolveS3Config(c.root, flags);
  return config.ok() ? config->StoreKey() : AbsRoot(c.root);
}

std::string IndexPath(const Common& c) {
  return c.index.empty() ? DefaultIndexPath(StoreKey(c)) : c.index;
}

int CheckS3FlagsFitRoot(const Common& c) {
  if (c.root.empty() || IsS3Url(c.root)) return kExitOk;
  const S3Flags d;
  std::string given;
  auto note = [&given](bool set, const char* flag) {
    if (set) given += (given.empty() ? "" : ", ") + std::string(flag);
  };
  note(!c.s3.endpoint_url.empty(), "--endpoint-url");
  note(!c.s3.region.empty(), "--region");
  note(c.s3.no_sign_request, "--no-sign-request");
  note(c.s3.force_path_style, "--force-path-style");
  note(c.s3.max_threads != d.max_threads, "--max-threads");
  note(c.part_size != Common{}.part_size, "--part-size");
  note(c.s3.request_timeout_s != d.request_timeout_s, "--request-timeout-s");
  if (given.empty()) return kExitOk;
  Error(given + ": for s3:// roots; " + c.root + " is read from the local filesystem: drop them");
  return kExitUsage;
}

int ResolveCacheFlags(Common& c) {
  if (c.cache_dir.empty()) {
    if (c.max_cache_size.empty()) return kExitOk;
    Error("--max-cache-size needs --cache DIR: the directory the cache lives in");
    return kExitUsage;
  }
  if (!IsS3Url(c.root)) {
    Error("--cache caches the bytes of s3:// roots; " + c.root +
          " is read from the local filesystem (and its page cache): drop --cache");
    return kExitUsage;
  }
  if (c.max_cache_size.empty()) {
    c.max_cache_bytes = DiskCache::kDefaultMaxBytes;
  } else if (auto size = ParseSize(c.max_cache_size)) {
    c.max_cache_bytes = *size;
  } else {
    Error("--max-cache-size: cannot read '" + c.max_cache_size + "' as a size (try 10G or 512MiB)");
    return kExitUsage;
  }
  c.cache_dir = std::filesystem::absolute(c.cache_dir).lexically_normal().string();
  return kExitOk;
}

static std::shared_ptr<const Source> OpenS3Root(const Common& c, int* exit_code) {
  S3Flags flags = c.s3;
  auto part = ParseSize(c.part_size);
  if (!part) {
    Error("--part-size " + c.part_size + ": not a size (say 8MiB)");
    *exit_code = kExitUsage;
    return nullptr;
  }
  flags.part_size = *part;
  auto config = ResolveS3Config(c.root, flags);
  if (!config.ok()) {
    Error(c.root + ": " + config.status().message());
    *exit_code = config.status().code() == Status::Code::kInvalidArgument ? kExitUsage : kExitNoSource;
    return nullptr;
  }
  std::shared_ptr<DiskCache> cache;
  if (!c.cache_dir.empty()) {
    auto opened = DiskCache::Open(c.cache_dir, c.max_cache_bytes);
    if (!opened.ok()) {
      Error("--cache " + c.cache_dir + ": " + opened.status().message());
      *exit_code = kExitUsage;
      return nullptr;
    }
    cache = *opened;
  }
  auto source = std::make_shared<S3Source>(*config, std::move(cache));
  if (Status st = source->Probe(); !st.ok()) {
    Error(st.message() + " [" + config->Describe() + "]");
    *exit_code = kExitNoSource;
    return nullptr;
  }
  return source;
}

std::shared_ptr<const Source> RootSource(const Common& c, int* exit_code) {
  static std::map<std::string, std::shared_ptr<const Source>> opened;
  if (auto it = opened.find(c.root); it != opened.end()) return it->second;
  std::shared_ptr<const Source> source;
  if (IsS3Url(c.root)) {
    source = OpenS3Root(c, exit_code);
  } else {
    auto posix = PosixSource::OpenRoot(c.root);
    if (!posix.ok()) {
      Error(posix.status().message());
      *exit_code = kExitNoSource;
    } else {
      source = *posix;
    }
  }
  if (source) opened[c.root] = source;
  return source;
}

// The first problems of each checkpoint (a corrupt save can have one per
// chunk, thousands): `check` lists them all.
static void PrintProblems(const Catalog& catalog) {
  constexpr size_t kShown = 20;
  for (const Checkpoint& ck : catalog.checkpoints) {
    const char* dir = ck.dir.empty() ? "." : ck.dir.c_str();
    for (size_t i = 0; i < ck.problems.size() && i < kShown; ++i)
      std::fprintf(stderr, "ckptfs: problem in %s: %s\n", dir, ck.problems[i].c_str());
    if (ck.problems.size() > kShown)
      std::fprintf(stderr, "ckptfs: ... and %zu more problem(s) in %s; `ckptfs check %s` lists them all\n",
                   ck.problems.size() - kShown, dir, catalog.root.c_str());
  }
}

size_t CountProblems(const Catalog& catalog) {
  size_t n = 0;
  for (const Checkpoint& ck : catalog.checkpoints) n += ck.problems.size();
  return n;
}

static int ExitCodeFor(const Status& s) { return s.code() == Status::Code::kBusy ? kExitIndexBusy : kExitIndexError; }

// What the index's lifecycle tells the user (indexer/index_lifecycle.h).
static void Notice(const std::string& line) { std::fprintf(stderr, "ckptfs: %s\n", line.c_str()); }

// Opens the index of `c`, telling the user what opening it did (a rebuilt
// schema 1 index, removed leftovers). nullptr with *exit_code set on failure.
static std::unique_ptr<Store> OpenStore(const Common& c, Store::Access access, int* exit_code) {
  auto store = Store::Open(IndexPath(c), AbsRoot(c.root), access);
  if (!store.ok()) {
    Error(store.status().message());
    *exit_code = ExitCodeFor(store.status());
    return nullptr;
  }
  for (const std::string& line : (*store)->notices()) Notice(line);
  return std::move(*store);
}

static bool CheckRootIsDir(const Common& c, int* exit_code) { return RootSource(c, exit_code) != nullptr; }

int BuildIndex(const Common& c, bool quiet, size_t* unread) {
  auto t0 = std::chrono::steady_clock::now();
  int rc = kExitOk;
  // The store before the scan: a busy or refused index fails at once, not
  // after minutes of reading headers.
  if (!CheckRootIsDir(c, &rc)) return rc;
  bool rebuilt = false;
  auto store = OpenForUpdate(IndexPath(c), AbsRoot(c.root), Notice, &rebuilt);
  if (!store.ok()) {
    Error(store.status().message());
    return ExitCodeFor(store.status());
  }
  ScanOptions so;
  so.file_index_mapping = c.mapping;
  so.predict_items = c.predict_items;
  so.warn = [](const std::string& line) { std::fprintf(stderr, "ckptfs: warning: %s\n", line.c_str()); };
  Progress progress("indexing " + c.root, 0, "dirs scanned");
  so.progress = [&](size_t dirs, size_t) { progress.Update(dirs); };
  auto catalog = ScanSource(*RootSource(c, &rc), so);
  if (!catalog.ok()) {
    Error(catalog.status().message());
    return kExitNoSource;
  }
  Status st = ApplyScan(**store, *catalog, rebuilt);
  if (!st.ok()) {
    Error(st.message());
    return ExitCodeFor(st);
  }
  const std::string path = (*store)->path();
  store->reset();  // flushed and unlocked before we report success
  size_t tensors = 0, chunks = 0, files = 0;
  for (const Checkpoint& ck : catalog->checkpoints) {
    files += ck.files.size();
    for (const auto& t : ck.tensors) {
      ++tensors;
      chunks += t->chunks.size();
    }
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!quiet || CountProblems(*catalog))
    std::fprintf(stderr, "ckptfs: indexed %s: %zu checkpoint(s), %zu tensors, %zu chunks, %zu files in %.2f s -> %s\n",
                 catalog->root.c_str(), catalog->checkpoints.size(), tensors, chunks, files, secs,
                 path.c_str());
  if (catalog->checkpoints.empty())
    std::fprintf(stderr, "ckptfs: warning: no checkpoint recognised under %s (looked for %s; a "
                 "mount shows checkpoints saved later as they commit)\n",
                 catalog->root.c_str(), DescribeRecognised().c_str());
  PrintProblems(*catalog);
  for (const std::string& u : catalog->unread) std::fprintf(stderr, "ckptfs: warning: %s\n", u.c_str());
  if (unread) *unread = catalog->unread.size();
  if (!catalog->unread.empty()) {
    std::fprintf(stderr, "ckptfs: %zu checkpoint(s) not indexed: their files could not be read now; run again once "
                 "they can\n", catalog->unread.size());
    return kExitNoSource;
  }
  if (size_t n = CountProblems(*catalog)) {
    std::fprintf(stderr, "ckptfs: %zu problem(s); the affected tensors read as EIO. Fix the source and re-run `ckptfs index`.\n", n);
    return kExitProblems;
  }
  return kExitOk;
}

int DumpIndex(const Common& c, std::ostream& out) {
  int rc = kExitOk;
  if (!CheckRootIsDir(c, &rc)) return rc;
  auto store = OpenStore(c, Store::Access::kReadOnly, &rc);
  if (!store) return rc;
  Status st = store->Dump(out);
  if (!st.ok()) {
    Error(st.message());
    return kExitIndexError;
  }
  return kExitOk;
}

// Opens the index read-only, building it first when there is none (or it is
// of schema 1), when --reindex asks, or when checkpoints were saved since
// (indexer/index_lifecycle.h). nullptr with *exit_code set on failure.
static std::unique_ptr<Store> OpenOrBuild(const Common& c, int* exit_code) {
  int rc = kExitOk, build_rc = kExitOk;
  Status build_failed;  // what `build` returned when it failed; BuildIndex said why
  ReadOpenOptions options;
  options.reindex = c.reindex;
  options.note = Notice;
  options.build = [&] {
    size_t unread = 0;
    build_rc = BuildIndex(c, /*quiet=*/true, &unread);
    // Built without the checkpoints that could not be read (said above): a
    // live mount serves them once they read, a later command indexes them.
    if (build_rc == kExitOk || build_rc == kExitProblems || (build_rc == kExitNoSource && unread))
      return Status::OK();
    build_failed = build_rc == kExitIndexBusy ? Status::Busy("the index is being written by another process")
                                              : Status::IOError("the index could not be built");
    return build_failed;
  };
  auto store = OpenForReading(*RootSource(c, &rc), IndexPath(c), AbsRoot(c.root), options);
  if (store.ok()) return std::move(*store);
  if (!build_failed.ok() && store.status().code() == build_failed.code() &&
      store.status().message() == build_failed.message()) {
    *exit_code = build_rc;
    return nullptr;
  }
  Error(store.status().message());
  *exit_code = ExitCodeFor(store.status());
  return nullptr;
}

std::optional<Catalog> LoadCatalog(const Common& c, bool allow_stale, int* exit_code) {
  if (!CheckRootIsDir(c, exit_code)) return std::nullopt;
  auto store = OpenOrBuild(c, exit_code);
  if (!store) return std::nullopt;
  auto catalog = ReadCatalog(*store);
  if (!catalog.ok()) {
    Error(catalog.status().message() + "; run `ckptfs index` again");
    *exit_code = kExitIndexError;
    return std::nullopt;
  }
  if (!allow_stale) {
    int rc = kExitOk;
    Status fresh = CheckSources(*RootSource(c, &rc), [&] {
      std::vector<SourceFile> files;
      for (const Checkpoint& ck : catalog->checkpoints) files.insert(files.end(), ck.files.begin(), ck.files.end());
      return files;
    }());
    if (!fresh.ok()) {
      Error(fresh.message());
      *exit_code = kExitStale;
      return std::nullopt;
    }
  }
  return std::move(*catalog);
}

static std::optional<FsOptions> MakeFsOptions(const Common& c, int* exit_code,
                                              std::function<void(const std::string&)> log) {
  FsOptions fo;
  fo.consolidated.max_file_bytes = c.max_file_bytes;
  fo.max_loaded = c.max_loaded;
  fo.compute_cache_bytes = c.compute_cache_mib << 20;
  if (!c.keep_dtype.empty()) {
    try {
      std::regex check(c.keep_dtype);
    } catch (const std::regex_error& e) {
      Error("--keep-dtype '" + c.keep_dtype + "' is not a valid regular expression (ECMAScript): " + e.what());
      *exit_code = kExitUsage;
      return std::nullopt;
    }
    fo.keep_dtype = c.keep_dtype;
  }
  if (!c.rules.empty()) {
    std::ifstream f(c.rules);
    if (!f) {
      Error(c.rules + ": cannot read the rules file");
      *exit_code = kExitUsage;
      return std::nullopt;
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
      return std::nullopt;
    }
    for (auto& [fqn, name] : j.items()) fo.consolidated.names[fqn] = name.get<std::string>();
  }
  fo.uid = ::getuid();
  fo.gid = ::getgid();
  fo.log = log ? log : [](const std::string& line) { std::fprintf(stderr, "ckptfs: %s\n", line.c_str()); };
  return fo;
}

std::unique_ptr<VirtualFs> OpenFs(const Common& c, int* exit_code, std::function<void(const std::string&)> log,
                                  std::shared_ptr<StoreLoader>* loader_out) {
  std::shared_ptr<const Source> source = RootSource(c, exit_code);
  if (!source) return nullptr;
  auto fo = MakeFsOptions(c, exit_code, std::move(log));
  if (!fo) return nullptr;
  std::optional<std::vector<std::string>> dirs;
  {
    auto store = OpenOrBuild(c, exit_code);  // closed again before a mount forks
    if (!store) return nullptr;
    auto fresh = FreshCheckpoints(*source, *store);
    if (!fresh.ok()) {
      const bool stale = fresh.status().code() == Status::Code::kStale;
      Error(stale ? fresh.status().message() : fresh.status().message() + "; run `ckptfs index` again");
      *exit_code = stale ? kExitStale : kExitIndexError;
      return nullptr;
    }
    dirs = std::move(*fresh);
  }
  // Absolute: a background mount opens it after its chdir("/").
  auto loader = std::make_shared<StoreLoader>(std::filesystem::absolute(IndexPath(c)).string(), AbsRoot(c.root));
  if (loader_out) *loader_out = loader;
  auto fs = VirtualFs::Open(source, *dirs, [loader](const std::string& dir) { return loader->Load(dir); },
                            std::move(*fo));
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
      rc = kExitWriteError;
      break;
    }
    off += *n;
    if (progress) progress->Update(*done += *n);
  }
  fs.Release(*h);
  return rc;
}


}  // namespace ckptfs
