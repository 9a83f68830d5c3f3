#include "fs/virtual_fs.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/planner.h"

namespace ckptfs {

FsError FsError::From(const Status& s) {
  switch (s.code()) {
    case Status::Code::kOk: return FsError();
    case Status::Code::kNotFound: return FsError(ENOENT, s.message());
    case Status::Code::kInvalidArgument: return FsError(EINVAL, s.message());
    default: return FsError(EIO, s.ToString());
  }
}

bool Attr::is_dir() const { return S_ISDIR(mode); }

struct VirtualFs::Node {
  enum class Kind { kSourceDir, kSourceFile, kVirtualDir, kVirtualFile };
  Kind kind;
  uint64_t ino = 0;
  uint64_t parent = 0;
  std::string name;
  std::string rel;                              // source kinds
  std::shared_ptr<const Layout> layout;         // virtual file
  std::string problem;                          // virtual file that cannot be served
  std::map<std::string, uint64_t> children;     // virtual entries (in any dir)
  int mesh_ckpt = -1;                           // a mesh/ dir: its checkpoint's index

  bool is_dir() const { return kind == Kind::kSourceDir || kind == Kind::kVirtualDir; }
  bool is_source() const { return kind == Kind::kSourceDir || kind == Kind::kSourceFile; }
};

struct VirtualFs::Handle {
  const Node* node;
  int fd = -1;  // source files
};

namespace {

std::string Join(const std::string& dir, const std::string& name) {
  return dir.empty() ? name : dir + "/" + name;
}

int64_t MtimeNs(const struct stat& st) {
  return int64_t(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec;
}

}  // namespace

VirtualFs::VirtualFs(Catalog catalog, FsOptions options)
    : catalog_(std::move(catalog)), options_(std::move(options)) {
  reader_ = std::make_unique<SourceReader>(&catalog_);
  auto root = std::make_unique<Node>();
  root->kind = Node::Kind::kSourceDir;
  root->ino = kRootIno;
  root->parent = kRootIno;
  nodes_.push_back(std::move(root));
  source_inos_[""] = kRootIno;
}

VirtualFs::~VirtualFs() = default;

Result<std::unique_ptr<VirtualFs>> VirtualFs::Create(Catalog catalog, FsOptions options) {
  std::unique_ptr<VirtualFs> fs(new VirtualFs(std::move(catalog), std::move(options)));
  RETURN_IF_ERROR(fs->BuildViews());
  return fs;
}

void VirtualFs::Log(const std::string& line) const {
  if (options_.log) options_.log(line);
}

Status VirtualFs::BuildViews() {
  for (const Checkpoint& ckpt : catalog_.checkpoints) {
    auto files = ConsolidatedView(ckpt, catalog_.files, options_.consolidated);
    if (!files.ok()) {
      // One bad checkpoint must not hide the others: log and go on.
      Log(Join(ckpt.dir, "consolidated") + ": not created: " + files.status().message());
      continue;
    }
    Node* dir = SourceNode(ckpt.dir, /*is_dir=*/true);
    Node* view = AddVirtual(dir, "consolidated", /*is_dir=*/true);
    for (ViewFile& f : *files) {
      Node* n = AddVirtual(view, f.name, /*is_dir=*/false);
      n->layout = std::move(f.layout);
      n->problem = std::move(f.problem);
    }
    if (auto npy = TensorsView(ckpt); npy.ok()) {
      Node* tensors = AddVirtual(dir, "tensors", /*is_dir=*/true);
      for (ViewFile& f : *npy) {
        Node* n = AddVirtual(tensors, f.name, /*is_dir=*/false);
        n->layout = std::move(f.layout);
      }
    } else {
      Log(Join(ckpt.dir, "tensors") + ": not created: " + npy.status().message());
    }
    if (auto items = BytesView(ckpt); !items.empty()) {
      Node* bytes = AddVirtual(dir, "bytes", /*is_dir=*/true);
      for (ViewFile& f : items) AddVirtual(bytes, f.name, /*is_dir=*/false)->layout = std::move(f.layout);
    }
    auto rules = RulesFor(ckpt);
    if (!rules.ok()) {
      Log(Join(ckpt.dir, "mesh") + ": not created: " + rules.status().message());
      continue;
    }
    Node* mesh = AddVirtual(dir, "mesh", /*is_dir=*/true);
    mesh->mesh_ckpt = &ckpt - catalog_.checkpoints.data();
    Node* readme = AddVirtual(mesh, "README", /*is_dir=*/false);
    Layout text;
    text.AddLiteral(MeshReadme(*rules));
    readme->layout = std::make_shared<const Layout>(std::move(text));
  }
  return Status::OK();
}

// The preset for the checkpoint's model family (config.json's model_type,
// else its tensor names), with the --rules file's rules first.
Result<ShardingRules> VirtualFs::RulesFor(const Checkpoint& ckpt) const {
  std::string model_type;
  if (auto it = ckpt.sidecars.find("config.json"); it != ckpt.sidecars.end()) {
    std::ifstream f(catalog_.root + "/" + catalog_.files[it->second].path);
    std::stringstream text;
    text << f.rdbuf();
    auto j = nlohmann::json::parse(text.str(), nullptr, false);
    if (j.is_object() && j.contains("model_type") && j["model_type"].is_string()) model_type = j["model_type"];
  }
  std::vector<std::string> names;
  if (auto weights = ModelWeights(ckpt, options_.consolidated); weights.ok())
    for (const auto& w : *weights) names.push_back(w.entry_name());
  ShardingRules rules = PresetRules(model_type, names);
  if (options_.rules_json.empty()) return rules;
  return LoadRulesFile(options_.rules_json, std::move(rules));
}

// Builds mesh/<spec>/rank-NNNNN/ on first lookup. ENOENT, with a log line
// saying why, for a spec that is malformed or impossible for the checkpoint.
FsResult<uint64_t> VirtualFs::OpenMesh(Node* mesh_dir, const std::string& name) {
  const Checkpoint& ckpt = catalog_.checkpoints[mesh_dir->mesh_ckpt];
  const std::string where = Join(ckpt.dir, "mesh/" + name);
  auto fail = [&](const std::string& why) {
    Log(where + ": " + why);
    return FsError(ENOENT, where + ": " + why);
  };
  auto spec = ParseMeshSpec(name);
  if (!spec.ok()) return fail(spec.status().message());
  if (spec->name != name) return fail("not the canonical name; open mesh/" + spec->name);
  auto rules = RulesFor(ckpt);
  if (!rules.ok()) return fail(rules.status().message());
  Status possible = CheckMeshSpec(ckpt, *spec, *rules);
  if (!possible.ok()) return fail(possible.message());
  std::vector<std::vector<ViewFile>> ranks;
  for (uint64_t r = 0; r < spec->world(); ++r) {
    auto files = MeshRankView(ckpt, catalog_.files, *spec, r, *rules, options_.consolidated);
    if (!files.ok()) return fail(files.status().message());
    ranks.push_back(std::move(*files));
  }
  std::unique_lock lock(mu_);
  if (auto it = mesh_dir->children.find(name); it != mesh_dir->children.end()) return it->second;
  Node* dir = AddVirtual(mesh_dir, name, /*is_dir=*/true);
  for (uint64_t r = 0; r < ranks.size(); ++r) {
    char rank_name[32];
    std::snprintf(rank_name, sizeof rank_name, "rank-%05llu", static_cast<unsigned long long>(r));
    Node* rank_dir = AddVirtual(dir, rank_name, /*is_dir=*/true);
    for (ViewFile& f : ranks[r]) {
      Node* n = AddVirtual(rank_dir, f.name, /*is_dir=*/false);
      n->layout = std::move(f.layout);
      n->problem = std::move(f.problem);
    }
  }
  return dir->ino;
}

// REQUIRES: construction time, or mu_ held exclusively.
VirtualFs::Node* VirtualFs::AddVirtual(Node* parent, const std::string& name, bool is_dir) {
  auto n = std::make_unique<Node>();
  n->kind = is_dir ? Node::Kind::kVirtualDir : Node::Kind::kVirtualFile;
  n->ino = nodes_.size() + 1;
  n->parent = parent->ino;
  n->name = name;
  parent->children[name] = n->ino;
  nodes_.push_back(std::move(n));
  return nodes_.back().get();
}

// Returns the node for source path `rel`, creating it (and its parents).
VirtualFs::Node* VirtualFs::SourceNode(const std::string& rel, bool is_dir) {
  {
    std::shared_lock lock(mu_);
    if (auto it = source_inos_.find(rel); it != source_inos_.end()) return nodes_[it->second - 1].get();
  }
  uint64_t parent = kRootIno;
  if (auto slash = rel.rfind('/'); slash != std::string::npos)
    parent = SourceNode(rel.substr(0, slash), true)->ino;
  std::unique_lock lock(mu_);
  if (auto it = source_inos_.find(rel); it != source_inos_.end()) return nodes_[it->second - 1].get();
  auto n = std::make_unique<Node>();
  n->kind = is_dir ? Node::Kind::kSourceDir : Node::Kind::kSourceFile;
  n->ino = nodes_.size() + 1;
  n->parent = parent;
  n->rel = rel;
  n->name = rel.substr(rel.rfind('/') == std::string::npos ? 0 : rel.rfind('/') + 1);
  source_inos_[rel] = n->ino;
  nodes_.push_back(std::move(n));
  return nodes_.back().get();
}

VirtualFs::Node* VirtualFs::Find(uint64_t ino) const {
  std::shared_lock lock(mu_);
  if (ino == 0 || ino > nodes_.size()) return nullptr;
  return nodes_[ino - 1].get();
}

std::string VirtualFs::PathOf(const Node& n) const {
  if (n.is_source()) return n.rel;
  const Node* p = Find(n.parent);
  return p ? Join(PathOf(*p), n.name) : n.name;
}

FsResult<Attr> VirtualFs::AttrOf(const Node& n) const {
  Attr a;
  a.ino = n.ino;
  a.uid = options_.uid;
  a.gid = options_.gid;
  if (n.is_source()) {
    struct stat st;
    std::string abs = n.rel.empty() ? catalog_.root : catalog_.root + "/" + n.rel;
    if (::stat(abs.c_str(), &st) != 0) return FsError(errno, n.rel + ": " + std::strerror(errno));
    a.mode = (st.st_mode & ~0222u);
    a.size = st.st_size;
    a.nlink = S_ISDIR(st.st_mode) ? 2 : 1;
    a.mtime_ns = MtimeNs(st);
    a.uid = st.st_uid;
    a.gid = st.st_gid;
    return a;
  }
  a.is_virtual = true;
  a.mtime_ns = catalog_.indexed_at_ns;
  if (n.kind == Node::Kind::kVirtualDir) {
    a.mode = S_IFDIR | 0555;
    a.nlink = 2;
  } else {
    a.mode = S_IFREG | 0444;
    a.size = n.layout->size();
  }
  return a;
}

FsResult<Attr> VirtualFs::Lookup(uint64_t parent, const std::string& name) {
  Node* p = Find(parent);
  if (!p) return FsError(ENOENT, "unknown inode " + std::to_string(parent));
  if (!p->is_dir()) return FsError(ENOTDIR, PathOf(*p) + " is not a directory");
  if (name == "." ) return AttrOf(*p);
  if (name == "..") return GetAttr(p->parent);
  if (p->kind == Node::Kind::kSourceDir) {
    const std::string rel = Join(p->rel, name);
    struct stat st;
    if (::stat((catalog_.root + "/" + rel).c_str(), &st) == 0 &&
        (S_ISDIR(st.st_mode) || S_ISREG(st.st_mode)))
      return AttrOf(*SourceNode(rel, S_ISDIR(st.st_mode)));
  }
  uint64_t child = 0;
  {
    std::shared_lock lock(mu_);
    auto it = p->children.find(name);
    if (it != p->children.end()) child = it->second;
  }
  if (!child && p->mesh_ckpt >= 0) {
    ASSIGN_OR_RETURN(child, OpenMesh(p, name));
  }
  if (!child) return FsError(ENOENT, Join(PathOf(*p), name) + ": no such file or directory");
  return AttrOf(*Find(child));
}

FsResult<Attr> VirtualFs::GetAttr(uint64_t ino) {
  Node* n = Find(ino);
  if (!n) return FsError(ENOENT, "unknown inode " + std::to_string(ino));
  return AttrOf(*n);
}

FsResult<std::vector<DirEntry>> VirtualFs::ReadDir(uint64_t ino) {
  Node* p = Find(ino);
  if (!p) return FsError(ENOENT, "unknown inode " + std::to_string(ino));
  if (!p->is_dir()) return FsError(ENOTDIR, PathOf(*p) + " is not a directory");
  std::vector<DirEntry> out;
  if (p->kind == Node::Kind::kSourceDir) {
    std::string abs = p->rel.empty() ? catalog_.root : catalog_.root + "/" + p->rel;
    DIR* d = ::opendir(abs.c_str());
    if (!d) return FsError(errno, p->rel + ": " + std::strerror(errno));
    std::vector<std::string> names;
    while (struct dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name != "." && name != "..") names.push_back(name);
    }
    ::closedir(d);
    for (const std::string& name : names) {
      auto a = Lookup(ino, name);
      if (a.ok()) out.push_back({name, *a});  // skips sockets, dangling links
    }
  }
  std::map<std::string, uint64_t> children;
  {
    std::shared_lock lock(mu_);
    children = p->children;
  }
  for (const auto& [name, child] : children) {
    bool shadowed = std::any_of(out.begin(), out.end(), [&](const DirEntry& e) { return e.name == name; });
    if (shadowed) continue;
    auto a = AttrOf(*Find(child));
    if (a.ok()) out.push_back({name, *a});
  }
  std::sort(out.begin(), out.end(), [](const DirEntry& a, const DirEntry& b) { return a.name < b.name; });
  return out;
}

FsResult<uint64_t> VirtualFs::Open(uint64_t ino, int flags) {
  Node* n = Find(ino);
  if (!n) return FsError(ENOENT, "unknown inode " + std::to_string(ino));
  if ((flags & O_ACCMODE) != O_RDONLY || (flags & (O_TRUNC | O_CREAT | O_APPEND)))
    return FsError(EROFS, PathOf(*n) + ": read-only file system");
  if (n->is_dir()) return FsError(EISDIR, PathOf(*n) + " is a directory");
  auto h = std::make_unique<Handle>();
  h->node = n;
  if (n->kind == Node::Kind::kSourceFile) {
    h->fd = ::open((catalog_.root + "/" + n->rel).c_str(), O_RDONLY | O_CLOEXEC);
    if (h->fd < 0) return FsError(errno, n->rel + ": " + std::strerror(errno));
  }
  return reinterpret_cast<uint64_t>(h.release());
}

FsResult<size_t> VirtualFs::Read(uint64_t handle, char* buf, size_t size, uint64_t offset) {
  const Handle* h = reinterpret_cast<const Handle*>(handle);
  const Node& n = *h->node;
  if (n.kind == Node::Kind::kSourceFile) {
    size_t done = 0;
    while (done < size) {
      ssize_t r = ::pread(h->fd, buf + done, size - done, offset + done);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) return FsError(errno, n.rel + ": " + std::strerror(errno));
      if (r == 0) break;
      done += r;
    }
    return done;
  }
  auto fail = [&](const FsError& e) {
    Log(PathOf(n) + ": read of " + std::to_string(size) + " bytes at " + std::to_string(offset) +
        " failed (" + std::strerror(e.err()) + "): " + e.message());
    return e;
  };
  if (!n.problem.empty()) return fail(FsError(EIO, "checkpoint incomplete: " + n.problem));
  auto plan = Plan(*n.layout, offset, size);
  if (!plan.ok()) return fail(FsError::From(plan.status()));
  Status st = reader_->Execute(*plan, buf);
  if (!st.ok()) return fail(FsError::From(st));
  return plan->length;
}

void VirtualFs::Release(uint64_t handle) {
  std::unique_ptr<Handle> h(reinterpret_cast<Handle*>(handle));
  if (h->fd >= 0) ::close(h->fd);
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
