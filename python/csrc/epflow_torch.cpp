// EPFlow's PyTorch binding: a torch op library, loaded from Python with
// torch.ops.load_library (python/epflow/__init__.py).
//
//   torch.classes.epflow.Workspace(unique_id, world, rank, device)
//       owns one ncclComm_t (ncclCommInitRank on `device`) and one epflow::Workspace on it: the
//       memory every handle on it shares (python/epflow keeps one per process group and device).
//     .memory() -> [symmetric, ring, schedule, backward] bytes it holds.
//   torch.classes.epflow.Handle(workspace, hidden, intermediate, num_experts, top_k,
//                               max_tokens_per_rank, timeout_seconds, comm_sms, minibatch_rows,
//                               ring_rows, saved_gate_up_rows, with_backward, dtype,
//                               fp8_power_of_two_scales)
//       one epflow::Layer of this shape on the workspace (with_backward:
//       LayerConfig::with_backward, what training needs; dtype "bf16" or "fp8":
//       LayerConfig::dtype). Layers of one shape share a handle (python/epflow);
//       every call of every handle on a workspace runs in stream order.
//     .quantize_weights(w_gate, w_up, w_down) -> [gate, up, down, gate_scales, up_scales,
//                                                 down_scales(, gate_up_t, down_t,
//                                                 gate_up_t_scales, down_t_scales)]
//       epflow::quantize_expert_weights of bf16 weights on the current stream (FP8 handles):
//       e4m3 as uint8 in the weights' shapes, fp32 scales [E, I/128, H/128] (gate, up) and
//       [E, H/128, I/128] (down), views of one new buffer; a with_backward handle's also the
//       transposed copies its backward reads (Fp8ExpertWeights).
//     .forward_train(x, topk_idx, topk_weights, w_gate, w_up, w_down, y, buffer,
//                    weights_reversed) -> Context
//       Layer::forward into the caller's y [T, H] bf16, keeping what its backward reads in
//       `buffer` (uint8, Handle.saved_context_bytes() bytes, the caller's: autograd saves it
//       like any activation, so activation checkpointing can drop and recompute it); any number
//       of contexts may be in flight. Weights [E, rows, cols] may be expert-strided views (each
//       expert's matrix contiguous, e.g. gate and up halves of a fused [E, 2I, H]), read in
//       place; weights_reversed: their rows list the experts from the last to the first (memory
//       order of a buffer that holds them in reverse, as Megatron-Core's DDP does).
//     .forward_train_fp8(x, topk_idx, topk_weights, fp8_weights, y, buffer) -> Context
//       the same for an FP8 handle, reading the weights quantize_weights returned (the caller
//       keeps them alive until the context's backward, which reads them too).
//     .backward(context, buffer, dy, x, topk_idx, topk_weights, w_gate, w_up, w_down)
//         -> (dx, d_topk_weights, d_w_gate, d_w_up, d_w_down)
//       Layer::backward of that context, given its buffer and its forward's inputs (the same
//       values: a recomputed copy is fine); bf16 weight gradients (the parameters' dtype), fp32
//       d_topk_weights. A context serves one backward; a second is refused with an error.
//     .backward_out(context, buffer, dy, x, topk_idx, topk_weights, w_gate, w_up, w_down,
//                   dx, d_topk_weights, d_w_gate, d_w_up, d_w_down, accumulate,
//                   weights_reversed, grads_reversed)
//       the same, into the caller's tensors: dx and d_topk_weights overwritten; the weight
//       gradients (all bf16 or all fp32; expert-strided views written in place, in reverse
//       expert order with grads_reversed) overwritten, or added to with accumulate (gradient
//       accumulation in place, as Megatron-Core's main_grad fusion does).
//     .memory() -> [symmetric, ring, schedule, backward] bytes its workspace holds;
//     .saved_context_bytes() -> bytes of one forward's context.
//   torch.classes.epflow.Context: one training forward's context (which layer and call made
//       it, and whether a backward has used it).
//   epflow::get_unique_id() -> Tensor            ncclUniqueId as uint8[128] on the CPU
//   epflow::check_config(world, hidden, ..., with_backward)  a shape's errors, before collectives
//   epflow::moe_forward(int handle, Tensor x, Tensor topk_idx, Tensor topk_weights,
//                       Tensor w_gate, Tensor w_up, Tensor w_down) -> Tensor y
//       Layer::forward on the current CUDA stream, keeping nothing (inference); y is freshly
//       allocated [T, H] bf16. The handle methods above are what python/epflow's autograd
//       function calls; they run on the current CUDA stream too.
//   epflow::moe_forward.out(..., *, Tensor(a!) out) -> Tensor(a!)
//       the same into the caller's `out` [T, H] bf16 (contiguous, 16-byte aligned, overlapping no
//       input); returns it.
//   epflow::moe_forward_fp8(int handle, Tensor x, Tensor topk_idx, Tensor topk_weights,
//                           Tensor[] fp8_weights) -> Tensor y
//       an FP8 handle's Layer::forward (inference), the weights as quantize_weights returns them.
//
// Every output is written whole by the call (every element of y, dx and d_topk_weights; every
// expert's weight gradient, zero for an expert no row reached): the forms that take outputs let a
// test fill them with NaN first and check that.
//
// NOTES: the op takes the handle's integer id, not the torchbind object: an int passes through
// torch.compile (Dynamo, FakeTensor, AOTAutograd) and CUDA-graph capture untouched, whereas a
// ScriptObject argument needs a registered fake class. The object keeps the communicator and
// the layer alive; the id is looked up in a registry it adds itself to and removes itself from.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstring>
#include <initializer_list>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "epflow/epflow.h"

