// Where a store lives and how it is opened: the marker, the writer lock,
// schema 1 and damaged stores rebuilt, read-only opens beside a live writer.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>

#include <nlohmann/json.hpp>
#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include "indexer/index_store.h"
#include "indexer/store_internal.h"
#include "source/posix_io.h"

namespace ckptfs {
namespace store_internal {
namespace {

// RocksDB writes a LOG file into the database directory unless given a
// logger; a read-only open must write nothing into a shared store, and the
// writer's log would only repeat what ckptfs reports itself.
class NullLogger : public rocksdb::Logger {
 public:
  using rocksdb::Logger::Logv;
  void Logv(const char*, va_list) override {}
};

}  // namespace

Status FromRocks(const rocksdb::Status& s, const std::string& what) {
  if (s.ok()) return Status::OK();
  if (s.IsNotFound() || s.IsPathNotFound()) return Status::NotFound(what + ": " + s.ToString());
  if (s.IsCorruption()) return Status::Corruption(what + ": " + s.ToString());
  return Status::IOError(what + ": " + s.ToString());
}


rocksdb::Options StoreOptions() {
  rocksdb::Options o;
  o.info_log = std::make_shared<NullLogger>();
  // Packed tensor rows still repeat much (fqn prefixes, ranks, neighbouring
  // offsets): LZ4 takes 1M chunks from 19.2 MB to 7.4 MB, with no
  // measurable change in load time (docs/BENCHMARKS.md).
  o.compression = rocksdb::kLZ4Compression;
  return o;
}

}  // namespace store_internal

namespace {

using nlohmann::json;
using store_internal::FromRocks;
using store_internal::StoreOptions;
namespace fs = std::filesystem;

std::string Join(const std::string& dir, const char* name) { return dir + "/" + name; }

// What `--index` points at.
enum class Place { kAbsent, kEmptyDir, kStore, kV1Index, kFile, kForeign };

bool IsV1Index(const std::string& path) {
  if (::access(Join(path, "CURRENT").c_str(), F_OK) != 0) return false;
  rocksdb::DB* raw = nullptr;
  if (!rocksdb::DB::OpenForReadOnly(StoreOptions(), path, &raw).ok()) return false;
  std::unique_ptr<rocksdb::DB> db(raw);
  std::string value;
  if (!db->Get(rocksdb::ReadOptions(), rows::kFormatKey, &value).ok()) return false;
  json j = json::parse(value, nullptr, false);
  return j.is_object() && j.value("schema", 0) == 1;
}

Place Classify(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return errno == ENOENT ? Place::kAbsent : Place::kForeign;
  if (!S_ISDIR(st.st_mode)) return Place::kFile;
  if (::access(Join(path, kStoreMarker).c_str(), F_OK) == 0) return Place::kStore;
  std::error_code ec;
  if (fs::is_empty(path, ec) && !ec) return Place::kEmptyDir;
  return IsV1Index(path) ? Place::kV1Index : Place::kForeign;
}

Status RefusePlace(Place p, const std::string& path) {
  if (p == Place::kFile)
    return Status::InvalidArgument("index location " + path +
                                   " is a file, not an index directory; give --index a new or empty directory");
  return Status::InvalidArgument("index location " + path + " is a directory that is not a ckptfs index (it has no " +
                                 kStoreMarker + " file) and is not empty; ckptfs writes only into its own index "
                                 "directories: give --index a new or empty directory");
}

Status WriteMarker(const std::string& dir, const std::string& root) {
  const std::string path = Join(dir, kStoreMarker);
  const std::string text = json({{"schema", kIndexSchemaVersion}, {"root", root}}).dump() + "\n";
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError(path + ": " + std::strerror(errno));
  bool ok = ::write(fd, text.data(), text.size()) == ssize_t(text.size()) && ::fsync(fd) == 0;
  int err = errno;
  ::close(fd);
  if (!ok) return Status::IOError(path + ": " + std::strerror(err));
  return Status::OK();
}

// The root a marker names; "" when the marker cannot be read (a creation
// killed while writing it).
std::string MarkerRoot(const std::string& dir) {
  std::string text(4096, '\0');
  int fd = ::open(Join(dir, kStoreMarker).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  ssize_t n = ::read(fd, text.data(), text.size());
  ::close(fd);
  json j = json::parse(text.substr(0, n > 0 ? n : 0), nullptr, false);
  return j.is_object() && j.contains("root") && j["root"].is_string() ? j["root"].get<std::string>() : "";
}

// flock() on writer.pid: released by the kernel when the holder dies, so a
// killed writer never leaves the store locked.
Result<int> LockWriter(const std::string& dir) {
  const std::string path = Join(dir, kStorePidFile);
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError(path + ": " + std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    char buf[32] = {};
    ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
    ::close(fd);
    std::string pid = n > 0 ? std::string(buf, n) : "?";
    while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
    return Status::Busy("index " + dir + " is in use by process " + pid +
                        " (a mount or another `ckptfs index`); unmount it or wait for it to finish");
  }
  const std::string text = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, text.data(), text.size(), 0) != ssize_t(text.size())) {
    int err = errno;
    ::close(fd);
    return Status::IOError(path + ": " + std::strerror(err));
  }
  return fd;
}

// Schema 1 built each index in `<index>.tmp.<pid>` and renamed it into
// place; a killed build left that directory behind. Those of dead processes
// are removed with DestroyDB, which deletes only RocksDB's own files (and
// then the directory if nothing else is in it).
std::vector<std::string> RemoveStaleTemps(const std::string& index_path) {
  std::vector<std::string> removed;
  fs::path p(index_path);
  const std::string prefix = p.filename().string() + ".tmp.";
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(p.has_parent_path() ? p.parent_path() : ".", ec)) {
    const std::string name = e.path().filename().string();
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string digits = name.substr(prefix.size());
    if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    pid_t pid = pid_t(std::strtol(digits.c_str(), nullptr, 10));
    if (pid <= 0 || ::kill(pid, 0) == 0 || errno != ESRCH || !e.is_directory(ec)) continue;
    if (!rocksdb::DestroyDB(e.path().string(), StoreOptions()).ok()) continue;
    if (!fs::exists(e.path(), ec)) removed.push_back(e.path().string());
  }
  return removed;
}

