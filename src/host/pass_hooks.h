// Instrumentation of the passes through one small interface, so that the production passes carry
// no benchmark parameters: the layer runs without hooks; epflow-bench and the tests pass hooks to
// LayerCore to time each stage and to record the megakernel's tasks.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/moe_megakernel.cuh"

namespace epflow {

class PassHooks {
 public:
  virtual ~PassHooks() = default;
  // Called stream-ordered before a pass's first stage, between stages and after its last stage
  // (stages + 1 times; LayerCore lists the stages' names), e.g. to record an event.
  virtual cudaError_t stage_boundary(cudaStream_t stream) = 0;
  // Where the next megakernel launch records its tasks ([sm_count][kTraceRecordsPerCta], every
  // record's task set to -1 stream-ordered before the launch), or null for no trace.
  virtual kernels::MegakernelTraceRecord* megakernel_trace(cudaStream_t stream) {
    (void)stream;
    return nullptr;
  }
};

inline cudaError_t stage_boundary(PassHooks* hooks, cudaStream_t stream) {
  return hooks ? hooks->stage_boundary(stream) : cudaSuccess;
}

}  // namespace epflow
