// Device routing schedule: builds this rank's pull table on the GPU from every source rank's
// topk_idx, by running the portable helpers of common/routing_schedule.h (so it is, by
// construction, the table the host tests prove). Stream-ordered, no host sync: the token counts
// of the sources are read from device memory; the workspace is sized for max_tokens_per_rank and
// the kernels skip the chunks past the actual counts. Three kernels: count (a warp per chunk),
// scan over chunks (a warp per source and expert), fill (layout, rows, padding).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/routing_schedule.h"

namespace epflow::kernels {

// Device buffers of the schedule (see routing_schedule_workspace_bytes for their sizes).
struct ScheduleBuffers {
  int32_t* chunk_counts = nullptr;   // [world][E_local][chunk stride], becomes per-chunk ordinals
  int32_t* counts = nullptr;         // [E_local * world]
  int64_t* seg_offset = nullptr;     // [E_local + 1]; seg_offset[E_local] = total padded rows
  int32_t* expert_rows = nullptr;    // [E_local]: real (unpadded) rows of each local expert
  sched::PullRow* table = nullptr;   // [pull_table_capacity]
  int32_t* invalid_slots = nullptr;  // [1], accumulated: slots with out-of-range expert ids
};

struct ScheduleLaunch {
  sched::ScheduleShape shape;
  int64_t max_tokens_per_rank = 0;
  int64_t chunk_slots = 0;  // slots per chunk (one warp's share); 0: effective_chunk_slots picks
};

// The chunk size the kernels use: chunk_slots if set, else one that keeps the per-chunk counts
// within 16 MB and at most 1024 chunks per source (a multiple of 32, at least max(256, E_local)).
int64_t effective_chunk_slots(const ScheduleLaunch& launch);

// Carves ScheduleBuffers out of one allocation of routing_schedule_workspace_bytes() bytes.
size_t routing_schedule_workspace_bytes(const ScheduleLaunch& launch);
ScheduleBuffers carve_schedule_buffers(const ScheduleLaunch& launch, void* workspace);

// topk_idx: device array of `world` device pointers (peer windows in the layer);
// tokens: device array of `world` token counts. Rows past seg_offset[E_local] are left as they are.
cudaError_t launch_routing_schedule(const ScheduleLaunch& launch,
                                    const int32_t* const* topk_idx, const int64_t* tokens,
                                    const ScheduleBuffers& buffers, cudaStream_t stream);

}  // namespace epflow::kernels
