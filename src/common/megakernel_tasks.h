// Task lists of the megakernel (both passes) and the counter protocol between its two SM
// partitions; the kinds and counters are named after the forward's.
//
// Portable (EPFLOW_HD): the kernel (src/kernels/megakernel/) and the CPU protocol simulation
// (tests/common/test_megakernel_tasks.cpp) run these same functions.
//
// The pull table's row tiles m = 0 .. m_tiles-1 (kTileRows rows each, all inside one expert) live
// in a ring of ring_tiles tile slots: tile m uses slot m % ring_tiles during macrobatch
// m / ring_tiles ("round"). Three task kinds per tile:
//   D(m)    dispatch: pull the tile's x rows from their source ranks into the slot (the head
//           tiles, the first minibatch, in kHeadDispatchParts parts D(m, p));
//   GU(m,n) gate/up GEMM + SwiGLU (compute SMs): h slot = swiglu(x slot, expert weights), n tile;
//   DN(m,n) down GEMM (compute SMs): y = h slot * W_down^T, n tile, pushed from the epilogue
//           straight into the owners' (token, k) combine slots (no y buffer, no combine task).
// Hand-over happens through three monotonically growing counters per slot, in local memory:
//   x_ready += 1 per D (or head part),  h_done += 1 per GU warpgroup half (2 per tile),
//   y_done += 2 per DN.
// Each task waits for the counters below (wait_targets) before touching the slot:
//   D(m):  h_done  >= round * 2 * n_gate_up        (the previous round's GU finished reading x)
//   GU(m): x_ready >= round + parts(slot)          (this round's x has arrived; parts(slot) =
//                                                   kHeadDispatchParts for a head tile's slot)
//          y_done  >= round * 2 * n_down           (the previous round's DN finished reading h)
//   DN(m): h_done  >= (round + 1) * 2 * n_gate_up
//
// Head. The head tiles' dispatch parts wait for nothing (round 0): every CTA of the kernel, both
// partitions, claims them one at a time from one counter before its own role, so the first
// minibatch arrives at the whole GPU's pull rate instead of the communication partition's (the
// compute SMs wait for it with nothing else to do).
// Order. Comm CTAs take the comm list round-robin, each in list order, then join the compute
// CTAs; compute CTAs claim compute tasks one at a time, in list order, from one counter.
// Compute list: by minibatch (minibatch_tiles row tiles): GU tiles of minibatch 0, then
// GU of minibatch j + 1 followed by DN of minibatch j (row tile fastest inside each, so
// concurrent CTAs share weight tiles through L2), then DN of the last; without the lag (GU(j),
// DN(j), ...) when the ring holds a single minibatch; the backward lists DN n tile fastest when
// experts have few row tiles (down_n_fastest). Comm list: D(0), D(1), ... in tile order.
// Both lists are consistent with one global order in which every task comes after all tasks it
// waits for (docs/ARCHITECTURE.md), and tasks are taken in list order, so the earliest
// unfinished task has always been taken by a CTA that can run it: no deadlock. The head parts
// come first in that order and wait for nothing; a CTA finishes every part it claimed before it
// takes anything else.
#pragma once

#include <cstdint>

#include "common/hd.h"

