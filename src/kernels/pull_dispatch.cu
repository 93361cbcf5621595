#include "kernels/layer_kernels.cuh"
#include "kernels/warp_row_copy.cuh"

namespace epflow::kernels {

namespace {

constexpr int kThreads = 256;

// NOTES: a warp per table row, rows taken in table order: consecutive warps hit consecutive
// rows, which the schedule interleaved across source ranks, so the NVLink reads of one moment
// spread over all peers.
__global__ void __launch_bounds__(kThreads) pull_dispatch_kernel(DispatchArgs a) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t{gridDim.x} * (kThreads / 32);
  const int64_t total = a.seg_offset[a.experts];
  const int64_t vecs = a.hidden * 2 / 16;
  for (int64_t row = int64_t{blockIdx.x} * (kThreads / 32) + threadIdx.x / 32; row < total;
       row += warps) {
    const sched::PullRow r = a.table[row];
    // Padding rows are left as they are: they only feed padding output rows, which the GEMM
    // skips where it can and the combine never reads.
    if (r.src_rank == sched::kPaddingRow) continue;
    int4* dst = reinterpret_cast<int4*>(a.routed_x + row * a.hidden);
    const int64_t token = r.src_slot / a.top_k;
    const auto* src = reinterpret_cast<const int4*>(a.peers.base[r.src_rank] + a.x_offset +
                                                    token * a.hidden * 2);
    warp_copy_row(src, dst, vecs, lane);
  }
}

}  // namespace

cudaError_t launch_pull_dispatch(const DispatchArgs& args, int32_t blocks, cudaStream_t stream) {
  pull_dispatch_kernel<<<blocks, kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace epflow::kernels
