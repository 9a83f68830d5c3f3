// The bytes of a fake remote object for the cache tests: byte i of version v
// is (i * 7 + v) & 0xff, so every offset and every version reads differently.
#pragma once

#include <cstdint>
#include <string>

namespace ckptfs {

inline void FillFakeBytes(uint64_t at, uint64_t n, int version, char* out) {
  for (uint64_t i = 0; i < n; ++i) out[i] = char(((at + i) * 7 + version) & 0xff);
}

inline std::string FakeBytes(uint64_t at, uint64_t n, int version) {
  std::string s(n, '\0');
  FillFakeBytes(at, n, version, s.data());
  return s;
}

}  // namespace ckptfs
