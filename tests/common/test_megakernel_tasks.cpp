// The forward megakernel's task lists and counter protocol (src/common/megakernel_tasks.h),
// simulated on the CPU: every worker first claims head dispatch parts from a shared counter until
// none is left, then P comm workers take the comm list round-robin, each in list order, Q
// compute workers claim compute tasks in list order, one ahead of the task they run, a task
// starting only when its wait targets hold, in random interleavings. Proves, for many shapes (ring smaller than the table, partial minibatches,
// more workers than tasks), that every task runs (no deadlock), every list holds each task once,
// every task finds in its ring slot exactly the data of its own tile (no overwrite too early),
// and every tile's output is pushed whole.
#include <gtest/gtest.h>

#include <array>
#include <map>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "common/megakernel_tasks.h"

namespace epflow::mega {
namespace {

struct Worker {
  std::vector<Task> tasks;
  size_t next = 0;
};

// Which tile's data each ring slot holds, per buffer; -1 = never written.
struct RingContents {
  std::vector<int32_t> x, h_written;
  std::vector<int32_t> x_parts;  // dispatch tasks that wrote the slot's current tile
  // h is written tile by tile in n slices, then read by the tile's down slices: count both.
  std::vector<int32_t> h_slices, y_slices;
  std::vector<int32_t> pushed;  // per tile: down slices pushed to the owners
};

struct Sim {
  TaskShape s;
  std::vector<std::array<uint32_t, kCounters>> counters;
  RingContents ring;
  std::mt19937 rng;

  explicit Sim(const TaskShape& shape, uint32_t seed) : s(shape), rng(seed) {
    counters.assign(s.ring_tiles, {0, 0, 0});
    ring.x.assign(s.ring_tiles, -1);
    ring.x_parts.assign(s.ring_tiles, 0);
    ring.h_written.assign(s.ring_tiles, -1);
    ring.h_slices.assign(s.ring_tiles, 0);
    ring.y_slices.assign(s.ring_tiles, 0);
    ring.pushed.assign(s.m_tiles, 0);
  }

  bool ready(const Task& t) const {
    WaitTarget w[2];
    const int n = wait_targets(s, t, w);
    const auto& c = counters[ring_slot_of_tile(s, t.m_tile)];
    for (int i = 0; i < n; ++i)
      if (c[static_cast<int>(w[i].counter)] < w[i].at_least) return false;
    return true;
  }

