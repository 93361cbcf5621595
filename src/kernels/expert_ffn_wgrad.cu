// Weight-gradient GEMM of the expert FFN's backward (expert_ffn.cuh, ExpertWgradArgs): one
// output tile (128 rows of dw[e] x 256 columns) per task, its K the expert's rows. Both operands
// come from row-major activations whose rows are the reduction: A = lhsᵀ is M-major, B = rhs is
// N-major, each loaded as boxes of 64 columns x 64 rows (grouped_gemm.cuh's consume_tile with
// RowsMajor::kM and WeightMajor::kN).
//
// A CTA takes jobs: up to kMChunk row tiles of one (expert, n tile), in m order. NOTES: when the
// expert has at most kStages k-blocks of rows (small token counts: K = 128-256), its B slice
// (K x 256) stays resident in the CTA's B buffers for the whole job, one k-block per buffer, and
// only the A slices (K x 128) stream through the stages: per output tile ~48 KB of operands from
// L2 instead of ~144 KB. Without that, a 128x256 tile with K ~ 128-256 re-read both slices from
// L2 for every tile, and the weight gradients ran L2-bound at ~4.3 TB/s of operand loads (half of
// the backward at 512 tokens/rank). Longer K streams both operands, stage by stage, as before.
// Before a job's first loads the producer waits until every earlier k-block is released, so no
// buffer is rewritten while a consumer may still read it.
#include "kernels/expert_ffn.cuh"
#include "kernels/grouped_gemm.cuh"

namespace epflow::kernels {

namespace {

using gemm::Epilogue;
using gemm::kBlockK;
using gemm::kBlockM;
using gemm::kBlockNMma;

// 4 x (16 KB of A + 32 KB of B) = 192 KB of 227; outputs leave from registers (no staging).
constexpr int kStages = 4;
constexpr int kMChunk = 8;  // row tiles per job: a resident B slice serves up to this many
using Smem = gemm::GemmSmem<kStages, 16>;

struct WgradParams {
  const int64_t* seg_offset;
  int32_t experts, m_tiles, n_tiles, m_chunks;
  void* dw;
  int64_t m, n;
  bool fp32_out, accumulate;
};

// Each thread writes its accumulator pairs straight from registers; every element has one
// writer, so accumulation is deterministic. bf16 overwrites go out 16 bytes per lane
// (gemm::quad_gather_block); fp32 and accumulation as pairs.
struct WgradDirectSink {
  static constexpr bool kDirect = true;
  const WgradParams* p;
  int64_t row_base[2];  // element index of the thread's two rows at this n tile; -1: past m
  int32_t cols = 0;     // columns of this n tile inside n
  int32_t q = 0;
  uint32_t pairs[2][4];  // bf16 overwrite: pairs of blocks j = 4i .. 4i+3, per row half
  __device__ __forceinline__ void prepare(const gemm::TileCoord& c, int wg, int tid) {
    const int warp = tid / 32, g = tid % 32 / 4;
    q = tid % 4;
    cols = static_cast<int32_t>(p->n - int64_t{c.n_tile} * kBlockNMma);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = int64_t{c.m_tile} * kBlockM + wg * 64 + warp * 16 + g + 8 * half;
      row_base[half] =
          row < p->m ? (c.expert * p->m + row) * p->n + int64_t{c.n_tile} * kBlockNMma : -1;
    }
  }
  __device__ __forceinline__ void begin(int, int) {}
  // Called for j = 0 .. 31 in order by every thread (unrolled: the indices are constants).
  __device__ __forceinline__ void write(int j, int half, float v0, float v1) {
    if (!p->fp32_out && !p->accumulate) {
      pairs[half][j % 4] = gemm::bf16_pair(v0, v1);
      if (j % 4 != 3 || half != 1) return;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 block = gemm::quad_gather_block(pairs[h], q);
        const int col = 8 * (j - 3 + q);  // n is a multiple of 64: the block is inside or out
        if (row_base[h] >= 0 && col < cols)
          *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(p->dw) + row_base[h] + col) =
              block;
      }
      return;
    }
    const int col = 8 * j + 2 * q;  // even, and n is a multiple of 64: col + 1 < cols too
    if (row_base[half] < 0 || col >= cols) return;
    const int64_t at = row_base[half] + col;
    if (p->fp32_out) {
      auto* dst = reinterpret_cast<float2*>(static_cast<float*>(p->dw) + at);
      if (p->accumulate) {
        const float2 old = *dst;
        v0 += old.x;
        v1 += old.y;
      }
      *dst = make_float2(v0, v1);
    } else {
      auto* dst = reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(p->dw) + at);
      const float2 old = __bfloat1622float2(*dst);  // accumulate (overwrite returned above)
      *dst = __floats2bfloat162_rn(v0 + old.x, v1 + old.y);
    }
  }
  __device__ __forceinline__ void skip(int, int) {}
};

