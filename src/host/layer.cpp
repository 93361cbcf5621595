#include "epflow/layer.h"

#include <cuda_runtime.h>

#include "host/status_util.h"

namespace epflow {

namespace {

Status require(bool ok, const char* what) {
  return ok ? Status::ok_status() : Status(StatusCode::kInvalidArgument, what);
}

}  // namespace

Status check_nccl_version() {
  int loaded = 0;
  if (ncclGetVersion(&loaded) != ncclSuccess)
    return error_status(StatusCode::kNcclError, "ncclGetVersion failed");
  if (loaded != NCCL_VERSION_CODE)
    return error_status(
        StatusCode::kNcclError, "EPFlow was built with NCCL headers ", NCCL_VERSION_CODE,
        " but the loaded libnccl is ", loaded,
        ": the device communicator layout differs between releases. Rebuild with "
        "-DEPFLOW_NCCL_ROOT pointing at the NCCL you load (or fix LD_LIBRARY_PATH).");
  return Status::ok_status();
}

Status validate(const LayerConfig& c, const ForwardArgs& a) {
  EPFLOW_RETURN_IF_ERROR(validate(c));
  if (a.num_tokens < 0 || a.num_tokens > c.max_tokens_per_rank)
    return error_status(StatusCode::kInvalidArgument, "num_tokens (", a.num_tokens,
                        ") must be in [0, max_tokens_per_rank=", c.max_tokens_per_rank, "]");
  if (a.num_tokens > 0) {
    EPFLOW_RETURN_IF_ERROR(require(a.x != nullptr, "x is null"));
    EPFLOW_RETURN_IF_ERROR(require(a.topk_idx != nullptr, "topk_idx is null"));
    EPFLOW_RETURN_IF_ERROR(require(a.topk_weights != nullptr, "topk_weights is null"));
    EPFLOW_RETURN_IF_ERROR(require(a.y != nullptr, "y is null"));
  }
  // Weights are needed even at T = 0: peers' tokens may still route to this rank's experts.
  EPFLOW_RETURN_IF_ERROR(require(a.weights.gate && a.weights.up && a.weights.down,
                                 "expert weights (gate, up, down) must all be set"));
  return Status::ok_status();
}

Status validate(const LayerConfig& c, const SavedContext& saved, const BackwardArgs& a) {
  EPFLOW_RETURN_IF_ERROR(validate(c));
  EPFLOW_RETURN_IF_ERROR(
      require(saved.generation != 0, "saved context was never filled by forward()"));
  if (saved.num_tokens > 0) {
    EPFLOW_RETURN_IF_ERROR(require(a.dy != nullptr, "dy is null"));
    EPFLOW_RETURN_IF_ERROR(require(a.dx != nullptr, "dx is null"));
    EPFLOW_RETURN_IF_ERROR(require(a.d_topk_weights != nullptr, "d_topk_weights is null"));
  }
  EPFLOW_RETURN_IF_ERROR(require(a.d_gate && a.d_up && a.d_down,
                                 "weight gradients (d_gate, d_up, d_down) must all be set"));
  return Status::ok_status();
}

struct Layer::Impl {
  LayerConfig config;
};

Layer::Layer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Layer::~Layer() = default;

Status Layer::create(const LayerConfig& config, ncclComm_t comm, std::unique_ptr<Layer>* out) {
  EPFLOW_RETURN_IF_ERROR(require(out != nullptr, "output pointer is null"));
  EPFLOW_RETURN_IF_ERROR(validate(config));
  if (config.dtype != DType::kBF16)
    return error_status(StatusCode::kNotImplemented, "dtype ", to_string(config.dtype),
                        " is not implemented yet: only bf16");
  EPFLOW_RETURN_IF_ERROR(check_nccl_version());
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0)
    return error_status(StatusCode::kNoDevice, "no CUDA device found (",
                        err == cudaSuccess ? "0 devices" : cudaGetErrorString(err), ")");
  EPFLOW_RETURN_IF_ERROR(require(comm != nullptr, "communicator is null"));
  int comm_size = 0, comm_rank = 0;
  if (ncclCommCount(comm, &comm_size) != ncclSuccess ||
      ncclCommUserRank(comm, &comm_rank) != ncclSuccess)
    return error_status(StatusCode::kNcclError, "could not query the communicator's size and rank");
  if (comm_size != config.ep_size || comm_rank != config.ep_rank)
    return error_status(StatusCode::kInvalidArgument, "communicator is rank ", comm_rank, " of ",
                        comm_size, " but config says ep_rank ", config.ep_rank, " of ep_size ",
                        config.ep_size);
  return error_status(StatusCode::kNotImplemented,
                      "the GPU layer is not implemented yet (issue [B]); use the CPU reference");
}

Status Layer::forward(const ForwardArgs& args, cudaStream_t, SavedContext*) {
  EPFLOW_RETURN_IF_ERROR(validate(impl_->config, args));
  return error_status(StatusCode::kNotImplemented,
                      "GPU forward is not implemented yet (issue [B])");
}

Status Layer::backward(const BackwardArgs& args, const SavedContext& saved, cudaStream_t) {
  EPFLOW_RETURN_IF_ERROR(validate(impl_->config, saved, args));
  return error_status(StatusCode::kNotImplemented,
                      "GPU backward is not implemented yet (issue [F])");
}

const LayerConfig& Layer::config() const { return impl_->config; }

MemoryReport Layer::memory() const { return {}; }

}  // namespace epflow
