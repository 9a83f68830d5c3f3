// VirtualFs: the tree a mount shows, with no FUSE in sight.
//
// The source tree is mirrored read-only (entries are looked up in the real
// directory on demand, so new files appear); next to each checkpoint the
// views are injected as virtual directories (`consolidated/`, `tensors/`,
// `bytes/`, `mesh/`). Where a real entry has the same name as a virtual one,
// the real entry wins. Live: checkpoints can be added and removed while
// mounted.
//
// VirtualFs answers the FUSE operations and composes the parts that hold
// its state, each with its own header:
//   NodeTable (fs/node_table.h): the inodes, allocated on first lookup and
//     never reused; the lock that guards them and the checkpoint registry.
//   CheckpointSet (fs/checkpoint_set.h): the checkpoints, each loaded on
//     first use and unloaded beyond FsOptions::max_loaded (its nodes and
//     inode numbers kept, so a file the kernel still knows opens instead of
//     failing ESTALE).
//   ViewBuilder (fs/view_builder.h): the views, built when a checkpoint is
//     loaded or on their first lookup.
//   OpenFiles (fs/open_files.h): handles, reads, and the EIO served once a
//     source changed since indexing.
//
// Thread-safe: the FUSE loop calls it from many threads. The node table's
// lock is never held while calling into SourceReader or doing file I/O.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/meta.h"
#include "fs/checkpoint_set.h"
#include "fs/compute_cache.h"
#include "fs/fs_error.h"
#include "fs/fs_options.h"
#include "fs/node_table.h"
#include "fs/open_files.h"
#include "fs/source_tree.h"
#include "fs/view_builder.h"
#include "source/scatter_reply.h"
#include "source/source_reader.h"

namespace ckptfs {

struct Attr {
  uint64_t ino = 0;
  uint32_t mode = 0;  // S_IFDIR/S_IFREG/S_IFLNK | permission bits (never writable)
  uint64_t size = 0;
  uint32_t nlink = 1;
  int64_t mtime_ns = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  bool is_virtual = false;  // immutable: may be cached for long
  bool is_dir() const;
};

struct DirEntry {
  std::string name;
  Attr attr;
};

// A loaded checkpoint, for the CLI's inspection commands.
struct LoadedCheckpoint {
  const Checkpoint* ckpt;
  SourceReader* reader;
};

class VirtualFs {
 public:
  static constexpr uint64_t kRootIno = NodeTable::kRootIno;

  // The checkpoints in `dirs` under `root`, loaded by `loader` on first use.
  static Result<std::unique_ptr<VirtualFs>> Open(std::shared_ptr<const Source> source,
                                                 const std::vector<std::string>& dirs, CheckpointLoader loader,
                                                 FsOptions options);
  // Over the POSIX directory `root` (absolute, resolved).
  static Result<std::unique_ptr<VirtualFs>> Open(std::string root, const std::vector<std::string>& dirs,
                                                 CheckpointLoader loader, FsOptions options);
  // Every checkpoint of `catalog`, already in memory.
  static Result<std::unique_ptr<VirtualFs>> Create(Catalog catalog, FsOptions options);
  ~VirtualFs();

