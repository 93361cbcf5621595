// What the FP8 grouped GEMM benchmarks share (epflow-fp8-gemm-bench and
// experiments/deepgemm_same_run): random e4m3 operands and block scales from a counter-based
// generator, device buffers, and exiting with a message on a CUDA error.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace epflow::bench {

// On a CUDA error: prints what failed and exits 1.
inline void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "FP8 GEMM benchmark: %s: %s\n", what, cudaGetErrorString(e));
  std::exit(1);
}

template <class T>
struct DeviceBuffer {
  T* p = nullptr;
  explicit DeviceBuffer(int64_t n) { check(cudaMalloc(&p, sizeof(T) * n), "cudaMalloc"); }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

template <class T>
std::vector<T> to_host(const T* p, int64_t n) {
  std::vector<T> v(n);
  check(cudaMemcpy(v.data(), p, sizeof(T) * n, cudaMemcpyDeviceToHost), "copy to host");
  return v;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The median time of `iters` calls of launch(), timed one by one with CUDA events on the default
// stream (each call waited for before the next starts), in microseconds.
template <class Launch>
double median_call_us(Launch&& launch, int iters) {
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "event");
  check(cudaEventCreate(&e1), "event");
  std::vector<double> us(iters);
  for (int i = 0; i < iters; ++i) {
    check(cudaEventRecord(e0), "event record");
    launch();
    check(cudaEventRecord(e1), "event record");
    check(cudaEventSynchronize(e1), "a timed call");
    float ms = 0.0f;
    check(cudaEventElapsedTime(&ms, e0, e1), "event time");
    us[i] = 1e3 * ms;
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return median(us);
}

// DeepSeek-V3's expert GEMM shapes are named "NAME K -> N".
struct Shape {
  const char* name;
  int64_t n, k;
};

__host__ __device__ inline uint64_t fp8_gemm_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Random e4m3 bytes without NaN (0x7F / 0xFF): any sign, exponent and mantissa but the NaN one.
static __global__ void fill_e4m3(uint8_t* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint8_t b = static_cast<uint8_t>(fp8_gemm_mix((i + 1) * 0x9E3779B97F4A7C15ull + seed));
    p[i] = (b & 0x7F) == 0x7F ? b ^ 0x01 : b;
  }
}

// Random scale number i: 2^u, u uniform in [-4, 4) (blocks of very different magnitudes).
__host__ __device__ inline float random_scale(int64_t i, uint64_t seed) {
  const uint64_t bits = fp8_gemm_mix((i + 1) * 0x9E3779B97F4A7C15ull + seed) >> 11;
  const double u = static_cast<double>(bits) / 9007199254740992.0;
  return exp2f(static_cast<float>(8.0 * u - 4.0));
}

static __global__ void fill_scales(float* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    p[i] = random_scale(i, seed);
}

}  // namespace epflow::bench
