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

// One token's dx row [H] and its d topk_weights [K] (for spot checks of shapes too large to run
// whole): backward()'s own arithmetic, so bit for bit its values.
void backward_token(const LayerConfig& config, const std::vector<RankExperts>& experts,
                    const float* x_row, const int32_t* topk_idx_row, const float* topk_weights_row,
                    const float* dy_row, float* dx_row, float* d_topk_weights_row);

enum class WeightGradMatrix { kGate, kUp, kDown };

// One element of a rank's weight gradients: RankGrads::d_gate / d_up [E_local, I, H] (row < I,
// col < H) or d_down [E_local, H, I] (row < H, col < I).
struct WeightGradElement {
  WeightGradMatrix matrix = WeightGradMatrix::kGate;
  int32_t expert = 0;  // local to the rank, < experts_per_rank
  int64_t row = 0;
  int64_t col = 0;
};

// values[n] = elements[n] of rank `rank`'s weight gradients, as backward() computes them (the
// same terms summed in the same order: its values to the float rounding) for the cost of
// 3 * H MACs per routed row of each distinct (expert, intermediate index) among the elements,
// instead of the whole backward's 9 * H * I per routed row.
Status weight_grad_elements(const LayerConfig& config, const std::vector<RankInput>& inputs,
                            const std::vector<RankExperts>& experts,
                            const std::vector<std::vector<float>>& dy, int32_t rank,
                            const std::vector<WeightGradElement>& elements,
                            std::vector<float>* values);

// --- FP8, block-scaled (LayerConfig::dtype = kFP8Blockwise). e4m3 values with one fp32 scale per block: 1 x 128 for activations (a row's 128
// consecutive columns), 128 x 128 for weights; a last partial block scales what it has. See
// src/common/fp8_blocks.h for the rounding, saturation and NaN rules.

// Row-major [rows, cols] in 1 x 128 blocks: q [rows, cols] e4m3 bytes, scales [rows, ceil(cols /
// 128)].
void quantize_rows_1x128(const float* x, int64_t rows, int64_t cols, bool power_of_two_scales,
                         uint8_t* q, float* scales);
// Row-major [rows, cols] in 128 x 128 blocks: q [rows, cols], scales [ceil(rows / 128),
// ceil(cols / 128)].
void quantize_blocks_128x128(const float* w, int64_t rows, int64_t cols, bool power_of_two_scales,
                             uint8_t* q, float* scales);

// The layer's forward quantizing where the FP8 kernels do, and nowhere else: each token's x
// (1 x 128, by its owner, before it crosses NVLink), every expert matrix (128 x 128), and h
// (1 x 128) before the down GEMM; each GEMM sums 128-deep blocks of e4m3 products exactly, scales
// a block's sum by its two scales and adds the blocks in order (double); SwiGLU, the expert
// output rows and the weighted sum in fp32 / double as forward() does. y[r] = [T_r, H].
Status forward_fp8(const LayerConfig& config, const std::vector<RankInput>& inputs,
                   const std::vector<RankExperts>& experts, bool power_of_two_scales,
                   std::vector<std::vector<float>>* y);

// An expert matrix [n, k] quantized 128 x 128: q [n, k], scales [ceil(n / 128), ceil(k / 128)].
struct Fp8Matrix {
  int64_t n = 0, k = 0;
  std::vector<uint8_t> q;
  std::vector<float> scales;
};
// Every rank's experts quantized once, by global expert id.
struct Fp8Experts {
  std::vector<Fp8Matrix> gate, up, down;
  bool power_of_two_scales = false;
};
Fp8Experts quantize_experts_fp8(const LayerConfig& config, const std::vector<RankExperts>& experts,
                                bool power_of_two_scales);
// One token's output row of forward_fp8 (spot checks of shapes too large to run whole).
void forward_token_fp8(const LayerConfig& config, const Fp8Experts& experts, const float* x_row,
                       const int32_t* topk_idx_row, const float* topk_weights_row, float* y_row);

// The backward of forward_fp8, every quantizer taken as the identity (straight-through), with
// e4m3 operands where the FP8 backward's GEMMs read them (docs/design/fp8_backward.md): dy
// quantized 1 x 128 once per token; dhp = Q(dy) Q(W_down) (K = H; the weights' 128 x 128 blocks
// read transposed, their scales as they are), times w; the SwiGLU backward from g | u as the
// training forward keeps them (bf16), dg and du rounded to bf16; dx = Q([dg | du]) Q([W_gate;
// W_up]) (K = 2I: the gate blocks, then the up blocks); d w = <dhp, h>, h = silu(g) u recomputed
// from the kept g | u and rounded to bf16. Weight gradients summed in double: d W_down +=
// (w Q(dy))^T h, d W_gate += dg^T Q(x), d W_up += du^T Q(x). Each GEMM sums 128-deep blocks
// exactly and adds them in order, as forward_fp8.
// With fp8_weight_gradients (the FP8 layer's weight-gradient GEMMs in FP8, as it runs them from
// enough rows per expert), each weight gradient's operands are quantized once more along the
// tokens, in each expert's rows of the layer's pull table (sched::build_pull_table: segments
// padded to whole 128-row blocks with zero rows): Q(dy) and Q(x) as bf16 (e4m3 value times scale,
// rounded), w·h as bf16(w h), dg and du in bf16; then d W_down = Qt(Q(dy))ᵀ Qt(w·h), d W_gate =
// Qt(dg)ᵀ Qt(Q(x)), d W_up = Qt(du)ᵀ Qt(Q(x)), the first operand of each by 128 x 1 blocks (a
// scale per feature per 128 rows), the second by 128 x 128 blocks; sums in double.
Status backward_fp8(const LayerConfig& config, const std::vector<RankInput>& inputs,
                    const std::vector<RankExperts>& experts,
                    const std::vector<std::vector<float>>& dy, bool power_of_two_scales,
                    std::vector<RankGrads>* grads, bool fp8_weight_gradients = false);
// One token's dx row [H] and d topk_weights [K] of backward_fp8 (spot checks of shapes too large
// to run whole): the same arithmetic, so bit for bit its values.
void backward_token_fp8(const LayerConfig& config, const Fp8Experts& experts, const float* x_row,
                        const int32_t* topk_idx_row, const float* topk_weights_row,
                        const float* dy_row, float* dx_row, float* d_topk_weights_row);

}  // namespace epflow::reference