namespace {

void check_status(const epflow::Status& s, const char* what) {
  if (s.ok()) return;
  if (s.code() == epflow::StatusCode::kNotImplemented)
    TORCH_CHECK_NOT_IMPLEMENTED(false, "EPFlow ", what, ": ", s.to_string());
  TORCH_CHECK(false, "EPFlow ", what, ": ", s.to_string());
}

class Handle;
struct Named;        // an input tensor and its name (check_output)
struct ForwardCall;  // a checked call's device and ForwardArgs

epflow::DType parse_dtype(const std::string& dtype) {
  TORCH_CHECK(dtype == "bf16" || dtype == "fp8", "EPFlow: dtype must be \"bf16\" or \"fp8\", got \"",
              dtype, "\"");
  return dtype == "fp8" ? epflow::DType::kFP8Blockwise : epflow::DType::kBF16;
}

epflow::LayerConfig layer_config(int64_t world, int64_t rank, int64_t hidden, int64_t intermediate,
                                 int64_t num_experts, int64_t top_k, int64_t max_tokens_per_rank,
                                 double timeout_seconds, int64_t comm_sms, int64_t minibatch_rows,
                                 int64_t ring_rows, int64_t saved_gate_up_rows,
                                 bool with_backward, const std::string& dtype,
                                 bool fp8_power_of_two_scales) {
  epflow::LayerConfig c;
  c.dtype = parse_dtype(dtype);
  c.fp8_power_of_two_scales = fp8_power_of_two_scales;
  c.hidden = hidden;
  c.intermediate = intermediate;
  c.num_experts = static_cast<int32_t>(num_experts);
  c.top_k = static_cast<int32_t>(top_k);
  c.ep_size = static_cast<int32_t>(world);
  c.ep_rank = static_cast<int32_t>(rank);
  c.max_tokens_per_rank = max_tokens_per_rank;
  c.timeout_seconds = timeout_seconds;
  c.comm_sms = static_cast<int32_t>(comm_sms);
  c.minibatch_rows = minibatch_rows;
  c.ring_rows = ring_rows;
  c.saved_gate_up_rows = saved_gate_up_rows;
  c.with_backward = with_backward;
  return c;
}

// A layer's config errors, with the field named, before any collective (python/epflow checks
// a shape with it before it creates a workspace or a handle).
void check_config(int64_t world, int64_t hidden, int64_t intermediate, int64_t num_experts,
                  int64_t top_k, int64_t max_tokens_per_rank, double timeout_seconds,
                  int64_t comm_sms, int64_t minibatch_rows, int64_t ring_rows,
                  int64_t saved_gate_up_rows, bool with_backward, std::string dtype,
                  bool fp8_power_of_two_scales) {
  const epflow::LayerConfig c =
      layer_config(world, 0, hidden, intermediate, num_experts, top_k, max_tokens_per_rank,
                   timeout_seconds, comm_sms, minibatch_rows, ring_rows, saved_gate_up_rows,
                   with_backward, dtype, fp8_power_of_two_scales);
  check_status(epflow::validate(c), "config");
}

std::vector<int64_t> memory_list(const epflow::MemoryReport& m) {
  return {m.symmetric_bytes, m.ring_bytes, m.schedule_bytes, m.backward_bytes};
}

// A process group's communicator on one device and the epflow::Workspace on it.
class Workspace : public torch::CustomClassHolder {
 public:
  Workspace(at::Tensor unique_id, int64_t world, int64_t rank, int64_t device) {
    TORCH_CHECK(unique_id.device().is_cpu() && unique_id.scalar_type() == at::kByte &&
                    unique_id.numel() == static_cast<int64_t>(sizeof(ncclUniqueId)),
                "unique_id must be a CPU uint8 tensor of ", sizeof(ncclUniqueId),
                " bytes (epflow._C.get_unique_id()), got ", unique_id.scalar_type(), " [",
                unique_id.numel(), "] on ", unique_id.device());
    TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "rank ", rank, " of world ", world,
                " is not a valid rank");
    TORCH_CHECK(device >= 0 && device < static_cast<int64_t>(c10::cuda::device_count()),
                "device cuda:", device, " does not exist (", c10::cuda::device_count(),
                " CUDA devices visible)");
    device_ = static_cast<c10::DeviceIndex>(device);
    world_ = static_cast<int32_t>(world);
    rank_ = static_cast<int32_t>(rank);
    c10::cuda::CUDAGuard guard(device_);
    ncclUniqueId id;
    std::memcpy(&id, unique_id.contiguous().data_ptr<uint8_t>(), sizeof(id));
    check_status(epflow::create_communicator(id, static_cast<int>(world), static_cast<int>(rank),
                                             &comm_),
                 "communicator");
    const epflow::Status s = epflow::Workspace::create(comm_, &workspace_);
    if (!s.ok()) {
      ncclCommDestroy(comm_);
      comm_ = nullptr;
      check_status(s, "Workspace::create");
    }
  }
  ~Workspace() override {
    if (device_ < 0) return;
    c10::cuda::CUDAGuard guard(device_);
    workspace_.reset();  // frees the symmetric window while the communicator still exists
    if (comm_) ncclCommDestroy(comm_);
  }
  c10::DeviceIndex device() const { return device_; }
  int32_t world() const { return world_; }
  int32_t rank() const { return rank_; }
  const std::shared_ptr<epflow::Workspace>& workspace() const { return workspace_; }
  std::vector<int64_t> memory() const { return memory_list(workspace_->memory()); }

