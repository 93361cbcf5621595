#include "device_fill.cuh"

namespace epflow::bench {

namespace {

__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__global__ void fill_kernel(__nv_bfloat16* dst, int64_t count, float scale, uint64_t seed) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    // Odd multiples of 2^-24 in (-1, 1): never zero.
    const uint64_t r = splitmix64(seed * 0x100000001B3ull + i);
    const float u = (static_cast<float>(r >> 40) * 2.0f + 1.0f) * (1.0f / 16777216.0f) - 1.0f;
    dst[i] = __float2bfloat16(u * scale);
  }
}

}  // namespace

cudaError_t fill_uniform_bf16(__nv_bfloat16* dst, int64_t count, float scale, uint64_t seed,
                              cudaStream_t stream) {
  fill_kernel<<<1024, 256, 0, stream>>>(dst, count, scale, seed);
  return cudaGetLastError();
}

}  // namespace epflow::bench
