// What bounds the FP8 weight gradients' operand passes (README.md): the library's four passes at
// DeepSeek-V3's shapes, against plain copies of the same bytes, contiguous and in the passes'
// access pattern (a CTA reads R rows x C bytes of a row-major matrix and writes C rows x R bytes
// of its transpose's rows), for several tile shapes (R, C). Bytes only: the tile copies move the
// bytes without transposing them, so they time the pattern, not the work.
//   nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -Isrc \
//     experiments/operand_passes/pattern_probe.cu src/kernels/fp8_quantize.cu -o probe
//   ./probe TOKENS...
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "common/fp8_blocks.h"
#include "kernels/fp8_quantize.cuh"

#define CHECK(x)                                                                   \
  do {                                                                             \
    cudaError_t e_ = (x);                                                          \
    if (e_ != cudaSuccess) {                                                       \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,             \
                   cudaGetErrorString(e_));                                        \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

namespace {

constexpr int kThreads = 256;

// Valid e4m3 bytes (no NaN pattern) and scales of 1 in packed rows; bf16 values in [-1, 1).
__global__ void fill_bytes(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    p[i] = static_cast<uint8_t>(h & 0x6f);
  }
}
__global__ void fill_packed_scales(uint8_t* p, int64_t rows, int64_t cols, int64_t row_bytes) {
  const int64_t blocks = cols / 128;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < rows * blocks;
       i += int64_t{gridDim.x} * blockDim.x)
    reinterpret_cast<float*>(p + i / blocks * row_bytes + cols)[i % blocks] = 1.0f;
}
__global__ void fill_bf16(__nv_bfloat16* p, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x)
    p[i] = __float2bfloat16(static_cast<float>((i * 2654435761u >> 8) % 2048) / 1024.0f - 1.0f);
}

// src [rows, src_ld bytes] -> dst [cols, dst_ld bytes]: CTA (x, y) reads rows y R .. + R - 1,
// bytes x C .. + C - 1 (16-byte loads, all issued before any store to shared memory) and writes
// rows x C .. + C - 1 of dst, bytes y R .. + R - 1, from shared memory.
template <int R, int C>
__global__ void __launch_bounds__(kThreads) tile_move(const uint8_t* src, int64_t src_ld,
                                                      uint8_t* dst, int64_t dst_ld) {
  extern __shared__ uint4 smem[];
  constexpr int kLoads = R * C / 16 / kThreads;
  constexpr int kChunksIn = C / 16, kChunksOut = R / 16;
  const int64_t r0 = int64_t{blockIdx.y} * R, c0 = int64_t{blockIdx.x} * C;
  uint4 v[kLoads];
#pragma unroll
  for (int l = 0; l < kLoads; ++l) {
    const int i = l * kThreads + threadIdx.x, r = i / kChunksIn, ch = i % kChunksIn;
    v[l] = *reinterpret_cast<const uint4*>(src + (r0 + r) * src_ld + c0 + ch * 16);
  }
#pragma unroll
  for (int l = 0; l < kLoads; ++l) smem[l * kThreads + threadIdx.x] = v[l];
  __syncthreads();
#pragma unroll
  for (int l = 0; l < kLoads; ++l) {
    const int i = l * kThreads + threadIdx.x, c = i / kChunksOut, ch = i % kChunksOut;
    *reinterpret_cast<uint4*>(dst + (c0 + c) * dst_ld + r0 + ch * 16) =
        smem[(i * 7) % (R * C / 16)];
  }
}

float median_us(const std::function<void()>& launch, int warmup = 5, int iters = 20) {
  for (int i = 0; i < warmup; ++i) launch();
  std::vector<float> t;
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < iters; ++i) {
    CHECK(cudaEventRecord(a));
    launch();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1000.0f);
  }
  CHECK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void report(const char* what, int tokens, double bytes, float us) {
  std::printf("%-44s tokens %5d  %8.1f us  %7.1f MB  %6.2f TB/s\n", what, tokens, us, bytes / 1e6,
              bytes / us / 1e6);
}

