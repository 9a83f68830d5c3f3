// Mounting a VirtualFs with FUSE3 (the only code that includes FUSE headers
// is fs/mount.cc).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "core/status.h"
#include "fs/live_root.h"
#include "fs/virtual_fs.h"

namespace ckptfs {

struct MountOptions {
  bool debug = false;       // libfuse's request log
  // Called once the filesystem is mounted, before serving (a background
  // mount detaches from the terminal there: cli/daemon.h). May be empty.
  std::function<void()> mounted;
  bool allow_other = false; // let other users in (needs user_allow_other)
  unsigned max_threads = 16;
  std::string fsname;       // shown in /proc/mounts, df, mount (the source root)
  bool watch = true;        // watch the sources for changes (inotify + rescan)
  unsigned rescan_ms = 2000;  // periodic re-check of the sources; 0 = never
  // Called with one line per event worth a log line. Must be thread-safe.
  std::function<void(const std::string&)> log;
  // With live.scan set (and watch on), checkpoints that appear under the
  // root are indexed and served, and deleted ones disappear (fs/live_root.h).
  LiveRoot::Hooks live;
  // Receives VirtualFs::FetchReport() (what each checkpoint fetched and
  // served) on every SIGUSR1 and once at unmount. May be empty.
  std::function<void(const std::string&)> report;
};

// Checks a mountpoint the way mount-s3 does, before anything is indexed or
// forked: it exists, is a directory, is not already a mountpoint, and is
// empty unless `allow_non_empty`. Returns its absolute, resolved path (a
// relative path would break unmounting after the daemon's chdir("/")).
Result<std::string> CheckMountpoint(const std::string& mountpoint, bool allow_non_empty);

// Mounts `fs` at `mountpoint` (absolute: see CheckMountpoint) and serves
// until unmounted (fusermount3 -u) or signalled. Returns once the filesystem
// is unmounted. It never forks: threads and RocksDB started before it keep
// working.
Status MountAndServe(std::unique_ptr<VirtualFs> fs, const std::string& mountpoint,
                     const MountOptions& options);

}  // namespace ckptfs