 private:
  c10::DeviceIndex device_ = -1;
  int32_t world_ = 0, rank_ = 0;
  ncclComm_t comm_ = nullptr;
  std::shared_ptr<epflow::Workspace> workspace_;
};

// One training forward's context: the layer's SavedContext, whose buffer is the caller's tensor
// (given again to the backward, which may get a recomputed copy of it).
class Context : public torch::CustomClassHolder {
 public:
  epflow::SavedContext saved;
  int64_t call() const { return static_cast<int64_t>(saved.call); }
};

std::mutex g_registry_mutex;
std::unordered_map<int64_t, Handle*> g_registry;
int64_t g_next_id = 1;

class Handle : public torch::CustomClassHolder {
 public:
  Handle(const c10::intrusive_ptr<Workspace>& workspace, int64_t hidden, int64_t intermediate,
         int64_t num_experts, int64_t top_k, int64_t max_tokens_per_rank, double timeout_seconds,
         int64_t comm_sms, int64_t minibatch_rows, int64_t ring_rows, int64_t saved_gate_up_rows,
         bool with_backward, std::string dtype, bool fp8_power_of_two_scales)
      : workspace_(workspace) {
    config_ = layer_config(workspace->world(), workspace->rank(), hidden, intermediate,
                           num_experts, top_k, max_tokens_per_rank, timeout_seconds, comm_sms,
                           minibatch_rows, ring_rows, saved_gate_up_rows, with_backward, dtype,
                           fp8_power_of_two_scales);
    check_status(epflow::validate(config_), "config");
    device_ = workspace->device();
    c10::cuda::CUDAGuard guard(device_);
    check_status(epflow::Layer::create(config_, workspace->workspace(), &layer_), "Layer::create");
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    id_ = g_next_id++;
    g_registry[id_] = this;
  }

  ~Handle() override {
    {
      std::lock_guard<std::mutex> lock(g_registry_mutex);
      g_registry.erase(id_);
    }
    if (device_ >= 0) {
      c10::cuda::CUDAGuard guard(device_);
      layer_.reset();  // before the workspace (which this handle keeps alive)
    }
  }

  int64_t id() const { return id_; }
  int64_t device() const { return device_; }
  const epflow::LayerConfig& config() const { return config_; }
  epflow::Layer& layer() { return *layer_; }
  std::string repr() const {
    return "epflow.Handle(id=" + std::to_string(id_) + ", cuda:" + std::to_string(device_) +
           ", " + config_.to_string() + ")";
  }
  // Device memory the layer holds, bytes: [symmetric, ring, schedule, backward].
  std::vector<int64_t> memory() const { return memory_list(layer_->memory()); }
  int64_t saved_context_bytes() const { return layer_->saved_context_bytes(); }
  std::vector<at::Tensor> quantize_weights(const at::Tensor& w_gate, const at::Tensor& w_up,
                                           const at::Tensor& w_down);
  c10::intrusive_ptr<Context> forward_train(const at::Tensor& x, const at::Tensor& topk_idx,
                                            const at::Tensor& topk_weights,
                                            const at::Tensor& w_gate, const at::Tensor& w_up,
                                            const at::Tensor& w_down, at::Tensor y,
                                            at::Tensor buffer, bool weights_reversed);
  c10::intrusive_ptr<Context> forward_train_fp8(const at::Tensor& x, const at::Tensor& topk_idx,
                                                const at::Tensor& topk_weights,
                                                std::vector<at::Tensor> fp8_weights,
                                                at::Tensor y, at::Tensor buffer);
  // Layer::forward of a prepared call into a context over `buffer` (checked against `inputs`).
  c10::intrusive_ptr<Context> forward_keeping_context(const ForwardCall& call,
                                                      const at::Tensor& buffer,
                                                      std::initializer_list<Named> inputs);
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
      const c10::intrusive_ptr<Context>& context, const at::Tensor& buffer, const at::Tensor& dy,
      const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
      const at::Tensor& w_gate, const at::Tensor& w_up, const at::Tensor& w_down);
  void backward_out(const c10::intrusive_ptr<Context>& context, const at::Tensor& buffer,
                    const at::Tensor& dy, const at::Tensor& x,
                    const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                    const at::Tensor& w_gate, const at::Tensor& w_up, const at::Tensor& w_down,
                    at::Tensor dx, at::Tensor d_topk_weights, at::Tensor d_gate, at::Tensor d_up,
                    at::Tensor d_down, bool accumulate, bool weights_reversed,
                    bool grads_reversed);

 private:
  c10::intrusive_ptr<Workspace> workspace_;
  epflow::LayerConfig config_;
  c10::DeviceIndex device_ = -1;
  std::unique_ptr<epflow::Layer> layer_;
  int64_t id_ = 0;
};

Handle& lookup(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  auto it = g_registry.find(handle);
  TORCH_CHECK(it != g_registry.end(), "EPFlow handle ", handle,
              " does not exist (destroyed, or created in another process)");
  return *it->second;
}

at::Tensor get_unique_id() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  TORCH_CHECK(r == ncclSuccess, "ncclGetUniqueId: ", ncclGetErrorString(r));
  at::Tensor out = at::empty({static_cast<int64_t>(sizeof(id))}, at::kByte);
  std::memcpy(out.data_ptr<uint8_t>(), &id, sizeof(id));
  return out;
}

