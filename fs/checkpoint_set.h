// CheckpointSet: the checkpoints a VirtualFs (fs/virtual_fs.h) serves, each
// loaded on first use and unloaded when more than FsOptions::max_loaded are.
//
// A checkpoint is only a directory name until a path inside it is first
// looked up or listed; then its rows are loaded (CheckpointLoader: the
// store, or a catalog in memory) and its views built (the BuildViews hook),
// in time linear in its tensors. Beyond max_loaded, the least recently used
// loaded checkpoint with no open file is unloaded (its rows and plans
// freed, the nodes of its views kept, without their layouts) and loaded
// again on next use, so the inodes the kernel holds stay valid. A load that
// fails is retried on later use, at most once per backoff (1 s doubling to
// 16 s); meanwhile its views answer EIO.
//
// Entries are numbered in the order they were hosted and never destroyed
// while the set lives (open handles and the nodes of their views point into
// them). The registry is guarded by the node table's lock (fs/node_table.h).
// Lock order: a Served's load_mu, then the node table's lock.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/meta.h"
#include "fs/compute_cache.h"
#include "fs/fs_error.h"
#include "fs/fs_options.h"
#include "fs/merged_view.h"
#include "fs/node_table.h"
#include "fs/source_tree.h"
#include "source/source_reader.h"

namespace ckptfs {

// One checkpoint as served: its rows, reader and views, loaded on first use.
// Unloading frees its rows, not the entry.
struct Served {
  std::string dir;
  int index = -1;                  // in the CheckpointSet
  std::mutex load_mu;              // serializes loading and unloading; never taken with the table's lock held
  std::string load_error;          // the last load's failure; guarded by load_mu
  int failures = 0;                // consecutive failed loads; guarded by load_mu
  std::chrono::steady_clock::time_point retry_at;  // no load tried before; guarded by load_mu
  std::optional<Checkpoint> staged;  // rows handed over by Host; guarded by load_mu
  Checkpoint ckpt;                 // its rows while resident
  std::unique_ptr<SourceReader> reader;
  ViewAccess access;               // set by the first load, kept: its nodes' attributes
  bool has_access = false;         // guarded by load_mu
  std::atomic<bool> stale{false};    // invalidated once, when first seen
  std::atomic<bool> removed{false};  // replaced or deleted: no new lookups, no reload
  std::atomic<bool> resident{false}; // rows loaded, views filled (set under load_mu and the table's lock)
  std::atomic<int> handles{0};       // open virtual files and pins; raised under the table's lock (shared)
  std::atomic<uint64_t> last_used{0};
  std::vector<std::shared_ptr<MergedSources>> merged;  // its merged/ views' sources; guarded by load_mu
  // What its readers fetched and served, kept across unloads (the mount's log).
  std::shared_ptr<FetchCounters> counters = std::make_shared<FetchCounters>();
};

class CheckpointSet {
 public:
  // Attaches (or fills again) the views of checkpoint `i`, whose rows were
  // just loaded, to the node of its directory.
  using BuildViews = std::function<Status(int i, FsNode* dir)>;
  CheckpointSet(const FsOptions& options, const SourceTree& tree, CheckpointLoader loader, NodeTable& nodes,
                ComputeCache& compute, BuildViews build_views);

  // Keeps a checkpoint from being unloaded while a lookup uses its views.
  class Pin {
   public:
    Pin(CheckpointSet* set, Served* s) : set_(set), served_(s) {}
    Pin(Pin&& o) noexcept : set_(o.set_), served_(std::exchange(o.served_, nullptr)) {}
    Pin(const Pin&) = delete;
    Pin& operator=(const Pin&) = delete;
    Pin& operator=(Pin&&) = delete;
    ~Pin();

   private:
    CheckpointSet* set_;
    Served* served_;
  };

  // Serves a new entry in `dir` (`rows`, when given, instead of asking the
  // loader); the one it replaces (`*prev`, else -1) is detached, its
  // directory's views put in `old`. Returns the new entry's index.
  int Host(const std::string& dir, std::optional<Checkpoint> rows, int* prev, Detached* old);
  // Stops serving `dir`: its entry's index (-1 when none), views in `old`.
  int Unhost(const std::string& dir, Detached* old);

  // Loads checkpoint `i` (rows, reader) and attaches or refills its views,
  // unless it is loaded. A failed load is tried again on a later call once
  // its backoff is over; until then the failure is returned at once.
  // NotFound for a replaced or removed checkpoint that is not loaded.
  Status EnsureLoaded(int i);
  // Pins checkpoint `i` and loads it if it is not: the caller's handle.
  // ESTALE for one replaced or removed meanwhile, EIO when it cannot load.
  FsResult<Served*> Acquire(int i);
  void Unpin(Served* s);
  // For a source directory hosting a checkpoint: its views, loaded now if
  // never attached, and kept loaded while the returned pin lives. `error`
  // gets the load's failure.
  Pin PinViewsOf(const FsNode& dir, Status* error = nullptr);
  // Frees the rows and layouts of checkpoint `i`, keeping its nodes, unless
  // a file of it is open or it is in use; false when nothing was done.
  // `wait`: for a replaced or removed one, whose rows nothing else frees;
  // else a checkpoint being loaded or built is left alone.
  bool Unload(int i, bool wait);
  // NotFound (replaced or removed: the kernel looks the path up again) is
  // ESTALE; anything else EIO.
  static FsError LoadFailure(const Status& st);
  void Touch(int i) const;

  Served* ServedAt(int i) const;
  // The index of the live checkpoint in `rel`, or -1. HostedBy REQUIRES:
  // the node table's lock held; IndexOf takes it.
  int HostedBy(const std::string& rel) const;
  int IndexOf(const std::string& dir) const;
  // Directories served now, sorted (`stale_only`: with a changed source).
  std::vector<std::string> Dirs(bool stale_only) const;
  std::vector<int> Live() const;  // indexes of the checkpoints served now
  size_t size() const;            // entries ever hosted

 private:
  Status LoadLocked(int i, Served* s);
  // Gives a loaded checkpoint's reader its ChecksumGate (--verify-checksums).
  void UseChecksums(Served& s);
  // Unloads least recently used checkpoints (never `keep`, never one with an
  // open file) until at most max_loaded are loaded, counting `keep` (>= 0)
  // as about to be.
  void EvictBeyondLimit(int keep);

  const FsOptions& options_;
  const SourceTree& tree_;
  CheckpointLoader loader_;
  NodeTable& nodes_;
  ComputeCache& compute_;
  BuildViews build_views_;
  mutable std::atomic<uint64_t> use_clock_{0};
  std::atomic<size_t> resident_count_{0};        // checkpoints loaded (resident)
  std::vector<std::unique_ptr<Served>> served_;  // append-only
  std::unordered_map<std::string, int> hosted_;  // dir -> live entry of served_
};

}  // namespace ckptfs
