// The backward's per-row SwiGLU and router-weight gradients (layer_kernels.cuh,
// SwigluBackwardArgs). Memory-bound: a warp per pull-table row, 8 bf16 (16 bytes) per lane and
// step, fp32 math.
#include <cuda_bf16.h>

#include "unfused/row_movers.cuh"
#include "unfused/warp_row_copy.cuh"

namespace epflow::kernels {

namespace {

struct Vec8 {
  float v[8];
};

__device__ __forceinline__ Vec8 load8(const __nv_bfloat16* p) {
  const int4 raw = *reinterpret_cast<const int4*>(p);
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
  Vec8 out;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    out.v[2 * i] = f.x;
    out.v[2 * i + 1] = f.y;
  }
  return out;
}

__device__ __forceinline__ void store8(__nv_bfloat16* p, const Vec8& x) {
  int4 raw;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(x.v[2 * i], x.v[2 * i + 1]);
  *reinterpret_cast<int4*>(p) = raw;
}

__device__ __forceinline__ void zero_row(__nv_bfloat16* row, int64_t elems, int lane) {
  for (int64_t i = lane * 8; i < elems; i += 32 * 8)
    *reinterpret_cast<int4*>(row + i) = make_int4(0, 0, 0, 0);
}

__global__ void __launch_bounds__(kRowMoverThreads) swiglu_backward_kernel(SwigluBackwardArgs a) {
  constexpr int kWarps = kRowMoverThreads / 32;
  const int lane = threadIdx.x % 32;
  const int64_t I = a.intermediate;
  const int64_t total = a.seg_offset[a.experts];
  for (int64_t row = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32; row < total;
       row += int64_t{gridDim.x} * kWarps) {
    const sched::PullRow r = a.table[row];
    if (r.src_rank == sched::kPaddingRow) {
      zero_row(a.dgu + row * 2 * I, 2 * I, lane);
      zero_row(a.dhp_wh + row * I, I, lane);
      continue;
    }
    const float w = *reinterpret_cast<const float*>(a.peers.base[r.src_rank] + a.weights_offset +
                                                    int64_t{r.src_slot} * sizeof(float));
    float dot = 0.0f;
    for (int64_t i = lane * 8; i < I; i += 32 * 8) {
      const Vec8 g = load8(a.gate_up + row * 2 * I + i), u = load8(a.gate_up + row * 2 * I + I + i);
      const Vec8 dhp = load8(a.dhp_wh + row * I + i);
      Vec8 wh, dg, du;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float sig = 1.0f / (1.0f + __expf(-g.v[j]));
        const float silu = g.v[j] * sig;
        // h as the forward stored it (bf16), so d w matches the y the forward combined.
        const float h = __bfloat162float(__float2bfloat16(silu * u.v[j]));
        dot = fmaf(dhp.v[j], h, dot);
        wh.v[j] = w * h;
        const float dh = w * dhp.v[j];
        du.v[j] = dh * silu;
        dg.v[j] = dh * u.v[j] * sig * (1.0f + g.v[j] * (1.0f - sig));
      }
      store8(a.dgu + row * 2 * I + i, dg);
      store8(a.dgu + row * 2 * I + I + i, du);
      store8(a.dhp_wh + row * I + i, wh);
    }
    // NOTES: the warp's lanes add their partial sums in a fixed butterfly order: d w does not
    // depend on timing.
#pragma unroll
    for (int off = 16; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    if (lane == 0)
      *reinterpret_cast<float*>(a.peers.base[r.src_rank] + a.d_weights_offset +
                                int64_t{r.src_slot} * sizeof(float)) = dot;
  }
}

}  // namespace

cudaError_t launch_swiglu_backward(const SwigluBackwardArgs& args, int32_t blocks,
                                   cudaStream_t stream) {
  swiglu_backward_kernel<<<blocks, kRowMoverThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace epflow::kernels
