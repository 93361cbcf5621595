#include <algorithm>
#include <cub/block/block_scan.cuh>

#include "epflow/config.h"
#include "kernels/routing_schedule.cuh"

namespace epflow::kernels {

namespace {

using sched::PullRow;
using sched::ScheduleShape;

// NOTES: a warp per chunk. A warp reads its chunk 32 slots at a time (lane l takes slot base + l:
// one coalesced load per step), so it can rank the step's slots in slot order with
// __match_any_sync; its chunk's counts and running ordinals live in shared memory ([kWarps]
// [E_local] per block, 32 KB at 1024 experts), which a thread per chunk could not afford beyond a
// few dozen experts. The kWarps chunks of a block are consecutive chunks of one source (a group),
// so in the expert-major chunk_counts each expert's kWarps entries of a group are one 32-byte
// sector (count writes them, fill reads them back), and the scan over one expert's chunks reads
// contiguous memory.
constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kBatch = 8;  // 32-slot steps whose ids a lane loads before it uses any
constexpr unsigned kFullWarp = 0xffffffffu;

// The chunk size chosen when ScheduleLaunch::chunk_slots is 0.
// NOTES: at least a full batch and at least E_local slots, so a chunk's E_local counts (written
// whether used or not) cost at most one int per slot; at most 1024 chunks per source, so the scan
// is a few steps; and W * E_local * chunks entries within 16 MB (world 8 with 1024 experts and
// 65536 tokens of K 16 gives chunks of 2048 slots).
constexpr int64_t kMinChunkSlots = 32 * kBatch;
constexpr int64_t kMaxChunksPerSource = 1024;
constexpr int64_t kMaxChunkEntries = int64_t{4} << 20;

using LayoutScan = cub::BlockScan<int64_t, kThreads>;

// Dynamic shared memory of the fill kernel: seg_offset[E + 1], then ordinals[kWarps][E].
constexpr size_t fill_smem_bytes(int32_t experts) {
  return sizeof(int64_t) * (experts + 1) + sizeof(int32_t) * kWarps * experts;
}
static_assert(fill_smem_bytes(Limits::kMaxExpertsPerRank) + sizeof(LayoutScan::TempStorage) <=
                  48 * 1024,
              "the fill kernel's shared memory must fit without an opt-in");

// Sizes shared by the kernels.
struct ChunkPlan {
  int64_t max_tokens;   // per source; the workspace holds no more
  int64_t chunk_slots;  // slots per chunk
  int64_t stride;       // chunk_counts entries per (source, expert): max chunks in whole groups
};

ChunkPlan plan_of(const ScheduleLaunch& l) {
  const int64_t chunk_slots = effective_chunk_slots(l);
  const int64_t max_chunks = sched::ceil_div(l.max_tokens_per_rank * l.shape.top_k, chunk_slots);
  return ChunkPlan{l.max_tokens_per_rank, chunk_slots, sched::round_up(max_chunks, kWarps)};
}

// NOTES: clamped to max_tokens: a larger count breaks the caller's contract, and must not make
// the kernels index past the workspace.
__device__ int64_t slots_of(const ScheduleShape& s, const ChunkPlan& p, const int64_t* tokens,
                            int32_t src) {
  const int64_t t = tokens[src];
  return (t < 0 ? 0 : t < p.max_tokens ? t : p.max_tokens) * s.top_k;
}

// The ids of slots base + 32 * i + lane (i < kBatch), -1 (an empty slot) at and past end: every
// load is issued before any is used.
__device__ __forceinline__ void load_ids(const int32_t* __restrict__ topk_idx, int64_t base,
                                         int64_t end, int32_t lane, int32_t (&ids)[kBatch]) {
#pragma unroll
  for (int i = 0; i < kBatch; ++i) {
    const int64_t slot = base + 32 * i + lane;
    ids[i] = slot < end ? topk_idx[slot] : -1;
  }
}

// Pass 1: every chunk's count per local expert, into chunk_counts[src][e][chunk]. Grid-stride
// over groups (kWarps consecutive chunks of one source); groups past the source's slots are
// skipped and their entries left unwritten (the scan never reads them).
__global__ void __launch_bounds__(kThreads)
    count_kernel(ScheduleShape s, ChunkPlan p, const int32_t* const* __restrict__ topk_idx,
                 const int64_t* __restrict__ tokens, int32_t* __restrict__ chunk_counts,
                 int32_t* __restrict__ invalid_slots) {
  extern __shared__ int32_t hist[];  // [kWarps][E_local]: the group's chunk counts
  const int32_t E = s.experts_per_rank;
  const int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t groups = p.stride / kWarps;  // per source
  int32_t invalid = 0;
  for (int64_t g = blockIdx.x; g < s.world * groups; g += gridDim.x) {
    const int32_t src = static_cast<int32_t>(g / groups);
    const int64_t first_chunk = g % groups * kWarps;
    const int64_t slots = slots_of(s, p, tokens, src);
    if (first_chunk * p.chunk_slots >= slots) continue;  // the whole block skips
    for (int32_t i = threadIdx.x; i < kWarps * E; i += kThreads) hist[i] = 0;
    __syncthreads();
    const int64_t begin = (first_chunk + warp) * p.chunk_slots;
    const int64_t end = min(begin + p.chunk_slots, slots);
    int32_t* count = hist + warp * E;
    for (int64_t base = begin; base < end; base += 32 * kBatch) {
      int32_t ids[kBatch];
      load_ids(topk_idx[src], base, end, lane, ids);
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int32_t e = sched::local_expert_of(s, ids[i]);
        if (e >= 0) atomicAdd(&count[e], 1);
        invalid += e == sched::kInvalidExpert;
      }
    }
    __syncthreads();
    int32_t* out = chunk_counts + int64_t{src} * E * p.stride + first_chunk;
    for (int32_t i = threadIdx.x; i < kWarps * E; i += kThreads)
      out[int64_t{i / kWarps} * p.stride + i % kWarps] = hist[i % kWarps * E + i / kWarps];
    __syncthreads();  // everyone has read hist before the next group zeroes it
  }
  invalid = __reduce_add_sync(kFullWarp, invalid);
  if (lane == 0 && invalid != 0) atomicAdd(invalid_slots, invalid);
}

// Pass 1b: a warp per (source, expert) scans that expert's chunk counts in place, exclusive (they
// become the fill's ordinal bases), and writes the total to counts[e * world + src].
// NOTES: a lane takes 4 consecutive chunks (one 16-byte load; rows are 32-byte aligned) and the
// warp scans the lane sums, 128 chunks a step; the next step's load is issued before this step's
// stores, so steps do not queue behind each other's latency.
__global__ void __launch_bounds__(kThreads)
    scan_kernel(ScheduleShape s, ChunkPlan p, const int64_t* __restrict__ tokens,
                int32_t* __restrict__ chunk_counts, int32_t* __restrict__ counts) {
  const int64_t pair = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32;  // src * E_local + e
  if (pair >= int64_t{s.world} * s.experts_per_rank) return;
  const int32_t src = static_cast<int32_t>(pair / s.experts_per_rank);
  const int32_t e = static_cast<int32_t>(pair % s.experts_per_rank);
  const int32_t lane = threadIdx.x % 32;
  const int64_t chunks = sched::ceil_div(slots_of(s, p, tokens, src), p.chunk_slots);
  int4* row = reinterpret_cast<int4*>(chunk_counts + pair * p.stride);
  auto load = [&](int64_t step) {  // this lane's 4 counts of a step, 0 past the last chunk
    const int64_t c = (32 * step + lane) * 4;
    int4 v = c < chunks ? row[c / 4] : make_int4(0, 0, 0, 0);
    if (c + 1 >= chunks) v.y = 0;
    if (c + 2 >= chunks) v.z = 0;
    if (c + 3 >= chunks) v.w = 0;
    return v;
  };
  const int64_t steps = sched::ceil_div(chunks, 128);
  int32_t running = 0;
  int4 next = load(0);
  for (int64_t step = 0; step < steps; ++step) {
    const int4 v = next;
    if (step + 1 < steps) next = load(step + 1);
    const int32_t sum = v.x + v.y + v.z + v.w;
    int32_t inclusive = sum;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int32_t below = __shfl_up_sync(kFullWarp, inclusive, d);
      if (lane >= d) inclusive += below;
    }
    const int32_t base = running + inclusive - sum;
    const int64_t c = (32 * step + lane) * 4;
    if (c < chunks)
      row[c / 4] = make_int4(base, base + v.x, base + v.x + v.y, base + v.x + v.y + v.z);
    running += __shfl_sync(kFullWarp, inclusive, 31);
  }
  if (lane == 0) counts[e * s.world + src] = running;
}

