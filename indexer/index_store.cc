#include "indexer/index_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <ostream>

#include <nlohmann/json.hpp>
#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/sst_file_reader.h>
#include <rocksdb/sst_file_writer.h>
#include <rocksdb/table_properties.h>
#include <rocksdb/write_batch.h>

#include "source/posix_source.h"

namespace ckptfs {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// RocksDB writes a LOG file into the database directory unless given a
// logger; a read-only open must write nothing into a shared store, and the
// writer's log would only repeat what ckptfs reports itself.
class NullLogger : public rocksdb::Logger {
 public:
  using rocksdb::Logger::Logv;
  void Logv(const char*, va_list) override {}
};

Status FromRocks(const rocksdb::Status& s, const std::string& what) {
  if (s.ok()) return Status::OK();
  if (s.IsNotFound() || s.IsPathNotFound()) return Status::NotFound(what + ": " + s.ToString());
  if (s.IsCorruption()) return Status::Corruption(what + ": " + s.ToString());
  return Status::IOError(what + ": " + s.ToString());
}

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
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

// Positions `it` at the commit record of `dir` and decodes it; NotFound
// when the checkpoint has none.
Result<CheckpointEntry> SeekCommitRecord(rocksdb::Iterator& it, const std::string& dir, const std::string& path) {
  const std::string key = rows::CommitKey(dir);
  it.Seek(key);
  if (!it.Valid() || it.key() != key) {
    RETURN_IF_ERROR(FromRocks(it.status(), "read index " + path));
    return Status::NotFound("checkpoint '" + dir + "' is not in index " + path);
  }
  return rows::DecodeCommitRecord(key, it.value().ToStringView());
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

std::vector<CheckpointEntry> Store::List() const {
  std::shared_lock lock(mu_);
  std::vector<CheckpointEntry> out;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  for (it->Seek(rows::kCommitPrefix); it->Valid() && it->key().starts_with(rows::kCommitPrefix); it->Next()) {
    auto e = rows::DecodeCommitRecord(it->key().ToStringView(), it->value().ToStringView());
    if (e.ok()) {
      out.push_back(std::move(*e));
    } else {
      out.emplace_back();
      out.back().dir = *rows::DirOfCommitKey(it->key().ToStringView());
    }
  }
  return out;
}

Result<Checkpoint> Store::Load(const std::string& dir) const {
  std::shared_lock lock(mu_);
  // One iterator reads the commit record and the rows from one snapshot.
  // The rows are decoded once and kept by the caller: their blocks would
  // only fill the block cache (~19 MB uncompressed for 1M chunks).
  rocksdb::ReadOptions read;
  read.fill_cache = false;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(read));
  ASSIGN_OR_RETURN(CheckpointEntry entry, SeekCommitRecord(*it, dir, path_));
  rows::CheckpointDecoder decoder(entry, /*strict=*/false);
  const std::string end = rows::DataEnd(dir);
  for (it->Seek(rows::DataBegin(dir)); it->Valid() && it->key().compare(end) < 0; it->Next())
    RETURN_IF_ERROR(decoder.Add(it->key().ToStringView(), it->value().ToStringView()).WithContext("index " + path_));
  RETURN_IF_ERROR(FromRocks(it->status(), "read index " + path_));
  auto ckpt = decoder.Finish();
  if (!ckpt.ok()) return ckpt.status().WithContext("index " + path_);
  return ckpt;
}

Result<std::vector<SourceFile>> Store::LoadFiles(const std::string& dir) const {
  std::shared_lock lock(mu_);
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  ASSIGN_OR_RETURN(CheckpointEntry entry, SeekCommitRecord(*it, dir, path_));
  rows::CheckpointDecoder decoder(entry, /*strict=*/false);
  const std::string prefix = rows::FilesPrefix(dir);
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next())
    RETURN_IF_ERROR(decoder.Add(it->key().ToStringView(), it->value().ToStringView()).WithContext("index " + path_));
  RETURN_IF_ERROR(FromRocks(it->status(), "read index " + path_));
  return decoder.TakeFiles();
}

Status Store::WriteRows(const std::vector<rows::Row>& rows, const std::string& dir, bool replace) {
  if (access_ != Access::kReadWrite) return Status::InvalidArgument("index " + path_ + " is open read-only");
  rocksdb::WriteBatch batch;
  if (replace) {
    // Tombstones only where there are rows, so adding checkpoints does not
    // pile them up.
    std::string value;
    if (db_->Get(rocksdb::ReadOptions(), rows::CommitKey(dir), &value).ok()) batch.Delete(rows::CommitKey(dir));
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
    it->Seek(rows::DataBegin(dir));
    if (it->Valid() && it->key().compare(rows::DataEnd(dir)) < 0)
      batch.DeleteRange(rows::DataBegin(dir), rows::DataEnd(dir));
  }
  for (const rows::Row& r : rows) batch.Put(r.key, r.value);
  if (batch.Count() == 0) return Status::OK();
  // Not synced and not flushed here: a flush per commit costs ~25 ms of
  // fsyncs (24 small checkpoints: 0.7 s instead of 0.1 s). The batch is in
  // the write-ahead log, which survives a killed process and is replayed
  // whole or not at all; the memtable reaches SST files when it fills, when
  // the store closes, or at the next read-write open after a crash.
  return FromRocks(db_->Write(rocksdb::WriteOptions(), &batch), "write index " + path_);
}

