// LiveRoot: keeps a mounted training root in step with its directory tree.
//
// On every watcher call it walks the root (never following symlinks, not
// descending into checkpoints it serves) and:
//  - a directory that now reads as a complete checkpoint (its commit point
//    exists: DCP's .metadata renamed into place, every rank's shard and the
//    index of torch's HF writer, ckptfs's writer's commit record; and no
//    problem found) is served, then committed to the store;
//  - a served checkpoint whose commit point is gone is removed: its
//    directory is gone, or no longer reads as the checkpoint it was served
//    as (`mark` changed: .metadata or every shard deleted, the writer's
//    commit record deleted), also when emptied subdirectories stay behind.
//    Its views go (the kernel's entries for them are invalidated) and what
//    remains of the directory shows as plain directories; a directory that
//    still reads as a checkpoint (a commit record deleted, the files kept)
//    is offered again on the same pass and served from what it holds now;
//  - a served checkpoint with a changed source reads as EIO; it is read
//    again and replaced only once `resaved` says its commit point is newer
//    than its data (a complete re-save into the same directory).
// A checkpoint still being written, or broken, is never served: it is
// looked at again on the next call. New directories get an inotify watch.
#pragma once

#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include "core/meta.h"
#include "core/status.h"
#include "fs/virtual_fs.h"
#include "fs/watcher.h"

namespace ckptfs {

class LiveRoot {
 public:
  struct Hooks {
    // Reads directory `rel` alone: a checkpoint, or nullopt when no format recognises it.
    std::function<Result<std::optional<Checkpoint>>(const std::string& rel)> scan;
    // True when a served checkpoint whose sources changed may be read
    // again: its commit point is newer than its data (a complete re-save).
    std::function<bool(const std::string& rel)> resaved;
    // What makes directory `rel` a checkpoint now, from its file names
    // (indexer/scan.h, CheckpointMark): "" when nothing does, nullopt when
    // it cannot be listed now (kept served until it can).
    std::function<std::optional<std::string>(const std::string& rel)> mark;
    // Persists (or forgets) a checkpoint's rows; may be empty (nothing persisted).
    std::function<Status(const Checkpoint&)> commit;
    std::function<Status(const std::string& dir)> remove;
    std::function<void(const std::string&)> log;
  };
  // `fs` must outlive this.
  LiveRoot(VirtualFs* fs, Hooks hooks);
  // New directories found by Refresh() get a watch here (may stay unset).
  void set_watcher(SourceWatcher* watcher) { watcher_ = watcher; }

  // One pass, as described above. Thread-compatible: call from one thread.
  void Refresh();

 private:
  // Directories under the root, checkpoints served now not descended into.
  std::vector<std::string> Walk(const std::set<std::string>& served);
  void Offer(const std::string& rel, bool replacing);
  // Why served checkpoint `dir` is gone (its commit point, above), or ""
  // while it is not.
  std::string Gone(const std::string& dir);
  void Remove(const std::string& dir, const std::string& why);
  void Log(const std::string& line) const;

  VirtualFs* fs_;
  SourceWatcher* watcher_ = nullptr;
  Hooks hooks_;
  // Directories found not (yet) servable, by a signature of their files:
  // they are read again only once something in them changed.
  std::map<std::string, std::string> waiting_;
  // Served checkpoints' marks, taken when first seen served.
  std::map<std::string, std::string> marks_;
};

}  // namespace ckptfs
