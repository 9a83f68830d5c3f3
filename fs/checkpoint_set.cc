#include "fs/checkpoint_set.h"

#include <malloc.h>

#include <algorithm>
#include <shared_mutex>

#include "source/checksums.h"

namespace ckptfs {
namespace {

// glibc keeps freed memory (a checkpoint's rows, the temporaries of building
// its views) mapped for reuse; a daemon's RSS would then stay at its peak.
void ReturnFreedMemory() { malloc_trim(0); }

// A store being rebuilt or a shard being restored takes seconds; a store
// that stays broken is asked at most every 16 s.
std::chrono::seconds LoadBackoff(int failures) { return std::chrono::seconds(1 << std::min(failures - 1, 4)); }

}  // namespace

CheckpointSet::CheckpointSet(const FsOptions& options, const SourceTree& tree, CheckpointLoader loader,
                             NodeTable& nodes, ComputeCache& compute, BuildViews build_views)
    : options_(options),
      tree_(tree),
      loader_(std::move(loader)),
      nodes_(nodes),
      compute_(compute),
      build_views_(std::move(build_views)) {}

Served* CheckpointSet::ServedAt(int i) const {
  std::shared_lock lock(nodes_.mu());
  return served_[i].get();
}

int CheckpointSet::HostedBy(const std::string& rel) const {
  auto it = hosted_.find(rel);
  return it == hosted_.end() ? -1 : it->second;
}

// Makes a new entry the checkpoint served in its directory; the views of
// the one it replaces are detached (they stay reachable from open handles
// only).
int CheckpointSet::Host(const std::string& dir, std::optional<Checkpoint> rows, int* prev, Detached* old) {
  auto s = std::make_unique<Served>();
  s->dir = dir;
  s->staged = std::move(rows);
  std::unique_lock lock(nodes_.mu());
  *prev = HostedBy(dir);
  if (*prev >= 0) served_[*prev]->removed = true;
  const int i = int(served_.size());
  s->index = i;
  hosted_[dir] = i;
  served_.push_back(std::move(s));
  nodes_.TakeViewsLocked(dir, old);
  if (*prev >= 0) nodes_.DetachLocked(*prev);
  return i;
}

int CheckpointSet::Unhost(const std::string& dir, Detached* old) {
  std::unique_lock lock(nodes_.mu());
  const int i = HostedBy(dir);
  if (i < 0) return -1;
  served_[i]->removed = true;
  hosted_.erase(dir);
  nodes_.TakeViewsLocked(dir, old);
  nodes_.DetachLocked(i);
  return i;
}

int CheckpointSet::IndexOf(const std::string& dir) const {
  std::shared_lock lock(nodes_.mu());
  return HostedBy(dir);
}

std::vector<int> CheckpointSet::Live() const {
  std::shared_lock lock(nodes_.mu());
  std::vector<int> live;
  for (const auto& [dir, i] : hosted_) live.push_back(i);
  return live;
}

std::vector<std::string> CheckpointSet::Dirs(bool stale_only) const {
  std::shared_lock lock(nodes_.mu());
  std::vector<std::string> out;
  for (const auto& [dir, i] : hosted_)
    if (!stale_only || served_[i]->stale.load()) out.push_back(dir);
  std::sort(out.begin(), out.end());
  return out;
}

Status CheckpointSet::EnsureLoaded(int i) {
  Served* s = ServedAt(i);
  if (!s->resident) EvictBeyondLimit(i);  // room first: at most max_loaded at any time
  {
    std::lock_guard<std::mutex> load(s->load_mu);
    if (!s->resident) RETURN_IF_ERROR(LoadLocked(i, s));
  }
  Touch(i);
  return Status::OK();
}

// REQUIRES: s->load_mu held.
Status CheckpointSet::LoadLocked(int i, Served* s) {
  if (s->removed) return Status::NotFound(JoinRel(s->dir, "") + ": replaced or removed since it was looked up");
  const auto now = std::chrono::steady_clock::now();
  if (s->failures > 0 && now < s->retry_at) return Status::IOError(s->load_error);
  auto ckpt = s->staged ? Result<Checkpoint>(std::move(*s->staged)) : loader_(s->dir);
  s->staged.reset();
  if (!ckpt.ok()) {
    ++s->failures;
    const auto wait = LoadBackoff(s->failures);
    s->retry_at = now + wait;
    s->load_error = JoinRel(s->dir, "") + ": cannot load the checkpoint (attempt " + std::to_string(s->failures) +
                    ", next in " + std::to_string(wait.count()) + " s on use; its views answer EIO meanwhile): " +
                    ckpt.status().message();
    options_.Log(s->load_error);
    return Status::IOError(s->load_error);
  }
  s->ckpt = std::move(*ckpt);
  s->reader = std::make_unique<SourceReader>(tree_.source(), &s->ckpt.files, GroupPolicy{}, 1ull << 30, options_.read);
  s->reader->ShareCounters(s->counters);
  if (options_.verify_checksums) UseChecksums(*s);
  if (!s->has_access) s->access = AccessOf(tree_, s->ckpt);
  s->has_access = true;
  RETURN_IF_ERROR(build_views_(i, nodes_.SourceNode(s->dir, NodeKind::kSourceDir)));
  {
    std::unique_lock lock(nodes_.mu());  // Acquire() reads it under the lock
    s->resident = true;
  }
  ++resident_count_;
  if (s->failures > 0)
    options_.Info(JoinRel(s->dir, "") + ": loaded after " + std::to_string(s->failures) + " failed attempts");
  s->failures = 0;
  s->load_error.clear();
  ReturnFreedMemory();
  options_.Info(JoinRel(s->dir, "") + ": loaded (" + std::to_string(s->ckpt.tensors.size()) + " tensors)");
  return Status::OK();
}

void CheckpointSet::UseChecksums(Served& s) {
  auto gate = std::make_unique<ChecksumGate>(s.ckpt);
  // Said, not hidden: --verify-checksums checks nothing of a checkpoint
  // without a writer's checksums.
  if (gate->chunks() == 0)
    options_.Log(JoinRel(s.dir, "") +
                 ": --verify-checksums: no writer checksums in its index (not saved by ckptfs's writer, "
                 "or its commit record was refused: see `ckptfs index` and `ckptfs verify`); its reads are not checked");
  s.reader->SetChecksumGate(std::move(gate));
}

void CheckpointSet::Touch(int i) const {
  if (i >= 0) ServedAt(i)->last_used = ++use_clock_;
}

void CheckpointSet::EvictBeyondLimit(int keep) {
  if (options_.max_loaded == 0) return;
  std::vector<std::pair<uint64_t, int>> loaded;  // (last used, index)
  {
    std::shared_lock lock(nodes_.mu());
    for (const auto& [dir, i] : hosted_)
      if (i != keep && served_[i]->resident) loaded.push_back({served_[i]->last_used.load(), i});
  }
  const size_t wanted = loaded.size() + (keep >= 0 ? 1 : 0);
  if (wanted <= options_.max_loaded) return;
  std::sort(loaded.begin(), loaded.end());
  size_t excess = wanted - options_.max_loaded;
  for (const auto& [used, i] : loaded) {
    if (excess == 0) break;
    if (!Unload(i, /*wait=*/false)) continue;
    --excess;
    options_.Info(JoinRel(ServedAt(i)->dir, "") +
                  ": unloaded (least recently used beyond --max-loaded); loaded again on next use");
  }
}

// The nodes stay, with their sizes and inode numbers: the kernel may hold
// them for an hour, and opening one loads the checkpoint again.
bool CheckpointSet::Unload(int i, bool wait) {
  Served* s = ServedAt(i);
  std::unique_lock<std::mutex> load(s->load_mu, std::defer_lock);
  if (wait) load.lock();
  else if (!load.try_lock()) return false;  // being loaded, or a view of it built: in use
  std::vector<std::shared_ptr<const Layout>> layouts;  // freed outside the lock
  {
    std::unique_lock lock(nodes_.mu());
    if (!s->resident || s->handles > 0) return false;
    s->resident = false;
    --resident_count_;
    nodes_.DropLayoutsLocked(i, &layouts);
  }
  s->merged.clear();
  layouts.clear();
  compute_.Drop(i);
  s->reader.reset();
  s->ckpt = Checkpoint();
  ReturnFreedMemory();
  return true;
}

FsError CheckpointSet::LoadFailure(const Status& st) {
  if (st.code() == Status::Code::kNotFound) return FsError(ESTALE, st.message() + "; look it up again");
  return FsError(EIO, st.message());
}

FsResult<Served*> CheckpointSet::Acquire(int i) {
  Served* s;
  {
    std::shared_lock lock(nodes_.mu());  // Unload() checks handles under it exclusively
    s = served_[i].get();
    ++s->handles;
  }
  if (Status st = EnsureLoaded(i); !st.ok()) {
    Unpin(s);
    return LoadFailure(st);
  }
  return s;
}

// Checkpoints pinned while another loaded may leave more than max_loaded
// loaded; the last unpin brings the count back down.
void CheckpointSet::Unpin(Served* s) {
  if (--s->handles > 0) return;
  if (s->removed) Unload(s->index, /*wait=*/true);
  if (options_.max_loaded > 0 && resident_count_.load() > options_.max_loaded) EvictBeyondLimit(-1);
}

CheckpointSet::Pin::~Pin() {
  if (served_) set_->Unpin(served_);
}

// Pinned (Served::handles), the checkpoint cannot be unloaded by another
// thread between being loaded here and the caller reading its views. A
// virtual directory's checkpoint is pinned, not loaded: its entries are
// kept across unloads, and what needs rows (FillNpy, OpenMesh) loads it.
CheckpointSet::Pin CheckpointSet::PinViewsOf(const FsNode& dir, Status* error) {
  int i;
  Served* s;
  bool attached;
  {
    std::shared_lock lock(nodes_.mu());
    i = dir.kind == NodeKind::kSourceDir ? HostedBy(dir.rel) : dir.ckpt;
    if (i < 0) return Pin(this, nullptr);
    s = served_[i].get();
    ++s->handles;
    attached = dir.kind != NodeKind::kSourceDir || dir.ckpt == i;
  }
  Pin pin(this, s);
  // A checkpoint that cannot be loaded shows no views (the load logs why,
  // and is tried again later); its source files stay readable.
  if (!attached) {
    Status st = EnsureLoaded(i);
    if (error) *error = st;
  }
  return pin;
}

size_t CheckpointSet::size() const {
  std::shared_lock lock(nodes_.mu());
  return served_.size();
}

}  // namespace ckptfs
