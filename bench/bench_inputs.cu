#include <algorithm>
#include <cmath>
#include <numeric>

#include "bench_inputs.h"

namespace epflow::bench {

namespace {

__global__ void fill_kernel(__nv_bfloat16* dst, int64_t count, float scale, uint64_t key) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x)
    dst[i] = __float2bfloat16(unit_value(key, static_cast<uint64_t>(i)) * scale);
}

// Fills `order` with the indices of `score`: those of the k largest first, largest first (ties:
// smaller index first), then the rest in no particular order.
template <typename Score>
void largest_first(const std::vector<Score>& score, int32_t k, std::vector<int32_t>* order) {
  std::iota(order->begin(), order->end(), 0);
  std::partial_sort(order->begin(), order->begin() + k, order->end(), [&](int32_t a, int32_t b) {
    return score[a] != score[b] ? score[a] > score[b] : a < b;
  });
}

// zipf's lp_e = -ln(1 + r_e) of every global expert e (bench_inputs.h).
std::vector<double> zipf_log_popularity(uint64_t seed, int32_t num_experts) {
  const uint64_t rank_key = stream_key(seed, InputStream::kZipfRank, 0);
  std::vector<uint64_t> hash(num_experts);
  for (int32_t e = 0; e < num_experts; ++e) hash[e] = mix64(rank_key + e);
  std::vector<int32_t> by_hash(num_experts);
  std::iota(by_hash.begin(), by_hash.end(), 0);
  std::sort(by_hash.begin(), by_hash.end(), [&](int32_t a, int32_t b) {
    return hash[a] != hash[b] ? hash[a] < hash[b] : a < b;
  });
  std::vector<double> log_popularity(num_experts);
  for (int32_t place = 0; place < num_experts; ++place)
    log_popularity[by_hash[place]] = -std::log(1.0 + place);
  return log_popularity;
}

}  // namespace

cudaError_t fill_uniform_bf16(__nv_bfloat16* dst, int64_t count, float scale, uint64_t key,
                              cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  fill_kernel<<<1024, 256, 0, stream>>>(dst, count, scale, key);
  return cudaGetLastError();
}

Routing make_routing(uint64_t seed, uint32_t rank, int64_t tokens, int32_t num_experts,
                     int32_t top_k, RoutingKind kind) {
  Routing r;
  r.topk_idx.resize(tokens * top_k);
  r.topk_weights.resize(tokens * top_k);
  const uint64_t route_key = stream_key(seed, InputStream::kRoute, rank);
  const uint64_t weight_key = stream_key(seed, InputStream::kRouteWeight, rank);
  const bool zipf = kind == RoutingKind::kZipf;
  const std::vector<double> log_popularity =
      zipf ? zipf_log_popularity(seed, num_experts) : std::vector<double>{};
  std::vector<uint64_t> hash_score(zipf ? 0 : num_experts);
  std::vector<double> zipf_score(zipf ? num_experts : 0);
  std::vector<int32_t> order(num_experts);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int32_t e = 0; e < num_experts; ++e) {
      const uint64_t h = mix64(route_key + static_cast<uint64_t>(t) * num_experts + e);
      if (zipf) {
        const double u = static_cast<double>(2 * (h >> 12) + 1) * 0x1p-53;
        zipf_score[e] = log_popularity[e] - std::log(-std::log(u));
      } else {
        hash_score[e] = h >> 1;
      }
    }
    if (zipf)
      largest_first(zipf_score, top_k, &order);
    else
      largest_first(hash_score, top_k, &order);
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
