#include "kernels/layer_kernels.cuh"
#include "kernels/warp_row_copy.cuh"

namespace epflow::kernels {

namespace {

constexpr int kThreads = 256;

// NOTES: each routed row goes to its own (token, k) slot on the owner: no two writers share a
// slot, so there are no atomics and the result does not depend on timing.
__global__ void __launch_bounds__(kThreads) push_combine_kernel(CombineArgs a) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t{gridDim.x} * (kThreads / 32);
  const int64_t total = a.seg_offset[a.experts];
  const int64_t vecs = a.hidden * 2 / 16;
  for (int64_t row = int64_t{blockIdx.x} * (kThreads / 32) + threadIdx.x / 32; row < total;
       row += warps) {
    const sched::PullRow r = a.table[row];
    if (r.src_rank == sched::kPaddingRow) continue;
    const auto* src = reinterpret_cast<const int4*>(a.routed_y + row * a.hidden);
    auto* dst = reinterpret_cast<int4*>(a.peers.base[r.src_rank] + a.combine_offset +
                                        int64_t{r.src_slot} * a.hidden * 2);
    warp_copy_row(src, dst, vecs, lane);
  }
}

}  // namespace

cudaError_t launch_push_combine(const CombineArgs& args, int32_t blocks, cudaStream_t stream) {
  push_combine_kernel<<<blocks, kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace epflow::kernels
