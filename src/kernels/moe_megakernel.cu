// The fused megakernel, forward and backward passes (moe_megakernel.cuh). Task lists, counters
// and the argument that no wait can deadlock: src/common/megakernel_tasks.h and
// docs/ARCHITECTURE.md. The passes share the task lists, the counters, the pulls, the dynamic
// schedule and the timed waits; they differ in the GEMMs' operands and epilogues (Pass).
#include <cuda.h>

#include <cstddef>
#include <cstdio>
#include <string>

#include "common/megakernel_tasks.h"
#include "kernels/grouped_gemm.cuh"
#include "kernels/moe_megakernel.cuh"
#include "kernels/ptx/timed_wait.cuh"

namespace epflow::kernels {

namespace {

using gemm::Epilogue;
using mega::Task;
using mega::TaskKind;
using mega::TaskShape;

// Forward: x -> gate/up + SwiGLU -> down, pushed. Backward: dy -> dhp + SwiGLU backward ->
// [dg | du] [W_gate; W_up], pushed (and x pulled for the weight gradients).
enum class Pass { kForward, kBackward };

// NOTES: the down GEMM pushes its outputs from registers (no staging), so only the gate/up
// epilogue stages in shared memory: 4 x 48 KB of A/B tiles + 2 x 16 KB staging = 224 KB of 227.
constexpr int kStages = 4;
constexpr int kStaging = gemm::kStagingBytes<Epilogue::kSwiGLU>;
// Dispatch moves each x row as two bulk copies (TMA) through a row buffer in shared memory: the
// source (local HBM or a peer over NVLink) into the buffer, the buffer into the ring. Up to
// kPullWarps warps per CTA (lane 0 of each issues) keep up to kMaxPullRows rows in flight, in
// the GEMM's stage memory, which no GEMM uses before the CTA's dispatch is done (a CTA runs GEMMs
// only after its last dispatch task). NOTES: register copies (a warp per row, 16 loads of 16 B
// in flight per lane, 96 KB per SM) pulled ~18 GB/s of peer rows per SM inside the kernel and
// ~20 GB/s in a probe; bulk copies ~45 GB/s in the probe.
constexpr int kMaxPullRows = 64;
constexpr int kPullWarps = 4;

struct alignas(1024) MegaSmem {
  gemm::GemmSmem<kStages, kStaging> gemm;
  // Consumer warpgroup w -> its store thread: "staging w holds a tile" / "staging w is free".
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
  gemm::TileCoord next_tile;
  uint64_t next_taken, next_ready;
  uint64_t pull_full[kMaxPullRows];  // dispatch row buffer i holds its row
  int64_t head_claimed;              // the head dispatch part thread 0 claimed, for its CTA
};

// Gate/up tiles: the consumers' epilogue output goes to a store thread of the producer
// warpgroup, which issues the TMA stores of h into the ring, waits for them to land and signals
// the tile's counter: the consumer warpgroups go straight on to their next tile's MMAs. A warpgroup whose rows are all padding
// signals itself once it has consumed the tile's stages. NOTES: never earlier (say, by the store
// thread as soon as it reaches the task): the producer may not have passed the task's waits yet,
// and an early signal of round r + 1 would complete a target meant for round r.
struct RingSink {
  static constexpr bool kDirect = false;
  MegaSmem* s;
  const MegakernelArgs* a;
  uint32_t* counter = nullptr;  // the current tile's counter
  int64_t task = 0;             // the current tile's task
  uint32_t uses = 0;
  __device__ __forceinline__ void acquire(int wg, int) {
    ptx::mbarrier_wait(&s->staging_empty[wg], (uses & 1) ^ 1);
    ++uses;
  }
  __device__ __forceinline__ void publish(int wg, int tid, const uint8_t*,
                                         const gemm::TileCoord& c) {
    if (tid == 0) {
      s->staged[wg] = gemm::StageTag{task, c};
      ptx::mbarrier_arrive(&s->staging_full[wg]);
    }
  }
  __device__ __forceinline__ void skip(int, int tid) {
    if (tid == 0) ptx::signal_counter(counter);
  }
  // Training: g and u of the tile's routed rows, bf16, into gate_up_out at the rows' pull-table
  // positions (the backward reads them there; the ring slot is reused). NOTES: straight from
  // the accumulators, 16 bytes per lane, before the SwiGLU staging: the stores drain while the
  // warpgroup writes staging and runs the next mainloop.
  __device__ __forceinline__ void keep_gate_up(const float* acc, const gemm::TileCoord& c, int wg,
                                               int tid) {
    if (!a->gate_up_out) return;
    constexpr int kHalfCols = kTileCols / 2;  // gate columns, then as many up columns
    constexpr int kUp = kHalfCols / 8 * 4;           // register offset of the up half
    const int warp = tid / 32, g = tid % 32 / 4, q = tid % 4;
    const int64_t I = a->intermediate;
    const int32_t cols = static_cast<int32_t>(I - int64_t{c.n_tile} * kHalfCols);
    __nv_bfloat16* dst[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = wg * 64 + warp * 16 + g + 8 * half;
      dst[half] = row < c.rows ? a->gate_up_out + (int64_t{c.m_tile} * kTileRows + row) * 2 * I +
                                     int64_t{c.n_tile} * kHalfCols
                               : nullptr;
    }
#pragma unroll
    for (int part = 0; part < 2; ++part) {  // gate into [0, I), up into [I, 2I)
#pragma unroll
      for (int i = 0; i < kHalfCols / 32; ++i) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          uint32_t pairs[4];
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const float* v = acc + part * kUp + 4 * (4 * i + r) + 2 * half;
            pairs[r] = gemm::bf16_pair(v[0], v[1]);
          }
          const uint4 block = gemm::quad_gather_block(pairs, q);
          const int col = 8 * (4 * i + q);
          if (dst[half] && col < cols)
            *reinterpret_cast<uint4*>(dst[half] + part * I + col) = block;
        }
      }
    }
  }
};

