// The public Layer: a handle over LayerCore (layer_core.h), and the host-side checks of a call's
// arguments.
#include "epflow/layer.h"

#include <utility>

#include "common/status_util.h"
#include "host/layer_core.h"

namespace epflow {

namespace {

Status require(bool ok, const char* what) {
  return ok ? Status::ok_status() : Status(StatusCode::kInvalidArgument, what);
}

}  // namespace

Status validate(const LayerConfig& c, const ForwardArgs& a) {
  EPFLOW_RETURN_IF_ERROR(validate(c));
  if (a.num_tokens < 0 || a.num_tokens > c.max_tokens_per_rank)
    return invalid_argument("num_tokens (", a.num_tokens, ") must be in [0, max_tokens_per_rank=",
                            c.max_tokens_per_rank, "]");
  if (a.num_tokens > 0) {
    EPFLOW_RETURN_IF_ERROR(require(a.x != nullptr, "x is null"));
    EPFLOW_RETURN_IF_ERROR(require(a.topk_idx != nullptr, "topk_idx is null"));
    EPFLOW_RETURN_IF_ERROR(require(a.topk_weights != nullptr, "topk_weights is null"));
    EPFLOW_RETURN_IF_ERROR(require(a.y != nullptr, "y is null"));
  }
  // Weights are needed even at T = 0: peers' tokens may still route to this rank's experts.
  return require(a.weights.gate && a.weights.up && a.weights.down,
                 "expert weights (gate, up, down) must all be set");
}

Status validate(const LayerConfig& c, const SavedContext& saved, const BackwardArgs& a) {
  EPFLOW_RETURN_IF_ERROR(validate(c));
  EPFLOW_RETURN_IF_ERROR(require(c.with_backward,
                                 "backward() needs a layer created with LayerConfig::with_backward"));
  EPFLOW_RETURN_IF_ERROR(require(saved.layer_id != 0 && saved.consumed != nullptr,
                                 "saved context was never filled by forward()"));
  EPFLOW_RETURN_IF_ERROR(require(saved.buffer != nullptr, "saved context has no buffer"));
  if (saved.num_tokens > 0) {
    EPFLOW_RETURN_IF_ERROR(require(a.dy != nullptr, "dy is null"));
    EPFLOW_RETURN_IF_ERROR(require(a.dx != nullptr, "dx is null"));
    EPFLOW_RETURN_IF_ERROR(require(a.d_topk_weights != nullptr, "d_topk_weights is null"));
  }
  return require(a.d_gate && a.d_up && a.d_down,
                 "weight gradients (d_gate, d_up, d_down) must all be set");
}

struct Workspace::Impl {
  std::shared_ptr<SharedWorkspace> shared;
};

Workspace::Workspace(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Workspace::~Workspace() = default;

Status Workspace::create(ncclComm_t comm, std::shared_ptr<Workspace>* out) {
  EPFLOW_RETURN_IF_ERROR(require(out != nullptr, "output pointer is null"));
  auto impl = std::make_unique<Impl>();
  EPFLOW_RETURN_IF_ERROR(SharedWorkspace::create(comm, &impl->shared));
  out->reset(new Workspace(std::move(impl)));
  return Status::ok_status();
}

MemoryReport Workspace::memory() const { return impl_->shared->memory(); }

struct Layer::Impl {
  std::unique_ptr<LayerCore> core;
};

Layer::Layer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Layer::~Layer() = default;

Status Layer::create(const LayerConfig& config, const std::shared_ptr<Workspace>& workspace,
                     std::unique_ptr<Layer>* out) {
  EPFLOW_RETURN_IF_ERROR(require(out != nullptr, "output pointer is null"));
  EPFLOW_RETURN_IF_ERROR(require(workspace != nullptr, "workspace is null"));
  auto impl = std::make_unique<Impl>();
  EPFLOW_RETURN_IF_ERROR(LayerCore::create(config, workspace->impl_->shared, &impl->core));
  out->reset(new Layer(std::move(impl)));
  return Status::ok_status();
}

Status Layer::create(const LayerConfig& config, ncclComm_t comm, std::unique_ptr<Layer>* out) {
  EPFLOW_RETURN_IF_ERROR(require(out != nullptr, "output pointer is null"));
  auto impl = std::make_unique<Impl>();
  EPFLOW_RETURN_IF_ERROR(LayerCore::create(config, comm, &impl->core));
  out->reset(new Layer(std::move(impl)));
  return Status::ok_status();
}

Status Layer::forward(const ForwardArgs& args, cudaStream_t stream, SavedContext* saved) {
  return impl_->core->forward(args, stream, saved);
}

Status Layer::backward(const BackwardArgs& args, const SavedContext& saved, cudaStream_t stream) {
  return impl_->core->backward(args, saved, stream);
}

const LayerConfig& Layer::config() const { return impl_->core->config(); }
MemoryReport Layer::memory() const { return impl_->core->memory(); }
int64_t Layer::saved_context_bytes() const { return impl_->core->saved_context_bytes(); }
Status Layer::check_routing() { return impl_->core->check_routing(); }
Status Layer::device_failure() const { return impl_->core->device_failure(); }

Status with_device_failure(const Layer& layer, Status s) {
  if (s.ok()) return s;
  const Status why = layer.device_failure();
  return why.ok() ? s : error_status(why.code(), s.message(), ": ", why.message());
}

}  // namespace epflow
