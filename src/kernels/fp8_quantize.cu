// Block-scaled FP8 quantization kernels (fp8_quantize.cuh): rows by 1 x 128 blocks (16 lanes
// per block where rows are whole blocks and aligned, a warp per block elsewhere), a CTA per
// 128 x 128 block of a matrix. Each finds its block's largest magnitude (a NaN wins),
// takes fp8::block_scale of it and writes every element's fp8::quantize: the reference's code.
#include "common/fp8_blocks.h"
#include "kernels/fp8_quantize.cuh"

namespace epflow::kernels {

namespace {

constexpr int kRowThreads = 256;    // 8 warps: 8 row blocks per CTA
constexpr int kBlockThreads = 256;  // one 128 x 128 block per CTA

__global__ void __launch_bounds__(kRowThreads)
    quantize_rows_kernel(const __nv_bfloat16* x, int64_t rows, int64_t cols, bool pow2,
                         uint8_t* q, int64_t q_stride, float* scales, int64_t scale_stride) {
  const int64_t blocks_per_row = (cols + fp8::kBlock - 1) / fp8::kBlock;
  const int64_t block = int64_t{blockIdx.x} * (kRowThreads / 32) + threadIdx.x / 32;
  if (block >= rows * blocks_per_row) return;
  const int lane = threadIdx.x % 32;
  const int64_t row = block / blocks_per_row, b = block % blocks_per_row;
  const int64_t c0 = b * fp8::kBlock + lane * 4;  // this lane's 4 columns
  const int64_t left = cols - c0;
  const int n = left >= 4 ? 4 : (left > 0 ? static_cast<int>(left) : 0);
  const __nv_bfloat16* src = x + row * cols + c0;
  uint8_t* dst = q + row * q_stride + c0;
  float v[4] = {0.0f, 0.0f, 0.0f, 0.0f}, m = 0.0f;
  // Whole aligned groups of 4 move as one 8-byte load and one 4-byte store.
  const bool vector = n == 4 && (reinterpret_cast<uintptr_t>(src) % 8 == 0) &&
                      (reinterpret_cast<uintptr_t>(dst) % 4 == 0);
  if (vector) {
    const uint2 raw = *reinterpret_cast<const uint2*>(src);
    const __nv_bfloat162* pair = reinterpret_cast<const __nv_bfloat162*>(&raw);
    v[0] = __low2float(pair[0]), v[1] = __high2float(pair[0]);
    v[2] = __low2float(pair[1]), v[3] = __high2float(pair[1]);
  } else {
    for (int i = 0; i < n; ++i) v[i] = __bfloat162float(src[i]);
  }
  for (int i = 0; i < n; ++i) m = fp8::amax_nan(m, fabsf(v[i]));
  for (int off = 16; off > 0; off /= 2) m = fp8::amax_nan(m, __shfl_xor_sync(0xffffffffu, m, off));
  const float scale = fp8::block_scale(m, pow2);
  if (vector) {
    *reinterpret_cast<uint32_t*>(dst) = fp8::quantize_quad(v, scale);
  } else {
    for (int i = 0; i < n; ++i) dst[i] = fp8::quantize(v[i], scale);
  }
  if (lane == 0) scales[row * scale_stride + b] = scale;
}

// Whole 128-column blocks of aligned rows (the layer's x): 16 lanes per block, each with 8
// columns as one 16-byte load and one 8-byte store; a warp takes kVecBlocksPerWarp blocks and
// issues all its loads before it reduces any, so enough bytes are in flight to run at the HBM
// rate (one 8-byte load per lane and block leaves it latency-bound).
constexpr int kVecBlocksPerWarp = 4;

__global__ void __launch_bounds__(kRowThreads)
    quantize_rows_vec_kernel(const __nv_bfloat16* x, int64_t rows, int64_t cols, bool pow2,
                             uint8_t* q, int64_t q_stride, float* scales, int64_t scale_stride) {
  // NOTES: 32-bit block indices (the launcher checks they fit): a 64-bit division is a long
  // instruction sequence, per 16 bytes each lane moves.
  constexpr int kPasses = kVecBlocksPerWarp / 2;
  const uint32_t blocks_per_row = static_cast<uint32_t>(cols / fp8::kBlock);
  const uint32_t total = static_cast<uint32_t>(rows) * blocks_per_row;
  const uint32_t warp = blockIdx.x * (kRowThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32, col = 8 * (lane % 16);
  int64_t row[kPasses], b[kPasses];
  uint4 raw[kPasses];
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const uint32_t block = warp * kVecBlocksPerWarp + 2 * p + lane / 16;
    row[p] = block < total ? int64_t{block / blocks_per_row} : int64_t{-1};
    b[p] = block < total ? int64_t{block % blocks_per_row} : int64_t{0};
    raw[p] = row[p] >= 0 ? *reinterpret_cast<const uint4*>(x + row[p] * cols +
                                                           b[p] * fp8::kBlock + col)
                         : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    float v[8], m = 0.0f;
    const __nv_bfloat162* pair = reinterpret_cast<const __nv_bfloat162*>(&raw[p]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = __low2float(pair[i]), v[2 * i + 1] = __high2float(pair[i]);
      m = fp8::amax_nan(m, fp8::amax_nan(fabsf(v[2 * i]), fabsf(v[2 * i + 1])));
    }
    for (int off = 8; off > 0; off /= 2)  // within the block's 16 lanes
      m = fp8::amax_nan(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (row[p] < 0) continue;
    const float scale = fp8::block_scale(m, pow2);
    *reinterpret_cast<uint2*>(q + row[p] * q_stride + b[p] * fp8::kBlock + col) =
        make_uint2(fp8::quantize_quad(v, scale), fp8::quantize_quad(v + 4, scale));
    if (col == 0) scales[row[p] * scale_stride + b[p]] = scale;
  }
}

// The block's e4m3 bytes, staged for the transposed copy already transposed: column c's 128
// bytes (the transposed block's row c, in row order) at c * 128, its 16-byte chunks swizzled by
// c / 8 (the vector path's warps write eight columns apart; the chunk reads stay whole rows).
__device__ __forceinline__ int transposed_offset(int r, int c) {
  return c * fp8::kBlock + ((r / 16) ^ (c / 8 % 8)) * 16 + r % 16;
}

// Block (rb, cb)'s bytes from `tile` (transposed_offset's layout) into its transposed place in
// t (matrix `matrix`): thread t writes 16-byte chunks of the transposed block's rows (8 per row,
// a warp four whole rows), or bytes where the block is partial or the rows are not 16-byte
// aligned.
__device__ void store_transposed(const uint8_t* tile, const TransposedCopy& t, int64_t matrix,
                                 int64_t r0, int64_t c0, int64_t nr, int64_t nc) {
  uint8_t* base = t.q + matrix * t.matrix_stride;
  const bool chunks = nr == fp8::kBlock && t.ld % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(base) % 16 == 0;
  for (int id = threadIdx.x; id < fp8::kBlock * 8; id += kBlockThreads) {
    const int oc = id / 8, ch = id % 8;
    if (oc >= nc) continue;
    uint8_t* dst = base + (c0 + oc) * t.ld + r0 + ch * 16;
    if (chunks) {
      *reinterpret_cast<uint4*>(dst) =
          *reinterpret_cast<const uint4*>(tile + transposed_offset(ch * 16, oc));
    } else {
      for (int r = ch * 16; r < ch * 16 + 16 && r < nr; ++r)
        dst[r - ch * 16] = tile[transposed_offset(r, oc)];
    }
  }
}

// NOTES: five CTAs per SM (48 registers, no spills): this pass is bandwidth-bound, and its loads
// in flight per SM are what set its rate.
__global__ void __launch_bounds__(kBlockThreads, 5)
    quantize_blocks_kernel(const __nv_bfloat16* w, int64_t w_stride, int64_t rows, int64_t cols,
                           bool pow2, uint8_t* q, float* scales, TransposedCopy qt) {
  const int64_t row_blocks = (rows + fp8::kBlock - 1) / fp8::kBlock;
  const int64_t col_blocks = (cols + fp8::kBlock - 1) / fp8::kBlock;
  const int64_t matrix = blockIdx.z, rb = blockIdx.y, cb = blockIdx.x;
  const int64_t r0 = rb * fp8::kBlock, c0 = cb * fp8::kBlock;
  const int64_t nr = rows - r0 < fp8::kBlock ? rows - r0 : fp8::kBlock;
  const int64_t nc = cols - c0 < fp8::kBlock ? cols - c0 : fp8::kBlock;
  const __nv_bfloat16* src = w + matrix * w_stride;
  uint8_t* dst = q + matrix * rows * cols;
  __shared__ alignas(16) uint8_t tile[fp8::kBlock * fp8::kBlock];  // for qt only
  // Whole 128-column blocks of aligned rows: thread t holds 8 columns c0 + 8 (t % 16) .. + 7 of
  // rows 4 (t / 16) .. + 3 and 64 + 4 (t / 16) .. + 3 in registers (16-byte loads, one pass over
  // memory; four consecutive rows, so that the transposed copy's bytes of a column leave as
  // 4-byte words, transposed in registers). Otherwise thread t reads column c0 + t % 128 of rows
  // t / 128, + 2, ... twice (amax, then the values).
  constexpr int kVecRowStep = kBlockThreads / 16, kVecPasses = fp8::kBlock / kVecRowStep;
  static_assert(kVecPasses == 8, "two groups of four consecutive rows per thread");
  auto vec_row = [](int vfirst, int p) { return p / 4 * (fp8::kBlock / 2) + 4 * vfirst + p % 4; };
  const bool vector = nc == fp8::kBlock && cols % 8 == 0 &&
                      reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(dst) % 8 == 0;
  const int vcol = 8 * (threadIdx.x % 16), vfirst = threadIdx.x / 16;
  const int col = threadIdx.x % fp8::kBlock, first = threadIdx.x / fp8::kBlock;
  // NOTES: the rows stay bf16 in registers (half the registers of floats: more CTAs per SM, more
  // loads in flight for this bandwidth-bound pass); the amax of bf16 magnitudes is exact, NaN
  // winning as fp8::amax_nan's.
  uint4 raw[kVecPasses];
  float m = 0.0f;
  if (vector) {
    __nv_bfloat162 m2 = __float2bfloat162_rn(0.0f);
#pragma unroll
    for (int p = 0; p < kVecPasses; ++p) {
      const int64_t r = vec_row(vfirst, p);
      raw[p] = make_uint4(0, 0, 0, 0);
      if (r < nr) raw[p] = *reinterpret_cast<const uint4*>(src + (r0 + r) * cols + c0 + vcol);
    }
#pragma unroll
    for (int p = 0; p < kVecPasses; ++p) {
      const __nv_bfloat162* pair = reinterpret_cast<const __nv_bfloat162*>(&raw[p]);
#pragma unroll
      for (int i = 0; i < 4; ++i) m2 = __hmax2_nan(m2, __habs2(pair[i]));
    }
    m = fp8::amax_nan(__low2float(m2), __high2float(m2));
  } else if (col < nc) {
    for (int64_t r = first; r < nr; r += kBlockThreads / fp8::kBlock)
      m = fp8::amax_nan(m, fabsf(__bfloat162float(src[(r0 + r) * cols + c0 + col])));
  }
  for (int off = 16; off > 0; off /= 2) m = fp8::amax_nan(m, __shfl_xor_sync(0xffffffffu, m, off));
  __shared__ float warp_max[kBlockThreads / 32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  m = warp_max[0];
  for (int i = 1; i < kBlockThreads / 32; ++i) m = fp8::amax_nan(m, warp_max[i]);
  const float scale = fp8::block_scale(m, pow2);
  if (vector) {
    uint2 bytes[kVecPasses];  // rows past nr: zeros (their raw values), never stored
#pragma unroll
    for (int p = 0; p < kVecPasses; ++p) {
      const int64_t r = vec_row(vfirst, p);
      const __nv_bfloat162* pair = reinterpret_cast<const __nv_bfloat162*>(&raw[p]);
      float v[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) v[2 * i] = __low2float(pair[i]), v[2 * i + 1] = __high2float(pair[i]);
      bytes[p] = make_uint2(fp8::quantize_quad(v, scale), fp8::quantize_quad(v + 4, scale));
      if (r < nr) *reinterpret_cast<uint2*>(dst + (r0 + r) * cols + c0 + vcol) = bytes[p];
    }
    if (qt.q)
#pragma unroll
      for (int g = 0; g < kVecPasses / 4; ++g)
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // columns vcol + 4h .. + 3, rows vec_row(vfirst, 4g) ..
          const uint32_t a = h ? bytes[4 * g].y : bytes[4 * g].x;
          const uint32_t b = h ? bytes[4 * g + 1].y : bytes[4 * g + 1].x;
          const uint32_t c = h ? bytes[4 * g + 2].y : bytes[4 * g + 2].x;
          const uint32_t d = h ? bytes[4 * g + 3].y : bytes[4 * g + 3].x;
          // A 4 x 4 byte transpose: word i = column i's bytes of rows a, b, c, d (a lowest).
          const uint32_t ab01 = __byte_perm(a, b, 0x5140), ab23 = __byte_perm(a, b, 0x7362);
          const uint32_t cd01 = __byte_perm(c, d, 0x5140), cd23 = __byte_perm(c, d, 0x7362);
          const uint32_t words[4] = {
              __byte_perm(ab01, cd01, 0x5410), __byte_perm(ab01, cd01, 0x7632),
              __byte_perm(ab23, cd23, 0x5410), __byte_perm(ab23, cd23, 0x7632)};
          const int r = vec_row(vfirst, 4 * g);
#pragma unroll
          for (int i = 0; i < 4; ++i)
            *reinterpret_cast<uint32_t*>(tile + transposed_offset(r, vcol + 4 * h + i)) = words[i];
        }
  } else if (col < nc) {
    for (int64_t r = first; r < nr; r += kBlockThreads / fp8::kBlock) {
      const int64_t at = (r0 + r) * cols + c0 + col;
      dst[at] = fp8::quantize(__bfloat162float(src[at]), scale);
      if (qt.q) tile[transposed_offset(static_cast<int>(r), col)] = dst[at];
    }
  }
  if (threadIdx.x == 0) {
    scales[(matrix * row_blocks + rb) * col_blocks + cb] = scale;
    if (qt.q) qt.scales[matrix * qt.scale_matrix_stride + cb * qt.scale_ld + rb] = scale;
  }
  if (qt.q) {
    __syncthreads();
    store_transposed(tile, qt, matrix, r0, c0, nr, nc);
  }
}

// 16 e4m3 values of one block (a 16-byte load) times its scale, rounded to bf16: two 16-byte
// words of 8 bf16 each, out[0] the first 8. NOTES: one conversion instruction per two bytes
// (e4m3x2 to f16x2, exact): the same values as fp8::to_float byte by byte, which converts one.
__device__ void dequantize_16(uint4 q, float scale, uint4* out) {
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
  uint32_t pairs[8];
#pragma unroll
  for (int w = 0; w < 4; ++w)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>(words[w] >> (16 * h)), __NV_E4M3);
      const float2 f = __half22float2(__half2(raw));
      const __nv_bfloat162 b = __floats2bfloat162_rn(f.x * scale, f.y * scale);
      pairs[2 * w + h] = *reinterpret_cast<const uint32_t*>(&b);
    }
  out[0] = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
  out[1] = make_uint4(pairs[4], pairs[5], pairs[6], pairs[7]);
}

// Packed rows back to bf16: thread t of the grid-stride loop turns 16 e4m3 bytes of a row
// (a 16-byte load) into 16 bf16 values (two 16-byte stores) with their block's scale.
__global__ void __launch_bounds__(kRowThreads)
    dequantize_rows_kernel(const uint8_t* packed, int64_t row_bytes, const int64_t* rows_on_device,
                           int64_t cols, __nv_bfloat16* out) {
  const int64_t chunks = cols / 16, total = *rows_on_device * chunks;
  for (int64_t i = int64_t{blockIdx.x} * kRowThreads + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * kRowThreads) {
    const int64_t row = i / chunks, col = i % chunks * 16;
    const uint8_t* src = packed + row * row_bytes;
    dequantize_16(*reinterpret_cast<const uint4*>(src + col),
                  reinterpret_cast<const float*>(src + cols)[col / fp8::kBlock],
                  reinterpret_cast<uint4*>(out + row * cols + col));
  }
}

// Where a transposed quantization reads its rows, loaded a 128 x 128 tile at a time into
// tile[128][kTileLd] bf16 by a CTA of kBlockThreads: bf16 rows with a row stride, or packed
// 1 x 128 rows, dequantized as dequantize_rows_kernel does (so the result is bitwise that of
// dequantizing first), reading half the bytes and writing none. Every thread issues all its
// 16-byte loads before it stores any into the tile: the loads in flight set the pass's rate.
constexpr int kTileLd = fp8::kBlock + 8;  // bf16; +8: rows 16 bytes apart in the banks
struct Bf16Rows {
  const __nv_bfloat16* x;
  int64_t ld;
  __device__ void load(__nv_bfloat16 (*tile)[kTileLd], int64_t r0, int64_t c0) const {
    constexpr int kB = fp8::kBlock, kLoads = kB * kB / 8 / kBlockThreads;
    uint4 raw[kLoads];
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int i = l * kBlockThreads + threadIdx.x, r = i / (kB / 8), ch = i % (kB / 8);
      raw[l] = *reinterpret_cast<const uint4*>(x + (r0 + r) * ld + c0 + ch * 8);
    }
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int i = l * kBlockThreads + threadIdx.x, r = i / (kB / 8), ch = i % (kB / 8);
      *reinterpret_cast<uint4*>(&tile[r][ch * 8]) = raw[l];
    }
  }
};
struct PackedRows {
  const uint8_t* packed;
  int64_t cols;
  __device__ void load(__nv_bfloat16 (*tile)[kTileLd], int64_t r0, int64_t c0) const {
    constexpr int kB = fp8::kBlock, kLoads = kB * kB / 16 / kBlockThreads;
    const int64_t row_bytes = fp8::packed_row_bytes(cols);
    uint4 raw[kLoads];
    float scale[kLoads];
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int i = l * kBlockThreads + threadIdx.x, r = i / (kB / 16), ch = i % (kB / 16);
      const uint8_t* src = packed + (r0 + r) * row_bytes;
      raw[l] = *reinterpret_cast<const uint4*>(src + c0 + ch * 16);
      scale[l] = reinterpret_cast<const float*>(src + cols)[c0 / kB];
    }
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int i = l * kBlockThreads + threadIdx.x, r = i / (kB / 16), ch = i % (kB / 16);
      dequantize_16(raw[l], scale[l], reinterpret_cast<uint4*>(&tile[r][ch * 16]));
    }
  }
};

