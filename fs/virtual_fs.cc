#include "fs/virtual_fs.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <set>
#include <shared_mutex>

#include "core/views.h"
#include "source/posix_io.h"
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

namespace {

int64_t MtimeNs(const struct stat& st) {
  return int64_t(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec;
}

}  // namespace

VirtualFs::VirtualFs(FsOptions options, std::unique_ptr<SourceTree> tree, CheckpointLoader loader)
    : options_(std::move(options)),
      tree_(std::move(tree)),
      compute_(std::make_unique<ComputeCache>(options_.compute_cache_bytes)),
      ckpts_(options_, *tree_, std::move(loader), nodes_, *compute_,
             [this](int i, FsNode* dir) { return views_.Build(i, dir); }),
      views_(options_, *tree_, nodes_, ckpts_),
      files_(options_, *tree_, nodes_, ckpts_, views_, *compute_) {
  mounted_at_ns_ = WallClockNs();
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

void VirtualFs::AddCheckpoint(const std::string& dir, std::optional<Checkpoint> rows) {
  const bool eager = rows.has_value();
  Detached old;
  int prev;
  const int i = ckpts_.Host(dir, std::move(rows), &prev, &old);
  DropKernelEntries(old);
  if (prev >= 0) ckpts_.Unload(prev, /*wait=*/true);  // no file of it open: its rows go now
  // Rows handed over (a live checkpoint) are loaded now, so the watcher
  // checks their sources from the start.
  if (eager) (void)ckpts_.EnsureLoaded(i);
}

void VirtualFs::RemoveCheckpoint(const std::string& dir) {
  Detached old;
  const int i = ckpts_.Unhost(dir, &old);
  if (i < 0) return;
  compute_->Drop(i);  // nothing new can look them up
  DropKernelEntries(old);
  ckpts_.Unload(i, /*wait=*/true);
}

FsResult<uint64_t> VirtualFs::Open(uint64_t ino, int flags) { return files_.Open(ino, flags); }

FsResult<size_t> VirtualFs::Read(uint64_t handle, char* buf, size_t size, uint64_t offset) {
  return files_.Read(handle, buf, size, offset);
}

FsResult<ScatterReply> VirtualFs::ReadScatter(uint64_t handle, size_t size, uint64_t offset) {
  return files_.ReadScatter(handle, size, offset);
}

void VirtualFs::Release(uint64_t handle) { files_.Release(handle); }

size_t VirtualFs::RecheckSources() { return files_.RecheckSources(); }

std::vector<std::string> VirtualFs::FetchReport() const {
  std::vector<std::string> lines;
  for (int i : ckpts_.Live()) {
    const Served* s = ckpts_.ServedAt(i);
    if (s->counters->fetched.load() == 0 && s->counters->served.load() == 0) continue;
    lines.push_back((s->dir.empty() ? std::string(".") : s->dir) + ": " + s->counters->Describe());
  }
  std::sort(lines.begin(), lines.end());
  if (options_.read.hold) lines.push_back(options_.read.hold->Describe());
  return lines;
}

std::vector<std::string> VirtualFs::CheckpointDirs(bool stale_only) const { return ckpts_.Dirs(stale_only); }

size_t VirtualFs::ServedCount() const { return ckpts_.size(); }

void VirtualFs::Forget(uint64_t ino, uint64_t nlookup) { nodes_.Forget(ino, nlookup); }

void VirtualFs::DropKernelEntries(const Detached& old) const {
  if (!old.dir_ino || !options_.invalidate_entry) return;
  for (const std::string& name : old.names) options_.invalidate_entry(old.dir_ino, name);
}

std::vector<LoadedCheckpoint> VirtualFs::LoadAll() {
  std::vector<LoadedCheckpoint> out;
  for (const std::string& dir : CheckpointDirs()) {
    const int i = ckpts_.IndexOf(dir);
    if (i < 0 || !ckpts_.EnsureLoaded(i).ok()) continue;
    Served* s = ckpts_.ServedAt(i);
    out.push_back({&s->ckpt, s->reader.get()});
  }
  return out;
}

size_t VirtualFs::NodeCount() const { return nodes_.size(); }

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
  const ViewAccess& access = ckpts_.ServedAt(n.ckpt)->access;
  a.uid = access.uid;
  a.gid = access.gid;
  if (n.kind == NodeKind::kVirtualDir) {
    a.mode = access.dir_mode();
    a.nlink = 2;
  } else {
    a.mode = access.file_mode();
    a.size = n.size;
  }
  return a;
}

FsResult<Attr> VirtualFs::Lookup(uint64_t parent, const std::string& name, bool for_kernel) {
  std::shared_ptr<Node> p = nodes_.Find(parent);
  if (!p) return FsError(ENOENT, "unknown inode " + std::to_string(parent));
  if (!p->is_dir()) return FsError(ENOTDIR, nodes_.PathOf(*p) + " is not a directory");
  if (name == "." ) return AttrOf(*p);
  if (name == "..") return GetAttr(p->parent);
  if (p->kind == NodeKind::kSourceDir) {
    const std::string rel = JoinRel(p->rel, name);
    if (auto st = tree_->Lstat(rel); st.ok()) {
      if (S_ISDIR(st->st_mode)) return AttrOf(*nodes_.SourceNode(rel, NodeKind::kSourceDir));
      if (S_ISREG(st->st_mode)) return AttrOf(*nodes_.SourceNode(rel, NodeKind::kSourceFile));
      if (S_ISLNK(st->st_mode)) return AttrOf(*nodes_.SourceNode(rel, NodeKind::kSourceLink));
    }
  }
  Status load_error;
  CheckpointSet::Pin pin = ckpts_.PinViewsOf(*p, &load_error);
  ckpts_.Touch(p->ckpt);
  ASSIGN_OR_RETURN(uint64_t child, views_.Child(p.get(), name));
  // A view of a checkpoint that cannot be loaded exists; it cannot be served.
  if (!child && !load_error.ok() && ParseViewName(name)) return FsError(EIO, load_error.message());
  if (!child) return FsError(ENOENT, JoinRel(nodes_.PathOf(*p), name) + ": no such file or directory");
  std::shared_ptr<Node> c = nodes_.Find(child);
  if (!c) return FsError(ESTALE, JoinRel(nodes_.PathOf(*p), name) + ": its checkpoint was replaced or removed");
  ASSIGN_OR_RETURN(Attr a, AttrOf(*c));
  if (for_kernel) {
    std::shared_lock lock(nodes_.mu());  // Forget() erases under it exclusively
    if (!nodes_.NodeLocked(child)) return FsError(ESTALE, JoinRel(nodes_.PathOf(*p), name) + ": its checkpoint was removed");
    ++c->nlookup;
  }
  return a;
}

FsResult<Attr> VirtualFs::GetAttr(uint64_t ino) {
  std::shared_ptr<Node> n = nodes_.Find(ino);
  if (!n) return FsError(ENOENT, "unknown inode " + std::to_string(ino));
  return AttrOf(*n);
}

FsResult<std::vector<DirEntry>> VirtualFs::ReadDir(uint64_t ino) {
  std::shared_ptr<Node> p = nodes_.Find(ino);
  if (!p) return FsError(ENOENT, "unknown inode " + std::to_string(ino));
  if (!p->is_dir()) return FsError(ENOTDIR, nodes_.PathOf(*p) + " is not a directory");
  std::vector<DirEntry> out;
  if (p->kind == NodeKind::kSourceDir) {
    ASSIGN_OR_RETURN(std::vector<std::string> names, tree_->List(p->rel));
    for (const std::string& name : names) {
      auto a = Lookup(ino, name);
      if (a.ok()) out.push_back({name, *a});  // skips sockets, dangling links
    }
  }
  CheckpointSet::Pin pin = ckpts_.PinViewsOf(*p);
  if (FsError e = views_.EnsureFilled(p.get()); !e.ok()) return e;
  // Inodes only (a virtual dir may hold 100k files): a node and its name
  // live as long as the VirtualFs.
  std::vector<uint64_t> children;
  {
    std::shared_lock lock(nodes_.mu());
    children.reserve(p->children.size());
    for (const auto& [name, child] : p->children) children.push_back(child);
  }
  std::set<std::string> real;  // a real entry shadows a virtual one of its name
  for (const DirEntry& e : out) real.insert(e.name);
  out.reserve(out.size() + children.size());
  for (uint64_t child : children) {
    std::shared_ptr<const Node> c = nodes_.Find(child);
    if (!c || real.count(c->name)) continue;  // gone: its checkpoint was removed meanwhile
    auto a = AttrOf(*c);
    if (a.ok()) out.push_back({c->name, *a});
  }
  std::sort(out.begin(), out.end(), [](const DirEntry& a, const DirEntry& b) { return a.name < b.name; });
  return out;
}

FsResult<std::string> VirtualFs::ReadLink(uint64_t ino) {
  std::shared_ptr<Node> n = nodes_.Find(ino);
  if (!n) return FsError(ENOENT, "unknown inode " + std::to_string(ino));
  if (n->kind != NodeKind::kSourceLink) return FsError(EINVAL, nodes_.PathOf(*n) + " is not a symlink");
  return tree_->ReadLink(n->rel);
}

std::vector<std::string> VirtualFs::SourceDirs() const {
  std::set<std::string> dirs;
  for (int i : ckpts_.Live()) {
    Served* s = ckpts_.ServedAt(i);
    dirs.insert(s->dir);
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
