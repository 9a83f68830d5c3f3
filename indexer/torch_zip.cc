// How torch.save archives are read (what and why: torch_zip.h).
//
// Zip layout reference: PKWARE APPNOTE.TXT 6.3 (sections 4.3.7 local header,
// 4.3.12 central directory header, 4.3.14-16 zip64 end records, 4.5.3 zip64
// extra field). All offsets inside the zip are relative to `base`.
#include "indexer/torch_zip.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>
#include <unordered_map>

#include "source/posix_io.h"
#include "source/posix_source.h"

namespace ckptfs {
namespace {

constexpr uint32_t kLocalSig = 0x04034b50;
constexpr uint32_t kCentralSig = 0x02014b50;
constexpr uint32_t kEocdSig = 0x06054b50;
constexpr uint32_t kZip64EocdSig = 0x06064b50;
constexpr uint32_t kZip64LocatorSig = 0x07064b50;
constexpr uint64_t kEocdSize = 22;
constexpr uint64_t kZip64LocatorSize = 20;
constexpr uint64_t kZip64EocdSize = 56;
constexpr uint64_t kCentralHeaderSize = 46;
constexpr uint64_t kLocalHeaderSize = 30;
constexpr uint64_t kMaxCommentSize = 0xFFFF;

uint64_t Le(std::string_view s, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = bytes; i-- > 0;) v = (v << 8) | uint8_t(s[at + i]);
  return v;
}

// Reads [rel, rel + len) of the zip (callers check the range). The last
// 64 KiB, read first to find the end record, is kept: it usually holds the
// central directory too, and all of a small archive (a DCP item), so most
// reads cost no syscall.
class RangeReader {
 public:
  RangeReader(const SourceObject& src, uint64_t base, uint64_t length, const std::string& what)
      : src_(src), base_(base), length_(length), what_(what) {}

  Status LoadTail(uint64_t len) {
    tail_start_ = length_ - len;
    tail_.assign(len, '\0');
    return src_.ReadAt(base_ + tail_start_, len, tail_.data());
  }
  const std::string& tail() const { return tail_; }
  uint64_t tail_start() const { return tail_start_; }

  Result<std::string> Read(uint64_t rel, uint64_t len) const {
    if (rel >= tail_start_ && rel - tail_start_ <= tail_.size() && len <= tail_.size() - (rel - tail_start_))
      return tail_.substr(rel - tail_start_, len);
    std::string out(len, '\0');
    RETURN_IF_ERROR(src_.ReadAt(base_ + rel, len, out.data()));
    return out;
  }

 private:
  const SourceObject& src_;
  uint64_t base_, length_;
  const std::string& what_;
  std::string tail_;
  uint64_t tail_start_ = 0;
};

// a + b <= limit without overflow.
bool FitsWithin(uint64_t a, uint64_t b, uint64_t limit) { return a <= limit && b <= limit - a; }

}  // namespace

const ZipEntry* ZipDirectory::Find(std::string_view name) const {
  for (const auto& e : entries)
    if (e.name == name) return &e;
  return nullptr;
}

