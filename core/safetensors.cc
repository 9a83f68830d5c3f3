#include "core/safetensors.h"

#include <algorithm>
#include <optional>
#include <tuple>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "core/box.h"

namespace ckptfs {
namespace {

using nlohmann::json;

Status Bad(const std::string& what) { return Status::Corruption("safetensors header: " + what); }

// `shape` or `data_offsets` of one entry, as the SAX events left them.
struct UintArrayField {
  bool present = false;   // the key was seen
  bool is_array = false;
  bool all_uints = true;  // every item a non-negative integer
  std::vector<uint64_t> values;
};

// One entry's fields before validation. Validation waits for the entry's
// closing brace so that the checks run in one fixed order.
struct PendingEntry {
  bool dtype_present = false;
  std::optional<std::string> dtype;  // set only when the value is a string
  UintArrayField shape, offsets;
  std::string repeated;  // a field given twice
};

// Builds the header while nlohmann's SAX parser reads the text, in one pass.
// A DOM built through a parser callback (the obvious way to see duplicate
// keys, which a DOM keeps only once) costs O(entries^2): the callback parser
// rescans the top-level object at the end of every entry (40k tensors took
// 82 s). Semantic faults are recorded and parsing goes on, so that text that
// is not JSON at all is reported as such whatever it holds.
//
// Depth: 1 inside the top-level object, 2 inside an entry or __metadata__,
// 3 inside a shape or data_offsets array. Containers whose contents do not
// matter (or are already wrong) are skipped by counting braces in `skip_`.
class HeaderSax {
 public:
  explicit HeaderSax(SafetensorsHeader& out) : out_(out) {}

  bool null() { return Scalar(); }
  bool boolean(bool) { return Scalar(); }
  bool number_integer(json::number_integer_t v) { return v >= 0 ? Uint(static_cast<uint64_t>(v)) : Scalar(); }
  bool number_unsigned(json::number_unsigned_t v) { return Uint(v); }
  bool number_float(json::number_float_t, const std::string&) { return Scalar(); }
  bool binary(json::binary_t&) { return Scalar(); }
  bool string(std::string& s);
  bool key(std::string& k);
  bool start_object(std::size_t);
  bool end_object();
  bool start_array(std::size_t);
  bool end_array();
  bool parse_error(std::size_t, const std::string&, const json::exception&) { return false; }

  // A duplicate entry, else the first fault in document order; OK otherwise.
  Status Outcome() const {
    return duplicate_.empty() ? error_ : Bad("duplicate entry '" + duplicate_ + "'");
  }

 private:
  bool InMetadata() const { return name_ == "__metadata__"; }
  std::string Who() const { return "entry '" + name_ + "'"; }
  void Fail(const std::string& what) {
    if (error_.ok()) error_ = Bad(what);
  }
  // A value of the wrong kind where the current position wants something else.
  void WrongValue();
  bool Scalar();
  bool Uint(uint64_t v);
  void FinishEntry();
  Status CheckEntry(SafetensorsEntry& e) const;
  UintArrayField* ArrayField(const std::string& k) {
    return k == "shape" ? &entry_.shape : k == "data_offsets" ? &entry_.offsets : nullptr;
  }

