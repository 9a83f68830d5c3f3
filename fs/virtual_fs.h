// VirtualFs: the tree a mount shows, with no FUSE in sight.
//
// The source tree is mirrored read-only (entries are looked up in the real
// directory on demand, so new files appear); next to each checkpoint the
// views are injected as virtual directories (`consolidated/`, `tensors/`,
// `bytes/`, `mesh/`). Where a real entry has the same name as a virtual one,
// the real entry wins.
//
// Lazy: a checkpoint is only a directory name until a path inside it is
// first looked up or listed; then its rows are loaded (CheckpointLoader:
// the store, or a catalog in memory) and its views built, in time linear in
// its tensors. With FsOptions::max_loaded, the least recently used loaded
// checkpoint with no open file is unloaded (its rows and plans freed, the
// kernel's entries of its views dropped) and loaded again on next use.
// `mesh/<spec>/` directories are made on first lookup of a valid spec, the
// files of `tensors/` on its first lookup or listing (most mounts never list
// it; for 100k tensors its nodes alone take ~40 MB), and a `tensors/` file's
// layout on its first open. Live: checkpoints can be added and removed while
// mounted.
//
// Inode numbers are allocated on first lookup and kept for the life of the
// mount (kernel FORGETs are ignored: the table grows with distinct paths
// looked up, which for checkpoint trees is small).
//
// Thread-safe: the FUSE loop calls it from many threads. Lock order: mu_
// (the node table) is never held while calling into SourceReader or doing
// file I/O.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/layout.h"
#include "core/meta.h"
#include "core/views.h"
#include "fs/compute_cache.h"
#include "fs/fs_error.h"
#include "fs/source_tree.h"
#include "source/source_reader.h"

namespace ckptfs {

struct FsOptions {
  ConsolidatedOptions consolidated;
  // Contents of a mesh rules file (`--rules`), or empty for the presets.
  std::string rules_json;
  uid_t uid = 0;
  gid_t gid = 0;
  // Checkpoints kept loaded (rows, plans, views); beyond it the least
  // recently used one with no open file is unloaded and loaded again on its
  // next use. 0 = no limit (the CLI's one-shot commands).
  size_t max_loaded = 0;
  // Receives one line per served error (EIO on a read, say) and per view
  // that could not be built. Must be thread-safe.
  std::function<void(const std::string&)> log;
  // Receives one line per checkpoint loaded or unloaded. May be empty.
  std::function<void(const std::string&)> info;
  // Asks the kernel to drop what it cached of inode `ino` (pages and
  // attributes). Called from a reader thread, never while a lock is held;
  // the mount queues it (invalidating from inside a read of the same inode
  // would deadlock on the page lock). May be empty (no kernel cache: cat,
  // export, tests).
  std::function<void(uint64_t ino)> invalidate;
  // Read-ahead and overlapped source reads (source/source_reader.h).
  ReadOptions read;
  // Tensors a dtype view (consolidated.<dtype>/, mesh/<spec>.<dtype>/)
  // keeps as saved: a regex searched in their names (`--keep-dtype`).
  std::string keep_dtype;
  // Bytes of computed tensor blocks kept for readers (`--compute-cache-mib`,
  // fs/compute_cache.h). 512 MiB: a ~1B-parameter model's largest matrices
  // many times over, 2 % of a 24 GiB machine, which the page cache needs
  // more (it holds the served pages themselves).
  uint64_t compute_cache_bytes = 512ull << 20;
  // Check each chunk's recorded CRC32C on its first read; a mismatch is EIO
  // for the reads touching that chunk (ChecksumGate, source/checksums.h).
  bool verify_checksums = false;
};

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

// Loads the rows of the checkpoint in directory `dir` (relative to the root).
using CheckpointLoader = std::function<Result<Checkpoint>(const std::string& dir)>;

// A loaded checkpoint, for the CLI's inspection commands.
struct LoadedCheckpoint {
  const Checkpoint* ckpt;
  SourceReader* reader;
};

class VirtualFs {
 public:
  static constexpr uint64_t kRootIno = 1;

