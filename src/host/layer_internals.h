// Internal access to the layer for epflow-bench and the tests: the forward with an event recorded
// at every stage boundary, so the benchmark can report each stage's time from the same run; the
// unfused chain of issue [B] to compare the megakernel with; the resolved runtime plan.
#pragma once

#include <cuda_runtime_api.h>

#include "epflow/layer.h"
#include "host/runtime_plan.h"

namespace epflow {

struct StageEvents {
  cudaEvent_t start;          // before the inputs are copied into the symmetric window
  cudaEvent_t schedule_done;  // metadata exchange (barrier, token counts) + device schedule
  cudaEvent_t dispatch_done;  // unfused: pull dispatch; fused: the megakernel's start
  cudaEvent_t ffn_done;       // unfused: expert FFN; fused: the megakernel's end
  cudaEvent_t end;            // (unfused: push combine,) barrier, weighted sum
};

struct LayerInternals {
  // Switches the layer to the unfused chain (allocating its [max_rows] buffers once) or back.
  static Status use_unfused_forward(Layer& layer, bool unfused);
  static runtime::LayerPlan plan(const Layer& layer);
  static Status forward_with_stage_events(Layer& layer, const ForwardArgs& args,
                                          cudaStream_t stream, const StageEvents& events);
};

}  // namespace epflow
