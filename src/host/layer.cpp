// The public Layer: a handle over LayerCore (layer_core.h), and the host-side checks of a call's
// arguments.
#include "epflow/layer.h"

#include <utility>

#include "common/status_util.h"
#include "host/layer_core.h"
#include "kernels/fp8_quantize.cuh"

namespace epflow {

namespace {

Status require(bool ok, const char* what) {
  return ok ? Status::ok_status() : Status(StatusCode::kInvalidArgument, what);
}

// One matrix kind of this rank's experts (or of their gradients): `rows` x `cols` elements of
// elem_bytes each, expert e's at p + e * stride elements (a negative stride: the experts laid out
// from the last to the first). The kernels read and write them through TMA, which needs 16-byte
// aligned starts and strides.
Status check_expert_matrices(const char* name, const void* p, int64_t stride, int64_t rows,
                             int64_t cols, int64_t elem_bytes) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0)
    return invalid_argument(name, " must start at a 16-byte aligned address");
  const int64_t step = stride < 0 ? -stride : stride;
  if (stride != 0 && (step < rows * cols || step * elem_bytes % 16 != 0))
    return invalid_argument(name, "'s expert stride (", stride, " elements) must be 0 (densely "
                            "packed) or at least the matrix's ", rows * cols, " elements either "
                            "way and a multiple of 16 bytes");
  return Status::ok_status();
}

Status check_bf16_expert_weights(const LayerConfig& c, const ExpertWeights& w) {
  EPFLOW_RETURN_IF_ERROR(require(w.gate && w.up && w.down,
                                 "bf16 expert weights (gate, up, down) must all be set"));
  const int64_t H = c.hidden, I = c.intermediate;
  EPFLOW_RETURN_IF_ERROR(check_expert_matrices("gate", w.gate, w.gate_expert_stride, I, H, 2));
  EPFLOW_RETURN_IF_ERROR(check_expert_matrices("up", w.up, w.up_expert_stride, I, H, 2));
  return check_expert_matrices("down", w.down, w.down_expert_stride, H, I, 2);
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
  if (c.dtype == DType::kFP8Blockwise) {
    const Fp8ExpertWeights& w = a.weights.fp8;
    EPFLOW_RETURN_IF_ERROR(
        require(w.gate && w.up && w.down && w.gate_scales && w.up_scales && w.down_scales,
                "an fp8-blockwise layer reads ExpertWeights::fp8: its e4m3 weights and "
                "scales (gate, up, down) must all be set (quantize_expert_weights)"));
    for (const void* p : {static_cast<const void*>(w.gate), static_cast<const void*>(w.up),
                          static_cast<const void*>(w.down), static_cast<const void*>(w.gate_scales),
                          static_cast<const void*>(w.up_scales),
                          static_cast<const void*>(w.down_scales)})
      EPFLOW_RETURN_IF_ERROR(require(reinterpret_cast<uintptr_t>(p) % 16 == 0,
                                     "ExpertWeights::fp8's weights and scales must be 16-byte "
                                     "aligned (TMA reads them)"));
    if (c.with_backward) {
      EPFLOW_RETURN_IF_ERROR(require(
          w.gate_up_t && w.down_t && w.gate_up_t_scales && w.down_t_scales,
          "a training fp8-blockwise layer's backward also reads the transposed weights "
          "(ExpertWeights::fp8's gate_up_t, down_t and their scales): quantize the weights with "
          "the training config (quantize_expert_weights)"));
      for (const void* p :
           {static_cast<const void*>(w.gate_up_t), static_cast<const void*>(w.down_t),
            static_cast<const void*>(w.gate_up_t_scales),
            static_cast<const void*>(w.down_t_scales)})
        EPFLOW_RETURN_IF_ERROR(require(reinterpret_cast<uintptr_t>(p) % 16 == 0,
                                       "ExpertWeights::fp8's transposed weights and scales must "
                                       "be 16-byte aligned (TMA reads them)"));
    }
    return Status::ok_status();
  }
  return check_bf16_expert_weights(c, a.weights);
}

namespace {

// quantize_expert_weights' buffer: the three e4m3 matrices, their scales, then (training
// configs) the transposed copies gate_up_t and down_t and their scales, each region 256-byte
// aligned. offsets[i]: start of region i; [kFp8Regions]: the end.
enum Fp8Region { kGate, kUp, kDown, kGateScales, kUpScales, kDownScales, kGateUpT, kDownT,
                 kGateUpTScales, kDownTScales, kFp8Regions };
void fp8_weight_regions(const LayerConfig& c, int64_t offsets[kFp8Regions + 1]) {
  const int64_t E = c.experts_per_rank(), H = c.hidden, I = c.intermediate;
  const int64_t hb = (H + 127) / 128, ib = (I + 127) / 128;
  const int64_t t = c.with_backward ? 1 : 0;
  const int64_t sizes[kFp8Regions] = {E * I * H,           E * I * H,      E * H * I,
                                      E * ib * hb * 4,     E * ib * hb * 4, E * hb * ib * 4,
                                      t * E * H * 2 * I,   t * E * I * H,  t * E * hb * 2 * ib * 4,
                                      t * E * ib * hb * 4};
  int64_t at = 0;
  for (int i = 0; i < kFp8Regions; ++i) {
    offsets[i] = at;
    at += (sizes[i] + 255) / 256 * 256;
  }
  offsets[kFp8Regions] = at;
}

}  // namespace