  SafetensorsHeader& out_;
  int depth_ = 0;
  int skip_ = 0;
  std::string name_;   // the current top-level key
  std::string field_;  // the current key inside an entry or __metadata__
  PendingEntry entry_;
  UintArrayField* array_ = nullptr;  // the array being read at depth 3
  std::unordered_set<std::string> names_;
  std::string duplicate_;
  Status error_;
};

void HeaderSax::WrongValue() {
  if (depth_ == 1) {
    Fail(InMetadata() ? "__metadata__ is not an object" : Who() + " is not an object");
  } else if (depth_ == 2 && InMetadata()) {
    Fail("__metadata__['" + field_ + "'] is not a string");
  } else if (depth_ == 3) {
    array_->all_uints = false;
  }
  // In an entry, a "dtype" that is not a string is left unset (reported as
  // "has no dtype"), a "shape" or "data_offsets" that is not an array keeps
  // is_array false, and other fields are ignored, as the reference reader
  // does.
}

bool HeaderSax::Scalar() {
  if (skip_ == 0) WrongValue();
  return true;
}

bool HeaderSax::Uint(uint64_t v) {
  if (skip_ == 0 && depth_ == 3)
    array_->values.push_back(v);
  else
    Scalar();
  return true;
}

bool HeaderSax::string(std::string& s) {
  if (skip_ > 0) return true;
  if (depth_ == 2 && InMetadata())
    out_.metadata[field_] = s;  // a repeated key keeps the last value, as JSON parsers do
  else if (depth_ == 2 && field_ == "dtype")
    entry_.dtype = s;
  else
    WrongValue();
  return true;
}

bool HeaderSax::key(std::string& k) {
  if (skip_ > 0) return true;
  if (depth_ == 1) {
    name_ = k;
    if (!names_.insert(k).second && duplicate_.empty()) duplicate_ = k;
    return true;
  }
  field_ = k;
  if (InMetadata()) return true;
  bool* present = k == "dtype" ? &entry_.dtype_present : ArrayField(k) ? &ArrayField(k)->present : nullptr;
  if (present && *present && entry_.repeated.empty()) entry_.repeated = k;
  if (present) *present = true;
  return true;
}

bool HeaderSax::start_object(std::size_t) {
  if (skip_ > 0) {
    ++skip_;
  } else if (depth_ == 0 || depth_ == 1) {
    ++depth_;
    entry_ = PendingEntry();
  } else {
    WrongValue();
    skip_ = 1;
  }
  return true;
}

bool HeaderSax::end_object() {
  if (skip_ > 0) {
    --skip_;
    return true;
  }
  if (depth_ == 2 && !InMetadata()) FinishEntry();
  --depth_;
  return true;
}

bool HeaderSax::start_array(std::size_t) {
  if (skip_ > 0) {
    ++skip_;
  } else if (depth_ == 2 && !InMetadata() && ArrayField(field_)) {
    array_ = ArrayField(field_);
    array_->is_array = true;
    ++depth_;
  } else {
    WrongValue();
    skip_ = 1;
  }
  return true;
}

bool HeaderSax::end_array() {
  if (skip_ > 0)
    --skip_;
  else
    --depth_;  // only shape and data_offsets arrays are entered
  return true;
}

void HeaderSax::FinishEntry() {
  if (!error_.ok()) return;  // only the first fault is reported
  SafetensorsEntry e;
  e.name = name_;
  error_ = CheckEntry(e);
  if (error_.ok()) out_.entries.push_back(std::move(e));
}

// The checks of one entry, in the order the reference reader applies them.
Status HeaderSax::CheckEntry(SafetensorsEntry& e) const {
  const std::string who = Who();
  auto uints = [&](const UintArrayField& f, const char* what) -> Status {
    if (!f.present) return Bad(who + " has no " + what);
    if (!f.is_array) return Bad(who + " " + what + " is not an array");
    if (!f.all_uints) return Bad(who + " " + what + " holds a value that is not a non-negative integer");
    return Status::OK();
  };
  if (!entry_.repeated.empty()) return Bad(who + " gives '" + entry_.repeated + "' twice");
  if (!entry_.dtype) return Bad(who + " has no dtype");
  auto dtype = ParseDType(*entry_.dtype);
  if (!dtype) return Bad(who + " has unknown dtype '" + *entry_.dtype + "'");
  RETURN_IF_ERROR(uints(entry_.shape, "shape"));
  RETURN_IF_ERROR(uints(entry_.offsets, "data_offsets"));
  const std::vector<uint64_t>& offs = entry_.offsets.values;
  if (offs.size() != 2) return Bad(who + " data_offsets must have 2 values");
  const std::vector<uint64_t>& shape = entry_.shape.values;
  auto numel = CheckedNumel(shape);
  auto nbytes = numel ? ByteSize(*dtype, *numel) : std::nullopt;
  if (!nbytes) return Bad(who + " size overflows or is not a whole number of bytes");
  if (offs[1] < offs[0]) return Bad(who + " data_offsets end before they begin");
  if (offs[1] - offs[0] != *nbytes)
    return Bad(who + " data_offsets span " + std::to_string(offs[1] - offs[0]) + " bytes but " +
                 std::string(DTypeName(*dtype)) + ShapeToString(shape) + " needs " + std::to_string(*nbytes));
  e.dtype = *dtype;
  e.shape = shape;
  e.begin = offs[0];
  e.end = offs[1];
  return Status::OK();
}

// A JSON string literal; InvalidArgument when `s` is not UTF-8.
Result<std::string> Quote(const std::string& s, const char* what) {
  try {
    return json(s).dump();
  } catch (const json::type_error&) {
    return Status::InvalidArgument(std::string(what) + " is not valid UTF-8");
  }
}

std::string UintList(const std::vector<uint64_t>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? "," : "") + std::to_string(v[i]);
  return out + "]";
}

}  // namespace

