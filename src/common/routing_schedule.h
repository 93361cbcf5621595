// The routing schedule: from every rank's topk_idx, this rank's pull table for its local experts.
//
// Portable (EPFLOW_HD): the host driver in routing_schedule_host.h and the device kernels in
// src/kernels/routing_schedule.cu run these same functions, so the CPU tests prove the GPU layout.
//
// Layout of the pull table (one row per routed (token, k) slot whose expert lives on this rank):
//  - rows grouped by local expert, experts in order; each expert's segment padded with
//    padding rows up to a multiple of tile_m (the GEMM M tile), so no tile spans two experts;
//  - inside a segment, rows interleaved across source ranks: the j-th row from every source
//    together (round j = [src0's j-th, src1's j-th, ...], skipping sources that have run out),
//    so one tile pulls from many peers at once instead of hammering one;
//  - the rows from one source to one expert keep the order of their slot ids (token * K + k):
//    the table is a pure function of the routing, so wgrad sums run in a fixed order;
//  - the megakernel walks the table in macrobatches of whole tiles that fit its ring buffer
//    (src/common/megakernel_tasks.h): every row in exactly one, however many rows the routing
//    sends (nothing is ever dropped).
//
// Slot ids are computed chunk by chunk (count per chunk, scan over chunks, fill per chunk) so
// the device can run chunks in parallel; the result does not depend on the chunk size. A row's
// place comes from its ordinal j (rows src sent expert e from earlier slots): the host driver
// walks each chunk serially (count_chunk, fill_chunk), the device hands each chunk to a warp that
// ranks 32 slots at a time; both go through the per-slot (local_expert_of), per-row (pull_row)
// and per-expert (padded_segment_rows, fill_padding) helpers below.
#pragma once

#include <cstdint>

#include "common/hd.h"

namespace epflow::sched {

// A pull-table row: read slot `src_slot` (= token * top_k + k) of rank `src_rank`.
struct PullRow {
  int32_t src_rank;  // kPaddingRow for padding
  int32_t src_slot;
};
inline constexpr int32_t kPaddingRow = -1;

struct ScheduleShape {
  int32_t world = 1;             // EP size
  int32_t rank = 0;              // the rank whose pull table this is (the destination)
  int32_t experts_per_rank = 1;  // E_local
  int32_t top_k = 1;             // K
  int32_t tile_m = 1;            // segment padding granularity (GEMM M tile)

