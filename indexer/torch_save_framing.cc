// torch.save framing (what and why: torch_save_framing.h).
//
// Zip layout reference: PKWARE APPNOTE.TXT 6.3 (4.3.7 local file header,
// 4.3.12 central directory header, 4.3.14-16 zip64 end records, 4.5.3 zip64
// extended information). Pickle opcodes: Python's Lib/pickle.py, protocol 2.
#include "indexer/torch_save_framing.h"

#include <map>

#include "core/zip_crc32.h"

namespace ckptfs {
namespace {

constexpr uint64_t kAlign = 64;  // torch's .storage_alignment
constexpr uint32_t kSat32 = 0xFFFFFFFF;
constexpr size_t kDataEntry = 4;
constexpr uint16_t kVersionZip = 20, kVersionZip64 = 45;

struct DTypeInfo {
  uint64_t size;
  const char* legacy_storage;  // nullptr: torch pickles UntypedStorage + dtype (v3)
};
const std::map<std::string, DTypeInfo>& DTypes() {
  static const std::map<std::string, DTypeInfo> m = {
      {"float32", {4, "FloatStorage"}},     {"float64", {8, "DoubleStorage"}},
      {"float16", {2, "HalfStorage"}},      {"bfloat16", {2, "BFloat16Storage"}},
      {"int64", {8, "LongStorage"}},        {"int32", {4, "IntStorage"}},
      {"int16", {2, "ShortStorage"}},       {"int8", {1, "CharStorage"}},
      {"uint8", {1, "ByteStorage"}},        {"bool", {1, "BoolStorage"}},
      {"complex64", {8, "ComplexFloatStorage"}}, {"complex128", {16, "ComplexDoubleStorage"}},
      {"uint16", {2, nullptr}},             {"uint32", {4, nullptr}},
      {"uint64", {8, nullptr}},             {"float8_e4m3fn", {1, nullptr}},
      {"float8_e5m2", {1, nullptr}},        {"float8_e4m3fnuz", {1, nullptr}},
      {"float8_e5m2fnuz", {1, nullptr}},    {"float8_e8m0fnu", {1, nullptr}},
      {"complex32", {4, nullptr}},          {"float4_e2m1fn_x2", {1, nullptr}},  // an element: 2 F4 values
  };
  return m;
}

uint32_t crc32_of(const std::string& d) { return ZipCrc32(0, d.data(), d.size()); }

void Put(std::string& s, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) s.push_back(char((v >> (8 * i)) & 0xFF));
}

// --- pickle protocol 2 ------------------------------------------------------
void PGlobal(std::string& s, const std::string& module, const std::string& name) {
  s += 'c' + module + '\n' + name + '\n';
}
void PStr(std::string& s, const std::string& v) {
  s += 'X';
  Put(s, v.size(), 4);
  s += v;
}
void PInt(std::string& s, uint64_t v) {
  if (v < 0x100) {
    s += 'K';
    Put(s, v, 1);
  } else if (v < 0x10000) {
    s += 'M';
    Put(s, v, 2);
  } else if (v < 0x80000000ull) {
    s += 'J';
    Put(s, v, 4);
  } else {  // LONG1: little-endian two's complement, here 8 bytes + a sign byte
    s += '\x8a';
    s += char(9);
    Put(s, v, 8);
    s += '\0';
  }
}
void PTuple(std::string& s, const std::vector<uint64_t>& v) {
  static const char kTupleN[] = {')', '\x85', '\x86', '\x87'};  // EMPTY_TUPLE, TUPLE1..3
  if (v.size() > 3) s += '(';
  for (uint64_t x : v) PInt(s, x);
  s += v.size() > 3 ? 't' : kTupleN[v.size()];
}

}  // namespace

uint64_t TorchSaveFraming::ElementSize(const std::string& dtype) {
  auto it = DTypes().find(dtype);
  return it == DTypes().end() ? 0 : it->second.size;
}