Result<uint64_t> DecodeHeaderLength(std::string_view prefix8, uint64_t file_size) {
  if (prefix8.size() < 8 || file_size < 8)
    return Status::Corruption("file is " + std::to_string(file_size) +
                              " bytes, too short for a safetensors header");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(prefix8[i]);
  if (n > kMaxSafetensorsHeader)
    return Status::Corruption("header length " + std::to_string(n) + " exceeds the limit of " +
                              std::to_string(kMaxSafetensorsHeader) + " bytes");
  if (n > file_size - 8)
    return Status::Corruption("header length " + std::to_string(n) + " runs past the end of the " +
                              std::to_string(file_size) + "-byte file");
  return n;
}

Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view text, uint64_t header_len) {
  if (text.empty() || text.front() != '{') return Bad("does not start with '{'");
  SafetensorsHeader h;
  h.header_len = header_len;
  HeaderSax sax(h);
  if (!json::sax_parse(text.begin(), text.end(), &sax)) return Bad("is not valid JSON");
  RETURN_IF_ERROR(sax.Outcome());
  // Names break ties between empty tensors at one offset, so the order does
  // not depend on the order of the text.
  std::sort(h.entries.begin(), h.entries.end(), [](const auto& a, const auto& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  uint64_t at = 0;
  for (const auto& e : h.entries) {
    if (e.begin != at)
      return Bad("entry '" + e.name + "' starts at " + std::to_string(e.begin) + ", expected " +
                 std::to_string(at) + (e.begin < at ? " (overlap)" : " (gap)"));
    at = e.end;
  }
  return h;
}

Status CheckSafetensorsFileSize(const SafetensorsHeader& h, uint64_t file_size) {
  uint64_t want = h.data_start() + h.data_end();
  if (want != file_size)
    return Status::Corruption("file is " + std::to_string(file_size) + " bytes but its header says " +
                              std::to_string(want) +
                              (file_size < want ? " (truncated?)" : " (trailing bytes)"));
  return Status::OK();
}

Result<std::string> EncodeSafetensorsHeader(const std::vector<SafetensorsEntry>& entries,
                                            const std::map<std::string, std::string>& metadata,
                                            uint64_t data_alignment) {
  // Written as text: an ordered_json object finds each key by linear search,
  // which made 100k entries quadratic.
  std::string text = "{";
  if (!metadata.empty()) {
    text += "\"__metadata__\":{";
    for (const auto& [k, v] : metadata) {
      ASSIGN_OR_RETURN(std::string qk, Quote(k, "metadata key"));
      ASSIGN_OR_RETURN(std::string qv, Quote(v, "metadata value"));
      text += (text.back() == '{' ? "" : ",") + qk + ":" + qv;
    }
    text += "}";
  }
  std::unordered_set<std::string_view> names;
  for (const auto& e : entries) {
    if (e.name == "__metadata__" || !names.insert(e.name).second)
      return Status::InvalidArgument("tensor name '" + e.name + "' is used twice or reserved");
    ASSIGN_OR_RETURN(std::string qn, Quote(e.name, "tensor name"));
    text += (text.back() == '{' ? "" : ",") + qn + ":{\"dtype\":\"" + std::string(DTypeName(e.dtype)) +
            "\",\"shape\":" + UintList(e.shape) + ",\"data_offsets\":" + UintList({e.begin, e.end}) + "}";
  }
  text += "}";
  text.append((data_alignment - (8 + text.size()) % data_alignment) % data_alignment, ' ');
  if (text.size() > kMaxSafetensorsHeader)
    return Status::InvalidArgument("safetensors header of " + std::to_string(text.size()) +
                                   " bytes exceeds the limit; split the file");
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + text;
}

}  // namespace ckptfs