  EPFLOW_HD int32_t num_experts() const { return world * experts_per_rank; }
};

// local_expert_of() results that are not a local expert index.
inline constexpr int32_t kNotLocal = -1;      // empty slot (-1) or an expert of another rank
inline constexpr int32_t kInvalidExpert = -2; // id < -1 or >= num_experts

EPFLOW_HD int32_t local_expert_of(const ScheduleShape& s, int32_t expert_id) {
  if (expert_id == -1) return kNotLocal;
  if (expert_id < -1 || expert_id >= s.num_experts()) return kInvalidExpert;
  const int32_t owner = expert_id / s.experts_per_rank;
  return owner == s.rank ? expert_id - owner * s.experts_per_rank : kNotLocal;
}

EPFLOW_HD int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
EPFLOW_HD int64_t ceil_div(int64_t v, int64_t m) { return (v + m - 1) / m; }

// --- pass 1: counts ---------------------------------------------------------------------------

// Adds the slots [slot_begin, slot_end) of one source's topk_idx into counts[E_local] and returns
// how many slots held an invalid expert id (those are skipped, and reported by the caller).
EPFLOW_HD int32_t count_chunk(const ScheduleShape& s, const int32_t* topk_idx, int64_t slot_begin,
                              int64_t slot_end, int32_t* counts) {
  int32_t invalid = 0;
  for (int64_t slot = slot_begin; slot < slot_end; ++slot) {
    const int32_t e = local_expert_of(s, topk_idx[slot]);
    if (e >= 0) counts[e] += 1;
    invalid += (e == kInvalidExpert);
  }
  return invalid;
}

// --- pass 2: segment layout -------------------------------------------------------------------

// Rows local expert e receives from all sources; counts[e * world + src] = rows from src to e.
EPFLOW_HD int64_t segment_rows(const ScheduleShape& s, const int32_t* counts, int32_t e) {
  int64_t rows = 0;
  for (int32_t src = 0; src < s.world; ++src) rows += counts[e * s.world + src];
  return rows;
}

// Length of expert e's segment: its rows padded to whole tiles (an empty expert's is empty).
EPFLOW_HD int64_t padded_segment_rows(const ScheduleShape& s, const int32_t* counts, int32_t e) {
  return round_up(segment_rows(s, counts, e), s.tile_m);
}

// Writes seg_offset[E_local + 1] (padded start of each expert's segment; seg_offset[E_local] =
// total padded rows, the exclusive scan of padded_segment_rows) and returns the total.
EPFLOW_HD int64_t layout_segments(const ScheduleShape& s, const int32_t* counts,
                                  int64_t* seg_offset) {
  int64_t offset = 0;
  for (int32_t e = 0; e < s.experts_per_rank; ++e) {
    seg_offset[e] = offset;
    offset += padded_segment_rows(s, counts, e);
  }
  seg_offset[s.experts_per_rank] = offset;
  return offset;
}

// Position inside an expert's segment of the j-th row (0-based) that source `src` sends it,
// given that expert's per-source counts[world]: all rows of rounds < j come first, then the
// sources before src that still have a j-th row.
EPFLOW_HD int64_t interleaved_position(const int32_t* expert_counts, int32_t world, int32_t src,
                                       int32_t j) {
  int64_t pos = 0;
  for (int32_t r = 0; r < world; ++r) {
    const int32_t c = expert_counts[r];
    pos += c < j ? c : j;
    pos += (r < src && c > j);
  }
  return pos;
}

// Table row of the j-th row (0-based, in slot order) that source src sends local expert e.
EPFLOW_HD int64_t pull_row(const ScheduleShape& s, const int32_t* counts,
                           const int64_t* seg_offset, int32_t src, int32_t e, int32_t j) {
  return seg_offset[e] + interleaved_position(counts + e * s.world, s.world, src, j);
}

// --- pass 3: fill -----------------------------------------------------------------------------

// Writes the rows of slots [slot_begin, slot_end) of source `src` into the table. ordinal[E_local]
// holds, on entry, how many rows src sent each expert from slots before slot_begin (the exclusive
// scan of pass-1 chunk counts) and is advanced in place.
EPFLOW_HD void fill_chunk(const ScheduleShape& s, const int32_t* topk_idx, int32_t src,
                          int64_t slot_begin, int64_t slot_end, const int32_t* counts,
                          const int64_t* seg_offset, int32_t* ordinal, PullRow* table) {
  for (int64_t slot = slot_begin; slot < slot_end; ++slot) {
    const int32_t e = local_expert_of(s, topk_idx[slot]);
    if (e < 0) continue;
    table[pull_row(s, counts, seg_offset, src, e, ordinal[e]++)] =
        PullRow{src, static_cast<int32_t>(slot)};
  }
}

// Marks the padding rows of expert e's segment: padding rows lane, lane + lanes, ... of it, so
// `lanes` threads can share one segment (the host passes 0, 1).
EPFLOW_HD void fill_padding(const ScheduleShape& s, const int32_t* counts,
                            const int64_t* seg_offset, int32_t e, PullRow* table,
                            int32_t lane = 0, int32_t lanes = 1) {
  for (int64_t row = seg_offset[e] + segment_rows(s, counts, e) + lane; row < seg_offset[e + 1];
       row += lanes)
    table[row] = PullRow{kPaddingRow, -1};
}

// Local expert owning padded row `row` (0 <= row < seg_offset[E_local]): binary search.
EPFLOW_HD int32_t expert_of_row(const int64_t* seg_offset, int32_t experts_per_rank, int64_t row) {
  int32_t lo = 0, hi = experts_per_rank - 1;
  while (lo < hi) {  // last e with seg_offset[e] <= row; empty segments are skipped past
    const int32_t mid = (lo + hi + 1) / 2;
    if (seg_offset[mid] <= row) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Most rows a pull table can hold: every slot of every source routed here, plus padding.
EPFLOW_HD int64_t pull_table_capacity(const ScheduleShape& s, int64_t max_tokens_per_rank) {
  const int64_t per_token = s.top_k;
  return int64_t{s.world} * max_tokens_per_rank * per_token +
         int64_t{s.experts_per_rank} * (s.tile_m - 1);
}

}  // namespace epflow::sched