namespace {

Status ZipCorrupt(const std::string& what, const std::string& m) { return Status::Corruption(what + ": zip: " + m); }

// Where the central directory is, from the end records.
struct EndRecord {
  uint64_t disk = 0, cd_disk = 0;
  uint64_t count = 0, cd_size = 0, cd_offset = 0;
  uint64_t cd_limit = 0;  // the directory must end before the end records
};

// zip64: a locator right before the EOCD (at `eocd`) points at the zip64
// EOCD record, whose 64-bit fields replace the saturated 16/32-bit ones.
Status ApplyZip64(RangeReader& in, uint64_t eocd, EndRecord& r, const std::string& what) {
  if (eocd < kZip64LocatorSize) return Status::OK();
  ASSIGN_OR_RETURN(std::string loc, in.Read(eocd - kZip64LocatorSize, kZip64LocatorSize));
  if (Le(loc, 0, 4) != kZip64LocatorSig) return Status::OK();
  uint64_t rec = Le(loc, 8, 8);
  uint64_t loc_start = eocd - kZip64LocatorSize;
  if (!FitsWithin(rec, kZip64EocdSize, loc_start))
    return ZipCorrupt(what, "zip64 end record at " + std::to_string(rec) + " lies outside the archive");
  ASSIGN_OR_RETURN(std::string z, in.Read(rec, kZip64EocdSize));
  if (Le(z, 0, 4) != kZip64EocdSig) return ZipCorrupt(what, "zip64 locator does not point at a zip64 end record");
  r.disk = Le(z, 16, 4);
  r.cd_disk = Le(z, 20, 4);
  r.count = Le(z, 32, 8);
  r.cd_size = Le(z, 40, 8);
  r.cd_offset = Le(z, 48, 8);
  r.cd_limit = rec;
  return Status::OK();
}

// Where in the last `tail_len` bytes (loaded as the tail) the EOCD starts:
// like Python's zipfile, the last signature whose comment fits.
std::optional<uint64_t> FindEndRecord(const RangeReader& in, uint64_t tail_len) {
  const std::string& tail = in.tail();
  for (uint64_t i = tail_len - kEocdSize + 1; i-- > 0;)
    if (Le(tail, i, 4) == kEocdSig && i + kEocdSize + Le(tail, i + 20, 2) <= tail_len) return i;
  return std::nullopt;
}

// The EOCD is the last 22 bytes unless a comment (<= 64 KiB) follows it.
// The last kTorchArchiveTailBytes are searched first (torch writes no
// comment), then the last 64 KiB: searched from the end either way, the
// same record is found.
Result<EndRecord> ReadEndRecord(RangeReader& in, uint64_t length, const std::string& what) {
  uint64_t tail_len = 0;
  std::optional<uint64_t> found;
  for (uint64_t want : {kTorchArchiveTailBytes, kEocdSize + kMaxCommentSize}) {
    if (tail_len == length) break;
    tail_len = std::min<uint64_t>(length, want);
    RETURN_IF_ERROR(in.LoadTail(tail_len));
    if ((found = FindEndRecord(in, tail_len))) break;
  }
  if (!found) return ZipCorrupt(what, "no end-of-central-directory record (not a zip, or truncated)");
  const std::string& tail = in.tail();
  const uint64_t tail_start = length - tail_len;
  uint64_t eocd = tail_start + *found;
  std::string_view e(tail.data() + *found, kEocdSize);
  EndRecord r;
  r.disk = Le(e, 4, 2);
  r.cd_disk = Le(e, 6, 2);
  r.count = Le(e, 10, 2);
  r.cd_size = Le(e, 12, 4);
  r.cd_offset = Le(e, 16, 4);
  r.cd_limit = eocd;
  RETURN_IF_ERROR(ApplyZip64(in, eocd, r, what));
  return r;
}

Status CheckEndRecord(const EndRecord& r, const std::string& what, const TorchZipLimits& limits) {
  if (r.disk != 0 || r.cd_disk != 0) return Status::NotSupported(what + ": zip: multi-disk archives are not supported");
  if (!FitsWithin(r.cd_offset, r.cd_size, r.cd_limit))
    return ZipCorrupt(what, "central directory [" + std::to_string(r.cd_offset) + ", +" + std::to_string(r.cd_size) +
                                ") lies outside the archive (directory must end by " + std::to_string(r.cd_limit) + ")");
  if (r.cd_size > limits.max_central_directory_bytes)
    return ZipCorrupt(what, "central directory of " + std::to_string(r.cd_size) + " bytes exceeds the limit of " +
                                std::to_string(limits.max_central_directory_bytes));
  if (r.count > limits.max_entries)
    return ZipCorrupt(what,
                      std::to_string(r.count) + " entries exceed the limit of " + std::to_string(limits.max_entries));
  if (r.count > r.cd_size / kCentralHeaderSize)
    return ZipCorrupt(what, std::to_string(r.count) + " entries cannot fit in a " + std::to_string(r.cd_size) +
                                "-byte central directory");
  return Status::OK();
}

// One central directory header, zip64 fields applied.
struct CentralEntry {
  std::string name;
  std::string where;  // "entry 'name'", for messages
  uint64_t flags = 0, method = 0, crc = 0, csize = 0, usize = 0;
  uint64_t start_disk = 0, local = 0;
  uint64_t record_size = 0;  // fixed header plus name, extra and comment
};

// zip64 extended information: present fields replace saturated ones, in the
// order uncompressed size, compressed size, local offset, disk.
Status ApplyZip64Extra(std::string_view extra, CentralEntry& c, const std::string& what) {
  for (size_t x = 0; x + 4 <= extra.size();) {
    uint64_t id = Le(extra, x, 2), len = Le(extra, x + 2, 2);
    if (x + 4 + len > extra.size()) return ZipCorrupt(what, c.where + ": extra field runs past its header");
    if (id == 0x0001) {
      std::string_view z = extra.substr(x + 4, len);
      size_t p = 0;
      auto take = [&](uint64_t& field, uint64_t saturated, int bytes) -> bool {
        if (field != saturated) return true;
        if (p + bytes > z.size()) return false;
        field = Le(z, p, bytes);
        p += bytes;
        return true;
      };
      if (!take(c.usize, 0xFFFFFFFF, 8) || !take(c.csize, 0xFFFFFFFF, 8) || !take(c.local, 0xFFFFFFFF, 8) ||
          !take(c.start_disk, 0xFFFF, 4))
        return ZipCorrupt(what, c.where + ": zip64 extra field is too short");
    }
    x += 4 + len;
  }
  return Status::OK();
}

// The `n`th header, at `at` in the directory `cd` (read from `cd_offset`).
Result<CentralEntry> ParseCentralEntry(const std::string& cd, uint64_t at, uint64_t n, uint64_t cd_offset,
                                       const std::string& what) {
  const uint64_t cd_size = cd.size();
  if (cd_size - at < kCentralHeaderSize || Le(cd, at, 4) != kCentralSig)
    return ZipCorrupt(what, "central directory entry " + std::to_string(n) + " at " + std::to_string(cd_offset + at) +
                                " is truncated or has a bad signature");
  CentralEntry c;
  c.flags = Le(cd, at + 8, 2);
  c.method = Le(cd, at + 10, 2);
  c.crc = Le(cd, at + 16, 4);
  c.csize = Le(cd, at + 20, 4);
  c.usize = Le(cd, at + 24, 4);
  uint64_t name_len = Le(cd, at + 28, 2), extra_len = Le(cd, at + 30, 2), comment_len = Le(cd, at + 32, 2);
  c.start_disk = Le(cd, at + 34, 2);
  c.local = Le(cd, at + 42, 4);
  uint64_t var_len = name_len + extra_len + comment_len;
  if (cd_size - at - kCentralHeaderSize < var_len)
    return ZipCorrupt(what, "central directory entry " + std::to_string(n) + " runs past the central directory");
  c.name = cd.substr(at + kCentralHeaderSize, name_len);
  c.where = "entry '" + c.name + "'";
  c.record_size = kCentralHeaderSize + var_len;
  RETURN_IF_ERROR(ApplyZip64Extra(std::string_view(cd.data() + at + kCentralHeaderSize + name_len, extra_len), c, what));
  return c;
}

Status CheckStoredEntry(const CentralEntry& c, const std::string& what) {
  if (c.flags & 1) return Status::NotSupported(what + ": zip: " + c.where + " is encrypted");
  if (c.method != 0)
    return Status::NotSupported(what + ": zip: " + c.where + " is compressed (method " + std::to_string(c.method) +
                                "); torch.save archives store entries uncompressed");
  if (c.csize != c.usize)
    return ZipCorrupt(what, c.where + " is stored but its sizes differ (" + std::to_string(c.csize) + " vs " +
                                std::to_string(c.usize) + ")");
  if (c.start_disk != 0) return Status::NotSupported(what + ": zip: " + c.where + " is on another disk");
  return Status::OK();
}

// The local header's name and extra lengths (the extra carries torch's
// alignment padding) locate the data; its sizes are zero and unused. Returns
// the data's offset in the zip.
Result<uint64_t> LocateData(RangeReader& in, const CentralEntry& c, uint64_t cd_offset, const std::string& what) {
  const uint64_t name_len = c.name.size();
  if (!FitsWithin(c.local, kLocalHeaderSize + name_len, cd_offset))
    return ZipCorrupt(what, c.where + ": local header at " + std::to_string(c.local) + " lies outside the archive");
  ASSIGN_OR_RETURN(std::string lh, in.Read(c.local, kLocalHeaderSize + name_len));
  if (Le(lh, 0, 4) != kLocalSig)
    return ZipCorrupt(what, c.where + ": bad local header signature at " + std::to_string(c.local));
  if (Le(lh, 26, 2) != name_len || lh.compare(kLocalHeaderSize, name_len, c.name) != 0)
    return ZipCorrupt(what, c.where + ": local header names a different entry");
  uint64_t data = c.local + kLocalHeaderSize + name_len + Le(lh, 28, 2);
  if (!FitsWithin(data, c.usize, cd_offset))
    return ZipCorrupt(what, c.where + ": data [" + std::to_string(data) + ", +" + std::to_string(c.usize) +
                                ") lies outside the archive");
  return data;
}

Result<ZipDirectory> ReadDirectory(RangeReader& in, uint64_t base, uint64_t length, const std::string& what,
                                   const TorchZipLimits& limits) {
  if (base + length < base) return Status::InvalidArgument(what + ": zip: range overflows");
  if (length < kEocdSize)
    return ZipCorrupt(what, std::to_string(length) + " bytes is too short for an end-of-central-directory record");
  ASSIGN_OR_RETURN(EndRecord end, ReadEndRecord(in, length, what));
  RETURN_IF_ERROR(CheckEndRecord(end, what, limits));
  ASSIGN_OR_RETURN(std::string cd, in.Read(end.cd_offset, end.cd_size));

  ZipDirectory dir;
  dir.entries.reserve(end.count);
  std::set<std::string_view> names;  // views into `cd`
  uint64_t at = 0;
  for (uint64_t n = 0; n < end.count; ++n) {
    ASSIGN_OR_RETURN(CentralEntry c, ParseCentralEntry(cd, at, n, end.cd_offset, what));
    RETURN_IF_ERROR(CheckStoredEntry(c, what));
    if (!names.insert(std::string_view(cd.data() + at + kCentralHeaderSize, c.name.size())).second)
      return ZipCorrupt(what, "duplicate " + c.where);
    ASSIGN_OR_RETURN(uint64_t data, LocateData(in, c, end.cd_offset, what));
    dir.entries.push_back({std::move(c.name), base + data, c.usize, static_cast<uint32_t>(c.crc)});
    at += c.record_size;
  }
  return dir;
}

}  // namespace