// What a read-only open reads first: the manifest CURRENT names, and its
// size. The writer appends to that manifest before it deletes any file (a
// flushed write-ahead log, a compacted table), so an open that finds the
// same stamp before and after itself saw one consistent state; with another
// stamp it may have missed rows of a deleted log or a deleted table.
std::string ManifestStamp(const std::string& path) {
  std::ifstream current(Join(path, "CURRENT"));
  std::string manifest;
  if (!std::getline(current, manifest) || manifest.empty()) return "";
  struct stat st;
  if (::stat((path + "/" + manifest).c_str(), &st) != 0) return "";
  return manifest + ":" + std::to_string(st.st_size);
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

Result<std::unique_ptr<Store>> Store::Open(const std::string& index_path, const std::string& abs_root,
                                           Access access) {
  const Place place = Classify(index_path);
  if (place == Place::kFile || place == Place::kForeign) return RefusePlace(place, index_path);
  if (place == Place::kStore) {
    const std::string owner = MarkerRoot(index_path);
    if (!owner.empty() && owner != abs_root)
      return Status::InvalidArgument("index " + index_path + " belongs to " + owner + ", not " + abs_root +
                                     "; give another --index, or delete it to index " + abs_root + " there");
  }
  std::unique_ptr<Store> store(new Store(index_path, abs_root, access));
  if (access == Access::kReadOnly) {
    if (place == Place::kAbsent || place == Place::kEmptyDir)
      return Status::NotFound("no index at " + index_path + " (run `ckptfs index` first)");
    if (place == Place::kV1Index)
      return Status::NotFound("index " + index_path + " was built by an older ckptfs (schema 1); `ckptfs index` rebuilds it");
    RETURN_IF_ERROR(store->OpenReadOnly());
    return store;
  }
  std::error_code ec;
  if (place == Place::kAbsent && (fs::create_directories(index_path, ec), ec))
    return Status::IOError("create index directory " + index_path + ": " + ec.message());
  // The marker first: from here on the directory is recognisably ours, so a
  // run killed at any later point leaves something the next run may clean.
  if (place != Place::kStore || MarkerRoot(index_path).empty()) RETURN_IF_ERROR(WriteMarker(index_path, abs_root));
  ASSIGN_OR_RETURN(store->lock_fd_, LockWriter(index_path));
  for (const std::string& gone : RemoveStaleTemps(index_path))
    store->notices_.push_back("removed " + gone + ", left behind by an interrupted `ckptfs index`");
  if (place == Place::kV1Index) {
    RETURN_IF_ERROR(FromRocks(rocksdb::DestroyDB(index_path, StoreOptions()), "remove schema 1 index " + index_path));
    store->rebuilt_from_v1_ = true;
    store->notices_.push_back("index " + index_path + " was built by an older ckptfs (schema 1); rebuilding it");
  }
  RETURN_IF_ERROR(store->OpenReadWrite());
  return store;
}

Store::Store(std::string path, std::string root, Access access)
    : path_(std::move(path)), root_(std::move(root)), access_(access) {}

Store::~Store() {
  if (db_ && access_ == Access::kReadWrite) {
    (void)Flush();
    (void)db_->Close();
  }
  db_.reset();
  if (lock_fd_ >= 0) {
    // An empty pid file: nobody holds the store.
    (void)!::ftruncate(lock_fd_, 0);
    ::close(lock_fd_);
  }
}

Status Store::OpenDatabase() {
  rocksdb::Options options = StoreOptions();
  options.create_if_missing = true;
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(options, path_, &raw);
  if (s.ok()) db_.reset(raw);
  return FromRocks(s, "open index " + path_);
}

Status Store::OpenReadWrite() {
  Status s = OpenDatabase();
  // The directory carries our marker, so whatever it holds is a cache of the
  // source root: a database that cannot be opened is rebuilt, not fatal.
  if (s.code() == Status::Code::kCorruption || s.code() == Status::Code::kNotFound)
    return Rebuild("its database could not be opened (" + s.message() + ")");
  RETURN_IF_ERROR(s);
  return CheckSchema();
}

Status Store::CheckSchema() {
  std::string value, root;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), rows::kFormatKey, &value);
  if (s.IsNotFound()) {
    rocksdb::WriteBatch b;
    b.Put(rows::kFormatKey, json({{"schema", kIndexSchemaVersion}}).dump());
    b.Put(rows::kRootKey, root_);
    rocksdb::WriteOptions sync;
    sync.sync = true;
    return FromRocks(db_->Write(sync, &b), "initialise index " + path_);
  }
  RETURN_IF_ERROR(FromRocks(s, "read index " + path_));
  json j = json::parse(value, nullptr, false);
  int schema = j.is_object() ? j.value("schema", 0) : 0;
  if (schema == 1) {
    rebuilt_from_v1_ = true;
    return Rebuild("it was built by an older ckptfs (schema 1)");
  }
  if (schema != kIndexSchemaVersion) return Rebuild("its format record is not schema 2");
  if (!db_->Get(rocksdb::ReadOptions(), rows::kRootKey, &root).ok() || root != root_)
    return Rebuild("its database names another root");
  return Status::OK();
}

