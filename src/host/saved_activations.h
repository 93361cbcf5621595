// What a forward keeps for its backward: the routing schedule of the call (pull table, segments,
// per-expert rows; the backward runs on the same rows) and, when the forward keeps them, the
// routed rows' gate/up pre-activations g | u up to plan.saved_gate_up_rows rows. A view over
// memory someone else owns: a SavedContext's buffer (training forwards), or the workspace's
// (inference forwards: schedule only).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "epflow/status.h"
#include "kernels/routing_schedule.cuh"

namespace epflow {

struct LayerWorkspace;

struct SavedActivations {
  kernels::ScheduleBuffers schedule;
  // [ws.plan.saved_gate_up_rows, 2I] in pull-table order (the first rows of the table; the
  // backward recomputes the rest), or null.
  __nv_bfloat16* gate_up = nullptr;

  // Alignment of a buffer carve() takes, and of each part inside it.
  static constexpr int64_t kAlignment = 256;
  // Bytes of the schedule, then of g | u, for ws's shape.
  static int64_t schedule_bytes(const LayerWorkspace& ws);
  static int64_t bytes(const LayerWorkspace& ws, bool with_gate_up);
  // The view over `buffer` (at least bytes(ws, with_gate_up), kAlignment-aligned).
  static SavedActivations carve(const LayerWorkspace& ws, void* buffer, bool with_gate_up);

  // The device schedule of this rank's experts from every rank's topk_idx and T (in their
  // windows and ws.tokens once the publish barrier passed), stream-ordered.
  Status build_schedule(const LayerWorkspace& ws, cudaStream_t stream) const;
};

}  // namespace epflow
