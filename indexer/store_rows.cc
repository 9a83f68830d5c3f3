#include "indexer/store_rows.h"

#include "indexer/dcp_item.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <unordered_set>

namespace ckptfs::rows {
namespace {

using nlohmann::json;

// Tags after "d/<dir>\0"; their order (f < h < t < v) is the scan order, so a
// decoder has the file table before the first chunk that refers to it.
constexpr char kFileTag = 'f';
constexpr char kHeaderTag = 'h';
constexpr char kTensorTag = 't';
constexpr char kMappingTag = 'v';

// Leading byte of a tensor value; a later layout gets a new number, so that
// a binary that predates it refuses the row ("unknown row layout") instead
// of misreading it. Layout 2 is layout 1 plus the kPredicted chunk flag: a
// tensor with no predicted chunk is still written as 1, readable by every
// binary.
constexpr uint8_t kTensorLayout = 1, kTensorLayoutPredicted = 2;
// Chunk flags.
// kPredicted (layout 2 only): the chunk's ByteMeta is a prediction
// (ItemCheck, core/meta.h), its item's offset and length follow; the check
// is settled again after every load.
constexpr uint8_t kHasStrides = 1, kHasUnavailable = 2, kHasCrc = 4, kPredicted = 8;
constexpr uint8_t KnownFlags(uint8_t layout) {
  return kHasStrides | kHasUnavailable | kHasCrc | (layout == kTensorLayoutPredicted ? kPredicted : 0);
}

// Appends LEB128 varints and length-prefixed strings. A chunk's box, byte
// range and file id are small integers: 1M chunks of rank 2 take ~12 bytes
// each this way against ~90 as JSON.
class Writer {
 public:
  void U8(uint8_t v) { out_.push_back(char(v)); }
  void Var(uint64_t v) {
    while (v >= 0x80) {
      out_.push_back(char(v | 0x80));
      v >>= 7;
    }
    out_.push_back(char(v));
  }
  void Str(std::string_view s) {
    Var(s.size());
    out_.append(s);
  }
  template <class Values>  // Shape, Dims
  void Vec(const Values& v) {
    Var(v.size());
    for (uint64_t x : v) Var(x);
  }
  void Fixed32(uint32_t v) {
    for (int i = 0; i < 4; ++i) out_.push_back(char(v >> (8 * i)));
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

// Reads what Writer wrote; every read is bounds-checked, so a damaged or
// hostile value fails with `ok() == false` instead of reading past the end.
class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}
  bool ok() const { return ok_; }
  bool done() const { return pos_ == in_.size(); }
  uint8_t U8() {
    if (pos_ >= in_.size()) return Fail();
    return uint8_t(in_[pos_++]);
  }
  uint64_t Var() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= in_.size()) return Fail();
      uint8_t b = uint8_t(in_[pos_++]);
      v |= uint64_t(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
    return Fail();
  }
  // A count of items that take at least one byte each.
  uint64_t Count() {
    uint64_t n = Var();
    return n > in_.size() - pos_ ? Fail() : n;
  }
  std::string Str() {
    uint64_t n = Count();
    if (!ok_) return {};
    std::string s(in_.substr(pos_, n));
    pos_ += n;
    return s;
  }
  std::vector<uint64_t> Vec() {
    std::vector<uint64_t> v(Count());
    for (auto& x : v) x = Var();
    return v;
  }
  uint32_t Fixed32() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t(U8()) << (8 * i);
    return v;
  }

 private:
  uint64_t Fail() {
    ok_ = false;
    pos_ = in_.size();
    return 0;
  }
  std::string_view in_;
  size_t pos_ = 0;
  bool ok_ = true;
};

std::string DataKey(const std::string& dir, char tag, std::string_view rest) {
  std::string k = DataBegin(dir);
  k.push_back(tag);
  k.append(rest);
  return k;
}

// A file's key is its path within the checkpoint directory; a file outside
// it (a reader may name one through "../") keeps its root-relative path
// behind a leading '/', which no path within the directory has.
std::string PathInCheckpoint(const std::string& dir, const std::string& path) {
  if (dir.empty()) return path;
  if (path.size() > dir.size() && path.compare(0, dir.size(), dir) == 0 && path[dir.size()] == '/')
    return path.substr(dir.size() + 1);
  return "/" + path;
}

