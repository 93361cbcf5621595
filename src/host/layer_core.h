// The layer as the library runs it: a workspace, the schedule buffer of inference forwards (a
// training forward keeps its own in its SavedContext), and the two pass executors, with the
// steps every executor shares around its expert phase (inputs into the window, barriers,
// schedule, weighted sums). The public Layer is a thin handle over it; the
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
#include "host/workspace.h"

namespace epflow {

class LayerCore {
 public:
  // Validates config and comm (ranks, NCCL version, device) before any collective.
  static Status create(const LayerConfig& config, ncclComm_t comm,
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

  Workspace& workspace() { return *ws_; }
  const Workspace& workspace() const { return *ws_; }
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

  std::unique_ptr<Workspace> ws_;
  void* inference_buffer_ = nullptr;  // the schedule of forwards that keep nothing
  SavedActivations inference_acts_;
  std::unique_ptr<ForwardExecutor> forward_;
  std::unique_ptr<BackwardExecutor> backward_;
  uint64_t id_ = 0;     // unique in the process: which layer filled a SavedContext
  uint64_t calls_ = 0;  // forward calls so far
};

}  // namespace epflow
