// OpenFiles: the files opened through a VirtualFs (fs/virtual_fs.h), their
// reads, and the EIO served once a source is seen changed.
//
// A source file's handle reads the source tree. A virtual file's handle
// pins its checkpoint (loading it again if it was unloaded since the kernel
// looked the file up: the inode is still this file's); a read plans the
// file's layout (core/planner.h), runs the plan through the checkpoint's
// SourceReader (a merged/ file's own), fills computed bytes from the
// ComputeCache and queues read-ahead. A source seen changed, by a read or by
// RecheckSources, makes its checkpoint (or merged view) read as EIO from
// then on, and the kernel's pages of its files are dropped.
//
// Errors served on reads and opens are logged through a LogLimiter (a few
// lines per checkpoint and cause every 10 s, then a count).
//
// Thread-safe; no lock is held during a read.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "core/planner.h"
#include "fs/checkpoint_set.h"
#include "fs/compute_cache.h"
#include "fs/fs_error.h"
#include "fs/fs_options.h"
#include "fs/log_limiter.h"
#include "fs/node_table.h"
#include "fs/source_tree.h"
#include "fs/view_builder.h"
#include "source/scatter_reply.h"

namespace ckptfs {

class OpenFiles {
 public:
  OpenFiles(const FsOptions& options, const SourceTree& tree, NodeTable& nodes, CheckpointSet& ckpts,
            ViewBuilder& views, ComputeCache& compute);

  // The operations of VirtualFs of the same names (fs/virtual_fs.h).
  FsResult<uint64_t> Open(uint64_t ino, int flags);
  FsResult<size_t> Read(uint64_t handle, char* buf, size_t size, uint64_t offset);
  FsResult<ScatterReply> ReadScatter(uint64_t handle, size_t size, uint64_t offset);
  void Release(uint64_t handle);
  size_t RecheckSources();

 private:
  struct Handle;
  // The plan of a read of a virtual file through `h`, or the failure to
  // serve (logged).
  FsResult<ReadPlan> PlanRead(const Handle& h, size_t size, uint64_t offset);
  // Logs a failed read of `n` and returns the error to serve; a Stale
  // status marks the checkpoint stale first.
  FsError ReadFailed(const FsNode& n, size_t size, uint64_t offset, const FsError& e);
  FsError ReadFailed(const FsNode& n, size_t size, uint64_t offset, const Status& st);
  // Where the pushes of virtual file `n` of checkpoint `served` go: the
  // kernel's pages of its inode, while the checkpoint is not stale.
  PageSink PushSink(const FsNode& n, const Served* served) const;
  // The reader of an open virtual file: its checkpoint's, or a merged/
  // file's own (fs/merged_view.h).
  static SourceReader* ReaderOf(const Handle& h);
  // Drops the kernel's cache of every virtual file of checkpoint `i`, once,
  // logging `why` (the change seen).
  void InvalidateCheckpoint(int i, const std::string& why);
  // From now on merged view `ms` of checkpoint `ckpt` reads as EIO; the
  // kernel's pages of its files are dropped.
  void MarkMergedStale(const std::shared_ptr<MergedSources>& ms, int ckpt, const std::string& why);
  // Through limiter_, keyed by the checkpoint and the cause.
  void LogServed(int ckpt, const FsError& e, const std::string& line);

  const FsOptions& options_;
  const SourceTree& tree_;
  NodeTable& nodes_;
  CheckpointSet& ckpts_;
  ViewBuilder& views_;
  ComputeCache& compute_;
  LogLimiter limiter_;
  // The bytes served of each virtual file opened for a source-order fetch,
  // by inode (source/ordered_fetch.h, ServedRecord); kept while mounted, as
  // the kernel keeps the pages.
  std::mutex records_mu_;
  std::unordered_map<uint64_t, std::shared_ptr<ServedRecord>> records_;  // guarded by records_mu_
};

}  // namespace ckptfs
