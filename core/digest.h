// MD5 and base64, for the integrity headers of S3 uploads: `Content-MD5`
// (base64 of the body's MD5) where a server does not take the CRC32C
// checksum header, and `x-amz-checksum-crc32c` (base64 of the big-endian
// CRC32C). MD5 here is an integrity check against transport damage that a
// server verifies, never a security property. Pure.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace ckptfs {

// RFC 1321 MD5, fed in pieces: Md5 m; m.Update(a, n); m.Update(b, k); m.Final().
class Md5 {
 public:
  Md5();
  void Update(const void* data, size_t n);
  std::array<uint8_t, 16> Final();  // once; the object is spent afterwards

 private:
  void Block(const uint8_t* p);
  uint32_t h_[4];
  uint8_t buf_[64];
  size_t buf_len_ = 0;
  uint64_t total_ = 0;
};

// RFC 4648 base64 with padding.
std::string Base64(const void* data, size_t n);

// What `x-amz-checksum-crc32c` carries: base64 of the CRC's 4 big-endian bytes.
std::string Crc32cBase64(uint32_t crc32c);

}  // namespace ckptfs
