#include "indexer/index_store.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>

#include <nlohmann/json.hpp>
#include <rocksdb/db.h>
#include <rocksdb/options.h>

#include "indexer/file_table.h"

namespace ckptfs {
namespace {

using nlohmann::json;

// Key prefixes (docs/INDEX.md).
const char kMetaFormat[] = "meta/format";
const char kMetaRoot[] = "meta/root";
const char kMetaComplete[] = "meta/complete";
const char kFilePrefix[] = "file/";
const char kCkptPrefix[] = "ckpt/";
const char kTensorPrefix[] = "tensor/";

std::string Hex8(uint64_t v) {
  char buf[20];
  std::snprintf(buf, sizeof buf, "%08llx", static_cast<unsigned long long>(v));
  return buf;
}

// RocksDB writes a LOG file into the database directory unless given a
// logger; a read-only open must not write into a shared index.
class NullLogger : public rocksdb::Logger {
 public:
  using rocksdb::Logger::Logv;
  void Logv(const char*, va_list) override {}
};

Status FromRocks(const rocksdb::Status& s, const std::string& what) {
  if (s.ok()) return Status::OK();
  if (s.IsNotFound()) return Status::NotFound(what + ": " + s.ToString());
  if (s.IsCorruption()) return Status::Corruption(what + ": " + s.ToString());
  return Status::IOError(what + ": " + s.ToString());
}

json ChunkToJson(const Chunk& c) {
  json j = {{"offsets", c.shard.box.offsets},
            {"lengths", c.shard.box.lengths},
            {"file", c.bytes.file},
            {"offset", c.bytes.offset},
            {"length", c.bytes.length}};
  if (!c.basic.strides.empty()) j["strides"] = c.basic.strides;
  if (!c.unavailable.empty()) j["unavailable"] = c.unavailable;
  return j;
}

json TensorToJson(const TensorMeta& t) {
  json chunks = json::array();
  for (const Chunk& c : t.chunks) chunks.push_back(ChunkToJson(c));
  json j = {{"dtype", std::string(DTypeName(t.dtype))}, {"shape", t.shape}, {"chunks", chunks}};
  if (!t.problem.empty()) j["problem"] = t.problem;
  if (!t.path.empty()) j["path"] = t.path;
  return j;
}

Result<TensorMeta> TensorFromJson(const std::string& fqn, const json& j) {
  TensorMeta t;
  t.fqn = fqn;
  auto dtype = ParseDType(j.at("dtype").get<std::string>());
  if (!dtype) return Status::Corruption("index: tensor '" + fqn + "' has an unknown dtype");
  t.dtype = *dtype;
  t.shape = j.at("shape").get<Shape>();
  t.problem = j.value("problem", "");
  if (j.contains("path")) t.path = j["path"].get<std::vector<std::string>>();
  for (const json& cj : j.at("chunks")) {
    Chunk c;
    c.shard.fqn = fqn;
    c.shard.box.offsets = cj.at("offsets").get<std::vector<uint64_t>>();
    c.shard.box.lengths = cj.at("lengths").get<std::vector<uint64_t>>();
    c.bytes.file = cj.at("file").get<FileId>();
    c.bytes.offset = cj.at("offset").get<uint64_t>();
    c.bytes.length = cj.at("length").get<uint64_t>();
    c.basic.dtype = t.dtype;
    if (cj.contains("strides")) c.basic.strides = cj["strides"].get<std::vector<uint64_t>>();
    c.unavailable = cj.value("unavailable", "");
    t.chunks.push_back(std::move(c));
  }
  return t;
}

// Swaps `from` into `to` atomically when `to` exists, then removes the old.
Status RenameIntoPlace(const std::string& from, const std::string& to) {
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) == 0) {
    std::error_code ec;
    std::filesystem::remove_all(from, ec);
    return Status::OK();
  }
  if (errno != ENOENT && errno != EINVAL && errno != ENOSYS)
    return Status::IOError("rename " + from + " -> " + to + ": " + std::strerror(errno));
  if (::rename(from.c_str(), to.c_str()) != 0)
    return Status::IOError("rename " + from + " -> " + to + ": " + std::strerror(errno));
  return Status::OK();
}

}  // namespace

