#include "fs/live_root.h"

#include <sys/stat.h>

#include <deque>

namespace ckptfs {
namespace {

// What waits for the next pass, not for a change: no directory has this
// signature.
constexpr char kReadAgain[] = "\n";

// The names, sizes and mtimes of a directory's entries: what changes when a
// file is added, renamed into place, grown or rewritten.
std::string Signature(const SourceTree& tree, const std::string& rel) {
  auto names = tree.List(rel);
  if (!names.ok()) return "";
  std::string sig;
  for (const std::string& name : *names) {
    auto st = tree.Lstat(JoinRel(rel, name));
    if (!st.ok()) continue;
    sig += name + ":" + std::to_string(st->st_size) + ":" + std::to_string(st->st_mtim.tv_sec) + "." +
           std::to_string(st->st_mtim.tv_nsec) + ";";
  }
  return sig;
}

// Whether `dir` is a directory now: kNo once deleted (or replaced by a
// file or a link), kUnknown while it cannot be looked at (an outage).
enum class DirNow { kYes, kNo, kUnknown };
DirNow IsDir(const SourceTree& tree, const std::string& dir) {
  auto st = tree.Lstat(dir);
  if (!st.ok()) return st.status().err() == ENOENT || st.status().err() == ENOTDIR ? DirNow::kNo : DirNow::kUnknown;
  return S_ISDIR(st->st_mode) ? DirNow::kYes : DirNow::kNo;
}

}  // namespace

LiveRoot::LiveRoot(VirtualFs* fs, Hooks hooks) : fs_(fs), hooks_(std::move(hooks)) {}

void LiveRoot::Log(const std::string& line) const {
  if (hooks_.log) hooks_.log(line);
}

std::vector<std::string> LiveRoot::Walk(const std::set<std::string>& served) {
  std::vector<std::string> out;
  std::deque<std::string> pending{""};
  std::set<std::string> seen;  // bind mounts can loop
  while (!pending.empty()) {
    std::string rel = pending.front();
    pending.pop_front();
    if (!seen.insert(fs_->tree().source()->DirKey(rel)).second) continue;
    if (watcher_ && fs_->tree().watchable()) (void)watcher_->Watch(rel.empty() ? fs_->root() : fs_->root() + "/" + rel);
    if (served.count(rel)) continue;  // its files are the reader's business
    out.push_back(rel);
    auto names = fs_->tree().List(rel);
    if (!names.ok()) continue;
    for (const std::string& name : *names) {
      auto st = fs_->tree().Lstat(JoinRel(rel, name));
      if (st.ok() && S_ISDIR(st->st_mode)) pending.push_back(JoinRel(rel, name));
    }
  }
  return out;
}

void LiveRoot::Offer(const std::string& rel, bool replacing) {
  std::string sig = Signature(fs_->tree(), rel);
  if (auto it = waiting_.find(rel); it != waiting_.end() && it->second == sig) return;
  auto found = hooks_.scan(rel);
  std::string why;
  if (!found.ok()) why = found.status().message();
  else if (!*found) why = "";  // not a checkpoint at all
  else if (!(*found)->incomplete.empty()) why = (*found)->incomplete;
  else if (!(*found)->problems.empty()) why = (*found)->problems.front();
  if (!found.ok()) {  // its sources could not be read: tried again on the next pass
    if (waiting_.count(rel) == 0) Log(JoinRel(rel, "") + ": not served yet (looked at again on each rescan): " + why);
    waiting_[rel] = kReadAgain;
    return;
  }
  if (!*found || !why.empty()) {
    if (!why.empty() && waiting_.count(rel) == 0)
      Log(JoinRel(rel, "") + ": not served yet (looked at again when its files change): " + why);
    waiting_[rel] = sig;
    return;
  }
  waiting_.erase(rel);
  Checkpoint& ckpt = **found;
  Log(JoinRel(rel, "") + (replacing ? ": changed; indexed again (" : ": indexed (") + std::to_string(ckpt.tensors.size()) +
      " tensors) and served");
  // Served first (the rows are handed over), persisted after: a store held
  // by another process delays no view; the next index or mount adds it.
  std::optional<Checkpoint> copy;
  if (hooks_.commit) copy = ckpt;
  fs_->AddCheckpoint(rel, std::move(ckpt));
  marks_.erase(rel);  // taken again from what was served now
  if (!copy) return;
  if (Status st = hooks_.commit(*copy); !st.ok())
    Log(JoinRel(rel, "") + ": served, but not recorded in the index (" + st.message() +
        "); the next `ckptfs index` or mount records it");
}

std::string LiveRoot::Gone(const std::string& dir) {
  switch (IsDir(fs_->tree(), dir)) {
    case DirNow::kNo: return "its directory is gone";
    case DirNow::kUnknown: return "";  // kept until it can be looked at
    case DirNow::kYes: break;
  }
  // An emptied directory, or one whose .metadata or shards were deleted
  // while subdirectories stayed (a cleanup that deletes files; an object
  // store that keeps listing emptied prefixes), has no commit point left.
  std::optional<std::string> mark = hooks_.mark ? hooks_.mark(dir) : std::optional<std::string>();
  if (!mark) return "";  // cannot tell now: kept until it can be listed
  if (mark->empty()) return "no commit point left";
  auto [it, first] = marks_.emplace(dir, *mark);
  if (first || it->second == *mark) return "";
  return "its commit point changed: read as " + it->second + " when served, as " + *mark + " now";
}

void LiveRoot::Remove(const std::string& dir, const std::string& why) {
  marks_.erase(dir);
  fs_->RemoveCheckpoint(dir);
  Log(JoinRel(dir, "") + ": gone; no longer served (" + why + ")");
  if (hooks_.remove) (void)hooks_.remove(dir);
}

void LiveRoot::Refresh() {
  // Removals first: what remains of a removed checkpoint's directory is
  // walked (and offered again) on this same pass.
  for (const std::string& dir : fs_->CheckpointDirs())
    if (std::string why = Gone(dir); !why.empty()) Remove(dir, why);
  std::vector<std::string> dirs = fs_->CheckpointDirs();
  std::set<std::string> served(dirs.begin(), dirs.end());
  for (const std::string& rel : Walk(served)) Offer(rel, /*replacing=*/false);
  for (const std::string& dir : fs_->CheckpointDirs(/*stale_only=*/true))
    if (hooks_.resaved && hooks_.resaved(dir)) Offer(dir, /*replacing=*/true);
}

}  // namespace ckptfs