Result<ZipDirectory> ReadZipDirectory(int fd, uint64_t base, uint64_t length, const std::string& what,
                                      const TorchZipLimits& limits) {
  FdObject src(fd, what);
  RangeReader in(src, base, length, what);
  return ReadDirectory(in, base, length, what, limits);
}

// ---------------------------------------------------------------------------
// dtypes

namespace {

struct NamedDType {
  std::string_view name;
  DType dtype;
};

constexpr NamedDType kTorchDTypes[] = {
    {"float32", DType::kF32},       {"float", DType::kF32},        {"float64", DType::kF64},
    {"double", DType::kF64},        {"float16", DType::kF16},      {"half", DType::kF16},
    {"bfloat16", DType::kBF16},     {"int64", DType::kI64},        {"long", DType::kI64},
    {"int32", DType::kI32},         {"int", DType::kI32},          {"int16", DType::kI16},
    {"short", DType::kI16},         {"int8", DType::kI8},          {"uint8", DType::kU8},
    {"bool", DType::kBOOL},         {"uint16", DType::kU16},       {"uint32", DType::kU32},
    {"uint64", DType::kU64},        {"float8_e4m3fn", DType::kF8_E4M3},
    {"float8_e5m2", DType::kF8_E5M2}, {"float8_e8m0fnu", DType::kF8_E8M0},
    {"float8_e4m3fnuz", DType::kF8_E4M3FNUZ}, {"float8_e5m2fnuz", DType::kF8_E5M2FNUZ},
    {"complex64", DType::kC64},     {"cfloat", DType::kC64},
};

// Typed storage classes, and the canonical torch name of their dtype.
struct StorageDType {
  std::string_view cls;
  DType dtype;
  std::string_view torch_name;
};

constexpr StorageDType kStorages[] = {
    {"FloatStorage", DType::kF32, "float32"},     {"DoubleStorage", DType::kF64, "float64"},
    {"HalfStorage", DType::kF16, "float16"},      {"BFloat16Storage", DType::kBF16, "bfloat16"},
    {"LongStorage", DType::kI64, "int64"},        {"IntStorage", DType::kI32, "int32"},
    {"ShortStorage", DType::kI16, "int16"},       {"CharStorage", DType::kI8, "int8"},
    {"ByteStorage", DType::kU8, "uint8"},         {"BoolStorage", DType::kBOOL, "bool"},
    {"ComplexFloatStorage", DType::kC64, "complex64"},
};

}  // namespace