// Down tiles: push combine in the epilogue, straight from the accumulators into the owners'
// (token, k) combine slots (local HBM or a peer over NVLink; no atomics: every slot has one
// writer), skipping padding rows and columns past H, 16 bytes per lane (quad_gather_block).
// The rows' destinations are read from the pull table before the
// mainloop (prepare), so the epilogue starts without a dependent load. The tile's counter only
// says its h rows were read (the MMAs are done), so the warpgroup signals before its stores:
// the signal's release then has no stores of this tile to wait for (over NVLink, microseconds
// in which warp 0 would hold back the warpgroup's next MMAs).
struct PushCombineSink {
  static constexpr bool kDirect = true;
  const MegakernelArgs* a;
  uint32_t* counter = nullptr;
  char* dst[2] = {nullptr, nullptr};  // the thread's rows in their combine slots at this n tile
  int32_t cols = 0;                   // columns of this n tile inside H
  int32_t q = 0;
  uint32_t pairs[2][4];  // bf16 pairs of blocks j = 4i .. 4i+3, per row half
  __device__ __forceinline__ void prepare(const gemm::TileCoord& c, int wg, int tid) {
    const int warp = tid / 32, g = tid % 32 / 4;
    q = tid % 4;
    cols = a->hidden - c.n_tile * kTileCols;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = wg * 64 + warp * 16 + g + 8 * half;
      dst[half] = nullptr;
      if (row < c.rows) {
        const sched::PullRow r = a->table[int64_t{c.m_tile} * kTileRows + row];
        dst[half] = a->peers.base[r.src_rank] + a->combine_offset +
                    (int64_t{r.src_slot} * a->hidden + int64_t{c.n_tile} * kTileCols) * 2;
      }
    }
  }
  // Called for j = 0 .. 31 in order (unrolled: every index below is a compile-time constant).
  __device__ __forceinline__ void write(int j, int half, float v0, float v1) {
    pairs[half][j % 4] = gemm::bf16_pair(v0, v1);
    if (j % 4 != 3 || half != 1) return;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 block = gemm::quad_gather_block(pairs[h], q);
      const int col = 8 * (j - 3 + q);
      if (dst[h] && col < cols) *reinterpret_cast<uint4*>(dst[h] + col * 2) = block;
    }
  }
  __device__ __forceinline__ void begin(int, int tid) {
    if (tid == 0) ptx::signal_counter(counter);
  }
  __device__ __forceinline__ void skip(int, int tid) {
    if (tid == 0) ptx::signal_counter(counter);
  }
};

// Backward dhp tiles (dhp = dy W_down): the SwiGLU and router-weight backward in the epilogue,
// straight from the accumulators. Per routed row (its table row is its ring row: the backward's
// ring does not wrap) and column i of the tile, from the forward's kept g | u and the row's
// router weight w (read from its owner's window before the mainloop): h = silu(g) u rounded as
// the forward stored it, w·h (the down weight gradient's rhs), dg = w dhp u silu'(g) and
// du = w dhp silu(g) (the dx GEMM's rows), 16 bytes per lane (quad_gather_block); and the row's
// <dhp, h> over the tile's columns into dw_partial (router_weight_grad sums the n tiles in order:
// d w is deterministic). Padding rows get zeros: the weight-gradient GEMMs sum over whole tiles.
// The counter says the tile's [dg | du] rows are written, so each warpgroup signals after all
// its threads stored (and fenced them for the dx GEMM's TMA loads).
struct DhSink {
  static constexpr bool kDirect = true;
  const MegakernelArgs* a;
  uint32_t* counter = nullptr;
  gemm::TileCoord c;                       // the current tile (skip() needs it too)
  const __nv_bfloat16* gu[2] = {nullptr, nullptr};  // the thread's rows' g here (u: + I); null: padding
  __nv_bfloat16* wh[2];   // the thread's rows of w·h at this n tile
  __nv_bfloat16* dgu[2];  // ... and of [dg | du]
  int64_t row[2];          // the thread's two ring rows
  float w[2], dot[2];
  int32_t cols = 0, q = 0, wg = 0, tid = 0;
  uint32_t wh_pairs[2][4], dg_pairs[2][4], du_pairs[2][4];

  __device__ __forceinline__ void prepare(const gemm::TileCoord& tile, int warpgroup, int thread) {
    c = tile;
    wg = warpgroup;
    tid = thread;
    const int64_t I = a->intermediate, col0 = int64_t{tile.n_tile} * kTileCols;
    q = tid % 4;
    cols = static_cast<int32_t>(I - col0);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      row[half] = int64_t{tile.a_row} + wg * 64 + tid / 32 * 16 + tid % 32 / 4 + 8 * half;
      wh[half] = a->wh_out + row[half] * I + col0;
      dgu[half] = a->ring_h + row[half] * 2 * I + col0;
      dot[half] = 0.0f;
      w[half] = 0.0f;
      gu[half] = nullptr;
      if (row[half] - tile.a_row < tile.rows) {
        gu[half] = a->gate_up_in + row[half] * 2 * I + col0;
        const sched::PullRow r = a->table[row[half]];
        w[half] = *reinterpret_cast<const float*>(a->peers.base[r.src_rank] + a->weights_offset +
                                                  int64_t{r.src_slot} * sizeof(float));
        // This lane's quarter of the row's g and u columns, into L2 while the MMAs run.
        const int64_t line = int64_t{q} * 64;  // 128 bytes of bf16
        if (line < cols) {
          ptx::prefetch_l2(gu[half] + line);
          ptx::prefetch_l2(gu[half] + I + line);
        }
      }
    }
  }
  __device__ __forceinline__ void begin(int, int) {}
  // Called for j = 0 .. 31 in order (unrolled: every index below is a compile-time constant).
  __device__ __forceinline__ void write(int j, int half, float d0, float d1) {
    const int col = 8 * j + 2 * q;
    float wh0 = 0.0f, wh1 = 0.0f, dg0 = 0.0f, dg1 = 0.0f, du0 = 0.0f, du1 = 0.0f;
    if (gu[half] && col < cols) {
      const float2 g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(gu[half] + col));
      const float2 u = __bfloat1622float2(
          *reinterpret_cast<const __nv_bfloat162*>(gu[half] + a->intermediate + col));
      auto one = [&](float gv, float uv, float dhp, float* whv, float* dgv, float* duv) {
        const float sig = 1.0f / (1.0f + __expf(-gv));
        const float silu = gv * sig;
        const float h = __bfloat162float(__float2bfloat16(silu * uv));
        dot[half] = fmaf(dhp, h, dot[half]);
        const float dh = w[half] * dhp;
        *whv = w[half] * h;
        *duv = dh * silu;
        *dgv = dh * uv * sig * (1.0f + gv * (1.0f - sig));
      };
      one(g.x, u.x, d0, &wh0, &dg0, &du0);
      one(g.y, u.y, d1, &wh1, &dg1, &du1);
    }
    wh_pairs[half][j % 4] = gemm::bf16_pair(wh0, wh1);
    dg_pairs[half][j % 4] = gemm::bf16_pair(dg0, dg1);
    du_pairs[half][j % 4] = gemm::bf16_pair(du0, du1);
    if (j % 4 != 3 || half != 1) return;
    const int block = 8 * (j - 3 + q);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 vwh = gemm::quad_gather_block(wh_pairs[h], q);
      const uint4 vdg = gemm::quad_gather_block(dg_pairs[h], q);
      const uint4 vdu = gemm::quad_gather_block(du_pairs[h], q);
      if (block < cols) {
        *reinterpret_cast<uint4*>(wh[h] + block) = vwh;
        *reinterpret_cast<uint4*>(dgu[h] + block) = vdg;
        *reinterpret_cast<uint4*>(dgu[h] + a->intermediate + block) = vdu;
      }
    }
    if (j != kTileCols / 8 - 1) return;
    // The quad's four partial sums of each row, in a fixed order.
    const int32_t n_dh = backward_dh_tiles(a->intermediate);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float v = dot[h];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      if (q == 0 && gu[h]) a->dw_partial[row[h] * n_dh + c.n_tile] = v;
    }
    finish();
  }
  // After the epilogue (every thread of the warpgroup): the tile's rows are written; signal.
  __device__ __forceinline__ void finish() {
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);  // the dx GEMM reads them by TMA
    ptx::named_barrier_sync(1 + wg, 128);
    if (tid == 0) ptx::signal_counter(counter);
  }
  // A warpgroup whose 64 rows are all padding: zeros for them (w·h and [dg | du] at this n tile).
  __device__ __forceinline__ void skip(int warpgroup, int thread) {
    wg = warpgroup;
    tid = thread;
    const int64_t I = a->intermediate, col0 = int64_t{c.n_tile} * kTileCols;
    const int32_t chunks =
        static_cast<int32_t>((I - col0 < kTileCols ? I - col0 : kTileCols) / 8);
    for (int32_t i = tid; i < 64 * 3 * chunks; i += 128) {
      const int64_t row = int64_t{c.a_row} + wg * 64 + i / (3 * chunks);
      const int32_t part = i % (3 * chunks) / chunks, col = i % chunks * 8;
      __nv_bfloat16* dst = part == 0 ? a->wh_out + row * I + col0 + col
                                     : a->ring_h + row * 2 * I + (part - 1) * I + col0 + col;
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
    finish();
  }
};