std::string DefaultIndexPath(const std::string& abs_root) {
  std::string base;
  if (const char* d = std::getenv("CKPTFS_INDEX_DIR"); d && *d) base = d;
  else if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) base = std::string(x) + "/ckptfs";
  else if (const char* h = std::getenv("HOME"); h && *h) base = std::string(h) + "/.cache/ckptfs";
  else base = "/tmp/ckptfs-" + std::to_string(::getuid());
  std::string name = std::filesystem::path(abs_root).filename().string();
  if (name.empty()) name = "root";
  // FNV-1a: stable across runs and builds (std::hash is not).
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : abs_root) h = (h ^ c) * 1099511628211ull;
  char buf[20];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return base + "/" + name + "-" + buf;
}

Status WriteIndex(const Catalog& catalog, const std::string& index_path) {
  std::error_code ec;
  std::filesystem::path target(index_path);
  if (target.has_parent_path()) std::filesystem::create_directories(target.parent_path(), ec);
  const std::string tmp = index_path + ".tmp." + std::to_string(::getpid());
  std::filesystem::remove_all(tmp, ec);

  rocksdb::Options options;
  options.create_if_missing = true;
  options.error_if_exists = true;
  options.compression = rocksdb::kNoCompression;
  rocksdb::DB* raw = nullptr;
  RETURN_IF_ERROR(FromRocks(rocksdb::DB::Open(options, tmp, &raw), "create index " + tmp));
  std::unique_ptr<rocksdb::DB> db(raw);

  rocksdb::WriteBatch batch;
  size_t tensors = 0, chunks = 0;
  batch.Put(kMetaFormat, json({{"schema", kIndexSchemaVersion}}).dump());
  batch.Put(kMetaRoot, catalog.root);
  for (size_t i = 0; i < catalog.files.size(); ++i) {
    const SourceFile& f = catalog.files[i];
    json fj = {{"path", f.path}, {"size", f.size}, {"mtime_ns", f.mtime_ns}, {"inode", f.inode}};
    if (f.derived()) fj["derived"] = {{"transform", f.transform}, {"base", f.base}, {"offset", f.base_offset},
                                      {"length", f.base_length}};
    batch.Put(kFilePrefix + Hex8(i), fj.dump());
  }
  for (size_t i = 0; i < catalog.checkpoints.size(); ++i) {
    const Checkpoint& c = catalog.checkpoints[i];
    json sidecars = json::object();
    for (const auto& [name, id] : c.sidecars) sidecars[name] = id;
    json byte_items = json::object();
    for (const auto& [key, b] : c.byte_items) byte_items[key] = {b.file, b.offset, b.length};
    batch.Put(kCkptPrefix + Hex8(i), json({{"dir", c.dir},
                                          {"format", c.format},
                                          {"sidecars", sidecars},
                                          {"file_index", c.file_index},
                                          {"byte_items", byte_items},
                                          {"problems", c.problems},
                                          {"incomplete", c.incomplete}})
                                         .dump());
    for (const auto& t : c.tensors) {
      batch.Put(kTensorPrefix + Hex8(i) + "/" + t->fqn, TensorToJson(*t).dump());
      ++tensors;
      chunks += t->chunks.size();
    }
  }
  RETURN_IF_ERROR(FromRocks(db->Write(rocksdb::WriteOptions(), &batch), "write index " + tmp));
  // The completion record goes last, in its own synced write: an index
  // without it is treated as never written.
  rocksdb::WriteOptions sync;
  sync.sync = true;
  json complete = {{"indexed_at_ns", catalog.indexed_at_ns},
                   {"files", catalog.files.size()},
                   {"checkpoints", catalog.checkpoints.size()},
                   {"tensors", tensors},
                   {"chunks", chunks}};
  RETURN_IF_ERROR(FromRocks(db->Put(sync, kMetaComplete, complete.dump()), "write index " + tmp));
  RETURN_IF_ERROR(FromRocks(db->Close(), "close index " + tmp));
  db.reset();
  return RenameIntoPlace(tmp, index_path);
}

