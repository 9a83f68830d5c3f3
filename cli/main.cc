// ckptfs: mount sharded training checkpoints as the files tools expect.
//
// Thin by design: each subcommand parses its flags and calls the libraries.
// `cat` and `export` read through VirtualFs, the same read path as a mount.
// Exit codes are named below and documented in docs/CLI.md.
#include <fcntl.h>
#include <sys/stat.h>
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
#include "source/posix_source.h"
#include "source/s3_source.h"
#include "cli/progress.h"

#include "cli/cli.h"
#include "cli/daemon.h"
#include "cli/store_loader.h"
#include "cli/log.h"

namespace ckptfs {
namespace {

const char kVersion[] = "ckptfs " CKPTFS_VERSION;

const char kExamples[] = R"(
Examples:
  ckptfs index  /ckpts/step_100                 # build the index (once per checkpoint)
  ckptfs mount  /ckpts/step_100 /mnt/s100       # serve it; unmount with fusermount3 -u /mnt/s100
  ls -l /mnt/s100/model/consolidated/           # a Hugging Face folder, computed on read
  ckptfs ls     /ckpts/step_100 model/consolidated
  ckptfs cat    /ckpts/step_100 model/consolidated/model.safetensors.index.json
  ckptfs export /ckpts/step_100 model/consolidated /tmp/hf   # materialise a view
  ckptfs mount  s3://bucket/run1 /mnt/run1      # object storage (AWS_* variables, ~/.aws)
  ckptfs mount  s3://bucket/run1 /mnt/run1 --cache /var/cache/ckptfs --max-cache-size 50G

Docs: docs/CLI.md (flags, exit codes), docs/SEMANTICS.md (what the mount serves).
)";

// Flags of an s3:// root, named as mountpoint-s3 names them (docs/CLI.md).
void AddS3(CLI::App* cmd, Common& c) {
  cmd->add_option("--endpoint-url", c.s3.endpoint_url,
                  "S3 endpoint of an s3:// root (default: AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the profile's, or AWS)");
  cmd->add_option("--region", c.s3.region, "S3 region (default: AWS_REGION, AWS_DEFAULT_REGION, the profile's, us-east-1)");
  cmd->add_flag("--no-sign-request", c.s3.no_sign_request, "Send unsigned requests (public buckets)");
  cmd->add_flag("--force-path-style", c.s3.force_path_style, "Address AWS buckets by path, not by host name");
  cmd->add_option("--max-threads", c.s3.max_threads, "Ranged GETs in flight per read (default 16)");
  cmd->add_option("--part-size", c.part_size, "Bytes per ranged GET (default 8MiB)");
  cmd->add_option("--cache", c.cache_dir,
                  "Keep the bytes fetched from an s3:// root in this local directory (new, empty, or a ckptfs "
                  "cache; several mounts may share it) and read them from there next time; each 1 MiB block is "
                  "checked (CRC32C, ETag) before it is served");
  cmd->add_option("--max-cache-size", c.max_cache_size,
                  "Bound of the --cache directory; least recently used blocks are deleted first (default 10GiB; "
                  "units as --part-size, G = GiB)");
}

void AddCommon(CLI::App* cmd, Common& c, bool view_flags) {
  cmd->add_option("--index", c.index, "Index location (default: $CKPTFS_INDEX_DIR or ~/.cache/ckptfs/<name>-<hash>)");
  AddS3(cmd, c);
  if (view_flags) {
    cmd->add_option("--max-file-size", c.max_file_size,
                    "Split consolidated/ into files of at most this size when the checkpoint has no file mapping (default 5GB; units B, KB, MB, GB, KiB, MiB, GiB; K, M, G are binary)");
    cmd->add_flag("--reindex", c.reindex, "Rebuild the index before opening");
    cmd->add_option("--names", c.names,
                    "JSON {fqn: name}: exactly which tensors consolidated/ and mesh/ hold, under which names "
                    "(replaces the model-weight rule)");
    cmd->add_option("--rules", c.rules,
                    "Mesh sharding rules (JSON {\"rules\": [{\"pattern\", \"kind\", \"dim\"}]}) placed before the preset's");
    cmd->add_option("--keep-dtype", c.keep_dtype,
                    "Dtype views (consolidated.bf16/, mesh/tp2.fp16/, ...) keep the tensors whose names match this "
                    "regex (ECMAScript, searched) as saved, e.g. 'e_score_correction_bias|router'");
  }
}

// Every flag of every subcommand; CLI11 writes into it.
struct Flags {
  Common c;
  bool quiet = false, foreground = false, debug = false, allow_other = false, allow_non_empty = false;
  bool no_watch = false, json = false, dump = false, verify_checksums = false;
  unsigned threads = 16;
  unsigned readahead_mib = 32;
  unsigned direct_pool_mib = 0;  // off: slower than the page cache where measured (BENCHMARKS)
  // 1 GiB: a ~0.5B-parameter bf16 model whole, or the ranges a loader has
  // not reached yet of a larger one; 4 % of a 24 GiB machine.
  unsigned fetch_hold_mib = 1024;
  unsigned rescan_ms = 2000;
  size_t max_loaded = 32;  // mount only: the one-shot commands load what they need
  std::string mountpoint, vpath, dest, log_file, log_level = "info";
  std::string mesh_spec, pattern, tensor_name, against;
};

struct Commands {
  CLI::App *index, *mount, *ls, *inspect, *check, *verify, *cat, *exp, *version, *help;
};

void AddIndexAndMount(CLI::App& app, Flags& f, Commands& cmd) {
  cmd.index = app.add_subcommand("index", "Build the index of a checkpoint tree (RocksDB)");
  cmd.index->add_option("ROOT", f.c.root, "Checkpoint directory (or a tree of them)")->required();
  cmd.index->add_option("--mapping", f.c.mapping, "JSON {fqn: 1-based file index} deciding consolidated/ file split");
  cmd.index->add_flag("-q,--quiet", f.quiet, "Print only problems");
  cmd.index->add_flag("--dump", f.dump, "Print every row of the index as JSON lines ({key, value}) and exit");
  AddCommon(cmd.index, f.c, false);
  cmd.index->footer("\nExample:\n  ckptfs index /ckpts/step_100\n\nExit status 5 when the checkpoint has problems (holes, truncated or corrupt files):\nthey are listed, and reads of the affected tensors fail with EIO.\n");

  auto* m = cmd.mount = app.add_subcommand("mount", "Mount a checkpoint tree read-only (indexes it first if needed)");
  m->add_option("ROOT", f.c.root, "Checkpoint directory")->required();
  m->add_option("MOUNTPOINT", f.mountpoint, "Empty directory to mount on")->required();
  m->add_flag("-f,--foreground", f.foreground, "Stay in the foreground (logs to stderr)");
  m->add_flag("-d,--debug", f.debug, "Log every FUSE request (implies -f)");
  m->add_flag("--allow-other", f.allow_other,
              "Let other users read the mount, each only what the sources let them read (needs user_allow_other in "
              "/etc/fuse.conf unless root)");
  m->add_flag("--allow-non-empty", f.allow_non_empty, "Mount over a directory that has files (they are hidden)");
  m->add_flag("--no-watch", f.no_watch, "Do not watch the sources for changes (no inotify, no rescan)");
  m->add_option("--rescan-ms", f.rescan_ms,
                "Re-check the sources this often, for filesystems without inotify (default 2000; 0 = never)");
  m->add_option("--threads", f.threads, "Maximum FUSE worker threads (default 16)")->check(CLI::Range(1u, 1024u));
  m->add_option("--max-loaded", f.max_loaded,
                "Checkpoints kept loaded in memory (rows and views); beyond it the least recently used one with no "
                "open file is unloaded and loaded again on next use (default 32; 0 = no limit)");
  m->add_option("--compute-cache-mib", f.c.compute_cache_mib,
                "MiB of computed tensor blocks (dtype casts) kept for readers, least recently used dropped first "
                "(default 512)")
      ->check(CLI::Range(uint64_t(1), uint64_t(1) << 20));
  m->add_option("--readahead-mib", f.readahead_mib,
                "Source MiB read ahead of each sequential reader of a virtual file; 0 = off (default 32)")
      ->check(CLI::Range(0u, 4096u));
  m->add_option("--direct-pool-mib", f.direct_pool_mib,
                "MiB of aligned buffers for direct (O_DIRECT) reads of source ranges not in the page cache; when "
                "full, reads go through the page cache. 0 = no direct reads (default 0: on the disks measured so far direct "
                "reads were slower than the page cache; try 64 on fast local NVMe and compare)")
      ->check(CLI::Range(0u, 65536u));
  m->add_option("--fetch-hold-mib", f.fetch_hold_mib,
                "MiB of source ranges held in memory for the loaders of whole files (default 1024; 0 = off). Once a "
                "reader of a file with several tensors has begun reading in two of them (transformers, safetensors, "
                "torch.load, cp), every source range the file needs is fetched once, in the sources' own order, and "
                "held until each of its bytes was served; ranges beyond this bound wait for earlier ones to be "
                "served, and bytes needed again later are fetched again (the log's \"refetched\"). Readers of one "
                "tensor (tensors/*.npy) are not affected. The log says what was fetched at unmount and on SIGUSR1")
      ->check(CLI::Range(0u, 1u << 20));
  m->add_flag("--verify-checksums", f.verify_checksums,
              "Check each chunk's recorded CRC32C (checkpoints saved by ckptfs's writer) on its first read: a chunk "
              "that differs answers EIO, the rest keep serving. The first read of a chunk reads all of it");
  m->add_option("--log-file", f.log_file,
                "Append log lines here (default: stderr with -f, else <index>.log next to the index)");
  m->add_option("--log-level", f.log_level, "error, warn, info (default) or debug")
      ->check(CLI::IsMember({"error", "warn", "info", "debug"}));
  AddCommon(m, f.c, true);
  m->footer("\nExamples:\n  ckptfs mount /ckpts/step_100 /mnt/s100\n  ckptfs mount -f --max-file-size 2GB /ckpts/step_100 /mnt/s100\n"
            "  ckptfs mount s3://bucket/run1 /mnt/run1 --endpoint-url http://minio:9000   # new steps by listing every --rescan-ms\n  fusermount3 -u /mnt/s100     # unmount\n\nExit status 7 when the mountpoint is missing, not a directory, not empty or already mounted.\n");
}

void AddReadCommands(CLI::App& app, Flags& f, Commands& cmd) {
  cmd.ls = app.add_subcommand("ls", "List tensors (no PATH) or a directory of the virtual tree (PATH), without mounting");
  cmd.ls->add_option("ROOT", f.c.root, "Checkpoint directory")->required();
  cmd.ls->add_option("PATH", f.vpath, "Path inside the tree: list its entries instead of the tensors");
  cmd.ls->add_flag("--json", f.json, "Print JSON (tensors: checkpoint, name, dtype, shape, chunks, bytes, files; entries: name, type, size)");
  cmd.ls->add_option("--filter", f.pattern, "Only tensors whose name matches this glob (e.g. '*.q_proj.weight')");
  cmd.ls->add_option("--mesh", f.mesh_spec, "Show the per-rank views of a layout spec (tp4, tp2-pp2, ...), or why it is impossible");
  AddCommon(cmd.ls, f.c, true);
  cmd.ls->footer("\nExamples:\n  ckptfs ls /ckpts/step_100                        # table of tensors\n"
                 "  ckptfs ls /ckpts/step_100 --filter '*embed*' --json\n"
                 "  ckptfs ls /ckpts/step_100 model/consolidated     # files of a view\n"
                 "  ckptfs ls /ckpts/step_100 --mesh tp4\n");

  cmd.inspect = app.add_subcommand("inspect", "Show one tensor: chunks, files, byte ranges, and statistics read from it");
  cmd.inspect->add_option("ROOT", f.c.root, "Checkpoint directory")->required();
  cmd.inspect->add_option("NAME", f.tensor_name, "Tensor name (fqn), as `ckptfs ls` prints it")->required();
  cmd.inspect->add_flag("--json", f.json, "Print JSON");
  AddCommon(cmd.inspect, f.c, true);
  cmd.inspect->footer("\nExample:\n  ckptfs inspect /ckpts/step_100 model.embed_tokens.weight\n");

  cmd.cat = app.add_subcommand("cat", "Write a file of the virtual tree to stdout, without mounting");
  cmd.cat->add_option("ROOT", f.c.root, "Checkpoint directory")->required();
  cmd.cat->add_option("PATH", f.vpath, "File inside the tree")->required();
  AddCommon(cmd.cat, f.c, true);
  cmd.cat->footer("\nExample:\n  ckptfs cat /ckpts/step_100 model/consolidated/model-00001-of-00002.safetensors > out.safetensors\n");

  cmd.exp = app.add_subcommand("export", "Copy a file or directory of the virtual tree to real files");
  cmd.exp->add_option("ROOT", f.c.root, "Checkpoint directory")->required();
  cmd.exp->add_option("PATH", f.vpath, "File or directory inside the tree")->required();
  cmd.exp->add_option("DEST", f.dest, "Destination directory (created)")->required();
  AddCommon(cmd.exp, f.c, true);
  cmd.exp->footer("\nExample:\n  ckptfs export /ckpts/step_100 model/consolidated /tmp/hf\n");
}

void AddCheckCommands(CLI::App& app, Flags& f, Commands& cmd) {
  cmd.check = app.add_subcommand("check", "Report holes, overlaps, changed sources and unreadable items");
  cmd.check->add_option("ROOT", f.c.root, "Checkpoint directory")->required();
  AddCommon(cmd.check, f.c, false);
  cmd.check->footer("\nExample:\n  ckptfs check /ckpts/step_100 && echo clean\n\nPrints each problem, then one summary line; exit status 0 when clean, 5 when there are problems.\n");

  cmd.verify = app.add_subcommand("verify", "Read every byte of every virtual file and validate each safetensors file");
  cmd.verify->add_option("ROOT", f.c.root, "Checkpoint directory")->required();
  cmd.verify->add_option("--against", f.against, "Compare consolidated/ tensor by tensor with this Hugging Face folder");
  cmd.verify->add_flag("--json", f.json, "Print JSON");
  AddCommon(cmd.verify, f.c, true);
  cmd.verify->footer("\nExamples:\n  ckptfs verify /ckpts/step_100\n  ckptfs verify /ckpts/step_100 --against /models/reference-hf\n\n"
                     "Prints each problem, then one summary line; exit status 0 when clean, 5 when there are problems.\n");

  cmd.version = app.add_subcommand("version", "Print the version");
  cmd.help = app.add_subcommand("help", "Print this help");
}

// The log a mount writes to: stderr in the foreground, else a file next to
// its index, said before the daemon detaches.
std::optional<Log> OpenMountLog(const Flags& f, int* rc) {
  const bool foreground = f.foreground || f.debug;
  std::string path = f.log_file;
  if (path.empty() && !foreground) path = IndexPath(f.c) + ".log";
  if (!path.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  }
  std::string error;
  auto log = Log::Open(path, *ParseLogLevel(f.log_level), &error);
  if (!log) {
    Error("--log-file " + error);
    *rc = kExitUsage;
    return std::nullopt;
  }
  if (!path.empty() && !foreground) std::fprintf(stderr, "ckptfs: logging to %s\n", path.c_str());
  return log;
}

// The mount's work, in the foreground or in the background child
// (cli/daemon.h); `detach`, when set, is called once the mount is up.
int MountAndServeFlags(Flags& f, const std::string& mountpoint, Log* out, std::function<void()> detach) {
  int rc = kExitOk;
  f.c.max_loaded = f.max_loaded;
  std::shared_ptr<StoreLoader> store;
  auto fs = OpenFs(f.c, &rc, [out](const std::string& line) { out->Write(LogLevel::kWarn, line); }, &store);
  if (!fs) return rc;
  fs->set_info([out](const std::string& line) { out->Write(LogLevel::kInfo, line); });
  ReadOptions read;
  read.readahead_bytes = uint64_t(f.readahead_mib) << 20;
  if (f.direct_pool_mib > 0) read.direct = std::make_shared<DirectIo>(uint64_t(f.direct_pool_mib) << 20);
  if (!fs->tree().source()->CachesReads()) read.push_tensor_bytes = kPushTensorBytes;
  if (f.fetch_hold_mib > 0) {
    read.hold = std::make_shared<FetchBudget>(uint64_t(f.fetch_hold_mib) << 20);
    // Ranges sized for the server, as many in flight as the client allows.
    if (auto* s3 = dynamic_cast<const S3Source*>(fs->tree().source().get())) {
      read.hold_range_bytes = s3->config().part_size;
      read.hold_threads = s3->config().max_threads;
    }
    out->Write(LogLevel::kInfo, "source-order fetch of whole files: ranges up to " +
                                    std::to_string(read.hold_range_bytes >> 10) + " KiB, " +
                                    std::to_string(read.hold_threads) + " in flight per open file, at most " +
                                    std::to_string(f.fetch_hold_mib) + " MiB held (--fetch-hold-mib)");
  }
  fs->set_read_options(read);
  fs->set_verify_checksums(f.verify_checksums);
  out->Write(LogLevel::kInfo, "mounting " + AbsRoot(f.c.root) + " at " + mountpoint + " (index " + IndexPath(f.c) +
                                  (f.c.cache_dir.empty() ? "" : ", cache " + f.c.cache_dir) + ")");
  MountOptions mo;
  mo.debug = f.debug;
  mo.mounted = std::move(detach);
  mo.allow_other = f.allow_other;
  mo.max_threads = f.threads;
  mo.fsname = AbsRoot(f.c.root);
  mo.watch = !f.no_watch;
  mo.rescan_ms = f.rescan_ms;
  mo.log = [out](const std::string& line) { out->Write(LogLevel::kWarn, line); };
  mo.report = [out](const std::string& line) { out->Write(LogLevel::kInfo, line); };
  mo.live.log = [out](const std::string& line) { out->Write(LogLevel::kInfo, line); };
  std::shared_ptr<const Source> source = fs->tree().source();
  mo.live.scan = [source, out](const std::string& rel) {
    ScanOptions so;
    so.warn = [out](const std::string& line) { out->Write(LogLevel::kWarn, line); };
    return ScanCheckpointDir(*source, rel, so);
  };
  mo.live.resaved = [source](const std::string& rel) { return CommitPointIsNewest(*source, rel); };
  mo.live.mark = [source](const std::string& rel) { return CheckpointMark(*source, rel); };
  mo.live.commit = [store](const Checkpoint& ckpt) { return store->Commit(ckpt); };
  mo.live.remove = [store](const std::string& dir) { return store->Remove(dir); };
  Status st = MountAndServe(std::move(fs), mountpoint, mo);
  if (!st.ok()) {
    Error(st.message());
    out->Write(LogLevel::kError, st.message());
    return kExitMountFailed;
  }
  if (read.direct) out->Write(LogLevel::kInfo, read.direct->stats().Describe());
  if (auto* s3 = dynamic_cast<const S3Source*>(source.get())) {
    out->Write(LogLevel::kInfo, s3->fetched().Describe());
    // Exact, for comparing with the per-checkpoint counts above it.
    out->Write(LogLevel::kInfo, "s3: " + std::to_string(s3->fetched().bytes) + " bytes received");
    if (s3->disk_cache()) out->Write(LogLevel::kInfo, s3->disk_cache()->stats().Describe());
  }
  out->Write(LogLevel::kInfo, "unmounted " + mountpoint);
  return kExitOk;
}

int RunMount(Flags& f) {
  auto mountpoint = CheckMountpoint(f.mountpoint, f.allow_non_empty);
  if (!mountpoint.ok()) {
    Error(mountpoint.status().message());
    return kExitMountFailed;
  }
  int rc = kExitOk;
  auto log = OpenMountLog(f, &rc);
  if (!log) return rc;
  Log* out = &*log;
  if (f.foreground || f.debug) return MountAndServeFlags(f, *mountpoint, out, {});
  return RunInBackground([&](std::function<void()> detach) { return MountAndServeFlags(f, *mountpoint, out, detach); });
}

// Each checkpoint's mesh/<spec>/: opening it builds the views or says why not.
int RunMeshListing(VirtualFs& fs, const std::string& spec) {
  int status = kExitOk;
  for (const std::string& ck : fs.CheckpointDirs()) {
    std::string dir = (ck.empty() ? "" : ck + "/") + "mesh/" + spec;
    auto spec_dir = fs.Resolve(dir);
    if (!spec_dir.ok()) {  // the reason was logged by the lookup
      status = kExitNoSource;
      continue;
    }
    std::printf("%s/\n", dir.c_str());
    auto ranks = fs.ReadDir(spec_dir->ino);
    for (const auto& rank : ranks.value()) {
      std::printf("  %s/\n", rank.name.c_str());
      auto files = fs.ReadDir(rank.attr.ino);
      for (const auto& file : files.value())
        std::printf("    %14llu  %s\n", static_cast<unsigned long long>(file.attr.size), file.name.c_str());
    }
  }
  return status;
}

const char* ModeString(const Attr& a) {
  if (a.is_dir()) return "dr-xr-xr-x";
  if ((a.mode & S_IFMT) == S_IFLNK) return "lrwxrwxrwx";
  return "-r--r--r--";
}

int RunListing(VirtualFs& fs, const Attr& attr, const std::string& vpath, bool as_json) {
  std::vector<DirEntry> entries;
  if (attr.is_dir()) {
    auto e = fs.ReadDir(attr.ino);
    if (!e.ok()) {
      Error(e.status().message());
      return kExitNoSource;
    }
    entries = std::move(*e);
  } else {
    entries.push_back({std::filesystem::path(vpath).filename().string(), attr});
  }
  if (as_json) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& e : entries)
      out.push_back({{"name", e.name}, {"type", e.attr.is_dir() ? "dir" : "file"}, {"size", e.attr.size},
                     {"virtual", e.attr.is_virtual}});
    std::cout << out.dump(2) << "\n";
    return kExitOk;
  }
  for (const auto& e : entries)
    std::printf("%s %14llu  %s%s\n", ModeString(e.attr), static_cast<unsigned long long>(e.attr.size), e.name.c_str(),
                e.attr.is_dir() ? "/" : "");
  return kExitOk;
}

