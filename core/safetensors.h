// The safetensors header codec (format: docs/FORMATS.md#safetensors).
//
//   u64 little-endian N | N bytes of UTF-8 JSON | data buffer
//
// Parsing applies the reference (Rust crate) rules: N <= 100,000,000; the
// JSON is an object starting with '{'; every entry has a known dtype, a shape
// and data_offsets whose length equals numel * bits / 8 (overflow-checked);
// sorted by offset, entries start at 0 and abut; no duplicate names (nor a
// field given twice in one entry); `__metadata__` is a string->string map.
// One pass, linear in the header (nlohmann's SAX interface). The file-size rule
// (8 + N + last_end == file size) is separate, so an indexer can tell a
// truncated file from a malformed one.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"

namespace ckptfs {

// Readers refuse larger headers; writers split files to stay below it.
inline constexpr uint64_t kMaxSafetensorsHeader = 100'000'000;

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<uint64_t> shape;
  uint64_t begin = 0;  // relative to the data buffer
  uint64_t end = 0;
};

struct SafetensorsHeader {
  uint64_t header_len = 0;                 // N
  std::vector<SafetensorsEntry> entries;   // sorted by begin, then end, then name
  std::map<std::string, std::string> metadata;

  uint64_t data_start() const { return 8 + header_len; }
  uint64_t data_end() const { return entries.empty() ? 0 : entries.back().end; }
};

// Decodes the 8-byte prefix. Fails when N exceeds the cap or the file.
Result<uint64_t> DecodeHeaderLength(std::string_view prefix8, uint64_t file_size);

// Parses and validates the JSON header of length N.
Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view json, uint64_t header_len);

// Fails (Corruption) unless 8 + N + data_end == file_size.
Status CheckSafetensorsFileSize(const SafetensorsHeader& h, uint64_t file_size);

// Encodes prefix + JSON for `entries` (in the given order, which must be the
// data order) and `metadata`, padded with spaces so the data starts at a
// multiple of `data_alignment` bytes (a multiple of 8, as the format asks).
// Fails (InvalidArgument) when the header would exceed kMaxSafetensorsHeader,
// or a name repeats, is `__metadata__` or is not UTF-8.
Result<std::string> EncodeSafetensorsHeader(const std::vector<SafetensorsEntry>& entries,
                                            const std::map<std::string, std::string>& metadata,
                                            uint64_t data_alignment = 8);

}  // namespace ckptfs