// One CTA per 128 x 128 tile of x (rows r0.., columns c0..): the tile through shared memory;
// thread t takes columns 2p, 2p + 1 (p = t % 64) of rows 32 (t / 64) .. + 31, one 4-byte shared
// load per row for both, kept in registers: their magnitudes' packed bf16 maximum (exact, a NaN
// winning as fp8::amax_nan's), the columns' (k128x1) or the tile's (k128x128) amax through
// shared memory, then the 64 values' e4m3 bytes. NOTES: the bytes go out through shared memory,
// transposed row c of q as whole 128-byte lines (a warp stores four): each thread storing its
// own bytes to its own row wrote half-sectors. A thread per column, reading the tile twice (for
// the amax, then the values) two bytes per shared load, issued about twice the shared loads and
// conversions; the pass runs well below the HBM rate, partly held by them (docs/benchmarks.md).
template <TransposedScaling kScaling, typename Source>
__global__ void __launch_bounds__(kBlockThreads, 4)  // four tiles (52 KB of shared memory) per SM
    quantize_transposed_kernel(Source source, int64_t max_rows, const int64_t* rows_on_device,
                               bool pow2, uint8_t* q, float* block_scales) {
  constexpr int kB = fp8::kBlock, kChunks = kB / 16;  // 16-byte chunks of a 128-byte row
  constexpr int kQuarters = kBlockThreads / (kB / 2), kRows = kB / kQuarters;
  static_assert(kRows == 32, "a thread's 32 rows: two 16-byte chunks of each of its columns");
  const int64_t r0 = int64_t{blockIdx.y} * kB, c0 = int64_t{blockIdx.x} * kB;
  if (r0 >= *rows_on_device) return;
  __shared__ alignas(16) __nv_bfloat16 tile[kB][kTileLd];
  // The e4m3 tile transposed: row c's chunk k at out[c][k ^ (c / 2) % 8] (the swizzle spreads
  // both a quarter-warp's stores, eight even or odd rows, and its loads over the banks).
  __shared__ uint4 out[kB][kChunks];
  __shared__ float amax_of[kQuarters][kB];
  source.load(tile, r0, c0);
  __syncthreads();
  const int pair = threadIdx.x % (kB / 2), quarter = threadIdx.x / (kB / 2);
  __nv_bfloat162 v[kRows];
  __nv_bfloat162 m2 = __float2bfloat162_rn(0.0f);
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    v[i] = *reinterpret_cast<const __nv_bfloat162*>(&tile[quarter * kRows + i][2 * pair]);
    m2 = __hmax2_nan(m2, __habs2(v[i]));
  }
  amax_of[quarter][2 * pair] = __low2float(m2);
  amax_of[quarter][2 * pair + 1] = __high2float(m2);
  __syncthreads();
  float scale[2];
  if constexpr (kScaling == TransposedScaling::k128x1) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int col = 2 * pair + h;
      scale[h] = fp8::block_scale(fp8::amax_nan(fp8::amax_nan(amax_of[0][col], amax_of[1][col]),
                                                fp8::amax_nan(amax_of[2][col], amax_of[3][col])),
                                  pow2);
    }
  } else {
    if (threadIdx.x < 32) {  // the tile's amax: a warp over the partial ones
      float t = 0.0f;
      for (int i = threadIdx.x; i < kQuarters * kB; i += 32)
        t = fp8::amax_nan(t, amax_of[i / kB][i % kB]);
      for (int off = 16; off > 0; off /= 2) t = fp8::amax_nan(t, __shfl_xor_sync(0xffffffffu, t, off));
      if (threadIdx.x == 0) amax_of[0][0] = t;
    }
    __syncthreads();
    scale[0] = scale[1] = fp8::block_scale(amax_of[0][0], pow2);
  }
  // Column 2 pair + h's bytes of rows 32 quarter + 4 g .. + 3: word g % 4 of chunk 2 quarter + g / 4.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int col = 2 * pair + h;
    uint32_t word[kRows / 4];
