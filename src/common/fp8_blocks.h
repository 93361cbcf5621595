// Block-scaled FP8 (the DeepSeek-V3 recipe): e4m3 values (OCP E4M3FN: max 448, no infinities)
// with one fp32 scale per block: 1 x 128 for activations (a row's 128 consecutive columns),
// 128 x 128 for weights. value ≈ e4m3 * scale. Portable: the quantization kernels and the CPU
// reference run this very code, so they agree bit for bit.
//
// A block's scale is amax / 448, at least 2^-126 (or, with power-of-two scales, the smallest
// 2^e >= that, what a UE8M0 byte can hold); its values are round-to-nearest-even of
// v * (1 / scale), saturated to ±448. A block of zeros has scale 1 and zero values. A NaN or
// infinity in a block makes that block's scale and values NaN (it stays in its block: a 1 x 128
// block is one token's).
#pragma once

#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>

#include "common/hd.h"

namespace epflow::fp8 {

inline constexpr int kBlock = 128;         // block edge, elements
// The most 128-deep K blocks of a GEMM in the FP8 layer (H and I at most 128 times this): a
// tile's weight scales sit in shared memory, loaded as one TMA box of at most 256 floats per row.
inline constexpr int kMaxKBlocks = 253;
inline constexpr float kE4m3Max = 448.0f;  // largest finite e4m3 magnitude
inline constexpr float kMinScale = 0x1p-126f;  // smallest normal float: the least block scale

// The scale of a block whose largest magnitude is amax.
EPFLOW_HD float block_scale(float amax, bool power_of_two) {
  if (!(amax == amax) || amax == INFINITY) return NAN;  // NaN or infinity: the block is lost
  if (amax == 0.0f) return 1.0f;
  // NOTES: at least the smallest normal float, so 1 / scale stays finite (a block of tiny values
  // would otherwise get an infinite reciprocal, and its zeros 0 * inf = NaN).
  const float s = fmaxf(amax / kE4m3Max, kMinScale);
  if (!power_of_two) return s;
  // The smallest power of two >= s: exact (frexp), no rounding of a logarithm.
  int e = 0;
  const float m = frexpf(s, &e);  // s = m * 2^e, m in [0.5, 1)
  return ldexpf(1.0f, m == 0.5f ? e - 1 : e);
}

// v * (1 / scale) as e4m3 (round to nearest even, saturated to ±448; NaN stays NaN).
// NOTES: a product with the block's reciprocal, not a quotient: a correctly rounded division is a
// long instruction sequence per element, which made the quantization kernels compute-bound;
// inlined, the reciprocal of a block's scale is computed once per block (a NaN scale still gives
// NaN values).
EPFLOW_HD __nv_fp8_storage_t quantize(float v, float scale) {
  return __nv_cvt_float_to_fp8(v * (1.0f / scale), __NV_SATFINITE, __NV_E4M3);
}

// Two values of one block, v0 in the low byte: quantize(v0, scale) | quantize(v1, scale) << 8.
// NOTES: on the device one conversion instruction makes both bytes (the same rounding).
EPFLOW_HD uint16_t quantize_pair(float v0, float v1, float scale) {
#ifdef __CUDA_ARCH__
  const float inv = 1.0f / scale;
  return __nv_cvt_float2_to_fp8x2(make_float2(v0 * inv, v1 * inv), __NV_SATFINITE, __NV_E4M3);
#else
  return static_cast<uint16_t>(quantize(v0, scale) | quantize(v1, scale) << 8);
#endif
}
// Four values of one block, v[0] in the low byte.
EPFLOW_HD uint32_t quantize_quad(const float* v, float scale) {
  return uint32_t{quantize_pair(v[0], v[1], scale)} |
         uint32_t{quantize_pair(v[2], v[3], scale)} << 16;
}

// max(a, b) of two magnitudes where a NaN wins (fmaxf would drop it): a block's amax.
// NOTES: on the device one max.NaN instruction instead of two compares, a max and a select.
EPFLOW_HD float amax_nan(float a, float b) {
#ifdef __CUDA_ARCH__
  float m;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(m) : "f"(a), "f"(b));
  return m;
#else
  return (a != a || b != b) ? NAN : fmaxf(a, b);
#endif
}

// A row of cols e4m3 values followed by its ceil(cols / 128) fp32 scales, padded to 16 bytes
// (the unit of a bulk copy): how the FP8 layer keeps x rows on the wire and x and h rows in its
// ring, so one copy moves a row with its scales.
EPFLOW_HD int64_t packed_row_bytes(int64_t cols) {
  const int64_t scale_bytes = (cols + kBlock - 1) / kBlock * 4;
  return cols + (scale_bytes + 15) / 16 * 16;
}

// The float an e4m3 byte holds.
EPFLOW_HD float to_float(__nv_fp8_storage_t q) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(q, __NV_E4M3)));
}

}  // namespace epflow::fp8
