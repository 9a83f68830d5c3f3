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
// nodes of its views kept, without their layouts) and loaded again on next
// use: its inode numbers stay valid across the unload, so a file the kernel
// still knows opens (reloading its checkpoint) instead of failing ESTALE,
// and a reload adds no nodes. A load that fails is retried on later use,
// at most once per backoff (1 s doubling to 16 s); meanwhile its views
// answer EIO.
// `mesh/<spec>/` directories are made on first lookup of a valid spec, the
// files of `tensors/` on its first lookup or listing (most mounts never list
// it; for 100k tensors its nodes alone take ~40 MB), and a `tensors/` file's
// layout on its first open. Live: checkpoints can be added and removed while
// mounted.
//
// Inode numbers are allocated on first lookup and never reused (so the
// FUSE generation is always 0). The table grows with distinct paths looked
// up, not with unloads: a reload fills the nodes it had. The nodes of a
// replaced or removed checkpoint leave the tree at once and the table once
// the kernel forgets them (its rows are freed once no file of it is open).
// Source nodes stay for the life of the mount.
//
// Errors served on reads and opens are logged through a LogLimiter (a few
// lines per checkpoint and cause every 10 s, then a count).
//
// Thread-safe: the FUSE loop calls it from many threads. Lock order: mu_
// (the node table) is never held while calling into SourceReader or doing
// file I/O.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <mutex>
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
#include "fs/log_limiter.h"
#include "fs/merged_view.h"
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
  enum class NodeKind { kSourceDir, kSourceFile, kSourceLink, kVirtualDir, kVirtualFile };
  struct Node;
  struct Handle;
  // One checkpoint as served: its rows, reader and views, loaded on first use.
  // Never destroyed while the VirtualFs lives (open handles and the nodes of
  // its views point into it); unloading frees its rows, not the entry.
  struct Served {
    std::string dir;
    int index = -1;                  // in served_
    std::mutex load_mu;              // serializes loading and unloading; never taken with mu_ held
    std::string load_error;          // the last load's failure; guarded by load_mu
    int failures = 0;                // consecutive failed loads; guarded by load_mu
    std::chrono::steady_clock::time_point retry_at;  // no load tried before; guarded by load_mu
    std::optional<Checkpoint> staged;  // rows handed over by AddCheckpoint; guarded by load_mu
    Checkpoint ckpt;                 // its rows while resident
    std::unique_ptr<SourceReader> reader;
    ViewAccess access;               // set by the first load, kept: its nodes' attributes
    bool has_access = false;         // guarded by load_mu
    std::atomic<bool> stale{false};    // invalidated once, when first seen
    std::atomic<bool> removed{false};  // replaced or deleted: no new lookups, no reload
    std::atomic<bool> resident{false}; // rows loaded, views filled (set under load_mu and mu_)
    std::atomic<int> handles{0};       // open virtual files and pins; raised under mu_ (shared)
    std::atomic<uint64_t> last_used{0};
    std::vector<std::shared_ptr<MergedSources>> merged;  // its merged/ views' sources; guarded by load_mu
  };
  // Keeps a checkpoint from being unloaded while a lookup uses its views.
  class Pin {
   public:
    Pin(VirtualFs* fs, Served* s) : fs_(fs), served_(s) {}
    Pin(Pin&& o) noexcept : fs_(o.fs_), served_(std::exchange(o.served_, nullptr)) {}
    Pin(const Pin&) = delete;
    Pin& operator=(const Pin&) = delete;
    Pin& operator=(Pin&&) = delete;
    ~Pin();

   private:
    VirtualFs* fs_;
    Served* served_;
  };
  VirtualFs(FsOptions options, std::unique_ptr<SourceTree> tree, CheckpointLoader loader);
  // A replaced checkpoint's directory and the names of its views in it,
  // whose kernel entries are dropped once the lock is released.
  struct Detached {
    uint64_t dir_ino = 0;
    std::vector<std::string> names;
  };
  int HostLocked(std::unique_ptr<Served> s, Detached* old);
  void DropKernelEntries(const Detached& old) const;
  // Loads checkpoint `i` (rows, reader) and attaches or refills its views,
  // unless it is loaded. A failed load is tried again on a later call once
  // its backoff is over; until then the failure is returned at once.
  // NotFound for a replaced or removed checkpoint that is not loaded.
  Status EnsureLoaded(int i);
  Status LoadLocked(int i, Served* s);
  Status BuildViews(int i, Node* dir);
  // For a source directory hosting a checkpoint: its views, loaded now if
  // never attached, and kept loaded while the returned pin lives. `error`
  // gets the load's failure.
  Pin EnsureViewsOf(const Node& dir, Status* error = nullptr);
  // Pins checkpoint `i` and loads it if it is not: the caller's handle.
  // ESTALE for one replaced or removed meanwhile, EIO when it cannot load.
  FsResult<Served*> Acquire(int i);
  void Unpin(Served* s);
  // Gives a loaded checkpoint's reader its ChecksumGate (--verify-checksums).
  void UseChecksums(Served& s);
  void Touch(int i) const;
  // Unloads least recently used checkpoints (never `keep`, never one with an
  // open file) until at most max_loaded are loaded, counting `keep` (>= 0)
  // as about to be.
  void EvictBeyondLimit(int keep);
  // Frees the rows and layouts of checkpoint `i`, keeping its nodes, or does
  // nothing when a file of it is open or it is in use. False when nothing
  // was done.
  // `wait`: for a replaced or removed one, whose rows nothing else frees;
  // else a checkpoint being loaded or built is left alone.
  bool Unload(int i, bool wait);
  // NotFound (replaced or removed: the kernel looks the path up again) is
  // ESTALE; anything else EIO.
  static FsError LoadFailure(const Status& st);
  Served* ServedAt(int i) const;
  // The index of the live checkpoint in `rel`, or -1. REQUIRES: mu_ held.
  int HostedBy(const std::string& rel) const;
  // Drops the kernel's cache of every virtual file of checkpoint `i`, once.
  void InvalidateCheckpoint(size_t i);
  // The plan of a read of a virtual file through `h`, or the failure to
  // serve (logged).
  FsResult<ReadPlan> PlanRead(const Handle& h, size_t size, uint64_t offset);
  // Logs a failed read of `n` and returns the error to serve; a Stale
  // status marks the checkpoint stale first.
  FsError ReadFailed(const Node& n, size_t size, uint64_t offset, const FsError& e);
  FsError ReadFailed(const Node& n, size_t size, uint64_t offset, const Status& st);
  // The reader of an open virtual file: its checkpoint's, or a merged/
  // file's own (fs/merged_view.h).
  static SourceReader* ReaderOf(const Handle& h);
  FsResult<uint64_t> OpenMesh(Node* mesh_dir, const std::string& spec_name);
  // consolidated.<dtype>/ of the checkpoint shown in `dir`, made on its
  // first lookup (ENOENT with a log line for an unknown dtype).
  FsResult<uint64_t> OpenDTypeView(Node* dir, const std::string& name);
  // merged/ or merged.<dtype>/ of the LoRA adapter shown in `dir`, made on
  // its first lookup (fs/merged_view.h); ENOENT with a log line saying why
  // when it cannot be.
  FsResult<uint64_t> OpenMergedView(Node* dir, const std::string& name);
  // Why adapter `ckpt` gets no merged/ ("" when it does: a LoRA adapter
  // whose base is a checkpoint of this mount).
  std::string MergedRefusal(const Checkpoint& ckpt) const;
  // A copy of the rows of the checkpoint in `dir`, loaded for the copy.
  Result<Checkpoint> RowsOf(const std::string& dir);
  // From now on merged view `ms` of checkpoint `ckpt` reads as EIO; the
  // kernel's pages of its files are dropped.
  void MarkMergedStale(const std::shared_ptr<MergedSources>& ms, int ckpt, const std::string& why);
  // The DTypeView for suffix `suffix` of checkpoint `ckpt`.
  Result<DTypeView> DTypeViewFor(const Checkpoint& ckpt, const std::string& suffix) const;
  bool NeedsNpy(const Node& dir) const;
  bool ViewsAttached(const Node& dir) const;
  FsError FillNpy(Node* npy_dir);
  // The layout of a virtual file whose checkpoint is pinned and loaded: a
  // tensors/ file's and a mesh file's are made again after an unload.
  FsError EnsureLayout(Node* file, const Served& served);
  static void ReturnFreedMemory();
  Result<ShardingRules> RulesFor(const Checkpoint& ckpt) const;
  // Shared: a node of a removed checkpoint may leave the table meanwhile.
  std::shared_ptr<Node> Find(uint64_t ino) const;
  // nullptr when `ino` left the table. REQUIRES: mu_ held.
  Node* NodeLocked(uint64_t ino) const;
  // Takes the nodes of replaced or removed checkpoint `i` out of the tree;
  // those the kernel does not hold leave the table. REQUIRES: mu_ held
  // exclusively.
  void DetachLocked(int i);
  Node* SourceNode(const std::string& rel, NodeKind kind);
  Node* AddVirtual(Node* parent, const std::string& name, bool is_dir, int ckpt);
  // `sources`: a merged/ file's own sources (fs/merged_view.h), else null.
  void AddViewFile(Node* view, ViewFile f, int ckpt, std::shared_ptr<MergedSources> sources = nullptr);
  FsResult<Attr> AttrOf(const Node& n) const;
  std::string PathOf(const Node& n) const;
  void Log(const std::string& line) const;
  // Through limiter_, keyed by the checkpoint and the cause.
  void LogServed(int ckpt, const FsError& e, const std::string& line);
  void Info(const std::string& line) const;

  FsOptions options_;
  std::unique_ptr<const SourceTree> tree_;
  CheckpointLoader loader_;
  int64_t mounted_at_ns_ = 0;  // mtime of virtual entries
  std::function<void(uint64_t, const std::string&)> invalidate_entry_;
  LogLimiter limiter_;
  // Lock order: a Served's load_mu, then mu_. mu_ is never held during I/O.
  mutable std::shared_mutex mu_;  // guards nodes_, source_inos_, served_, hosted_
  mutable std::atomic<uint64_t> use_clock_{0};
  std::atomic<size_t> resident_count_{0};  // checkpoints loaded (resident)
  std::unique_ptr<ComputeCache> compute_;  // blocks of computed tensors, tagged by checkpoint
  std::unordered_map<uint64_t, std::shared_ptr<Node>> nodes_;  // ino -> node
  uint64_t next_ino_ = kRootIno + 1;                 // never reused
  std::unordered_map<std::string, uint64_t> source_inos_;
  std::vector<std::unique_ptr<Served>> served_;      // append-only
  std::unordered_map<std::string, int> hosted_;      // dir -> live entry of served_
};

}  // namespace ckptfs
