// Shared pieces of the ckptfs CLI: exit codes, the flags every subcommand
// takes, and opening a checkpoint tree (index -> Catalog -> VirtualFs).
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>

#include "fs/virtual_fs.h"
#include "source/s3_config.h"
#include "source/source.h"
#include "cli/progress.h"

namespace ckptfs {

class StoreLoader;

// Exit codes (docs/CLI.md).
enum Exit : int {
  kExitOk = 0,
  kExitUsage = 2,        // bad flags or arguments
  kExitNoSource = 3,     // the source root or a virtual path does not exist / cannot be read
  kExitStale = 4,        // sources changed since indexing: re-run `ckptfs index`
  kExitProblems = 5,     // indexed, but the checkpoint has problems (holes, bad files)
  kExitReadError = 6,    // data could not be served (EIO): see the message
  kExitMountFailed = 7,  // the mount itself failed
  kExitIndexError = 8,   // the index could not be written or read
  kExitIndexBusy = 9,    // another process (a mount, another `ckptfs index`) holds the index for writing
  kExitWriteError = 10,  // (export, cat) the destination could not be written
};


struct Common {
  std::string root;
  std::string index;  // --index; default from DefaultIndexPath
  uint64_t max_file_bytes = 5'000'000'000;
  std::string max_file_size = "5GB";
  std::string mapping;
  std::string rules;  // --rules FILE
  std::string names;  // --names FILE
  bool reindex = false;
  size_t max_loaded = 0;  // mount --max-loaded (FsOptions::max_loaded)
  // A mount's index places DCP items by prediction over object storage
  // (ScanOptions::predict_items); `ckptfs index` reads their framing.
  bool predict_items = false;
  S3Flags s3;             // an s3:// root: --endpoint-url, --region, ...
  std::string part_size = "8MiB";  // --part-size, parsed into s3.part_size
  std::string cache_dir;           // --cache DIR (s3:// roots), made absolute by ResolveCacheFlags
  std::string max_cache_size;      // --max-cache-size, parsed into max_cache_bytes
  uint64_t max_cache_bytes = 0;
  std::string keep_dtype;  // --keep-dtype REGEX (FsOptions::keep_dtype)
  uint64_t compute_cache_mib = 512;  // mount --compute-cache-mib
};


void Error(const std::string& msg);
// "5GB" -> 5e9, "512MiB" and "512M" -> 512*2^20, "1000" -> 1000.
std::optional<uint64_t> ParseSize(const std::string& s);
// Checks --cache and --max-cache-size (the size needs the directory, the
// directory an s3:// root), fills max_cache_bytes and makes cache_dir
// absolute (a background mount runs in /). Returns an exit code.
int ResolveCacheFlags(Common& c);
// Refuses the flags of s3:// roots (--endpoint-url, --part-size, ...) on a
// local root, where they would do nothing, as ResolveCacheFlags refuses
// --cache. Returns an exit code.
int CheckS3FlagsFitRoot(const Common& c);
std::string AbsRoot(const std::string& root);

// The source of c.root: a local directory, or an s3:// root (reached once
// now, so a wrong endpoint, secret or bucket fails here with a message
// saying what to fix). Opened once per process. Null with *exit_code set
// (kExitNoSource, kExitUsage) on failure.
std::shared_ptr<const Source> RootSource(const Common& c, int* exit_code);
std::string IndexPath(const Common& c);
size_t CountProblems(const Catalog& catalog);

// Scans the source and commits each checkpoint found into the index (and
// removes those no longer found). Returns an exit code: kExitNoSource when
// some checkpoint could not be read now (the others are committed; their
// count goes to *unread when given).
int BuildIndex(const Common& c, bool quiet, size_t* unread = nullptr);

// Prints every row of the index as one JSON object per line, values decoded
// (`ckptfs index --dump`). Returns an exit code.
int DumpIndex(const Common& c, std::ostream& out);

// Loads the index (building it when missing or when --reindex).
// (Commands other than index and check read an s3:// root through a mount
// tree, which serves local roots only so far: they refuse it.) With
// `allow_stale`, sources that changed since indexing are not an error (for
// `check`, which reports them). Sets *exit_code on failure.
std::optional<Catalog> LoadCatalog(const Common& c, bool allow_stale, int* exit_code);

// The tree of the index's checkpoints (building the index when missing or
// when --reindex), each checked against its sources now and loaded from the
// store on first use. *loader_out, when given, receives the store's loader
// (a mount commits live checkpoints through it). Sets *exit_code on failure.
std::unique_ptr<VirtualFs> OpenFs(const Common& c, int* exit_code, std::function<void(const std::string&)> log = {},
                                  std::shared_ptr<StoreLoader>* loader_out = nullptr);

// Streams a virtual file to `out`, counting into *done; returns an exit code.
int CopyOut(VirtualFs& fs, const Attr& a, const std::string& vpath, std::FILE* out, Progress* progress,
            uint64_t* done);

// Inspection subcommands (cli/inspect_commands.cc).
int RunTensorTable(const std::vector<LoadedCheckpoint>& checkpoints, const std::string& pattern, bool json);
int RunInspect(VirtualFs& fs, const std::string& name, bool json);
int RunCheck(const Common& c);
int RunVerify(VirtualFs& fs, const std::string& against, bool json);

}  // namespace ckptfs
