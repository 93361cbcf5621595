#include "host/saved_activations.h"

#include <cuda_runtime.h>

#include "common/status_util.h"
#include "host/workspace.h"

namespace epflow {

Status SavedActivations::create(const Workspace& ws, std::unique_ptr<SavedActivations>* out) {
  std::unique_ptr<SavedActivations> acts(new SavedActivations());
  const size_t bytes = kernels::routing_schedule_workspace_bytes(ws.schedule);
  EPFLOW_CUDA_RETURN(cudaMalloc(&acts->schedule_buffers_, bytes));
  acts->schedule = kernels::carve_schedule_buffers(ws.schedule, acts->schedule_buffers_);
  acts->schedule_bytes = static_cast<int64_t>(bytes);
  if (ws.config.with_backward) {
    const size_t gu_bytes = sizeof(__nv_bfloat16) * ws.max_rows * 2 * ws.config.intermediate;
    EPFLOW_CUDA_RETURN(cudaMalloc(&acts->gate_up, gu_bytes));
    acts->gate_up_bytes = static_cast<int64_t>(gu_bytes);
  }
  *out = std::move(acts);
  return Status::ok_status();
}

SavedActivations::~SavedActivations() {
  if (schedule_buffers_) cudaFree(schedule_buffers_);
  if (gate_up) cudaFree(gate_up);
}

Status SavedActivations::build_schedule(const Workspace& ws, cudaStream_t stream) {
  EPFLOW_CUDA_RETURN(cudaMemsetAsync(schedule.invalid_slots, 0, sizeof(int32_t), stream));
  EPFLOW_CUDA_RETURN(kernels::launch_routing_schedule(ws.schedule, ws.peer_topk_idx, ws.tokens,
                                                      schedule, stream));
  return Status::ok_status();
}

}  // namespace epflow
