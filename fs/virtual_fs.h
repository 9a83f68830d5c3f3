// VirtualFs: the tree a mount shows, with no FUSE in sight.
//
// The source tree is mirrored read-only (entries are looked up in the real
// directory on demand, so new files appear); next to each indexed checkpoint
// the views are injected as virtual directories (`consolidated/`, `mesh/`).
// Where a real entry has the same name as a virtual one, the real entry wins.
// `mesh/<spec>/` directories are made on first lookup of a valid spec.
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

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/layout.h"
#include "core/meta.h"
#include "core/views.h"
#include "fs/fs_error.h"
#include "indexer/source_reader.h"

namespace ckptfs {

struct FsOptions {
  ConsolidatedOptions consolidated;
  // Contents of a mesh rules file (`--rules`), or empty for the presets.
  std::string rules_json;
  uid_t uid = 0;
  gid_t gid = 0;
  // Receives one line per served error (EIO on a read, say) and per view
  // that could not be built. Must be thread-safe.
  std::function<void(const std::string&)> log;
};

struct Attr {
  uint64_t ino = 0;
  uint32_t mode = 0;  // S_IFDIR/S_IFREG | permission bits (never writable)
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

class VirtualFs {
 public:
  static constexpr uint64_t kRootIno = 1;

  // Builds the views of every checkpoint in `catalog`.
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

  // "model/consolidated/model.safetensors" -> its attributes ("" is the root).
  FsResult<Attr> Resolve(const std::string& path);

  const Catalog& catalog() const { return catalog_; }
  SourceReader& reader() { return *reader_; }

 private:
  struct Node;
  struct Handle;
  VirtualFs(Catalog catalog, FsOptions options);
  Status BuildViews();
  FsResult<uint64_t> OpenMesh(Node* mesh_dir, const std::string& spec_name);
  Result<ShardingRules> RulesFor(const Checkpoint& ckpt) const;
  Node* Find(uint64_t ino) const;
  Node* SourceNode(const std::string& rel, bool is_dir);
  Node* AddVirtual(Node* parent, const std::string& name, bool is_dir);
  FsResult<Attr> AttrOf(const Node& n) const;
  std::string PathOf(const Node& n) const;
  void Log(const std::string& line) const;

  Catalog catalog_;
  FsOptions options_;
  std::unique_ptr<SourceReader> reader_;
  mutable std::shared_mutex mu_;                     // guards nodes_, source_inos_
  std::vector<std::unique_ptr<Node>> nodes_;         // ino - 1 -> node
  std::unordered_map<std::string, uint64_t> source_inos_;
};

}  // namespace ckptfs
