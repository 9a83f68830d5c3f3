// Element conversion to float32, for views of dtypes NumPy lacks (BF16,
// F8_*, F4, F6_*). Pure bit manipulation; no rounding is involved because
// every value of these types is exactly representable in float32.
//
// Packed sub-byte layouts (an assumption the safetensors spec leaves open,
// matching PyTorch's float4_e2m1fn_x2 and the OCP MX convention): elements
// form a little-endian bit stream, element i in bits [i*b, (i+1)*b); so for
// F4 element 0 is the low nibble of byte 0, and four F6 elements fill three
// bytes with element 0 in the low 6 bits of byte 0.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace ckptfs {

// True for the dtypes presented as float32 in NumPy views.
bool NeedsFloat32View(DType t);

// Element `k` of a buffer `src` of dtype `t` (element 0 at src[0]) as a
// double. Every dtype but C64 (complex, which has no single value: returns
// NaN; callers check HasRealValue first). Integers beyond 2^53 round.
double DecodeElement(DType t, const uint8_t* src, uint64_t k);
bool HasRealValue(DType t);

// Decodes `count` elements from element `first` into float32 (exact for the
// NeedsFloat32View dtypes).
void DecodeToFloat32(DType t, const uint8_t* src, uint64_t first, uint64_t count, float* out);

}  // namespace ckptfs