namespace epflow::mega {

struct TaskShape {
  int32_t m_tiles = 0;          // row tiles of this call's pull table (device: seg_offset[E] / M)
  int32_t ring_tiles = 1;       // tile slots of the ring (rows per macrobatch / kTileRows)
  int32_t minibatch_tiles = 1;  // row tiles per minibatch; divides ring_tiles
  int32_t n_gate_up = 1;        // N tiles of the gate/up GEMM
  int32_t n_down = 1;           // N tiles of the down GEMM
  int32_t head_tiles = 0;       // tiles dispatched in parts by every CTA: the first minibatch
  // DN tiles of a minibatch row tile by row tile (n fastest) instead of n tile by n tile: for
  // the backward when experts have few row tiles (down_n_fastest_suits).
  bool down_n_fastest = false;
};

// Parts of a head tile's dispatch: 16 rows each for 128-row tiles, so the first minibatch (16
// tiles of DeepSeek-V3) is 128 parts, about one per SM of an H200.
inline constexpr int32_t kHeadDispatchParts = 8;

// The head tiles of a call: the first minibatch (at most the whole table).
EPFLOW_HD int32_t head_tiles_of(int32_t m_tiles, int32_t minibatch_tiles) {
  return m_tiles < minibatch_tiles ? m_tiles : minibatch_tiles;
}

enum class TaskKind : int32_t { kDispatch, kGateUp, kDown };

struct Task {
  TaskKind kind;
  int32_t m_tile;
  int32_t n_tile;  // 0 for dispatch
};

EPFLOW_HD int32_t ring_slot_of_tile(const TaskShape& s, int32_t m_tile) {
  return m_tile % s.ring_tiles;
}

// Signals per GEMM tile: one per consumer warpgroup (each owns 64 of the 128 rows).
inline constexpr uint32_t kSignalsPerGemmTile = 2;

EPFLOW_HD int64_t num_compute_tasks(const TaskShape& s) {
  return int64_t{s.m_tiles} * (s.n_gate_up + s.n_down);
}

// The compute list runs the down GEMM of minibatch j after the gate/up GEMM of minibatch j + 1
// (when the ring holds two minibatches or more): by the time a CTA takes a down tile, the gate/up
// tiles it needs finished a whole minibatch earlier, and the tail wave of one minibatch's gate/up
// tiles is filled with ready down tiles instead of idle CTAs.
EPFLOW_HD bool lagged_down(const TaskShape& s) { return s.ring_tiles >= 2 * s.minibatch_tiles; }

EPFLOW_HD int32_t num_minibatches(const TaskShape& s) {
  return (s.m_tiles + s.minibatch_tiles - 1) / s.minibatch_tiles;
}

// Task `off` of one GEMM's tiles over minibatch j, row tile fastest (concurrent CTAs share the
// weight tiles of the same n through L2), or for DN tiles with down_n_fastest, n fastest.
EPFLOW_HD Task minibatch_task(const TaskShape& s, TaskKind kind, int32_t j, int64_t off) {
  const int32_t first = j * s.minibatch_tiles;
  const int32_t left = s.m_tiles - first;
  const int32_t mt = left < s.minibatch_tiles ? left : s.minibatch_tiles;
  if (kind == TaskKind::kDown && s.down_n_fastest)
    return Task{kind, first + static_cast<int32_t>(off / s.n_down),
                static_cast<int32_t>(off % s.n_down)};
  return Task{kind, first + static_cast<int32_t>(off % mt), static_cast<int32_t>(off / mt)};
}

// NOTES: the backward's dx tiles (DN) of row tile m wait for all its dhp tiles (GU), which a
// minibatch lists n tile by n tile; with about one row tile per expert, a minibatch's last dhp
// tiles (those past the first wave of CTAs: a minibatch can hold more dhp tiles than there are
// compute CTAs) hold up every dx tile listed row tile fastest. Row tile by row tile, the dx
// tiles of the rows done first come first, and wait less. Only when row tiles of one expert are
// few: with many, row tile fastest is what lets concurrent CTAs share each weight slice in L2.
EPFLOW_HD bool down_n_fastest_suits(int32_t m_tiles, int32_t experts) {
  return m_tiles <= 2 * experts;
}

EPFLOW_HD Task compute_task(const TaskShape& s, int64_t t) {
  const int32_t jn = num_minibatches(s);
  const int32_t last_tiles = s.m_tiles - (jn - 1) * s.minibatch_tiles;
  const int64_t gu = int64_t{s.minibatch_tiles} * s.n_gate_up;  // a full minibatch's tasks
  const int64_t dn = int64_t{s.minibatch_tiles} * s.n_down;
  const int64_t gu_last = int64_t{last_tiles} * s.n_gate_up;
  if (!lagged_down(s) || jn == 1) {  // GU(0) DN(0) GU(1) DN(1) ...
    const int32_t j = static_cast<int32_t>(t / (gu + dn));
    const int64_t off = t % (gu + dn);
    const int64_t gu_j = j == jn - 1 ? gu_last : gu;
    return off < gu_j ? minibatch_task(s, TaskKind::kGateUp, j, off)
                      : minibatch_task(s, TaskKind::kDown, j, off - gu_j);
  }
  // GU(0), then [GU(k), DN(k-1)] for k = 1 .. jn-1, then DN(jn-1); only GU(jn-1) and DN(jn-1)
  // may be partial.
  if (t < gu) return minibatch_task(s, TaskKind::kGateUp, 0, t);
  int64_t u = t - gu;
  const int64_t full_pairs = jn - 2;  // pairs k = 1 .. jn-2
  if (u < full_pairs * (gu + dn)) {
    const int32_t k = 1 + static_cast<int32_t>(u / (gu + dn));
    const int64_t off = u % (gu + dn);
    return off < gu ? minibatch_task(s, TaskKind::kGateUp, k, off)
                    : minibatch_task(s, TaskKind::kDown, k - 1, off - gu);
  }
  u -= full_pairs * (gu + dn);
  if (u < gu_last) return minibatch_task(s, TaskKind::kGateUp, jn - 1, u);
  u -= gu_last;
  if (u < dn) return minibatch_task(s, TaskKind::kDown, jn - 2, u);
  return minibatch_task(s, TaskKind::kDown, jn - 1, u - dn);
}

// The head list, claimed by every CTA: part p of head tile m is Task{kDispatch, m, p}.
EPFLOW_HD int64_t num_head_tasks(const TaskShape& s) {
  return int64_t{s.head_tiles} * kHeadDispatchParts;
}

EPFLOW_HD Task head_task(const TaskShape&, int64_t t) {
  return Task{TaskKind::kDispatch, static_cast<int32_t>(t / kHeadDispatchParts),
              static_cast<int32_t>(t % kHeadDispatchParts)};
}

// The comm list: the tiles after the head, whole (Task{kDispatch, m, 0}).
EPFLOW_HD int64_t num_comm_tasks(const TaskShape& s) { return s.m_tiles - s.head_tiles; }

EPFLOW_HD Task comm_task(const TaskShape& s, int64_t t) {
  return Task{TaskKind::kDispatch, s.head_tiles + static_cast<int32_t>(t), 0};
}

// Rows [*begin, *end) that dispatch task t copies of a tile whose first `rows` rows are routed
// (the rest is segment padding): all of them, or a head part's share.
EPFLOW_HD void dispatch_rows(const TaskShape& s, const Task& t, int32_t rows, int32_t* begin,
                             int32_t* end) {
  if (t.m_tile >= s.head_tiles) {
    *begin = 0;
    *end = rows;
    return;
  }
  const int32_t per_part = (rows + kHeadDispatchParts - 1) / kHeadDispatchParts;
  const int32_t b = t.n_tile * per_part;
  *begin = b < rows ? b : rows;
  *end = b + per_part < rows ? b + per_part : rows;
}

// The counters of one ring slot.
enum class Counter : int32_t { kXReady = 0, kHDone = 1, kYDone = 2 };
inline constexpr int kCounters = 3;

EPFLOW_HD const char* counter_name(Counter c) {
  switch (c) {
    case Counter::kXReady: return "x_ready (dispatched x rows)";
    case Counter::kHDone: return "h_done (gate/up warpgroups finished)";
    default: return "y_done (down warpgroups finished)";
  }
}

EPFLOW_HD const char* task_name(TaskKind k) {
  switch (k) {
    case TaskKind::kDispatch: return "dispatch";
    case TaskKind::kGateUp: return "gate/up GEMM";
    default: return "down GEMM + combine";
  }
}

struct WaitTarget {
  Counter counter;
  uint32_t at_least;
};

// What task `task` waits for before it touches its slot; returns how many targets (0..2).
EPFLOW_HD int wait_targets(const TaskShape& s, const Task& task, WaitTarget out[2]) {
  const uint32_t round = static_cast<uint32_t>(task.m_tile / s.ring_tiles);
  const uint32_t gu = kSignalsPerGemmTile * static_cast<uint32_t>(s.n_gate_up);
  const uint32_t dn = kSignalsPerGemmTile * static_cast<uint32_t>(s.n_down);
  int n = 0;
  switch (task.kind) {
    case TaskKind::kDispatch:
      if (round > 0) out[n++] = WaitTarget{Counter::kHDone, round * gu};
      break;
    case TaskKind::kGateUp: {
      // A head tile's slot got kHeadDispatchParts signals in round 0, later tiles one each.
      const bool head_slot = ring_slot_of_tile(s, task.m_tile) < s.head_tiles;
      out[n++] = WaitTarget{Counter::kXReady,
                            round + (head_slot ? uint32_t{kHeadDispatchParts} : 1u)};
      if (round > 0) out[n++] = WaitTarget{Counter::kYDone, round * dn};
      break;
    }
    case TaskKind::kDown:
      out[n++] = WaitTarget{Counter::kHDone, (round + 1) * gu};
      break;
  }
  return n;
}

// The counter a finished task (or, for GEMM tiles, each of its warpgroups) adds one to.
EPFLOW_HD Counter signalled_counter(TaskKind k) {
  switch (k) {
    case TaskKind::kDispatch: return Counter::kXReady;
    case TaskKind::kGateUp: return Counter::kHDone;
    default: return Counter::kYDone;
  }
}

}  // namespace epflow::mega