  // The checkpoints in `dirs` under `root`, loaded by `loader` on first use.
  static Result<std::unique_ptr<VirtualFs>> Open(std::string root, const std::vector<std::string>& dirs,
                                                 CheckpointLoader loader, FsOptions options);
  // Every checkpoint of `catalog`, already in memory.
  static Result<std::unique_ptr<VirtualFs>> Create(Catalog catalog, FsOptions options);
  ~VirtualFs();

  FsResult<Attr> Lookup(uint64_t parent, const std::string& name);
  FsResult<Attr> GetAttr(uint64_t ino);
  // Entries other than "." and "..", sorted by name.
  FsResult<std::vector<DirEntry>> ReadDir(uint64_t ino);
  // Returns a handle for Read/Release. Any write access is EROFS.
  FsResult<uint64_t> Open(uint64_t ino, int flags);
  // Reads up to `size` bytes; fewer only at end of file.
  FsResult<size_t> Read(uint64_t handle, char* buf, size_t size, uint64_t offset);
  void Release(uint64_t handle);
  // The target of a symlink in the source tree (never followed by us).
  FsResult<std::string> ReadLink(uint64_t ino);

  // Re-checks the sources of every checkpoint; a checkpoint with a source
  // changed since indexing reads as EIO from now on and its virtual files
  // are invalidated in the kernel's cache. Returns how many were found
  // changed by this call. Called by the source watcher.
  size_t RecheckSources();
  // Absolute paths of the directories holding sources (for the watcher).
  std::vector<std::string> SourceDirs() const;
  // Replaces FsOptions::info; call only while no request is served.
  void set_info(std::function<void(const std::string&)> f) { options_.info = std::move(f); }
  // Replaces FsOptions::invalidate; call only while no request is served.
  void set_invalidate(std::function<void(uint64_t)> f) { options_.invalidate = std::move(f); }
  // Replaces FsOptions::read for checkpoints loaded from now on; call
  // before serving.
  void set_read_options(ReadOptions read) { options_.read = read; }
  void set_verify_checksums(bool on) { options_.verify_checksums = on; }
  // Likewise for the kernel's cached name `name` in directory `parent`.
  void set_invalidate_entry(std::function<void(uint64_t, const std::string&)> f) {
    invalidate_entry_ = std::move(f);
  }

  // "model/consolidated/model.safetensors" -> its attributes ("" is the root).
  FsResult<Attr> Resolve(const std::string& path);

  const std::string& root() const { return tree_.root(); }
  const SourceTree& tree() const { return tree_; }

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
  enum class NodeKind { kSourceDir, kSourceFile, kSourceLink, kVirtualDir, kVirtualFile };
  struct Node;
  struct Handle;
  // One checkpoint as served: its rows, reader and views, loaded on first use.
  // Never destroyed while the VirtualFs lives (open handles point into it).
  struct Served {
    std::string dir;
    std::mutex load_mu;              // serializes Load(); never held with mu_
    bool loaded = false;             // guarded by load_mu
    std::string load_error;          // guarded by load_mu
    std::optional<Checkpoint> staged;  // rows handed over by AddCheckpoint; guarded by load_mu
    Checkpoint ckpt;                 // immutable once loaded
    std::unique_ptr<SourceReader> reader;
    ViewAccess access;
    std::atomic<bool> stale{false};    // invalidated once, when first seen
    std::atomic<bool> removed{false};  // replaced or deleted: no new lookups
    std::atomic<bool> resident{false}; // loaded with its views attached
    std::atomic<bool> evicted{false};  // unloaded: rows freed (set under mu_)
    std::atomic<int> handles{0};       // open virtual files and pins; raised under mu_ (shared)
    std::atomic<uint64_t> last_used{0};
  };
  // Keeps a checkpoint from being unloaded while a lookup uses its views.
  class Pin {
   public:
    explicit Pin(Served* s) : served_(s) {}
    Pin(Pin&& o) noexcept : served_(std::exchange(o.served_, nullptr)) {}
    Pin(const Pin&) = delete;
    Pin& operator=(const Pin&) = delete;
    Pin& operator=(Pin&&) = delete;
    ~Pin();

