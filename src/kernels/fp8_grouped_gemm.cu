// The block-scaled FP8 grouped GEMM (fp8_grouped_gemm.cuh). Persistent, warp-specialised like
// the BF16 one: warpgroup 0's thread 0 loads tiles with TMA into a ring of stages (128 rows x 128
// K of a, 128 n x 128 K of w: 32 KB), warpgroups 1 and 2 each multiply 64 of the tile's 128 rows
// by its 128 columns. Per 128-deep K block: four m64n128k32 e4m3 wgmmas into partial sums, then
// acc += partial * a_scale(row) * w_scale (promotion); the tile's bf16 output goes through a
// staging buffer as TMA stores.
#include "common/routing_schedule.h"
#include "kernels/fp8_grouped_gemm.cuh"
#include "kernels/ptx/tma.cuh"
#include "kernels/ptx/wgmma.cuh"
#include "kernels/tensor_map.h"

namespace epflow::kernels {

namespace {

constexpr int kN = 128;       // tile columns
constexpr int kK = 128;       // K block: one scale block, one 128-byte swizzle span of e4m3
constexpr int kStages = 5;
constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
static_assert(kTileRows == 128, "two consumer warpgroups of 64 rows");

struct alignas(1024) Smem {
  uint8_t a[kStages][kTileRows * kK];
  uint8_t b[kStages][kN * kK];
  uint8_t out[2][64 * kN * 2];  // per consumer warpgroup: 2 boxes of 64 rows x 64 bf16
  uint64_t full[kStages];
  uint64_t empty[kStages];
};

struct Params {
  const int64_t* seg_offset;
  int32_t experts, n_tiles, k_blocks;
  const float* a_scales;  // [rows, k_blocks]
  const float* w_scales;  // [experts, n_tiles, k_blocks]
};

struct Tile {
  int32_t m, n, expert;
};

__device__ __forceinline__ Tile tile_of(const Params& p, int64_t t, int32_t m_tiles) {
  Tile c;
  c.m = static_cast<int32_t>(t % m_tiles);
  c.n = static_cast<int32_t>(t / m_tiles);
  c.expert = sched::expert_of_row(p.seg_offset, p.experts, int64_t{c.m} * kTileRows);
  return c;
}

__global__ void __launch_bounds__(kThreads, 1)
    fp8_grouped_gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                            const __grid_constant__ CUtensorMap map_w,
                            const __grid_constant__ CUtensorMap map_out, const Params p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  auto& s = *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) / 1024 * 1024);
  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      ptx::mbarrier_init(&s.full[i], 1);
      ptx::mbarrier_init(&s.empty[i], 2);  // one arrival per consumer warpgroup
    }
    ptx::mbarrier_init_fence();
    ptx::prefetch_tensor_map(&map_a);
    ptx::prefetch_tensor_map(&map_w);
    ptx::prefetch_tensor_map(&map_out);
  }
  __syncthreads();
  const int32_t m_tiles = static_cast<int32_t>(p.seg_offset[p.experts] / kTileRows);
  const int64_t tiles = int64_t{m_tiles} * p.n_tiles;
  int stage = 0;
  uint32_t phase = 0;
  auto advance = [&] {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  };
  if (wg == 0) {
    ptx::warpgroup_reg_dealloc<40>();
    if (threadIdx.x != 0) return;
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
      const Tile c = tile_of(p, t, m_tiles);
      for (int32_t kb = 0; kb < p.k_blocks; ++kb, advance()) {
        ptx::mbarrier_wait(&s.empty[stage], phase ^ 1);
        ptx::mbarrier_arrive_expect_tx(&s.full[stage], (kTileRows + kN) * kK);
        ptx::tma_load_2d(s.a[stage], &map_a, kb * kK, c.m * kTileRows, &s.full[stage]);
        ptx::tma_load_3d(s.b[stage], &map_w, kb * kK, c.n * kN, c.expert, &s.full[stage]);
      }
    }
    return;
  }
  ptx::warpgroup_reg_alloc<232>();
  const int cwg = wg - 1, tid = threadIdx.x % 128;
  const int warp = tid / 32, g = tid % 32 / 4, q = tid % 4;
  uint8_t* staging = s.out[cwg];
  const uint64_t a_desc0 = ptx::smem_desc_k_major_sw128(ptx::smem_addr(s.a[0]) + cwg * 64 * kK);
  const uint64_t b_desc0 = ptx::smem_desc_k_major_sw128(ptx::smem_addr(s.b[0]));
  float acc[kN / 2], part[kN / 2];
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const Tile c = tile_of(p, t, m_tiles);
    const int64_t row0 = int64_t{c.m} * kTileRows + cwg * 64 + warp * 16 + g;  // and row0 + 8
    const float* sa = p.a_scales + row0 * p.k_blocks;
    const float* sw = p.w_scales + (int64_t{c.expert} * p.n_tiles + c.n) * p.k_blocks;
    for (int32_t kb = 0; kb < p.k_blocks; ++kb, advance()) {
      // The block's scales, loaded while its MMAs run.
      const float a0 = sa[kb], a1 = sa[8 * p.k_blocks + kb], b = sw[kb];
      ptx::mbarrier_wait(&s.full[stage], phase);
      const uint64_t a_desc = ptx::smem_desc_advance(a_desc0, stage * sizeof(s.a[0]));
      const uint64_t b_desc = ptx::smem_desc_advance(b_desc0, stage * sizeof(s.b[0]));
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kK / 32; ++kk)
        ptx::wgmma_m64n128k32_e4m3(part, ptx::smem_desc_advance(a_desc, kk * 32),
                                   ptx::smem_desc_advance(b_desc, kk * 32), kk > 0);
      ptx::wgmma_commit_group();
      ptx::wgmma_wait_group<0>();
      ptx::wgmma_fence_operands(part);
      if (tid == 0) ptx::mbarrier_arrive(&s.empty[stage]);
      const float s0 = a0 * b, s1 = a1 * b;
