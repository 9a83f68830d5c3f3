// Mounting a VirtualFs with FUSE3 (the only code that includes FUSE headers
// is fs/mount.cc).
#pragma once

#include <memory>
#include <string>

#include "core/status.h"
#include "fs/virtual_fs.h"

namespace ckptfs {

struct MountOptions {
  bool foreground = false;  // else daemonize once the mount is up
  bool debug = false;       // libfuse's request log (implies foreground)
  bool allow_other = false; // let other users in (needs user_allow_other)
  unsigned max_threads = 16;
};

// Mounts `fs` at `mountpoint` and serves until unmounted (fusermount3 -u)
// or signalled. Returns once the filesystem is unmounted; in background mode
// the calling process forks and the parent exits(0) when the mount is up.
Status MountAndServe(std::unique_ptr<VirtualFs> fs, const std::string& mountpoint,
                     const MountOptions& options);

}  // namespace ckptfs
