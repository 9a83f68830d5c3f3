// How the unpickler's text codecs work (what: pickle_text.h).
#include "indexer/pickle_text.h"

#include <vector>

namespace ckptfs::pickle_text {

bool IsValidUtf8(std::string_view s) {
  size_t i = 0, n = s.size();
  while (i < n) {
    uint8_t c = s[i];
    if (c < 0x80) { ++i; continue; }
    int len;
    uint32_t cp;
    if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; }
    else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; }
    else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; }
    else return false;
    if (n - i < static_cast<size_t>(len)) return false;
    for (int k = 1; k < len; ++k) {
      uint8_t cc = s[i + k];
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000)) return false;
    if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += len;
  }
  return true;
}

void AppendUtf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(char(cp));
  } else if (cp < 0x800) {
    out.push_back(char(0xC0 | (cp >> 6)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(char(0xE0 | (cp >> 12)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(char(0xF0 | (cp >> 18)));
    out.push_back(char(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  }
}

std::optional<std::string> Latin1Encode(std::string_view utf8) {
  std::string out;
  out.reserve(utf8.size());
  for (size_t i = 0; i < utf8.size();) {
    uint8_t c = utf8[i];
    if (c < 0x80) {
      out.push_back(char(c));
      ++i;
    } else if ((c & 0xE0) == 0xC0 && i + 1 < utf8.size()) {
      uint32_t cp = ((c & 0x1F) << 6) | (uint8_t(utf8[i + 1]) & 0x3F);
      if (cp > 0xFF) return std::nullopt;
      out.push_back(char(cp));
      i += 2;
    } else {
      return std::nullopt;
    }
  }
  return out;
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::string TwosComplementToDecimal(std::string_view le) {
  std::vector<uint8_t> mag(le.begin(), le.end());
  bool negative = !mag.empty() && (mag.back() & 0x80);
  if (negative) {  // magnitude = ~x + 1
    unsigned carry = 1;
    for (auto& b : mag) {
      unsigned v = uint8_t(~b) + carry;
      b = uint8_t(v);
      carry = v >> 8;
    }
  }
  // Base-2^32 limbs, least significant first, then repeated division by 1e9.
  std::vector<uint32_t> limbs((mag.size() + 3) / 4, 0);
  for (size_t i = 0; i < mag.size(); ++i) limbs[i / 4] |= uint32_t(mag[i]) << (8 * (i % 4));
  while (!limbs.empty() && limbs.back() == 0) limbs.pop_back();
  std::vector<uint32_t> groups;  // base 1e9, least significant first
  while (!limbs.empty()) {
    uint64_t rem = 0;
    for (size_t i = limbs.size(); i-- > 0;) {
      uint64_t cur = (rem << 32) | limbs[i];
      limbs[i] = uint32_t(cur / 1'000'000'000u);
      rem = cur % 1'000'000'000u;
    }
    groups.push_back(uint32_t(rem));
    while (!limbs.empty() && limbs.back() == 0) limbs.pop_back();
  }
  std::string out = negative ? "-" : "";
  if (groups.empty()) return "0";
  out += std::to_string(groups.back());
  for (size_t i = groups.size() - 1; i-- > 0;) {
    std::string g = std::to_string(groups[i]);
    out.append(9 - g.size(), '0');
    out += g;
  }
  return out;
}

}  // namespace ckptfs::pickle_text
