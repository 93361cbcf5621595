// Probe (not the benchmark): the block-scaled FP8 grouped GEMM (kernels/fp8_grouped_gemm.cuh, the
// FP8 megakernel's mainloop) at the DeepSeek-V3 shapes (32 experts; gate|up 7168 -> 4096, down
// 2048 -> 7168) with random e4m3 operands (no NaN) and unit scales, 100 untimed (the sustained
// power state) and 20 timed calls per size, CUDA events, median. For the FP8 forward's
// development; the layer's figures come from epflow-bench.
#include <cuda_runtime.h>

#include <cstdint>
#include <algorithm>
#include <cstdio>
#include <vector>

#include "kernels/fp8_grouped_gemm.cuh"

namespace {

// Random e4m3 bytes without NaN (0x7F / 0xFF), from a hash of the index.
__global__ void fill_e4m3(uint8_t* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t z = (i + seed) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z ^= z >> 27;
    const uint8_t b = static_cast<uint8_t>(z) & 0xF7;  // exponent <= 14 or mantissa < 8: no NaN
    p[i] = b;
  }
}

__global__ void fill_ones(float* p, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    p[i] = 1.0f;
}

}  // namespace

int main() {
  const int32_t E = 32;
  struct Shape {
    const char* name;
    int64_t n, k;
  };
  for (const Shape& shape : {Shape{"gate|up 7168 -> 4096", 4096, 7168},
                             Shape{"down 2048 -> 7168", 7168, 2048}})
  for (int64_t per : {128, 512, 1024, 2048}) {
    const int64_t n = shape.n, k = shape.k;
    std::vector<int64_t> seg(E + 1);
    for (int32_t e = 0; e <= E; ++e) seg[e] = e * per;
    const int64_t rows = E * per;
    int64_t* d_seg = nullptr;
    uint8_t *a = nullptr, *w = nullptr;
    float *as = nullptr, *ws = nullptr;
    __nv_bfloat16* out = nullptr;
    cudaMalloc(&d_seg, (E + 1) * 8);
    cudaMemcpy(d_seg, seg.data(), (E + 1) * 8, cudaMemcpyHostToDevice);
    cudaMalloc(&a, rows * k);
    cudaMalloc(&w, E * n * k);
    cudaMalloc(&as, rows * (k / 128) * 4);
    cudaMalloc(&ws, E * (n / 128) * (k / 128) * 4);
    cudaMalloc(&out, rows * n * 2);
    fill_e4m3<<<1024, 256>>>(a, rows * k, 1);
    fill_e4m3<<<1024, 256>>>(w, E * n * k, 2);
    fill_ones<<<256, 256>>>(as, rows * (k / 128));
    fill_ones<<<256, 256>>>(ws, E * (n / 128) * (k / 128));
    epflow::kernels::Fp8GroupedGemmArgs g;
    g.segments = epflow::kernels::ExpertSegments{E, rows, d_seg, nullptr};
    g.n = n;
    g.k = k;
    g.a = a;
    g.a_scales = as;
    g.w = w;
    g.w_scales = ws;
    g.out = out;
    for (int i = 0; i < 100; ++i) epflow::kernels::launch_fp8_grouped_gemm(g, nullptr);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    std::vector<float> ms(20);
    for (int i = 0; i < 20; ++i) {
      cudaEventRecord(e0);
      epflow::kernels::launch_fp8_grouped_gemm(g, nullptr);
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      cudaEventElapsedTime(&ms[i], e0, e1);
    }
    std::sort(ms.begin(), ms.end());
    const double us = ms[10] * 1e3;
    std::printf("fp8 grouped GEMM, 32 experts x %lld rows, %s: median %.1f us, %.0f TFLOP/s (%s)\n",
                static_cast<long long>(per), shape.name, us, 2.0 * rows * n * k / us * 1e-6,
                cudaGetErrorString(cudaGetLastError()));
    for (void* p : {static_cast<void*>(d_seg), static_cast<void*>(a), static_cast<void*>(w),
                    static_cast<void*>(as), static_cast<void*>(ws), static_cast<void*>(out)})
      cudaFree(p);
  }
  return 0;
}
