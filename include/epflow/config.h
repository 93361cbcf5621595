// EPFlow: the shape and knobs of one expert-parallel MoE layer.
#pragma once

#include <cstdint>
#include <string>

#include "epflow/status.h"

namespace epflow {

// Data type of the expert GEMMs. Activations enter and leave the API in bf16 either way.
enum class DType {
  kBF16,
  // e4m3 with fp32 block scales (DeepSeek-V3's recipe): x rows quantized 1 x 128 by their owner
  // (and sent over NVLink so), weights 128 x 128 (ExpertWeights::fp8, quantize_expert_weights),
  // h 1 x 128 in the SwiGLU epilogue; fp32 accumulation; bf16 combine. Training (with_backward):
  // dy and x quantized 1 x 128 by their owner, dhp and dx GEMMs in FP8 on the transposed
  // weights ([dg | du] quantized 1 x 128 in the epilogue), weight-gradient GEMMs in FP8 on
  // operands quantized along the tokens where a call brings each local expert 256 rows or more
  // on average, else in bf16 on the dequantized rows (docs/design/fp8_backward.md); the
  // gradients written in BackwardArgs::grad_dtype. H and I multiples of 128.
  kFP8Blockwise,
  kMXFP8,  // e4m3 + one e8m0 scale per 32 values, wire/storage format (not implemented yet)
};

const char* to_string(DType dtype);

// Limits the kernels are built for. Checked by validate(); see README "Limits".
struct Limits {
  static constexpr int64_t kHiddenMultiple = 64;        // H: TMA box / wgmma K step
  // H: the megakernel's dispatch keeps whole x rows in flight in a CTA's shared memory (224 KB).
  static constexpr int64_t kMaxHidden = 32768;
  static constexpr int64_t kIntermediateMultiple = 64;  // I: K step of the down GEMM
  static constexpr int32_t kMaxTopK = 16;
  static constexpr int32_t kMaxEpSize = 72;             // one NVLink domain (NVL72)
  static constexpr int32_t kMaxExpertsPerRank = 1024;
  static constexpr int64_t kMaxSlotsPerRank = int64_t{1} << 30;  // T_max * K: slot ids are int32
};

struct LayerConfig {
  // Model shape.
  int64_t hidden = 0;        // H
  int64_t intermediate = 0;  // I (per expert)
  int32_t num_experts = 0;   // experts over the whole EP group
  int32_t top_k = 0;         // K

  // Expert parallelism: this rank owns experts [ep_rank * E_local, (ep_rank + 1) * E_local).
  int32_t ep_size = 1;
  int32_t ep_rank = 0;

  // Largest T any rank passes to forward(); T may differ per rank and per call up to this.
  int64_t max_tokens_per_rank = 0;

  DType dtype = DType::kBF16;
  // kFP8Blockwise: the activation scales (x's and h's) are powers of two (UE8M0-representable)
  // instead of amax / 448. quantize_expert_weights takes its own switch for the weights'.
  bool fp8_power_of_two_scales = false;

  // Knobs. 0 means "choose automatically" (see runtime heuristics).
  int32_t comm_sms = 0;        // SMs of the megakernel's communication partition
  int64_t minibatch_rows = 0;  // routed rows handed to compute at once (multiple of the tile height)
  int64_t ring_rows = 0;       // capacity of the routed-token ring buffer, in rows
  // Training: routed rows whose gate/up pre-activations a SavedContext keeps (rounded up to the
  // tile height; 0: balanced routing plus a margin, runtime_plan.h). The backward recomputes
  // the rest from the x rows, on the device: any routing works, one past it costs a GEMM.
  // kFP8Blockwise keeps every row (its recompute would not reproduce the FP8 forward's g | u).
  int64_t saved_gate_up_rows = 0;

  // Every wait on another SM or GPU gives up after this long with a diagnostic.
  double timeout_seconds = 5.0;

  // Training: create() also allocates the backward's row buffers, so that no call allocates
  // (calls can be captured in a CUDA graph from the first one); each forward that fills a
  // SavedContext keeps its activations in the caller's memory. Without it, forward() with a
  // SavedContext and backward() are refused; Layer::memory() reports the extra bytes.
  bool with_backward = false;

  int32_t experts_per_rank() const { return ep_size > 0 ? num_experts / ep_size : 0; }
  std::string to_string() const;
};

// Checks a config against the limits of the kernels; no device needed.
Status validate(const LayerConfig& config);

}  // namespace epflow
