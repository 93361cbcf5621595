// The layer's passes as chains of separate kernels over buffers of every routable row (pull
// dispatch, the expert FFN's two grouped GEMMs, push combine; the backward's pulls, two input-
// gradient GEMMs, SwiGLU backward and pushes): what the megakernels fuse, kept beside the library
// only as the comparison epflow-bench runs (--baselines epflow-unfused, --backward-unfused).
// They plug into LayerCore as executors over its workspace and schedule.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "host/executor.h"

namespace epflow::bench {

class UnfusedForward final : public ForwardExecutor {
 public:
  // Buffers of [max_rows, H | I | H] for ws's shape.
  static Status create(const LayerWorkspace& ws, std::unique_ptr<UnfusedForward>* out);
  ~UnfusedForward() override;
  // keep_for_backward: kNotImplemented (it keeps no gate/up pre-activations).
  Status run(LayerWorkspace& ws, SavedActivations& acts, const ExpertWeights& weights,
             bool keep_for_backward, cudaStream_t stream, PassHooks* hooks) override;
  int64_t buffer_bytes() const { return bytes_; }

 private:
  UnfusedForward() = default;
  void* buffers_ = nullptr;
  int64_t bytes_ = 0;
  __nv_bfloat16 *routed_x_ = nullptr, *routed_h_ = nullptr, *routed_y_ = nullptr;
};

// SMs the unfused backward leaves to its side stream (the x rows pulled in and the dx rows
// pushed out while its GEMMs run on the others): the forward dispatch's bytes per FLOP (a row
// moves 4·H bytes against 12·H·I FLOPs of dgrad and wgrad), with a 4/3 margin instead of the
// dispatch's 2 because the side work spans whole GEMM phases; at least 2, at most a quarter.
int32_t default_backward_side_sms(const LayerConfig& config, int32_t sm_count);

// Runs on the workspace's backward rows plus its own dx rows. side_sms > 0: the x pull and the dx
// push run on a second stream on that many SMs, beside the GEMMs on the others (fork and join by
// events: graph-capturable); 0: everything in order on the caller's stream.
class UnfusedBackward final : public BackwardExecutor {
 public:
  static Status create(const LayerWorkspace& ws, int32_t side_sms,
                       std::unique_ptr<UnfusedBackward>* out);
  ~UnfusedBackward() override;
  std::vector<const char*> stage_names() const override;
  Status run(LayerWorkspace& ws, const SavedActivations& acts, const ExpertWeights& weights,
             const BackwardArgs& args, cudaStream_t stream, PassHooks* hooks) override;
  int64_t buffer_bytes() const { return bytes_; }

 private:
  UnfusedBackward() = default;
  int32_t side_sms_ = 0;
  __nv_bfloat16* dx_rows_ = nullptr;  // [max_rows, H]
  int64_t bytes_ = 0;
  cudaStream_t side_ = nullptr;
  cudaEvent_t dy_pulled_ = nullptr, x_pulled_ = nullptr, dx_ready_ = nullptr,
              dx_pushed_ = nullptr;
};

}  // namespace epflow::bench