#pragma unroll
    for (int g = 0; g < kRows / 4; ++g) {
      float f[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) f[j] = h ? __high2float(v[4 * g + j]) : __low2float(v[4 * g + j]);
      word[g] = fp8::quantize_quad(f, scale[h]);
    }
#pragma unroll
    for (int k = 0; k < 2; ++k)
      out[col][(2 * quarter + k) ^ (col / 2 % 8)] =
          make_uint4(word[4 * k], word[4 * k + 1], word[4 * k + 2], word[4 * k + 3]);
  }
  const int64_t row_bytes =
      kScaling == TransposedScaling::k128x1 ? fp8::packed_row_bytes(max_rows) : max_rows;
  if constexpr (kScaling == TransposedScaling::k128x1) {
    if (quarter == 0)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        reinterpret_cast<float*>(q + (c0 + 2 * pair + h) * row_bytes + max_rows)[r0 / kB] = scale[h];
  } else {
    if (threadIdx.x == 0) block_scales[(c0 / kB) * (max_rows / kB) + r0 / kB] = scale[0];
  }
  __syncthreads();
#pragma unroll
  for (int l = 0; l < kB * kChunks / kBlockThreads; ++l) {
    const int i = l * kBlockThreads + threadIdx.x, c = i / kChunks, k = i % kChunks;
    reinterpret_cast<uint4*>(q + (c0 + c) * row_bytes + r0)[k] = out[c][k ^ (c / 2 % 8)];
  }
}