// A tensor argument's dtype, device and shape.
void check_kind(const at::Tensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef shape,
                const at::Device& device) {
  TORCH_CHECK(t.scalar_type() == dtype, "epflow.moe_forward: ", name, " must be ", dtype,
              ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == device, "epflow.moe_forward: ", name, " must be on ", device,
              " (the handle's device), got ", t.device());
  TORCH_CHECK(t.sizes() == shape, "epflow.moe_forward: ", name, " must have shape ", shape,
              ", got ", t.sizes());
}

// The kernels move rows with 16-byte vectors and TMA: a view at an odd offset would fault.
void check_aligned(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.numel() == 0 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              "epflow.moe_forward: ", name, " must start at a 16-byte aligned address (a view at "
              "an offset is not); call .clone()");
}

void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype,
                  at::IntArrayRef shape, const at::Device& device) {
  check_kind(t, name, dtype, shape, device);
  TORCH_CHECK(t.is_contiguous(), "epflow.moe_forward: ", name,
              " must be contiguous (row-major); call .contiguous()");
  check_aligned(t, name);
}

// Expert matrices [E, R, C] of `dtype` on `device`: each expert's matrix row-major and
// contiguous, any 16-byte multiple between experts (at least the matrix: a view of a fused
// [E, 2I, H] tensor, as Megatron-Core's linear_fc1, is read in place). Returns the expert
// stride in elements for ExpertWeights / BackwardArgs (0: densely packed).
int64_t check_expert_matrices(const at::Tensor& t, const char* name, at::ScalarType dtype,
                              at::IntArrayRef shape, const at::Device& device) {
  if (t.is_contiguous()) {
    check_tensor(t, name, dtype, shape, device);
    return 0;
  }
  check_kind(t, name, dtype, shape, device);
  const int64_t matrix = shape[1] * shape[2];
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == shape[2] &&
                  (shape[0] == 1 || (t.stride(0) >= matrix &&
                                     t.stride(0) * t.element_size() % 16 == 0)),
              "epflow.moe_forward: ", name, " must hold each expert's matrix row-major and "
              "contiguous, consecutive experts a multiple of 16 bytes and at least a matrix apart "
              "(a view of a fused [E, 2I, H] tensor works), got strides ", t.strides(),
              "; call .contiguous()");
  check_aligned(t, name);
  return shape[0] == 1 ? 0 : t.stride(0);
}

// A checked expert-matrices tensor for the C++ API: where expert 0's matrix starts and the
// signed expert stride. Expert e is the tensor's row e, or row E - 1 - e with `reversed` (the
// tensor in memory order of experts laid out from the last to the first, as Megatron-Core's DDP
// buffers hold them; torch has no negative strides).
struct ExpertMatrices {
  void* ptr;
  int64_t stride;
};
ExpertMatrices expert_matrices(const at::Tensor& t, const char* name, at::ScalarType dtype,
                               at::IntArrayRef shape, const at::Device& device, bool reversed) {
  const int64_t stride = check_expert_matrices(t, name, dtype, shape, device);
  if (!reversed || shape[0] <= 1) return {t.data_ptr(), stride};
  const int64_t step = stride == 0 ? shape[1] * shape[2] : stride;
  return {static_cast<char*>(t.data_ptr()) + (shape[0] - 1) * step * t.element_size(), -step};
}

// The byte ranges a checked tensor covers, ascending: one for a contiguous tensor, one per
// expert for expert matrices (check_expert_matrices).
std::vector<std::pair<uintptr_t, uintptr_t>> byte_ranges(const at::Tensor& t) {
  if (t.numel() == 0) return {};
  const auto base = reinterpret_cast<uintptr_t>(t.data_ptr());
  if (t.is_contiguous()) return {{base, base + t.nbytes()}};
  const auto bytes = static_cast<uintptr_t>(t.size(1) * t.size(2) * t.element_size());
  const auto step = static_cast<uintptr_t>(t.stride(0) * t.element_size());
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  for (int64_t e = 0; e < t.size(0); ++e)
    ranges.emplace_back(base + e * step, base + e * step + bytes);
  return ranges;
}

// Checked tensors overlap when any of their byte ranges do (fused gate and up views interleave
// without overlapping).
bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  const auto ra = byte_ranges(a), rb = byte_ranges(b);
  for (size_t i = 0, j = 0; i < ra.size() && j < rb.size();) {
    if (ra[i].first < rb[j].second && rb[j].first < ra[i].second) return true;
    if (ra[i].second <= rb[j].second)
      ++i;
    else
      ++j;
  }
  return false;
}

struct Named {
  const char* name;
  const at::Tensor* tensor;
};

// An output the caller gave: its dtype, shape, device, layout as for an input, and no overlap
// with what the call reads or with another output (the kernels read inputs while they write
// outputs, so an alias would be a race, not an in-place update).
void check_no_overlap(const at::Tensor& out, const char* name,
                      std::initializer_list<Named> others) {
  for (const Named& other : others)
    TORCH_CHECK(!overlaps(out, *other.tensor), "epflow: output ", name, " overlaps ",
                other.name, " in memory; give it a buffer of its own");
}
void check_output(const at::Tensor& out, const char* name, at::ScalarType dtype,
                  at::IntArrayRef shape, const at::Device& device,
                  std::initializer_list<Named> others) {
  check_tensor(out, name, dtype, shape, device);
  check_no_overlap(out, name, others);
}

// The checked forward arguments of one call on `h`, y not yet bound (forward_call's callers give
// the caller's y or allocate one; the backward re-checks its forward's arguments and needs none).
struct ForwardCall {
  at::Device device;
  epflow::ForwardArgs args;
};

