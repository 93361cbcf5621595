// The rate of the weight-gradient epilogue's conversions: fp32 pairs to packed bf16 pairs, per SM
// per cycle, with 256 threads per SM (the two consumer warpgroups), by `cvt.rn.bf16x2.f32`
// (SASS F2FP.BF16.F32.PACK_AB, 64 per thread per tile) and by integer round-to-nearest-even
// (add 0x7fff plus the kept lowest bit, then a byte permute: ALU instructions instead), each
// conversion's result fed back into the next by an XOR so that none can be hoisted. Also checks
// that the integer form equals cvt.rn on random finite values. Usage: conversion_rate.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

constexpr int kThreads = 256, kChains = 16, kIters = 4096;

__device__ __forceinline__ uint32_t pack_cvt(float lo, float hi) {
  uint32_t r;
  asm volatile("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ uint32_t pack_int(float lo, float hi) {
  const uint32_t a = __float_as_uint(lo), b = __float_as_uint(hi);
  const uint32_t ra = a + 0x7fffu + ((a >> 16) & 1u), rb = b + 0x7fffu + ((b >> 16) & 1u);
  return __byte_perm(ra, rb, 0x7632);  // the high halves: lo's in bits 0..15, hi's in 16..31
}

template <bool kInt>
__global__ void __launch_bounds__(kThreads, 1) rate(const float* in, uint32_t* out, long long* cycles) {
  float a[kChains], b[kChains];
  for (int i = 0; i < kChains; ++i)
    a[i] = in[(threadIdx.x * kChains + i) % 1024], b[i] = in[(threadIdx.x * kChains + i + 7) % 1024];
  __syncthreads();
  const long long t0 = clock64();
  for (int it = 0; it < kIters; ++it) {
#pragma unroll
    for (int i = 0; i < kChains; ++i) {
      const uint32_t p = kInt ? pack_int(a[i], b[i]) : pack_cvt(a[i], b[i]);
      a[i] = __uint_as_float(__float_as_uint(a[i]) ^ (p & 0x00ff00ffu));
    }
  }
  __syncthreads();
  const long long t1 = clock64();
  uint32_t acc = 0;
  for (int i = 0; i < kChains; ++i) acc ^= __float_as_uint(a[i]);
  out[blockIdx.x * kThreads + threadIdx.x] = acc;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

__global__ void compare(const float* in, int n, int* mismatches) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i + 1 < n; i += gridDim.x * blockDim.x)
    if (pack_int(in[i], in[i + 1]) != pack_cvt(in[i], in[i + 1])) atomicAdd(mismatches, 1);
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int n = 1 << 22;
  std::vector<float> host(n);
  uint64_t s = 0x9e3779b97f4a7c15ull;
  for (int i = 0; i < n; ++i) {  // finite values over many binades, both signs
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    uint32_t bits = static_cast<uint32_t>(s >> 32);
    if (((bits >> 23) & 0xff) == 0xff) bits &= 0xbfffffffu;  // no Inf / NaN
    host[i] = __builtin_bit_cast(float, bits);
  }
  float* in;
  uint32_t* out;
  long long* cycles;
  int* mismatches;
  cudaMalloc(&in, n * sizeof(float));
  cudaMalloc(&out, sms * kThreads * sizeof(uint32_t));
  cudaMalloc(&cycles, sms * sizeof(long long));
  cudaMalloc(&mismatches, sizeof(int));
  cudaMemcpy(in, host.data(), n * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemset(mismatches, 0, sizeof(int));
  compare<<<sms * 4, 256>>>(in, n, mismatches);
  int bad = -1;
  cudaMemcpy(&bad, mismatches, sizeof(int), cudaMemcpyDeviceToHost);
  std::printf("integer round-to-nearest-even against cvt.rn.bf16x2.f32: %d mismatches in %d pairs\n",
              bad, n - 1);
  for (int form = 0; form < 2; ++form) {
    for (int rep = 0; rep < 3; ++rep) {  // the first launch warms up
      if (form) rate<true><<<sms, kThreads>>>(in, out, cycles);
      else rate<false><<<sms, kThreads>>>(in, out, cycles);
    }
    if (cudaDeviceSynchronize() != cudaSuccess) return 1;
    std::vector<long long> c(sms);
    cudaMemcpy(c.data(), cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost);
    long long worst = 0;
    for (long long v : c) worst = v > worst ? v : worst;
    const double per_sm = double(kThreads) * kChains * kIters;
    std::printf("%s: %.1f conversions (fp32 pairs) per SM per cycle (slowest SM: %lld cycles)\n",
                form ? "integer rounding + byte permute" : "cvt.rn.bf16x2.f32", per_sm / worst,
                worst);
  }
  return 0;
}
