// The pieces of S3 uploads that need no server: MD5 (RFC 1321's test suite,
// and lengths around the padding boundary, as Python's hashlib computes
// them), base64 (RFC 4648's vectors), the CRC32C header value, and the XML
// body of CompleteMultipartUpload. The requests themselves run against a
// real SeaweedFS in tests/e2e/test_s3_upload.py.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "core/digest.h"
#include "source/s3_client.h"

namespace ckptfs {
namespace {

std::string Hex(const std::array<uint8_t, 16>& d) {
  static const char* kHex = "0123456789abcdef";
  std::string s;
  for (uint8_t b : d) s += {kHex[b >> 4], kHex[b & 15]};
  return s;
}

std::string Md5Hex(const std::string& s) {
  Md5 m;
  m.Update(s.data(), s.size());
  return Hex(m.Final());
}

TEST(Digest, Md5OfRfc1321TestSuite) {
  EXPECT_EQ(Md5Hex(""), "d41d8cd98f00b204e9800998ecf8427e");
  EXPECT_EQ(Md5Hex("a"), "0cc175b9c0f1b6a831c399e269772661");
  EXPECT_EQ(Md5Hex("abc"), "900150983cd24fb0d6963f7d28e17f72");
  EXPECT_EQ(Md5Hex("message digest"), "f96b697d7cb7938d525a2f31aaf161d0");
  EXPECT_EQ(Md5Hex("abcdefghijklmnopqrstuvwxyz"), "c3fcd3d76192e4007dfb496cca67e13b");
  std::string digits;
  for (int i = 0; i < 8; ++i) digits += "1234567890";
  EXPECT_EQ(Md5Hex(digits), "57edf4a22be3c955ac49da2e2107b67a");
}

TEST(Digest, Md5AroundThePaddingBoundaryAndInPieces) {
  EXPECT_EQ(Md5Hex(std::string(55, 'x')), "04364420e25c512fd958a70738aa8f72");
  EXPECT_EQ(Md5Hex(std::string(56, 'x')), "668a72d5ba17f08e62dabcafad6db14b");
  EXPECT_EQ(Md5Hex(std::string(64, 'x')), "c1bb4f81d892b2d57947682aeb252456");
  // Fed in uneven pieces: the same digest as whole.
  std::string digits;
  for (int i = 0; i < 8; ++i) digits += "1234567890";
  Md5 m;
  for (size_t at = 0, step = 1; at < digits.size(); at += step, step = step * 2 + 1)
    m.Update(digits.data() + at, std::min(step, digits.size() - at));
  EXPECT_EQ(Hex(m.Final()), "57edf4a22be3c955ac49da2e2107b67a");
}

TEST(Digest, Base64OfRfc4648Vectors) {
  const std::pair<const char*, const char*> cases[] = {
      {"", ""}, {"f", "Zg=="}, {"fo", "Zm8="}, {"foo", "Zm9v"}, {"foob", "Zm9vYg=="}, {"fooba", "Zm9vYmE="},
      {"foobar", "Zm9vYmFy"}};
  for (auto [in, out] : cases) EXPECT_EQ(Base64(in, std::strlen(in)), out) << in;
}

TEST(Digest, Crc32cHeaderIsBase64OfTheBigEndianValue) {
  // CRC32C("123456789") = 0xE3069283, the standard check value.
  EXPECT_EQ(Crc32cBase64(0xE3069283u), "4waSgw==");
}

TEST(S3Upload, CompletionXmlListsPartsInOrderWithTheirChecksums) {
  std::vector<S3CompletedPart> parts = {{1, "\"a1\"", 0xE3069283u}, {2, "\"b2\"", 0}};
  EXPECT_EQ(S3CompletionXml(parts, S3PartCheck::kCrc32c),
            "<CompleteMultipartUpload xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">"
            "<Part><PartNumber>1</PartNumber><ETag>\"a1\"</ETag><ChecksumCRC32C>4waSgw==</ChecksumCRC32C></Part>"
            "<Part><PartNumber>2</PartNumber><ETag>\"b2\"</ETag><ChecksumCRC32C>AAAAAA==</ChecksumCRC32C></Part>"
            "</CompleteMultipartUpload>");
  EXPECT_EQ(S3CompletionXml(parts, S3PartCheck::kMd5),
            "<CompleteMultipartUpload xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">"
            "<Part><PartNumber>1</PartNumber><ETag>\"a1\"</ETag></Part>"
            "<Part><PartNumber>2</PartNumber><ETag>\"b2\"</ETag></Part>"
            "</CompleteMultipartUpload>");
}

}  // namespace
}  // namespace ckptfs