std::string EncodeTensor(const TensorMeta& t) {
  Writer w;
  const bool predicted = std::any_of(t.chunks.begin(), t.chunks.end(), [](const Chunk& c) { return c.item_check(); });
  w.U8(predicted ? kTensorLayoutPredicted : kTensorLayout);
  w.Str(DTypeName(t.dtype));
  w.Vec(t.shape);
  w.Var(t.path.size());
  for (const std::string& p : t.path) w.Str(p);
  w.Str(t.problem);
  w.Var(t.chunks.size());
  for (const Chunk& c : t.chunks) {
    w.U8((c.strides().empty() ? 0 : kHasStrides) | (c.unavailable().empty() ? 0 : kHasUnavailable) |
         (c.has_crc32c() ? kHasCrc : 0) | (c.item_check() ? kPredicted : 0));
    w.Vec(c.box().offsets);
    w.Vec(c.box().lengths);
    w.Var(c.file());
    w.Var(c.offset());
    w.Var(c.length());
    if (!c.strides().empty()) w.Vec(c.strides());
    if (!c.unavailable().empty()) w.Str(c.unavailable());
    if (c.has_crc32c()) w.Fixed32(c.crc32c());
    if (c.item_check()) {
      w.Var(c.item_check()->item.offset);
      w.Var(c.item_check()->item.length);
    }
  }
  return w.Take();
}

Result<TensorMeta> DecodeTensor(std::string_view fqn, std::string_view value) {
  Reader r(value);
  TensorMeta t;
  t.fqn = fqn;
  const uint8_t layout = r.U8();
  if (layout != kTensorLayout && layout != kTensorLayoutPredicted)
    return Status::Corruption("tensor '" + t.fqn + "': unknown row layout " + std::to_string(layout) +
                              " (written by a newer ckptfs? `ckptfs index` rebuilds it)");
  auto dtype = ParseDType(r.Str());
  if (!dtype) return Status::Corruption("tensor '" + t.fqn + "': unknown dtype");
  t.dtype = *dtype;
  t.shape = r.Vec();
  t.path.resize(r.Count());
  for (auto& p : t.path) p = r.Str();
  t.problem = r.Str();
  t.chunks.resize(r.Count());
  for (Chunk& c : t.chunks) {
    const uint8_t flags = r.U8();
    if (flags & ~KnownFlags(layout))
      return Status::Corruption("tensor '" + t.fqn + "': chunk flags " + std::to_string(flags) +
                                " unknown to row layout " + std::to_string(layout));
    Box box;
    box.offsets = r.Vec();
    box.lengths = r.Vec();
    if (box.offsets.size() != box.lengths.size())
      return Status::Corruption("tensor '" + t.fqn + "': chunk box offsets and lengths differ in rank");
    uint64_t file = r.Var();
    if (file > UINT32_MAX) return Status::Corruption("tensor '" + t.fqn + "': file id out of range");
    uint64_t offset = r.Var();
    c = Chunk(box, {FileId(file), offset, r.Var()}, t.dtype);
    if (flags & kHasStrides) c.set_strides(r.Vec());
    if (flags & kHasUnavailable) c.set_unavailable(r.Str());
    if (flags & kHasCrc) c.set_crc32c(r.Fixed32());
    if (flags & kPredicted) {
      const uint64_t item_offset = r.Var();
      c.set_item_check(ItemCheckOf(c, {FileId(file), item_offset, r.Var()}, t.dtype));
    }
  }
  if (!r.ok() || !r.done()) return Status::Corruption("tensor '" + t.fqn + "': truncated or overlong row");
  return t;
}

json FileToJson(FileId id, const SourceFile& f) {
  json j = {{"id", id}, {"size", f.size}, {"mtime_ns", f.mtime_ns}, {"ctime_ns", f.ctime_ns}, {"inode", f.inode}};
  if (!f.version.empty()) j["version"] = f.version;
  if (f.has_rest_crc32c) j["rest_crc32c"] = f.rest_crc32c;
  if (f.derived())
    j["derived"] = {{"transform", f.transform}, {"base", f.base}, {"offset", f.base_offset}, {"length", f.base_length}};
  return j;
}

json HeaderToJson(const Checkpoint& c) {
  json sidecars = json::object();
  for (const auto& [name, id] : c.sidecars) sidecars[name] = id;
  json items = json::object();
  for (const auto& [key, b] : c.byte_items) items[key] = {b.file, b.offset, b.length};
  return {{"sidecars", sidecars}, {"byte_items", items}, {"problems", c.problems}, {"incomplete", c.incomplete}};
}

