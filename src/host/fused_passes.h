// The library's executors: each pass's expert phase as one persistent megakernel (BF16).
#pragma once

#include <cstdint>

#include "host/executor.h"
#include "kernels/moe_megakernel.cuh"

namespace epflow {

// Forward: the megakernel pulls x rows into its ring, runs gate/up + SwiGLU and down, and pushes
// each result row into its owner's combine slot from the down GEMM's epilogue; keeping g | u for
// the backward costs one extra store per gate/up tile.
class FusedForward final : public ForwardExecutor {
 public:
  Status run(LayerWorkspace& ws, SavedActivations& acts, const ExpertWeights& weights,
             bool keep_for_backward, cudaStream_t stream, PassHooks* hooks) override;
};

// Backward: the backward megakernel (dy and x rows pulled; dhp = dy W_down with the SwiGLU and
// router-weight backward in its epilogue; dx = [dg | du] [W_gate; W_up] pushed into the owners'
// combine slots), d topk_weights pushed to the owners, then the weight gradients dW_down =
// dyᵀ (w h), dW_gate = dgᵀ x, dW_up = duᵀ x over the rows the megakernel left.
class FusedBackward final : public BackwardExecutor {
 public:
  explicit FusedBackward(int32_t comm_sms) : comm_sms_(comm_sms) {}
  std::vector<const char*> stage_names() const override;
  Status run(LayerWorkspace& ws, const SavedActivations& acts, const ExpertWeights& weights,
             const BackwardArgs& args, cudaStream_t stream, PassHooks* hooks) override;
  int32_t comm_sms() const { return comm_sms_; }

 private:
  int32_t comm_sms_;  // the megakernel's communication partition
};

// What both megakernel passes take from the workspace and the schedule; the pass sets its rows,
// ring and partition. With hooks that trace, the launch records its tasks there.
kernels::MegakernelArgs megakernel_args(const LayerWorkspace& ws, const SavedActivations& acts,
                                        const ExpertWeights& weights, PassHooks* hooks,
                                        cudaStream_t stream);

// dW_down = dyᵀ (w h), dW_gate = dgᵀ x, dW_up = duᵀ x over the workspace's backward rows, on at
// most max_ctas SMs (0: all); the last two wait for x_rows_in first when it is set. Any backward
// executor that fills those rows ends with it.
Status weight_gradients(const LayerWorkspace& ws, const SavedActivations& acts,
                        const BackwardArgs& args, int32_t max_ctas, cudaStream_t stream,
                        cudaEvent_t x_rows_in);

}  // namespace epflow
