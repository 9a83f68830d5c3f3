// Element casts between floating dtypes, as torch's `Tensor.to(dtype)`
// makes them on CPU, for the `consolidated.<dtype>/` views.
//
// Narrowing rounds to nearest, ties to even; values past the target's range
// become infinities; subnormals are produced and read as IEEE says. A float64
// source is first rounded to float32 (torch converts double to Half/BFloat16
// through float). NaNs stay NaNs, with the bits torch 2.x's vectorised CPU
// kernels give them (measured; they differ by path):
//   float -> bfloat16: 0xFFFF; anything else -> bfloat16: 0x7FC0;
//   -> float16: sign | 0x7E00 | the top payload bits of the float;
//   Half, BFloat16, F8 -> float: sign and payload moved up.
// torch's scalar loop, which handles the last few elements of a tensor,
// writes Half -> float NaNs as 0x7FFFFFFF instead: NaN bits of that path are
// not reproducible element by element, and tests compare them as NaNs.
//
// Pure: no I/O, no allocation beyond the caller's buffers.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "core/dtype.h"

namespace ckptfs {

// True for the dtypes a dtype view casts: F16, BF16, F32, F64, F8_*.
// Integers, BOOL and C64 are never cast; packed F4/F6 have no element-wise
// cast in torch (their torch dtypes hold two or four values per element) and
// are kept as saved.
bool IsCastable(DType t);

// The dtypes a view can be cast to, by their view suffix: "bf16", "fp16",
// "fp32". nullopt for any other suffix.
std::optional<DType> ParseViewDType(std::string_view suffix);
std::string_view ViewDTypeSuffix(DType t);
// torch's name of the dtype ("bfloat16", "float16", "float32"), as
// config.json writes it.
std::string_view TorchDTypeName(DType t);

// Casts `count` elements of `from` at `src` to `to` at `dst`. REQUIRES:
// IsCastable(from) and `to` one of F16, BF16, F32. Buffers may be unaligned.
void CastElements(DType from, DType to, const uint8_t* src, uint64_t count, uint8_t* dst);

// Single-element conversions (bits in, bits out), exposed for tests.
uint16_t F32ToBF16Bits(uint32_t f);
uint16_t F32ToF16Bits(uint32_t f);
uint32_t F16ToF32Bits(uint16_t h);

}  // namespace ckptfs
