#include <algorithm>
#include <numeric>

#include "bench_inputs.h"

namespace epflow::bench {

namespace {

__global__ void fill_kernel(__nv_bfloat16* dst, int64_t count, float scale, uint64_t key) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x)
    dst[i] = __float2bfloat16(unit_value(key, static_cast<uint64_t>(i)) * scale);
}

}  // namespace

cudaError_t fill_uniform_bf16(__nv_bfloat16* dst, int64_t count, float scale, uint64_t key,
                              cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  fill_kernel<<<1024, 256, 0, stream>>>(dst, count, scale, key);
  return cudaGetLastError();
}

Routing make_routing(uint64_t seed, uint32_t rank, int64_t tokens, int32_t num_experts,
                     int32_t top_k) {
  Routing r;
  r.topk_idx.resize(tokens * top_k);
  r.topk_weights.resize(tokens * top_k);
  const uint64_t route_key = stream_key(seed, InputStream::kRoute, rank);
  const uint64_t weight_key = stream_key(seed, InputStream::kRouteWeight, rank);
  std::vector<uint64_t> score(num_experts);
  std::vector<int32_t> order(num_experts);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int32_t e = 0; e < num_experts; ++e)
      score[e] = mix64(route_key + static_cast<uint64_t>(t) * num_experts + e) >> 1;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [&](int32_t a, int32_t b) {
      return score[a] != score[b] ? score[a] > score[b] : a < b;
    });
    for (int32_t k = 0; k < top_k; ++k) {
      r.topk_idx[t * top_k + k] = order[k];
      const uint64_t u = mix64(weight_key + static_cast<uint64_t>(t) * top_k + k) >> 40;
      r.topk_weights[t * top_k + k] =
          0.05f + 0.95f * (static_cast<float>(u) * (1.0f / 16777216.0f));
    }
  }
  return r;
}

}  // namespace epflow::bench
