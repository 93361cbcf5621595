#include "reference/synthetic.h"

#include "common/splitmix64.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>

namespace epflow::synthetic {
namespace {

// Every quantity draws from its own generator, so changing one rank's token count, the routing
// mode or ep_size leaves all other draws as they were.
enum class Stream : uint64_t {
  kX = 1,
  kRouting = 2,
  kRouterWeights = 3,
  kPopularity = 4,
  kExpertWeights = 5,
};

// mt19937_64's output is fixed by the standard; the mappings below avoid the library's
// distributions, whose algorithms are not, so a seed gives the same data everywhere.
std::mt19937_64 make_rng(uint64_t seed, Stream stream, uint64_t index) {
  return std::mt19937_64(splitmix64(seed ^ splitmix64((static_cast<uint64_t>(stream) << 32) ^
                                                      index)));
}

// The top 24 bits of a draw: exactly the precision of a float mantissa.
uint32_t draw24(std::mt19937_64& rng) { return static_cast<uint32_t>(rng() >> 40); }

// Uniform over the odd multiples of 2^-24 in (-1, 1): symmetric, and never exactly 0.
float signed_unit(std::mt19937_64& rng) {
  const int32_t odd = static_cast<int32_t>(2 * draw24(rng) + 1) - (1 << 24);
  return static_cast<float>(odd) * 0x1p-24f;
}

// Uniform over (0, 1].
double unit_open_closed(std::mt19937_64& rng) {
  return static_cast<double>(draw24(rng) + 1) * 0x1p-24;
}

// Uniform over [0, 1) with double precision.
double unit_double(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1p-53; }

// Uniform over [0, n): draws past the last whole multiple of n are rejected, so there is no
// modulo bias.
uint64_t uniform_index(std::mt19937_64& rng, uint64_t n) {
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  const uint64_t limit = max - max % n;
  uint64_t draw = rng();
  while (draw >= limit) draw = rng();
  return draw % n;
}

void require_valid(const LayerConfig& config) {
  if (Status status = validate(config); !status.ok())
    throw std::invalid_argument("synthetic: " + status.to_string());
}

// Partial Fisher-Yates over a permutation kept from token to token: whatever order earlier
// tokens left it in, each token's K picks are a uniformly random ordered set of distinct
// experts, at O(K) per token.
void route_uniform(const LayerConfig& config, int64_t num_tokens, std::mt19937_64& rng,
                   std::vector<int32_t>* topk_idx) {
  std::vector<int32_t> experts(config.num_experts);
  std::iota(experts.begin(), experts.end(), 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int32_t k = 0; k < config.top_k; ++k) {
      const uint64_t pick = k + uniform_index(rng, config.num_experts - k);
      std::swap(experts[k], experts[pick]);
      (*topk_idx)[t * config.top_k + k] = experts[k];
    }
  }
}

// Cumulative Zipf-like popularity over expert ids: the j-th expert of a seeded random order has
// weight 1 / (j + 1)^1.5. Shared by all ranks, as a trained router's preferences would be.
std::vector<double> popularity_cdf(const LayerConfig& config, uint64_t seed) {
  std::mt19937_64 rng = make_rng(seed, Stream::kPopularity, 0);
  std::vector<int32_t> order(config.num_experts);
  std::iota(order.begin(), order.end(), 0);
  for (int32_t j = config.num_experts - 1; j > 0; --j)
    std::swap(order[j], order[uniform_index(rng, j + 1)]);
  std::vector<double> weight(config.num_experts);
  for (int32_t j = 0; j < config.num_experts; ++j) {
    const double place = j + 1;
    weight[order[j]] = 1.0 / (place * std::sqrt(place));  // sqrt is exact-rounded, pow is not
  }
  std::vector<double> cdf(config.num_experts);
  std::partial_sum(weight.begin(), weight.end(), cdf.begin());
  return cdf;
}

// Draws by popularity and redraws experts the token already has; top_k <= num_experts (checked
// by validate) guarantees termination.
void route_imbalanced(const LayerConfig& config, int64_t num_tokens,
                      const std::vector<double>& cdf, std::mt19937_64& rng,
                      std::vector<int32_t>* topk_idx) {
  const int32_t top_k = config.top_k;
  for (int64_t t = 0; t < num_tokens; ++t) {
    int32_t* row = topk_idx->data() + t * top_k;
    for (int32_t k = 0; k < top_k; ++k) {
      int32_t expert;
      do {
        const double target = unit_double(rng) * cdf.back();
        const auto it = std::upper_bound(cdf.begin(), cdf.end(), target);
        expert = static_cast<int32_t>(std::min<std::ptrdiff_t>(it - cdf.begin(),
                                                               config.num_experts - 1));
      } while (std::find(row, row + k, expert) != row + k);
      row[k] = expert;
    }
  }
}

void route_single_expert(const LayerConfig& config, int64_t num_tokens,
                         std::vector<int32_t>* topk_idx) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int32_t k = 0; k < config.top_k; ++k) (*topk_idx)[t * config.top_k + k] = k == 0 ? 0 : -1;
  }
}

}  // namespace

