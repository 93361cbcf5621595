// Expert FFN, kernel 1: h = silu(x W_gate[e]^T) * (x W_up[e]^T), one kBM x kBN tile of h per
// block. Gate and up columns n0..n0+kBN come from the same x tile, so both GEMMs run in one
// block on one A tile (two fp32 accumulator sets) and SwiGLU is applied before anything leaves
// registers.
#include "kernels/expert_ffn_tile.cuh"

namespace epflow::kernels {
namespace ffn {
namespace {

// NOTES: 128 x (2 x 128) outputs per block with 8 warps as 2 (M) x 4 (N): each warp owns 64 rows
// x 32 columns of both G and U, i.e. a 64 x 64 warp tile over the shared A fragments (128 fp32
// accumulators a thread). That is the ldmatrix-to-mma ratio at which shared-memory bandwidth
// keeps up with mma.sync; the registers allow one block per SM, so the pipeline is 4 stages
// deep (48 KiB each) to cover load latency. On an H200 (2026-11) this ran the DeepSeek-V3 shape
// at ~325-360 TFLOP/s, ahead of 3 stages, of 4 x 2 warps, and of kBN = 64 with two blocks per
// SM; that last one is faster for H = I = 2880 (no half N tile, fewer idle SMs in the last
// wave), which a per-shape choice could use later.
using GateUpConfig = TileConfig</*BN=*/128, /*BK=*/64, /*Stages=*/4, /*WarpsM=*/2, /*WarpsN=*/4,
                                /*MinBlocksPerSm=*/1, /*NumB=*/2>;

// silu(g) = g / (1 + exp(-g)), in fp32. For g -> -inf, exp overflows to inf and the quotient is
// -0, the right limit; __expf's ~2 ulp error is far below the bf16 rounding of h.
__device__ __forceinline__ float silu(float g) { return g / (1.0f + __expf(-g)); }

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSm)
    expert_gate_up_kernel(ExpertFfnArgs args, int n_tiles) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* smem = reinterpret_cast<bf16*>(smem_raw);

  TileCoords t;
  if (!locate_tile<Cfg>(args.seg_offset, args.experts, args.intermediate, n_tiles, &t)) return;
  const int64_t H = args.hidden;
  const int64_t I = args.intermediate;

  const bf16* a = args.x + t.m_base * H;
  const int64_t w_offset = (t.expert * I + t.n_base) * H;  // W[e] is [I, H]: rows are n
  const bf16* const b[2] = {args.w_gate + w_offset, args.w_up + w_offset};

  float acc[2][Cfg::kMI][Cfg::kNI][4];
  mainloop<Cfg>(acc, smem, a, b, H, t.valid_n);

#pragma unroll
  for (int mi = 0; mi < Cfg::kMI; ++mi)
#pragma unroll
    for (int ni = 0; ni < Cfg::kNI; ++ni)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[0][mi][ni][r] = silu(acc[0][mi][ni][r]) * acc[1][mi][ni][r];

  store_tile<Cfg>(acc[0], smem, args.h + t.m_base * I + t.n_base, I, t.valid_n);
}

}  // namespace

template <class Cfg>
cudaError_t launch_gate_up(const ExpertFfnArgs& args, cudaStream_t stream) {
  static_assert(Cfg::kNumB == 2, "gate and up");
  const int64_t m_tiles = args.max_rows / Cfg::kBM;
  const int64_t n_tiles = sched::ceil_div(args.intermediate, Cfg::kBN);
  if (m_tiles * n_tiles > INT32_MAX) return cudaErrorInvalidConfiguration;
  if (m_tiles * n_tiles == 0) return cudaSuccess;
  const cudaError_t err =
      cudaFuncSetAttribute(expert_gate_up_kernel<Cfg>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(Cfg::kSmemBytes));
  if (err != cudaSuccess) return err;
  expert_gate_up_kernel<Cfg>
      <<<static_cast<unsigned>(m_tiles * n_tiles), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(
          args, static_cast<int>(n_tiles));
  return cudaGetLastError();
}

}  // namespace ffn

cudaError_t launch_expert_ffn_gate_up(const ExpertFfnArgs& args, cudaStream_t stream) {
  return ffn::launch_gate_up<ffn::GateUpConfig>(args, stream);
}

}  // namespace epflow::kernels