// True for "a/b.c": no empty, "." or ".." component, not absolute.
bool PlainRelativePath(std::string_view p) {
  if (p.empty()) return false;
  size_t start = 0;
  while (start <= p.size()) {
    size_t end = p.find('/', start);
    if (end == std::string_view::npos) end = p.size();
    std::string_view part = p.substr(start, end - start);
    if (part.empty() || part == "." || part == "..") return false;
    start = end + 1;
  }
  return true;
}

json TensorValueToJson(std::string_view fqn, std::string_view value) {
  auto t = DecodeTensor(fqn, value);
  if (!t.ok()) return {{"undecodable", t.status().message()}};
  json chunks = json::array();
  for (const Chunk& c : t->chunks) {
    json cj = {{"offsets", Shape(c.box().offsets)}, {"lengths", Shape(c.box().lengths)},
               {"file", c.file()}, {"offset", c.offset()}, {"length", c.length()}};
    if (!c.strides().empty()) cj["strides"] = c.strides();
    if (!c.unavailable().empty()) cj["unavailable"] = c.unavailable();
    if (c.has_crc32c()) cj["crc32c"] = c.crc32c();
    if (c.item_check()) cj["predicted_in_item"] = {c.item_check()->item.offset, c.item_check()->item.length};
    chunks.push_back(std::move(cj));
  }
  json j = {{"dtype", std::string(DTypeName(t->dtype))}, {"shape", t->shape}, {"chunks", chunks}};
  if (!t->path.empty()) j["path"] = t->path;
  if (!t->problem.empty()) j["problem"] = t->problem;
  return j;
}

}  // namespace

std::string CheckpointRowKey(const std::string& dir) { return kCheckpointRowPrefix + dir; }

std::string DataBegin(const std::string& dir) {
  std::string k = kDataPrefix + dir;
  k.push_back('\0');
  return k;
}

std::string DataEnd(const std::string& dir) { return kDataPrefix + dir + "\x01"; }

std::string FilesPrefix(const std::string& dir) { return DataBegin(dir) + kFileTag; }

Result<std::vector<Row>> EncodeCheckpoint(const Checkpoint& ckpt, const std::string& source,
                                          int64_t committed_at_ns) {
  if (ckpt.dir.find('\0') != std::string::npos) return Status::InvalidArgument("checkpoint directory holds a NUL");
  auto bad_file = [&](FileId id) { return id >= ckpt.files.size(); };
  std::vector<Row> out;
  // Rows are keyed by name: two files of one path, or two tensors of one
  // fqn, would silently become one row.
  std::unordered_set<std::string_view> seen;
  for (FileId id = 0; id < ckpt.files.size(); ++id) {
    const SourceFile& f = ckpt.files[id];
    if (f.derived() && bad_file(f.base)) return Status::InvalidArgument(f.path + ": derived from an unknown file");
    if (!seen.insert(f.path).second) return Status::InvalidArgument(f.path + ": listed twice in the file table");
    out.push_back({DataKey(ckpt.dir, kFileTag, PathInCheckpoint(ckpt.dir, f.path)), FileToJson(id, f).dump()});
  }
  for (const auto& [name, id] : ckpt.sidecars)
    if (bad_file(id)) return Status::InvalidArgument("sidecar " + name + " names an unknown file");
  for (const auto& [key, b] : ckpt.byte_items)
    if (bad_file(b.file)) return Status::InvalidArgument("item " + key + " names an unknown file");
  out.push_back({DataKey(ckpt.dir, kHeaderTag, ""), HeaderToJson(ckpt).dump()});
  uint64_t chunks = 0;
  seen.clear();
  for (const auto& t : ckpt.tensors) {
    if (!seen.insert(t->fqn).second) return Status::InvalidArgument("tensor '" + t->fqn + "' listed twice");
    for (const Chunk& c : t->chunks)
      if (bad_file(c.file())) return Status::InvalidArgument("tensor '" + t->fqn + "' names an unknown file");
    chunks += t->chunks.size();
    out.push_back({DataKey(ckpt.dir, kTensorTag, t->fqn), EncodeTensor(*t)});
  }
  for (const auto& [fqn, index] : ckpt.file_index) {
    char idx[16];
    std::snprintf(idx, sizeof idx, "%08x/", uint32_t(index));
    out.push_back({DataKey(ckpt.dir, kMappingTag, idx + fqn), ""});
  }
  json row = {{"format", ckpt.format},           {"source", source},
              {"committed_at_ns", committed_at_ns}, {"tensors", ckpt.tensors.size()},
              {"chunks", chunks},                  {"files", ckpt.files.size()}};
  out.push_back({CheckpointRowKey(ckpt.dir), row.dump()});
  return out;
}

