// The forward megakernel's hand-off protocol (src/common/megakernel_tasks.h) run by real threads:
// CPU threads play the kernel's CTAs (every one first takes head dispatch parts from a shared
// counter; communication threads then take the comm list round-robin and join the compute tasks;
// compute threads claim compute tasks in list order from one counter), the ring slots' counters
// are std::atomic with the kernel's orders (waits load with acquire, signals add with release),
// and the ring's data are plain memory that tasks write and read as the kernel's do. Every task
// checks it finds its own tile's data. Built with -fsanitize=thread (scripts/sanitize.sh),
// ThreadSanitizer reports any access the counters fail to order; in the normal build it still
// checks, with real concurrency, that no wait deadlocks and no slot is overwritten too early.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "common/megakernel_tasks.h"

namespace epflow::mega {
namespace {

using Clock = std::chrono::steady_clock;

struct Ring {
  TaskShape s;
  std::vector<std::atomic<uint32_t>> counters;  // [ring_tiles * kCounters]
  // Plain data, as the kernel's ring: per slot, kHeadDispatchParts x cells written by the
  // dispatch parts (a whole tile's dispatch writes them all), n_gate_up h cells.
  std::vector<int32_t> x, h;
  std::vector<std::atomic<int32_t>> pushed;  // per tile: down slices pushed
  std::atomic<int64_t> head_next{0}, compute_next{0};
  std::atomic<bool> failed{false};
  std::string failure;  // written once, by the thread that set `failed` first

  explicit Ring(const TaskShape& shape)
      : s(shape),
        counters(static_cast<size_t>(shape.ring_tiles) * kCounters),
        x(static_cast<size_t>(shape.ring_tiles) * kHeadDispatchParts, -1),
        h(static_cast<size_t>(shape.ring_tiles) * shape.n_gate_up, -1),
        pushed(shape.m_tiles) {}

  std::atomic<uint32_t>& counter(int32_t slot, Counter c) {
    return counters[static_cast<size_t>(slot) * kCounters + static_cast<int>(c)];
  }
  void fail(const std::string& why) {
    if (!failed.exchange(true)) failure = why;
  }

  // Spins (yielding) until the task's targets hold; false after 20 s or another thread's failure.
  bool wait(const Task& t) {
    WaitTarget w[2];
    const int n = wait_targets(s, t, w);
    const int32_t slot = ring_slot_of_tile(s, t.m_tile);
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    for (int i = 0; i < n; ++i)
      while (counter(slot, w[i].counter).load(std::memory_order_acquire) < w[i].at_least) {
        if (failed.load(std::memory_order_relaxed)) return false;
        if (Clock::now() > deadline) {
          fail("deadlock: " + std::string(task_name(t.kind)) + " of tile " +
               std::to_string(t.m_tile) + " waited 20 s");
          return false;
        }
        std::this_thread::yield();
      }
    return true;
  }

  void run(const Task& t) {
    const int32_t slot = ring_slot_of_tile(s, t.m_tile);
    int32_t* xs = &x[static_cast<size_t>(slot) * kHeadDispatchParts];
    int32_t* hs = &h[static_cast<size_t>(slot) * s.n_gate_up];
    switch (t.kind) {
      case TaskKind::kDispatch:
        if (t.m_tile < s.head_tiles) {
          xs[t.n_tile] = t.m_tile;  // one part of a head tile
        } else {
          for (int p = 0; p < kHeadDispatchParts; ++p) xs[p] = t.m_tile;
        }
        break;
      case TaskKind::kGateUp:
        for (int p = 0; p < kHeadDispatchParts; ++p)
          if (xs[p] != t.m_tile)
            fail("gate/up of tile " + std::to_string(t.m_tile) + " read x of tile " +
                 std::to_string(xs[p]));
        hs[t.n_tile] = t.m_tile;
        break;
      case TaskKind::kDown:
        for (int n = 0; n < s.n_gate_up; ++n)
          if (hs[n] != t.m_tile)
            fail("down of tile " + std::to_string(t.m_tile) + " read h of tile " +
                 std::to_string(hs[n]));
        pushed[t.m_tile].fetch_add(1, std::memory_order_relaxed);
        break;
    }
    const uint32_t add = t.kind == TaskKind::kDispatch ? 1 : kSignalsPerGemmTile;
    counter(slot, signalled_counter(t.kind)).fetch_add(add, std::memory_order_release);
  }

  void head() {
    for (int64_t i; (i = head_next.fetch_add(1)) < num_head_tasks(s);) run(head_task(s, i));
  }
  void compute() {
    for (int64_t i; (i = compute_next.fetch_add(1)) < num_compute_tasks(s);) {
      const Task t = compute_task(s, i);
      if (!wait(t)) return;
      run(t);
    }
  }
  void comm(int32_t me, int32_t comm_threads) {
    for (int64_t i = me; i < num_comm_tasks(s); i += comm_threads) {
      const Task t = comm_task(s, i);
      if (!wait(t)) return;
      run(t);
    }
  }
};

void run_threads(TaskShape s, int32_t comm_threads, int32_t compute_threads) {
  s.head_tiles = head_tiles_of(s.m_tiles, s.minibatch_tiles);  // as the kernel sets it
  SCOPED_TRACE(::testing::Message() << "m_tiles " << s.m_tiles << " ring " << s.ring_tiles
                                    << " minibatch " << s.minibatch_tiles << " n " << s.n_gate_up
                                    << "/" << s.n_down << " threads " << comm_threads << "+"
                                    << compute_threads);
  Ring ring(s);
  std::vector<std::thread> threads;
  for (int32_t i = 0; i < comm_threads; ++i)
    threads.emplace_back([&ring, i, comm_threads] {
      ring.head();
      ring.comm(i, comm_threads);
      ring.compute();  // a communication CTA whose list is done joins the compute tasks
    });
  for (int32_t i = 0; i < compute_threads; ++i)
    threads.emplace_back([&ring] {
      ring.head();
      ring.compute();
    });
  for (auto& t : threads) t.join();
  ASSERT_FALSE(ring.failed.load()) << ring.failure;
  for (int32_t m = 0; m < s.m_tiles; ++m) EXPECT_EQ(ring.pushed[m].load(), s.n_down) << "tile " << m;
}

TEST(MegakernelProtocolThreads, RingWrapsManyTimes) {
  // 40 row tiles through a ring of 4 (10 rounds), minibatches of 2, more compute threads than
  // the ring has tiles.
  run_threads(TaskShape{40, 4, 2, 3, 5, 0}, 2, 6);
  run_threads(TaskShape{40, 4, 2, 3, 5, 0}, 1, 3);
}

TEST(MegakernelProtocolThreads, SingleRoundPartialMinibatchAndOneMinibatchRing) {
  run_threads(TaskShape{7, 8, 4, 2, 2, 0}, 2, 4);  // everything fits, last minibatch partial
  run_threads(TaskShape{9, 3, 3, 2, 4, 0}, 1, 5);  // a ring of one minibatch: no lag
  run_threads(TaskShape{1, 1, 1, 1, 1, 0}, 1, 1);  // a single tile
}

}  // namespace
}  // namespace epflow::mega