// Writes one virtual file to `out` through a partial file, never leaving a
// partial file under the real name.
int ExportFile(VirtualFs& fs, const Attr& a, const std::string& src, const std::filesystem::path& out,
               Progress* progress, uint64_t* done) {
  std::error_code ec;
  std::filesystem::create_directories(out.parent_path(), ec);
  std::string tmp = out.string() + ".ckptfs-partial";
  std::FILE* file = std::fopen(tmp.c_str(), "wb");
  if (!file) {
    Error(tmp + ": " + std::strerror(errno));
    return kExitWriteError;
  }
  int r = CopyOut(fs, a, src, file, progress, done);
  if (std::fclose(file) != 0 && r == kExitOk) {
    Error(tmp + ": " + std::strerror(errno));
    r = kExitWriteError;
  }
  if (r != kExitOk) {
    std::filesystem::remove(tmp, ec);
    return r;
  }
  std::filesystem::rename(tmp, out, ec);
  if (ec) {
    Error(out.string() + ": " + ec.message());
    return kExitWriteError;
  }
  return kExitOk;
}

int RunExport(VirtualFs& fs, const Attr& attr, const std::string& vpath, const std::string& dest) {
  std::vector<std::pair<std::string, Attr>> files;  // relative name, attr
  std::function<bool(const std::string&, const Attr&)> walk = [&](const std::string& rel, const Attr& a) {
    if (!a.is_dir()) {
      files.push_back({rel, a});
      return true;
    }
    auto entries = fs.ReadDir(a.ino);
    if (!entries.ok()) return false;
    for (const auto& e : *entries)
      if (!walk(rel.empty() ? e.name : rel + "/" + e.name, e.attr)) return false;
    return true;
  };
  std::string base = attr.is_dir() ? "" : std::filesystem::path(vpath).filename().string();
  if (!walk(base, attr)) {
    Error("cannot list " + vpath);
    return kExitNoSource;
  }
  uint64_t total = 0, done = 0;
  for (const auto& file : files) total += file.second.size;
  Progress progress("export " + vpath, total, "bytes");
  for (const auto& [rel, a] : files) {
    std::string src = vpath.empty() ? rel : (attr.is_dir() ? vpath + "/" + rel : vpath);
    int r = ExportFile(fs, a, src, std::filesystem::path(dest) / rel, &progress, &done);
    if (r != kExitOk) return r;
  }
  return kExitOk;
}

