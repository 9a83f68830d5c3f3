// Text codecs of the restricted unpickler (indexer/pickle.cc): the checks
// and conversions Python's unpickler gets from its str and int types.
// Internal to the pickle code.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace ckptfs::pickle_text {

// Strict UTF-8 (no overlongs, no surrogates, nothing above U+10FFFF): what
// Python's decoder accepts, minus the lone surrogates `surrogatepass` lets
// through, which JSON encoders downstream would reject anyway.
bool IsValidUtf8(std::string_view s);

// Appends code point `cp` (<= 0x10FFFF) encoded as UTF-8.
void AppendUtf8(std::string& out, uint32_t cp);

// str.encode('latin-1') of valid UTF-8; nullopt when a code point is > 0xFF.
std::optional<std::string> Latin1Encode(std::string_view utf8);

// The value of one hex digit, or -1.
int HexValue(char c);

// Little-endian two's complement (LONG1/LONG4 payload) to decimal text.
std::string TwosComplementToDecimal(std::string_view le);

}  // namespace ckptfs::pickle_text