// Job j: (expert, chunk of row tiles, n tile), n fastest, so CTAs running at once work on the
// same expert's operands.
struct Job {
  int32_t expert, n_tile, m_first, m_count;
};
__device__ __forceinline__ Job job_of(const WgradParams& p, int64_t j) {
  const int64_t per_expert = int64_t{p.m_chunks} * p.n_tiles;
  Job job;
  job.expert = static_cast<int32_t>(j / per_expert);
  const int32_t in_expert = static_cast<int32_t>(j % per_expert);
  job.n_tile = in_expert % p.n_tiles;
  job.m_first = in_expert / p.n_tiles * kMChunk;
  job.m_count = min(kMChunk, p.m_tiles - job.m_first);
  return job;
}

__device__ __forceinline__ gemm::TileCoord wgrad_tile(const WgradParams& p, const Job& job,
                                                      int32_t i) {
  gemm::TileCoord c;
  c.expert = job.expert;
  c.m_tile = job.m_first + i;
  c.n_tile = job.n_tile;
  c.rows = kBlockM;  // every row of dw's tile is real (stores past m are skipped)
  c.a_row = static_cast<int32_t>(p.seg_offset[c.expert]);  // the expert's first row: K origin
  return c;
}

__global__ void __launch_bounds__(gemm::kThreads, 1)
    expert_wgrad_kernel(const __grid_constant__ CUtensorMap map_lhs,
                        const __grid_constant__ CUtensorMap map_rhs, const WgradParams p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  auto& s = *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) / 1024 * 1024);
  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    gemm::init_stage_barriers(s);
    ptx::prefetch_tensor_map(&map_lhs);
    ptx::prefetch_tensor_map(&map_rhs);
  }
  __syncthreads();
  const int64_t jobs = int64_t{p.experts} * p.m_chunks * p.n_tiles;
  gemm::PipelineState<kStages> ps;
  auto k_blocks_of = [&](int32_t expert) {
    return static_cast<int32_t>((p.seg_offset[expert + 1] - p.seg_offset[expert]) / kBlockK);
  };
  if (wg == 0) {
    ptx::warpgroup_reg_dealloc<40>();
    if (threadIdx.x != 0) return;
    constexpr uint32_t kABytes = kBlockM * kBlockK * 2, kBBytes = kBlockNMma * kBlockK * 2;
    int64_t issued = 0;  // k-blocks loaded so far (the stage ring's position)
    for (int64_t j = blockIdx.x; j < jobs; j += gridDim.x) {
      const Job job = job_of(p, j);
      const int32_t k_blocks = k_blocks_of(job.expert);
      const bool resident = k_blocks <= kStages;
      // Every earlier k-block released: no buffer below is still being read.
      for (int64_t i = issued - kStages > 0 ? issued - kStages : 0; i < issued; ++i)
        ptx::mbarrier_wait(&s.empty[i % kStages], static_cast<uint32_t>(i / kStages) & 1);
      for (int32_t t = 0; t < job.m_count; ++t) {
        const gemm::TileCoord c = wgrad_tile(p, job, t);
        const bool load_b = !resident || t == 0;
        for (int32_t kb = 0; kb < k_blocks; ++kb, ps.advance(), ++issued) {
          ptx::mbarrier_wait(&s.empty[ps.stage], ps.phase ^ 1);
          uint64_t* full = &s.full[ps.stage];
          ptx::mbarrier_arrive_expect_tx(full, kABytes + (load_b ? kBBytes : 0));
          const int32_t row = c.a_row + kb * kBlockK;
#pragma unroll
          for (int box = 0; box < kBlockM / 64; ++box)
            ptx::tma_load_2d(s.a[ps.stage] + box * 64 * kBlockK * 2, &map_lhs,
                             c.m_tile * kBlockM + box * 64, row, full);
          if (load_b) {
            uint8_t* b = s.b[resident ? kb : ps.stage];
#pragma unroll
            for (int box = 0; box < kBlockNMma / 64; ++box)
              ptx::tma_load_2d(b + box * 64 * kBlockK * 2, &map_rhs,
                               c.n_tile * kBlockNMma + box * 64, row, full);
          }
        }
      }
    }
  } else {
    ptx::warpgroup_reg_alloc<232>();
    WgradDirectSink sink;
    sink.p = &p;
    for (int64_t j = blockIdx.x; j < jobs; j += gridDim.x) {
      const Job job = job_of(p, j);
      const int32_t k_blocks = k_blocks_of(job.expert);
      const bool resident = k_blocks <= kStages;
      for (int32_t t = 0; t < job.m_count; ++t)
        gemm::consume_tile<Epilogue::kStore, kStages, 16, WgradDirectSink,
                           gemm::WeightMajor::kN, gemm::RowsMajor::kM>(
            s, ps, wgrad_tile(p, job, t), k_blocks, wg - 1, sink, resident);
    }
  }
}

}  // namespace

