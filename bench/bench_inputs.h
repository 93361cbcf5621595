// Benchmark inputs from a counter-based generator (splitmix64 of a per-stream key plus the
// element index), so every system in a comparison sees the same numbers: epflow-bench and its
// NCCL+cuBLAS baseline here, and the NCCL+PyTorch baseline, which mirrors these functions in
// bench/baselines/inputs.py. Any change here must be made there too (the check mode of the
// Python script compares the two).
//
//   key(seed, stream, rank) = mix(seed ^ mix(stream << 32 | rank))
//   unit(key, i)  = (2v + 1) / 2^24 with v = ((mix(key + i) >> 40) & 0xFFFFFF) - 2^23:
//                   odd multiples of 2^-24 in (-1, 1), never zero, exact in fp32
//   x[t, h]                = bf16(unit(key(seed, kX, r), t * H + h))
//   dy[t, h]               = bf16(unit(key(seed, kDy, r), t * H + h))  (the backward's dL/dy)
//   gate/up[e, i, h]       = bf16(unit(key(seed, kGate|kUp, r), (e * I + i) * H + h) * H^-1/2)
//   down[e, h, i]          = bf16(unit(key(seed, kDown, r), (e * H + h) * I + i) * I^-1/2)
//   topk_idx[t, :]         = the K experts e with the largest score(t, e), largest first (ties:
//                            smaller e first), by the routing kind (RoutingKind, --routing), with
//                            h(t, e) = mix(key(seed, kRoute, r) + t * E + e):
//     uniform: h(t, e) >> 1, an integer
//     zipf:    lp_e - ln(-ln(u(t, e))) in double: Gumbel-top-k, so the K experts of a token are a
//              sample without replacement with probabilities p_e proportional to 1 / (1 + r_e)
//              r_e     = e's place, from 0, among the E experts sorted by
//                        mix(key(seed, kZipfRank, 0) + e) ascending (ties: smaller e first): rank
//                        0's key, so every rank ranks the experts alike
//              lp_e    = -ln(1 + r_e)
//              u(t, e) = (2 * (h(t, e) >> 12) + 1) * 2^-53: odd multiples of 2^-53 in (0, 1),
//                        exact in double (h >> 11 plus a half would round to 1.0 at the top)
//              ln is the C library's here and torch's float64 log in inputs.py: they may differ in
//              the last ulp, which reorders only scores within an ulp of each other (inputs.py's
//              selftest compares every topk_idx)
//   topk_weights[t, k]     = 0.05f + 0.95f * ((mix(key(seed, kRouteWeight, r) + t * K + k) >> 40)
//                            * 2^-24), in fp32 in that order, for every routing kind
// (e local to the rank for weights, global for routing; scales are 1.0f / sqrtf(fan_in)).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "common/hd.h"
#include "common/splitmix64.h"
#include "routing_kind.h"

namespace epflow::bench {

enum class InputStream : uint32_t {
  kX = 1,
  kGate = 2,
  kUp = 3,
  kDown = 4,
  kRoute = 5,
  kRouteWeight = 6,
  kZipfRank = 7,
  kDy = 8,
};

EPFLOW_HD uint64_t mix64(uint64_t z) { return splitmix64(z); }

EPFLOW_HD uint64_t stream_key(uint64_t seed, InputStream stream, uint32_t rank) {
  return mix64(seed ^ mix64((uint64_t{static_cast<uint32_t>(stream)} << 32) | rank));
}

EPFLOW_HD float unit_value(uint64_t key, uint64_t i) {
  const int32_t v = static_cast<int32_t>((mix64(key + i) >> 40) & 0xFFFFFF) - 0x800000;
  return static_cast<float>(2 * v + 1) * (1.0f / 16777216.0f);
}

inline float fan_in_scale(int64_t fan_in) { return 1.0f / __builtin_sqrtf(float(fan_in)); }

// dst[i] = bf16(unit_value(key, i) * scale), i < count, on the device.
cudaError_t fill_uniform_bf16(__nv_bfloat16* dst, int64_t count, float scale, uint64_t key,
                              cudaStream_t stream);

struct Routing {
  std::vector<int32_t> topk_idx;    // [T, K]
  std::vector<float> topk_weights;  // [T, K]
};

// Rank `rank`'s routing of T tokens over num_experts experts (formulas above).
Routing make_routing(uint64_t seed, uint32_t rank, int64_t tokens, int32_t num_experts,
                     int32_t top_k, RoutingKind kind = RoutingKind::kUniform);

}  // namespace epflow::bench