Result<std::string> TorchTensorPickle(const std::string& dtype, const std::vector<uint64_t>& shape) {
  auto it = DTypes().find(dtype);
  if (it == DTypes().end()) return Status::NotSupported("torch.save framing: unknown dtype '" + dtype + "'");
  const bool v3 = it->second.legacy_storage == nullptr;
  uint64_t numel = 1;
  std::vector<uint64_t> strides(shape.size());
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = numel;
    numel *= shape[i];
  }
  std::string s = "\x80\x02";
  PGlobal(s, "torch._utils", v3 ? "_rebuild_tensor_v3" : "_rebuild_tensor_v2");
  s += "((";
  PStr(s, "storage");
  if (v3)
    PGlobal(s, "torch.storage", "UntypedStorage");
  else
    PGlobal(s, "torch", it->second.legacy_storage);
  PStr(s, "0");
  PStr(s, "cpu");
  PInt(s, v3 ? numel * it->second.size : numel);  // UntypedStorage counts bytes
  s += "tQ";  // TUPLE, BINPERSID
  PInt(s, 0);  // storage_offset
  PTuple(s, shape);
  PTuple(s, strides);
  s += '\x89';  // NEWFALSE: requires_grad
  PGlobal(s, "collections", "OrderedDict");
  s += ")R";  // backward_hooks = OrderedDict()
  if (v3) PGlobal(s, "torch", dtype);
  s += "tR.";
  return s;
}

Result<TorchSaveFraming> TorchSaveFraming::Plan(const TorchSaveSpec& spec) {
  uint64_t esize = ElementSize(spec.dtype);
  if (esize == 0) return Status::NotSupported("torch.save framing: unknown dtype '" + spec.dtype + "'");
  uint64_t numel = 1;
  for (uint64_t d : spec.shape) numel *= d;
  if (numel * esize != spec.nbytes)
    return Status::InvalidArgument("torch.save framing: " + std::to_string(spec.nbytes) + " bytes for a " +
                                   spec.dtype + " tensor of " + std::to_string(numel) + " elements");
  ASSIGN_OR_RETURN(std::string pkl, TorchTensorPickle(spec.dtype, spec.shape));
  TorchSaveFraming a;
  a.spec_ = spec;
  auto add = [&](const std::string& name, std::string data) {
    Entry e;
    e.name = "archive/" + name;
    e.size = data.size();
    e.crc = crc32_of(data);
    e.data = std::move(data);
    a.entries_.push_back(std::move(e));
  };
  add("data.pkl", pkl);
  add(".format_version", "1");
  add(".storage_alignment", "64");
  add("byteorder", "little");
  add("data/0", "");
  add("version", "3\n");
  add(".data/serialization_id", spec.serialization_id.empty() ? std::string(40, '0') : spec.serialization_id);
  a.entries_[kDataEntry].size = spec.nbytes;
  a.entries_[kDataEntry].zip64 = spec.force_zip64 || spec.nbytes >= kSat32;
  a.Layout();
  return a;
}

void TorchSaveFraming::Layout() {
  uint64_t off = 0;
  for (size_t i = 0; i < entries_.size(); ++i) {
    Entry& e = entries_[i];
    e.offset = off;
    uint64_t hdr = 30 + e.name.size();
    if (i == kDataEntry) {
      hdr += (e.zip64 ? 20 : 0) + 4;  // zip64 extra, `FB` extra header
      e.pad = uint16_t((kAlign - (spec_.file_offset + off + hdr) % kAlign) % kAlign);
      hdr += e.pad;
      data_offset_ = off + hdr;
    }
    off += hdr + e.size;
  }
  cd_offset_ = off;
  cd_size_ = 0;
  for (Entry& e : entries_) {
    e.zip64 = e.zip64 || e.offset >= kSat32;  // from here on: "central entry needs zip64"
    cd_size_ += 46 + e.name.size() + (e.zip64 ? 28 : 0);
  }
  total_size_ = cd_offset_ + cd_size_ + 56 + 20 + 22;
}