// Passes 2 and 3: every block lays the segments out in shared memory (block 0 also writes
// seg_offset), fills the rows of its groups' chunks, then its share of the padding.
// NOTES: the layout is one block-wide scan over E_local <= 1024 experts, cheaper to repeat per
// block (at most two per SM) than a kernel of its own between scan and fill.
__global__ void __launch_bounds__(kThreads)
    fill_kernel(ScheduleShape s, ChunkPlan p, const int32_t* const* __restrict__ topk_idx,
                const int64_t* __restrict__ tokens, const int32_t* __restrict__ chunk_counts,
                const int32_t* __restrict__ counts, int64_t* __restrict__ seg_offset,
                int32_t* __restrict__ expert_rows, PullRow* __restrict__ table) {
  __shared__ LayoutScan::TempStorage scan_storage;
  extern __shared__ int64_t fill_smem[];
  const int32_t E = s.experts_per_rank;
  int64_t* seg = fill_smem;                                           // [E + 1]
  int32_t* ordinals = reinterpret_cast<int32_t*>(fill_smem + E + 1);  // [kWarps][E]

  // Layout: each thread a blocked range of experts, one exclusive scan of the range sums.
  const int32_t per_thread = static_cast<int32_t>(sched::ceil_div(E, kThreads));
  const int32_t e_begin = min(static_cast<int32_t>(threadIdx.x) * per_thread, E);
  const int32_t e_end = min(e_begin + per_thread, E);
  int64_t rows = 0;
  for (int32_t e = e_begin; e < e_end; ++e) rows += sched::padded_segment_rows(s, counts, e);
  int64_t offset = 0;
  LayoutScan(scan_storage).ExclusiveSum(rows, offset);
  for (int32_t e = e_begin; e < e_end; ++e) {
    seg[e] = offset;
    offset += sched::padded_segment_rows(s, counts, e);
  }
  if (threadIdx.x == kThreads - 1) seg[E] = offset;  // the last range ends at the total
  __syncthreads();
  if (blockIdx.x == 0) {
    for (int32_t e = threadIdx.x; e <= E; e += kThreads) seg_offset[e] = seg[e];
    for (int32_t e = threadIdx.x; e < E; e += kThreads)
      expert_rows[e] = static_cast<int32_t>(sched::segment_rows(s, counts, e));
  }

  // Rows: the groups of the count kernel, each warp its chunk.
  const int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned lanes_below = (1u << lane) - 1;
  const int64_t groups = p.stride / kWarps;
  for (int64_t g = blockIdx.x; g < s.world * groups; g += gridDim.x) {
    const int32_t src = static_cast<int32_t>(g / groups);
    const int64_t first_chunk = g % groups * kWarps;
    const int64_t slots = slots_of(s, p, tokens, src);
    if (first_chunk * p.chunk_slots >= slots) continue;  // the whole block skips
    const int32_t* bases = chunk_counts + int64_t{src} * E * p.stride + first_chunk;
    for (int32_t i = threadIdx.x; i < kWarps * E; i += kThreads)
      ordinals[i % kWarps * E + i / kWarps] = bases[int64_t{i / kWarps} * p.stride + i % kWarps];
    __syncthreads();
    const int64_t begin = (first_chunk + warp) * p.chunk_slots;
    const int64_t end = min(begin + p.chunk_slots, slots);
    int32_t* ordinal = ordinals + warp * E;  // rows src sent each expert from earlier slots
    for (int64_t base = begin; base < end; base += 32 * kBatch) {
      int32_t ids[kBatch];
      load_ids(topk_idx[src], base, end, lane, ids);
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        if (base + 32 * i >= end) break;  // the whole warp: the chunk ends before this step
        const int32_t e = sched::local_expert_of(s, ids[i]);
        // Lanes of one expert: each one's ordinal is the expert's running ordinal plus the
        // peers on lower lanes (= earlier slots); the highest peer advances the running ordinal
        // once all peers have read it.
        const unsigned peers = __match_any_sync(kFullWarp, e);
        int32_t j = 0;
        if (e >= 0) {
          j = ordinal[e] + __popc(peers & lanes_below);
          const int32_t slot = static_cast<int32_t>(base + 32 * i + lane);
          table[sched::pull_row(s, counts, seg, src, e, j)] = PullRow{src, slot};
        }
        __syncwarp();
        if (e >= 0 && (peers >> lane) == 1u) ordinal[e] = j + 1;
        __syncwarp();
      }
    }
    __syncthreads();  // everyone is done with ordinals before the next group loads them
  }

  // Padding: a warp per expert.
  for (int32_t e = blockIdx.x * kWarps + warp; e < E; e += gridDim.x * kWarps)
    sched::fill_padding(s, counts, seg, e, table, lane, 32);
}

