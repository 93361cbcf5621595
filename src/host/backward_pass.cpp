#include <cuda_runtime.h>

#include "common/fp8_blocks.h"
#include "common/status_util.h"
#include "common/tile.h"
#include "host/fused_passes.h"
#include "host/pass_hooks.h"
#include "host/saved_activations.h"
#include "host/layer_workspace.h"
#include "kernels/expert_wgrad.cuh"
#include "kernels/fp8_quantize.cuh"
#include "kernels/gate_up_recompute.cuh"

namespace epflow {

namespace {

// d topk_weights of every routed row from the megakernel's partial sums, into the owners' windows.
Status push_router_weight_grads(const LayerWorkspace& ws, const SavedActivations& acts,
                                cudaStream_t stream) {
  const LayerConfig& c = ws.config;
  kernels::RouterWeightGradArgs rw;
  rw.peers = ws.peers;
  rw.d_weights_offset = ws.layout.d_weights;
  rw.table = acts.schedule.table;
  rw.seg_offset = acts.schedule.seg_offset;
  rw.experts = c.experts_per_rank();
  rw.dw_partial = ws.backward.dw_partial;
  rw.n_tiles = kernels::backward_dh_tiles(c.intermediate);
  rw.max_rows = ws.max_rows;
  EPFLOW_CUDA_RETURN(kernels::launch_router_weight_grad(rw, stream));
  return Status::ok_status();
}

// g | u of the rows the context does not keep (the table's rows from plan.saved_gate_up_rows
// on), before the megakernel reads them: their x rows into the backward's x buffer (the
// megakernel pulls them there again for the weight gradients), then the gate/up GEMM of those
// rows. Both launch over the table's capacity and find the call's rows on the device.
Status recompute_gate_up_overflow(const LayerWorkspace& ws, const SavedActivations& acts,
                                  const ExpertWeights& weights, cudaStream_t stream) {
  const LayerConfig& c = ws.config;
  const int64_t first = ws.plan.saved_gate_up_rows;
  if (first >= ws.max_rows) return Status::ok_status();
  kernels::RowGatherArgs g;
  g.peers = ws.peers;
  g.src_offset = ws.layout.x;
  g.top_k = c.top_k;
  g.table = acts.schedule.table;
  g.seg_offset = acts.schedule.seg_offset;
  g.experts = c.experts_per_rank();
  g.hidden = c.hidden;
  g.first_row = first;
  g.max_rows = ws.max_rows;
  g.rows = ws.backward.x;
  EPFLOW_CUDA_RETURN(kernels::launch_row_gather(g, ws.sm_count, stream));
  kernels::GateUpRecomputeArgs r;
  r.seg_offset = acts.schedule.seg_offset;
  r.expert_rows = acts.schedule.expert_rows;
  r.experts = c.experts_per_rank();
  r.hidden = c.hidden;
  r.intermediate = c.intermediate;
  r.first_row = first;
  r.max_rows = ws.max_rows;
  r.rows = ws.backward.x;
  r.w_gate = weights.gate;
  r.w_up = weights.up;
  r.w_gate_stride = weights.gate_expert_stride;
  r.w_up_stride = weights.up_expert_stride;
  r.out = ws.backward.gate_up_overflow;
  EPFLOW_CUDA_RETURN(kernels::launch_gate_up_recompute(r, ws.sm_count, stream));
  return Status::ok_status();
}

// The FP8 weight gradients (LayerWorkspace::fp8_weight_gradients): each operand quantized along
// the tokens and written transposed (dy, [dg | du]: 128 x 1; w·h, x: 128 x 128; dy, x and
// [dg | du] from their packed rows, w·h from bf16), then the K-grouped FP8 GEMMs: d W_down's
// operands first, then d W_gate's and d W_up's into the same buffers (BackwardRows).
Status fp8_weight_gradients(const LayerWorkspace& ws, const SavedActivations& acts,
                            const BackwardArgs& args, int32_t max_ctas, cudaStream_t stream) {
  const int64_t H = ws.config.hidden, I = ws.config.intermediate;
  const BackwardRows& b = ws.backward;
  const int64_t cap = b.ring.rows;
  const int64_t* table_rows = acts.schedule.seg_offset + ws.config.experts_per_rank();
  const bool pow2 = ws.config.fp8_power_of_two_scales;
  using kernels::TransposedScaling;
  auto quantize = [&](const __nv_bfloat16* rows, int64_t ld, int64_t cols, TransposedScaling sc,
                      uint8_t* q, float* scales) {
    return kernels::launch_quantize_transposed(rows, ld, cap, table_rows, cols, sc, pow2, q,
                                               scales, stream);
  };
  auto requantize = [&](const uint8_t* packed, int64_t cols, TransposedScaling sc, uint8_t* q,
                        float* scales) {
    return kernels::launch_requantize_transposed(packed, cap, table_rows, cols, sc, pow2, q,
                                                 scales, stream);
  };
  kernels::Fp8ExpertWgradArgs wg;
  wg.segments = kernels::ExpertSegments{ws.config.experts_per_rank(), cap,
                                        acts.schedule.seg_offset, acts.schedule.expert_rows};
  wg.fp32_out = args.grad_dtype == GradDType::kFP32;
  wg.accumulate = args.accumulate_weight_grads;
  wg.max_ctas = max_ctas;
  auto gemm = [&](const uint8_t* a_t, int64_t m, const uint8_t* b_t, const float* b_scales,
                  int64_t n, void* dw, int64_t dw_expert_stride) {
    wg.a_t = a_t;
    wg.m = m;
    wg.b_t = b_t;
    wg.b_scales = b_scales;
    wg.n = n;
    wg.dw = dw;
    wg.dw_expert_stride = dw_expert_stride;
    return kernels::launch_fp8_expert_wgrad(wg, stream);
  };
  EPFLOW_CUDA_RETURN(requantize(reinterpret_cast<const uint8_t*>(b.ring.x), H,
                                TransposedScaling::k128x1, b.dy_t, nullptr));
  EPFLOW_CUDA_RETURN(
      quantize(b.wh, I, I, TransposedScaling::k128x128, b.wh_t, b.wh_t_scales));
  EPFLOW_CUDA_RETURN(
      gemm(b.dy_t, H, b.wh_t, b.wh_t_scales, I, args.d_down, args.d_down_expert_stride));
  EPFLOW_CUDA_RETURN(requantize(b.x_fp8, H, TransposedScaling::k128x128, b.x_t, b.x_t_scales));
  EPFLOW_CUDA_RETURN(requantize(b.dgu_fp8, 2 * I, TransposedScaling::k128x1, b.dgu_t, nullptr));
  const int64_t dgu_row = fp8::packed_row_bytes(cap);
  EPFLOW_CUDA_RETURN(
      gemm(b.dgu_t, I, b.x_t, b.x_t_scales, H, args.d_gate, args.d_gate_expert_stride));
  EPFLOW_CUDA_RETURN(gemm(b.dgu_t + I * dgu_row, I, b.x_t, b.x_t_scales, H, args.d_up,
                          args.d_up_expert_stride));
  return Status::ok_status();
}

}  // namespace

Status weight_gradients(const LayerWorkspace& ws, const SavedActivations& acts,
                        const BackwardArgs& args, int32_t max_ctas, cudaStream_t stream,
                        cudaEvent_t x_rows_in) {
  if (ws.fp8_weight_gradients)
    return fp8_weight_gradients(ws, acts, args, max_ctas, stream);
  const int64_t H = ws.config.hidden, I = ws.config.intermediate;
  const BackwardRows& b = ws.backward;
  kernels::ExpertWgradArgs wg;
  wg.segments = kernels::ExpertSegments{ws.config.experts_per_rank(), ws.max_rows,
                                        acts.schedule.seg_offset, acts.schedule.expert_rows};
  wg.fp32_out = args.grad_dtype == GradDType::kFP32;
  wg.accumulate = args.accumulate_weight_grads;
  wg.max_ctas = max_ctas;
  auto wgrad = [&](const __nv_bfloat16* lhs, int64_t m, int64_t lhs_ld, const __nv_bfloat16* rhs,
                   int64_t n, void* dw, int64_t dw_expert_stride) {
    wg.lhs = lhs;
    wg.m = m;
    wg.lhs_ld = lhs_ld;
    wg.rhs = rhs;
    wg.n = n;
    wg.dw = dw;
    wg.dw_expert_stride = dw_expert_stride;
    return kernels::launch_expert_wgrad(wg, stream);
  };
  // FP8: the weight gradients read the pulled dy and x rows dequantized (Q(dy), Q(x): the
  // operands the FP8 GEMMs read) into the x buffer in turn; [dg | du] are DhSink's bf16 values
  // (which it writes only for weight gradients in bf16).
  const bool fp8 = ws.config.dtype == DType::kFP8Blockwise;
  const int64_t* table_rows = acts.schedule.seg_offset + ws.config.experts_per_rank();
  auto dequantize = [&](const uint8_t* packed) {
    return kernels::launch_dequantize_rows_1x128(packed, ws.max_rows, table_rows, H, b.x,
                                                 4 * ws.sm_count, stream);
  };
  if (fp8)
    EPFLOW_CUDA_RETURN(dequantize(reinterpret_cast<const uint8_t*>(b.ring.x)));
  EPFLOW_CUDA_RETURN(
      wgrad(fp8 ? b.x : b.ring.x, H, H, b.wh, I, args.d_down, args.d_down_expert_stride));
  if (x_rows_in) EPFLOW_CUDA_RETURN(cudaStreamWaitEvent(stream, x_rows_in, 0));
  if (fp8) EPFLOW_CUDA_RETURN(dequantize(b.x_fp8));
  EPFLOW_CUDA_RETURN(wgrad(b.ring.h, I, 2 * I, b.x, H, args.d_gate, args.d_gate_expert_stride));
  EPFLOW_CUDA_RETURN(wgrad(b.ring.h + I, I, 2 * I, b.x, H, args.d_up, args.d_up_expert_stride));
  return Status::ok_status();
}

// Weight gradients after the megakernel and before the barrier (which waits for the slowest
// rank's pushes): a rank whose megakernel ended first computes them meanwhile.
std::vector<const char*> FusedBackward::stage_names() const {
  return {"g|u past the context (x gather, GEMM)",
          "megakernel (dy, x pull; dhp + SwiGLU bwd; dx push)", "d topk_weights",
          "weight gradients"};
}

Status FusedBackward::run(LayerWorkspace& ws, const SavedActivations& acts,
                          const ExpertWeights& weights, const BackwardArgs& args,
                          cudaStream_t stream, PassHooks* hooks) {
  const BackwardRows& b = ws.backward;
  EPFLOW_RETURN_IF_ERROR(recompute_gate_up_overflow(ws, acts, weights, stream));
  EPFLOW_CUDA_RETURN(stage_boundary(hooks, stream));
  EPFLOW_CUDA_RETURN(cudaMemsetAsync(b.ring.counters, 0, b.ring.counter_bytes, stream));
  kernels::MegakernelArgs m = megakernel_args(ws, acts, weights, hooks, stream);
  m.x_offset = ws.layout.dy;
  m.ring_tiles = static_cast<int32_t>(b.ring.rows / kTileRows);
  m.ring_x = b.ring.x;
  m.ring_h = b.ring.h;
  m.counters = b.ring.counters;
  m.comm_ctas = comm_sms_;
  m.gate_up_in = acts.gate_up;
  m.gate_up_rows = ws.plan.saved_gate_up_rows;
  m.gate_up_overflow = b.gate_up_overflow;
  m.weights_offset = ws.layout.topk_weights;
  m.wh_out = b.wh;
  m.dw_partial = b.dw_partial;
  m.x_pull_offset = ws.layout.x;
  m.x_out = b.x;
  if (m.fp8) {  // packed rows into the GEMMs and for the weight gradients; bf16 [dg | du] for
                // weight gradients in bf16 only
    m.ring_h = reinterpret_cast<__nv_bfloat16*>(b.dgu_fp8);
    m.dgu_out = ws.fp8_weight_gradients ? nullptr : b.ring.h;
    m.x_out = b.x_fp8;
  }
  EPFLOW_CUDA_RETURN(kernels::launch_backward_megakernel(m, ws.sm_count, stream));
  EPFLOW_CUDA_RETURN(stage_boundary(hooks, stream));
  EPFLOW_RETURN_IF_ERROR(push_router_weight_grads(ws, acts, stream));
  EPFLOW_CUDA_RETURN(stage_boundary(hooks, stream));
  EPFLOW_RETURN_IF_ERROR(weight_gradients(ws, acts, args, 0, stream, nullptr));
  EPFLOW_CUDA_RETURN(stage_boundary(hooks, stream));
  return Status::ok_status();
}

}  // namespace epflow