Result<Catalog> LoadIndex(const std::string& index_path) {
  struct stat st;
  if (::stat(index_path.c_str(), &st) != 0)
    return Status::NotFound("no index at " + index_path + " (run `ckptfs index` first)");
  rocksdb::Options options;
  options.create_if_missing = false;
  options.info_log = std::make_shared<NullLogger>();
  rocksdb::DB* raw = nullptr;
  RETURN_IF_ERROR(FromRocks(rocksdb::DB::OpenForReadOnly(options, index_path, &raw),
                            "open index " + index_path));
  std::unique_ptr<rocksdb::DB> db(raw);
  std::string value;
  rocksdb::ReadOptions ro;
  if (!db->Get(ro, kMetaComplete, &value).ok())
    return Status::Corruption("index " + index_path + " is incomplete (indexing was interrupted); run `ckptfs index` again");
  Catalog catalog;
  try {
    json complete = json::parse(value);
    catalog.indexed_at_ns = complete.at("indexed_at_ns").get<int64_t>();
    RETURN_IF_ERROR(FromRocks(db->Get(ro, kMetaFormat, &value), "index format record"));
    if (json::parse(value).at("schema").get<int>() != kIndexSchemaVersion)
      return Status::Corruption("index " + index_path + " has schema " + value + ", this ckptfs reads " +
                                std::to_string(kIndexSchemaVersion) + "; run `ckptfs index` again");
    RETURN_IF_ERROR(FromRocks(db->Get(ro, kMetaRoot, &catalog.root), "index root record"));

    std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(ro));
    for (it->Seek(kFilePrefix); it->Valid() && it->key().starts_with(kFilePrefix); it->Next()) {
      json j = json::parse(it->value().ToString());
      SourceFile f;
      f.path = j.at("path");
      f.size = j.at("size");
      f.mtime_ns = j.at("mtime_ns");
      f.inode = j.at("inode");
      if (j.contains("derived")) {
        const json& d = j["derived"];
        f.transform = d.at("transform");
        f.base = d.at("base");
        f.base_offset = d.at("offset");
        f.base_length = d.at("length");
      }
      catalog.files.push_back(std::move(f));
    }
    for (it->Seek(kCkptPrefix); it->Valid() && it->key().starts_with(kCkptPrefix); it->Next()) {
      json j = json::parse(it->value().ToString());
      Checkpoint c;
      c.dir = j.at("dir");
      c.format = j.at("format");
      for (auto& [name, id] : j.at("sidecars").items()) c.sidecars[name] = id.get<FileId>();
      c.file_index = j.at("file_index").get<std::map<std::string, int>>();
      const json items = j.value("byte_items", json::object());
      for (auto& [key, b] : items.items())
        c.byte_items[key] = ByteMeta{b.at(0).get<FileId>(), b.at(1).get<uint64_t>(), b.at(2).get<uint64_t>()};
      c.problems = j.at("problems").get<std::vector<std::string>>();
      c.incomplete = j.at("incomplete");
      catalog.checkpoints.push_back(std::move(c));
    }
    for (it->Seek(kTensorPrefix); it->Valid() && it->key().starts_with(kTensorPrefix); it->Next()) {
      std::string key = it->key().ToString();
      size_t slash = key.find('/', sizeof(kTensorPrefix) - 1);
      size_t ckpt = std::stoull(key.substr(sizeof(kTensorPrefix) - 1, 8), nullptr, 16);
      if (slash == std::string::npos || ckpt >= catalog.checkpoints.size())
        return Status::Corruption("index: malformed tensor key '" + key + "'");
      ASSIGN_OR_RETURN(TensorMeta t, TensorFromJson(key.substr(slash + 1), json::parse(it->value().ToString())));
      for (const Chunk& c : t.chunks)
        if (c.bytes.file >= catalog.files.size())
          return Status::Corruption("index: tensor '" + t.fqn + "' refers to an unknown file");
      catalog.checkpoints[ckpt].tensors.push_back(std::make_shared<const TensorMeta>(std::move(t)));
    }
    RETURN_IF_ERROR(FromRocks(it->status(), "read index " + index_path));
  } catch (const std::exception& e) {
    return Status::Corruption("index " + index_path + " is malformed: " + e.what());
  }
  return catalog;
}

Status CheckSources(const Catalog& catalog) {
  std::string changed;
  int count = 0;
  for (const SourceFile& f : catalog.files) {
    if (f.derived()) continue;  // its base file is checked
    auto now = StatSource(catalog.root + "/" + f.path);
    std::string what = now.ok() ? DescribeChange(f, *now) : now.status().message();
    if (what.empty()) continue;
    if (++count <= 3) changed += (changed.empty() ? "" : "; ") + f.path + ": " + what;
  }
  if (count == 0) return Status::OK();
  if (count > 3) changed += "; and " + std::to_string(count - 3) + " more";
  return Status::Stale(std::to_string(count) + " source file(s) changed since indexing (" + changed +
                       "); run `ckptfs index` again");
}

}  // namespace ckptfs