std::string TorchSaveFraming::LocalHeader(const Entry& e, uint32_t crc) const {
  const bool data = &e == &entries_[kDataEntry];
  const bool z64 = data && e.zip64;
  std::string s;
  Put(s, 0x04034b50, 4);
  Put(s, z64 ? kVersionZip64 : kVersionZip, 2);
  Put(s, 0, 2);  // flags: sizes and CRC are in this header, names are ASCII
  Put(s, 0, 2);  // stored
  Put(s, 0, 4);  // DOS time and date: torch writes zeros too
  Put(s, crc, 4);
  Put(s, z64 ? kSat32 : e.size, 4);
  Put(s, z64 ? kSat32 : e.size, 4);
  Put(s, e.name.size(), 2);
  Put(s, data ? (z64 ? 20 : 0) + 4 + e.pad : 0, 2);
  s += e.name;
  if (z64) {
    Put(s, 0x0001, 2);
    Put(s, 16, 2);
    Put(s, e.size, 8);
    Put(s, e.size, 8);
  }
  if (data) {
    Put(s, 0x4246, 2);  // "FB": torch's padding field
    Put(s, e.pad, 2);
    s.append(e.pad, 'Z');
  }
  return s;
}

std::string TorchSaveFraming::CentralDirectory(uint32_t data_crc) const {
  std::string s;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    Put(s, 0x02014b50, 4);
    Put(s, kVersionZip64, 2);  // made by
    Put(s, e.zip64 ? kVersionZip64 : kVersionZip, 2);
    Put(s, 0, 2);
    Put(s, 0, 2);
    Put(s, 0, 4);
    Put(s, i == kDataEntry ? data_crc : e.crc, 4);
    Put(s, e.zip64 ? kSat32 : e.size, 4);
    Put(s, e.zip64 ? kSat32 : e.size, 4);
    Put(s, e.name.size(), 2);
    Put(s, e.zip64 ? 28 : 0, 2);
    Put(s, 0, 2);  // comment
    Put(s, 0, 2);  // disk
    Put(s, 0, 2);  // internal attributes
    Put(s, 0, 4);  // external attributes
    Put(s, e.zip64 ? kSat32 : e.offset, 4);
    s += e.name;
    if (e.zip64) {  // every saturated field, in APPNOTE order
      Put(s, 0x0001, 2);
      Put(s, 24, 2);
      Put(s, e.size, 8);
      Put(s, e.size, 8);
      Put(s, e.offset, 8);
    }
  }
  return s;
}

std::string TorchSaveFraming::Head(uint32_t data_crc32) const {
  std::string s;
  for (size_t i = 0; i <= kDataEntry; ++i) s += LocalHeader(entries_[i], i == kDataEntry ? data_crc32 : entries_[i].crc) + entries_[i].data;
  return s;
}

std::string TorchSaveFraming::Tail(uint32_t data_crc32) const {
  std::string s;
  for (size_t i = kDataEntry + 1; i < entries_.size(); ++i) s += LocalHeader(entries_[i], entries_[i].crc) + entries_[i].data;
  s += CentralDirectory(data_crc32);
  const uint64_t n = entries_.size(), z64_eocd = cd_offset_ + cd_size_;
  Put(s, 0x06064b50, 4);  // zip64 end of central directory record
  Put(s, 44, 8);
  Put(s, kVersionZip64, 2);
  Put(s, kVersionZip64, 2);
  Put(s, 0, 4);
  Put(s, 0, 4);
  Put(s, n, 8);
  Put(s, n, 8);
  Put(s, cd_size_, 8);
  Put(s, cd_offset_, 8);
  Put(s, 0x07064b50, 4);  // zip64 locator
  Put(s, 0, 4);
  Put(s, z64_eocd, 8);
  Put(s, 1, 4);
  Put(s, 0x06054b50, 4);  // end of central directory
  Put(s, 0, 2);
  Put(s, 0, 2);
  Put(s, n, 2);
  Put(s, n, 2);
  Put(s, cd_size_ >= kSat32 ? kSat32 : cd_size_, 4);
  Put(s, cd_offset_ >= kSat32 ? kSat32 : cd_offset_, 4);
  Put(s, 0, 2);
  return s;
}

}  // namespace ckptfs