Result<std::string> DirOfCheckpointRowKey(std::string_view key) {
  if (!key.starts_with(kCheckpointRowPrefix)) return Status::Corruption("not a checkpoint row key");
  return std::string(key.substr(std::strlen(kCheckpointRowPrefix)));
}

Result<CheckpointEntry> DecodeCheckpointRow(std::string_view key, std::string_view value) {
  CheckpointEntry e;
  ASSIGN_OR_RETURN(e.dir, DirOfCheckpointRowKey(key));
  json j = json::parse(value, nullptr, /*allow_exceptions=*/false);
  try {
    e.format = j.at("format").get<std::string>();
    e.source = j.at("source").get<std::string>();
    e.committed_at_ns = j.at("committed_at_ns").get<int64_t>();
    e.tensors = j.at("tensors").get<uint64_t>();
    e.chunks = j.at("chunks").get<uint64_t>();
    e.files = j.at("files").get<uint64_t>();
  } catch (const std::exception& ex) {
    return Status::Corruption("checkpoint row of '" + e.dir + "' is malformed: " + ex.what());
  }
  return e;
}

CheckpointDecoder::CheckpointDecoder(const CheckpointEntry& entry, bool strict)
    : entry_(entry), strict_(strict), prefix_(DataBegin(entry.dir)) {
  ckpt_.dir = entry.dir;
  ckpt_.format = entry.format;
  // The checkpoint row's count is a hint only (Finish checks it); a damaged
  // one must not make us reserve terabytes.
  ckpt_.tensors.reserve(std::min<uint64_t>(entry.tensors, 1u << 24));
}

Status CheckpointDecoder::Add(std::string_view key, std::string_view value) {
  if (!key.starts_with(prefix_) || key.size() == prefix_.size())
    return Status::Corruption("row does not belong to checkpoint '" + entry_.dir + "'");
  std::string_view rest = key.substr(prefix_.size() + 1);
  switch (key[prefix_.size()]) {
    case kFileTag: return AddFile(rest, value);
    case kHeaderTag: return rest.empty() ? AddHeader(value) : Status::Corruption("malformed header key");
    case kTensorTag: return AddTensor(rest, value);
    case kMappingTag: return AddMapping(rest);
  }
  return Status::Corruption("unknown row kind in checkpoint '" + entry_.dir + "'");
}

Status CheckpointDecoder::AddFile(std::string_view path, std::string_view value) {
  SourceFile f;
  if (path.starts_with("/") && !strict_) f.path = path.substr(1);
  else if (!strict_ || PlainRelativePath(path)) f.path = ckpt_.dir.empty() ? std::string(path) : ckpt_.dir + "/" + std::string(path);
  else return Status::Corruption("source path '" + std::string(path) + "' is not a plain path inside the checkpoint");
  FileId id;
  try {
    json j = json::parse(value);
    id = j.at("id").get<FileId>();
    f.size = j.at("size").get<uint64_t>();
    f.mtime_ns = j.at("mtime_ns").get<int64_t>();
    f.ctime_ns = j.at("ctime_ns").get<int64_t>();
    f.inode = j.at("inode").get<uint64_t>();
    if (j.contains("version")) {
      f.version = j["version"].get<std::string>();
      // It goes out in a request header (If-Match): printable ASCII only.
      if (std::any_of(f.version.begin(), f.version.end(), [](char c) { return c < 0x20 || c > 0x7e; }))
        return Status::Corruption("source file '" + f.path + "': malformed version");
    }
    if (j.contains("rest_crc32c")) {
      f.rest_crc32c = j["rest_crc32c"].get<uint32_t>();
      f.has_rest_crc32c = true;
    }
    if (j.contains("derived")) {
      const json& d = j["derived"];
      f.transform = d.at("transform").get<std::string>();
      f.base = d.at("base").get<uint32_t>();
      f.base_offset = d.at("offset").get<uint64_t>();
      f.base_length = d.at("length").get<uint64_t>();
    }
  } catch (const std::exception& e) {
    return Status::Corruption("file row '" + f.path + "' is malformed: " + e.what());
  }
  if (id >= entry_.files) return Status::Corruption("file row '" + f.path + "' has an id beyond the file count");
  if (ckpt_.files.size() < entry_.files) {
    ckpt_.files.resize(entry_.files);
    have_file_.resize(entry_.files);
  }
  if (have_file_[id]) return Status::Corruption("two file rows share id " + std::to_string(id));
  have_file_[id] = true;
  ckpt_.files[id] = std::move(f);
  return Status::OK();
}

