// Internal access to the layer for epflow-bench: the forward with an event recorded at every
// stage boundary, so the benchmark can report each stage's time from the same run.
#pragma once

#include <cuda_runtime_api.h>

#include "epflow/layer.h"

namespace epflow {

struct StageEvents {
  cudaEvent_t start;          // before the inputs are copied into the symmetric window
  cudaEvent_t schedule_done;  // metadata exchange (barrier, token counts) + device schedule
  cudaEvent_t dispatch_done;  // pull dispatch
  cudaEvent_t ffn_done;       // expert FFN (gate/up + SwiGLU, down)
  cudaEvent_t end;            // push combine, barrier, weighted sum
};

struct LayerInternals {
  static Status forward_with_stage_events(Layer& layer, const ForwardArgs& args,
                                          cudaStream_t stream, const StageEvents& events);
};

}  // namespace epflow