size_t align256(size_t v) { return (v + 255) / 256 * 256; }

size_t chunk_counts_bytes(const ScheduleLaunch& l) {
  return sizeof(int32_t) * l.shape.world * l.shape.experts_per_rank * plan_of(l).stride;
}

}  // namespace

int64_t effective_chunk_slots(const ScheduleLaunch& l) {
  if (l.chunk_slots > 0) return l.chunk_slots;
  const auto& s = l.shape;
  const int64_t pairs = int64_t{s.world} * s.experts_per_rank;
  // A multiple of kWarps, so the stride (chunks rounded up to whole groups) stays within it.
  const int64_t max_chunks =
      std::clamp(kMaxChunkEntries / pairs / kWarps * kWarps, int64_t{kWarps}, kMaxChunksPerSource);
  const int64_t chunk_slots =
      std::max({kMinChunkSlots, int64_t{s.experts_per_rank},
                sched::ceil_div(l.max_tokens_per_rank * s.top_k, max_chunks)});
  return sched::round_up(chunk_slots, 32);
}

size_t routing_schedule_workspace_bytes(const ScheduleLaunch& l) {
  const auto& s = l.shape;
  return align256(chunk_counts_bytes(l)) +
         align256(sizeof(int32_t) * s.world * s.experts_per_rank) +
         align256(sizeof(int64_t) * (s.experts_per_rank + 1)) +
         align256(sizeof(int32_t) * s.experts_per_rank) +
         align256(sizeof(sched::PullRow) * sched::pull_table_capacity(s, l.max_tokens_per_rank)) +
         align256(sizeof(int32_t));
}