cudaError_t launch_expert_wgrad(const ExpertWgradArgs& a, cudaStream_t stream) {
  const int64_t lhs_ld = a.lhs_ld == 0 ? a.m : a.lhs_ld, rhs_ld = a.rhs_ld == 0 ? a.n : a.rhs_ld;
  const ExpertSegments& seg = a.segments;
  if (!seg.valid() || a.m <= 0 || a.m % 64 != 0 || a.n <= 0 || a.n % 64 != 0 || lhs_ld < a.m ||
      lhs_ld % 8 != 0 || rhs_ld < a.n || rhs_ld % 8 != 0)
    return cudaErrorInvalidValue;
  if (seg.experts == 0) return cudaSuccess;  // (no rows at all still writes zero gradients)
  if (!seg.seg_offset || !a.lhs || !a.rhs || !a.dw) return cudaErrorInvalidValue;
  int32_t sm_count = 0;
  if (cudaError_t e = current_device_sm_count(&sm_count); e != cudaSuccess) return e;
  if (a.max_ctas > 0 && a.max_ctas < sm_count) sm_count = a.max_ctas;
  // lhs and rhs as [max_rows, m | n] with their row strides, in boxes of 64 columns x 64 rows.
  // A max_rows of 0 still maps one (never read) row.
  const uint64_t rows = seg.max_rows > 0 ? seg.max_rows : 1;
  const uint64_t lhs_dims[2] = {uint64_t(a.m), rows}, rhs_dims[2] = {uint64_t(a.n), rows};
  const uint64_t lhs_strides[1] = {uint64_t(lhs_ld) * 2}, rhs_strides[1] = {uint64_t(rhs_ld) * 2};
  const uint32_t box2[2] = {64, kBlockK};
  CUtensorMap map_lhs, map_rhs;
  if (!encode_bf16_tensor_map(&map_lhs, a.lhs, 2, lhs_dims, box2, lhs_strides).ok() ||
      !encode_bf16_tensor_map(&map_rhs, a.rhs, 2, rhs_dims, box2, rhs_strides).ok())
    return cudaErrorInvalidValue;
  WgradParams p;
  p.seg_offset = seg.seg_offset;
  p.experts = seg.experts;
  p.dw = a.dw;
  p.m = a.m;
  p.n = a.n;
  p.fp32_out = a.fp32_out;
  p.accumulate = a.accumulate;
  p.m_tiles = static_cast<int32_t>((a.m + kBlockM - 1) / kBlockM);
  p.n_tiles = static_cast<int32_t>((a.n + kBlockNMma - 1) / kBlockNMma);
  p.m_chunks = (p.m_tiles + kMChunk - 1) / kMChunk;
  const int64_t jobs = int64_t{seg.experts} * p.m_chunks * p.n_tiles;
  const int grid = static_cast<int>(jobs < sm_count ? jobs : sm_count);
  constexpr size_t smem = sizeof(Smem) + 1024;  // + alignment slack
  static_assert(smem <= 227 * 1024, "beyond the opt-in shared memory of an SM90 CTA");
  if (cudaError_t e = cudaFuncSetAttribute(expert_wgrad_kernel,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
      e != cudaSuccess)
    return e;
  expert_wgrad_kernel<<<grid, gemm::kThreads, smem, stream>>>(map_lhs, map_rhs, p);
  return cudaGetLastError();
}

}  // namespace epflow::kernels
