#include "core/safetensors.h"

#include <algorithm>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "core/box.h"

namespace ckptfs {
namespace {

using nlohmann::json;

Status Bad(const std::string& what) { return Status::Corruption("safetensors header: " + what); }

Result<std::vector<uint64_t>> UintArray(const json& j, const std::string& what) {
  if (!j.is_array()) return Bad(what + " is not an array");
  std::vector<uint64_t> out;
  for (const json& v : j) {
    if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0))
      return Bad(what + " holds a value that is not a non-negative integer");
    out.push_back(v.get<uint64_t>());
  }
  return out;
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
  // Duplicate keys are invalid; nlohmann keeps the last silently, so count
  // top-level keys with the parser callback.
  std::set<std::string> seen;
  std::string dup;
  json::parser_callback_t cb = [&](int depth, json::parse_event_t ev, json& parsed) {
    if (depth == 1 && ev == json::parse_event_t::key) {
      std::string k = parsed.get<std::string>();
      if (!seen.insert(k).second && dup.empty()) dup = k;
    }
    return true;
  };
  json j = json::parse(text.begin(), text.end(), cb, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Bad("is not valid JSON");
  if (!j.is_object()) return Bad("is not a JSON object");
  if (!dup.empty()) return Bad("duplicate entry '" + dup + "'");

  SafetensorsHeader h;
  h.header_len = header_len;
  for (auto& [name, v] : j.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) return Bad("__metadata__ is not an object");
      for (auto& [k, s] : v.items()) {
        if (!s.is_string()) return Bad("__metadata__['" + k + "'] is not a string");
        h.metadata[k] = s.get<std::string>();
      }
      continue;
    }
    const std::string who = "entry '" + name + "'";
    if (!v.is_object()) return Bad(who + " is not an object");
    if (!v.contains("dtype") || !v["dtype"].is_string()) return Bad(who + " has no dtype");
    auto dtype = ParseDType(v["dtype"].get<std::string>());
    if (!dtype) return Bad(who + " has unknown dtype '" + v["dtype"].get<std::string>() + "'");
    if (!v.contains("shape")) return Bad(who + " has no shape");
    ASSIGN_OR_RETURN(auto shape, UintArray(v["shape"], who + " shape"));
    if (!v.contains("data_offsets")) return Bad(who + " has no data_offsets");
    ASSIGN_OR_RETURN(auto offs, UintArray(v["data_offsets"], who + " data_offsets"));
    if (offs.size() != 2) return Bad(who + " data_offsets must have 2 values");
    auto numel = CheckedNumel(shape);
    auto nbytes = numel ? ByteSize(*dtype, *numel) : std::nullopt;
    if (!nbytes) return Bad(who + " size overflows or is not a whole number of bytes");
    if (offs[1] < offs[0]) return Bad(who + " data_offsets end before they begin");
    if (offs[1] - offs[0] != *nbytes)
      return Bad(who + " data_offsets span " + std::to_string(offs[1] - offs[0]) +
                 " bytes but " + std::string(DTypeName(*dtype)) + ShapeToString(shape) +
                 " needs " + std::to_string(*nbytes));
    h.entries.push_back({name, *dtype, std::move(shape), offs[0], offs[1]});
  }
  std::sort(h.entries.begin(), h.entries.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
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
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    j["__metadata__"] = std::move(m);
  }
  for (const auto& e : entries) {
    j[e.name] = {{"dtype", std::string(DTypeName(e.dtype))}, {"shape", e.shape}, {"data_offsets", {e.begin, e.end}}};
  }
  std::string text = j.dump();
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
