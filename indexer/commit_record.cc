#include "indexer/commit_record.h"

#include <climits>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <tuple>
#include <unistd.h>

#include "indexer/index_store.h"
#include "indexer/scan.h"

namespace ckptfs {
namespace {

// A file's path inside its checkpoint directory.
std::string InDir(const Checkpoint& ckpt, FileId id) {
  const std::string& p = ckpt.files.at(id).path;
  return ckpt.dir.empty() ? p : p.substr(ckpt.dir.size() + 1);
}

// Where a chunk's bytes are and what they hold, comparable across two file tables.
using ChunkKey = std::tuple<std::string, uint64_t, uint64_t, std::vector<uint64_t>, std::vector<uint64_t>, DType>;

ChunkKey KeyOf(const Checkpoint& ckpt, const Chunk& c) {
  Box box = c.box();
  return {InDir(ckpt, c.file()), c.offset(), c.length(), box.offsets, box.lengths, c.dtype()};
}

std::string Describe(const ChunkKey& k) {
  return std::get<0>(k) + " bytes [" + std::to_string(std::get<1>(k)) + ", " +
         std::to_string(std::get<1>(k) + std::get<2>(k)) + ") as " + std::string(DTypeName(std::get<5>(k)));
}

// The recorded checksum of each of `t`'s chunks, in order, or why the record's `r` disagrees with it.
Result<std::vector<uint32_t>> MatchChunks(const Checkpoint& record, const TensorMeta& r, const Checkpoint& scanned,
                                          const TensorMeta& t) {
  if (r.dtype != t.dtype || r.shape != t.shape)
    return Status::InvalidArgument("tensor '" + t.fqn + "': the record says " + std::string(DTypeName(r.dtype)) +
                                   ShapeToString(r.shape) + ", the files " + std::string(DTypeName(t.dtype)) +
                                   ShapeToString(t.shape));
  if (r.chunks.size() != t.chunks.size())
    return Status::InvalidArgument("tensor '" + t.fqn + "': the record has " + std::to_string(r.chunks.size()) +
                                   " chunk(s), the files " + std::to_string(t.chunks.size()));
  std::map<ChunkKey, const Chunk*> recorded;
  for (const Chunk& c : r.chunks) recorded[KeyOf(record, c)] = &c;
  std::vector<uint32_t> crcs;
  for (const Chunk& c : t.chunks) {
    ChunkKey key = KeyOf(scanned, c);
    auto it = recorded.find(key);
    if (it == recorded.end() || !it->second->has_crc32c() || !c.strides().empty())
      return Status::InvalidArgument("tensor '" + t.fqn + "': the record has no checksummed chunk at " +
                                     Describe(key) + " where the files have one");
    crcs.push_back(it->second->crc32c());
  }
  return crcs;
}

// The commit record at `rel`: read in place on a local root; an object
// store's is copied to a temporary file first, because RocksDB reads an
// SST file only from a filesystem.
Result<Checkpoint> ReadRecordOf(const Source& source, const std::string& rel, const std::string& sst) {
  const std::string local = source.LocalPath(rel);
  if (!local.empty()) return ReadCommitRecord(local);
  ASSIGN_OR_RETURN(std::string bytes, source.ReadWhole(rel));
  const char* tmpdir = std::getenv("TMPDIR");
  std::string tmp = std::string(tmpdir && *tmpdir ? tmpdir : "/tmp") + "/ckptfs-commit-XXXXXX";
  int fd = ::mkstemp(tmp.data());
  if (fd < 0) return Status::IOError("copy " + sst + ": cannot create " + tmp + ": " + std::strerror(errno));
  bool written = ::write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size());
  ::close(fd);
  Result<Checkpoint> record = written ? ReadCommitRecord(tmp)
                                      : Result<Checkpoint>(Status::IOError("copy " + sst + " to " + tmp +
                                                                           ": write failed (is the disk full?)"));
  ::unlink(tmp.c_str());
  if (!record.ok()) return record.status().WithContext(sst);
  return record;
}

// The files a record is judged by, relative to the root: DCP's .metadata,
// the save's commit point, when the directory has one; else every file the
// record describes and every data file the scan read (a re-save by another
// writer rewrites at least one of them). Never the sidecars: a config.json,
// tokenizer or README written next to the shards after the save is not a
// new save.
std::set<std::string> SaveFiles(const Source& source, const Checkpoint& record, const Checkpoint& scanned) {
  const std::string metadata = JoinRel(scanned.dir, ".metadata");
  if (source.ModifyTimeNs(metadata)) return {metadata};
  std::set<FileId> sidecars;
  for (const auto& [name, id] : scanned.sidecars) sidecars.insert(id);
  std::set<std::string> out;
  for (FileId id = 0; id < record.files.size(); ++id) out.insert(JoinRel(scanned.dir, InDir(record, id)));
  for (FileId id = 0; id < scanned.files.size(); ++id)
    if (!sidecars.count(id) && !scanned.files[id].derived()) out.insert(scanned.files[id].path);
  return out;
}

// True when the record was written no earlier than the save it describes
// (modification times, so a copy that keeps them keeps its record; a file
// of the record that is gone is for ApplyCommitRecord to find).
bool RecordIsCurrentFor(const Source& source, const std::string& rel, const Checkpoint& record,
                        const Checkpoint& scanned) {
  auto written = source.ModifyTimeNs(rel);
  if (!written) return false;
  for (const std::string& f : SaveFiles(source, record, scanned))
    if (source.ModifyTimeNs(f).value_or(INT64_MIN) > *written) return false;
  return true;
}

}  // namespace

