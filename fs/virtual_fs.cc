#include "fs/virtual_fs.h"

#include <dirent.h>
#include <fcntl.h>
#include <malloc.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/cast.h"
#include "core/planner.h"
#include "source/checksums.h"
#include "source/posix_source.h"

namespace ckptfs {

FsError FsError::From(const Status& s) {
  switch (s.code()) {
    case Status::Code::kOk: return FsError();
    case Status::Code::kNotFound: return FsError(ENOENT, s.message());
    case Status::Code::kInvalidArgument: return FsError(EINVAL, s.message());
    case Status::Code::kPermissionDenied: return FsError(EACCES, s.message());
    default: return FsError(EIO, s.ToString());
  }
}

bool Attr::is_dir() const { return S_ISDIR(mode); }

struct VirtualFs::Node {
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

struct VirtualFs::Handle {
  std::shared_ptr<const Node> node;
  std::unique_ptr<TreeFile> file;  // source files
  Served* served = nullptr;  // virtual files: holds it loaded (Served::handles)
  mutable ReadStream stream;  // virtual files: follows the reader for read-ahead
};

namespace {

std::string Join(const std::string& dir, const std::string& name) {
  return dir.empty() ? name : dir + "/" + name;
}

int64_t MtimeNs(const struct stat& st) {
  return int64_t(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec;
}

}  // namespace

VirtualFs::VirtualFs(FsOptions options, std::unique_ptr<SourceTree> tree, CheckpointLoader loader)
    : options_(std::move(options)),
      tree_(std::move(tree)),
      loader_(std::move(loader)),
      limiter_([this](const std::string& line) { Log(line); }),
      compute_(std::make_unique<ComputeCache>(options_.compute_cache_bytes)) {
  mounted_at_ns_ = std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::system_clock::now().time_since_epoch())
                       .count();
  auto root = std::make_shared<Node>();
  root->kind = Node::Kind::kSourceDir;
  root->ino = kRootIno;
  root->parent = kRootIno;
  nodes_[kRootIno] = std::move(root);
  source_inos_[""] = kRootIno;
}

VirtualFs::~VirtualFs() = default;

Result<std::unique_ptr<VirtualFs>> VirtualFs::Open(std::string root, const std::vector<std::string>& dirs,
                                                   CheckpointLoader loader, FsOptions options) {
  return Open(PosixSourceAt(root), dirs, std::move(loader), std::move(options));
}

Result<std::unique_ptr<VirtualFs>> VirtualFs::Open(std::shared_ptr<const Source> source,
                                                   const std::vector<std::string>& dirs, CheckpointLoader loader,
                                                   FsOptions options) {
  auto tree = SourceTree::Open(std::move(source));
  if (!tree.ok()) return Status::IOError(tree.status().message());
  std::unique_ptr<VirtualFs> fs(new VirtualFs(std::move(options), std::move(*tree), std::move(loader)));
  for (const std::string& dir : dirs) fs->AddCheckpoint(dir);
  return fs;
}

Result<std::unique_ptr<VirtualFs>> VirtualFs::Create(Catalog catalog, FsOptions options) {
  auto by_dir = std::make_shared<std::map<std::string, Checkpoint>>();
  std::vector<std::string> dirs;
  for (Checkpoint& c : catalog.checkpoints) {
    dirs.push_back(c.dir);
    (*by_dir)[c.dir] = std::move(c);
  }
  // Each checkpoint is handed over once; a reload (after a replacement) of
  // an in-memory catalog has nothing newer to give.
  CheckpointLoader loader = [by_dir](const std::string& dir) -> Result<Checkpoint> {
    auto it = by_dir->find(dir);
    if (it == by_dir->end()) return Status::NotFound(dir + ": no such checkpoint in the catalog");
    Checkpoint c = std::move(it->second);
    by_dir->erase(it);
    return c;
  };
  return Open(catalog.root, dirs, std::move(loader), std::move(options));
}

void VirtualFs::Log(const std::string& line) const {
  if (options_.log) options_.log(line);
}

void VirtualFs::LogServed(int ckpt, const FsError& e, const std::string& line) {
  limiter_.Log(ServedAt(ckpt)->dir + '\0' + std::to_string(e.err()) + '\0' + CauseKey(e.message()), line);
}

void VirtualFs::Info(const std::string& line) const {
  if (options_.info) options_.info(line);
}

VirtualFs::Served* VirtualFs::ServedAt(int i) const {
  std::shared_lock lock(mu_);
  return served_[i].get();
}

int VirtualFs::HostedBy(const std::string& rel) const {
  auto it = hosted_.find(rel);
  return it == hosted_.end() ? -1 : it->second;
}

void VirtualFs::AddCheckpoint(const std::string& dir, std::optional<Checkpoint> rows) {
  auto s = std::make_unique<Served>();
  s->dir = dir;
  s->staged = std::move(rows);
  const bool eager = s->staged.has_value();
  Detached old;
  int i, prev;
  {
    std::unique_lock lock(mu_);
    prev = HostedBy(dir);
    i = HostLocked(std::move(s), &old);
  }
  DropKernelEntries(old);
  if (prev >= 0) Unload(prev, /*wait=*/true);  // no file of it open: its rows go now
  // Rows handed over (a live checkpoint) are loaded now, so the watcher
  // checks their sources from the start.
  if (eager) (void)EnsureLoaded(i);
}

// Makes `s` the checkpoint served in its directory; the views of the one it
// replaces are detached (they stay reachable from open handles only).
// REQUIRES: mu_ held exclusively.
int VirtualFs::HostLocked(std::unique_ptr<Served> s, Detached* old) {
  const std::string dir = s->dir;
  const int prev = HostedBy(dir);
  if (prev >= 0) served_[prev]->removed = true;
  const int i = int(served_.size());
  s->index = i;
  hosted_[dir] = i;
  served_.push_back(std::move(s));
  if (auto it = source_inos_.find(dir); it != source_inos_.end()) {
    Node* n = NodeLocked(it->second);
    for (const auto& [name, ino] : n->children) old->names.push_back(name);
    n->children.clear();
    n->ckpt = -1;
    old->dir_ino = n->ino;
  }
  if (prev >= 0) DetachLocked(prev);
  return i;
}

// Its directories are emptied, so nothing reaches its nodes but the inode
// numbers the kernel holds (a lookup in one of them is ENOENT).
void VirtualFs::DetachLocked(int i) {
  for (auto it = nodes_.begin(); it != nodes_.end();) {
    Node& n = *it->second;
    if (n.is_source() || n.ckpt != i) {
      ++it;
      continue;
    }
    n.detached = true;
    n.children.clear();
    it = n.nlookup == 0 ? nodes_.erase(it) : std::next(it);
  }
}

void VirtualFs::Forget(uint64_t ino, uint64_t nlookup) {
  std::unique_lock lock(mu_);
  auto it = nodes_.find(ino);
  if (it == nodes_.end()) return;
  Node& n = *it->second;
  n.nlookup -= std::min<uint64_t>(nlookup, n.nlookup);
  if (n.nlookup == 0 && n.detached) nodes_.erase(it);
}

void VirtualFs::DropKernelEntries(const Detached& old) const {
  if (!old.dir_ino || !invalidate_entry_) return;
  for (const std::string& name : old.names) invalidate_entry_(old.dir_ino, name);
}

void VirtualFs::RemoveCheckpoint(const std::string& dir) {
  Detached old;
  int i;
  {
    std::unique_lock lock(mu_);
    i = HostedBy(dir);
    if (i < 0) return;
    served_[i]->removed = true;
    hosted_.erase(dir);
    if (auto it = source_inos_.find(dir); it != source_inos_.end()) {
      Node* n = NodeLocked(it->second);
      for (const auto& [name, ino] : n->children) old.names.push_back(name);
      n->children.clear();
      n->ckpt = -1;
      old.dir_ino = n->ino;
    }
    DetachLocked(i);
  }
  compute_->Drop(i);  // nothing new can look them up
  DropKernelEntries(old);
  Unload(i, /*wait=*/true);
}

std::vector<std::string> VirtualFs::CheckpointDirs(bool stale_only) const {
  std::shared_lock lock(mu_);
  std::vector<std::string> out;
  for (const auto& [dir, i] : hosted_)
    if (!stale_only || served_[i]->stale.load()) out.push_back(dir);
  std::sort(out.begin(), out.end());
  return out;
}

Status VirtualFs::EnsureLoaded(int i) {
  Served* s = ServedAt(i);
  if (!s->resident) EvictBeyondLimit(i);  // room first: at most max_loaded at any time
  {
    std::lock_guard<std::mutex> load(s->load_mu);
    if (!s->resident) RETURN_IF_ERROR(LoadLocked(i, s));
  }
  Touch(i);
  return Status::OK();
}

namespace {

// A store being rebuilt or a shard being restored takes seconds; a store
// that stays broken is asked at most every 16 s.
std::chrono::seconds LoadBackoff(int failures) { return std::chrono::seconds(1 << std::min(failures - 1, 4)); }

}  // namespace

// REQUIRES: s->load_mu held.
Status VirtualFs::LoadLocked(int i, Served* s) {
  if (s->removed) return Status::NotFound(Join(s->dir, "") + ": replaced or removed since it was looked up");
  const auto now = std::chrono::steady_clock::now();
  if (s->failures > 0 && now < s->retry_at) return Status::IOError(s->load_error);
  auto ckpt = s->staged ? Result<Checkpoint>(std::move(*s->staged)) : loader_(s->dir);
  s->staged.reset();
  if (!ckpt.ok()) {
    ++s->failures;
    const auto wait = LoadBackoff(s->failures);
    s->retry_at = now + wait;
    s->load_error = Join(s->dir, "") + ": cannot load the checkpoint (attempt " + std::to_string(s->failures) +
                    ", next in " + std::to_string(wait.count()) + " s on use; its views answer EIO meanwhile): " +
                    ckpt.status().message();
    Log(s->load_error);
    return Status::IOError(s->load_error);
  }
  s->ckpt = std::move(*ckpt);
  s->reader = std::make_unique<SourceReader>(tree_->source(), &s->ckpt.files, GroupPolicy{}, 1ull << 30, options_.read);
  if (options_.verify_checksums) UseChecksums(*s);
  if (!s->has_access) s->access = AccessOf(*tree_, s->ckpt);
  s->has_access = true;
  RETURN_IF_ERROR(BuildViews(i, SourceNode(s->dir, Node::Kind::kSourceDir)));
  {
    std::unique_lock lock(mu_);  // Acquire() reads it under mu_
    s->resident = true;
  }
  ++resident_count_;
  if (s->failures > 0) Info(Join(s->dir, "") + ": loaded after " + std::to_string(s->failures) + " failed attempts");
  s->failures = 0;
  s->load_error.clear();
  ReturnFreedMemory();
  Info(Join(s->dir, "") + ": loaded (" + std::to_string(s->ckpt.tensors.size()) + " tensors)");
  return Status::OK();
}

void VirtualFs::UseChecksums(Served& s) {
  auto gate = std::make_unique<ChecksumGate>(s.ckpt);
  // Said, not hidden: --verify-checksums checks nothing of a checkpoint
  // without a writer's checksums.
  if (gate->chunks() == 0)
    Log(Join(s.dir, "") + ": --verify-checksums: no writer checksums in its index (not saved by ckptfs's writer, "
        "or its commit record was refused: see `ckptfs index` and `ckptfs verify`); its reads are not checked");
  s.reader->SetChecksumGate(std::move(gate));
}

void VirtualFs::Touch(int i) const {
  if (i >= 0) ServedAt(i)->last_used = ++use_clock_;
}

void VirtualFs::EvictBeyondLimit(int keep) {
  if (options_.max_loaded == 0) return;
  std::vector<std::pair<uint64_t, int>> loaded;  // (last used, index)
  {
    std::shared_lock lock(mu_);
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
    Info(Join(ServedAt(i)->dir, "") + ": unloaded (least recently used beyond --max-loaded); loaded again on next use");
  }
}

// The nodes stay, with their sizes and inode numbers: the kernel may hold
// them for an hour, and opening one loads the checkpoint again.
bool VirtualFs::Unload(int i, bool wait) {
  Served* s = ServedAt(i);
  std::unique_lock<std::mutex> load(s->load_mu, std::defer_lock);
  if (wait) load.lock();
  else if (!load.try_lock()) return false;  // being loaded, or a view of it built: in use
  std::vector<std::shared_ptr<const Layout>> layouts;  // freed outside mu_
  {
    std::unique_lock lock(mu_);
    if (!s->resident || s->handles > 0) return false;
    s->resident = false;
    --resident_count_;
    for (const auto& [ino, n] : nodes_) {
      if (n->ckpt != i) continue;
      if (n->layout) layouts.push_back(std::move(n->layout));
      n->sources.reset();
      n->built = false;
    }
  }
  s->merged.clear();
  layouts.clear();
  compute_->Drop(i);
  s->reader.reset();
  s->ckpt = Checkpoint();
  ReturnFreedMemory();
  return true;
}

FsError VirtualFs::LoadFailure(const Status& st) {
  if (st.code() == Status::Code::kNotFound) return FsError(ESTALE, st.message() + "; look it up again");
  return FsError(EIO, st.message());
}

FsResult<VirtualFs::Served*> VirtualFs::Acquire(int i) {
  Served* s;
  {
    std::shared_lock lock(mu_);  // Unload() checks handles under it exclusively
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
void VirtualFs::Unpin(Served* s) {
  if (--s->handles > 0) return;
  if (s->removed) Unload(s->index, /*wait=*/true);
  if (options_.max_loaded > 0 && resident_count_.load() > options_.max_loaded) EvictBeyondLimit(-1);
}

std::vector<LoadedCheckpoint> VirtualFs::LoadAll() {
  std::vector<LoadedCheckpoint> out;
  for (const std::string& dir : CheckpointDirs()) {
    int i;
    {
      std::shared_lock lock(mu_);
      i = HostedBy(dir);
    }
    if (i < 0 || !EnsureLoaded(i).ok()) continue;
    Served* s = ServedAt(i);
    out.push_back({&s->ckpt, s->reader.get()});
  }
  return out;
}

namespace {

// A view directory's files, built outside the node table's lock.
struct PendingDir {
  std::string name;
  std::vector<ViewFile> files;
  bool is_mesh = false;
  bool is_npy = false;
};

}  // namespace

// Builds consolidated/, bytes/ and mesh/ of checkpoint `i` and attaches
// them to `dir`, with tensors/ empty until first used (FillNpy: one file
// per tensor is the largest view, and the one least often listed). One bad
// view must not hide the others: failures are logged and the view left out.
Status VirtualFs::BuildViews(int i, Node* dir) {
  const Checkpoint& ckpt = ServedAt(i)->ckpt;
  std::vector<PendingDir> pending;
  if (auto files = ConsolidatedView(ckpt, ckpt.files, options_.consolidated); files.ok())
    pending.push_back({"consolidated", std::move(*files)});
  else
    Log(Join(ckpt.dir, "consolidated") + ": not created: " + files.status().message());
  bool mergeable = false;
  if (IsPeftAdapter(ckpt)) {
    const std::string why = MergedRefusal(ckpt);
    if (!why.empty()) Log(Join(ckpt.dir, "merged/: not created: " + why));
    mergeable = why.empty();
  }
  pending.push_back({"tensors", {}, false, true});
  if (auto items = BytesView(ckpt); !items.empty()) pending.push_back({"bytes", std::move(items)});
  if (auto rules = RulesFor(ckpt); rules.ok()) {
    Layout text;
    text.AddLiteral(MeshReadme(*rules));
    pending.push_back({"mesh", {{"README", std::make_shared<const Layout>(std::move(text)), ""}}, true});
  } else {
    Log(Join(ckpt.dir, "mesh") + ": not created: " + rules.status().message());
  }
  std::unique_lock lock(mu_);
  if (served_[i]->removed) return Status::OK();  // replaced while loading: attach nothing
  dir->ckpt = i;
  // Loaded again after an unload, the views' nodes are still there and get
  // their layouts back; tensors/ keeps its files (each layout is made on open).
  for (PendingDir& p : pending) {
    Node* view = AddVirtual(dir, p.name, /*is_dir=*/true, i);
    if (view->is_mesh != p.is_mesh) view->is_mesh = p.is_mesh;
    if (const bool fill = p.is_npy && view->children.empty(); view->is_npy != fill) view->is_npy = fill;
    for (ViewFile& f : p.files) AddViewFile(view, std::move(f), i);
  }
  if (mergeable) AddVirtual(dir, "merged", /*is_dir=*/true, i)->is_dtype_view = true;  // built on first lookup
  return Status::OK();
}

namespace {

// The text of sidecar `name` of `ckpt` ("" when it has none or it cannot be read).
std::string ReadSidecar(const Source& source, const Checkpoint& ckpt, const std::string& name) {
  auto it = ckpt.sidecars.find(name);
  if (it == ckpt.sidecars.end()) return "";
  auto text = source.ReadWhole(ckpt.files[it->second].path);
  return text.ok() ? *text : "";
}

// "tp2.bf16" -> {"tp2", "bf16"}; "tp2" -> {"tp2", ""}.
std::pair<std::string, std::string> SplitDTypeSuffix(const std::string& name) {
  const size_t dot = name.rfind('.');
  if (dot == std::string::npos) return {name, ""};
  return {name.substr(0, dot), name.substr(dot + 1)};
}

}  // namespace

Result<DTypeView> VirtualFs::DTypeViewFor(const Checkpoint& ckpt, const std::string& suffix) const {
  auto to = ParseViewDType(suffix);
  if (!to) return Status::NotFound("unknown dtype '" + suffix + "': the dtype views are .bf16, .fp16 and .fp32");
  DTypeView view{*to, options_.keep_dtype, ""};
  if (ckpt.sidecars.count("config.json")) view.config_json = ReadSidecar(*tree_->source(), ckpt, "config.json");
  return view;
}

// Builds consolidated.<dtype>/ on first lookup; ENOENT, with a log line,
// for a name that is no dtype view.
FsResult<uint64_t> VirtualFs::OpenDTypeView(Node* dir, const std::string& name) {
  int i;
  {
    std::shared_lock lock(mu_);
    i = dir->ckpt;
  }
  if (i < 0) return FsError(ENOENT, Join(dir->rel, name) + ": no checkpoint here now");
  Served* served = ServedAt(i);
  if (Status st = EnsureLoaded(i); !st.ok()) return LoadFailure(st);  // the caller holds a pin
  if (served->removed) return FsError(ESTALE, Join(served->dir, "") + ": replaced or removed; look it up again");
  std::lock_guard<std::mutex> load(served->load_mu);  // one build at a time
  {
    std::shared_lock lock(mu_);
    if (auto it = dir->children.find(name); it != dir->children.end() && NodeLocked(it->second) &&
                                            NodeLocked(it->second)->built)
      return it->second;  // built by another thread meanwhile
  }
  const Checkpoint& ckpt = served->ckpt;
  const std::string where = Join(ckpt.dir, name);
  auto fail = [&](const std::string& why) {
    Log(where + ": " + why);
    return FsError(ENOENT, where + ": " + why);
  };
  auto view = DTypeViewFor(ckpt, SplitDTypeSuffix(name).second);
  if (!view.ok()) return fail(view.status().message());
  auto files = ConsolidatedView(ckpt, ckpt.files, options_.consolidated, &*view);
  if (!files.ok()) return fail("not created: " + files.status().message());
  std::unique_lock lock(mu_);
  if (dir->ckpt != i) return FsError(ESTALE, served->dir + ": replaced or removed; look it up again");
  Node* view_dir = AddVirtual(dir, name, /*is_dir=*/true, i);  // or the one built before an unload
  view_dir->is_dtype_view = true;
  view_dir->built = true;
  for (ViewFile& f : *files) AddViewFile(view_dir, std::move(f), i);
  return view_dir->ino;
}

std::string VirtualFs::MergedRefusal(const Checkpoint& ckpt) const {
  auto target = MergeTarget(*tree_->source(), ckpt);
  if (!target.ok()) return target.status().message();
  std::shared_lock lock(mu_);
  return HostedBy(target->second) >= 0 ? "" : NoBaseCheckpoint(target->first, target->second);
}

Result<Checkpoint> VirtualFs::RowsOf(const std::string& dir) {
  int i;
  {
    std::shared_lock lock(mu_);
    i = HostedBy(dir);
  }
  if (i < 0) return Status::NotFound("no checkpoint in '" + Join(dir, "") + "' now");
  auto s = Acquire(i);
  if (!s.ok()) return Status::IOError(s.status().message());
  Checkpoint copy = (*s)->ckpt;  // pinned: not unloaded while copied
  Unpin(*s);
  return copy;
}

// Built outside every lock: the base is pinned only while its rows are
// copied, and the adapter's load_mu is taken only to attach, never with
// the base's held.
FsResult<uint64_t> VirtualFs::OpenMergedView(Node* dir, const std::string& name) {
  int i;
  bool mergeable;
  {
    std::shared_lock lock(mu_);
    i = dir->ckpt;
    mergeable = dir->children.count("merged") > 0;  // BuildViews' verdict, logged once there
  }
  if (i < 0) return FsError(ENOENT, Join(dir->rel, name) + ": no checkpoint here now");
  if (!mergeable) return FsError(ENOENT, Join(dir->rel, name) + ": no merged view here (see the log)");
  Served* served = ServedAt(i);
  auto adapter = RowsOf(served->dir);  // the caller holds a pin: loads, never waits for an unload
  if (!adapter.ok()) return LoadFailure(adapter.status());
  const std::string where = Join(served->dir, name);
  auto fail = [&](const std::string& why) {
    Log(where + "/: not created: " + why);
    return FsError(ENOENT, where + ": not created: " + why);
  };
  auto target = MergeTarget(*tree_->source(), *adapter);
  if (!target.ok()) return fail(target.status().message());
  auto base = RowsOf(target->second);
  if (!base.ok()) return fail("its base " + Join(target->second, "") + ": " + base.status().message());
  std::optional<DTypeView> dtype;
  if (const std::string suffix = *MergedViewSuffix(name); !suffix.empty()) {
    auto to = ParseViewDType(suffix);
    if (!to) return fail("unknown dtype '" + suffix + "': the dtype views are .bf16, .fp16 and .fp32");
    dtype = DTypeView{*to, options_.keep_dtype, ""};
  }
  auto built = BuildMergedView(tree_->source(), *adapter, *base, std::move(target->first), options_.consolidated,
                               dtype ? &*dtype : nullptr, options_.read);
  if (!built.ok()) return fail(built.status().message());
  std::lock_guard<std::mutex> load(served->load_mu);  // guards served->merged
  std::unique_lock lock(mu_);
  if (dir->ckpt != i) return FsError(ESTALE, served->dir + ": replaced or removed; look it up again");
  Node* view_dir = AddVirtual(dir, name, /*is_dir=*/true, i);  // or the one built before an unload
  if (view_dir->built) return view_dir->ino;  // built by another thread meanwhile
  view_dir->is_dtype_view = true;
  view_dir->built = true;
  for (ViewFile& f : built->files) AddViewFile(view_dir, std::move(f), i, built->sources);
  served->merged.push_back(std::move(built->sources));
  return view_dir->ino;
}

void VirtualFs::MarkMergedStale(const std::shared_ptr<MergedSources>& ms, int ckpt, const std::string& why) {
  if (ms->stale.exchange(true)) return;
  compute_->Drop(ckpt);
  Log(Join(ServedAt(ckpt)->dir, "") + ": merged view: " + why + "; it reads as EIO until the adapter is indexed again");
  if (!options_.invalidate) return;
  std::vector<uint64_t> inos;
  {
    std::shared_lock lock(mu_);
    for (const auto& [ino, n] : nodes_)
      if (n->sources == ms) inos.push_back(ino);
  }
  for (uint64_t ino : inos) options_.invalidate(ino);
}

// The preset for the checkpoint's model family (config.json's model_type,
// else its tensor names) and the head counts head-aware splits need, with
// the --rules file's rules first.
Result<ShardingRules> VirtualFs::RulesFor(const Checkpoint& ckpt) const {
  ModelFacts facts;
  if (ckpt.sidecars.count("config.json")) facts = ParseModelFacts(ReadSidecar(*tree_->source(), ckpt, "config.json"));
  std::vector<std::string> names;
  if (auto weights = ModelWeights(ckpt, options_.consolidated); weights.ok())
    for (const auto& w : *weights) names.push_back(w.entry_name());
  ShardingRules rules = PresetRules(facts, names);
  if (options_.rules_json.empty()) return rules;
  return LoadRulesFile(options_.rules_json, std::move(rules));
}

// Builds mesh/<spec>/rank-NNNNN/ on first lookup. ENOENT, with a log line
// saying why, for a spec that is malformed or impossible for the checkpoint.
// REQUIRES: its checkpoint pinned.
FsResult<uint64_t> VirtualFs::OpenMesh(Node* mesh_dir, const std::string& name) {
  Served* served = ServedAt(mesh_dir->ckpt);
  if (Status st = EnsureLoaded(mesh_dir->ckpt); !st.ok()) return LoadFailure(st);
  if (served->removed) return FsError(ESTALE, Join(served->dir, "") + ": replaced or removed; look it up again");
  std::lock_guard<std::mutex> load(served->load_mu);  // one build at a time
  {
    std::shared_lock lock(mu_);
    if (auto it = mesh_dir->children.find(name); it != mesh_dir->children.end() && NodeLocked(it->second) &&
                                                 NodeLocked(it->second)->built)
      return it->second;  // built by another thread meanwhile
  }
  const Checkpoint& ckpt = served->ckpt;
  const std::string where = Join(ckpt.dir, "mesh/" + name);
  auto fail = [&](const std::string& why) {
    Log(where + ": " + why);
    return FsError(ENOENT, where + ": " + why);
  };
  // tp2.bf16: the spec's dtype view.
  const auto [spec_name, suffix] = SplitDTypeSuffix(name);
  std::optional<DTypeView> dtype;
  if (!suffix.empty()) {
    auto view = DTypeViewFor(ckpt, suffix);
    if (!view.ok()) return fail(view.status().message());
    dtype = std::move(*view);
  }
  auto spec = ParseMeshSpec(spec_name);
  if (!spec.ok()) return fail(spec.status().message());
  if (spec->name != spec_name)
    return fail("not the canonical name; open mesh/" + spec->name + (suffix.empty() ? "" : "." + suffix));
  auto rules = RulesFor(ckpt);
  if (!rules.ok()) return fail(rules.status().message());
  auto mesh = MeshView(ckpt, ckpt.files, *spec, *rules, options_.consolidated, dtype ? &*dtype : nullptr);
  if (!mesh.ok()) return fail(mesh.status().message());
  for (const std::string& note : mesh->notes) Log(where + ": " + note);
  std::vector<std::vector<ViewFile>>& ranks = mesh->ranks;
  std::unique_lock lock(mu_);
  Node* dir = AddVirtual(mesh_dir, name, /*is_dir=*/true, mesh_dir->ckpt);  // or the one built before an unload
  dir->is_spec = true;
  dir->built = true;
  for (uint64_t r = 0; r < ranks.size(); ++r) {
    char rank_name[32];
    std::snprintf(rank_name, sizeof rank_name, "rank-%05llu", static_cast<unsigned long long>(r));
    Node* rank_dir = AddVirtual(dir, rank_name, /*is_dir=*/true, mesh_dir->ckpt);
    for (ViewFile& f : ranks[r]) AddViewFile(rank_dir, std::move(f), mesh_dir->ckpt);
  }
  return dir->ino;
}

// Makes the files of tensors/ (`npy_dir`) on its first lookup or listing:
// names and sizes only, each file's layout being made again when it is
// opened (EnsureLayout). A tensor that cannot be presented leaves the
// folder empty, with a log line.
// REQUIRES: its checkpoint pinned.
FsError VirtualFs::FillNpy(Node* npy_dir) {
  Served* served = ServedAt(npy_dir->ckpt);
  if (Status st = EnsureLoaded(npy_dir->ckpt); !st.ok()) return LoadFailure(st);
  if (served->removed) return FsError(ESTALE, Join(served->dir, "") + ": replaced or removed; look it up again");
  std::lock_guard<std::mutex> load(served->load_mu);  // one fill at a time
  {
    std::shared_lock lock(mu_);
    if (!npy_dir->is_npy) return FsError();  // filled by another thread meanwhile
  }
  // Sizes first, nodes after: layouts made and freed between the nodes would
  // leave the heap fragmented (pages that neither hold much nor go back).
  const auto& tensors = served->ckpt.tensors;
  std::vector<uint64_t> sizes;
  sizes.reserve(tensors.size());
  for (const auto& t : tensors) {
    auto f = NpyFile(t);
    if (!f.ok()) {
      Log(Join(served->ckpt.dir, "tensors") + ": no files: " + f.status().message());
      sizes.clear();
      break;
    }
    sizes.push_back(f->layout->size());
  }
  std::unique_lock lock(mu_);
  npy_dir->is_npy = false;
  for (size_t i = 0; i < sizes.size(); ++i) {
    Node* n = AddVirtual(npy_dir, EscapeFileName(tensors[i]->fqn) + ".npy", /*is_dir=*/false, npy_dir->ckpt);
    n->size = sizes[i];
    n->npy = int(i);
  }
  return FsError();
}

// A tensors/ file's layout is made on its first open and kept while its
// checkpoint stays loaded; a mesh file's is made with its spec, which is
// built again when its checkpoint was unloaded since.
// REQUIRES: a handle of the checkpoint held.
FsError VirtualFs::EnsureLayout(Node* n, const Served& served) {
  Node* spec = nullptr;
  {
    std::shared_lock lock(mu_);
    if (n->layout) return FsError();
    for (Node* up = n; !spec;) {
      Node* parent = NodeLocked(up->parent);
      if (!parent || parent->kind != Node::Kind::kVirtualDir) break;
      if (parent->is_spec || parent->is_dtype_view) spec = parent;
      up = parent;
    }
  }
  if (n->npy >= 0) {
    auto f = NpyFile(served.ckpt.tensors.at(n->npy));
    if (!f.ok()) return FsError::From(f.status());
    std::unique_lock lock(mu_);
    if (!n->layout) n->layout = std::move(f->layout);
    return FsError();
  }
  if (spec) {
    std::shared_ptr<Node> up = Find(spec->parent);
    if (!up) return FsError(ESTALE, PathOf(*n) + ": its checkpoint was replaced or removed");
    auto built = spec->is_spec                    ? OpenMesh(up.get(), spec->name)
                 : MergedViewSuffix(spec->name) ? OpenMergedView(up.get(), spec->name)
                                                : OpenDTypeView(up.get(), spec->name);
    if (!built.ok()) return built.status();
  }
  std::shared_lock lock(mu_);
  if (n->layout) return FsError();
  return FsError(EIO, PathOf(*n) + ": its view was not made again when " + Join(served.dir, "") +
                          " was loaded again (see the log)");
}

// glibc keeps freed memory (a checkpoint's rows, the temporaries of building
// its views) mapped for reuse; a daemon's RSS would then stay at its peak.
void VirtualFs::ReturnFreedMemory() { malloc_trim(0); }

// Puts a view file under `view`; a name with '/' (a sidecar folder such as
// sentence-transformers' 1_Pooling/config.json) gets its directories.
// REQUIRES: mu_ held exclusively.
void VirtualFs::AddViewFile(Node* view, ViewFile f, int ckpt, std::shared_ptr<MergedSources> sources) {
  Node* dir = view;
  for (size_t at = 0, slash; (slash = f.name.find('/', at)) != std::string::npos; at = slash + 1) {
    const std::string part = f.name.substr(at, slash - at);
    auto it = dir->children.find(part);
    dir = it != dir->children.end() ? NodeLocked(it->second) : AddVirtual(dir, part, /*is_dir=*/true, ckpt);
  }
  Node* n = AddVirtual(dir, f.name.substr(f.name.rfind('/') + 1), /*is_dir=*/false, ckpt);
  // A node filled again after an unload is read meanwhile without the lock
  // (AttrOf, Open): what a reload leaves as it was is not written.
  if (const uint64_t size = f.layout->size(); n->size != size) n->size = size;
  if (n->problem != f.problem) n->problem = std::move(f.problem);
  n->sources = std::move(sources);
  n->layout = std::move(f.layout);
}

// REQUIRES: construction time, or mu_ held exclusively.
// An existing child of that name and kind is reused: a checkpoint loaded
// again keeps its inode numbers.
VirtualFs::Node* VirtualFs::AddVirtual(Node* parent, const std::string& name, bool is_dir, int ckpt) {
  if (auto it = parent->children.find(name); it != parent->children.end()) {
    Node* old = NodeLocked(it->second);
    if (old && old->ckpt == ckpt && old->is_dir() == is_dir) return old;
  }
  auto n = std::make_shared<Node>();
  n->ckpt = ckpt;
  n->kind = is_dir ? Node::Kind::kVirtualDir : Node::Kind::kVirtualFile;
  n->ino = next_ino_++;
  n->parent = parent->ino;
  n->name = name;
  parent->children[name] = n->ino;
  nodes_[n->ino] = n;
  return n.get();
}

// Returns the node for source path `rel`, creating it (and its parents).
VirtualFs::Node* VirtualFs::SourceNode(const std::string& rel, NodeKind kind) {
  {
    std::shared_lock lock(mu_);
    if (auto it = source_inos_.find(rel); it != source_inos_.end()) return NodeLocked(it->second);
  }
  uint64_t parent = kRootIno;
  if (auto slash = rel.rfind('/'); slash != std::string::npos)
    parent = SourceNode(rel.substr(0, slash), Node::Kind::kSourceDir)->ino;
  std::unique_lock lock(mu_);
  if (auto it = source_inos_.find(rel); it != source_inos_.end()) {
    // The same path may have become another kind (a file replaced by a link).
    NodeLocked(it->second)->kind = kind;
    return NodeLocked(it->second);
  }
  auto n = std::make_shared<Node>();
  n->kind = kind;
  n->ino = next_ino_++;
  n->parent = parent;
  n->rel = rel;
  n->name = rel.substr(rel.rfind('/') == std::string::npos ? 0 : rel.rfind('/') + 1);
  source_inos_[rel] = n->ino;
  nodes_[n->ino] = n;
  return n.get();
}

size_t VirtualFs::NodeCount() const {
  std::shared_lock lock(mu_);
  return nodes_.size();
}

size_t VirtualFs::ServedCount() const {
  std::shared_lock lock(mu_);
  return served_.size();
}

std::shared_ptr<VirtualFs::Node> VirtualFs::Find(uint64_t ino) const {
  std::shared_lock lock(mu_);
  auto it = nodes_.find(ino);
  return it == nodes_.end() ? nullptr : it->second;
}

VirtualFs::Node* VirtualFs::NodeLocked(uint64_t ino) const {
  auto it = nodes_.find(ino);
  return it == nodes_.end() ? nullptr : it->second.get();
}

std::string VirtualFs::PathOf(const Node& n) const {
  if (n.is_source()) return n.rel;
  std::shared_ptr<const Node> p = Find(n.parent);
  return p ? Join(PathOf(*p), n.name) : n.name;
}

FsResult<Attr> VirtualFs::AttrOf(const Node& n) const {
  Attr a;
  a.ino = n.ino;
  a.uid = options_.uid;
  a.gid = options_.gid;
  if (n.is_source()) {
    ASSIGN_OR_RETURN(struct stat st, tree_->Lstat(n.rel));
    a.mode = S_ISLNK(st.st_mode) ? (S_IFLNK | 0777) : (st.st_mode & ~0222u);
    a.size = st.st_size;
    a.nlink = S_ISDIR(st.st_mode) ? 2 : 1;
    a.mtime_ns = MtimeNs(st);
    a.uid = st.st_uid;
    a.gid = st.st_gid;
    return a;
  }
  a.is_virtual = true;
  a.mtime_ns = mounted_at_ns_;
  const ViewAccess& access = ServedAt(n.ckpt)->access;
  a.uid = access.uid;
  a.gid = access.gid;
  if (n.kind == Node::Kind::kVirtualDir) {
    a.mode = access.dir_mode();
    a.nlink = 2;
  } else {
    a.mode = access.file_mode();
    a.size = n.size;
  }
  return a;
}

namespace {

bool IsViewName(const std::string& name) {
  return name == "consolidated" || name == "tensors" || name == "mesh" || name == "bytes" ||
         name.rfind("consolidated.", 0) == 0 || MergedViewSuffix(name);
}

}  // namespace

FsResult<Attr> VirtualFs::Lookup(uint64_t parent, const std::string& name, bool for_kernel) {
  std::shared_ptr<Node> p = Find(parent);
  if (!p) return FsError(ENOENT, "unknown inode " + std::to_string(parent));
  if (!p->is_dir()) return FsError(ENOTDIR, PathOf(*p) + " is not a directory");
  if (name == "." ) return AttrOf(*p);
  if (name == "..") return GetAttr(p->parent);
  if (p->kind == Node::Kind::kSourceDir) {
    const std::string rel = Join(p->rel, name);
    if (auto st = tree_->Lstat(rel); st.ok()) {
      if (S_ISDIR(st->st_mode)) return AttrOf(*SourceNode(rel, Node::Kind::kSourceDir));
      if (S_ISREG(st->st_mode)) return AttrOf(*SourceNode(rel, Node::Kind::kSourceFile));
      if (S_ISLNK(st->st_mode)) return AttrOf(*SourceNode(rel, Node::Kind::kSourceLink));
    }
  }
  Status load_error;
  Pin pin = EnsureViewsOf(*p, &load_error);
  Touch(p->ckpt);
  if (FsError e = NeedsNpy(*p) ? FillNpy(p.get()) : FsError(); !e.ok()) return e;
  uint64_t child = 0;
  bool built = true;
  {
    std::shared_lock lock(mu_);
    auto it = p->children.find(name);
    if (it != p->children.end()) child = it->second;
    if (const Node* c = child ? NodeLocked(child) : nullptr; c && (c->is_spec || c->is_dtype_view)) built = c->built;
  }
  if ((!child || !built) && p->is_mesh) {
    ASSIGN_OR_RETURN(child, OpenMesh(p.get(), name));
  }
  if ((!child || !built) && p->kind == Node::Kind::kSourceDir && name.rfind("consolidated.", 0) == 0 &&
      ViewsAttached(*p)) {
    ASSIGN_OR_RETURN(child, OpenDTypeView(p.get(), name));
  }
  if ((!child || !built) && p->kind == Node::Kind::kSourceDir && MergedViewSuffix(name) && ViewsAttached(*p)) {
    ASSIGN_OR_RETURN(child, OpenMergedView(p.get(), name));
  }
  // A view of a checkpoint that cannot be loaded exists; it cannot be served.
  if (!child && !load_error.ok() && IsViewName(name)) return FsError(EIO, load_error.message());
  if (!child) return FsError(ENOENT, Join(PathOf(*p), name) + ": no such file or directory");
  std::shared_ptr<Node> c = Find(child);
  if (!c) return FsError(ESTALE, Join(PathOf(*p), name) + ": its checkpoint was replaced or removed");
  ASSIGN_OR_RETURN(Attr a, AttrOf(*c));
  if (for_kernel) {
    std::shared_lock lock(mu_);  // Forget() erases under it exclusively
    if (!NodeLocked(child)) return FsError(ESTALE, Join(PathOf(*p), name) + ": its checkpoint was removed");
    ++c->nlookup;
  }
  return a;
}

bool VirtualFs::ViewsAttached(const Node& dir) const {
  std::shared_lock lock(mu_);
  return dir.ckpt >= 0;
}

bool VirtualFs::NeedsNpy(const Node& n) const {
  std::shared_lock lock(mu_);
  return n.is_npy;
}

VirtualFs::Pin::~Pin() {
  if (served_) fs_->Unpin(served_);
}

// Pinned (Served::handles), the checkpoint cannot be unloaded by another
// thread between being loaded here and the caller reading its views. A
// virtual directory's checkpoint is pinned, not loaded: its entries are
// kept across unloads, and what needs rows (FillNpy, OpenMesh) loads it.
VirtualFs::Pin VirtualFs::EnsureViewsOf(const Node& dir, Status* error) {
  int i;
  Served* s;
  bool attached;
  {
    std::shared_lock lock(mu_);
    i = dir.kind == Node::Kind::kSourceDir ? HostedBy(dir.rel) : dir.ckpt;
    if (i < 0) return Pin(this, nullptr);
    s = served_[i].get();
    ++s->handles;
    attached = dir.kind != Node::Kind::kSourceDir || dir.ckpt == i;
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

FsResult<Attr> VirtualFs::GetAttr(uint64_t ino) {
  std::shared_ptr<Node> n = Find(ino);
  if (!n) return FsError(ENOENT, "unknown inode " + std::to_string(ino));
  return AttrOf(*n);
}

FsResult<std::vector<DirEntry>> VirtualFs::ReadDir(uint64_t ino) {
  std::shared_ptr<Node> p = Find(ino);
  if (!p) return FsError(ENOENT, "unknown inode " + std::to_string(ino));
  if (!p->is_dir()) return FsError(ENOTDIR, PathOf(*p) + " is not a directory");
  std::vector<DirEntry> out;
  if (p->kind == Node::Kind::kSourceDir) {
    ASSIGN_OR_RETURN(std::vector<std::string> names, tree_->List(p->rel));
    for (const std::string& name : names) {
      auto a = Lookup(ino, name);
      if (a.ok()) out.push_back({name, *a});  // skips sockets, dangling links
    }
  }
  Pin pin = EnsureViewsOf(*p);
  if (FsError e = NeedsNpy(*p) ? FillNpy(p.get()) : FsError(); !e.ok()) return e;
  // Inodes only (a virtual dir may hold 100k files): a node and its name
  // live as long as the VirtualFs.
  std::vector<uint64_t> children;
  {
    std::shared_lock lock(mu_);
    children.reserve(p->children.size());
    for (const auto& [name, child] : p->children) children.push_back(child);
  }
  std::set<std::string> real;  // a real entry shadows a virtual one of its name
  for (const DirEntry& e : out) real.insert(e.name);
  out.reserve(out.size() + children.size());
  for (uint64_t child : children) {
    std::shared_ptr<const Node> c = Find(child);
    if (!c || real.count(c->name)) continue;  // gone: its checkpoint was removed meanwhile
    auto a = AttrOf(*c);
    if (a.ok()) out.push_back({c->name, *a});
  }
  std::sort(out.begin(), out.end(), [](const DirEntry& a, const DirEntry& b) { return a.name < b.name; });
  return out;
}

FsResult<uint64_t> VirtualFs::Open(uint64_t ino, int flags) {
  std::shared_ptr<Node> n = Find(ino);
  if (!n) return FsError(ENOENT, "unknown inode " + std::to_string(ino));
  if ((flags & O_ACCMODE) != O_RDONLY || (flags & (O_TRUNC | O_CREAT | O_APPEND)))
    return FsError(EROFS, PathOf(*n) + ": read-only file system");
  if (n->is_dir()) return FsError(EISDIR, PathOf(*n) + " is a directory");
  // Refused here rather than at read: a mapped file whose pages fail to read
  // kills its reader with SIGBUS, a failed open is an exception it can catch.
  if (!n->problem.empty()) {
    FsError e(EIO, PathOf(*n) + ": " + n->problem);
    LogServed(n->ckpt, e, PathOf(*n) + ": open failed (" + std::strerror(EIO) + "): " + n->problem);
    return e;
  }
  auto h = std::make_unique<Handle>();
  h->node = n;
  if (n->kind == Node::Kind::kSourceLink) return FsError(ELOOP, n->rel + ": a symlink (the kernel follows it)");
  if (n->kind == Node::Kind::kSourceFile) {
    ASSIGN_OR_RETURN(h->file, tree_->OpenFile(n->rel));
  }
  if (n->kind == Node::Kind::kVirtualFile) {
    // Loads its checkpoint again if it was unloaded since the kernel looked
    // the file up: the inode is still this file's.
    auto s = Acquire(n->ckpt);
    if (!s.ok()) {
      LogServed(n->ckpt, s.status(), PathOf(*n) + ": open failed (" + std::strerror(s.status().err()) +
                                         "): " + s.status().message());
      return s.status();
    }
    h->served = *s;
    if (FsError e = EnsureLayout(n.get(), **s); !e.ok()) {
      Unpin(*s);
      return e;
    }
  }
  Touch(n->ckpt);
  return reinterpret_cast<uint64_t>(h.release());
}

FsResult<size_t> VirtualFs::Read(uint64_t handle, char* buf, size_t size, uint64_t offset) {
  const Handle* h = reinterpret_cast<const Handle*>(handle);
  const Node& n = *h->node;
  if (n.kind == Node::Kind::kSourceFile) return h->file->Read(buf, size, offset);
  ASSIGN_OR_RETURN(ReadPlan plan, PlanRead(*h, size, offset));
  SourceReader* reader = ReaderOf(*h);
  Status st = reader->Execute(plan, buf);
  if (st.ok() && !plan.computes.empty()) st = compute_->Fill(plan.computes, buf, *reader, n.ckpt);
  if (!st.ok()) return ReadFailed(n, size, offset, st);
  reader->ReadAhead(h->stream, n.layout, offset, plan.length);
  return plan.length;
}

FsError VirtualFs::ReadFailed(const Node& n, size_t size, uint64_t offset, const FsError& e) {
  LogServed(n.ckpt, e, PathOf(n) + ": read of " + std::to_string(size) + " bytes at " + std::to_string(offset) +
      " failed (" + std::strerror(e.err()) + "): " + e.message());
  return e;
}

FsError VirtualFs::ReadFailed(const Node& n, size_t size, uint64_t offset, const Status& st) {
  if (st.code() == Status::Code::kStale && n.sources) MarkMergedStale(n.sources, n.ckpt, st.message());
  else if (st.code() == Status::Code::kStale) InvalidateCheckpoint(n.ckpt);
  return ReadFailed(n, size, offset, FsError::From(st));
}

// Kept loaded by the open handle; a merged/ file reads two checkpoints' files.
SourceReader* VirtualFs::ReaderOf(const Handle& h) {
  return h.node->sources ? h.node->sources->reader.get() : h.served->reader.get();
}

FsResult<ReadPlan> VirtualFs::PlanRead(const Handle& h, size_t size, uint64_t offset) {
  const Node& n = *h.node;
  if (!n.problem.empty()) return ReadFailed(n, size, offset, FsError(EIO, n.problem));
  if (n.sources && n.sources->stale.load())
    return ReadFailed(n, size, offset,
                      FsError(EIO, PathOf(n) + ": a source of the adapter or of its base changed since indexing; "
                                               "the merged view reads as EIO until the adapter is loaded again"));
  // One changed source makes the whole checkpoint suspect: files the read
  // does not touch may belong to a save that replaced them all.
  if (h.served->stale.load())
    return ReadFailed(n, size, offset,
                      FsError(EIO, Join(h.served->dir, "") + ": a source changed since indexing; the checkpoint "
                                                             "reads as EIO until it is indexed again"));
  auto plan = Plan(*n.layout, offset, size);
  if (!plan.ok()) return ReadFailed(n, size, offset, FsError::From(plan.status()));
  return std::move(plan).value();
}

FsResult<ScatterReply> VirtualFs::ReadScatter(uint64_t handle, size_t size, uint64_t offset) {
  const Handle* h = reinterpret_cast<const Handle*>(handle);
  const Node& n = *h->node;
  ScatterReply reply;
  if (n.kind != Node::Kind::kVirtualFile) {
    // One buffer per thread, kept (see the header).
    thread_local std::vector<char> buf;
    if (buf.size() < size) buf.resize(size);
    ASSIGN_OR_RETURN(size_t got, Read(handle, buf.data(), size, offset));
    reply.Add(0, buf.data(), got);
    if (Status st = reply.Finish(); !st.ok()) return FsError::From(st);
    return reply;
  }
  ASSIGN_OR_RETURN(ReadPlan plan, PlanRead(*h, size, offset));
  SourceReader* reader = ReaderOf(*h);
  Status st = reader->ExecuteScatter(plan, &reply);
  // Computed bytes are gathered: each op into the memory ExecuteScatter set aside.
  for (size_t i = 0; st.ok() && i < plan.computes.size(); ++i) {
    ComputeOp op = plan.computes[i];
    char* out = reply.Reserve(op.dst_offset, op.length);
    op.dst_offset = 0;
    st = compute_->Fill({op}, out, *reader, n.ckpt);
  }
  if (st.ok()) st = reply.Finish();
  if (!st.ok()) return ReadFailed(n, size, offset, st);
  reader->ReadAhead(h->stream, n.layout, offset, plan.length);
  return reply;
}

FsResult<std::string> VirtualFs::ReadLink(uint64_t ino) {
  std::shared_ptr<Node> n = Find(ino);
  if (!n) return FsError(ENOENT, "unknown inode " + std::to_string(ino));
  if (n->kind != Node::Kind::kSourceLink) return FsError(EINVAL, PathOf(*n) + " is not a symlink");
  return tree_->ReadLink(n->rel);
}

void VirtualFs::InvalidateCheckpoint(size_t i) {
  Served* s = ServedAt(int(i));
  if (s->stale.exchange(true)) return;
  compute_->Drop(int(i));
  Log(Join(s->dir, "") + ": a source changed since indexing; its views read as EIO until it is indexed again");
  if (!options_.invalidate) return;
  std::vector<uint64_t> inos;
  {
    std::shared_lock lock(mu_);
    for (const auto& [ino, n] : nodes_)
      if (n->kind == Node::Kind::kVirtualFile && n->ckpt == int(i)) inos.push_back(ino);
  }
  for (uint64_t ino : inos) options_.invalidate(ino);
}

std::vector<std::string> VirtualFs::SourceDirs() const {
  std::set<std::string> dirs;
  std::vector<Served*> loaded;
  {
    std::shared_lock lock(mu_);
    for (const auto& [dir, i] : hosted_) {
      dirs.insert(dir);
      loaded.push_back(served_[i].get());
    }
  }
  for (Served* s : loaded) {
    std::lock_guard<std::mutex> load(s->load_mu);
    for (const SourceFile& f : s->ckpt.files) {
      size_t slash = f.path.rfind('/');
      dirs.insert(slash == std::string::npos ? "" : f.path.substr(0, slash));
    }
  }
  std::vector<std::string> out;
  if (!tree_->watchable()) return out;
  for (const std::string& d : dirs) out.push_back(d.empty() ? tree_->root() : tree_->root() + "/" + d);
  return out;
}

size_t VirtualFs::RecheckSources() {
  limiter_.Flush();  // the counts of a fault that stopped
  std::vector<int> live;
  {
    std::shared_lock lock(mu_);
    for (const auto& [dir, i] : hosted_) live.push_back(i);
  }
  size_t changed = 0;
  for (int i : live) {
    Served* s = ServedAt(i);
    if (s->stale.load()) continue;
    bool changed_now;
    std::vector<std::pair<std::shared_ptr<MergedSources>, Status>> merged_changed;
    {
      std::lock_guard<std::mutex> load(s->load_mu);  // the reader is not unloaded meanwhile
      // Null until loaded (nothing served, nothing cached) and once unloaded.
      changed_now = s->reader && !s->reader->Recheck().ok();
      for (const auto& ms : s->merged)
        if (Status st = ms->stale ? Status::OK() : ms->reader->Recheck(); !st.ok()) merged_changed.push_back({ms, st});
    }
    for (const auto& [ms, st] : merged_changed) MarkMergedStale(ms, i, st.message());
    if (changed_now) {
      InvalidateCheckpoint(i);
      ++changed;
    }
  }
  return changed;
}

void VirtualFs::Release(uint64_t handle) {
  std::unique_ptr<Handle> h(reinterpret_cast<Handle*>(handle));
  if (h->served) Unpin(h->served);
}

FsResult<Attr> VirtualFs::Resolve(const std::string& path) {
  uint64_t ino = kRootIno;
  size_t at = 0;
  while (at < path.size()) {
    size_t slash = path.find('/', at);
    std::string part = path.substr(at, slash == std::string::npos ? std::string::npos : slash - at);
    at = slash == std::string::npos ? path.size() : slash + 1;
    if (part.empty() || part == ".") continue;
    ASSIGN_OR_RETURN(Attr a, Lookup(ino, part));
    ino = a.ino;
  }
  return GetAttr(ino);
}

}  // namespace ckptfs