// The TMA maps of the two GEMMs. First GEMM (gate/up tasks): rows1 (128-row boxes) and
// rows1_few (16-row boxes) over ring_x; weights w1a, w1b. Second GEMM (down tasks): rows2,
// rows2_few over ring_h; weights w2a, w2b.
//   Forward: w1a, w1b = W_gate, W_up [E, I, H] (128-row boxes: a tile is 128 gate + 128 up
//   rows); h_out = ring h as the SwiGLU output (64 x 64 boxes); w2a = w2b = W_down [E, H, I]
//   (256-row boxes).
//   Backward: w1a = w1b = W_down read N-major ([E, H, I] as k = H, n = I); w2a, w2b = W_gate,
//   W_up read N-major (k = I each: the dx GEMM's K is [dg | du]); h_out unused.
struct Maps {
  CUtensorMap rows1, rows1_few, w1a, w1b, h_out, rows2, rows2_few, w2a, w2b;
};

template <Pass P>
__device__ __forceinline__ TaskShape task_shape(const MegakernelArgs& a) {
  TaskShape s;
  s.m_tiles = static_cast<int32_t>(a.seg_offset[a.experts] / kTileRows);
  s.ring_tiles = a.ring_tiles;
  s.minibatch_tiles = a.minibatch_tiles;
  // Output columns of a first-GEMM tile: 128 of h (256 accumulator columns: gate and up), or
  // 256 of dhp.
  constexpr int kCols1 = P == Pass::kForward ? gemm::kOutCols<Epilogue::kSwiGLU>
                                             : gemm::kOutCols<Epilogue::kStore>;
  s.n_gate_up = (a.intermediate + kCols1 - 1) / kCols1;
  s.n_down = (a.hidden + gemm::kOutCols<Epilogue::kStore> - 1) / gemm::kOutCols<Epilogue::kStore>;
  s.head_tiles = mega::head_tiles_of(s.m_tiles, s.minibatch_tiles);
  s.down_n_fastest =
      P == Pass::kBackward && mega::down_n_fastest_suits(s.m_tiles, a.experts);
  return s;
}

// The GEMM tile of a compute task: its expert, its routed rows (a prefix of the tile: segments
// are padded at their end) and its rows in the ring.
__device__ __forceinline__ gemm::TileCoord tile_of(const MegakernelArgs& a, const TaskShape& s,
                                   const Task& t) {
  gemm::TileCoord c;
  c.m_tile = t.m_tile;
  c.n_tile = t.n_tile;
  const int64_t first_row = int64_t{t.m_tile} * kTileRows;
  c.expert = sched::expert_of_row(a.seg_offset, a.experts, first_row);
  const int64_t left = a.seg_offset[c.expert] + a.expert_rows[c.expert] - first_row;
  c.rows = static_cast<int32_t>(left < kTileRows ? left : kTileRows);
  c.a_row = mega::ring_slot_of_tile(s, t.m_tile) * kTileRows;
  return c;
}

__device__ __forceinline__ uint32_t* counter_of(const MegakernelArgs& a, int32_t slot, mega::Counter c) {
  return a.counters + slot * mega::kCounters + static_cast<int>(c);
}

// The counters region: kCounters per ring slot, the compute task claim counter, the timeout
// election, the head dispatch claim counter, then (8-byte aligned) kProgressWords per CTA.
constexpr int kClaimWords = 3;
__device__ __forceinline__ uint32_t* claim_counter(const MegakernelArgs& a) {
  return a.counters + mega::kCounters * a.ring_tiles;
}
__device__ __forceinline__ uint32_t* timeout_election(const MegakernelArgs& a) {
  return claim_counter(a) + 1;
}
__device__ __forceinline__ uint32_t* head_claim_counter(const MegakernelArgs& a) {
  return claim_counter(a) + 2;
}
__device__ __forceinline__ volatile uint64_t* progress_of(const MegakernelArgs& a,
                                                          int cta) {
  const int32_t words = (mega::kCounters * a.ring_tiles + kClaimWords + 1) / 2;
  return reinterpret_cast<volatile uint64_t*>(a.counters) + words + cta * kProgressWords;
}
__device__ __forceinline__ void record_progress(const MegakernelArgs& a, int word,
                                                int64_t task) {
  progress_of(a, blockIdx.x)[word] = static_cast<uint64_t>(task + 1);
}