std::optional<DType> DTypeFromTorchName(std::string_view torch_name) {
  for (const auto& d : kTorchDTypes)
    if (d.name == torch_name) return d.dtype;
  return std::nullopt;
}

std::string_view TorchNameOf(DType dtype) {
  for (const auto& d : kTorchDTypes)  // canonical names come first
    if (d.dtype == dtype) return d.name;
  return {};
}

std::optional<DType> DTypeFromTorchStorage(std::string_view class_name) {
  for (const auto& s : kStorages)
    if (s.cls == class_name) return s.dtype;
  return std::nullopt;
}

std::optional<std::vector<uint64_t>> AsShape(const PickleValue& v) {
  const PickleValue* t = &v;
  if (const auto* a = v.CallArgs("torch", "Size")) {
    if (a->size() != 1) return std::nullopt;
    t = (*a)[0];
  }
  const auto* items = t->AsTuple();
  if (!items) return std::nullopt;
  std::vector<uint64_t> out;
  out.reserve(items->size());
  for (const PickleValue* x : *items) {
    auto i = x->AsInt();
    if (!i || *i < 0) return std::nullopt;
    out.push_back(uint64_t(*i));
  }
  return out;
}

// ---------------------------------------------------------------------------
// Tensor rebuild calls

namespace {

Status BadTensor(const std::string& m) { return Status::Corruption("torch tensor: " + m); }

// The reach of (shape, strides) from storage_offset, in elements: one past
// the furthest element; 0 for an empty tensor. nullopt on overflow.
std::optional<uint64_t> ElementExtent(const std::vector<uint64_t>& shape, const std::vector<uint64_t>& strides,
                                      uint64_t storage_offset) {
  unsigned __int128 last = storage_offset;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 0) return storage_offset;
    last += (unsigned __int128)(shape[i] - 1) * strides[i];
    if (last > UINT64_MAX - 1) return std::nullopt;
  }
  return uint64_t(last + 1);
}