Status CheckpointDecoder::AddHeader(std::string_view value) {
  try {
    json j = json::parse(value);
    for (auto& [name, id] : j.at("sidecars").items()) ckpt_.sidecars[name] = id.get<FileId>();
    for (auto& [key, b] : j.at("byte_items").items())
      ckpt_.byte_items[key] = ByteMeta{b.at(0).get<FileId>(), b.at(1).get<uint64_t>(), b.at(2).get<uint64_t>()};
    ckpt_.problems = j.at("problems").get<std::vector<std::string>>();
    ckpt_.incomplete = j.at("incomplete").get<std::string>();
  } catch (const std::exception& e) {
    return Status::Corruption("header row is malformed: " + std::string(e.what()));
  }
  have_header_ = true;
  return Status::OK();
}

Status CheckpointDecoder::AddTensor(std::string_view fqn, std::string_view value) {
  ASSIGN_OR_RETURN(TensorMeta t, DecodeTensor(fqn, value));
  chunks_ += t.chunks.size();
  ckpt_.tensors.push_back(std::make_shared<const TensorMeta>(std::move(t)));
  return Status::OK();
}

Status CheckpointDecoder::AddMapping(std::string_view rest) {
  if (rest.size() < 9 || rest[8] != '/') return Status::Corruption("malformed file mapping row");
  char* end = nullptr;
  std::string hex(rest.substr(0, 8));
  unsigned long v = std::strtoul(hex.c_str(), &end, 16);
  if (end != hex.c_str() + 8) return Status::Corruption("malformed file mapping row");
  ckpt_.file_index[std::string(rest.substr(9))] = int(uint32_t(v));
  return Status::OK();
}

Result<Checkpoint> CheckpointDecoder::Finish() {
  const std::string what = "checkpoint '" + entry_.dir + "': ";
  if (strict_ && !entry_.dir.empty() && !PlainRelativePath(entry_.dir))
    return Status::Corruption(what + "not a plain relative directory path");
  if (!have_header_) return Status::Corruption(what + "no header row");
  for (bool have : have_file_)
    if (!have) return Status::Corruption(what + "file table has a gap");
  if (ckpt_.files.size() != entry_.files || ckpt_.tensors.size() != entry_.tensors || chunks_ != entry_.chunks)
    return Status::Corruption(what + "rows disagree with the checkpoint row's counts");
  auto bad = [&](FileId id) { return id >= ckpt_.files.size(); };
  for (const SourceFile& f : ckpt_.files)
    if (f.derived() && bad(f.base)) return Status::Corruption(what + f.path + " derives from an unknown file");
  for (const auto& [name, id] : ckpt_.sidecars)
    if (bad(id)) return Status::Corruption(what + "sidecar " + name + " names an unknown file");
  for (const auto& [key, b] : ckpt_.byte_items)
    if (bad(b.file)) return Status::Corruption(what + "item " + key + " names an unknown file");
  for (const auto& t : ckpt_.tensors)
    for (const Chunk& c : t->chunks)
      if (bad(c.file())) return Status::Corruption(what + "tensor '" + t->fqn + "' names an unknown file");
  return std::move(ckpt_);
}

json RowToJson(std::string_view key, std::string_view value) {
  json out = {{"key", std::string(key)}};
  size_t nul = key.find('\0');
  if (key.starts_with(kDataPrefix) && nul != std::string_view::npos && nul + 1 < key.size()) {
    std::string_view rest = key.substr(nul + 2);
    char tag = key[nul + 1];
    if (tag == kTensorTag) out["value"] = TensorValueToJson(rest, value);
    else if (tag == kMappingTag) out["value"] = "";
    else out["value"] = json::parse(value, nullptr, false);
  } else if (key == kRootKey) {
    out["value"] = std::string(value);
  } else {
    out["value"] = json::parse(value, nullptr, false);
  }
  return out;
}

}  // namespace ckptfs::rows
