#include "unfused/row_movers.cuh"
#include "unfused/warp_row_copy.cuh"

namespace epflow::kernels {

namespace {

// Padding rows are left as they are unless zero_padding_rows: in the forward they only feed
// padding output rows, which the GEMM skips where it can and the combine never reads.
__global__ void __launch_bounds__(kRowMoverMaxThreads) pull_dispatch_kernel(DispatchArgs a) {
  const int64_t vecs = a.hidden * 2 / 16;
  for_each_table_row(
      a.table, a.seg_offset, a.experts,
      [&](int64_t row, const sched::PullRow& r, int lane) {
        const int64_t token = r.src_slot / a.top_k;
        const auto* src = reinterpret_cast<const int4*>(a.peers.base[r.src_rank] + a.x_offset +
                                                        token * a.hidden * 2);
        auto* dst = reinterpret_cast<int4*>(a.routed_x + row * a.hidden);
        warp_copy_row(src, dst, vecs, lane);
      },
      [&](int64_t row, int lane) {
        if (!a.zero_padding_rows) return;
        auto* dst = reinterpret_cast<int4*>(a.routed_x + row * a.hidden);
        for (int64_t i = lane; i < vecs; i += 32) dst[i] = make_int4(0, 0, 0, 0);
      });
}

}  // namespace

cudaError_t launch_pull_dispatch(const DispatchArgs& args, int32_t blocks, cudaStream_t stream,
                                 int32_t threads) {
  pull_dispatch_kernel<<<blocks, threads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace epflow::kernels
