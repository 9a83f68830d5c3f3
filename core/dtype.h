// Element types, as named by safetensors.
//
// Sizes are in bits because the newest types pack below a byte: F4 is 4 bits,
// F6_E2M3/F6_E3M2 are 6. Such tensors are stored as one contiguous bit stream
// (numel * bits / 8 bytes, which must be whole), so a slice of one is only
// addressable in bytes when it starts and ends on a byte boundary; the planner
// enforces that with PackGroup().
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace ckptfs {

enum class DType : uint8_t {
  kBOOL, kU8, kI8, kI16, kU16, kF16, kBF16, kI32, kU32, kF32, kF64, kI64, kU64,
  kF8_E5M2, kF8_E4M3, kF8_E8M0, kF4, kF6_E2M3, kF6_E3M2, kC64,
  kF8_E4M3FNUZ, kF8_E5M2FNUZ,  // appended: the store keeps dtypes by number
};

// Every dtype, in declaration order (for tests and tables).
inline constexpr DType kAllDTypes[] = {
    DType::kBOOL, DType::kU8, DType::kI8, DType::kI16, DType::kU16, DType::kF16,
    DType::kBF16, DType::kI32, DType::kU32, DType::kF32, DType::kF64, DType::kI64,
    DType::kU64, DType::kF8_E5M2, DType::kF8_E4M3, DType::kF8_E8M0, DType::kF4,
    DType::kF6_E2M3, DType::kF6_E3M2, DType::kC64, DType::kF8_E4M3FNUZ, DType::kF8_E5M2FNUZ};

// Bits per element: 1 byte for BOOL, 4 for F4, 6 for F6_*, 64 for C64 ...
int DTypeBits(DType t);
// "BF16", "F8_E4M3", ... exactly as in safetensors headers.
std::string_view DTypeName(DType t);
std::optional<DType> ParseDType(std::string_view name);

// The smallest number of consecutive elements that fills whole bytes:
// 1 for byte-sized types, 2 for F4, 4 for F6_*.
int PackGroup(DType t);
// Bytes taken by PackGroup(t) elements.
int PackBytes(DType t);

// Bytes for `numel` elements; nullopt when that is not a whole number of bytes
// or overflows uint64.
std::optional<uint64_t> ByteSize(DType t, uint64_t numel);

// Alignment rank used to order tensors in a safetensors file the way the
// reference writer does: larger elements first, so each payload stays aligned.
int DTypeAlignmentRank(DType t);

}  // namespace ckptfs