// Blocks (one thread) until the task's slot is ready; on timeout records who waited for what
// (MegakernelDiagnostic) and traps.
template <Pass P>
__device__ __forceinline__ void wait_for_task(const MegakernelArgs& a, const TaskShape& s,
                                              const Task& t, bool compute) {
  mega::WaitTarget w[2];
  const int n = mega::wait_targets(s, t, w);
  const int32_t slot = mega::ring_slot_of_tile(s, t.m_tile);
  for (int i = 0; i < n; ++i) {
    uint32_t seen = 0;
    if (!ptx::wait_counter_at_least(counter_of(a, slot, w[i].counter), w[i].at_least,
                                    a.timeout_ns, &seen)) {
      // NOTES: the first waiter to give up is elected in device memory (an atomic on the
      // host-mapped record would need PCIe atomics, which a host may lack); `set` goes last.
      if (atomicCAS(timeout_election(a), 0u, 1u) == 0u) {
        volatile MegakernelDiagnostic* v = a.diagnostic;
        v->backward = P == Pass::kBackward;
        v->rank = a.rank;
        v->cta = blockIdx.x;
        v->compute = compute;
        v->task_kind = static_cast<int32_t>(t.kind);
        v->m_tile = t.m_tile;
        v->n_tile = t.n_tile;
        v->counter = static_cast<int32_t>(w[i].counter);
        v->slot = slot;
        v->m_tiles = s.m_tiles;
        v->ring_tiles = s.ring_tiles;
        v->want = w[i].at_least;
        v->have = seen;
        v->seconds = a.timeout_ns * 1e-9;
        v->minibatch_tiles = s.minibatch_tiles;
        v->n_gate_up = s.n_gate_up;
        v->n_down = s.n_down;
        v->down_n_fastest = s.down_n_fastest;
        v->comm_ctas = a.comm_ctas;
        v->ctas = gridDim.x < kMaxDiagnosedCtas ? gridDim.x : kMaxDiagnosedCtas;
        for (int c = 0; c < v->ctas; ++c)
          for (int w = 0; w < kProgressWords; ++w) v->progress[c][w] = progress_of(a, c)[w];
        __threadfence_system();
        v->set = 1;
        __threadfence_system();
        __trap();
      }
      // NOTES: another waiter is writing the record: trapping now would end the kernel before
      // its last write (waiters on one stuck counter give up within nanoseconds of each other,
      // and the record was lost that way). Its trap ends this thread too.
      for (;;) __nanosleep(1 << 20);
    }
  }
}

// Records task i of this CTA's n-th traced task (one thread per CTA calls it).
__device__ __forceinline__ void trace_task(const MegakernelArgs& a, int32_t n, int64_t i,
                                           const Task& t, uint64_t taken, uint64_t ready) {
  if (!a.trace || n >= kTraceRecordsPerCta) return;
  MegakernelTraceRecord& r = a.trace[int64_t{blockIdx.x} * kTraceRecordsPerCta + n];
  r.task = static_cast<int32_t>(i);
  r.cta = static_cast<int16_t>(blockIdx.x);
  r.kind = static_cast<int16_t>(t.kind);
  r.taken_ns = taken;
  r.ready_ns = ready;
  r.done_ns = ptx::global_timer_ns();
}

// One dispatching warp's share of the CTA's row buffers (lane 0 issues its copies). A row's
// bytes are H * 2 (multiple of 128: H is a multiple of 64).
struct RowPipe {
  uint8_t* buf;      // slots x row_bytes of shared memory
  uint64_t* full;    // per slot, one arrival + the row's bytes
  uint32_t slots;    // >= 2
  uint32_t row_bytes;
  uint32_t seq = 0;  // rows through the pipe so far: row q uses slot q % slots, phase q / slots
  int32_t warp;      // this warp, and how many warps of the CTA dispatch
  int32_t warps;
};

// x rows (H bf16 each) that fit the GEMM's stage and staging memory.
__device__ __forceinline__ int32_t row_buffers(const MegakernelArgs& a) {
  return static_cast<int32_t>(offsetof(decltype(MegaSmem::gemm), full) /
                              (static_cast<size_t>(a.hidden) * 2));
}

// The dispatching warps of a CTA: kPullWarps when each gets two row buffers or more, else as
// many as do (one at worst: Limits::kMaxHidden leaves room for three rows).
__device__ __forceinline__ int32_t pull_warps(const MegakernelArgs& a) {
  const int32_t fit = row_buffers(a);
  return fit / 2 < kPullWarps ? fit / 2 : kPullWarps;
}

__device__ __forceinline__ RowPipe make_row_pipe(const MegakernelArgs& a, MegaSmem& smem,
                                                 int32_t warp) {
  RowPipe p;
  p.warp = warp;
  p.warps = pull_warps(a);
  p.row_bytes = static_cast<uint32_t>(a.hidden) * 2;
  const uint32_t per_warp = static_cast<uint32_t>(row_buffers(a) / p.warps);
  p.slots = per_warp < kMaxPullRows / kPullWarps ? per_warp : kMaxPullRows / kPullWarps;
  p.buf = reinterpret_cast<uint8_t*>(&smem.gemm) + size_t{p.slots} * warp * p.row_bytes;
  p.full = smem.pull_full + p.slots * warp;
  return p;
}

// Named barrier of a CTA's dispatching warps (the GEMM's warpgroups use ids 1 and 2, later).
__device__ __forceinline__ void pull_warps_sync(const RowPipe& pipe) {
  ptx::named_barrier_sync(3, 32 * pipe.warps);
}

// What one pull copies: rows [begin, end) of a row tile, from the window region at src_offset
// ([T, H] per rank: x or dy) into the tile's rows at dst; rows [zero_from, kTileRows) of the tile
// are written as zeros (the backward's weight gradients sum over padding rows: kTileRows, none);
// signal: the slot's counter says the rows are in (a pull the GEMMs do not wait for: none).
struct PullJob {
  size_t src_offset;
  uint8_t* dst;
  int32_t begin, end, zero_from;
  bool signal;
};

// The pull of dispatch task t: the tile's rows (or a head part's share) into its ring slot.
// Backward: the part that starts at row 0 (or the whole tile) also zeroes the padding rows.
template <Pass P>
__device__ __forceinline__ PullJob dispatch_job(const MegakernelArgs& a, const TaskShape& s,
                                                const Task& t) {
  const int32_t rows = tile_of(a, s, t).rows;
  PullJob job;
  job.src_offset = a.x_offset;
  job.dst = reinterpret_cast<uint8_t*>(a.ring_x) +
            int64_t{mega::ring_slot_of_tile(s, t.m_tile)} * kTileRows * a.hidden * 2;
  mega::dispatch_rows(s, t, rows, &job.begin, &job.end);
  job.zero_from = P == Pass::kBackward && job.begin == 0 ? rows : kTileRows;
  job.signal = true;
  return job;
}

