// Block-scaled FP8 quantization on the device (src/common/fp8_blocks.h's rules, bit for bit the
// CPU reference's reference::quantize_rows_1x128 / quantize_blocks_128x128): bf16 in, e4m3
// bytes and fp32 scales out.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace epflow::kernels {

// x [rows, cols] -> q [rows, cols], scales [rows, ceil(cols / 128)]: row r's values at
// q + r * q_stride bytes, its scales at scales + r * scale_stride floats (0: densely packed; the
// FP8 layer writes packed rows, fp8::packed_row_bytes, into its window).
cudaError_t launch_quantize_rows_1x128(const __nv_bfloat16* x, int64_t rows, int64_t cols,
                                       bool power_of_two_scales, uint8_t* q, float* scales,
                                       cudaStream_t stream, int64_t q_stride = 0,
                                       int64_t scale_stride = 0);

// w [matrices, rows, cols] -> q (same shape, densely packed), scales [matrices,
// ceil(rows / 128), ceil(cols / 128)]. One matrix per expert: a block never spans two. Matrix i
// of w starts at w + i * w_stride (elements; 0: rows * cols, densely packed; a multiple of 8;
// negative: the matrices laid out from the last to the first). qt (optional, 16-byte aligned):
// the same bytes transposed, [matrices, cols, rows] (the FP8 backward's GEMMs contract over the
// other dimension, and e4m3 wgmma reads K-major operands only); block (a, b)'s scale serves
// block (b, a) of the transpose.
cudaError_t launch_quantize_blocks_128x128(const __nv_bfloat16* w, int64_t matrices, int64_t rows,
                                           int64_t cols, bool power_of_two_scales, uint8_t* q,
                                           float* scales, cudaStream_t stream, int64_t w_stride = 0,
                                           uint8_t* qt = nullptr);

}  // namespace epflow::kernels
