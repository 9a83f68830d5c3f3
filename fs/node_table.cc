#include "fs/node_table.h"

#include <algorithm>
#include <mutex>

#include "source/source.h"

namespace ckptfs {

NodeTable::NodeTable() {
  auto root = std::make_shared<FsNode>();
  root->kind = NodeKind::kSourceDir;
  root->ino = kRootIno;
  root->parent = kRootIno;
  nodes_[kRootIno] = std::move(root);
  source_inos_[""] = kRootIno;
}

std::shared_ptr<FsNode> NodeTable::Find(uint64_t ino) const {
  std::shared_lock lock(mu_);
  auto it = nodes_.find(ino);
  return it == nodes_.end() ? nullptr : it->second;
}

FsNode* NodeTable::NodeLocked(uint64_t ino) const {
  auto it = nodes_.find(ino);
  return it == nodes_.end() ? nullptr : it->second.get();
}

FsNode* NodeTable::SourceNode(const std::string& rel, NodeKind kind) {
  {
    std::shared_lock lock(mu_);
    if (auto it = source_inos_.find(rel); it != source_inos_.end()) return NodeLocked(it->second);
  }
  uint64_t parent = kRootIno;
  if (auto slash = rel.rfind('/'); slash != std::string::npos)
    parent = SourceNode(rel.substr(0, slash), NodeKind::kSourceDir)->ino;
  std::unique_lock lock(mu_);
  if (auto it = source_inos_.find(rel); it != source_inos_.end()) {
    // The same path may have become another kind (a file replaced by a link).
    NodeLocked(it->second)->kind = kind;
    return NodeLocked(it->second);
  }
  auto n = std::make_shared<FsNode>();
  n->kind = kind;
  n->ino = next_ino_++;
  n->parent = parent;
  n->rel = rel;
  n->name = rel.substr(rel.rfind('/') == std::string::npos ? 0 : rel.rfind('/') + 1);
  source_inos_[rel] = n->ino;
  nodes_[n->ino] = n;
  return n.get();
}

// An existing child of that name and kind is reused: a checkpoint loaded
// again keeps its inode numbers.
FsNode* NodeTable::AddVirtual(FsNode* parent, const std::string& name, bool is_dir, int ckpt) {
  if (auto it = parent->children.find(name); it != parent->children.end()) {
    FsNode* old = NodeLocked(it->second);
    if (old && old->ckpt == ckpt && old->is_dir() == is_dir) return old;
  }
  auto n = std::make_shared<FsNode>();
  n->ckpt = ckpt;
  n->kind = is_dir ? NodeKind::kVirtualDir : NodeKind::kVirtualFile;
  n->ino = next_ino_++;
  n->parent = parent->ino;
  n->name = name;
  parent->children[name] = n->ino;
  nodes_[n->ino] = n;
  return n.get();
}

// A name with '/' (a sidecar folder such as sentence-transformers'
// 1_Pooling/config.json) gets its directories.
void NodeTable::AddViewFile(FsNode* view, ViewFile f, int ckpt, std::shared_ptr<MergedSources> sources) {
  FsNode* dir = view;
  for (size_t at = 0, slash; (slash = f.name.find('/', at)) != std::string::npos; at = slash + 1) {
    const std::string part = f.name.substr(at, slash - at);
    auto it = dir->children.find(part);
    dir = it != dir->children.end() ? NodeLocked(it->second) : AddVirtual(dir, part, /*is_dir=*/true, ckpt);
  }
  FsNode* n = AddVirtual(dir, f.name.substr(f.name.rfind('/') + 1), /*is_dir=*/false, ckpt);
  // A node filled again after an unload is read meanwhile without the lock
  // (AttrOf, Open): what a reload leaves as it was is not written.
  if (const uint64_t size = f.layout->size(); n->size != size) n->size = size;
  if (n->problem != f.problem) n->problem = std::move(f.problem);
  n->sources = std::move(sources);
  n->layout = std::move(f.layout);
}

void NodeTable::TakeViewsLocked(const std::string& dir, Detached* old) {
  auto it = source_inos_.find(dir);
  if (it == source_inos_.end()) return;
  FsNode* n = NodeLocked(it->second);
  for (const auto& [name, ino] : n->children) old->names.push_back(name);
  n->children.clear();
  n->ckpt = -1;
  old->dir_ino = n->ino;
}

// Its directories are emptied, so nothing reaches its nodes but the inode
// numbers the kernel holds (a lookup in one of them is ENOENT).
void NodeTable::DetachLocked(int ckpt) {
  for (auto it = nodes_.begin(); it != nodes_.end();) {
    FsNode& n = *it->second;
    if (n.is_source() || n.ckpt != ckpt) {
      ++it;
      continue;
    }
    n.detached = true;
    n.children.clear();
    it = n.nlookup == 0 ? nodes_.erase(it) : std::next(it);
  }
}

void NodeTable::DropLayoutsLocked(int ckpt, std::vector<std::shared_ptr<const Layout>>* out) {
  for (const auto& [ino, n] : nodes_) {
    if (n->ckpt != ckpt) continue;
    if (n->layout) out->push_back(std::move(n->layout));
    n->sources.reset();
    n->built = false;
  }
}

void NodeTable::Forget(uint64_t ino, uint64_t nlookup) {
  std::unique_lock lock(mu_);
  auto it = nodes_.find(ino);
  if (it == nodes_.end()) return;
  FsNode& n = *it->second;
  n.nlookup -= std::min<uint64_t>(nlookup, n.nlookup);
  if (n.nlookup == 0 && n.detached) nodes_.erase(it);
}

std::vector<uint64_t> NodeTable::Select(const std::function<bool(const FsNode&)>& pred) const {
  std::vector<uint64_t> inos;
  std::shared_lock lock(mu_);
  for (const auto& [ino, n] : nodes_)
    if (pred(*n)) inos.push_back(ino);
  return inos;
}

std::string NodeTable::PathOf(const FsNode& n) const {
  if (n.is_source()) return n.rel;
  std::shared_ptr<const FsNode> p = Find(n.parent);
  return p ? JoinRel(PathOf(*p), n.name) : n.name;
}

size_t NodeTable::size() const {
  std::shared_lock lock(mu_);
  return nodes_.size();
}

}  // namespace ckptfs