// The checked token arguments of one call of `op` on `h` (x [T, H], topk_idx and topk_weights
// [T, K]), weights and y not yet bound.
ForwardCall token_call(Handle& h, const at::Tensor& x, const at::Tensor& topk_idx,
                       const at::Tensor& topk_weights, const char* op) {
  const epflow::LayerConfig& c = h.config();
  const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(h.device()));
  TORCH_CHECK(x.dim() == 2, op, ": x must be [T, H=", c.hidden, "], got ", x.sizes());
  const int64_t T = x.size(0);
  TORCH_CHECK(T <= c.max_tokens_per_rank, op, ": T=", T,
              " exceeds the handle's max_tokens_per_rank=", c.max_tokens_per_rank);
  check_tensor(x, "x", at::kBFloat16, {T, c.hidden}, device);
  check_tensor(topk_idx, "topk_idx", at::kInt, {T, c.top_k}, device);
  check_tensor(topk_weights, "topk_weights", at::kFloat, {T, c.top_k}, device);
  ForwardCall call{device, {}};
  epflow::ForwardArgs& a = call.args;
  a.num_tokens = T;
  a.x = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  a.topk_idx = topk_idx.data_ptr<int32_t>();
  a.topk_weights = topk_weights.data_ptr<float>();
  return call;
}

// This rank's bf16 expert weights of layer config c, checked ([E, I, H], [E, I, H], [E, H, I];
// expert-strided views read in place; `reversed`: see expert_matrices).
epflow::ExpertWeights bf16_expert_weights(const epflow::LayerConfig& c, const at::Tensor& w_gate,
                                          const at::Tensor& w_up, const at::Tensor& w_down,
                                          const at::Device& device, bool reversed = false) {
  const int64_t E = c.experts_per_rank(), H = c.hidden, I = c.intermediate;
  const auto gate = expert_matrices(w_gate, "w_gate", at::kBFloat16, {E, I, H}, device, reversed);
  const auto up = expert_matrices(w_up, "w_up", at::kBFloat16, {E, I, H}, device, reversed);
  const auto down = expert_matrices(w_down, "w_down", at::kBFloat16, {E, H, I}, device, reversed);
  epflow::ExpertWeights w;
  w.gate = static_cast<const __nv_bfloat16*>(gate.ptr);
  w.up = static_cast<const __nv_bfloat16*>(up.ptr);
  w.down = static_cast<const __nv_bfloat16*>(down.ptr);
  w.gate_expert_stride = gate.stride;
  w.up_expert_stride = up.stride;
  w.down_expert_stride = down.stride;
  return w;
}

ForwardCall forward_call(Handle& h, const at::Tensor& x, const at::Tensor& topk_idx,
                         const at::Tensor& topk_weights, const at::Tensor& w_gate,
                         const at::Tensor& w_up, const at::Tensor& w_down,
                         bool weights_reversed = false) {
  ForwardCall call = token_call(h, x, topk_idx, topk_weights, "epflow.moe_forward");
  call.args.weights =
      bf16_expert_weights(h.config(), w_gate, w_up, w_down, call.device, weights_reversed);
  return call;
}

// Binds the caller's y (checked) to a forward call.
void bind_y(ForwardCall& call, const at::Tensor& y, const at::Tensor& x,
            const at::Tensor& topk_idx, const at::Tensor& topk_weights, const at::Tensor& w_gate,
            const at::Tensor& w_up, const at::Tensor& w_down) {
  check_output(y, "y", at::kBFloat16, x.sizes(), call.device,
               {{"x", &x}, {"topk_idx", &topk_idx}, {"topk_weights", &topk_weights},
                {"w_gate", &w_gate}, {"w_up", &w_up}, {"w_down", &w_down}});
  call.args.y = reinterpret_cast<__nv_bfloat16*>(y.data_ptr());
}

cudaStream_t current_stream(const at::Device& device) {
  return at::cuda::getCurrentCUDAStream(device.index()).stream();
}

at::Tensor& moe_forward_out(int64_t handle, const at::Tensor& x, const at::Tensor& topk_idx,
                            const at::Tensor& topk_weights, const at::Tensor& w_gate,
                            const at::Tensor& w_up, const at::Tensor& w_down, at::Tensor& out) {
  Handle& h = lookup(handle);
  ForwardCall call = forward_call(h, x, topk_idx, topk_weights, w_gate, w_up, w_down);
  bind_y(call, out, x, topk_idx, topk_weights, w_gate, w_up, w_down);
  c10::cuda::CUDAGuard guard(call.device);
  check_status(h.layer().forward(call.args, current_stream(call.device), nullptr), "forward");
  return out;
}

at::Tensor moe_forward(int64_t handle, const at::Tensor& x, const at::Tensor& topk_idx,
                       const at::Tensor& topk_weights, const at::Tensor& w_gate,
                       const at::Tensor& w_up, const at::Tensor& w_down) {
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  return moe_forward_out(handle, x, topk_idx, topk_weights, w_gate, w_up, w_down, y);
}

// The FP8 weights' tensors of a layer (quantize_weights' order and shapes).
struct Fp8WeightShape {
  const char* name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};
