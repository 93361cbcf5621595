// Internal access to the layer for epflow-bench and the tests: the forward with an event recorded
// at every stage boundary, so the benchmark can report each stage's time from the same run; the
// unfused chain of issue [B] to compare the megakernel with; the resolved runtime plan; a
// per-task trace of the megakernel.
#pragma once

#include <cuda_runtime_api.h>

#include <vector>

#include "epflow/layer.h"
#include "host/runtime_plan.h"
#include "kernels/moe_megakernel.cuh"

namespace epflow {

struct StageEvents {
  cudaEvent_t start;          // before the inputs are copied into the symmetric window
  cudaEvent_t schedule_done;  // metadata exchange (barrier, token counts) + device schedule
  cudaEvent_t dispatch_done;  // unfused: pull dispatch; fused: the megakernel's start
  cudaEvent_t ffn_done;       // unfused: expert FFN; fused: the megakernel's end
  cudaEvent_t end;            // (unfused: push combine,) barrier, weighted sum
};

// The most stages a backward reports (the unfused one's); LayerInternals::backward_stage_names.
inline constexpr int kMaxBackwardStages = 7;

struct LayerInternals {
  // Switches the layer to the unfused chain (allocating its [max_rows] buffers once) or back.
  static Status use_unfused_forward(Layer& layer, bool unfused);
  static runtime::LayerPlan plan(const Layer& layer);
  // Records every megakernel task of each later call, forward or backward (when it was taken,
  // ready, done); the last megakernel launch's records are fetched (with a device sync) by
  // fetch_trace.
  static Status enable_trace(Layer& layer);
  static Status fetch_trace(const Layer& layer,
                            std::vector<kernels::MegakernelTraceRecord>* out);
  static Status forward_with_stage_events(Layer& layer, const ForwardArgs& args,
                                          cudaStream_t stream, const StageEvents& events);
  // Switches the backward to the unfused chain of separate kernels (allocating its dx rows once)
  // or back to the backward megakernel (the default).
  static Status use_unfused_backward(Layer& layer, bool unfused);
  // The unfused backward: SMs it leaves to its side stream (x pull, dx push beside the GEMMs);
  // 0: none, everything in order on the caller's stream (epflow-bench --backward-side-sms).
  static Status set_backward_side_sms(Layer& layer, int32_t side_sms);
  static int32_t backward_side_sms(const Layer& layer);
  // The backward megakernel's communication SMs (epflow-bench --backward-comm-sms).
  static Status set_backward_comm_sms(Layer& layer, int32_t comm_sms);
  static int32_t backward_comm_sms(const Layer& layer);
  // The current backward's stages, in order; backward_with_stage_events records an event before
  // the first and after each one (`marks`: size() + 1 events).
  static std::vector<const char*> backward_stage_names(const Layer& layer);
  static Status backward_with_stage_events(Layer& layer, const BackwardArgs& args,
                                           const SavedContext& saved, cudaStream_t stream,
                                           const cudaEvent_t* marks);
};

}  // namespace epflow