int64_t fp8_expert_weights_bytes(const LayerConfig& config) {
  int64_t offsets[kFp8Regions + 1];
  fp8_weight_regions(config, offsets);
  return offsets[kFp8Regions];
}

Status quantize_expert_weights(const LayerConfig& c, const ExpertWeights& w, bool pow2,
                               void* buffer, int64_t buffer_bytes, Fp8ExpertWeights* out,
                               cudaStream_t stream) {
  EPFLOW_RETURN_IF_ERROR(validate(c));
  EPFLOW_RETURN_IF_ERROR(require(out != nullptr, "output pointer is null"));
  EPFLOW_RETURN_IF_ERROR(check_bf16_expert_weights(c, w));
  int64_t at[kFp8Regions + 1];
  fp8_weight_regions(c, at);
  if (buffer == nullptr || buffer_bytes < at[kFp8Regions])
    return invalid_argument("the FP8 weights' buffer must be device memory of at least ",
                            at[kFp8Regions], " bytes (fp8_expert_weights_bytes), got ",
                            buffer_bytes, buffer ? "" : " (null)");
  EPFLOW_RETURN_IF_ERROR(require(reinterpret_cast<uintptr_t>(buffer) % 256 == 0,
                                 "the FP8 weights' buffer must be 256-byte aligned"));
  auto* base = static_cast<uint8_t*>(buffer);
  const int64_t E = c.experts_per_rank(), H = c.hidden, I = c.intermediate;
  const int64_t hb = (H + 127) / 128, ib = (I + 127) / 128;
  auto scales = [&](int i) { return reinterpret_cast<float*>(base + at[i]); };
  // Training: W_gate^T and W_up^T side by side in gate_up_t (rows of 2I), W_down^T in down_t.
  kernels::TransposedCopy gate_t, up_t, down_t;
  if (c.with_backward) {
    gate_t = {base + at[kGateUpT], 2 * I, H * 2 * I, scales(kGateUpTScales), 2 * ib, hb * 2 * ib};
    up_t = gate_t;
    up_t.q += I;
    up_t.scales += ib;
    down_t = {base + at[kDownT], H, I * H, scales(kDownTScales), hb, ib * hb};
  }
  EPFLOW_CUDA_RETURN(kernels::launch_quantize_blocks_128x128(w.gate, E, I, H, pow2,
                                                             base + at[kGate], scales(kGateScales),
                                                             stream, w.gate_expert_stride, gate_t));
  EPFLOW_CUDA_RETURN(kernels::launch_quantize_blocks_128x128(w.up, E, I, H, pow2, base + at[kUp],
                                                             scales(kUpScales), stream,
                                                             w.up_expert_stride, up_t));
  EPFLOW_CUDA_RETURN(kernels::launch_quantize_blocks_128x128(w.down, E, H, I, pow2,
                                                             base + at[kDown], scales(kDownScales),
                                                             stream, w.down_expert_stride, down_t));
  Fp8ExpertWeights q;
  q.gate = base + at[kGate];
  q.up = base + at[kUp];
  q.down = base + at[kDown];
  q.gate_scales = scales(kGateScales);
  q.up_scales = scales(kUpScales);
  q.down_scales = scales(kDownScales);
  if (c.with_backward) {
    q.gate_up_t = gate_t.q;
    q.down_t = down_t.q;
    q.gate_up_t_scales = gate_t.scales;
    q.down_t_scales = down_t.scales;
  }
  *out = q;
  return Status::ok_status();
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
  EPFLOW_RETURN_IF_ERROR(require(a.d_gate && a.d_up && a.d_down,
                                 "weight gradients (d_gate, d_up, d_down) must all be set"));
  const int64_t H = c.hidden, I = c.intermediate;
  const int64_t bytes = a.grad_dtype == GradDType::kFP32 ? 4 : 2;
  EPFLOW_RETURN_IF_ERROR(
      check_expert_matrices("d_gate", a.d_gate, a.d_gate_expert_stride, I, H, bytes));
  EPFLOW_RETURN_IF_ERROR(check_expert_matrices("d_up", a.d_up, a.d_up_expert_stride, I, H, bytes));
  return check_expert_matrices("d_down", a.d_down, a.d_down_expert_stride, H, I, bytes);
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
