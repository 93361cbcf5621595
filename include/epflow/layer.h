// EPFlow: the expert-parallel MoE layer handle: create once per communicator and shape, then call
// forward() and backward() on device pointers, stream-ordered, with no host synchronisation.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <memory>

#include "epflow/config.h"
#include "epflow/status.h"

namespace epflow {

// This rank's experts, row-major bf16 on the device (the layout of torch.nn.Linear weights):
// gate and up [E_local, I, H], down [E_local, H, I]. Expert e's matrix starts at
// `gate + e * gate_expert_stride` (likewise up and down; in elements, 0: right after expert
// e - 1's, densely packed), so the weights are read in place from fused storage: Megatron-Core's
// linear_fc1 [E_local, 2I, H] (gate rows, then up rows) is gate = fc1, up = fc1 + I * H with
// both strides 2 * I * H. A negative stride lays the experts out from the last to the first
// (Megatron-Core's DDP buffers hold parameters and gradients in reverse order). A stride is 0 or
// at least its matrix's size either way and a multiple of 8 (16 bytes); the pointers (expert 0's
// matrices) are 16-byte aligned.
// FP8 layers (LayerConfig::dtype = kFP8Blockwise) read `fp8` instead: the same matrices as e4m3
// bytes (OCP E4M3FN) in the same layouts, and one fp32 scale per 128 x 128 block, row-major over
// the blocks: gate and up scales [E_local, I / 128, H / 128], down [E_local, H / 128, I / 128];
// an element is its e4m3 value times its block's scale; all six pointers 16-byte aligned.
// A training layer (LayerConfig::with_backward) also reads the same values transposed (its
// backward's GEMMs contract over the other dimension, and e4m3 tensor-core operands must be
// contiguous along it): gate_up_t [E_local, H, 2I] (W_gate^T's columns, then W_up^T's) and
// down_t [E_local, I, H], with their blocks' scales transposed alike, gate_up_t_scales
// [E_local, H / 128, 2I / 128] and down_t_scales [E_local, I / 128, H / 128].
// quantize_expert_weights makes them all.
struct Fp8ExpertWeights {
  const uint8_t* gate = nullptr;
  const uint8_t* up = nullptr;
  const uint8_t* down = nullptr;
  const float* gate_scales = nullptr;
  const float* up_scales = nullptr;
  const float* down_scales = nullptr;
  const uint8_t* gate_up_t = nullptr;  // training layers only
  const uint8_t* down_t = nullptr;
  const float* gate_up_t_scales = nullptr;
  const float* down_t_scales = nullptr;
};
struct ExpertWeights {
  const __nv_bfloat16* gate = nullptr;
  const __nv_bfloat16* up = nullptr;
  const __nv_bfloat16* down = nullptr;
  Fp8ExpertWeights fp8 = {};  // FP8 layers only
  int64_t gate_expert_stride = 0;
  int64_t up_expert_stride = 0;
  int64_t down_expert_stride = 0;
};

// Bytes of device memory quantize_expert_weights needs for one rank's experts of `config` (a
// training config's include the transposed copies).
int64_t fp8_expert_weights_bytes(const LayerConfig& config);
// Quantizes this rank's bf16 expert weights 128 x 128 into `buffer` (device memory of at least
// fp8_expert_weights_bytes bytes, 256-byte aligned) and points *out at them; stream-ordered, no
// host sync (training keeps bf16 or fp32 master weights and re-quantizes after each optimizer
// step). Scales are amax / 448 per block (at least 2^-126), or the next power of two with
// power_of_two_scales; values are e4m3(v * (1 / scale)), and q * scale reads them back.
Status quantize_expert_weights(const LayerConfig& config, const ExpertWeights& bf16_weights,
                               bool power_of_two_scales, void* buffer, int64_t buffer_bytes,
                               Fp8ExpertWeights* out, cudaStream_t stream);

struct ForwardArgs {
  int64_t num_tokens = 0;                 // T on this rank, 0 <= T <= max_tokens_per_rank
  const __nv_bfloat16* x = nullptr;       // [T, H]
  const int32_t* topk_idx = nullptr;      // [T, K] global expert ids; -1 = empty slot
  const float* topk_weights = nullptr;    // [T, K]
  ExpertWeights weights;
  __nv_bfloat16* y = nullptr;             // [T, H] out
};

// One forward's context for its backward (layers created with LayerConfig::with_backward).
// The caller gives the memory: `buffer`, at least Layer::saved_context_bytes() bytes of device
// memory, 256-byte aligned, set before forward(); forward() keeps in it what the backward reads
// (the call's routing schedule and every routed row's gate/up pre-activations g | u) and records
// references to the caller's inputs (x, topk_idx, topk_weights, weights), which, like the
// buffer, must stay unchanged until backward() has been enqueued. Contexts are independent: any
// number of forwards of a layer may be in flight, and their backwards may run in any order, on
// the stream of the layer's calls. A context serves one backward() of the layer that filled it;
// using it again, or with another layer, is refused.
struct SavedContext {
  void* buffer = nullptr;  // set by the caller
  int64_t buffer_bytes = 0;
  // Filled by forward():
  uint64_t layer_id = 0;  // 0: never filled
  uint64_t call = 0;      // the layer's forward call that filled it
  int64_t num_tokens = 0;
  const __nv_bfloat16* x = nullptr;
  const int32_t* topk_idx = nullptr;
  const float* topk_weights = nullptr;
  ExpertWeights weights;
  std::shared_ptr<bool> consumed;  // set by backward(); shared by copies of the context
};

enum class GradDType { kBF16, kFP32 };

struct BackwardArgs {
  const __nv_bfloat16* dy = nullptr;      // [T, H]
  __nv_bfloat16* dx = nullptr;            // [T, H] out
  float* d_topk_weights = nullptr;        // [T, K] out; 0 for empty slots
  // This rank's weight gradients, same layouts as ExpertWeights, in grad_dtype, expert e's at
  // d_gate + e * d_gate_expert_stride elements (likewise up and down; 0: densely packed;
  // negative: from the last expert to the first; at least the matrix's size either way, a
  // 16-byte multiple): written in place into Megatron-Core's main_grad views, say.
  void* d_gate = nullptr;
  void* d_up = nullptr;
  void* d_down = nullptr;
  int64_t d_gate_expert_stride = 0;
  int64_t d_up_expert_stride = 0;
  int64_t d_down_expert_stride = 0;
  GradDType grad_dtype = GradDType::kFP32;
  bool accumulate_weight_grads = false;   // add into d_* instead of overwriting
};

// Device memory a workspace holds, by purpose (bytes); the contexts of forwards in flight are
// the caller's (Layer::saved_context_bytes() each).
struct MemoryReport {
  int64_t symmetric_bytes = 0;   // NCCL symmetric windows (peers read or write them)
  int64_t ring_bytes = 0;        // the megakernel's ring (routed x rows and SwiGLU outputs)
  int64_t schedule_bytes = 0;    // the inference forward's pull table, counts, counters
  int64_t backward_bytes = 0;    // the backward's row buffers (LayerConfig::with_backward, else 0)
  int64_t total() const { return symmetric_bytes + ring_bytes + schedule_bytes + backward_bytes; }
};

// Host-side checks of one call's arguments; forward()/backward() run them before any launch.
Status validate(const LayerConfig& config, const ForwardArgs& args);
Status validate(const LayerConfig& config, const SavedContext& saved, const BackwardArgs& args);

// What every layer on one communicator shares: the symmetric window the ranks read and write,
// the megakernels' ring, the backward's row buffers, the barrier state. Create one per EP group
// and device and create every layer of the model on it: a layer then costs no device memory of
// its own (its forwards' contexts are the caller's), and layers of different shapes share it
// (the memory grows to the largest shape when a layer is created; create layers before
// capturing CUDA graphs of their calls). The calls of all its layers run one at a time: a call
// on another stream than the previous call is ordered behind it by an event (no host sync);
// in a captured graph, the graph's order applies.
class Workspace {
 public:
  // `comm` spans the EP group; the current CUDA device is the workspace's.
  static Status create(ncclComm_t comm, std::shared_ptr<Workspace>* out);
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  // What it holds now: the largest need of the layers created on it, per purpose.
  MemoryReport memory() const;

