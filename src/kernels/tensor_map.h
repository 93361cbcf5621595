// Host-side encoding of TMA tensor maps (bf16, bytes or fp32; 128-byte swizzle unless named
// otherwise) through the driver entry point,
// so the library needs no link-time dependency on libcuda.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "epflow/status.h"

namespace epflow {

// A row-major bf16 tensor of dims (innermost first) dims[0..rank), loaded in boxes of
// box[0..rank) elements; box[0] * 2 must be 128 bytes (the swizzle span). Dimension i > 0 is
// strides_bytes[i - 1] bytes apart (multiples of 16), or densely packed without strides_bytes.
// Out-of-range box elements read as zeros.
Status encode_bf16_tensor_map(CUtensorMap* map, const void* base, int rank, const uint64_t* dims,
                              const uint32_t* box, const uint64_t* strides_bytes = nullptr);
// The same for a tensor of bytes (e4m3; box[0] must be 128).
Status encode_u8_tensor_map(CUtensorMap* map, const void* base, int rank, const uint64_t* dims,
                            const uint32_t* box, const uint64_t* strides_bytes = nullptr);
// A tensor of bytes loaded unswizzled: a box's rows land densely in shared memory, box[0] bytes
// apart (box[0] a multiple of 16).
Status encode_u8_tensor_map_unswizzled(CUtensorMap* map, const void* base, int rank,
                                       const uint64_t* dims, const uint32_t* box,
                                       const uint64_t* strides_bytes = nullptr);
// A vector of n fp32 loaded unswizzled in boxes of `box` elements (a multiple of 4, at most 256;
// the box's first element on a 16-byte boundary); elements past n read as zeros.
Status encode_f32_vector_map(CUtensorMap* map, const void* base, uint64_t n, uint32_t box);
// The same for an fp32 tensor (box[0] * 4 must be 128 bytes).
Status encode_f32_tensor_map(CUtensorMap* map, const void* base, int rank, const uint64_t* dims,
                             const uint32_t* box, const uint64_t* strides_bytes = nullptr);

}  // namespace epflow
