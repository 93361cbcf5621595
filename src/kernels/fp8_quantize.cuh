// Block-scaled FP8 quantization on the device (src/common/fp8_blocks.h's rules, bit for bit the
// CPU reference's reference::quantize_rows_1x128 / quantize_blocks_128x128): bf16 in, e4m3
// bytes and fp32 scales out; and packed rows back to bf16 (the FP8 backward's weight gradients).
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

// Where launch_quantize_blocks_128x128 also writes each matrix transposed: element (r, c) of
// matrix m at q[m * matrix_stride + c * ld + r], block (rb, cb)'s scale at scales[m *
// scale_matrix_stride + cb * scale_ld + rb] (the same scale: block (a, b) of a matrix is block
// (b, a) of its transpose). Strides in bytes for q, in floats for scales; q null: no copy.
// The FP8 backward's GEMMs contract over the other dimension, and e4m3 wgmma reads K-major
// operands only; two matrices side by side in one (ld = twice their rows) make one operand.
struct TransposedCopy {
  uint8_t* q = nullptr;
  int64_t ld = 0, matrix_stride = 0;
  float* scales = nullptr;
  int64_t scale_ld = 0, scale_matrix_stride = 0;
};

// w [matrices, rows, cols] -> q (same shape, densely packed), scales [matrices,
// ceil(rows / 128), ceil(cols / 128)]. One matrix per expert: a block never spans two. Matrix i
// of w starts at w + i * w_stride (elements; 0: rows * cols, densely packed; a multiple of 8;
// negative: the matrices laid out from the last to the first); qt: the transposed copy, if any.
cudaError_t launch_quantize_blocks_128x128(const __nv_bfloat16* w, int64_t matrices, int64_t rows,
                                           int64_t cols, bool power_of_two_scales, uint8_t* q,
                                           float* scales, cudaStream_t stream, int64_t w_stride = 0,
                                           const TransposedCopy& qt = {});

// Packed rows [rows, fp8::packed_row_bytes(cols)] (e4m3 values, then their 1 x 128 scales) back
// to bf16 out [rows, cols] (each value times its block's scale, rounded to bf16), for the rows
// [0, *rows_on_device) with *rows_on_device <= max_rows read on the device (the backward's
// weight gradients read the routed rows the call has, without a host sync); cols a multiple of
// 128, both pointers 16-byte aligned; at most ctas CTAs.
cudaError_t launch_dequantize_rows_1x128(const uint8_t* packed, int64_t max_rows,
                                         const int64_t* rows_on_device, int64_t cols,
                                         __nv_bfloat16* out, int32_t ctas, cudaStream_t stream);

// The FP8 weight gradients' operands (docs/design/fp8_backward.md): x [rows, cols] (bf16, row
// stride ld elements; the pull table's rows, whose expert segments are whole 128-row blocks)
// quantized along its rows and written transposed, contiguous along the rows (the K-major
// operand of a GEMM whose K is the tokens), for rows [0, *rows_on_device) (read on the device, a
// multiple of 128, at most max_rows). k128x1: a scale per column per 128 rows, q [cols,
// fp8::packed_row_bytes(max_rows)] packed rows (row c: max_rows e4m3 values, then max_rows / 128
// scales; the GEMMs' row operand). k128x128: a scale per 128 x 128 block, q [cols, max_rows]
// e4m3 and block_scales [cols / 128, max_rows / 128] (the weights' layout). cols and max_rows
// multiples of 128, ld of 8; x and q 16-byte aligned.
enum class TransposedScaling { k128x1, k128x128 };
cudaError_t launch_quantize_transposed(const __nv_bfloat16* x, int64_t ld, int64_t max_rows,
                                       const int64_t* rows_on_device, int64_t cols,
                                       TransposedScaling scaling, bool power_of_two_scales,
                                       uint8_t* q, float* block_scales, cudaStream_t stream);
// The same from packed rows [max_rows, fp8::packed_row_bytes(cols)] (1 x 128 blocks, 16-byte
// aligned): bitwise launch_dequantize_rows_1x128 followed by launch_quantize_transposed, in one
// pass over half the bytes (the FP8 backward's dy and x rows into the weight gradients).
cudaError_t launch_requantize_transposed(const uint8_t* packed, int64_t max_rows,
                                         const int64_t* rows_on_device, int64_t cols,
                                         TransposedScaling scaling, bool power_of_two_scales,
                                         uint8_t* q, float* block_scales, cudaStream_t stream);

}  // namespace epflow::kernels
