// The megakernel's shared memory: the GEMM's stages and staging (grouped_gemm.cuh), the
// handshakes between a compute CTA's threads, and the dispatch's row buffers, which reuse the
// stage memory. Separate because the dispatch, the sinks and the compute loop all work in it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/grouped_gemm.cuh"

namespace epflow::kernels::megakernel {

// Both GEMMs' epilogues hand their tiles to store warps through the staging buffers, so the
// consumers go straight on to the next tile's MMAs (the tensor cores idle while an epilogue runs
// in registers). Down-kind tiles stage their bf16 rows for the store warps' bulk copies into the
// rows' combine slots: 64 rows of kTileCols bf16 per warpgroup, each row padded by 16 bytes so
// the 8 rows of an stmatrix matrix (16 bytes each) hit 8 different bank groups.
// 3 x 48 KB of A/B tiles + 2 x 33 KB of staging + the FP8 rows' scale boxes and weights' scale
// slots: 224 KB of 227.
// NOTES: a fourth stage (with the down tiles pushed from registers, no room for their staging)
// ran no faster than three.
inline constexpr int kStages = 3;
inline constexpr int kPushRowBytes = kTileCols * 2 + 16;
inline constexpr int kPushStagingBytes = 64 * kPushRowBytes;
inline constexpr int kStaging = gemm::kStagingBytes<gemm::Epilogue::kSwiGLU> > kPushStagingBytes
                                    ? gemm::kStagingBytes<gemm::Epilogue::kSwiGLU>
                                    : kPushStagingBytes;
static_assert(kStaging % 1024 == 0,
              "the second warpgroup's staging must start on a 1024-byte boundary (128B-swizzled "
              "TMA boxes)");
// Dispatch moves each x row as two bulk copies (TMA) through a row buffer in shared memory: the
// source (local HBM or a peer over NVLink) into the buffer, the buffer into the ring. Up to
// kPullWarps warps per CTA (lane 0 of each issues) keep up to kMaxPullRows rows in flight, in
// the GEMM's stage memory, which no GEMM uses before the CTA's dispatch is done (a CTA runs GEMMs
// only after its last dispatch task). NOTES: bulk copies rather than register copies (a warp
// per row, 16 loads of 16 B in flight per lane): register copies pull peer rows into an SM at a
// much lower rate (epflow-row-copy-probe compares the two).
inline constexpr int kMaxPullRows = 64;
inline constexpr int kPullWarps = 4;

struct alignas(1024) MegaSmem {
  gemm::GemmSmem<kStages, kStaging> gemm;
  // FP8: the stages' boxes of the rows' scales and the weights' scale slots (gemm::Fp8ScaleLoads).
  alignas(128) uint8_t fp8_row_scales[kStages][gemm::kFp8ScaleBoxBytes];
  alignas(128) uint8_t fp8_weight_scales[gemm::kFp8WeightScaleBytes<kStages>];
  // Consumer warpgroup w -> its store warp: "staging w holds a tile" / "staging w is free".
  uint64_t staging_full[2];
  uint64_t staging_empty[2];
  // The dynamic schedule: the compute task and tile whose first stage is stage i (task -1: no
  // more tasks), and the gate/up task and tile whose output staging w holds (task -1: stop).
  gemm::StageTag stage_tag[kStages];
  uint64_t tag_read[kStages];  // gemm::StageTags::read
  gemm::StageTag staged[2];
  // Scheduler thread -> producer: the next claimed task (-1: none left), its tile, and when it
  // was claimed and its waits passed (trace); "next holds a task" / "next is free".
  uint64_t next_full, next_empty;
  int64_t next_task;
  int32_t next_kind;  // mega::TaskKind of next_task
  gemm::TileCoord next_tile;
  uint64_t next_taken, next_ready;
  uint64_t pull_full[kMaxPullRows];  // dispatch row buffer i holds its row
  int64_t head_claimed;              // the head dispatch part thread 0 claimed, for its CTA
  int32_t dispatch_records;          // trace records the CTA's dispatch wrote (thread 0's count)
};

// A consumer warpgroup's side of its staging handshake (both GEMMs' sinks share it, so they
// share the phase count): acquire(), every thread, before the warpgroup writes its staging;
// publish(), one thread, once the whole warpgroup's writes are fenced for the async proxy and
// synchronised: hands tile c of `task` to the store warp. The backward's dhp sink (dh_sink.cuh)
// holds it for its g | u instead, and releases it.
struct StagingHandshake {
  MegaSmem* s;
  uint32_t uses = 0;
  __device__ __forceinline__ void acquire(int wg) {
    ptx::mbarrier_wait(&s->staging_empty[wg], (uses & 1) ^ 1);
    ++uses;
  }
  __device__ __forceinline__ void publish(int wg, int64_t task, mega::TaskKind kind,
                                          const gemm::TileCoord& c) {
    s->staged[wg] = gemm::StageTag{task, static_cast<int32_t>(kind), c};
    ptx::mbarrier_arrive(&s->staging_full[wg]);
  }
  // release(): one thread, once the whole warpgroup is done with the staging, for a sink that
  // used it as its own scratch (no store warp involved): frees it as the store warp would.
  __device__ __forceinline__ void release(int wg) { ptx::mbarrier_arrive(&s->staging_empty[wg]); }
};

inline constexpr size_t kSmemBytes = sizeof(MegaSmem);
static_assert(kSmemBytes <= 227 * 1024, "beyond the opt-in shared memory of an SM90 CTA");

}  // namespace epflow::kernels::megakernel