Result<std::optional<TorchTensorRef>> MatchCall(const PickleValue* callable, const PickleValue* args_value,
                                                int depth);

Result<std::optional<TorchTensorRef>> MatchValue(const PickleValue& v, int depth) {
  const PickleValue& u = v.Unwrapped();
  if (u.kind() != PickleValue::Kind::kReduce) return std::optional<TorchTensorRef>();
  return MatchCall(u.callable(), u.args(), depth);
}

// The storage persistent id of a rebuild call's first argument:
// ('storage', storage_type, key, location, numel). `ref` gets the key and
// location; `storage` the typed storage's dtype (nullopt for UntypedStorage).
Status ReadStoragePid(const PickleValue& arg, const char* fn, TorchTensorRef& ref, uint64_t& numel,
                      std::optional<DType>& storage, std::string_view& storage_torch_name) {
  const PickleValue* pid = arg.pid();
  const auto* p = pid ? pid->AsTuple() : nullptr;
  if (!p || p->size() != 5 || !(*p)[0]->AsStr() || *(*p)[0]->AsStr() != "storage")
    return BadTensor(std::string(fn) + ": storage is not a ('storage', type, key, location, numel) persistent id: " +
                     arg.DebugString(200));
  const PickleValue* cls = (*p)[1];
  const std::string* key = (*p)[2]->AsStr();
  const std::string* location = (*p)[3]->AsStr();
  auto n = (*p)[4]->AsInt();
  if (!cls->IsGlobal() || !key || !location || !n || *n < 0)
    return BadTensor("malformed storage persistent id " + pid->DebugString(200));
  numel = uint64_t(*n);
  ref.storage_key = *key;
  ref.location = *location;
  bool untyped = (cls->global_module() == "torch" || cls->global_module() == "torch.storage") &&
                 cls->global_name() == "UntypedStorage";
  if (!untyped) {
    if (cls->global_module() != "torch")
      return BadTensor("storage type " + cls->DebugString(200) + " is not a torch storage");
    for (const auto& s : kStorages)
      if (s.cls == cls->global_name()) {
        storage = s.dtype;
        storage_torch_name = s.torch_name;
      }
    if (!storage)
      return Status::NotSupported("torch tensor: storage type torch." + std::string(cls->global_name()) +
                                  " is not supported");
  }
  return Status::OK();
}

