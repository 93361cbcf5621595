// Random layer inputs for tests and the benchmark: never zeros, with the routing patterns that
// break schedules (imbalance, empty experts, one hot expert, empty slots, ranks without tokens).
#pragma once

#include <cstdint>
#include <vector>

#include "epflow/config.h"
#include "epflow/reference.h"

namespace epflow::synthetic {

enum class Routing {
  kUniform,      // K distinct experts per token, uniformly at random
  kImbalanced,   // skewed (Zipf-like) expert popularity; many experts left empty
  kSingleExpert, // every slot of every token to expert 0 (slots k>0 are -1: ids stay distinct)
  kWithEmptySlots,  // uniform, with about a quarter of the slots set to -1
};

struct InputSpec {
  std::vector<int64_t> tokens_per_rank;  // size ep_size; entries may be 0 and may differ
  Routing routing = Routing::kUniform;
  uint64_t seed = 1;
  float x_scale = 1.0f;
};

// Fills inputs (x ~ U(-x_scale, x_scale), router weights in (0.05, 1]) for every rank.
std::vector<reference::RankInput> make_inputs(const LayerConfig& config, const InputSpec& spec);

// Expert weights scaled like a trained layer (~1/sqrt(fan_in)) so outputs stay O(1).
std::vector<reference::RankExperts> make_experts(const LayerConfig& config, uint64_t seed);

}  // namespace epflow::synthetic
