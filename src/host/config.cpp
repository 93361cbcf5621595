#include "epflow/config.h"

#include <sstream>

#include "common/fp8_blocks.h"
#include "common/status_util.h"

namespace epflow {

namespace {
constexpr int64_t kFp8Block = 128;
}  // namespace

const char* to_string(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bf16";
    case DType::kFP8Blockwise:
      return "fp8-blockwise";
    case DType::kMXFP8:
      return "mxfp8";
  }
  return "unknown";
}

std::string LayerConfig::to_string() const {
  std::ostringstream os;
  os << "H=" << hidden << " I=" << intermediate << " experts=" << num_experts << " top_k=" << top_k
     << " ep=" << ep_rank << "/" << ep_size << " max_tokens=" << max_tokens_per_rank
     << " dtype=" << epflow::to_string(dtype) << (with_backward ? " with_backward" : "");
  return os.str();
}

Status validate(const LayerConfig& c) {
  if (c.hidden <= 0 || c.hidden % Limits::kHiddenMultiple != 0)
    return invalid_argument("hidden (", c.hidden, ") must be a positive multiple of ",
                            Limits::kHiddenMultiple, " (TMA box / wgmma K step)");
  if (c.hidden > Limits::kMaxHidden)
    return invalid_argument("hidden (", c.hidden, ") exceeds ", Limits::kMaxHidden,
                            " (the dispatch keeps whole rows in a CTA's shared memory)");
  if (c.intermediate <= 0 || c.intermediate % Limits::kIntermediateMultiple != 0)
    return invalid_argument("intermediate (", c.intermediate, ") must be a positive multiple of ",
                            Limits::kIntermediateMultiple, " (K step of the down GEMM)");
  if (c.ep_size < 1 || c.ep_size > Limits::kMaxEpSize)
    return invalid_argument("ep_size (", c.ep_size, ") must be in [1, ", Limits::kMaxEpSize, "]");
  if (c.ep_rank < 0 || c.ep_rank >= c.ep_size)
    return invalid_argument("ep_rank (", c.ep_rank, ") must be in [0, ep_size=", c.ep_size, ")");
  if (c.num_experts < 1)
    return invalid_argument("num_experts (", c.num_experts, ") must be at least 1");
  if (c.num_experts % c.ep_size != 0)
    return invalid_argument("num_experts (", c.num_experts, ") is not divisible by ep_size (",
                            c.ep_size, "): every rank must own the same number of experts");
  if (c.experts_per_rank() > Limits::kMaxExpertsPerRank)
    return invalid_argument("experts per rank (", c.experts_per_rank(), ") exceeds ",
                            Limits::kMaxExpertsPerRank);
  if (c.top_k < 1 || c.top_k > Limits::kMaxTopK)
    return invalid_argument("top_k (", c.top_k, ") must be in [1, ", Limits::kMaxTopK, "]");
  if (c.top_k > c.num_experts)
    return invalid_argument("top_k (", c.top_k, ") exceeds num_experts (", c.num_experts, ")");
  if (c.max_tokens_per_rank < 1)
    return invalid_argument("max_tokens_per_rank (", c.max_tokens_per_rank, ") must be at least 1");
  if (c.max_tokens_per_rank * c.top_k > Limits::kMaxSlotsPerRank)
    return invalid_argument("max_tokens_per_rank * top_k (", c.max_tokens_per_rank * c.top_k,
                            ") exceeds ", Limits::kMaxSlotsPerRank, " slots per rank");
  if (c.dtype == DType::kFP8Blockwise &&
      (c.hidden % kFp8Block != 0 || c.intermediate % kFp8Block != 0))
    return invalid_argument("dtype fp8-blockwise needs hidden (", c.hidden, ") and intermediate (",
                            c.intermediate, ") to be multiples of ", kFp8Block,
                            " (one scale block per 128 of K)");
  if (c.dtype == DType::kFP8Blockwise &&
      (c.hidden > kFp8Block * fp8::kMaxKBlocks || c.intermediate > kFp8Block * fp8::kMaxKBlocks))
    return invalid_argument("dtype fp8-blockwise supports hidden (", c.hidden,
                            ") and intermediate (", c.intermediate, ") up to ",
                            kFp8Block * fp8::kMaxKBlocks,
                            " (a GEMM tile's weight scales are kept in shared memory)");
  if (c.dtype == DType::kFP8Blockwise && c.with_backward &&
      2 * c.intermediate > kFp8Block * fp8::kMaxKBlocks)
    return invalid_argument("a training fp8-blockwise layer supports intermediate (",
                            c.intermediate, ") up to ", kFp8Block * fp8::kMaxKBlocks / 2 / 128 * 128,
                            " (its dx GEMM's K is 2 * intermediate, whose weight scales a tile "
                            "keeps in shared memory)");
  if (c.comm_sms < 0)
    return invalid_argument("comm_sms (", c.comm_sms, ") must be >= 0 (0 = auto)");
  if (c.minibatch_rows < 0)
    return invalid_argument("minibatch_rows (", c.minibatch_rows, ") must be >= 0 (0 = auto)");
  if (c.ring_rows < 0)
    return invalid_argument("ring_rows (", c.ring_rows, ") must be >= 0 (0 = auto)");
  if (c.saved_gate_up_rows < 0)
    return invalid_argument("saved_gate_up_rows (", c.saved_gate_up_rows,
                            ") must be >= 0 (0 = auto)");
  if (!(c.timeout_seconds > 0.0))
    return invalid_argument("timeout_seconds (", c.timeout_seconds, ") must be positive");
  return Status::ok_status();
}

}  // namespace epflow