std::vector<Fp8WeightShape> fp8_weight_shapes(const epflow::LayerConfig& c) {
  const int64_t E = c.experts_per_rank(), H = c.hidden, I = c.intermediate;
  std::vector<Fp8WeightShape> shapes = {
      {"gate", at::kByte, {E, I, H}},
      {"up", at::kByte, {E, I, H}},
      {"down", at::kByte, {E, H, I}},
      {"gate_scales", at::kFloat, {E, I / 128, H / 128}},
      {"up_scales", at::kFloat, {E, I / 128, H / 128}},
      {"down_scales", at::kFloat, {E, H / 128, I / 128}}};
  if (c.with_backward) {  // the transposed copies the backward reads
    shapes.push_back({"gate_up_t", at::kByte, {E, H, 2 * I}});
    shapes.push_back({"down_t", at::kByte, {E, I, H}});
    shapes.push_back({"gate_up_t_scales", at::kFloat, {E, H / 128, 2 * I / 128}});
    shapes.push_back({"down_t_scales", at::kFloat, {E, I / 128, H / 128}});
  }
  return shapes;
}

// The tensors quantize_weights returned as the layer's Fp8ExpertWeights, checked.
epflow::Fp8ExpertWeights fp8_expert_weights(const epflow::LayerConfig& c,
                                            at::TensorList fp8_weights, const at::Device& device,
                                            const char* what) {
  const auto shapes = fp8_weight_shapes(c);
  TORCH_CHECK(fp8_weights.size() == shapes.size(), what, ": fp8_weights must be the ",
              shapes.size(), " tensors Handle.quantize_weights returns, got ", fp8_weights.size());
  for (size_t i = 0; i < shapes.size(); ++i)
    check_tensor(fp8_weights[i], shapes[i].name, shapes[i].dtype, shapes[i].shape, device);
  epflow::Fp8ExpertWeights w;
  w.gate = fp8_weights[0].data_ptr<uint8_t>();
  w.up = fp8_weights[1].data_ptr<uint8_t>();
  w.down = fp8_weights[2].data_ptr<uint8_t>();
  w.gate_scales = fp8_weights[3].data_ptr<float>();
  w.up_scales = fp8_weights[4].data_ptr<float>();
  w.down_scales = fp8_weights[5].data_ptr<float>();
  if (c.with_backward) {
    w.gate_up_t = fp8_weights[6].data_ptr<uint8_t>();
    w.down_t = fp8_weights[7].data_ptr<uint8_t>();
    w.gate_up_t_scales = fp8_weights[8].data_ptr<float>();
    w.down_t_scales = fp8_weights[9].data_ptr<float>();
  }
  return w;
}

std::vector<at::Tensor> Handle::quantize_weights(const at::Tensor& w_gate, const at::Tensor& w_up,
                                                 const at::Tensor& w_down) {
  TORCH_CHECK(config_.dtype == epflow::DType::kFP8Blockwise,
              "EPFlow quantize_weights: the handle is not an fp8 layer");
  const at::Device device(at::kCUDA, device_);
  const epflow::ExpertWeights bf16 = bf16_expert_weights(config_, w_gate, w_up, w_down, device);
  c10::cuda::CUDAGuard guard(device_);
  const int64_t bytes = epflow::fp8_expert_weights_bytes(config_);
  at::Tensor buffer = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(device));
  epflow::Fp8ExpertWeights q;
  check_status(epflow::quantize_expert_weights(config_, bf16, config_.fp8_power_of_two_scales,
                                               buffer.data_ptr(), bytes, &q,
                                               current_stream(device)),
               "quantize_expert_weights");
  const void* parts[10] = {q.gate,      q.up,     q.down,           q.gate_scales,
                           q.up_scales, q.down_scales, q.gate_up_t, q.down_t,
                           q.gate_up_t_scales, q.down_t_scales};
  const auto shapes = fp8_weight_shapes(config_);
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const int64_t offset =
        static_cast<const uint8_t*>(parts[i]) - static_cast<const uint8_t*>(buffer.data_ptr());
    int64_t n = at::elementSize(shapes[i].dtype);
    for (int64_t d : shapes[i].shape) n *= d;
    out.push_back(buffer.narrow(0, offset, n).view(shapes[i].dtype).view(shapes[i].shape));
  }
  return out;
}

at::Tensor moe_forward_fp8(int64_t handle, const at::Tensor& x, const at::Tensor& topk_idx,
                           const at::Tensor& topk_weights, at::TensorList fp8_weights) {
  Handle& h = lookup(handle);
  const epflow::LayerConfig& c = h.config();
  TORCH_CHECK(c.dtype == epflow::DType::kFP8Blockwise,
              "epflow.moe_forward_fp8: the handle is not an fp8 layer (use moe_forward)");
  ForwardCall call = token_call(h, x, topk_idx, topk_weights, "epflow.moe_forward_fp8");
  const at::Device& device = call.device;
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  epflow::ForwardArgs& a = call.args;
  a.weights.fp8 = fp8_expert_weights(c, fp8_weights, device, "epflow.moe_forward_fp8");
  a.y = reinterpret_cast<__nv_bfloat16*>(y.data_ptr());
  c10::cuda::CUDAGuard guard(device);
  check_status(h.layer().forward(a, current_stream(device), nullptr), "forward");
  return y;
}

// A context's buffer: uint8, on the handle's device, contiguous, at least the layer's bytes.
void check_context_buffer(const at::Tensor& buffer, int64_t bytes, const at::Device& device) {
  TORCH_CHECK(buffer.scalar_type() == at::kByte && buffer.device() == device &&
                  buffer.is_contiguous() && buffer.numel() >= bytes,
              "EPFlow: the context buffer must be a contiguous uint8 tensor of at least ", bytes,
              " bytes (Handle.saved_context_bytes()) on ", device, ", got ", buffer.scalar_type(),
              " [", buffer.numel(), "] on ", buffer.device());
}

