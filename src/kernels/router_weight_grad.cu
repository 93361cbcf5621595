// d topk_weights from the backward megakernel's per-tile partial sums (layer_kernels.cuh,
// RouterWeightGradArgs).
#include "kernels/layer_kernels.cuh"

namespace epflow::kernels {

namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) router_weight_grad_kernel(RouterWeightGradArgs a) {
  const int64_t row = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (row >= a.seg_offset[a.experts]) return;
  const sched::PullRow r = a.table[row];
  if (r.src_rank == sched::kPaddingRow) return;
  float dot = 0.0f;
  for (int32_t n = 0; n < a.n_tiles; ++n) dot += a.dw_partial[row * a.n_tiles + n];
  *reinterpret_cast<float*>(a.peers.base[r.src_rank] + a.d_weights_offset +
                            int64_t{r.src_slot} * sizeof(float)) = dot;
}

}  // namespace

cudaError_t launch_router_weight_grad(const RouterWeightGradArgs& a, cudaStream_t stream) {
  if (a.max_rows <= 0) return cudaSuccess;
  if (!a.table || !a.seg_offset || !a.dw_partial || a.n_tiles <= 0) return cudaErrorInvalidValue;
  const int64_t blocks = (a.max_rows + kThreads - 1) / kThreads;
  router_weight_grad_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace epflow::kernels
