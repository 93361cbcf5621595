#include "unfused/row_movers.cuh"
#include "unfused/warp_row_copy.cuh"

namespace epflow::kernels {

namespace {

// NOTES: each routed row goes to its own (token, k) slot on the owner: no two writers share a
// slot, so there are no atomics and the result does not depend on timing.
__global__ void __launch_bounds__(kRowMoverMaxThreads) push_combine_kernel(CombineArgs a) {
  const int64_t vecs = a.hidden * 2 / 16;
  for_each_routed_row(a.table, a.seg_offset, a.experts,
                      [&](int64_t row, const sched::PullRow& r, int lane) {
                        const auto* src =
                            reinterpret_cast<const int4*>(a.routed_y + row * a.hidden);
                        auto* dst = reinterpret_cast<int4*>(a.peers.base[r.src_rank] +
                                                            a.combine_offset +
                                                            int64_t{r.src_slot} * a.hidden * 2);
                        warp_copy_row(src, dst, vecs, lane);
                      });
}

}  // namespace

cudaError_t launch_push_combine(const CombineArgs& args, int32_t blocks, cudaStream_t stream,
                                int32_t threads) {
  push_combine_kernel<<<blocks, threads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace epflow::kernels