Status Store::Rebuild(const std::string& why) {
  if (db_) (void)db_->Close();
  db_.reset();
  RETURN_IF_ERROR(FromRocks(rocksdb::DestroyDB(path_, StoreOptions()), "remove damaged index " + path_));
  notices_.push_back("index " + path_ + " rebuilt: " + why);
  RETURN_IF_ERROR(OpenDatabase());
  return CheckSchema();
}

Status Store::VerifyChecksums() {
  if (access_ == Access::kReadWrite) RETURN_IF_ERROR(Flush());
  std::shared_lock lock(mu_);
  rocksdb::ReadOptions read;
  read.fill_cache = false;  // each block is read once: it would only evict others
  return FromRocks(db_->VerifyChecksum(read), "verify index " + path_);
}

Result<bool> Store::RebuildIfDamaged() {
  if (access_ != Access::kReadWrite) return Status::InvalidArgument("index " + path_ + " is open read-only");
  Status s = VerifyChecksums();
  if (s.ok()) return false;
  if (s.code() != Status::Code::kCorruption) return s;
  // Open refused every directory without our marker: this one is ours.
  std::unique_lock lock(mu_);
  RETURN_IF_ERROR(Rebuild("its database is damaged (" + s.message() + ")"));
  return true;
}

Status Store::OpenReadOnly() {
  constexpr int kAttempts = 40;  // ~4 s of a writer that never pauses
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    const std::string before = ManifestStamp(path_);
    if (before.empty() && ::access(Join(path_, "CURRENT").c_str(), F_OK) != 0)
      return Status::NotFound("index " + path_ + " is still being created; run `ckptfs index` again");
    Status s = OpenReadOnlyOnce();
    if (!before.empty() && ManifestStamp(path_) == before) return s;
    db_.reset();
    ::usleep(std::min(1000 << attempt, 100000));
  }
  return Status::Busy("index " + path_ + " changed during each of " + std::to_string(kAttempts) +
                      " tries to open it; its writer (a mount or `ckptfs index`) is busy, try again");
}

Status Store::OpenReadOnlyOnce() {
  rocksdb::DB* raw = nullptr;
  RETURN_IF_ERROR(FromRocks(rocksdb::DB::OpenForReadOnly(StoreOptions(), path_, &raw), "open index " + path_));
  std::unique_ptr<rocksdb::DB> db(raw);
  std::string value, root;
  rocksdb::Status f = db->Get(rocksdb::ReadOptions(), rows::kFormatKey, &value);
  json j = json::parse(f.ok() ? value : "", nullptr, false);
  if (!j.is_object() || j.value("schema", 0) != kIndexSchemaVersion)
    return Status::NotFound("index " + path_ + " is not initialised or of another schema; `ckptfs index` rebuilds it");
  if (!db->Get(rocksdb::ReadOptions(), rows::kRootKey, &root).ok() || root != root_)
    return Status::InvalidArgument("index " + path_ + " belongs to " + root + ", not " + root_);
  db_ = std::move(db);
  return Status::OK();
}

Status Store::CatchUp() {
  if (access_ == Access::kReadWrite) return Status::OK();
  std::unique_ptr<Store> fresh(new Store(path_, root_, access_));
  RETURN_IF_ERROR(fresh->OpenReadOnly());
  std::unique_lock lock(mu_);
  db_ = std::move(fresh->db_);
  return Status::OK();
}

}  // namespace ckptfs
