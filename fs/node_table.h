// NodeTable: the inodes of a VirtualFs (fs/virtual_fs.h) and the lock that
// guards them.
//
// A node is a source entry (a path of the source tree, made on its first
// lookup and kept for the life of the mount) or a virtual one (a view's
// directory or file, tagged with the checkpoint it shows). Inode numbers
// are allocated on first lookup and never reused (so the FUSE generation is
// always 0); a checkpoint loaded again refills the nodes it had. The nodes
// of a replaced or removed checkpoint are detached: they leave the tree at
// once and the table once the kernel forgets them.
//
// mu() also guards the checkpoint registry (fs/checkpoint_set.h): a
// checkpoint is hosted in a directory and its views are attached to that
// directory's node under one exclusive hold. It is never held during I/O.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/layout.h"
#include "core/views.h"
#include "fs/merged_view.h"

namespace ckptfs {

enum class NodeKind { kSourceDir, kSourceFile, kSourceLink, kVirtualDir, kVirtualFile };

struct FsNode {
  using Kind = NodeKind;
  Kind kind;
  uint64_t ino = 0;
  uint64_t parent = 0;
  std::string name;
  std::string rel;                              // source kinds
  std::shared_ptr<const Layout> layout;         // virtual file (freed when its checkpoint is unloaded)
  std::shared_ptr<MergedSources> sources;       // a merged/ file: read through these, not its checkpoint's
  uint64_t size = 0;                            // virtual file: layout->size(), kept
  std::string problem;                          // virtual file that cannot be served
  std::map<std::string, uint64_t> children;     // virtual entries (in any dir)
  int ckpt = -1;                                // virtual kinds: the checkpoint they show;
                                                // a source dir: whose views `children` holds
  bool is_mesh = false;                         // a mesh/ dir: specs are made on lookup
  bool is_spec = false;                         // a mesh/<spec>/ dir
  bool is_dtype_view = false;                   // a consolidated.<dtype>/ or merged[.<dtype>]/ dir
  bool built = false;                           // either: its files have layouts (again after an unload)
  bool detached = false;                        // its checkpoint was replaced or removed
  std::atomic<uint64_t> nlookup{0};             // references the kernel holds (lookups - forgets)
  bool is_npy = false;                          // tensors/: its files are made on first use
  int npy = -1;                                 // a tensors/ file: its tensor's index in the
                                                // checkpoint; its layout is made on open

  bool is_dir() const { return kind == Kind::kSourceDir || kind == Kind::kVirtualDir; }
  bool is_source() const { return kind == Kind::kSourceDir || kind == Kind::kSourceFile || kind == Kind::kSourceLink; }
};

// A source directory's views taken off it (its checkpoint was replaced or
// removed): the kernel's entries of these names are dropped once the lock
// is released.
struct Detached {
  uint64_t dir_ino = 0;
  std::vector<std::string> names;
};

class NodeTable {
 public:
  static constexpr uint64_t kRootIno = 1;

  NodeTable();
  std::shared_mutex& mu() const { return mu_; }

  // Shared: a node of a removed checkpoint may leave the table meanwhile.
  std::shared_ptr<FsNode> Find(uint64_t ino) const;
  // nullptr when `ino` left the table. REQUIRES: mu() held.
  FsNode* NodeLocked(uint64_t ino) const;
  // The node of source path `rel`, made (with its parents) on first use.
  FsNode* SourceNode(const std::string& rel, NodeKind kind);
  // REQUIRES: mu() held exclusively (both).
  FsNode* AddVirtual(FsNode* parent, const std::string& name, bool is_dir, int ckpt);
  // `sources`: a merged/ file's own sources (fs/merged_view.h), else null.
  void AddViewFile(FsNode* view, ViewFile f, int ckpt, std::shared_ptr<MergedSources> sources = nullptr);

  // Empties source directory `dir` of the views it shows; what it held goes
  // to `old`. REQUIRES: mu() held exclusively.
  void TakeViewsLocked(const std::string& dir, Detached* old);
  // Takes the nodes of replaced or removed checkpoint `ckpt` out of the
  // tree; those the kernel does not hold leave the table. REQUIRES: mu()
  // held exclusively.
  void DetachLocked(int ckpt);
  // Moves the layouts of checkpoint `ckpt`'s files to `out` (freed by the
  // caller outside the lock), keeping the nodes. REQUIRES: mu() held
  // exclusively.
  void DropLayoutsLocked(int ckpt, std::vector<std::shared_ptr<const Layout>>* out);
  // The kernel dropped `nlookup` of its references to `ino` (FUSE forget).
  void Forget(uint64_t ino, uint64_t nlookup);

  // The inodes of the nodes `pred` accepts (called under mu(), shared).
  std::vector<uint64_t> Select(const std::function<bool(const FsNode&)>& pred) const;
  std::string PathOf(const FsNode& n) const;
  size_t size() const;

 private:
  mutable std::shared_mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<FsNode>> nodes_;  // ino -> node
  uint64_t next_ino_ = kRootIno + 1;                               // never reused
  std::unordered_map<std::string, uint64_t> source_inos_;
};

}  // namespace ckptfs
