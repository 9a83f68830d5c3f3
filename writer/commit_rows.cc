// Commit rows from what the ranks wrote (what and why: commit_rows.h).
#include "writer/commit_rows.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/coverage.h"
#include "core/crc32c.h"
#include "indexer/commit_record.h"
#include "indexer/torch_zip.h"
#include "source/posix_source.h"
#include "writer/stager.h"

namespace ckptfs {
namespace {

class FileIds {
 public:
  FileIds(const Source& source, std::string dir) : source_(source), dir_(std::move(dir)) {}
  // The indexer's own identity (POSIX: size, mtime, ctime, inode; S3: size
  // and ETag), so the store sees exactly what a scan would have recorded.
  Result<FileId> Get(const std::string& name) {
    const std::string rel = JoinRel(dir_, name);
    auto it = ids_.find(rel);
    if (it != ids_.end()) return it->second;
    ASSIGN_OR_RETURN(SourceFile f, source_.Identify(rel));
    f.path = rel;
    files_.push_back(std::move(f));
    return ids_[rel] = FileId(files_.size() - 1);
  }
  std::vector<SourceFile> Take() { return std::move(files_); }

 private:
  const Source& source_;
  std::string dir_;
  std::map<std::string, FileId> ids_;
  std::vector<SourceFile> files_;
};

// The CRC32C of every byte of `f` outside the tensor chunks (framing,
// headers, BYTE_IO items), read back now that the ranks have written and
// fsynced (or uploaded) it: a few small reads per item, so `verify` covers
// every byte the writer wrote and not only tensor data.
Status ChecksumTheRest(const Source& source, const Checkpoint& ckpt, FileId id, SourceFile& f) {
  ASSIGN_OR_RETURN(auto object, source.Open(f.path));
  uint32_t crc = 0;
  std::vector<char> buf;
  for (const ByteMeta& r : BytesOutsideChunks(ckpt, id, f.size)) {
    buf.resize(r.length);
    Status st = object->ReadAt(r.offset, r.length, buf.data());
    if (!st.ok())
      return st.WithContext("read back " + f.path + " bytes [" + std::to_string(r.offset) + ", " +
                            std::to_string(r.offset + r.length) + ")");
    crc = Crc32c(crc, buf.data(), r.length);
  }
  f.rest_crc32c = crc;
  f.has_rest_crc32c = true;
  return Status::OK();
}

// torch.float4_e2m1fn_x2: each element a byte of two E2M1 values.
constexpr std::string_view kFloat4x2 = "float4_e2m1fn_x2";

// The index's dtype for a written tensor, as a scan reads its files: a
// float4_e2m1fn_x2 tensor is F4 (indexer/dcp_metadata.h), a 0-d one has no
// F4 shape; a dtype without a safetensors equivalent (complex128,
// complex32) cannot be indexed. Such tensors are left out, as by the scan.
Result<DType> IndexedDType(const WrittenTensor& wt) {
  if (wt.dtype == kFloat4x2)
    return wt.shape.empty() ? Result<DType>(Status::NotSupported("a 0-d float4_e2m1fn_x2 has no F4 shape"))
                            : Result<DType>(DType::kF4);
  auto dtype = DTypeFromTorchName(wt.dtype);
  if (!dtype) return Status::NotSupported("dtype " + wt.dtype + " cannot be indexed");
  return *dtype;
}

// `dims` (a shape, or a box's offsets or sizes) with the last counted in
// values rather than torch elements of `unpack` values each.
std::vector<uint64_t> Unpacked(std::vector<uint64_t> dims, uint64_t unpack) {
  if (!dims.empty()) dims.back() *= unpack;
  return dims;
}

}  // namespace

Result<Checkpoint> BuildCommitRows(const std::string& abs_root, const WrittenCheckpoint& w) {
  return BuildCommitRows(PosixSource(abs_root), w);
}

Result<Checkpoint> BuildCommitRows(const Source& source, const WrittenCheckpoint& w) {
  Checkpoint out;
  out.dir = w.dir;
  out.format = w.format;
  FileIds ids(source, w.dir);
  std::map<std::string, std::vector<const WrittenChunk*>> by_fqn;
  for (const WrittenChunk& c : w.chunks) by_fqn[c.fqn].push_back(&c);
  std::vector<WrittenTensor> tensors = w.tensors;
  std::sort(tensors.begin(), tensors.end(), [](auto& a, auto& b) { return a.fqn < b.fqn; });
  for (const WrittenTensor& wt : tensors) {
    auto dtype = IndexedDType(wt);
    if (!dtype.ok()) {
      out.problems.push_back(wt.fqn + ": " + dtype.status().message() + "; left out of the commit");
      continue;
    }
    const uint64_t unpack = wt.dtype == kFloat4x2 ? 2 : 1;
    auto t = std::make_shared<TensorMeta>();
    t->fqn = wt.fqn;
    t->path = wt.path.empty() ? std::vector<std::string>{wt.fqn} : wt.path;
    t->dtype = *dtype;
    t->shape = Unpacked(wt.shape, unpack);
    auto chunks = by_fqn[wt.fqn];
    std::sort(chunks.begin(), chunks.end(), [](auto* a, auto* b) { return a->offsets < b->offsets; });
    for (const WrittenChunk* c : chunks) {
      ASSIGN_OR_RETURN(FileId file, ids.Get(c->file));
      Chunk ch(Box{Unpacked(c->offsets, unpack), Unpacked(c->sizes, unpack)}, {file, c->offset, c->length}, *dtype);
      ch.set_crc32c(c->crc32c);
      t->chunks.push_back(std::move(ch));
    }
    auto problems = CheckCoverage(*t);
    if (!problems.empty())
      return Status::InvalidArgument("refusing to commit " + (w.dir.empty() ? std::string(".") : w.dir) + ": " + problems.front());
    out.tensors.push_back(std::move(t));
  }
  for (const WrittenBytes& b : w.bytes) {
    ASSIGN_OR_RETURN(FileId id, ids.Get(b.file));
    out.byte_items[b.key] = ByteMeta{id, b.offset, b.length};
  }
  std::set<std::string> known;
  for (const auto& t : w.tensors) known.insert(t.fqn);
  for (const auto& [fqn, cs] : by_fqn)
    if (!known.count(fqn)) return Status::InvalidArgument("chunk of '" + fqn + "' names no tensor of the checkpoint");
  out.files = ids.Take();
  for (FileId id = 0; id < out.files.size(); ++id) RETURN_IF_ERROR(ChecksumTheRest(source, out, id, out.files[id]));
  return out;
}

Status WriteCommitRecordFile(const std::string& abs_root, const Checkpoint& ckpt) {
  const std::string dir = JoinRel(JoinRel(abs_root, ckpt.dir), ".ckptfs");
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) return Status::IOError("mkdir " + dir + ": " + std::strerror(errno));
  const std::string tmp = dir + "/commit.sst.tmp", final_path = dir + "/commit.sst";
  ::unlink(tmp.c_str());  // a crashed save's leftover
  RETURN_IF_ERROR(WriteCommitRecord(abs_root, ckpt, tmp));
  int fd = ::open(tmp.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::IOError("open " + tmp + ": " + std::strerror(errno));
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  if (!synced) return Status::IOError("fsync " + tmp + ": " + std::strerror(errno));
  if (::rename(tmp.c_str(), final_path.c_str()) != 0)
    return Status::IOError("rename " + tmp + " to commit.sst: " + std::strerror(errno));
  return SyncDir(dir);
}

Status PutCommitRecord(const S3Client& client, const Checkpoint& ckpt) {
  const char* tmpdir = std::getenv("TMPDIR");
  std::string tmp = std::string(tmpdir && *tmpdir ? tmpdir : "/tmp") + "/ckptfs-commit-XXXXXX";
  int fd = ::mkstemp(tmp.data());
  if (fd < 0) return Status::IOError("commit record: cannot create " + tmp + ": " + std::strerror(errno));
  ::close(fd);
  ::unlink(tmp.c_str());  // RocksDB creates it
  Status st = WriteCommitRecord(client.config().Root(), ckpt, tmp);
  std::string bytes;
  if (st.ok()) {
    std::ifstream in(tmp, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
    if (!in.good() && !in.eof()) st = Status::IOError("commit record: cannot read back " + tmp);
  }
  ::unlink(tmp.c_str());
  RETURN_IF_ERROR(st);
  const std::string key = client.config().location.prefix + JoinRel(ckpt.dir, ".ckptfs/commit.sst");
  return client.Put(key, S3Body{{{bytes.data(), bytes.size()}}});
}

Result<std::vector<WrittenChunk>> GatherWritten(Collective& c, const std::vector<WrittenChunk>& mine) {
  nlohmann::json j = nlohmann::json::array();
  for (const WrittenChunk& w : mine)
    j.push_back({{"fqn", w.fqn}, {"offsets", w.offsets}, {"sizes", w.sizes}, {"file", w.file},
                 {"offset", w.offset}, {"length", w.length}, {"crc32c", w.crc32c}});
  ASSIGN_OR_RETURN(auto all, c.AllGather(j.dump()));
  std::vector<WrittenChunk> out;
  try {
  for (size_t r = 0; r < all.size(); ++r) {
    auto parsed = nlohmann::json::parse(all[r], nullptr, false);
    if (parsed.is_discarded() || !parsed.is_array())
      return Status::Corruption("rank " + std::to_string(r) + " sent chunks that are not a JSON array");
    for (const auto& e : parsed) {
      WrittenChunk w;
      w.fqn = e.at("fqn");
      w.offsets = e.at("offsets").get<std::vector<uint64_t>>();
      w.sizes = e.at("sizes").get<std::vector<uint64_t>>();
      w.file = e.at("file");
      w.offset = e.at("offset");
      w.length = e.at("length");
      w.crc32c = e.at("crc32c");
      out.push_back(std::move(w));
    }
  }
  } catch (const nlohmann::json::exception& e) {
    return Status::Corruption(std::string("chunks from a rank lack a field: ") + e.what());
  }
  return out;
}

}  // namespace ckptfs