// storage_offset, size and stride (arguments 1-3), and every element the
// view reaches inside the storage.
Status ReadView(const std::vector<const PickleValue*>& args, TorchTensorRef& ref) {
  auto offset = args[1]->AsInt();
  if (!offset || *offset < 0) return BadTensor("storage_offset is not a non-negative int");
  ref.storage_offset = uint64_t(*offset);
  auto shape = AsShape(*args[2]);
  auto strides = AsShape(*args[3]);
  if (!shape || !strides || shape->size() != strides->size())
    return BadTensor("size " + args[2]->DebugString(200) + " and stride " + args[3]->DebugString(200) +
                     " are not int tuples of one length");
  ref.shape = std::move(*shape);
  ref.strides = std::move(*strides);
  uint64_t item = DTypeBits(ref.dtype) / 8;
  auto extent = ElementExtent(ref.shape, ref.strides, ref.storage_offset);
  if (!extent || *extent > UINT64_MAX / item || *extent * item > ref.storage_nbytes)
    return BadTensor("storage_offset " + std::to_string(ref.storage_offset) + " with size " +
                     args[2]->DebugString(200) + " and stride " + args[3]->DebugString(200) +
                     " reaches past the storage '" + ref.storage_key + "' of " + std::to_string(ref.storage_nbytes) +
                     " bytes");
  return Status::OK();
}

// _rebuild_tensor (v1, v2: dtype from the typed storage; v3: dtype argument).
Result<TorchTensorRef> MatchRebuild(int version, const std::vector<const PickleValue*>& args) {
  const char* fn = version == 3 ? "_rebuild_tensor_v3" : version == 2 ? "_rebuild_tensor_v2" : "_rebuild_tensor";
  size_t min_args = version == 3 ? 7 : version == 2 ? 6 : 4;
  if (args.size() < min_args)
    return BadTensor(std::string(fn) + " has " + std::to_string(args.size()) + " arguments, expected " +
                     std::to_string(min_args) + " or more");
  TorchTensorRef ref;
  uint64_t numel = 0;
  std::optional<DType> storage_dtype;
  std::string_view storage_torch_name;
  RETURN_IF_ERROR(ReadStoragePid(*args[0], fn, ref, numel, storage_dtype, storage_torch_name));
  if (version == 3) {
    const PickleValue* d = args[6];
    if (!d->IsGlobal() || d->global_module() != "torch")
      return BadTensor("_rebuild_tensor_v3 dtype is not a torch dtype: " + d->DebugString(200));
    // float4_e2m1fn_x2's elements are bytes (two F4 values each): indexed
    // as U8 here, its torch_dtype kept; readers that know it unpack it.
    auto dt = d->global_name() == "float4_e2m1fn_x2" ? DType::kU8 : DTypeFromTorchName(d->global_name());
    if (!dt) return Status::NotSupported("torch tensor: dtype torch." + std::string(d->global_name()) + " is not supported");
    ref.dtype = *dt;
    ref.torch_dtype = d->global_name();
  } else {
    if (!storage_dtype) return BadTensor(std::string(fn) + " with an UntypedStorage has no dtype");
    ref.dtype = *storage_dtype;
    ref.torch_dtype = storage_torch_name;
  }
  // Typed storages count elements of their own type; untyped ones bytes.
  uint64_t storage_item = storage_dtype ? DTypeBits(*storage_dtype) / 8 : 1;
  if (numel > UINT64_MAX / storage_item) return BadTensor("storage numel overflows");
  ref.storage_nbytes = numel * storage_item;
  RETURN_IF_ERROR(ReadView(args, ref));
  return ref;
}

