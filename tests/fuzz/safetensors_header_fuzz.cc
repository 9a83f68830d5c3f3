// libFuzzer target: no input may crash, hang or leak the safetensors header
// codec (core/safetensors.h), and whatever it accepts must survive a round
// trip through EncodeSafetensorsHeader unchanged.
//
//   bash tools/fuzz.sh safetensors_header_fuzz      # builds into build-fuzz/
//
// Each input is read twice: as a whole .safetensors file (8-byte length
// prefix, header, data), and as a bare JSON header, so that seeds of either
// kind (corpus/safetensors_header_fuzz/) reach the parser.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "core/safetensors.h"

namespace {

using ckptfs::SafetensorsHeader;

bool SameHeader(const SafetensorsHeader& a, const SafetensorsHeader& b) {
  if (a.entries.size() != b.entries.size() || a.metadata != b.metadata) return false;
  for (size_t i = 0; i < a.entries.size(); ++i) {
    const auto& x = a.entries[i];
    const auto& y = b.entries[i];
    if (x.name != y.name || x.dtype != y.dtype || x.shape != y.shape || x.begin != y.begin || x.end != y.end)
      return false;
  }
  return true;
}

// An accepted header, encoded and parsed again, must give the same entries.
void CheckRoundTrip(const SafetensorsHeader& h) {
  auto enc = ckptfs::EncodeSafetensorsHeader(h.entries, h.metadata);
  if (!enc.ok()) {
    // Parsed names are UTF-8, unique and never __metadata__: only size may fail.
    if (enc.status().message().find("exceeds the limit") == std::string::npos) std::abort();
    return;
  }
  std::string_view json = std::string_view(*enc).substr(8);
  auto again = ckptfs::ParseSafetensorsHeader(json, json.size());
  if (!again.ok() || !SameHeader(h, *again)) std::abort();
}

void ParseOne(std::string_view json, uint64_t header_len, uint64_t file_size) {
  auto h = ckptfs::ParseSafetensorsHeader(json, header_len);
  if (!h.ok()) return;
  (void)ckptfs::CheckSafetensorsFileSize(*h, file_size);
  (void)h->data_start();
  (void)h->data_end();
  CheckRoundTrip(*h);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto n = ckptfs::DecodeHeaderLength(bytes.substr(0, 8), size);
  if (n.ok()) ParseOne(bytes.substr(8, *n), *n, size);
  ParseOne(bytes, size, 8 + size);
  return 0;
}
