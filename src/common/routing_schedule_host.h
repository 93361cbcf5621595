// Host driver of the routing schedule: runs the portable passes of routing_schedule.h in the
// same chunked order the device kernels use. Used by tests, the CPU planning code and as the
// expected result for the device schedule.
#pragma once

#include <cstdint>
#include <vector>

#include "common/routing_schedule.h"

namespace epflow::sched {

struct PullTable {
  std::vector<int32_t> counts;      // [E_local * world]: rows from src to local expert e
  std::vector<int64_t> seg_offset;  // [E_local + 1]: padded segment starts
  std::vector<PullRow> rows;        // [seg_offset[E_local]]
  int64_t invalid_slots = 0;        // slots whose expert id was out of range (skipped)

  int64_t total_rows() const { return seg_offset.empty() ? 0 : seg_offset.back(); }
};

// topk_idx[src] holds tokens[src] * top_k ids of source rank src. chunk_slots > 0 sets the
// chunk size of the count/fill passes; the table does not depend on it.
PullTable build_pull_table(const ScheduleShape& shape, const std::vector<const int32_t*>& topk_idx,
                           const std::vector<int64_t>& tokens, int64_t chunk_slots);

}  // namespace epflow::sched