  // `for_kernel`: the answer goes to the kernel, which holds the inode until
  // it forgets it (Forget).
  FsResult<Attr> Lookup(uint64_t parent, const std::string& name, bool for_kernel = false);
  FsResult<Attr> GetAttr(uint64_t ino);
  // Entries other than "." and "..", sorted by name.
  FsResult<std::vector<DirEntry>> ReadDir(uint64_t ino);
  // Returns a handle for Read/Release. Any write access is EROFS.
  FsResult<uint64_t> Open(uint64_t ino, int flags);
  // Reads up to `size` bytes; fewer only at end of file.
  FsResult<size_t> Read(uint64_t handle, char* buf, size_t size, uint64_t offset);
  // Read, as a finished scatter list (source/scatter_reply.h): a virtual
  // file's pieces point into the buffers its source reads filled. A source
  // file's reply points into a buffer of the calling thread, valid until
  // that thread's next ReadScatter.
  FsResult<ScatterReply> ReadScatter(uint64_t handle, size_t size, uint64_t offset);
  void Release(uint64_t handle);
  // The target of a symlink in the source tree (never followed by us).
  FsResult<std::string> ReadLink(uint64_t ino);
  // The kernel dropped `nlookup` of its references to `ino` (FUSE forget).
  // A node of a replaced or removed checkpoint is freed once it holds none.
  void Forget(uint64_t ino, uint64_t nlookup);
  // Nodes in the table and checkpoint entries held (for tests and logs).
  size_t NodeCount() const;
  size_t ServedCount() const;

  // Re-checks the sources of every checkpoint; a checkpoint with a source
  // changed since indexing reads as EIO from now on and its virtual files
  // are invalidated in the kernel's cache. Returns how many were found
  // changed by this call. Called by the source watcher.
  size_t RecheckSources();

  // One line per checkpoint that fetched or served bytes (source bytes
  // fetched, of them in source order and refetched, bytes served), then the
  // source-order hold's peak against its bound: what the mount logs at
  // unmount and on SIGUSR1.
  std::vector<std::string> FetchReport() const;
  // Absolute paths of the directories holding sources (for the watcher).
  std::vector<std::string> SourceDirs() const;
  // Replace FsOptions' fields (invalidate_entry: see there); call only while
  // no request is served. `read` applies to checkpoints loaded from then on.
  void set_info(std::function<void(const std::string&)> f) { options_.info = std::move(f); }
  void set_invalidate(std::function<void(uint64_t)> f) { options_.invalidate = std::move(f); }
  void set_invalidate_entry(FsOptions::InvalidateEntry f) { options_.invalidate_entry = std::move(f); }
  void set_store(FsOptions::Store f) { options_.store = std::move(f); }
  void set_read_options(ReadOptions read) { options_.read = read; }
  void set_verify_checksums(bool on) { options_.verify_checksums = on; }

  // "model/consolidated/model.safetensors" -> its attributes ("" is the root).
  FsResult<Attr> Resolve(const std::string& path);

  const std::string& root() const { return tree_->root(); }
  const SourceTree& tree() const { return *tree_; }

  // Live changes. AddCheckpoint registers a committed checkpoint (its views
  // appear on the next lookup; an earlier one in `dir` is replaced and its
  // open files keep their old rows). RemoveCheckpoint forgets one.
  // `rows`, when given, are served instead of asking the loader.
  void AddCheckpoint(const std::string& dir, std::optional<Checkpoint> rows = std::nullopt);
  void RemoveCheckpoint(const std::string& dir);
  // Directories of the checkpoints served now, sorted; with `stale_only`,
  // just those with a source changed since they were indexed.
  std::vector<std::string> CheckpointDirs(bool stale_only = false) const;

  // Loads every checkpoint now (the CLI's ls, inspect, verify), sorted by
  // directory. One that cannot be loaded is logged and left out.
  std::vector<LoadedCheckpoint> LoadAll();

 private:
  using Node = FsNode;
  VirtualFs(FsOptions options, std::unique_ptr<SourceTree> tree, CheckpointLoader loader);
  void DropKernelEntries(const Detached& old) const;
  FsResult<Attr> AttrOf(const Node& n) const;

  FsOptions options_;
  std::unique_ptr<const SourceTree> tree_;
  int64_t mounted_at_ns_ = 0;  // mtime of virtual entries
  std::unique_ptr<ComputeCache> compute_;  // blocks of computed tensors, tagged by checkpoint
  NodeTable nodes_;
  CheckpointSet ckpts_;
  ViewBuilder views_;
  OpenFiles files_;
};

}  // namespace ckptfs