// The backward's x pull of row tile m (for the weight gradients, after the GEMMs' own pulls).
__device__ __forceinline__ PullJob x_job(const MegakernelArgs& a, const TaskShape& s, int32_t m) {
  const int32_t rows = tile_of(a, s, Task{TaskKind::kDispatch, m, 0}).rows;
  return PullJob{a.x_pull_offset,
                 reinterpret_cast<uint8_t*>(a.x_out) + int64_t{m} * kTileRows * a.hidden * 2, 0,
                 rows, rows, false};
}

// Pull job of task t (every dispatching warp, converged): copies its rows, waits until they
// have landed and signals the slot's x_ready; thread 0 traces it as record n.
// NOTES: row j goes to warp j % warps, which copies its rows in order through its own buffers,
// refilling the buffer of its row j - 1 with row j - 1 + slots once row j's store is issued and
// row j - 1's store has read it. Several warps, because one copy chain is latency-bound (in
// epflow-row-copy-probe on 2xH200 one chain moved a row every ~0.3 us whether it held 4 or 14 KB;
// four chains moved 4 KB rows 3x faster). The lanes read the table 32 entries at a time, so the
// chain has no dependent global load per row.
__device__ __forceinline__ void pull_rows(const MegakernelArgs& a, const TaskShape& s,
                                          const Task& t, const PullJob& job, int64_t i, int32_t n,
                                          uint64_t taken, uint64_t ready, RowPipe& pipe) {
  const int lane = threadIdx.x % 32;
  // This warp's rows of the task: k = 0 .. mine-1 is the task's row begin + warp + k * warps.
  const int32_t first = job.begin + pipe.warp;
  const int32_t mine = job.end > first ? (job.end - first + pipe.warps - 1) / pipe.warps : 0;
  const sched::PullRow* table = a.table + int64_t{t.m_tile} * kTileRows;
  // Lane l holds the source of this warp's row window + l (loads come in increasing k).
  int32_t window = -32;
  uint64_t src = 0;
  auto load = [&](int32_t k) {  // every lane (the shuffle); lane 0 issues
    if (k >= window + 32) {
      window = k;
      const int32_t kk = k + lane;
      if (kk < mine) {
        const sched::PullRow r = table[first + kk * pipe.warps];
        src = reinterpret_cast<uint64_t>(a.peers.base[r.src_rank] + job.src_offset) +
              uint64_t{static_cast<uint32_t>(r.src_slot / a.top_k)} * pipe.row_bytes;
      }
    }
    const uint64_t from = __shfl_sync(0xffffffffu, src, k - window);
    if (lane != 0) return;
    const uint32_t b = (pipe.seq + k) % pipe.slots;
    ptx::mbarrier_arrive_expect_tx(&pipe.full[b], pipe.row_bytes);
    ptx::bulk_load(pipe.buf + b * pipe.row_bytes, reinterpret_cast<const void*>(from),
                   pipe.row_bytes, &pipe.full[b]);
  };
  const int32_t slots = static_cast<int32_t>(pipe.slots);
  // The previous round's gate/up tiles read this slot through TMA (the async proxy), as ours.
  if (lane == 0) cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
  for (int32_t k = 0; k < mine && k < slots; ++k) load(k);
  for (int32_t k = 0; k < mine; ++k) {
    const bool refill = k >= 1 && k - 1 + slots < mine;
    if (lane == 0) {
      const uint32_t q = pipe.seq + k;
      ptx::mbarrier_wait(&pipe.full[q % pipe.slots], (q / pipe.slots) & 1);
      ptx::bulk_store(job.dst + int64_t{first + k * pipe.warps} * pipe.row_bytes,
                      pipe.buf + q % pipe.slots * pipe.row_bytes, pipe.row_bytes);
      ptx::tma_store_commit();
      if (refill) ptx::bulk_wait_read<1>();
    }
    __syncwarp();
    if (refill) load(k - 1 + slots);
  }
  pipe.seq += static_cast<uint32_t>(mine);
  if (job.zero_from < kTileRows) {
    const int32_t chunks = static_cast<int32_t>(pipe.row_bytes / 16);
    for (int32_t r = job.zero_from + pipe.warp; r < kTileRows; r += pipe.warps)
      for (int32_t c = lane; c < chunks; c += 32)
        reinterpret_cast<uint4*>(job.dst + int64_t{r} * pipe.row_bytes)[c] = make_uint4(0, 0, 0, 0);
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);  // read by TMA, like the pulled rows
  }
  if (lane == 0) {
    // The gate/up GEMM reads the dispatched rows with TMA loads once the counter says so.
    ptx::tma_store_wait_all();
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
  }
  __threadfence();
  pull_warps_sync(pipe);
  if (threadIdx.x == 0) {
    if (job.signal)
      ptx::signal_counter(counter_of(a, mega::ring_slot_of_tile(s, t.m_tile),
                                     mega::signalled_counter(t.kind)));
    trace_task(a, n, i, t, taken, ready);
  }
}

// Every CTA, before its role (the dispatching warps): claims the head tiles' dispatch parts one
// at a time until none is left (they wait for nothing). Returns how many it ran (its trace
// records so far).
template <Pass P>
__device__ __forceinline__ int32_t dispatch_head(const MegakernelArgs& a,
                                                 const TaskShape& s, RowPipe& pipe,
                                                 volatile int64_t& claimed) {
  const int64_t tasks = mega::num_head_tasks(s);
  int32_t n = 0;
  for (;; ++n) {
    if (threadIdx.x == 0) claimed = atomicAdd(head_claim_counter(a), 1u);
    pull_warps_sync(pipe);
    const int64_t i = claimed;
    if (i >= tasks) break;
    const uint64_t now = a.trace ? ptx::global_timer_ns() : 0;
    // Its closing barrier also orders this read of `claimed` before the next claim.
    const Task t = mega::head_task(s, i);
    pull_rows(a, s, t, dispatch_job<P>(a, s, t), i, n, now, now, pipe);
  }
  return n;
}

