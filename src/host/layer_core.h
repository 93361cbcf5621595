// The layer as the library runs it: its view of the shared workspace (its shape over the
// memory every layer on the communicator shares) and the two pass executors, with the steps
// every executor shares around its expert phase (inputs into the window, barriers, schedule,
// weighted sums). The public Layer is a thin handle over it; the
// benchmark and the tests use it directly to pass hooks, swap executors or set internal knobs.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <memory>
#include <vector>

#include "epflow/layer.h"
#include "host/executor.h"
#include "host/pass_hooks.h"
#include "host/saved_activations.h"
#include "host/layer_workspace.h"

namespace epflow {

class LayerCore {
 public:
  // Validates config and the workspace's communicator (ranks, NCCL version, device) before any
  // collective. The first form creates a workspace of its own on comm.
  static Status create(const LayerConfig& config, ncclComm_t comm,
                       std::unique_ptr<LayerCore>* out);
  static Status create(const LayerConfig& config, std::shared_ptr<SharedWorkspace> workspace,
                       std::unique_ptr<LayerCore>* out);
  ~LayerCore();
  LayerCore(const LayerCore&) = delete;
  LayerCore& operator=(const LayerCore&) = delete;

  // Layer::forward / Layer::backward, with optional instrumentation.
  Status forward(const ForwardArgs& args, cudaStream_t stream, SavedContext* saved,
                 PassHooks* hooks = nullptr);
  Status backward(const BackwardArgs& args, const SavedContext& saved, cudaStream_t stream,
                  PassHooks* hooks = nullptr);

  // The stages hooks see, in order: the forward's (the same for every forward executor, so
  // that systems compare stage by stage) and the current backward executor's.
  static std::vector<const char*> forward_stage_names();
  std::vector<const char*> backward_stage_names() const;

  // The fused executors by default; the benchmark swaps in others to compare.
  void set_forward_executor(std::unique_ptr<ForwardExecutor> executor);
  void set_backward_executor(std::unique_ptr<BackwardExecutor> executor);
  // The fused backward's communication SMs, in [1, sm_count) (default: the runtime plan's).
  Status set_backward_comm_sms(int32_t comm_sms);
  // An FP8 training layer's weight gradients: by the call's rows per expert (kAuto, the default),
  // always in FP8, or always in bf16 on the dequantized dy and x rows.
  Status set_wgrad_precision(WgradPrecision precision);

  LayerWorkspace& workspace() { return *ws_; }
  const std::shared_ptr<SharedWorkspace>& shared_workspace() const { return ws_->shared; }
  const LayerWorkspace& workspace() const { return *ws_; }
  const LayerConfig& config() const { return ws_->config; }
  MemoryReport memory() const;
  int64_t saved_context_bytes() const;
  Status check_routing() { return ws_->routing_report(); }
  Status device_failure() const { return ws_->device_failure(); }
  // s (an error of the layer's stream) with the timed-out wait behind it, if any.
  Status with_device_failure(Status s) const;

 private:
  LayerCore() = default;
  Status earlier_failure() const;
  Status run_forward(const ForwardArgs& args, cudaStream_t stream, SavedContext* saved,
                     PassHooks* hooks);
  Status run_backward(const BackwardArgs& args, const SavedContext& saved, cudaStream_t stream,
                      PassHooks* hooks);

  Status rows_into_window(const __nv_bfloat16* rows, int64_t T, char* dst,
                          cudaStream_t stream) const;
  // Before a call: the view's pointers (a later layer may have grown the shared memory) and
  // the call ordered behind the workspace's previous one.
  Status begin_call(cudaStream_t stream);

  std::unique_ptr<LayerWorkspace> ws_;
  std::unique_ptr<ForwardExecutor> forward_;
  std::unique_ptr<BackwardExecutor> backward_;
  uint64_t id_ = 0;     // unique in the process: which layer filled a SavedContext
  uint64_t calls_ = 0;  // forward calls so far
};

}  // namespace epflow