template <typename Source>
cudaError_t quantize_transposed(Source source, bool source_ok, int64_t max_rows,
                                const int64_t* rows_on_device, int64_t cols,
                                TransposedScaling scaling, bool pow2, uint8_t* q,
                                float* block_scales, cudaStream_t stream) {
  constexpr int64_t kB = fp8::kBlock;
  if (max_rows < 0 || max_rows % kB != 0 || cols <= 0 || cols % kB != 0 || !source_ok ||
      max_rows / kB > 65535 ||
      (max_rows > 0 &&
       (!rows_on_device || !q || (scaling == TransposedScaling::k128x128 && !block_scales))) ||
      reinterpret_cast<uintptr_t>(q) % 16 != 0)
    return cudaErrorInvalidValue;
  if (max_rows == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(cols / kB), static_cast<unsigned>(max_rows / kB));
  if (scaling == TransposedScaling::k128x1)
    quantize_transposed_kernel<TransposedScaling::k128x1><<<grid, kBlockThreads, 0, stream>>>(
        source, max_rows, rows_on_device, pow2, q, block_scales);
  else
    quantize_transposed_kernel<TransposedScaling::k128x128><<<grid, kBlockThreads, 0, stream>>>(
        source, max_rows, rows_on_device, pow2, q, block_scales);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_quantize_rows_1x128(const __nv_bfloat16* x, int64_t rows, int64_t cols,
                                       bool pow2, uint8_t* q, float* scales,
                                       cudaStream_t stream, int64_t q_stride,
                                       int64_t scale_stride) {
  const int64_t blocks_per_row = (cols + fp8::kBlock - 1) / fp8::kBlock;
  if (q_stride == 0) q_stride = cols;
  if (scale_stride == 0) scale_stride = blocks_per_row;
  if (rows < 0 || cols <= 0 || q_stride < cols || scale_stride < blocks_per_row ||
      (rows > 0 && (!x || !q || !scales)))
    return cudaErrorInvalidValue;
  const int64_t blocks = rows * blocks_per_row;
  if (blocks == 0) return cudaSuccess;
  if (cols % fp8::kBlock == 0 && blocks + kRowThreads < (int64_t{1} << 32) &&
      reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(q) % 8 == 0 && q_stride % 8 == 0) {
    constexpr int64_t kPerCta = kRowThreads / 32 * kVecBlocksPerWarp;
    quantize_rows_vec_kernel<<<static_cast<unsigned>((blocks + kPerCta - 1) / kPerCta),
                               kRowThreads, 0, stream>>>(x, rows, cols, pow2, q, q_stride, scales,
                                                         scale_stride);
    return cudaGetLastError();
  }
  const int64_t grid = (blocks + kRowThreads / 32 - 1) / (kRowThreads / 32);
  quantize_rows_kernel<<<static_cast<unsigned>(grid), kRowThreads, 0, stream>>>(
      x, rows, cols, pow2, q, q_stride, scales, scale_stride);
  return cudaGetLastError();
}

cudaError_t launch_quantize_blocks_128x128(const __nv_bfloat16* w, int64_t matrices, int64_t rows,
                                           int64_t cols, bool pow2, uint8_t* q, float* scales,
                                           cudaStream_t stream, int64_t w_stride,
                                           const TransposedCopy& qt) {
  if (w_stride == 0) w_stride = rows * cols;
  if (matrices < 0 || rows <= 0 || cols <= 0 || matrices > 65535 ||
      (w_stride < 0 ? -w_stride : w_stride) < rows * cols || w_stride % 8 != 0 ||
      (matrices > 0 && (!w || !q || !scales)) ||
      (qt.q && (!qt.scales || qt.ld < rows || qt.matrix_stride < cols * qt.ld ||
                qt.scale_ld < (rows + fp8::kBlock - 1) / fp8::kBlock)))
    return cudaErrorInvalidValue;
  if (matrices == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((cols + fp8::kBlock - 1) / fp8::kBlock),
                  static_cast<unsigned>((rows + fp8::kBlock - 1) / fp8::kBlock),
                  static_cast<unsigned>(matrices));
  quantize_blocks_kernel<<<grid, kBlockThreads, 0, stream>>>(w, w_stride, rows, cols, pow2, q,
                                                             scales, qt);
  return cudaGetLastError();
}

cudaError_t launch_dequantize_rows_1x128(const uint8_t* packed, int64_t max_rows,
                                         const int64_t* rows_on_device, int64_t cols,
                                         __nv_bfloat16* out, int32_t ctas, cudaStream_t stream) {
  if (max_rows < 0 || cols <= 0 || cols % fp8::kBlock != 0 || ctas <= 0 ||
      (max_rows > 0 && (!packed || !rows_on_device || !out)) ||
      reinterpret_cast<uintptr_t>(packed) % 16 != 0 || reinterpret_cast<uintptr_t>(out) % 16 != 0)
    return cudaErrorInvalidValue;
  if (max_rows == 0) return cudaSuccess;
  const int64_t needed = (max_rows * (cols / 16) + kRowThreads - 1) / kRowThreads;
  dequantize_rows_kernel<<<static_cast<unsigned>(needed < ctas ? needed : ctas), kRowThreads, 0,
                           stream>>>(packed, fp8::packed_row_bytes(cols), rows_on_device, cols,
                                     out);
  return cudaGetLastError();
}

cudaError_t launch_quantize_transposed(const __nv_bfloat16* x, int64_t ld, int64_t max_rows,
                                       const int64_t* rows_on_device, int64_t cols,
                                       TransposedScaling scaling, bool pow2, uint8_t* q,
                                       float* block_scales, cudaStream_t stream) {
  const bool x_ok = ld >= cols && ld % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                    (max_rows == 0 || x);
  return quantize_transposed(Bf16Rows{x, ld}, x_ok, max_rows, rows_on_device, cols, scaling, pow2,
                             q, block_scales, stream);
}

cudaError_t launch_requantize_transposed(const uint8_t* packed, int64_t max_rows,
                                         const int64_t* rows_on_device, int64_t cols,
                                         TransposedScaling scaling, bool pow2, uint8_t* q,
                                         float* block_scales, cudaStream_t stream) {
  const bool packed_ok =
      reinterpret_cast<uintptr_t>(packed) % 16 == 0 && (max_rows == 0 || packed);
  return quantize_transposed(PackedRows{packed, cols}, packed_ok, max_rows, rows_on_device, cols,
                             scaling, pow2, q, block_scales, stream);
}

}  // namespace epflow::kernels