template <int R, int C>
void time_tile_move(const char* name, int tokens, const uint8_t* src, int64_t rows, int64_t cols,
                    int64_t src_ld, uint8_t* dst) {
  const int smem = R * C;
  CHECK(cudaFuncSetAttribute(tile_move<R, C>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid(static_cast<unsigned>(cols / C), static_cast<unsigned>(rows / R));
  const float us = median_us([&] { tile_move<R, C><<<grid, kThreads, smem>>>(src, src_ld, dst, rows); });
  char label[96];
  std::snprintf(label, sizeof label, "%s tile copy R %d x C %d", name, R, C);
  report(label, tokens, 2.0 * rows * cols, us);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace epflow;
  std::vector<int> token_counts;
  for (int i = 1; i < argc; ++i) token_counts.push_back(std::atoi(argv[i]));
  if (token_counts.empty()) token_counts = {2048, 8192};
  const int64_t H = 7168, I = 2048, K = 8;
  for (int tokens : token_counts) {
    const int64_t rows = tokens * K;  // 32 experts with 128-row multiples: no padding needed here
    const int64_t packed = fp8::packed_row_bytes(H);
    const int64_t out_packed = fp8::packed_row_bytes(rows);
    uint8_t *src, *dst;
    __nv_bfloat16 *gu, *wh;
    float* block_scales;
    int64_t* d_rows;
    CHECK(cudaMalloc(&src, rows * packed));
    CHECK(cudaMalloc(&dst, H * out_packed));
    CHECK(cudaMalloc(&gu, rows * 2 * I * sizeof(__nv_bfloat16)));
    CHECK(cudaMalloc(&wh, rows * I * sizeof(__nv_bfloat16)));
    CHECK(cudaMalloc(&block_scales, (H / 128) * (rows / 128) * sizeof(float)));
    CHECK(cudaMalloc(&d_rows, sizeof(int64_t)));
    CHECK(cudaMemcpy(d_rows, &rows, sizeof rows, cudaMemcpyHostToDevice));
    fill_bytes<<<1024, kThreads>>>(src, rows * packed, 12345u);
    fill_packed_scales<<<1024, kThreads>>>(src, rows, H, packed);
    fill_bf16<<<1024, kThreads>>>(gu, rows * 2 * I);
    fill_bf16<<<1024, kThreads>>>(wh, rows * I);
    CHECK(cudaDeviceSynchronize());

    using kernels::TransposedScaling;
    const double packed_bytes = double(rows) * packed + double(H) * out_packed;
    report("dy pass (packed, 128x1)", tokens, packed_bytes, median_us([&] {
             CHECK(kernels::launch_requantize_transposed(src, rows, d_rows, H,
                                                         TransposedScaling::k128x1, false, dst,
                                                         nullptr, 0));
           }));
    report("x pass (packed, 128x128)", tokens, double(rows) * packed + double(H) * rows,
           median_us([&] {
             CHECK(kernels::launch_requantize_transposed(src, rows, d_rows, H,
                                                         TransposedScaling::k128x128, false, dst,
                                                         block_scales, 0));
           }));
    report("[dg|du] pass (bf16, 128x1)", tokens, double(rows) * 2 * I * 3, median_us([&] {
             CHECK(kernels::launch_quantize_transposed(gu, 2 * I, rows, d_rows, 2 * I,
                                                       TransposedScaling::k128x1, false, dst,
                                                       nullptr, 0));
           }));
    report("w.h pass (bf16, 128x128)", tokens, double(rows) * I * 3, median_us([&] {
             CHECK(kernels::launch_quantize_transposed(wh, I, rows, d_rows, I,
                                                       TransposedScaling::k128x128, false, dst,
                                                       block_scales, 0));
           }));
    report("contiguous copy (cudaMemcpyAsync)", tokens, 2.0 * rows * H, median_us([&] {
             CHECK(cudaMemcpyAsync(dst, src, rows * H, cudaMemcpyDeviceToDevice));
           }));
    // The packed passes' pattern: rows of 7392 bytes read, transposed rows of `rows` bytes written.
    time_tile_move<128, 128>("packed", tokens, src, rows, H, packed, dst);
    time_tile_move<128, 256>("packed", tokens, src, rows, H, packed, dst);
    time_tile_move<256, 128>("packed", tokens, src, rows, H, packed, dst);
    time_tile_move<256, 256>("packed", tokens, src, rows, H, packed, dst);
    time_tile_move<512, 128>("packed", tokens, src, rows, H, packed, dst);
    time_tile_move<128, 512>("packed", tokens, src, rows, H, packed, dst);
    CHECK(cudaFree(src));
    CHECK(cudaFree(dst));
    CHECK(cudaFree(gu));
    CHECK(cudaFree(wh));
    CHECK(cudaFree(block_scales));
    CHECK(cudaFree(d_rows));
  }
  return 0;
}