// ls PATH, cat and export: commands on one path of the virtual tree.
int RunPathCommand(VirtualFs& fs, const Flags& f, const Commands& cmd) {
  auto attr = fs.Resolve(f.vpath);
  if (!attr.ok()) {
    Error(attr.status().message());
    return kExitNoSource;
  }
  if (*cmd.ls) return RunListing(fs, *attr, f.vpath, f.json);
  if (*cmd.cat) {
    if (attr->is_dir()) {
      Error(f.vpath + " is a directory (use `ckptfs ls` or `ckptfs export`)");
      return kExitUsage;
    }
    uint64_t done = 0;
    return CopyOut(fs, *attr, f.vpath, stdout, nullptr, &done);
  }
  return RunExport(fs, *attr, f.vpath, f.dest);
}

int Dispatch(CLI::App& app, Flags& f, const Commands& cmd) {
  if (*cmd.version) return std::printf("%s\n", kVersion), kExitOk;
  if (*cmd.help) return std::printf("%s", app.help().c_str()), kExitOk;
  if (*cmd.index) return f.dump ? DumpIndex(f.c, std::cout) : BuildIndex(f.c, f.quiet);
  if (*cmd.check) return RunCheck(f.c);
  if (*cmd.mount) return RunMount(f);
  int rc = kExitOk;
  auto fs = OpenFs(f.c, &rc);
  if (!fs) return rc;
  if (*cmd.inspect) return RunInspect(*fs, f.tensor_name, f.json);
  if (*cmd.verify) return RunVerify(*fs, f.against, f.json);
  if (*cmd.ls && f.vpath.empty() && f.mesh_spec.empty()) return RunTensorTable(fs->LoadAll(), f.pattern, f.json);
  if (*cmd.ls && !f.mesh_spec.empty()) return RunMeshListing(*fs, f.mesh_spec);
  return RunPathCommand(*fs, f, cmd);
}

int Main(int argc, char** argv) {
  CLI::App app{"ckptfs: mount sharded training checkpoints as Hugging Face folders, computed on read."};
  app.footer(kExamples);
  app.require_subcommand(1);
  app.set_version_flag("--version", kVersion);
  Flags f;
  Commands cmd;
  AddIndexAndMount(app, f, cmd);
  AddReadCommands(app, f, cmd);
  AddCheckCommands(app, f, cmd);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? kExitOk : kExitUsage;
  }
  auto size = ParseSize(f.c.max_file_size);
  if (!size) {
    Error("--max-file-size: cannot read '" + f.c.max_file_size + "' as a size (try 5GB or 512MiB)");
    return kExitUsage;
  }
  f.c.max_file_bytes = *size;
  if (int rc = ResolveCacheFlags(f.c); rc != kExitOk) return rc;
  return Dispatch(app, f, cmd);
}

}  // namespace
}  // namespace ckptfs

int main(int argc, char** argv) {
  try {
    return ckptfs::Main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ckptfs: internal error: %s\n", e.what());
    return 1;
  }
}