ScheduleBuffers carve_schedule_buffers(const ScheduleLaunch& l, void* workspace) {
  const auto& s = l.shape;
  char* p = static_cast<char*>(workspace);
  ScheduleBuffers b;
  b.chunk_counts = reinterpret_cast<int32_t*>(p);  // first: the scan's 16-byte loads need it
  p += align256(chunk_counts_bytes(l));
  b.counts = reinterpret_cast<int32_t*>(p);
  p += align256(sizeof(int32_t) * s.world * s.experts_per_rank);
  b.seg_offset = reinterpret_cast<int64_t*>(p);
  p += align256(sizeof(int64_t) * (s.experts_per_rank + 1));
  b.expert_rows = reinterpret_cast<int32_t*>(p);
  p += align256(sizeof(int32_t) * s.experts_per_rank);
  b.table = reinterpret_cast<sched::PullRow*>(p);
  p += align256(sizeof(sched::PullRow) * sched::pull_table_capacity(s, l.max_tokens_per_rank));
  b.invalid_slots = reinterpret_cast<int32_t*>(p);
  return b;
}

cudaError_t launch_routing_schedule(const ScheduleLaunch& l, const int32_t* const* topk_idx,
                                    const int64_t* tokens, const ScheduleBuffers& b,
                                    cudaStream_t stream) {
  const auto& s = l.shape;
  const ChunkPlan p = plan_of(l);
  int device = 0, sm_count = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  if (const cudaError_t err =
          cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
      err != cudaSuccess)
    return err;
  // NOTES: count and fill grid-stride over the groups of max_tokens_per_rank with at most two
  // blocks per SM: a call with few tokens does not launch a grid sized for the maximum only to
  // retire it, and fill's per-block layout is repeated at most that often.
  const int64_t groups = int64_t{s.world} * (p.stride / kWarps);
  const auto blocks = static_cast<unsigned>(std::clamp<int64_t>(groups, 1, 2 * int64_t{sm_count}));
  if (groups > 0)
    count_kernel<<<blocks, kThreads, sizeof(int32_t) * kWarps * s.experts_per_rank, stream>>>(
        s, p, topk_idx, tokens, b.chunk_counts, b.invalid_slots);
  const int64_t pairs = int64_t{s.world} * s.experts_per_rank;
  scan_kernel<<<static_cast<unsigned>(sched::ceil_div(pairs, kWarps)), kThreads, 0, stream>>>(
      s, p, tokens, b.chunk_counts, b.counts);
  fill_kernel<<<blocks, kThreads, fill_smem_bytes(s.experts_per_rank), stream>>>(
      s, p, topk_idx, tokens, b.chunk_counts, b.counts, b.seg_offset, b.expert_rows, b.table);
  return cudaGetLastError();
}

}  // namespace epflow::kernels