c10::intrusive_ptr<Context> Handle::forward_train(const at::Tensor& x,
                                                  const at::Tensor& topk_idx,
                                                  const at::Tensor& topk_weights,
                                                  const at::Tensor& w_gate, const at::Tensor& w_up,
                                                  const at::Tensor& w_down, at::Tensor y,
                                                  at::Tensor buffer, bool weights_reversed) {
  TORCH_CHECK(config_.with_backward, "EPFlow forward_train: the handle was created without "
              "with_backward (inference only)");
  ForwardCall call =
      forward_call(*this, x, topk_idx, topk_weights, w_gate, w_up, w_down, weights_reversed);
  bind_y(call, y, x, topk_idx, topk_weights, w_gate, w_up, w_down);
  return forward_keeping_context(call, buffer,
                                 {{"x", &x}, {"topk_idx", &topk_idx},
                                  {"topk_weights", &topk_weights}, {"w_gate", &w_gate},
                                  {"w_up", &w_up}, {"w_down", &w_down}, {"y", &y}});
}

c10::intrusive_ptr<Context> Handle::forward_train_fp8(const at::Tensor& x,
                                                      const at::Tensor& topk_idx,
                                                      const at::Tensor& topk_weights,
                                                      std::vector<at::Tensor> fp8_weights,
                                                      at::Tensor y, at::Tensor buffer) {
  TORCH_CHECK(config_.with_backward && config_.dtype == epflow::DType::kFP8Blockwise,
              "EPFlow forward_train_fp8: the handle is not an fp8 layer created with_backward");
  ForwardCall call = token_call(*this, x, topk_idx, topk_weights, "EPFlow forward_train_fp8");
  const at::Device& device = call.device;
  call.args.weights.fp8 = fp8_expert_weights(config_, fp8_weights, device,
                                             "EPFlow forward_train_fp8");
  check_output(y, "y", at::kBFloat16, x.sizes(), device,
               {{"x", &x}, {"topk_idx", &topk_idx}, {"topk_weights", &topk_weights}});
  call.args.y = reinterpret_cast<__nv_bfloat16*>(y.data_ptr());
  return forward_keeping_context(
      call, buffer,
      {{"x", &x}, {"topk_idx", &topk_idx}, {"topk_weights", &topk_weights}, {"y", &y}});
}

c10::intrusive_ptr<Context> Handle::forward_keeping_context(
    const ForwardCall& call, const at::Tensor& buffer, std::initializer_list<Named> inputs) {
  check_context_buffer(buffer, layer_->saved_context_bytes(), call.device);
  check_output(buffer, "buffer", at::kByte, buffer.sizes(), call.device, inputs);
  c10::cuda::CUDAGuard guard(call.device);
  auto context = c10::make_intrusive<Context>();
  context->saved.buffer = buffer.data_ptr();
  context->saved.buffer_bytes = buffer.numel();
  check_status(layer_->forward(call.args, current_stream(call.device), &context->saved),
               "forward");
  return context;
}

