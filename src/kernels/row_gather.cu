// Routed x rows gathered from their owners' windows (gate_up_recompute.cuh): one warp per row,
// 16-byte loads over NVLink (or local memory at EP = 1).
#include "kernels/gate_up_recompute.cuh"

namespace epflow::kernels {

namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) row_gather_kernel(const RowGatherArgs a) {
  const int64_t end = a.seg_offset[a.experts];
  const int warps = kThreads / 32, lane = threadIdx.x % 32;
  const int64_t chunks = a.hidden * 2 / 16;
  for (int64_t r = a.first_row + int64_t{blockIdx.x} * warps + threadIdx.x / 32; r < end;
       r += int64_t{gridDim.x} * warps) {
    uint4* dst = reinterpret_cast<uint4*>(a.rows + r * a.hidden);
    const sched::PullRow p = a.table[r];
    if (p.src_rank == sched::kPaddingRow) {
      for (int64_t i = lane; i < chunks; i += 32) dst[i] = make_uint4(0, 0, 0, 0);
      continue;
    }
    const auto* src = reinterpret_cast<const uint4*>(
        a.peers.base[p.src_rank] + a.src_offset + int64_t{p.src_slot / a.top_k} * a.hidden * 2);
    for (int64_t i = lane; i < chunks; i += 32) dst[i] = src[i];
  }
}

}  // namespace

cudaError_t launch_row_gather(const RowGatherArgs& a, int32_t sm_count, cudaStream_t stream) {
  if (a.first_row < 0 || a.first_row > a.max_rows || a.hidden <= 0 || a.hidden % 8 != 0 ||
      a.top_k <= 0 || !a.table || !a.seg_offset || !a.rows)
    return cudaErrorInvalidValue;
  const int64_t rows = a.max_rows - a.first_row;
  if (rows == 0) return cudaSuccess;
  const int64_t blocks = (rows + kThreads / 32 - 1) / (kThreads / 32);
  const int grid = static_cast<int>(blocks < 4 * sm_count ? blocks : 4 * sm_count);
  row_gather_kernel<<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace epflow::kernels