// Communication partition after the head (the dispatching warps): the comm list's whole tiles,
// round-robin; in the backward, then the x rows of every tile (they wait for nothing and nothing
// in the kernel waits for them: the weight gradients after it read them). Returns the CTA's
// trace records so far.
template <Pass P>
__device__ __forceinline__ int32_t comm_role(const MegakernelArgs& a, const TaskShape& s,
                                             int32_t traced, RowPipe& pipe) {
  const int64_t tasks = mega::num_comm_tasks(s);
  const int64_t x_tasks = P == Pass::kBackward ? s.m_tiles : 0;
  uint64_t taken = 0, ready = 0;
  for (int64_t i = blockIdx.x; i < tasks + x_tasks; i += a.comm_ctas) {
    if (i >= tasks) {
      const int32_t m = static_cast<int32_t>(i - tasks);
      if (a.trace) taken = ready = ptx::global_timer_ns();
      pull_rows(a, s, Task{TaskKind::kDispatch, m, 0}, x_job(a, s, m), i, traced++, taken, ready,
                pipe);
      continue;
    }
    const Task t = mega::comm_task(s, i);
    if (threadIdx.x == 0) {
      if (a.trace) taken = ptx::global_timer_ns();
      wait_for_task<P>(a, s, t, false);
      if (a.trace) ready = ptx::global_timer_ns();
    }
    pull_warps_sync(pipe);
    pull_rows(a, s, t, dispatch_job<P>(a, s, t), i, traced++, taken, ready, pipe);
  }
  return traced;
}

// Compute partition: the GEMM CTA of grouped_gemm.cuh (producer warpgroup + two consumer
// warpgroups); two threads of the producer warpgroup store the consumers' gate/up output tiles
// and signal them, a third one schedules. NOTES: compute tasks are claimed in list order from one
// counter (dynamic, not round-robin), so tasks next to each other in the list (the row tiles
// sharing a weight tile) start together on different SMs and share that weight tile through L2;
// with a static split, CTAs drift apart (gate/up and down tiles differ 3.5x in length, waits
// differ) and each re-reads weights from HBM. The scheduler thread claims the next task, finds
// its tile and passes its waits while the producer still loads the current tile (claim, the
// expert lookup and the counter reads are ~2.5 us of dependent global accesses per task, which
// the 4-stage lookahead did not hide). It claims only once the producer took the previous task,
// so a CTA holds at most one task beyond the one it runs; tasks of a CTA are still taken in
// list order, which keeps the no-deadlock argument.
template <Pass P>
__device__ __forceinline__ void compute_role(const Maps& m, const MegakernelArgs& a,
                                             const TaskShape& s, MegaSmem& smem, int32_t traced) {
  const int wg = threadIdx.x / 128;
  const int64_t tasks = mega::num_compute_tasks(s);
  constexpr bool kBackward = P == Pass::kBackward;
  // K of the two GEMMs: H, then I (forward: h) or 2I (backward: [dg | du], W_gate's K first).
  const int32_t k_gate_up = a.hidden / gemm::kBlockK;
  const int32_t k_down = (kBackward ? 2 : 1) * a.intermediate / gemm::kBlockK;
  volatile gemm::StageTag* stage_tag = smem.stage_tag;
  const gemm::StageTags tags{smem.stage_tag, smem.tag_read};
  gemm::PipelineState<kStages> ps;
  if (wg == 0) {
    ptx::warpgroup_reg_dealloc<40>();
    if (threadIdx.x == 96) {
      uint32_t* next_task = claim_counter(a);
      for (uint32_t n = 0;; ++n) {
        ptx::mbarrier_wait(&smem.next_empty, (n & 1) ^ 1);
        const int64_t i = atomicAdd(next_task, 1u);
        const uint64_t taken = a.trace ? ptx::global_timer_ns() : 0;
        if (i < tasks) {
          const Task t = mega::compute_task(s, i);
          smem.next_tile = tile_of(a, s, t);
          wait_for_task<P>(a, s, t, true);
        }
        smem.next_task = i < tasks ? i : -1;
        smem.next_taken = taken;
        smem.next_ready = a.trace ? ptx::global_timer_ns() : 0;
        ptx::mbarrier_arrive(&smem.next_full);  // release: the fields above, and the waits
        if (i >= tasks) break;
      }
    } else if (threadIdx.x == 0) {
      for (uint32_t n = 0;; ++n) {
        ptx::mbarrier_wait(&smem.next_full, n & 1);
        const int64_t i = smem.next_task;
        const gemm::TileCoord c = smem.next_tile;
        const uint64_t taken = smem.next_taken, ready = smem.next_ready;
        ptx::mbarrier_arrive(&smem.next_empty);
        if (i < 0) break;
        cuda::ptx::fence_proxy_async(cuda::ptx::space_global);  // TMA reads what was waited for
        const Task t = mega::compute_task(s, i);
        if constexpr (kBackward) {
          constexpr auto kN = gemm::WeightMajor::kN;
          if (t.kind == TaskKind::kGateUp)
            gemm::produce_tile<Epilogue::kStore, kStages, kStaging, kN>(
                smem.gemm, ps, c, k_gate_up, &m.rows1, &m.rows1_few, &m.w1a, &m.w1b,
                tags, i);
          else
            gemm::produce_tile<Epilogue::kStore, kStages, kStaging, kN>(
                smem.gemm, ps, c, k_down, &m.rows2, &m.rows2_few, &m.w2a, &m.w2b,
                tags, i, a.intermediate / gemm::kBlockK);
        } else if (t.kind == TaskKind::kGateUp) {
          gemm::produce_tile<Epilogue::kSwiGLU>(smem.gemm, ps, c, k_gate_up, &m.rows1,
                                                &m.rows1_few, &m.w1a, &m.w1b, tags, i);
        } else {
          gemm::produce_tile<Epilogue::kStore>(smem.gemm, ps, c, k_down, &m.rows2, &m.rows2_few,
                                               &m.w2a, &m.w2b, tags, i);
        }
        record_progress(a, kProducerLoaded, i);
        trace_task(a, traced + static_cast<int32_t>(n), i, t, taken, ready);
      }
      // The next stage tells the consumers there is nothing more (no data: a plain arrival).
      ptx::mbarrier_wait(&smem.gemm.empty[ps.stage], ps.phase ^ 1);
      gemm::wait_tag_read(tags, ps);
      stage_tag[ps.stage].task = -1;
      ptx::mbarrier_arrive(&smem.gemm.full[ps.stage]);
    } else if (threadIdx.x == 32 || threadIdx.x == 64) {
      const int w = threadIdx.x / 32 - 1;  // the consumer warpgroup this thread stores for
      volatile gemm::StageTag* staged = smem.staged;
      for (uint32_t uses = 0;; ++uses) {
        ptx::mbarrier_wait(&smem.staging_full[w], uses & 1);
        const int64_t i = staged[w].task;
        if (i < 0) break;
        const Task t = mega::compute_task(s, i);
        // The consumers' tile (the scheduler looked it up once): no global loads before the stores.
        const volatile gemm::TileCoord& tag = staged[w].tile;
        const gemm::TileCoord c{tag.m_tile, tag.n_tile, tag.expert, tag.rows, tag.a_row};
        gemm::store_staging<Epilogue::kSwiGLU>(&m.h_out, smem.gemm.out[w], c, w);  // forward only
        ptx::tma_store_wait_read();
        ptx::mbarrier_arrive(&smem.staging_empty[w]);
        ptx::tma_store_wait_all();
        cuda::ptx::fence_proxy_async(cuda::ptx::space_global);
        ptx::signal_counter(counter_of(a, mega::ring_slot_of_tile(s, t.m_tile),
                                       mega::signalled_counter(t.kind)));
        record_progress(a, kStoreSignalled + w, i);
      }
    }
  } else {
    ptx::warpgroup_reg_alloc<232>();
    const int tid = threadIdx.x % 128;
    RingSink ring{&smem, &a};
    PushCombineSink push{&a};
    DhSink dh{&a};
    for (;;) {
      ptx::mbarrier_wait(&smem.gemm.full[ps.stage], ps.phase);  // the tile's first stage
      const int64_t i = stage_tag[ps.stage].task;
      const volatile gemm::TileCoord& tag = stage_tag[ps.stage].tile;
      const gemm::TileCoord c{tag.m_tile, tag.n_tile, tag.expert, tag.rows, tag.a_row};
      ptx::mbarrier_arrive(&smem.tag_read[ps.stage]);
      if (i < 0) break;
      const Task t = mega::compute_task(s, i);
      uint32_t* counter =
          counter_of(a, mega::ring_slot_of_tile(s, t.m_tile), mega::signalled_counter(t.kind));
      if (tid == 0) record_progress(a, kConsumerTaken + wg - 1, i);
      if constexpr (kBackward) {
        constexpr auto kN = gemm::WeightMajor::kN;
        if (t.kind == TaskKind::kGateUp) {
          dh.counter = counter;
          dh.c = c;
          gemm::consume_tile<Epilogue::kStore, kStages, kStaging, DhSink, kN>(
              smem.gemm, ps, c, k_gate_up, wg - 1, dh);
        } else {
          push.counter = counter;
          gemm::consume_tile<Epilogue::kStore, kStages, kStaging, PushCombineSink, kN>(
              smem.gemm, ps, c, k_down, wg - 1, push);
        }
      } else if (t.kind == TaskKind::kGateUp) {
        ring.counter = counter;
        ring.task = i;
        gemm::consume_tile<Epilogue::kSwiGLU>(smem.gemm, ps, c, k_gate_up, wg - 1, ring);
      } else {
        push.counter = counter;
        gemm::consume_tile<Epilogue::kStore>(smem.gemm, ps, c, k_down, wg - 1, push);
      }
      if (tid == 0) record_progress(a, kConsumerDone + wg - 1, i);
    }
    // Stop this warpgroup's store thread (through its staging handshake, phases kept).
    ring.acquire(wg - 1, tid);
    if (tid == 0) {
      smem.staged[wg - 1].task = -1;
      ptx::mbarrier_arrive(&smem.staging_full[wg - 1]);
    }
  }
}