Status ApplyCommitRecord(const Checkpoint& record, Checkpoint& scanned) {
  std::map<std::string, const TensorMeta*> by_fqn;
  for (const auto& t : record.tensors) by_fqn[t->fqn] = t.get();
  if (by_fqn.size() != scanned.tensors.size()) {
    for (const auto& t : scanned.tensors)
      if (!by_fqn.count(t->fqn)) return Status::InvalidArgument("tensor '" + t->fqn + "' is in the files, not in the record");
    return Status::InvalidArgument("the record has " + std::to_string(by_fqn.size()) + " tensors, the files " +
                                   std::to_string(scanned.tensors.size()));
  }
  std::vector<std::vector<uint32_t>> crcs;
  for (const auto& t : scanned.tensors) {
    auto it = by_fqn.find(t->fqn);
    if (it == by_fqn.end()) return Status::InvalidArgument("tensor '" + t->fqn + "' is in the files, not in the record");
    ASSIGN_OR_RETURN(auto c, MatchChunks(record, *it->second, scanned, *t));
    crcs.push_back(std::move(c));
  }
  std::map<std::string, const SourceFile*> files;
  for (FileId id = 0; id < record.files.size(); ++id) files[InDir(record, id)] = &record.files[id];
  // Everything agrees: only now is `scanned` changed.
  for (size_t i = 0; i < scanned.tensors.size(); ++i) {
    auto t = std::make_shared<TensorMeta>(*scanned.tensors[i]);
    for (size_t c = 0; c < t->chunks.size(); ++c) t->chunks[c].set_crc32c(crcs[i][c]);
    scanned.tensors[i] = std::move(t);
  }
  for (FileId id = 0; id < scanned.files.size(); ++id) {
    auto it = files.find(InDir(scanned, id));
    if (it == files.end() || !it->second->has_rest_crc32c || scanned.files[id].derived()) continue;
    scanned.files[id].rest_crc32c = it->second->rest_crc32c;
    scanned.files[id].has_rest_crc32c = true;
  }
  return Status::OK();
}

Status UseCommitRecord(const Source& source, Checkpoint& ckpt) {
  const std::string rel = CommitRecordRel(ckpt.dir);
  const std::string sst = CommitRecordPath(source.root(), ckpt.dir);
  if (!source.ModifyTimeNs(rel)) return Status::NotFound(sst + ": no commit record");
  // Only a record that really lies in this checkpoint (no symlink out of it);
  // an object store has no links.
  if (const std::string local = source.LocalPath(rel); !local.empty()) {
    char real[PATH_MAX];
    if (!::realpath(local.c_str(), real) || local != real)
      return Status::InvalidArgument("it is reached through a symlink");
  }
  ASSIGN_OR_RETURN(Checkpoint record, ReadRecordOf(source, rel, sst));
  if (!RecordIsCurrentFor(source, rel, record, ckpt))
    return Status::Stale("it is older than the save the directory holds (another writer saved into it since)");
  Status applied = ApplyCommitRecord(record, ckpt);
  return applied.ok() ? applied : applied.WithContext("it disagrees with the files");
}

}  // namespace ckptfs
