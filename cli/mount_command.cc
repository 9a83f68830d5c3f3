// `ckptfs mount`: serve a checkpoint tree through FUSE, in the foreground or
// as a background daemon (cli/daemon.h), logging to cli/log.h's Log.
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "cli/commands.h"
#include "cli/daemon.h"
#include "cli/log.h"
#include "cli/store_loader.h"
#include "fs/mount.h"
#include "indexer/index_store.h"
#include "indexer/scan.h"
#include "source/posix_source.h"
#include "source/s3_config.h"

namespace ckptfs {
namespace {

struct MountFlags {
  bool foreground = false, debug = false, allow_other = false, allow_non_empty = false;
  bool no_watch = false, verify_checksums = false;
  unsigned threads = 16;
  unsigned readahead_mib = 32;
  unsigned direct_pool_mib = 0;  // off: slower than the page cache where measured (BENCHMARKS)
  // 1 GiB: a ~0.5B-parameter bf16 model whole, or the ranges a loader has
  // not reached yet of a larger one; 4 % of a 24 GiB machine.
  unsigned fetch_hold_mib = 1024;
  bool fetch_direct = false;
  unsigned rescan_ms = 2000;
  size_t max_loaded = 32;  // mount only: the one-shot commands load what they need
  std::string mountpoint, log_file, log_level = "info";
};

void AddMountFlags(CLI::App* m, MountFlags& f, Common& c) {
  m->add_option("ROOT", c.root, "Checkpoint directory")->required();
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
  m->add_option("--compute-cache-mib", c.compute_cache_mib,
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
  m->add_flag("--fetch-direct", f.fetch_direct,
              "Read the ranges of --fetch-hold-mib with O_DIRECT where the source's filesystem allows it, instead "
              "of pinning them in the page cache: the sources' pages are not cached beside the virtual files' "
              "(ranges already in the page cache are still read from it). Off by default: on the virtual disks "
              "measured so far it was no faster, and at times slower (the device needed the kernel's "
              "read-ahead); try it on local NVMe, or where the page cache is short, and compare");
  m->add_flag("--verify-checksums", f.verify_checksums,
              "Check each chunk's recorded CRC32C (checkpoints saved by ckptfs's writer) on its first read: a chunk "
              "that differs answers EIO, the rest keep serving. The first read of a chunk reads all of it");
  m->add_option("--log-file", f.log_file,
                "Append log lines here (default: stderr with -f, else <index>.log next to the index)");
  m->add_option("--log-level", f.log_level, "error, warn, info (default) or debug")
      ->check(CLI::IsMember({"error", "warn", "info", "debug"}));
  AddCommon(m, c, true);
  m->footer("\nExamples:\n  ckptfs mount /ckpts/step_100 /mnt/s100\n  ckptfs mount -f --max-file-size 2GB /ckpts/step_100 /mnt/s100\n"
            "  ckptfs mount s3://bucket/run1 /mnt/run1 --endpoint-url http://minio:9000   # new steps by listing every --rescan-ms\n  fusermount3 -u /mnt/s100     # unmount\n\nExit status 7 when the mountpoint is missing, not a directory, not empty or already mounted.\n");
}

// The log a mount writes to: stderr in the foreground, else a file next to
// its index, said before the daemon detaches.
std::optional<Log> OpenMountLog(const MountFlags& f, const Common& c, int* rc) {
  const bool foreground = f.foreground || f.debug;
  std::string path = f.log_file;
  if (path.empty() && !foreground) path = IndexPath(c) + ".log";
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

// How the mount reads its sources, from the flags and the source's kind.
ReadOptions MakeReadOptions(const MountFlags& f, const Source& source, Log* out) {
  ReadOptions read;
  read.readahead_bytes = uint64_t(f.readahead_mib) << 20;
  if (f.direct_pool_mib > 0) read.direct = std::make_shared<DirectIo>(uint64_t(f.direct_pool_mib) << 20);
  if (!source.CachesReads()) read.push_tensor_bytes = kPushTensorBytes;
  if (f.fetch_hold_mib > 0) {
    // Ranges sized for the server, as many in flight as the client allows.
    if (auto shape = source.PreferredFetch()) {
      read.hold_range_bytes = shape->range_bytes;
      read.hold_threads = shape->threads;
    }
    read.hold =
        std::make_shared<FetchBudget>(uint64_t(f.fetch_hold_mib) << 20, read.hold_range_bytes, read.hold_threads);
    read.hold_direct = f.fetch_direct;
    out->Write(LogLevel::kInfo, "source-order fetch of whole files: ranges up to " +
                                    std::to_string(read.hold_range_bytes >> 10) + " KiB, " +
                                    std::to_string(read.hold_threads) + " in flight per open file, at most " +
                                    std::to_string(f.fetch_hold_mib) + " MiB held (--fetch-hold-mib)" +
                                    (f.fetch_direct ? ", read with O_DIRECT (--fetch-direct)" : ""));
  }
  return read;
}

// The FUSE session's options, and the live root's hooks into the source and
// the store.
MountOptions MakeMountOptions(const MountFlags& f, const Common& c, std::shared_ptr<const Source> source,
                              std::shared_ptr<StoreLoader> store, Log* out, std::function<void()> detach) {
  MountOptions mo;
  mo.debug = f.debug;
  mo.mounted = std::move(detach);
  mo.allow_other = f.allow_other;
  mo.max_threads = f.threads;
  mo.fsname = AbsRoot(c.root);
  mo.watch = !f.no_watch;
  mo.rescan_ms = f.rescan_ms;
  mo.log = [out](const std::string& line) { out->Write(LogLevel::kWarn, line); };
  mo.report = [out](const std::string& line) { out->Write(LogLevel::kInfo, line); };
  mo.live.log = [out](const std::string& line) { out->Write(LogLevel::kInfo, line); };
  mo.live.scan = [source, out](const std::string& rel) {
    ScanOptions so;
    so.predict_items = true;
    so.warn = [out](const std::string& line) { out->Write(LogLevel::kWarn, line); };
    return ScanCheckpointDir(*source, rel, so);
  };
  mo.live.resaved = [source](const std::string& rel) { return CommitPointIsNewest(*source, rel); };
  mo.live.mark = [source](const std::string& rel) { return CheckpointMark(*source, rel); };
  mo.live.commit = [store](const Checkpoint& ckpt) { return store->Commit(ckpt); };
  mo.live.remove = [store](const std::string& dir) { return store->Remove(dir); };
  return mo;
}

// The mount's work, in the foreground or in the background child
// (cli/daemon.h); `detach`, when set, is called once the mount is up.
int MountAndServeFlags(const MountFlags& f, Common& c, const std::string& mountpoint, Log* out,
                       std::function<void()> detach) {
  int rc = kExitOk;
  c.max_loaded = f.max_loaded;
  c.predict_items = true;
  std::shared_ptr<StoreLoader> store;
  auto fs = OpenFs(c, &rc, [out](const std::string& line) { out->Write(LogLevel::kWarn, line); }, &store);
  if (!fs) return rc;
  fs->set_info([out](const std::string& line) { out->Write(LogLevel::kInfo, line); });
  std::shared_ptr<const Source> source = fs->tree().source();
  ReadOptions read = MakeReadOptions(f, *source, out);
  fs->set_read_options(read);
  fs->set_verify_checksums(f.verify_checksums);
  out->Write(LogLevel::kInfo, "mounting " + AbsRoot(c.root) + " at " + mountpoint + " (index " + IndexPath(c) +
                                  (c.cache_dir.empty() ? "" : ", cache " + c.cache_dir) + ")");
  MountOptions mo = MakeMountOptions(f, c, source, store, out, std::move(detach));
  Status st = MountAndServe(std::move(fs), mountpoint, mo);
  if (!st.ok()) {
    Error(st.message());
    out->Write(LogLevel::kError, st.message());
    return kExitMountFailed;
  }
  if (read.direct) out->Write(LogLevel::kInfo, read.direct->stats().Describe());
  for (const std::string& line : source->DescribeTraffic()) out->Write(LogLevel::kInfo, line);
  out->Write(LogLevel::kInfo, "unmounted " + mountpoint);
  return kExitOk;
}

int RunMount(const MountFlags& f, Common& c) {
  auto mountpoint = CheckMountpoint(f.mountpoint, f.allow_non_empty);
  if (!mountpoint.ok()) {
    Error(mountpoint.status().message());
    return kExitMountFailed;
  }
  // A local root that is not there fails before a log file is made for it.
  if (!IsS3Url(c.root))
    if (auto root = PosixSource::OpenRoot(c.root); !root.ok()) {
      Error(root.status().message());
      return kExitNoSource;
    }
  int rc = kExitOk;
  auto log = OpenMountLog(f, c, &rc);
  if (!log) return rc;
  Log* out = &*log;
  if (f.foreground || f.debug) return MountAndServeFlags(f, c, *mountpoint, out, {});
  return RunInBackground(
      [&](std::function<void()> detach) { return MountAndServeFlags(f, c, *mountpoint, out, detach); });
}

}  // namespace

Handler DefineMount(CLI::App* cmd, Common& c) {
  auto f = std::make_shared<MountFlags>();
  AddMountFlags(cmd, *f, c);
  return [f, &c] { return RunMount(*f, c); };
}

}  // namespace ckptfs
