// Expert FFN, kernel 2: y = h W_down[e]^T, one kBM x kBN tile of y per block (W_down[e] is
// [H, I]: K = I, N = H).
#include "kernels/expert_ffn_tile.cuh"

namespace epflow::kernels {
namespace ffn {
namespace {

// NOTES: 4 warps as 2 x 2 give 64 x 64 warp tiles (the same ldmatrix-to-mma ratio as the
// gate/up kernel) on a 128 x 128 block tile; 3 stages of 32 KiB let two blocks share an SM, so
// one block's epilogue overlaps the other's mainloop. kBN = 128 keeps the N-tail waste small
// (H = 2880 = 22.5 tiles). On an H200 (2026-11): ~305-340 TFLOP/s; one block of 4 stages per
// SM was ~25% slower, 8 warps (64 x 32 warp tiles) and kBN = 256 were within a few percent.
using DownConfig = TileConfig</*BN=*/128, /*BK=*/64, /*Stages=*/3, /*WarpsM=*/2, /*WarpsN=*/2,
                              /*MinBlocksPerSm=*/2, /*NumB=*/1>;

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSm)
    expert_down_kernel(ExpertFfnArgs args, int n_tiles) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* smem = reinterpret_cast<bf16*>(smem_raw);

  TileCoords t;
  if (!locate_tile<Cfg>(args.seg_offset, args.experts, args.hidden, n_tiles, &t)) return;
  const int64_t H = args.hidden;
  const int64_t I = args.intermediate;

  const bf16* a = args.h + t.m_base * I;
  const bf16* const b[1] = {args.w_down + (t.expert * H + t.n_base) * I};

  float acc[1][Cfg::kMI][Cfg::kNI][4];
  mainloop<Cfg>(acc, smem, a, b, I, t.valid_n);
  store_tile<Cfg>(acc[0], smem, args.y + t.m_base * H + t.n_base, H, t.valid_n);
}

}  // namespace

template <class Cfg>
cudaError_t launch_down(const ExpertFfnArgs& args, cudaStream_t stream) {
  static_assert(Cfg::kNumB == 1, "one weight");
  const int64_t m_tiles = args.max_rows / Cfg::kBM;
  const int64_t n_tiles = sched::ceil_div(args.hidden, Cfg::kBN);
  if (m_tiles * n_tiles > INT32_MAX) return cudaErrorInvalidConfiguration;
  if (m_tiles * n_tiles == 0) return cudaSuccess;
  const cudaError_t err =
      cudaFuncSetAttribute(expert_down_kernel<Cfg>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(Cfg::kSmemBytes));
  if (err != cudaSuccess) return err;
  expert_down_kernel<Cfg>
      <<<static_cast<unsigned>(m_tiles * n_tiles), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(
          args, static_cast<int>(n_tiles));
  return cudaGetLastError();
}

}  // namespace ffn

cudaError_t launch_expert_ffn_down(const ExpertFfnArgs& args, cudaStream_t stream) {
  return ffn::launch_down<ffn::DownConfig>(args, stream);
}

}  // namespace epflow::kernels