std::vector<reference::RankInput> make_inputs(const LayerConfig& config, const InputSpec& spec) {
  require_valid(config);
  if (static_cast<int64_t>(spec.tokens_per_rank.size()) != config.ep_size) {
    throw std::invalid_argument("make_inputs: tokens_per_rank has " +
                                std::to_string(spec.tokens_per_rank.size()) +
                                " entries, expected ep_size (" + std::to_string(config.ep_size) +
                                ")");
  }
  if (!(spec.x_scale > 0.0f)) {
    throw std::invalid_argument("make_inputs: x_scale (" + std::to_string(spec.x_scale) +
                                ") must be positive");
  }
  const std::vector<double> cdf =
      spec.routing == Routing::kImbalanced ? popularity_cdf(config, spec.seed)
                                           : std::vector<double>{};
  const int64_t hidden = config.hidden;
  const int64_t top_k = config.top_k;
  std::vector<reference::RankInput> inputs(config.ep_size);
  for (int32_t r = 0; r < config.ep_size; ++r) {
    const int64_t num_tokens = spec.tokens_per_rank[r];
    if (num_tokens < 0) {
      throw std::invalid_argument("make_inputs: tokens_per_rank[" + std::to_string(r) + "] (" +
                                  std::to_string(num_tokens) + ") is negative");
    }
    reference::RankInput& in = inputs[r];
    in.num_tokens = num_tokens;

    std::mt19937_64 x_rng = make_rng(spec.seed, Stream::kX, r);
    in.x.resize(num_tokens * hidden);
    for (float& value : in.x) value = spec.x_scale * signed_unit(x_rng);

    std::mt19937_64 weight_rng = make_rng(spec.seed, Stream::kRouterWeights, r);
    in.topk_weights.resize(num_tokens * top_k);
    for (float& weight : in.topk_weights)
      weight = static_cast<float>(0.05 + 0.95 * unit_open_closed(weight_rng));

    std::mt19937_64 routing_rng = make_rng(spec.seed, Stream::kRouting, r);
    in.topk_idx.resize(num_tokens * top_k);
    switch (spec.routing) {
      case Routing::kUniform:
        route_uniform(config, num_tokens, routing_rng, &in.topk_idx);
        break;
      case Routing::kImbalanced:
        route_imbalanced(config, num_tokens, cdf, routing_rng, &in.topk_idx);
        break;
      case Routing::kSingleExpert:
        route_single_expert(config, num_tokens, &in.topk_idx);
        break;
      case Routing::kWithEmptySlots:
        // Emptied after the uniform draws, so the surviving slots match kUniform's.
        route_uniform(config, num_tokens, routing_rng, &in.topk_idx);
        for (int32_t& expert : in.topk_idx) {
          if (uniform_index(routing_rng, 4) == 0) expert = -1;
        }
        break;
    }
  }
  return inputs;
}

std::vector<reference::RankExperts> make_experts(const LayerConfig& config, uint64_t seed) {
  require_valid(config);
  const int64_t hidden = config.hidden;
  const int64_t intermediate = config.intermediate;
  const int64_t expert_size = intermediate * hidden;
  const int32_t experts_per_rank = config.experts_per_rank();
  const double gate_up_scale = 1.0 / std::sqrt(static_cast<double>(hidden));
  const double down_scale = 1.0 / std::sqrt(static_cast<double>(intermediate));
  const auto fill = [](std::mt19937_64& rng, double scale, float* first, int64_t count) {
    for (int64_t i = 0; i < count; ++i) first[i] = static_cast<float>(signed_unit(rng) * scale);
  };
  std::vector<reference::RankExperts> experts(config.ep_size);
  for (int32_t r = 0; r < config.ep_size; ++r) {
    reference::RankExperts& rank = experts[r];
    rank.gate.resize(experts_per_rank * expert_size);
    rank.up.resize(experts_per_rank * expert_size);
    rank.down.resize(experts_per_rank * expert_size);
    for (int32_t local = 0; local < experts_per_rank; ++local) {
      // Seeded by global id: expert e has the same weights whatever ep_size spreads them over.
      const int64_t expert = int64_t{r} * experts_per_rank + local;
      std::mt19937_64 rng = make_rng(seed, Stream::kExpertWeights, expert);
      const int64_t offset = local * expert_size;
      fill(rng, gate_up_scale, rank.gate.data() + offset, expert_size);
      fill(rng, gate_up_scale, rank.up.data() + offset, expert_size);
      fill(rng, down_scale, rank.down.data() + offset, expert_size);
    }
  }
  return experts;
}

}  // namespace epflow::synthetic
