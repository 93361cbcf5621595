// The expert phase of each pass, behind one interface per pass: what runs between the schedule
// (built by LayerCore from every rank's published routing) and the barrier after which each
// owner sums the (token, k) rows pushed into its window. A new data type or fusion strategy is a
// new executor, not a branch in the passes: the library ships the fused BF16 megakernel
// executors (fused_passes.h); bench/unfused adds chains of separate kernels to compare against.
#pragma once

#include <cuda_runtime_api.h>

#include <vector>

#include "epflow/layer.h"
#include "epflow/status.h"

namespace epflow {

struct LayerWorkspace;
struct SavedActivations;
class PassHooks;

class ForwardExecutor {
 public:
  virtual ~ForwardExecutor() = default;
  // Every routed row of acts' pull table: x pulled from its source rank's window, the expert's
  // SwiGLU FFN, the result pushed into the source's (token, k) combine slot. keep_for_backward:
  // also keep in acts what the backward reads (an executor that cannot returns kNotImplemented
  // before launching anything). Marks two stage boundaries: dispatch done, expert FFN done.
  virtual Status run(LayerWorkspace& ws, SavedActivations& acts, const ExpertWeights& weights,
                     bool keep_for_backward, cudaStream_t stream, PassHooks* hooks) = 0;
};

class BackwardExecutor {
 public:
  virtual ~BackwardExecutor() = default;
  // The stages run() marks the end of, in order.
  virtual std::vector<const char*> stage_names() const = 0;
  // With dy and the router weights published in every rank's window: every routed row's dx
  // pushed into its source's (token, k) combine slot, its d topk_weight into the source's
  // d_weights slot, and this rank's weight gradients into args' d_gate, d_up, d_down.
  virtual Status run(LayerWorkspace& ws, const SavedActivations& acts, const ExpertWeights& weights,
                     const BackwardArgs& args, cudaStream_t stream, PassHooks* hooks) = 0;
};

}  // namespace epflow