Result<std::optional<TorchTensorRef>> MatchCall(const PickleValue* callable, const PickleValue* args_value,
                                                int depth) {
  const auto* args = args_value->AsTuple();
  if (!callable->IsGlobal() || !args) return std::optional<TorchTensorRef>();
  // Parameter wrappers hold the tensor as their first argument; the depth
  // cap only guards against a hostile chain of wrappers.
  if (callable->IsGlobal("torch._utils", "_rebuild_parameter") ||
      callable->IsGlobal("torch._utils", "_rebuild_parameter_with_state")) {
    if (args->empty() || depth > 8) return BadTensor("malformed _rebuild_parameter call");
    ASSIGN_OR_RETURN(auto inner, MatchValue(*(*args)[0], depth + 1));
    if (!inner) return BadTensor("_rebuild_parameter data is not a tensor");
    return inner;
  }
  if (callable->IsGlobal("torch._tensor", "_rebuild_from_type_v2")) {
    // (func, new_type, args, state): func(*args), then the subclass type.
    if (args->size() < 3 || depth > 8) return BadTensor("malformed _rebuild_from_type_v2 call");
    return MatchCall((*args)[0], (*args)[2], depth + 1);
  }
  int version = callable->IsGlobal("torch._utils", "_rebuild_tensor_v3")   ? 3
                : callable->IsGlobal("torch._utils", "_rebuild_tensor_v2") ? 2
                : callable->IsGlobal("torch._utils", "_rebuild_tensor")    ? 1
                                                                           : 0;
  if (version == 0) return std::optional<TorchTensorRef>();
  ASSIGN_OR_RETURN(TorchTensorRef ref, MatchRebuild(version, *args));
  return std::optional<TorchTensorRef>(std::move(ref));
}

std::string PathKey(const PickleValue& key) {
  if (const std::string* s = key.AsStr()) return *s;
  if (auto i = key.AsInt()) return std::to_string(*i);
  return key.DebugString(200);
}

struct Walker {
  const std::string& what;
  const std::string& root;
  // Entry by name: archives hold thousands of storages.
  const std::unordered_map<std::string_view, const ZipEntry*>& entries;
  std::vector<TorchTensorRecord>& out;
  std::set<std::vector<std::string>> seen;
  std::vector<std::string> path;

  std::string PathString() const {
    std::string s;
    for (const auto& p : path) s += (s.empty() ? "" : "/") + p;
    return s.empty() ? "(root)" : s;
  }

  Status Walk(const PickleValue& value) {
    auto ref = MatchValue(value, 0);
    if (!ref.ok()) return ref.status().WithContext(what + ": " + PathString());
    if (*ref) return Add(std::move(**ref));
    const PickleValue& v = value.Unwrapped();
    if (const auto* entries = v.AsDict()) {
      for (const auto& e : *entries) {
        path.push_back(PathKey(*e.key));
        RETURN_IF_ERROR(Walk(*e.value));
        path.pop_back();
      }
    } else if (const auto* items = v.AsSequence()) {
      for (size_t i = 0; i < items->size(); ++i) {
        path.push_back(std::to_string(i));
        RETURN_IF_ERROR(Walk(*(*items)[i]));
        path.pop_back();
      }
    }
    return Status::OK();
  }