Status Store::Flush() {
  rocksdb::FlushOptions fo;
  fo.wait = true;
  return FromRocks(db_->Flush(fo), "flush index " + path_);
}

Status Store::Commit(const Checkpoint& ckpt) {
  ASSIGN_OR_RETURN(std::vector<rows::Row> rows, rows::EncodeCheckpoint(ckpt, rows::kSourceScan, NowNs()));
  std::unique_lock lock(mu_);
  return WriteRows(rows, ckpt.dir, /*replace=*/true);
}

Status Store::Remove(const std::string& dir) {
  std::unique_lock lock(mu_);
  return WriteRows({}, dir, /*replace=*/true);
}

Status Store::WriteRowsWithoutCommitRecordForTesting(const Checkpoint& ckpt) {
  ASSIGN_OR_RETURN(std::vector<rows::Row> rows, rows::EncodeCheckpoint(ckpt, rows::kSourceScan, NowNs()));
  rows.pop_back();  // the commit record
  std::unique_lock lock(mu_);
  return WriteRows(rows, ckpt.dir, /*replace=*/true);
}

Result<std::vector<rows::Row>> Store::RawRows(const std::string& dir) const {
  std::shared_lock lock(mu_);
  std::vector<rows::Row> out;
  std::string value;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), rows::CommitKey(dir), &value);
  if (s.ok()) out.push_back({rows::CommitKey(dir), value});
  else if (!s.IsNotFound()) return FromRocks(s, "read index " + path_);
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  const std::string end = rows::DataEnd(dir);
  for (it->Seek(rows::DataBegin(dir)); it->Valid() && it->key().compare(end) < 0; it->Next())
    out.push_back({it->key().ToString(), it->value().ToString()});
  RETURN_IF_ERROR(FromRocks(it->status(), "read index " + path_));
  return out;
}

Status Store::Dump(std::ostream& out) const {
  std::shared_lock lock(mu_);
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  for (it->SeekToFirst(); it->Valid(); it->Next())
    out << rows::RowToJson(it->key().ToStringView(), it->value().ToStringView()).dump() << "\n";
  return FromRocks(it->status(), "read index " + path_);
}

namespace {

// Every row of an SST file, its block checksums verified. Deletions are
// refused: ingesting one would remove rows the file does not show.
Result<std::vector<rows::Row>> ReadSst(const std::string& path) {
  rocksdb::SstFileReader reader(StoreOptions());
  RETURN_IF_ERROR(FromRocks(reader.Open(path), "open commit record " + path));
  RETURN_IF_ERROR(FromRocks(reader.VerifyChecksum(), "commit record " + path));
  auto props = reader.GetTableProperties();
  if (!props || props->num_deletions != 0 || props->num_range_deletions != 0 || props->num_merge_operands != 0)
    return Status::Corruption("commit record " + path + " holds deletions or merges; a commit record only adds rows");
  std::unique_ptr<rocksdb::Iterator> it(reader.NewIterator(rocksdb::ReadOptions()));
  std::vector<rows::Row> out;
  for (it->SeekToFirst(); it->Valid(); it->Next()) out.push_back({it->key().ToString(), it->value().ToString()});
  RETURN_IF_ERROR(FromRocks(it->status(), "read commit record " + path));
  if (out.size() != props->num_entries) return Status::Corruption("commit record " + path + " has unreadable rows");
  return out;
}

// The checkpoint a writer's rows describe, checked as untrusted input: one
// commit record, every other row inside that checkpoint's key range.
Result<Checkpoint> DecodeCommitRows(const std::vector<rows::Row>& all, CheckpointEntry* entry) {
  const rows::Row* record = nullptr;
  for (const rows::Row& r : all) {
    if (!r.key.starts_with(rows::kCommitPrefix)) continue;
    if (record) return Status::Corruption("two commit records");
    record = &r;
  }
  if (!record) return Status::Corruption("no commit record row");
  ASSIGN_OR_RETURN(*entry, rows::DecodeCommitRecord(record->key, record->value));
  rows::CheckpointDecoder decoder(*entry, /*strict=*/true);
  for (const rows::Row& r : all)
    if (&r != record) RETURN_IF_ERROR(decoder.Add(r.key, r.value));
  return decoder.Finish();
}

// Moves a checkpoint's file paths from under `from` to under `to`.
void Rebase(Checkpoint& ckpt, const std::string& from, const std::string& to) {
  for (SourceFile& f : ckpt.files) {
    std::string rest = from.empty() ? f.path : f.path.substr(from.size() + 1);
    f.path = to.empty() ? rest : to + "/" + rest;
  }
  ckpt.dir = to;
}

}  // namespace