void Handle::backward_out(const c10::intrusive_ptr<Context>& context, const at::Tensor& buffer,
                          const at::Tensor& dy, const at::Tensor& x, const at::Tensor& topk_idx,
                          const at::Tensor& topk_weights,
                          const at::Tensor& w_gate, const at::Tensor& w_up,
                          const at::Tensor& w_down, at::Tensor dx, at::Tensor d_topk_weights,
                          at::Tensor d_gate, at::Tensor d_up, at::Tensor d_down,
                          bool accumulate, bool weights_reversed, bool grads_reversed) {
  // The forward's arguments, checked again (they must be the forward's, unchanged).
  ForwardCall call =
      forward_call(*this, x, topk_idx, topk_weights, w_gate, w_up, w_down, weights_reversed);
  check_tensor(dy, "dy", at::kBFloat16, x.sizes(), call.device);
  const std::initializer_list<Named> inputs = {
      {"dy", &dy},         {"x", &x},          {"topk_idx", &topk_idx},
      {"topk_weights", &topk_weights}, {"w_gate", &w_gate}, {"w_up", &w_up},
      {"w_down", &w_down}, {"buffer", &buffer}};
  check_output(dx, "dx", at::kBFloat16, x.sizes(), call.device, inputs);
  check_output(d_topk_weights, "d_topk_weights", at::kFloat, topk_weights.sizes(), call.device,
               inputs);
  // Weight gradients in bf16 (the parameters' dtype) or fp32 (a master-gradient buffer).
  const at::ScalarType grad_type = d_gate.scalar_type();
  TORCH_CHECK(grad_type == at::kBFloat16 || grad_type == at::kFloat,
              "epflow: weight gradients must be bfloat16 or float32, got ", grad_type);
  // Expert-strided gradients (a fused main_grad's views) are written in place.
  const auto dg = expert_matrices(d_gate, "d_w_gate", grad_type, w_gate.sizes(), call.device,
                                  grads_reversed);
  const auto du =
      expert_matrices(d_up, "d_w_up", grad_type, w_up.sizes(), call.device, grads_reversed);
  const auto dd = expert_matrices(d_down, "d_w_down", grad_type, w_down.sizes(), call.device,
                                  grads_reversed);
  check_no_overlap(d_gate, "d_w_gate", inputs);
  check_no_overlap(d_up, "d_w_up", inputs);
  check_no_overlap(d_down, "d_w_down", inputs);
  const std::pair<const char*, const at::Tensor*> outs[] = {
      {"dx", &dx}, {"d_topk_weights", &d_topk_weights}, {"d_w_gate", &d_gate},
      {"d_w_up", &d_up}, {"d_w_down", &d_down}};
  for (size_t i = 0; i < std::size(outs); ++i)
    for (size_t j = 0; j < i; ++j)
      TORCH_CHECK(!overlaps(*outs[i].second, *outs[j].second), "epflow: outputs ",
                  outs[j].first, " and ", outs[i].first, " overlap in memory");
  check_context_buffer(buffer, layer_->saved_context_bytes(), call.device);
  // The context as its forward left it (its copies share whether a backward used it), over the
  // tensors given now: activation checkpointing gives recomputed copies of x and the buffer.
  epflow::SavedContext saved = context->saved;
  const epflow::ForwardArgs& f = call.args;
  TORCH_CHECK(saved.num_tokens == f.num_tokens, "EPFlow backward: the context's forward had ",
              saved.num_tokens, " tokens, x has ", f.num_tokens);
  saved.buffer = buffer.data_ptr();
  saved.buffer_bytes = buffer.numel();
  saved.x = f.x;
  saved.topk_idx = f.topk_idx;
  saved.topk_weights = f.topk_weights;
  // FP8: the e4m3 weights its forward read (the caller keeps them alive), and the bf16 ones'
  // strides for the weight gradients' shapes.
  const epflow::Fp8ExpertWeights fp8 = saved.weights.fp8;
  saved.weights = f.weights;
  saved.weights.fp8 = fp8;
  c10::cuda::CUDAGuard guard(call.device);
  epflow::BackwardArgs b;
  b.dy = reinterpret_cast<const __nv_bfloat16*>(dy.data_ptr());
  b.dx = reinterpret_cast<__nv_bfloat16*>(dx.data_ptr());
  b.d_topk_weights = d_topk_weights.data_ptr<float>();
  b.d_gate = dg.ptr;
  b.d_up = du.ptr;
  b.d_down = dd.ptr;
  b.d_gate_expert_stride = dg.stride;
  b.d_up_expert_stride = du.stride;
  b.d_down_expert_stride = dd.stride;
  b.grad_dtype = grad_type == at::kFloat ? epflow::GradDType::kFP32 : epflow::GradDType::kBF16;
  b.accumulate_weight_grads = accumulate;
  check_status(layer_->backward(b, saved, current_stream(call.device)), "backward");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> Handle::backward(
    const c10::intrusive_ptr<Context>& context, const at::Tensor& buffer, const at::Tensor& dy,
    const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
    const at::Tensor& w_gate, const at::Tensor& w_up, const at::Tensor& w_down) {
  const auto contiguous = at::MemoryFormat::Contiguous;
  at::Tensor dx = at::empty_like(x, contiguous);
  at::Tensor d_topk_weights = at::empty_like(topk_weights, contiguous);
  at::Tensor d_gate = at::empty_like(w_gate, contiguous), d_up = at::empty_like(w_up, contiguous);
  at::Tensor d_down = at::empty_like(w_down, contiguous);
  backward_out(context, buffer, dy, x, topk_idx, topk_weights, w_gate, w_up, w_down, dx,
               d_topk_weights, d_gate, d_up, d_down, /*accumulate=*/false,
               /*weights_reversed=*/false, /*grads_reversed=*/false);
  return {dx, d_topk_weights, d_gate, d_up, d_down};
}

}  // namespace

TORCH_LIBRARY(epflow, m) {
  m.class_<Context>("Context").def("call", &Context::call);
  m.class_<Workspace>("Workspace")
      .def(torch::init<at::Tensor, int64_t, int64_t, int64_t>())
      .def("memory", &Workspace::memory);
  m.class_<Handle>("Handle")
      .def(torch::init<c10::intrusive_ptr<Workspace>, int64_t, int64_t, int64_t, int64_t, int64_t,
                       double, int64_t, int64_t, int64_t, int64_t, bool, std::string, bool>())
      .def("id", &Handle::id)
      .def("quantize_weights", &Handle::quantize_weights)
      .def("forward_train", &Handle::forward_train)
      .def("forward_train_fp8", &Handle::forward_train_fp8)
      .def("backward", &Handle::backward)
      .def("backward_out", &Handle::backward_out)
      .def("device", &Handle::device)
      .def("memory", &Handle::memory)
      .def("saved_context_bytes", &Handle::saved_context_bytes)
      .def("__repr__", &Handle::repr);
  m.def("get_unique_id() -> Tensor", &get_unique_id);
  m.def(
      "check_config(int world, int hidden, int intermediate, int num_experts, int top_k, "
      "int max_tokens_per_rank, float timeout_seconds, int comm_sms, int minibatch_rows, "
      "int ring_rows, int saved_gate_up_rows, bool with_backward, str dtype, "
      "bool fp8_power_of_two_scales) -> ()",
      &check_config);
  m.def(
      "moe_forward(int handle, Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor w_gate, "
      "Tensor w_up, Tensor w_down) -> Tensor");
  m.def(
      "moe_forward.out(int handle, Tensor x, Tensor topk_idx, Tensor topk_weights, "
      "Tensor w_gate, Tensor w_up, Tensor w_down, *, Tensor(a!) out) -> Tensor(a!)");
  m.def(
      "moe_forward_fp8(int handle, Tensor x, Tensor topk_idx, Tensor topk_weights, "
      "Tensor[] fp8_weights) -> Tensor");
}

TORCH_LIBRARY_IMPL(epflow, CUDA, m) {
  m.impl("moe_forward", &moe_forward);
  m.impl("moe_forward.out", &moe_forward_out);
  m.impl("moe_forward_fp8", &moe_forward_fp8);
}
