#include <cuda_runtime.h>

#include "common/status_util.h"
#include "common/tile.h"
#include "host/fused_passes.h"
#include "host/pass_hooks.h"
#include "host/saved_activations.h"
#include "host/layer_workspace.h"

namespace epflow {

kernels::MegakernelArgs megakernel_args(const LayerWorkspace& ws, const SavedActivations& acts,
                                        const ExpertWeights& w, PassHooks* hooks,
                                        cudaStream_t stream) {
  const LayerConfig& c = ws.config;
  kernels::MegakernelArgs m;
  m.peers = ws.peers;
  m.combine_offset = ws.layout.combine;
  m.table = acts.schedule.table;
  m.seg_offset = acts.schedule.seg_offset;
  m.expert_rows = acts.schedule.expert_rows;
  m.experts = c.experts_per_rank();
  m.hidden = static_cast<int32_t>(c.hidden);
  m.intermediate = static_cast<int32_t>(c.intermediate);
  m.top_k = c.top_k;
  m.minibatch_tiles = static_cast<int32_t>(ws.plan.minibatch_rows / kTileRows);
  m.w_gate = w.gate;
  m.w_up = w.up;
  m.w_down = w.down;
  m.w_gate_stride = w.gate_expert_stride;
  m.w_up_stride = w.up_expert_stride;
  m.w_down_stride = w.down_expert_stride;
  if (c.dtype == DType::kFP8Blockwise) {
    m.fp8 = true;
    m.fp8_pow2_scales = c.fp8_power_of_two_scales;
    m.w_gate_fp8 = w.fp8.gate;
    m.w_up_fp8 = w.fp8.up;
    m.w_down_fp8 = w.fp8.down;
    m.w_gate_scales = w.fp8.gate_scales;
    m.w_up_scales = w.fp8.up_scales;
    m.w_down_scales = w.fp8.down_scales;
    m.w_gate_up_t_fp8 = w.fp8.gate_up_t;  // training layers' (the backward reads them)
    m.w_down_t_fp8 = w.fp8.down_t;
    m.w_gate_up_t_scales = w.fp8.gate_up_t_scales;
    m.w_down_t_scales = w.fp8.down_t_scales;
  }
  m.rank = c.ep_rank;
  m.timeout_ns = static_cast<int64_t>(c.timeout_seconds * 1e9);
  m.diagnostic = ws.reports.megakernel_device;
  if (hooks) m.trace = hooks->megakernel_trace(stream);
  return m;
}

Status FusedForward::run(LayerWorkspace& ws, SavedActivations& acts, const ExpertWeights& weights,
                         bool keep_for_backward, cudaStream_t stream, PassHooks* hooks) {
  EPFLOW_CUDA_RETURN(cudaMemsetAsync(ws.ring.counters, 0, ws.ring.counter_bytes, stream));
  // The megakernel has no stage boundary inside: dispatch and FFN are one stage, which begins
  // where dispatch would end.
  EPFLOW_CUDA_RETURN(stage_boundary(hooks, stream));
  kernels::MegakernelArgs m = megakernel_args(ws, acts, weights, hooks, stream);
  m.x_offset = ws.layout.x;
  m.ring_tiles = static_cast<int32_t>(ws.ring.rows / kTileRows);
  m.ring_x = ws.ring.x;
  m.ring_h = ws.ring.h;
  m.counters = ws.ring.counters;
  m.comm_ctas = ws.plan.comm_sms;
  if (keep_for_backward) {
    m.gate_up_out = acts.gate_up;
    m.gate_up_rows = ws.plan.saved_gate_up_rows;
  }
  EPFLOW_CUDA_RETURN(kernels::launch_forward_megakernel(m, ws.sm_count, stream));
  EPFLOW_CUDA_RETURN(stage_boundary(hooks, stream));
  return Status::ok_status();
}

}  // namespace epflow
