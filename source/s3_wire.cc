// How S3 requests are spelled (what and why: s3_wire.h).
#include "source/s3_wire.h"

#include <cctype>

#include "core/digest.h"

namespace ckptfs {

uint64_t S3Body::size() const {
  uint64_t n = 0;
  for (const auto& [p, len] : spans) n += len;
  return n;
}

std::string S3Encode(const std::string& s, bool keep_slash) {
  static const char* kHex = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' || (keep_slash && c == '/')) {
      out += char(c);
    } else {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

std::string S3Url(const S3Config& config, const std::string& ep, const std::string& key,
                  const std::string& query) {
  std::string url;
  if (config.path_style) {
    url = ep + "/" + S3Encode(config.location.bucket, false) + "/" + S3Encode(key, true);
  } else {
    const size_t scheme = ep.find("://") + 3;
    url = ep.substr(0, scheme) + config.location.bucket + "." + ep.substr(scheme) + "/" + S3Encode(key, true);
  }
  return query.empty() ? url : url + "?" + query;
}

std::string S3CompletionXml(const std::vector<S3CompletedPart>& parts, S3PartCheck check) {
  std::string xml = "<CompleteMultipartUpload xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">";
  for (const S3CompletedPart& p : parts) {
    xml += "<Part><PartNumber>" + std::to_string(p.number) + "</PartNumber><ETag>" + p.etag + "</ETag>";
    if (check == S3PartCheck::kCrc32c) xml += "<ChecksumCRC32C>" + Crc32cBase64(p.crc32c) + "</ChecksumCRC32C>";
    xml += "</Part>";
  }
  return xml + "</CompleteMultipartUpload>";
}

}  // namespace ckptfs