template <Pass P>
__global__ void __launch_bounds__(gemm::kThreads, 1)
    moe_megakernel(const __grid_constant__ Maps maps, const __grid_constant__ MegakernelArgs a) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  auto& smem = *reinterpret_cast<MegaSmem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) /
                                            1024 * 1024);
  const TaskShape s = task_shape<P>(a);
  // The first pull_warps warps dispatch (the head, then a communication CTA's tiles); the CTA's
  // other warps wait for them: dispatch uses the stage memory. NOTES: a communication CTA whose
  // comm list is done joins the compute partition (its SM would idle for the rest of the call:
  // the last macrobatch, or most of a call whose routed rows fit the ring). It claims compute
  // tasks from the same counter, in list order, and owes no dispatch any more, so the
  // no-deadlock argument is unchanged (docs/ARCHITECTURE.md).
  int32_t traced = 0;
  const int32_t warp = threadIdx.x / 32;
  if (warp < pull_warps(a)) {
    RowPipe pipe = make_row_pipe(a, smem, warp);
    if (threadIdx.x % 32 == 0)
      for (uint32_t b = 0; b < pipe.slots; ++b) ptx::mbarrier_init(&pipe.full[b], 1);
    ptx::mbarrier_init_fence();
    traced = dispatch_head<P>(a, s, pipe, smem.head_claimed);
    if (blockIdx.x < a.comm_ctas) traced = comm_role<P>(a, s, traced, pipe);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      ptx::mbarrier_init(&smem.gemm.full[i], 1);
      ptx::mbarrier_init(&smem.gemm.empty[i], 2);  // one arrival per consumer warpgroup
    }
    for (int w = 0; w < 2; ++w) {
      ptx::mbarrier_init(&smem.staging_full[w], 1);
      ptx::mbarrier_init(&smem.staging_empty[w], 1);
    }
    for (int i = 0; i < kStages; ++i) ptx::mbarrier_init(&smem.tag_read[i], gemm::kTagReaders);
    ptx::mbarrier_init(&smem.next_full, 1);
    ptx::mbarrier_init(&smem.next_empty, 1);
    ptx::mbarrier_init_fence();
    for (const CUtensorMap* map : {&maps.rows1, &maps.rows1_few, &maps.w1a, &maps.w1b,
                                   &maps.rows2, &maps.rows2_few, &maps.w2a, &maps.w2b})
      ptx::prefetch_tensor_map(map);
    if constexpr (P == Pass::kForward) ptx::prefetch_tensor_map(&maps.h_out);
  }
  __syncthreads();
  compute_role<P>(maps, a, s, smem, traced);
}

constexpr size_t kSmemBytes = sizeof(MegaSmem) + 1024;  // + alignment slack
static_assert(kSmemBytes <= 227 * 1024, "beyond the opt-in shared memory of an SM90 CTA");

}  // namespace

namespace {

// The backward pass's words for the shared task kinds and counters.
const char* task_name(bool backward, mega::TaskKind k) {
  if (!backward) return mega::task_name(k);
  switch (k) {
    case TaskKind::kDispatch: return "dy pull";
    case TaskKind::kGateUp: return "dhp GEMM + SwiGLU backward";
    default: return "dx GEMM + push";
  }
}
const char* counter_name(bool backward, mega::Counter c) {
  if (!backward) return mega::counter_name(c);
  switch (c) {
    case mega::Counter::kXReady: return "x_ready (pulled dy rows)";
    case mega::Counter::kHDone: return "h_done (dhp warpgroups finished [dg | du])";
    default: return "y_done (dx warpgroups finished)";
  }
}

}  // namespace