 private:
  friend class Layer;
  struct Impl;
  explicit Workspace(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class Layer {
 public:
  // Creation is collective over the workspace's communicator: every rank creates the same
  // layers in the same order. Its size must equal config.ep_size and its rank config.ep_rank.
  static Status create(const LayerConfig& config, const std::shared_ptr<Workspace>& workspace,
                       std::unique_ptr<Layer>* out);
  // A layer on a workspace of its own.
  static Status create(const LayerConfig& config, ncclComm_t comm, std::unique_ptr<Layer>* out);
  ~Layer();
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  Status forward(const ForwardArgs& args, cudaStream_t stream, SavedContext* saved);
  Status backward(const BackwardArgs& args, const SavedContext& saved, cudaStream_t stream);

  const LayerConfig& config() const;
  // The workspace's memory (shared with the other layers on it).
  MemoryReport memory() const;
  // The bytes of SavedContext::buffer a forward keeps its activations in (sized for every row
  // the layer can route to this rank's experts).
  int64_t saved_context_bytes() const;

  // What this rank's calls found wrong in topk_idx since the last report, then cleared:
  // kInvalidArgument counting the slots whose id is outside [-1, num_experts) (skipped: they
  // contribute nothing) or repeats an expert of an earlier slot of the same token (computed as
  // two slots), with the first one's token, slot and id; ok when none. The check runs on the
  // device inside each call, so synchronize the stream first for a complete report. forward()
  // and backward() also return it, after enqueuing their own work (that call itself ran).
  Status check_routing();

  // Why the layer's last kernels failed, if one of its waits timed out. A wait that times out
  // traps its kernel, which the stream then reports only as cudaErrorLaunchFailure; call this
  // after such an error: kTimeout naming the rank, the SM partition, the task and the counter it
  // waited for (a megakernel wait), or the peer that never arrived (a barrier between the
  // ranks), or ok when no wait of this layer timed out. Reads host memory only (safe after the
  // CUDA context is lost).
  Status device_failure() const;

 private:
  struct Impl;
  explicit Layer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// `s` (an error from the layer's stream) with the timed-out wait behind it, if one of the
// layer's waits timed out (Layer::device_failure); `s` unchanged otherwise.
Status with_device_failure(const Layer& layer, Status s);

}  // namespace epflow
