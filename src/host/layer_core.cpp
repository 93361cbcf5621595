#include "host/layer_core.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

#include "common/fp8_blocks.h"
#include "common/status_util.h"
#include "host/fused_passes.h"
#include "kernels/fp8_quantize.cuh"

namespace epflow {

namespace {

// A config this build can run, before anything touches the device.
Status check_supported(const LayerConfig& config) {
  EPFLOW_RETURN_IF_ERROR(validate(config));
  if (config.dtype == DType::kMXFP8)
    return error_status(StatusCode::kNotImplemented, "dtype ", to_string(config.dtype),
                        " is not implemented yet: bf16 and fp8-blockwise are");
  return Status::ok_status();
}

}  // namespace

Status LayerCore::create(const LayerConfig& config, ncclComm_t comm,
                         std::unique_ptr<LayerCore>* out) {
  if (out == nullptr) return invalid_argument("output pointer is null");
  EPFLOW_RETURN_IF_ERROR(check_supported(config));
  std::shared_ptr<SharedWorkspace> shared;
  EPFLOW_RETURN_IF_ERROR(SharedWorkspace::create(comm, &shared));
  return create(config, std::move(shared), out);
}

Status LayerCore::create(const LayerConfig& config, std::shared_ptr<SharedWorkspace> workspace,
                         std::unique_ptr<LayerCore>* out) {
  if (out == nullptr) return invalid_argument("output pointer is null");
  EPFLOW_RETURN_IF_ERROR(check_supported(config));
  if (workspace == nullptr) return invalid_argument("workspace is null");
  int device = 0;
  EPFLOW_CUDA_RETURN(cudaGetDevice(&device));
  if (device != workspace->device())
    return invalid_argument("the workspace is on device ", workspace->device(),
                            " but the current device is ", device);
  if (workspace->world() != config.ep_size || workspace->rank() != config.ep_rank)
    return invalid_argument("communicator is rank ", workspace->rank(), " of ", workspace->world(),
                            " but config says ep_rank ", config.ep_rank, " of ep_size ",
                            config.ep_size);
  static std::atomic<uint64_t> next_id{1};
  std::unique_ptr<LayerCore> core(new LayerCore());
  core->id_ = next_id.fetch_add(1);
  EPFLOW_RETURN_IF_ERROR(LayerWorkspace::create(config, std::move(workspace), &core->ws_));
  core->forward_ = std::make_unique<FusedForward>();
  core->backward_ = std::make_unique<FusedBackward>(core->ws_->plan.backward_comm_sms);
  *out = std::move(core);
  return Status::ok_status();
}

LayerCore::~LayerCore() {
  // After a timed-out wait the CUDA context is dead: leave its memory alone (the process must
  // exit); the shared workspace keeps its own.
  if (ws_ && !ws_->device_failure().ok()) {
    (void)forward_.release();
    (void)backward_.release();
  }
}

Status LayerCore::begin_call(cudaStream_t stream) {
  ws_->refresh();
  return ws_->shared->begin_call(stream);
}

std::vector<const char*> LayerCore::forward_stage_names() {
  return {"metadata+schedule", "dispatch", "expert FFN", "combine+sum"};
}

std::vector<const char*> LayerCore::backward_stage_names() const {
  std::vector<const char*> names{"inputs+barrier"};
  for (const char* n : backward_->stage_names()) names.push_back(n);
  names.push_back("barrier+sum");
  return names;
}

void LayerCore::set_forward_executor(std::unique_ptr<ForwardExecutor> executor) {
  forward_ = std::move(executor);
}

void LayerCore::set_backward_executor(std::unique_ptr<BackwardExecutor> executor) {
  backward_ = std::move(executor);
}

Status LayerCore::set_backward_comm_sms(int32_t comm_sms) {
  if (comm_sms < 1 || comm_sms >= ws_->sm_count)
    return invalid_argument("backward communication SMs (", comm_sms, ") must be in [1, ",
                            ws_->sm_count, ")");
  backward_ = std::make_unique<FusedBackward>(comm_sms);
  return Status::ok_status();
}

Status LayerCore::set_wgrad_precision(WgradPrecision precision) {
  if (!(config().dtype == DType::kFP8Blockwise && config().with_backward))
    return invalid_argument("the weight gradients' precision is a choice of fp8-blockwise "
                            "layers created with_backward only");
  ws_->wgrad_precision = precision;
  return Status::ok_status();
}

MemoryReport LayerCore::memory() const { return ws_->shared->memory(); }

int64_t LayerCore::saved_context_bytes() const {
  return SavedActivations::bytes(*ws_, /*with_gate_up=*/true);
}

Status LayerCore::with_device_failure(Status s) const {
  if (s.ok()) return s;
  const Status why = ws_->device_failure();
  return why.ok() ? s : error_status(why.code(), s.message(), ": ", why.message());
}

// A wait of an earlier call that timed out trapped its kernel (the CUDA context is gone); say
// where, from host-mapped memory, without touching the device.
Status LayerCore::earlier_failure() const {
  const Status why = ws_->device_failure();
  if (why.ok()) return why;
  return error_status(StatusCode::kTimeout, "an earlier call failed on the device: ",
                      why.message());
}

Status LayerCore::forward(const ForwardArgs& args, cudaStream_t stream, SavedContext* saved,
                          PassHooks* hooks) {
  EPFLOW_RETURN_IF_ERROR(validate(config(), args));
  if (saved) {
    if (!config().with_backward)
      return invalid_argument("forward() with a SavedContext needs a layer created with "
                              "LayerConfig::with_backward (it has the backward's buffers)");
    const int64_t need = saved_context_bytes();
    if (saved->buffer == nullptr || saved->buffer_bytes < need)
      return invalid_argument("SavedContext::buffer must be device memory of at least ", need,
                              " bytes (Layer::saved_context_bytes()), got ", saved->buffer_bytes,
                              saved->buffer ? "" : " (null)");
    if (reinterpret_cast<uintptr_t>(saved->buffer) % SavedActivations::kAlignment != 0)
      return invalid_argument("SavedContext::buffer must be ", SavedActivations::kAlignment,
                              "-byte aligned");
  }
  EPFLOW_RETURN_IF_ERROR(begin_call(stream));
  EPFLOW_RETURN_IF_ERROR(with_device_failure(run_forward(args, stream, saved, hooks)));
  EPFLOW_RETURN_IF_ERROR(ws_->shared->end_call(stream));
  return ws_->routing_report();
}

Status LayerCore::backward(const BackwardArgs& args, const SavedContext& saved,
                           cudaStream_t stream, PassHooks* hooks) {
  EPFLOW_RETURN_IF_ERROR(validate(config(), saved, args));
  if (saved.layer_id != id_)
    return invalid_argument("saved context was filled by another layer (forward call ",
                            saved.call, " of layer ", saved.layer_id, "; this is layer ", id_, ")");
  if (*saved.consumed)
    return invalid_argument("saved context of forward call ", saved.call,
                            " was already used by a backward (a context serves one backward)");
  EPFLOW_RETURN_IF_ERROR(begin_call(stream));
  EPFLOW_RETURN_IF_ERROR(with_device_failure(run_backward(args, saved, stream, hooks)));
  EPFLOW_RETURN_IF_ERROR(ws_->shared->end_call(stream));
  *saved.consumed = true;
  return ws_->routing_report();
}

// Token rows [T, H] (x or dy) into this rank's window for peers to pull: bf16 as they are, or
// (FP8) quantized once, by their owner, into packed rows that peers pull as they are.
Status LayerCore::rows_into_window(const __nv_bfloat16* rows, int64_t T, char* dst,
                                   cudaStream_t stream) const {
  const LayerConfig& c = config();
  if (c.dtype != DType::kFP8Blockwise) {
    EPFLOW_CUDA_RETURN(cudaMemcpyAsync(dst, rows, sizeof(__nv_bfloat16) * T * c.hidden,
                                       cudaMemcpyDeviceToDevice, stream));
    return Status::ok_status();
  }
  uint8_t* packed = reinterpret_cast<uint8_t*>(dst);
  const int64_t row_bytes = fp8::packed_row_bytes(c.hidden);
  EPFLOW_CUDA_RETURN(kernels::launch_quantize_rows_1x128(
      rows, T, c.hidden, c.fp8_power_of_two_scales, packed,
      reinterpret_cast<float*>(packed + c.hidden), stream, row_bytes, row_bytes / 4));
  return Status::ok_status();
}

// Stages: this rank's tokens and expert ids into its window, the barrier that publishes them and
// gathers every rank's T, the schedule of this rank's experts | the executor (dispatch, expert
// FFN) | the barrier and the weighted sum.
Status LayerCore::run_forward(const ForwardArgs& a, cudaStream_t stream, SavedContext* saved,
                              PassHooks* hooks) {
  const LayerConfig& c = config();
  const int64_t T = a.num_tokens;
  EPFLOW_RETURN_IF_ERROR(earlier_failure());
  EPFLOW_CUDA_RETURN(stage_boundary(hooks, stream));
  char* mine = ws_->local_window();
  if (T > 0) {
    EPFLOW_RETURN_IF_ERROR(rows_into_window(a.x, T, mine + ws_->layout.x, stream));
    EPFLOW_CUDA_RETURN(cudaMemcpyAsync(mine + ws_->layout.topk_idx, a.topk_idx,
                                       sizeof(int32_t) * T * c.top_k, cudaMemcpyDeviceToDevice,
                                       stream));
  }
  SavedActivations acts = SavedActivations::carve(
      *ws_, saved ? saved->buffer : ws_->inference_schedule, /*with_gate_up=*/saved != nullptr);
  EPFLOW_RETURN_IF_ERROR(ws_->publish_barrier(T, stream));
  EPFLOW_RETURN_IF_ERROR(acts.build_schedule(*ws_, stream));
  EPFLOW_CUDA_RETURN(stage_boundary(hooks, stream));
  EPFLOW_RETURN_IF_ERROR(forward_->run(*ws_, acts, a.weights, saved != nullptr, stream, hooks));
  EPFLOW_RETURN_IF_ERROR(
      ws_->barrier_and_sum(T, a.topk_idx, a.topk_weights, true, a.y, stream));
  EPFLOW_CUDA_RETURN(stage_boundary(hooks, stream));

  ++calls_;
  if (saved) {
    saved->layer_id = id_;
    saved->call = calls_;
    saved->num_tokens = T;
    saved->x = a.x;
    saved->topk_idx = a.topk_idx;
    saved->topk_weights = a.topk_weights;
    saved->weights = a.weights;
    saved->consumed = std::make_shared<bool>(false);
  }
  return Status::ok_status();
}

// Stages: this rank's x (again: later forwards may have replaced it), the router weights and dy
// into its window and the barrier that publishes them | the executor's, on the forward's
// schedule and g | u from the context | the barrier and each owner's sum of its dx rows over k.
Status LayerCore::run_backward(const BackwardArgs& a, const SavedContext& saved,
                               cudaStream_t stream, PassHooks* hooks) {
  const LayerConfig& c = config();
  const int64_t T = saved.num_tokens;
  EPFLOW_RETURN_IF_ERROR(earlier_failure());
  EPFLOW_CUDA_RETURN(stage_boundary(hooks, stream));
  char* mine = ws_->local_window();
  const kernels::WindowLayout& l = ws_->layout;
  if (T > 0) {
    EPFLOW_RETURN_IF_ERROR(rows_into_window(saved.x, T, mine + l.x, stream));
    EPFLOW_CUDA_RETURN(cudaMemcpyAsync(mine + l.topk_weights, saved.topk_weights,
                                       sizeof(float) * T * c.top_k, cudaMemcpyDeviceToDevice,
                                       stream));
    EPFLOW_RETURN_IF_ERROR(rows_into_window(a.dy, T, mine + l.dy, stream));
    // The d topk_weights slots the experts' GPUs write; empty slots stay 0.
    EPFLOW_CUDA_RETURN(cudaMemsetAsync(mine + l.d_weights, 0, sizeof(float) * T * c.top_k, stream));
  }
  EPFLOW_RETURN_IF_ERROR(ws_->publish_barrier(T, stream));
  EPFLOW_CUDA_RETURN(stage_boundary(hooks, stream));
  const SavedActivations acts = SavedActivations::carve(*ws_, saved.buffer, true);
  ws_->fp8_weight_gradients =
      c.dtype == DType::kFP8Blockwise &&
      (ws_->wgrad_precision == WgradPrecision::kAuto ? runtime::fp8_weight_gradients_pay(c, T)
                                                     : ws_->wgrad_precision == WgradPrecision::kFp8);
  EPFLOW_RETURN_IF_ERROR(backward_->run(*ws_, acts, saved.weights, a, stream, hooks));
  // Unweighted sums (the dx rows arrive weighted), and no routing check: the forward of this
  // context checked the same ids.
  EPFLOW_RETURN_IF_ERROR(ws_->barrier_and_sum(T, saved.topk_idx, nullptr, false, a.dx, stream));
  if (T > 0)
    EPFLOW_CUDA_RETURN(cudaMemcpyAsync(a.d_topk_weights, mine + l.d_weights,
                                       sizeof(float) * T * c.top_k, cudaMemcpyDeviceToDevice,
                                       stream));
  EPFLOW_CUDA_RETURN(stage_boundary(hooks, stream));
  return Status::ok_status();
}

}  // namespace epflow