#pragma unroll
      for (int j = 0; j < kN / 8; ++j) {
        const float* v = part + 4 * j;
        float* d = acc + 4 * j;
        if (kb == 0) {
          d[0] = v[0] * s0, d[1] = v[1] * s0, d[2] = v[2] * s1, d[3] = v[3] * s1;
        } else {
          d[0] = fmaf(v[0], s0, d[0]), d[1] = fmaf(v[1], s0, d[1]);
          d[2] = fmaf(v[2], s1, d[2]), d[3] = fmaf(v[3], s1, d[3]);
        }
      }
    }
    // Epilogue: bf16 pairs into the 128B-swizzled staging (2 boxes of 64 columns), TMA stores.
    if (tid == 0) ptx::tma_store_wait_read();
    ptx::named_barrier_sync(1 + cwg, 128);
#pragma unroll
    for (int j = 0; j < kN / 8; ++j)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = warp * 16 + g + 8 * half;
        const int box = j / 8, chunk = (j % 8) ^ (row % 8);
        *reinterpret_cast<__nv_bfloat162*>(staging + box * 64 * 128 + row * 128 + chunk * 16 +
                                           4 * q) =
            __floats2bfloat162_rn(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
      }
    ptx::fence_shared_to_async_proxy();
    ptx::named_barrier_sync(1 + cwg, 128);
    if (tid == 0) {
#pragma unroll
      for (int box = 0; box < kN / 64; ++box)
        ptx::tma_store_2d(&map_out, staging + box * 64 * 128, c.n * kN + box * 64,
                          c.m * kTileRows + cwg * 64);
      ptx::tma_store_commit();
    }
  }
  if (tid == 0) ptx::tma_store_wait_all();  // staging must outlive the stores
}

}  // namespace

cudaError_t launch_fp8_grouped_gemm(const Fp8GroupedGemmArgs& a, cudaStream_t stream) {
  const ExpertSegments& seg = a.segments;
  if (!seg.valid() || a.n <= 0 || a.n % kN != 0 || a.k <= 0 || a.k % kK != 0)
    return cudaErrorInvalidValue;
  if (seg.empty()) return cudaSuccess;
  if (!seg.seg_offset || !a.a || !a.a_scales || !a.w || !a.w_scales || !a.out)
    return cudaErrorInvalidValue;
  int32_t sm_count = 0;
  if (cudaError_t e = current_device_sm_count(&sm_count); e != cudaSuccess) return e;
  if (a.max_ctas > 0 && a.max_ctas < sm_count) sm_count = a.max_ctas;
  const uint64_t a_dims[2] = {uint64_t(a.k), uint64_t(seg.max_rows)};
  const uint32_t a_box[2] = {kK, kTileRows};
  const uint64_t w_dims[3] = {uint64_t(a.k), uint64_t(a.n), uint64_t(seg.experts)};
  const uint32_t w_box[3] = {kK, kN, 1};
  const uint64_t out_dims[2] = {uint64_t(a.n), uint64_t(seg.max_rows)};
  const uint32_t out_box[2] = {64, 64};
  CUtensorMap map_a, map_w, map_out;
  if (!encode_u8_tensor_map(&map_a, a.a, 2, a_dims, a_box).ok() ||
      !encode_u8_tensor_map(&map_w, a.w, 3, w_dims, w_box).ok() ||
      !encode_bf16_tensor_map(&map_out, a.out, 2, out_dims, out_box).ok())
    return cudaErrorInvalidValue;
  Params p;
  p.seg_offset = seg.seg_offset;
  p.experts = seg.experts;
  p.n_tiles = static_cast<int32_t>(a.n / kN);
  p.k_blocks = static_cast<int32_t>(a.k / kK);
  p.a_scales = a.a_scales;
  p.w_scales = a.w_scales;
  const int64_t max_tiles = seg.max_rows / kTileRows * p.n_tiles;
  const int grid = static_cast<int>(max_tiles < sm_count ? max_tiles : sm_count);
  constexpr size_t smem = sizeof(Smem) + 1024;
  if (cudaError_t e = cudaFuncSetAttribute(fp8_grouped_gemm_kernel,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
      e != cudaSuccess)
    return e;
  fp8_grouped_gemm_kernel<<<grid, kThreads, smem, stream>>>(map_a, map_w, map_out, p);
  return cudaGetLastError();
}

}  // namespace epflow::kernels
