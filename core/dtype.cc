#include "core/dtype.h"

#include <limits>

namespace ckptfs {
namespace {

struct DTypeInfo {
  DType type;
  std::string_view name;
  int bits;
};

constexpr DTypeInfo kInfo[] = {
    {DType::kBOOL, "BOOL", 8},        {DType::kU8, "U8", 8},
    {DType::kI8, "I8", 8},            {DType::kI16, "I16", 16},
    {DType::kU16, "U16", 16},         {DType::kF16, "F16", 16},
    {DType::kBF16, "BF16", 16},       {DType::kI32, "I32", 32},
    {DType::kU32, "U32", 32},         {DType::kF32, "F32", 32},
    {DType::kF64, "F64", 64},         {DType::kI64, "I64", 64},
    {DType::kU64, "U64", 64},         {DType::kF8_E5M2, "F8_E5M2", 8},
    {DType::kF8_E4M3, "F8_E4M3", 8},  {DType::kF8_E8M0, "F8_E8M0", 8},
    {DType::kF4, "F4", 4},            {DType::kF6_E2M3, "F6_E2M3", 6},
    {DType::kF6_E3M2, "F6_E3M2", 6},  {DType::kC64, "C64", 64},
    {DType::kF8_E4M3FNUZ, "F8_E4M3FNUZ", 8}, {DType::kF8_E5M2FNUZ, "F8_E5M2FNUZ", 8},
};

const DTypeInfo& Info(DType t) { return kInfo[static_cast<int>(t)]; }

}  // namespace

int DTypeBits(DType t) { return Info(t).bits; }
std::string_view DTypeName(DType t) { return Info(t).name; }

std::optional<DType> ParseDType(std::string_view name) {
  for (const auto& i : kInfo)
    if (i.name == name) return i.type;
  return std::nullopt;
}

int PackGroup(DType t) {
  int bits = DTypeBits(t);
  int g = 1;
  while ((g * bits) % 8 != 0) ++g;
  return g;
}

int PackBytes(DType t) { return PackGroup(t) * DTypeBits(t) / 8; }

std::optional<uint64_t> ByteSize(DType t, uint64_t numel) {
  uint64_t bits = DTypeBits(t);
  if (numel > std::numeric_limits<uint64_t>::max() / bits) return std::nullopt;
  uint64_t total = numel * bits;
  if (total % 8 != 0) return std::nullopt;
  return total / 8;
}

int DTypeAlignmentRank(DType t) { return DTypeBits(t); }

}  // namespace ckptfs