  // Runs the task on the simulated ring, checking it reads its own tile's data.
  void run(const Task& t) {
    const int32_t slot = ring_slot_of_tile(s, t.m_tile);
    auto& c = counters[slot];
    switch (t.kind) {
      case TaskKind::kDispatch:
        if (ring.x[slot] != t.m_tile) {
          // Overwriting x is only safe once every GU of the previous tile in this slot is done.
          if (ring.x[slot] >= 0)
            ASSERT_EQ(ring.h_slices[slot], s.n_gate_up) << "x overwritten early";
          ring.x[slot] = t.m_tile;
          ring.x_parts[slot] = 0;
        }
        ++ring.x_parts[slot];
        break;
      case TaskKind::kGateUp:
        ASSERT_EQ(ring.x[slot], t.m_tile) << "GU read another tile's x";
        ASSERT_EQ(ring.x_parts[slot], t.m_tile < s.head_tiles ? kHeadDispatchParts : 1)
            << "GU ran before all of its x rows arrived";
        if (ring.h_written[slot] != t.m_tile) {
          // First slice of this tile's h: the previous tile's DN must all be done with h.
          if (ring.h_written[slot] >= 0) ASSERT_EQ(ring.y_slices[slot], s.n_down);
          ring.h_written[slot] = t.m_tile;
          ring.h_slices[slot] = 0;
          ring.y_slices[slot] = 0;
        }
        ++ring.h_slices[slot];
        break;
      case TaskKind::kDown:
        ASSERT_EQ(ring.h_written[slot], t.m_tile);
        ASSERT_EQ(ring.h_slices[slot], s.n_gate_up) << "DN ran before all of h was written";
        ++ring.y_slices[slot];
        ++ring.pushed[t.m_tile];
        break;
    }
    const uint32_t add =
        (t.kind == TaskKind::kGateUp || t.kind == TaskKind::kDown) ? kSignalsPerGemmTile : 1;
    c[static_cast<int>(signalled_counter(t.kind))] += add;
  }
};

std::vector<Worker> deal(int64_t n, int32_t workers, Task (*task)(const TaskShape&, int64_t),
                         const TaskShape& s) {
  std::vector<Worker> w(workers);
  for (int64_t t = 0; t < n; ++t) w[t % workers].tasks.push_back(task(s, t));
  return w;
}

// Comm workers take the comm list round-robin (static), compute workers claim compute tasks in
// list order from a shared counter (dynamic), as the kernel does: a compute CTA's scheduler thread
// claims the next task as soon as its producer took the previous one and passes the next task's
// waits while the current one still runs, so a worker holds a running task (its waits passed; it
// finishes, signalling its counters, at any later move) and a pending one (claimed; it starts
// once its waits hold and the running one has finished). A comm worker whose comm list is done
// claims compute tasks the same way (the kernel's communication CTAs join the compute tasks).
// Returns how many compute tasks comm workers claimed (after their comm lists).
// The compute list of a shape, in order.
std::vector<Task> compute_list_of(const TaskShape& s) {
  std::vector<Task> list;
  for (int64_t t = 0; t < num_compute_tasks(s); ++t) list.push_back(compute_task(s, t));
  return list;
}

bool is_task(const Task& t, TaskKind k, int32_t m, int32_t n) {
  return t.kind == k && t.m_tile == m && t.n_tile == n;
}

int64_t simulate(TaskShape s, int32_t comm, int32_t compute, uint32_t seed) {
  s.head_tiles = head_tiles_of(s.m_tiles, s.minibatch_tiles);  // as the kernel sets it
  SCOPED_TRACE(testing::Message() << "m_tiles " << s.m_tiles << " ring " << s.ring_tiles
                                  << " minibatch " << s.minibatch_tiles << " n " << s.n_gate_up
                                  << "/" << s.n_down << " workers " << comm << "+" << compute
                                  << " seed " << seed);
  std::vector<Worker> workers = deal(num_comm_tasks(s), comm, comm_task, s);
  const std::vector<Task> compute_list = compute_list_of(s);

  // The lists hold every task exactly once.
  std::multiset<std::tuple<int, int32_t, int32_t>> seen;
  for (const Worker& w : workers)
    for (const Task& t : w.tasks) seen.insert({static_cast<int>(t.kind), t.m_tile, t.n_tile});
  for (const Task& t : compute_list) seen.insert({static_cast<int>(t.kind), t.m_tile, t.n_tile});
  for (int64_t t = 0; t < num_head_tasks(s); ++t) {
    const Task h = head_task(s, t);
    seen.insert({static_cast<int>(h.kind), h.m_tile, h.n_tile});
  }
  std::multiset<std::tuple<int, int32_t, int32_t>> want;
  for (int32_t m = 0; m < s.m_tiles; ++m) {
    for (int32_t p = 0; p < (m < s.head_tiles ? kHeadDispatchParts : 1); ++p)
      want.insert({static_cast<int>(TaskKind::kDispatch), m, p});
    for (int32_t n = 0; n < s.n_gate_up; ++n) want.insert({static_cast<int>(TaskKind::kGateUp), m, n});
    for (int32_t n = 0; n < s.n_down; ++n) want.insert({static_cast<int>(TaskKind::kDown), m, n});
  }
  EXPECT_EQ(seen, want);
  if (seen != want) return 0;

  Sim sim(s, seed);
  int64_t joined = 0;
  size_t next_compute = 0;
  int64_t next_head = 0;
  // Per worker (comm workers, then compute workers): still in the head phase.
  std::vector<bool> in_head(comm + compute, true);
  // Worker (comm workers, then compute workers) -> its pending (claimed) and running compute
  // task, -1: none.
  std::vector<int64_t> pending(comm + compute, -1), running(comm + compute, -1);
  enum Move { kHead, kComm, kClaim, kStart, kFinish };
  for (;;) {
    std::vector<std::pair<Move, size_t>> moves;
    bool left = next_compute < compute_list.size();
    for (size_t i = 0; i < in_head.size(); ++i)
      if (in_head[i]) moves.push_back({kHead, i});
    for (size_t i = 0; i < workers.size(); ++i) {
      const Worker& w = workers[i];
      if (w.next == w.tasks.size()) continue;
      left = true;
      if (!in_head[i] && sim.ready(w.tasks[w.next])) moves.push_back({kComm, i});
    }
    for (int32_t i = 0; i < comm + compute; ++i) {
      if (in_head[i]) {
        left = true;
        continue;
      }
      if (i < comm && workers[i].next < workers[i].tasks.size()) continue;  // still dispatching
      if (pending[i] < 0 && next_compute < compute_list.size()) moves.push_back({kClaim, size_t(i)});
      if (pending[i] >= 0 && running[i] < 0 && sim.ready(compute_list[pending[i]]))
        moves.push_back({kStart, size_t(i)});
      if (running[i] >= 0) moves.push_back({kFinish, size_t(i)});
      left = left || pending[i] >= 0 || running[i] >= 0;
    }
    if (!left) break;
    EXPECT_FALSE(moves.empty()) << "deadlock: no worker can make progress";
    if (moves.empty()) return joined;
    const auto [kind, i] = moves[sim.rng() % moves.size()];
    switch (kind) {
      case kHead:  // a head part waits for nothing: claimed and run in one move
        if (next_head < num_head_tasks(s))
          sim.run(head_task(s, next_head++));
        else
          in_head[i] = false;
        break;
      case kComm: sim.run(workers[i].tasks[workers[i].next++]); break;
      case kClaim:
        pending[i] = static_cast<int64_t>(next_compute++);
        if (i < static_cast<size_t>(comm)) ++joined;
        break;
      case kStart: running[i] = pending[i]; pending[i] = -1; break;
      case kFinish: sim.run(compute_list[running[i]]); running[i] = -1; break;
    }
    if (testing::Test::HasFailure()) return joined;
  }
  for (int32_t m = 0; m < s.m_tiles; ++m) EXPECT_EQ(sim.ring.pushed[m], s.n_down) << "tile " << m;
  return joined;
}

TEST(MegakernelTasks, SingleRoundNoDeadlockAndOwnData) {
  for (int32_t m_tiles : {1, 2, 7, 16})
    for (int32_t workers : {1, 3, 20})
      simulate(TaskShape{m_tiles, 16, 4, 3, 5}, workers, workers + 1, 1);
}

TEST(MegakernelTasks, RingWrapNoDeadlockAndOwnData) {
  const std::vector<TaskShape> shapes = {
      {9, 2, 1, 2, 3},    // many rounds, one-tile minibatches
      {10, 4, 2, 4, 7},   // partial last round
      {13, 6, 3, 1, 1},   // partial last minibatch
      {64, 8, 8, 16, 28}, // DeepSeek-V3 n tiles, ring of one minibatch
      {5, 1, 1, 2, 2},    // ring of a single tile
  };
  uint32_t seed = 7;
  int64_t joined = 0;
  for (const TaskShape& s : shapes)
    for (int32_t comm : {1, 2, 5})
      for (int32_t compute : {1, 4, 33})
        for (int rep = 0; rep < 3; ++rep) joined += simulate(s, comm, compute, seed++);
  // The interleavings include comm workers that finish their lists and take compute tasks.
  EXPECT_GT(joined, 0);
}

// The backward pass runs the same lists over a ring that holds every tile (ring_tiles: the
// table's capacity rounded up to the minibatch, so it never wraps), with n_gate_up = I / 256 dhp
// tiles and n_down = H / 256 dx tiles per row tile.
TEST(MegakernelTasks, BackwardPassShapesNoDeadlockAndOwnData) {
  const std::vector<TaskShape> shapes = {
      {32, 48, 16, 8, 28},  // DeepSeek-V3 at 512 tokens/rank, EP 2: two minibatches
      {37, 48, 16, 8, 28},  // a partial last minibatch
      {3, 16, 16, 2, 1},    // fewer tiles than one minibatch (the small test shape)
      {9, 12, 4, 2, 4},     // I ending in a partial dhp tile
  };
  uint32_t seed = 101;
  for (TaskShape s : shapes)
    for (bool n_fastest : {false, true}) {  // the dx tiles' order of few-tile experts, or not
      s.down_n_fastest = n_fastest;
      for (int32_t comm : {1, 12})
        for (int32_t compute : {1, 20}) simulate(s, comm, compute, seed++);
    }
}

TEST(MegakernelTasks, DownTilesRowTileByRowTileWhenExpertsHaveFewTiles) {
  TaskShape s{5, 4, 2, 2, 3};  // minibatches: tiles {0,1} {2,3} {4}
  s.down_n_fastest = true;
  const std::vector<Task> list = compute_list_of(s);
  auto is = [&](size_t i, TaskKind k, int32_t m, int32_t n) { return is_task(list[i], k, m, n); };
  // GU as without the flag (row tile fastest); DN(mb 0) at 8..13: (0,0) (0,1) (0,2) (1,0) ...
  EXPECT_TRUE(is(0, TaskKind::kGateUp, 0, 0));
  EXPECT_TRUE(is(1, TaskKind::kGateUp, 1, 0));
  EXPECT_TRUE(is(8, TaskKind::kDown, 0, 0));
  EXPECT_TRUE(is(9, TaskKind::kDown, 0, 1));
  EXPECT_TRUE(is(10, TaskKind::kDown, 0, 2));
  EXPECT_TRUE(is(11, TaskKind::kDown, 1, 0));
  EXPECT_TRUE(is(22, TaskKind::kDown, 4, 0));
  EXPECT_TRUE(is(24, TaskKind::kDown, 4, 2));
  ASSERT_EQ(list.size(), 25u);
  // The rule: up to two row tiles per local expert.
  EXPECT_TRUE(down_n_fastest_suits(48, 32));
  EXPECT_TRUE(down_n_fastest_suits(64, 32));
  EXPECT_FALSE(down_n_fastest_suits(65, 32));
}

TEST(MegakernelTasks, EmptyTableHasNoTasks) {
  const TaskShape s{0, 4, 2, 3, 3};
  EXPECT_EQ(num_compute_tasks(s), 0);
  EXPECT_EQ(num_comm_tasks(s), 0);
}

TEST(MegakernelTasks, HeadPartsThenCommListInTileOrder) {
  TaskShape s{7, 4, 2, 1, 1};
  s.head_tiles = head_tiles_of(s.m_tiles, s.minibatch_tiles);
  ASSERT_EQ(s.head_tiles, 2);
  ASSERT_EQ(num_head_tasks(s), 2 * kHeadDispatchParts);
  for (int64_t t = 0; t < num_head_tasks(s); ++t) {
    const Task h = head_task(s, t);
    EXPECT_EQ(h.kind, TaskKind::kDispatch);
    EXPECT_EQ(h.m_tile, t / kHeadDispatchParts);
    EXPECT_EQ(h.n_tile, t % kHeadDispatchParts);
  }
  ASSERT_EQ(num_comm_tasks(s), 5);
  for (int64_t t = 0; t < 5; ++t) {
    EXPECT_EQ(comm_task(s, t).kind, TaskKind::kDispatch);
    EXPECT_EQ(comm_task(s, t).m_tile, t + 2);
  }
  EXPECT_EQ(head_tiles_of(1, 4), 1);
}

TEST(MegakernelTasks, DispatchPartsCoverTheTileOnce) {
  TaskShape s{3, 2, 1, 1, 1};
  s.head_tiles = 1;
  for (int32_t tile_rows : {128, 100, 7}) {
    std::vector<int> hits(tile_rows, 0);
    for (int32_t p = 0; p < kHeadDispatchParts; ++p) {
      int32_t b = 0, e = 0;
      dispatch_rows(s, Task{TaskKind::kDispatch, 0, p}, tile_rows, &b, &e);
      for (int32_t r = b; r < e; ++r) ++hits[r];
    }
    for (int32_t r = 0; r < tile_rows; ++r) EXPECT_EQ(hits[r], 1) << "row " << r;
    int32_t b = -1, e = -1;
    dispatch_rows(s, Task{TaskKind::kDispatch, 1, 0}, tile_rows, &b, &e);
    EXPECT_EQ(b, 0);
    EXPECT_EQ(e, tile_rows);
  }
}

TEST(MegakernelTasks, ComputeListLagsDownGemmByOneMinibatch) {
  const TaskShape s{5, 4, 2, 2, 3};  // minibatches: tiles {0,1} {2,3} {4}
  const std::vector<Task> list = compute_list_of(s);
  auto is = [&](size_t i, TaskKind k, int32_t m, int32_t n) { return is_task(list[i], k, m, n); };
  // GU(mb 0): (0,0) (1,0) (0,1) (1,1); GU(mb 1): 4 tasks; DN(mb 0): 6 tasks; GU(mb 2): 2;
  // DN(mb 1): 6; DN(mb 2): 3.
  EXPECT_TRUE(is(0, TaskKind::kGateUp, 0, 0));
  EXPECT_TRUE(is(1, TaskKind::kGateUp, 1, 0));
  EXPECT_TRUE(is(2, TaskKind::kGateUp, 0, 1));
  EXPECT_TRUE(is(4, TaskKind::kGateUp, 2, 0));
  EXPECT_TRUE(is(8, TaskKind::kDown, 0, 0));
  EXPECT_TRUE(is(13, TaskKind::kDown, 1, 2));
  EXPECT_TRUE(is(14, TaskKind::kGateUp, 4, 0));
  EXPECT_TRUE(is(15, TaskKind::kGateUp, 4, 1));
  EXPECT_TRUE(is(16, TaskKind::kDown, 2, 0));
  EXPECT_TRUE(is(22, TaskKind::kDown, 4, 0));
  EXPECT_TRUE(is(24, TaskKind::kDown, 4, 2));
  ASSERT_EQ(list.size(), 25u);
}

TEST(MegakernelTasks, RingOfOneMinibatchDoesNotLag) {
  const TaskShape s{4, 2, 2, 1, 1};
  EXPECT_FALSE(lagged_down(s));
  EXPECT_EQ(compute_task(s, 2).kind, TaskKind::kDown);
  EXPECT_EQ(compute_task(s, 4).kind, TaskKind::kGateUp);
  EXPECT_EQ(compute_task(s, 4).m_tile, 2);
}

}  // namespace
}  // namespace epflow::mega