std::string describe(const MegakernelDiagnostic& d) {
  if (!d.set) return "";
  const auto kind = static_cast<mega::TaskKind>(d.task_kind);
  const bool bw = d.backward != 0;
  char msg[512];
  std::snprintf(msg, sizeof msg,
                "rank %d %s megakernel, CTA %d (%s partition) timed out after %.3f s: %s of "
                "row tile %d (n tile %d) waited for %s of ring slot %d to reach %u, it was %u "
                "(%d row tiles, ring of %d)",
                d.rank, bw ? "backward" : "forward", d.cta,
                d.compute ? "compute" : "communication", d.seconds, task_name(bw, kind),
                d.m_tile, d.n_tile, counter_name(bw, static_cast<mega::Counter>(d.counter)),
                d.slot, d.want, d.have, d.m_tiles, d.ring_tiles);
  std::string out = msg;
  // Which CTAs were inside a compute task when the wait gave up (the work it waited for; a
  // communication CTA joins the compute tasks once its dispatch is done).
  mega::TaskShape shape;
  shape.m_tiles = d.m_tiles;
  shape.ring_tiles = d.ring_tiles > 0 ? d.ring_tiles : 1;
  shape.minibatch_tiles = d.minibatch_tiles > 0 ? d.minibatch_tiles : 1;
  shape.n_gate_up = d.n_gate_up > 0 ? d.n_gate_up : 1;
  shape.n_down = d.n_down > 0 ? d.n_down : 1;
  shape.down_n_fastest = d.down_n_fastest != 0;
  const int64_t tasks = mega::num_compute_tasks(shape);
  auto task_text = [&](uint64_t word) -> std::string {
    if (word == 0) return "none";
    const int64_t i = static_cast<int64_t>(word) - 1;
    if (i >= tasks) return std::to_string(i) + " (out of range)";
    const mega::Task t = mega::compute_task(shape, i);
    const char* kinds[2][2] = {{"down", "gate/up"}, {"dx", "dhp"}};
    return std::to_string(i) + " (" + kinds[bw][t.kind == mega::TaskKind::kGateUp] +
           " m " + std::to_string(t.m_tile) + " n " + std::to_string(t.n_tile) + ")";
  };
  int listed = 0, inside = 0;
  for (int c = 0; c < d.ctas && c < kMaxDiagnosedCtas; ++c) {
    const uint64_t* p = d.progress[c];
    bool busy = false;
    for (int w = 0; w < 2; ++w) busy |= p[kConsumerTaken + w] != p[kConsumerDone + w];
    if (!busy) continue;
    ++inside;
    if (listed++ >= 8) continue;
    out += "; CTA " + std::to_string(c) + ": loads issued to task " +
           task_text(p[kProducerLoaded]);
    for (int w = 0; w < 2; ++w)
      out += ", warpgroup " + std::to_string(w) + " in " + task_text(p[kConsumerTaken + w]) +
             " after " + task_text(p[kConsumerDone + w]) + ", its stores signalled " +
             task_text(p[kStoreSignalled + w]);
  }
  out += inside ? "; " + std::to_string(inside) + " CTAs were inside a compute task"
                : "; no CTA was inside a compute task";
  return out;
}

size_t megakernel_counter_bytes(int32_t ring_tiles, int32_t sm_count) {
  // The slots' counters, the compute partition's task claim counter, the timeout election, the
  // head dispatch claim counter (rounded up to 8 bytes), then the CTAs' progress words.
  const size_t words32 =
      (mega::kCounters * static_cast<size_t>(ring_tiles) + kClaimWords + 1) / 2 * 2;
  return sizeof(uint32_t) * words32 + sizeof(uint64_t) * kProgressWords * sm_count;
}

namespace {

template <Pass P>
cudaError_t launch(const MegakernelArgs& a, int32_t sm_count, cudaStream_t stream) {
  constexpr bool kBackward = P == Pass::kBackward;
  if (a.hidden % 64 != 0 || a.intermediate % 64 != 0 || a.ring_tiles <= 0 ||
      a.minibatch_tiles <= 0 || a.ring_tiles % a.minibatch_tiles != 0 || a.comm_ctas < 1 ||
      a.comm_ctas >= sm_count)
    return cudaErrorInvalidValue;
  if (kBackward && (!a.gate_up_in || !a.wh_out || !a.dw_partial || !a.x_out || a.gate_up_out))
    return cudaErrorInvalidValue;
  Maps m;
  const int64_t ring_rows = int64_t{a.ring_tiles} * kTileRows;
  const int64_t E = a.experts, H = a.hidden, I = a.intermediate;
  bool ok = gemm::encode_row_operand_maps(a.ring_x, H, ring_rows, &m.rows1, &m.rows1_few) &&
            gemm::encode_row_operand_maps(a.ring_h, (kBackward ? 2 : 1) * I, ring_rows, &m.rows2,
                                          &m.rows2_few);
  if constexpr (kBackward) {
    m.h_out = {};
    ok = ok && gemm::encode_weight_map_n_major(a.w_down, E, H, I, &m.w1a) &&
         gemm::encode_weight_map_n_major(a.w_gate, E, I, H, &m.w2a) &&
         gemm::encode_weight_map_n_major(a.w_up, E, I, H, &m.w2b);
    m.w1b = m.w1a;
  } else {
    constexpr uint32_t kHalf = kTileCols / 2;
    ok = ok && gemm::encode_weight_map(a.w_gate, E, I, H, kHalf, &m.w1a) &&
         gemm::encode_weight_map(a.w_up, E, I, H, kHalf, &m.w1b) &&
         gemm::encode_output_map(a.ring_h, I, ring_rows, &m.h_out) &&
         gemm::encode_weight_map(a.w_down, E, H, I, kTileCols, &m.w2a);
    m.w2b = m.w2a;
  }
  if (!ok) return cudaErrorInvalidValue;
  auto* kernel = moe_megakernel<P>;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(kSmemBytes));
      e != cudaSuccess)
    return e;
  // NOTES: cooperative, so the launch fails instead of leaving CTAs that others wait for
  // unscheduled (the two partitions wait on each other).
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(sm_count);
  config.blockDim = dim3(gemm::kThreads);
  config.dynamicSmemBytes = kSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, m, a);
}

}  // namespace

cudaError_t launch_forward_megakernel(const MegakernelArgs& a, int32_t sm_count,
                                      cudaStream_t stream) {
  return launch<Pass::kForward>(a, sm_count, stream);
}

cudaError_t launch_backward_megakernel(const MegakernelArgs& a, int32_t sm_count,
                                       cudaStream_t stream) {
  return launch<Pass::kBackward>(a, sm_count, stream);
}

}  // namespace epflow::kernels
