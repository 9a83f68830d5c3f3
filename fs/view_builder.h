// ViewBuilder: the views a VirtualFs (fs/virtual_fs.h) shows next to each
// checkpoint, as nodes of its NodeTable (fs/node_table.h).
//
// consolidated/, bytes/ and mesh/README are built when a checkpoint is
// loaded (Build); the rest on first use, because most mounts never look:
// `mesh/<spec>/` on the first lookup of a valid spec, consolidated.<dtype>/
// and merged[.<dtype>]/ on their first lookup, the files of `tensors/` on
// its first lookup or listing (for 100k tensors its nodes alone take
// ~40 MB) and a `tensors/` file's layout on its first open. After an unload
// the nodes stay; their layouts are made again on the next open
// (EnsureLayout). One bad view never hides the others: a view that cannot
// be built is left out with a log line.
//
// Thread-safe. A view is built outside the node table's lock and attached
// under it; its checkpoint's load_mu serializes builds of one checkpoint.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>

#include "core/meta.h"
#include "core/hf_folder.h"
#include "fs/checkpoint_set.h"
#include "fs/fs_error.h"
#include "fs/fs_options.h"
#include "fs/node_table.h"
#include "fs/source_tree.h"

namespace ckptfs {

class ViewBuilder {
 public:
  ViewBuilder(const FsOptions& options, const SourceTree& tree, NodeTable& nodes, CheckpointSet& ckpts);

  // Builds consolidated/, bytes/ and mesh/ of checkpoint `i`, just loaded,
  // and attaches them to `dir`, with tensors/ empty until first used.
  Status Build(int i, FsNode* dir);
  // Makes the files of `dir` if it is a tensors/ not yet filled.
  // REQUIRES: its checkpoint pinned.
  FsError EnsureFilled(FsNode* dir);
  // The inode of virtual entry `name` of `dir`, 0 when there is none,
  // building a view made on first lookup. REQUIRES: `dir`'s views pinned.
  FsResult<uint64_t> Child(FsNode* dir, const std::string& name);
  // The layout of a virtual file whose checkpoint is pinned and loaded: a
  // tensors/ file's and a mesh file's are made again after an unload.
  FsError EnsureLayout(FsNode* file, const Served& served);

 private:
  // Holds checkpoint `ckpt`'s build lock (one build at a time), loaded;
  // `built` is entry `name` of `dir` when another thread built it first.
  struct BuildTurn {
    std::unique_lock<std::mutex> lock;
    uint64_t built = 0;
  };
  FsResult<BuildTurn> TakeBuildTurn(int ckpt, FsNode* dir, const std::string& name);
  // mesh/<spec>/rank-NNNNN/, made on first lookup; ENOENT, with a log line
  // saying why, for a spec malformed or impossible for the checkpoint.
  FsResult<uint64_t> OpenMesh(FsNode* mesh_dir, const std::string& spec_name);
  // consolidated.<dtype>/ of the checkpoint shown in `dir`, made on its
  // first lookup (ENOENT with a log line for an unknown dtype).
  // REQUIRES: ParseViewName(name) is consolidated's, with a suffix.
  FsResult<uint64_t> OpenDTypeView(FsNode* dir, const std::string& name);
  // merged/ or merged.<dtype>/ of the LoRA adapter shown in `dir`, made on
  // its first lookup (fs/merged_view.h); ENOENT with a log line saying why
  // when it cannot be. REQUIRES: ParseViewName(name) is merged's.
  FsResult<uint64_t> OpenMergedView(FsNode* dir, const std::string& name);
  FsError FillNpy(FsNode* npy_dir);
  bool ViewsAttached(const FsNode& dir) const;
  // Why adapter `ckpt` gets no merged/ ("" when it does: a LoRA adapter
  // whose base is a checkpoint of this mount).
  std::string MergedRefusal(const Checkpoint& ckpt) const;
  // A copy of the rows of the checkpoint in `dir`, loaded for the copy.
  Result<Checkpoint> RowsOf(const std::string& dir);
  // The DTypeView for suffix `suffix` of checkpoint `ckpt`.
  Result<DTypeView> DTypeViewFor(const Checkpoint& ckpt, const std::string& suffix) const;
  Result<ShardingRules> RulesFor(const Checkpoint& ckpt) const;

  const FsOptions& options_;
  const SourceTree& tree_;
  NodeTable& nodes_;
  CheckpointSet& ckpts_;
};

}  // namespace ckptfs