Result<std::string> Store::DirForIngest(const std::string& sst_path, const std::string& named) const {
  static const std::string kSuffix = "/.ckptfs/commit.sst";
  char real[PATH_MAX];
  if (!::realpath(sst_path.c_str(), real)) return Status::IOError(sst_path + ": " + std::strerror(errno));
  std::string r = real;
  if (r.size() <= kSuffix.size() || r.compare(r.size() - kSuffix.size(), kSuffix.size(), kSuffix) != 0) return named;
  r.resize(r.size() - kSuffix.size());
  if (r == root_) return std::string();
  if (r.size() > root_.size() && r.compare(0, root_.size(), root_) == 0 && r[root_.size()] == '/')
    return r.substr(root_.size() + 1);
  return named;
}

Status Store::Ingest(const std::string& sst_path) {
  if (access_ != Access::kReadWrite) return Status::InvalidArgument("index " + path_ + " is open read-only");
  ASSIGN_OR_RETURN(std::vector<rows::Row> all, ReadSst(sst_path));
  CheckpointEntry entry;
  auto ckpt = DecodeCommitRows(all, &entry);
  if (!ckpt.ok()) return ckpt.status().WithContext("commit record " + sst_path);
  ASSIGN_OR_RETURN(std::string dir, DirForIngest(sst_path, entry.dir));
  std::unique_lock lock(mu_);
  if (dir != entry.dir) {
    // Written for another root (the writer saw /ckpts/run1, this store
    // indexes /ckpts): the same rows under this store's name for the dir.
    Rebase(*ckpt, entry.dir, dir);
    ASSIGN_OR_RETURN(std::vector<rows::Row> again, rows::EncodeCheckpoint(*ckpt, entry.source, entry.committed_at_ns));
    return WriteRows(again, dir, /*replace=*/true);
  }
  // Old rows go first: an ingested file only adds rows. A crash between the
  // two steps leaves the checkpoint absent, never mixed.
  RETURN_IF_ERROR(WriteRows({}, dir, /*replace=*/true));
  rocksdb::IngestExternalFileOptions io;
  io.move_files = false;  // the commit record stays with its checkpoint
  io.write_global_seqno = false;
  return FromRocks(db_->IngestExternalFile({sst_path}, io), "ingest " + sst_path + " into " + path_);
}

Result<Checkpoint> ReadCommitRecord(const std::string& sst_path) {
  ASSIGN_OR_RETURN(std::vector<rows::Row> all, ReadSst(sst_path));
  CheckpointEntry entry;
  auto ckpt = DecodeCommitRows(all, &entry);
  if (!ckpt.ok()) return ckpt.status().WithContext("commit record " + sst_path);
  return ckpt;
}

Status WriteCommitRecord(const std::string& abs_root, const Checkpoint& ckpt, const std::string& sst_path) {
  if (abs_root.empty() || (abs_root[0] != '/' && abs_root.rfind("s3://", 0) != 0))
    return Status::InvalidArgument("commit record: the source root must be an absolute path or an s3:// URL, not '" +
                                   abs_root + "'");
  ASSIGN_OR_RETURN(std::vector<rows::Row> all, rows::EncodeCheckpoint(ckpt, rows::kSourceWriter, NowNs()));
  std::sort(all.begin(), all.end(), [](const rows::Row& a, const rows::Row& b) { return a.key < b.key; });
  rocksdb::SstFileWriter writer(rocksdb::EnvOptions(), StoreOptions());
  RETURN_IF_ERROR(FromRocks(writer.Open(sst_path), "create commit record " + sst_path));
  for (const rows::Row& r : all) RETURN_IF_ERROR(FromRocks(writer.Put(r.key, r.value), "write commit record " + sst_path));
  return FromRocks(writer.Finish(), "finish commit record " + sst_path);
}

Status CheckSources(const std::string& root, const std::vector<SourceFile>& files) {
  return CheckSources(*PosixSourceAt(root), files);
}

Status CheckSources(const Source& source, const std::vector<SourceFile>& files) {
  std::string changed;
  int count = 0;
  for (const SourceFile& f : files) {
    if (f.derived()) continue;  // its base file is checked
    auto now = source.Identify(f.path);
    std::string what = now.ok() ? source.DescribeChange(f, *now) : now.status().message();
    if (what.empty()) continue;
    if (++count <= 3) changed += (changed.empty() ? "" : "; ") + f.path + ": " + what;
  }
  if (count == 0) return Status::OK();
  if (count > 3) changed += "; and " + std::to_string(count - 3) + " more";
  return Status::Stale(std::to_string(count) + " source file(s) changed since indexing (" + changed +
                       "); run `ckptfs index` again");
}

Status CheckSources(const Catalog& catalog) {
  std::vector<SourceFile> files;
  for (const Checkpoint& c : catalog.checkpoints) files.insert(files.end(), c.files.begin(), c.files.end());
  return CheckSources(catalog.root, files);
}

}  // namespace ckptfs