  Status Add(TorchTensorRef ref) {
    std::string name = root + "/data/" + ref.storage_key;
    auto it = entries.find(name);
    const ZipEntry* e = it == entries.end() ? nullptr : it->second;
    if (!e) return Status::Corruption(what + ": " + PathString() + ": storage entry '" + name + "' is missing");
    if (e->size < ref.storage_nbytes)
      return Status::Corruption(what + ": " + PathString() + ": storage '" + name + "' declares " +
                                std::to_string(ref.storage_nbytes) + " bytes but the entry holds " +
                                std::to_string(e->size));
    if (!seen.insert(path).second) return Status::Corruption(what + ": duplicate tensor path " + PathString());
    uint64_t skip = ref.storage_offset * (DTypeBits(ref.dtype) / 8);  // <= storage_nbytes (checked)
    TorchTensorRecord r;
    r.path = path;
    r.dtype = ref.dtype;
    r.torch_dtype = std::move(ref.torch_dtype);
    r.shape = std::move(ref.shape);
    r.strides = std::move(ref.strides);
    r.storage_offset = ref.storage_offset;
    r.storage_key = std::move(ref.storage_key);
    r.data_offset = e->data_offset + skip;
    r.storage_bytes_available = ref.storage_nbytes - skip;
    out.push_back(std::move(r));
    return Status::OK();
  }
};

}  // namespace

Result<std::optional<TorchTensorRef>> MatchTorchTensor(const PickleValue& v) { return MatchValue(v, 0); }

Result<TorchArchive> ReadTorchArchive(int fd, uint64_t base, uint64_t length, const std::string& what,
                                      const TorchZipLimits& limits) {
  return ReadTorchArchive(FdObject(fd, what), base, length, what, limits);
}

Result<TorchArchive> ReadTorchArchive(const SourceObject& src, uint64_t base, uint64_t length,
                                      const std::string& what, const TorchZipLimits& limits) {
  TorchArchive ar;
  RangeReader in(src, base, length, what);
  ASSIGN_OR_RETURN(ar.zip, ReadDirectory(in, base, length, what, limits));

  // The root folder is whichever `<root>/data.pkl` the archive has (torch
  // names it after the file; older versions say "archive").
  const ZipEntry* pkl = nullptr;
  for (const auto& e : ar.zip.entries) {
    size_t slash = e.name.find('/');
    if (slash == std::string::npos || slash == 0 || e.name.compare(slash, std::string::npos, "/data.pkl") != 0)
      continue;
    if (pkl) return Status::Corruption(what + ": torch.save: more than one */data.pkl entry");
    pkl = &e;
    ar.root = e.name.substr(0, slash);
  }
  if (!pkl) return Status::Corruption(what + ": torch.save: no <root>/data.pkl entry (not a torch.save archive)");

  if (const ZipEntry* bo = ar.zip.Find(ar.root + "/byteorder")) {
    if (bo->size > 16) return Status::Corruption(what + ": torch.save: byteorder record of " + std::to_string(bo->size) + " bytes");
    ASSIGN_OR_RETURN(std::string order, in.Read(bo->data_offset - base, bo->size));
    if (order == "big") return Status::NotSupported(what + ": torch.save: big-endian archives are not supported");
    if (order != "little") return Status::Corruption(what + ": torch.save: byteorder is '" + order + "'");
  }

  if (pkl->size > limits.max_pickle_bytes)
    return Status::Corruption(what + ": torch.save: data.pkl of " + std::to_string(pkl->size) +
                              " bytes exceeds the limit of " + std::to_string(limits.max_pickle_bytes));
  ASSIGN_OR_RETURN(std::string pickle_bytes, in.Read(pkl->data_offset - base, pkl->size));
  auto doc = Unpickle(pickle_bytes, limits.pickle);
  if (!doc.ok()) return doc.status().WithContext(what + ": " + pkl->name);
  ar.pickle = std::move(doc).value();

  std::unordered_map<std::string_view, const ZipEntry*> entries;
  for (const auto& e : ar.zip.entries) entries.emplace(e.name, &e);
  Walker w{what, ar.root, entries, ar.tensors, {}, {}};
  RETURN_IF_ERROR(w.Walk(ar.pickle->root()));
  return ar;
}

Result<TorchArchive> ReadTorchArchiveFile(const std::string& path, const TorchZipLimits& limits) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return Status::IOError(path + ": " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return Status::IOError(path + ": " + std::strerror(errno));
  return ReadTorchArchive(fd.get(), 0, uint64_t(st.st_size), path, limits);
}

}  // namespace ckptfs
