#include "unfused/unfused_executors.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "common/status_util.h"
#include "host/fused_passes.h"
#include "host/pass_hooks.h"
#include "host/saved_activations.h"
#include "host/layer_workspace.h"
#include "unfused/expert_ffn.cuh"
#include "unfused/row_movers.cuh"

namespace epflow::bench {

namespace {

// Grid of the warp-per-row kernels: a few waves of CTAs with the GPU to themselves, or one big
// CTA on each of the side SMs the backward's GEMMs leave free.
struct RowMovers {
  int32_t blocks, threads;
};
RowMovers whole_gpu(const LayerWorkspace& ws) { return {4 * ws.sm_count, kernels::kRowMoverThreads}; }

// Every routed row of the pull table from its source rank's window region at `offset` ([T_max, H]:
// x, or the backward's dy) into `out` [max_rows, H].
Status pull_rows(const LayerWorkspace& ws, const SavedActivations& acts, size_t offset,
                 __nv_bfloat16* out, cudaStream_t stream, RowMovers movers,
                 bool zero_padding_rows) {
  kernels::DispatchArgs d;
  d.peers = ws.peers;
  d.x_offset = offset;
  d.table = acts.schedule.table;
  d.seg_offset = acts.schedule.seg_offset;
  d.experts = ws.config.experts_per_rank();
  d.hidden = ws.config.hidden;
  d.top_k = ws.config.top_k;
  d.routed_x = out;
  d.zero_padding_rows = zero_padding_rows;
  EPFLOW_CUDA_RETURN(kernels::launch_pull_dispatch(d, movers.blocks, stream, movers.threads));
  return Status::ok_status();
}

// Every routed row of `rows` [max_rows, H] into its owner's (token, k) combine slot.
Status push_rows(const LayerWorkspace& ws, const SavedActivations& acts, const __nv_bfloat16* rows,
                 cudaStream_t stream, RowMovers movers) {
  kernels::CombineArgs cb;
  cb.peers = ws.peers;
  cb.combine_offset = ws.layout.combine;
  cb.table = acts.schedule.table;
  cb.seg_offset = acts.schedule.seg_offset;
  cb.experts = ws.config.experts_per_rank();
  cb.hidden = ws.config.hidden;
  cb.routed_y = rows;
  EPFLOW_CUDA_RETURN(kernels::launch_push_combine(cb, movers.blocks, stream, movers.threads));
  return Status::ok_status();
}

// The unfused chains' kernels read densely packed expert weights (the bench's own).
Status require_dense_experts(const ExpertWeights& w) {
  if (w.gate_expert_stride == 0 && w.up_expert_stride == 0 && w.down_expert_stride == 0)
    return Status::ok_status();
  return error_status(StatusCode::kNotImplemented,
                      "the unfused executors read densely packed expert weights only (expert "
                      "strides 0)");
}

}  // namespace

Status UnfusedForward::create(const LayerWorkspace& ws, std::unique_ptr<UnfusedForward>* out) {
  if (ws.config.dtype != DType::kBF16)
    return error_status(StatusCode::kNotImplemented, "the unfused forward is bf16 only");
  std::unique_ptr<UnfusedForward> f(new UnfusedForward());
  const int64_t rows = ws.max_rows, H = ws.config.hidden, I = ws.config.intermediate;
  f->bytes_ = static_cast<int64_t>(sizeof(__nv_bfloat16)) * rows * (2 * H + I);
  EPFLOW_CUDA_RETURN(cudaMalloc(&f->buffers_, f->bytes_));
  f->routed_x_ = static_cast<__nv_bfloat16*>(f->buffers_);
  f->routed_h_ = f->routed_x_ + rows * H;
  f->routed_y_ = f->routed_h_ + rows * I;
  *out = std::move(f);
  return Status::ok_status();
}

UnfusedForward::~UnfusedForward() {
  if (buffers_) cudaFree(buffers_);
}

Status UnfusedForward::run(LayerWorkspace& ws, SavedActivations& acts, const ExpertWeights& w,
                           bool keep_for_backward, cudaStream_t stream, PassHooks* hooks) {
  if (keep_for_backward)
    return error_status(StatusCode::kNotImplemented,
                        "the unfused forward keeps no gate/up pre-activations for a backward");
  EPFLOW_RETURN_IF_ERROR(require_dense_experts(w));
  EPFLOW_RETURN_IF_ERROR(
      pull_rows(ws, acts, ws.layout.x, routed_x_, stream, whole_gpu(ws), false));
  EPFLOW_CUDA_RETURN(stage_boundary(hooks, stream));
  kernels::ExpertFfnArgs f;
  f.experts = ws.config.experts_per_rank();
  f.hidden = ws.config.hidden;
  f.intermediate = ws.config.intermediate;
  f.max_rows = ws.max_rows;
  f.seg_offset = acts.schedule.seg_offset;
  f.expert_rows = acts.schedule.expert_rows;
  f.x = routed_x_;
  f.w_gate = w.gate;
  f.w_up = w.up;
  f.w_down = w.down;
  f.h = routed_h_;
  f.y = routed_y_;
  EPFLOW_CUDA_RETURN(kernels::launch_expert_ffn(f, stream));
  EPFLOW_CUDA_RETURN(stage_boundary(hooks, stream));
  return push_rows(ws, acts, routed_y_, stream, whole_gpu(ws));
}

int32_t default_backward_side_sms(const LayerConfig& c, int32_t sm_count) {
  const double r = (4.0 / 3.0) * runtime::kGemmFlopsPerComputeSm /
                   (3.0 * static_cast<double>(c.intermediate) * runtime::kPullBytesPerCommSm);
  const auto side = static_cast<int32_t>(std::lround(sm_count * r / (1.0 + r)));
  return std::max(1, std::min(std::max(side, 2), sm_count / 4));
}

Status UnfusedBackward::create(const LayerWorkspace& ws, int32_t side_sms,
                               std::unique_ptr<UnfusedBackward>* out) {
  if (!ws.config.with_backward)
    return invalid_argument("the unfused backward needs a layer created with_backward");
  if (ws.config.dtype != DType::kBF16)
    return error_status(StatusCode::kNotImplemented, "the unfused backward is bf16 only");
  if (ws.plan.saved_gate_up_rows < ws.max_rows)
    return invalid_argument("the unfused backward reads every routed row's g | u from the "
                            "context: it needs LayerConfig::saved_gate_up_rows >= the pull "
                            "table's ", ws.max_rows, " rows (it has ", ws.plan.saved_gate_up_rows,
                            ")");
  if (side_sms < 0 || side_sms >= ws.sm_count / 2)
    return invalid_argument("backward side SMs (", side_sms, ") must be in [0, ",
                            ws.sm_count / 2, ")");
  std::unique_ptr<UnfusedBackward> b(new UnfusedBackward());
  b->side_sms_ = side_sms;
  b->bytes_ = static_cast<int64_t>(sizeof(__nv_bfloat16)) * ws.max_rows * ws.config.hidden;
  EPFLOW_CUDA_RETURN(cudaMalloc(&b->dx_rows_, b->bytes_));
  EPFLOW_CUDA_RETURN(cudaStreamCreateWithFlags(&b->side_, cudaStreamNonBlocking));
  for (cudaEvent_t* e : {&b->dy_pulled_, &b->x_pulled_, &b->dx_ready_, &b->dx_pushed_})
    EPFLOW_CUDA_RETURN(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  *out = std::move(b);
  return Status::ok_status();
}

UnfusedBackward::~UnfusedBackward() {
  if (dx_rows_) cudaFree(dx_rows_);
  for (cudaEvent_t e : {dy_pulled_, x_pulled_, dx_ready_, dx_pushed_})
    if (e) cudaEventDestroy(e);
  if (side_) cudaStreamDestroy(side_);
}

std::vector<const char*> UnfusedBackward::stage_names() const {
  return {"pull dy rows", "dhp = dy W_down", "SwiGLU backward", "dx = [dg|du] [Wg; Wu]",
          "weight gradients (x pull, dx push beside)"};
}

// dy rows first (the first GEMM reads them); x rows, needed only by the last two weight
// gradients, on the side stream beside the GEMMs. The GEMMs run on sm_count - side_sms CTAs and
// the side kernels on side_sms CTAs of a whole SM's threads, so both are resident at once
// whichever starts first (a GEMM CTA fills an SM's register file).
Status UnfusedBackward::run(LayerWorkspace& ws, const SavedActivations& acts, const ExpertWeights& w,
                            const BackwardArgs& args, cudaStream_t stream, PassHooks* hooks) {
  EPFLOW_RETURN_IF_ERROR(require_dense_experts(w));
  const int64_t H = ws.config.hidden, I = ws.config.intermediate;
  const BackwardRows& b = ws.backward;
  const RowMovers beside_gemms =
      side_sms_ > 0 ? RowMovers{side_sms_, kernels::kRowMoverMaxThreads} : whole_gpu(ws);
  EPFLOW_RETURN_IF_ERROR(pull_rows(ws, acts, ws.layout.dy, b.ring.x, stream, whole_gpu(ws), true));
  EPFLOW_CUDA_RETURN(cudaEventRecord(dy_pulled_, stream));
  cudaStream_t aside = side_sms_ > 0 ? side_ : stream;
  EPFLOW_CUDA_RETURN(cudaStreamWaitEvent(aside, dy_pulled_, 0));
  EPFLOW_RETURN_IF_ERROR(pull_rows(ws, acts, ws.layout.x, b.x, aside, beside_gemms, true));
  EPFLOW_CUDA_RETURN(cudaEventRecord(x_pulled_, aside));
  EPFLOW_CUDA_RETURN(stage_boundary(hooks, stream));
  const int32_t gemm_ctas = ws.sm_count - side_sms_;

  kernels::ExpertDgradArgs dg;
  dg.segments = kernels::ExpertSegments{ws.config.experts_per_rank(), ws.max_rows,
                                        acts.schedule.seg_offset, acts.schedule.expert_rows};
  dg.k = H;
  dg.n = I;
  dg.rows = b.ring.x;
  dg.w0 = w.down;
  dg.out = b.wh;  // dhp, then w h in place
  dg.max_ctas = gemm_ctas;
  EPFLOW_CUDA_RETURN(kernels::launch_expert_dgrad(dg, stream));
  EPFLOW_CUDA_RETURN(stage_boundary(hooks, stream));

  kernels::SwigluBackwardArgs sb;
  sb.peers = ws.peers;
  sb.weights_offset = ws.layout.topk_weights;
  sb.d_weights_offset = ws.layout.d_weights;
  sb.table = acts.schedule.table;
  sb.seg_offset = acts.schedule.seg_offset;
  sb.experts = ws.config.experts_per_rank();
  sb.intermediate = I;
  sb.gate_up = acts.gate_up;
  sb.dhp_wh = b.wh;
  sb.dgu = b.ring.h;
  EPFLOW_CUDA_RETURN(kernels::launch_swiglu_backward(sb, 4 * gemm_ctas, stream));
  EPFLOW_CUDA_RETURN(stage_boundary(hooks, stream));

  dg.k = 2 * I;
  dg.k0 = I;
  dg.n = H;
  dg.rows = b.ring.h;
  dg.w0 = w.gate;
  dg.w1 = w.up;
  dg.out = dx_rows_;
  EPFLOW_CUDA_RETURN(kernels::launch_expert_dgrad(dg, stream));
  EPFLOW_CUDA_RETURN(stage_boundary(hooks, stream));

  // dx rows into the owners' combine slots on the side stream, beside the weight gradients.
  EPFLOW_CUDA_RETURN(cudaEventRecord(dx_ready_, stream));
  EPFLOW_CUDA_RETURN(cudaStreamWaitEvent(aside, dx_ready_, 0));
  EPFLOW_RETURN_IF_ERROR(push_rows(ws, acts, dx_rows_, aside, beside_gemms));
  EPFLOW_CUDA_RETURN(cudaEventRecord(dx_pushed_, aside));
  EPFLOW_RETURN_IF_ERROR(weight_gradients(ws, acts, args, gemm_ctas, stream, x_pulled_));
  EPFLOW_CUDA_RETURN(stage_boundary(hooks, stream));
  // Join: every dx row is pushed (and the x rows pulled) before the barrier says so to peers.
  EPFLOW_CUDA_RETURN(cudaStreamWaitEvent(stream, dx_pushed_, 0));
  return Status::ok_status();
}

}  // namespace epflow::bench