   private:
    Served* served_;
  };
  VirtualFs(FsOptions options, SourceTree tree, CheckpointLoader loader);
  // A replaced checkpoint's directory and the names of its views in it,
  // whose kernel entries are dropped once the lock is released.
  struct Detached {
    uint64_t dir_ino = 0;
    std::vector<std::string> names;
  };
  int HostLocked(std::unique_ptr<Served> s, Detached* old);
  void DropKernelEntries(const Detached& old) const;
  // Loads checkpoint `i` and attaches its views to its directory, once.
  Status EnsureLoaded(int i);
  Status BuildViews(int i, Node* dir);
  // For a source directory hosting a checkpoint: its views, loaded now if
  // not yet, and kept loaded while the returned pin lives.
  Pin EnsureViewsOf(const Node& dir);
  // Gives a loaded checkpoint's reader its ChecksumGate (--verify-checksums).
  void UseChecksums(Served& s);
  void Touch(int i) const;
  // Unloads least recently used checkpoints (never `keep`, never one with an
  // open file) until at most max_loaded are loaded.
  void EvictBeyondLimit(int keep);
  // Replaces hosted checkpoint `i` by an unloaded entry and frees its rows,
  // or does nothing when a file of it is open. False when nothing was done.
  bool Evict(int i);
  Served* ServedAt(int i) const;
  // The index of the live checkpoint in `rel`, or -1. REQUIRES: mu_ held.
  int HostedBy(const std::string& rel) const;
  // Drops the kernel's cache of every virtual file of checkpoint `i`, once.
  void InvalidateCheckpoint(size_t i);
  FsResult<uint64_t> OpenMesh(Node* mesh_dir, const std::string& spec_name);
  // consolidated.<dtype>/ of the checkpoint shown in `dir`, made on its
  // first lookup (ENOENT with a log line for an unknown dtype).
  FsResult<uint64_t> OpenDTypeView(Node* dir, const std::string& name);
  // The DTypeView for suffix `suffix` of checkpoint `ckpt`.
  Result<DTypeView> DTypeViewFor(const Checkpoint& ckpt, const std::string& suffix) const;
  bool NeedsNpy(const Node& dir) const;
  bool ViewsAttached(const Node& dir) const;
  FsError FillNpy(Node* npy_dir);
  FsError EnsureNpyLayout(Node* npy_file, const Served& served);
  static void ReturnFreedMemory();
  Result<ShardingRules> RulesFor(const Checkpoint& ckpt) const;
  Node* Find(uint64_t ino) const;
  Node* SourceNode(const std::string& rel, NodeKind kind);
  Node* AddVirtual(Node* parent, const std::string& name, bool is_dir, int ckpt);
  void AddViewFile(Node* view, ViewFile f, int ckpt);
  FsResult<Attr> AttrOf(const Node& n) const;
  std::string PathOf(const Node& n) const;
  void Log(const std::string& line) const;
  void Info(const std::string& line) const;

  FsOptions options_;
  SourceTree tree_;
  CheckpointLoader loader_;
  int64_t mounted_at_ns_ = 0;  // mtime of virtual entries
  std::function<void(uint64_t, const std::string&)> invalidate_entry_;
  // Lock order: a Served's load_mu, then mu_. mu_ is never held during I/O.
  mutable std::shared_mutex mu_;  // guards nodes_, source_inos_, served_, hosted_
  mutable std::atomic<uint64_t> use_clock_{0};
  std::unique_ptr<ComputeCache> compute_;  // blocks of computed tensors, tagged by checkpoint
  std::vector<std::unique_ptr<Node>> nodes_;         // ino - 1 -> node
  std::unordered_map<std::string, uint64_t> source_inos_;
  std::vector<std::unique_ptr<Served>> served_;      // append-only
  std::unordered_map<std::string, int> hosted_;      // dir -> live entry of served_
};

}  // namespace ckptfs
