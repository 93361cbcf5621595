// A warp copies one row of 16-byte vectors (local HBM or a peer's NVLink-mapped memory), with
// several loads in flight per lane before the first store so the link stays busy.
#pragma once

#include <cstdint>

namespace epflow::kernels {

template <int kUnroll = 4>
__device__ __forceinline__ void warp_copy_row(const int4* __restrict__ src, int4* __restrict__ dst,
                                              int64_t vecs, int lane) {
  int64_t i = lane;
  for (; i + 32 * (kUnroll - 1) < vecs; i += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = src[i + 32 * u];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[i + 32 * u] = v[u];
  }
  for (; i < vecs; i += 32) dst[i] = src[i];
}

}  // namespace epflow::kernels
