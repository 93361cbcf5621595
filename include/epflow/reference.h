// EPFlow: the CPU reference of the MoE layer, forward and backward, over several simulated EP
// ranks (link epflow::reference).
// The math of docs/ARCHITECTURE.md §Math with fp32 storage and double accumulation. It is the
// ground truth every GPU kernel is checked against, so it stays plain: every sum in index order.
#pragma once

#include <cstdint>
#include <vector>

#include "epflow/config.h"
#include "epflow/status.h"

namespace epflow::reference {

// One simulated rank's tokens.
struct RankInput {
  int64_t num_tokens = 0;
  std::vector<float> x;             // [T, H]
  std::vector<int32_t> topk_idx;    // [T, K] global expert ids, -1 = empty slot
  std::vector<float> topk_weights;  // [T, K]
};

// One simulated rank's experts (experts_per_rank of them).
struct RankExperts {
  std::vector<float> gate;  // [E_local, I, H]
  std::vector<float> up;    // [E_local, I, H]
  std::vector<float> down;  // [E_local, H, I]
};

struct RankGrads {
  std::vector<float> dx;              // [T, H]
  std::vector<float> d_topk_weights;  // [T, K], 0 for empty slots
  std::vector<float> d_gate;          // [E_local, I, H]
  std::vector<float> d_up;            // [E_local, I, H]
  std::vector<float> d_down;          // [E_local, H, I]
};

// Checks shapes of inputs/experts against config (ep_size ranks) and every expert id.
Status check_inputs(const LayerConfig& config, const std::vector<RankInput>& inputs,
                    const std::vector<RankExperts>& experts);

// y[r] = [T_r, H] for every rank r.
Status forward(const LayerConfig& config, const std::vector<RankInput>& inputs,
               const std::vector<RankExperts>& experts, std::vector<std::vector<float>>* y);

// One token's output row (for spot checks of shapes too large to run whole).
void forward_token(const LayerConfig& config, const std::vector<RankExperts>& experts,
                   const float* x_row, const int32_t* topk_idx_row, const float* topk_weights_row,
                   float* y_row);

// dy[r] = [T_r, H]; grads[r] gets rank r's dx, d_topk_weights and its experts' weight gradients.
Status backward(const LayerConfig& config, const std::vector<RankInput>& inputs,
                const std::vector<RankExperts>& experts,
                const std::vector<std::vector<float>>& dy, std::vector<RankGrads>* grads);

}  // namespace epflow::reference
