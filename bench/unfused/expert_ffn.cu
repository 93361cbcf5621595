// Host launcher of the expert FFN: argument checks, then the gate/up kernel and the down kernel,
// stream-ordered (the down kernel reads h as the gate/up kernel left it). No host sync: how many
// rows are routed is only known on the device (seg_offset), so both grids cover max_rows and
// blocks past seg_offset[experts] exit at once.
#include <cstdint>

#include "unfused/expert_ffn.cuh"

namespace epflow::kernels {

cudaError_t launch_expert_ffn(const ExpertFfnArgs& args, cudaStream_t stream) {
  if (args.experts < 0 || args.hidden <= 0 || args.hidden % 64 != 0 || args.intermediate <= 0 ||
      args.intermediate % 64 != 0 || args.max_rows < 0 || args.max_rows % kTileRows != 0)
    return cudaErrorInvalidValue;
  if (args.experts == 0 || args.max_rows == 0) return cudaSuccess;
  if (!args.seg_offset || !args.x || !args.w_gate || !args.w_up || !args.w_down || !args.h ||
      !args.y)
    return cudaErrorInvalidValue;
  int32_t sm_count = 0;
  if (cudaError_t e = current_device_sm_count(&sm_count); e != cudaSuccess) return e;
  if (const cudaError_t err = launch_expert_ffn_gate_up(args, sm_count, stream);
      err != cudaSuccess)
    return err;
  return launch_expert_ffn_down(args, sm_count, stream);
}

}  // namespace epflow::kernels
