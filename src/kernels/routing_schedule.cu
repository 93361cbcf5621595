#include "kernels/routing_schedule.cuh"

namespace epflow::kernels {

namespace {

using sched::ScheduleShape;

constexpr int kThreads = 128;

// NOTES: one thread per chunk of slots keeps the chunk's slots in slot order, which is what
// makes the table deterministic; chunks run in parallel across threads and source ranks.
__global__ void count_chunks_kernel(ScheduleShape s, const int32_t* const* topk_idx,
                                    const int64_t* tokens, int64_t max_chunks, int64_t chunk_slots,
                                    int32_t* chunk_counts, int32_t* invalid_slots) {
  const int32_t src = blockIdx.y;
  const int64_t chunk = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (chunk >= max_chunks) return;
  int32_t* row = chunk_counts + (int64_t{src} * max_chunks + chunk) * s.experts_per_rank;
  for (int32_t e = 0; e < s.experts_per_rank; ++e) row[e] = 0;
  const int64_t slots = tokens[src] * s.top_k;
  const int64_t begin = chunk * chunk_slots;
  if (begin >= slots) return;
  const int64_t end = min(begin + chunk_slots, slots);
  const int32_t invalid = sched::count_chunk(s, topk_idx[src], begin, end, row);
  if (invalid) atomicAdd(invalid_slots, invalid);
}

// Exclusive scan over chunks for one (source, expert): bases for the fill, totals for layout.
__global__ void scan_chunks_kernel(ScheduleShape s, const int64_t* tokens, int64_t max_chunks,
                                   int64_t chunk_slots, int32_t* chunk_counts, int32_t* counts) {
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= int64_t{s.world} * s.experts_per_rank) return;
  const int32_t src = static_cast<int32_t>(i / s.experts_per_rank);
  const int32_t e = static_cast<int32_t>(i % s.experts_per_rank);
  const int64_t chunks = sched::ceil_div(tokens[src] * s.top_k, chunk_slots);
  int32_t running = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    int32_t& v = chunk_counts[(int64_t{src} * max_chunks + c) * s.experts_per_rank + e];
    const int32_t n = v;
    v = running;
    running += n;
  }
  counts[e * s.world + src] = running;
}

__global__ void layout_kernel(ScheduleShape s, const int32_t* counts, int64_t* seg_offset) {
  sched::layout_segments(s, counts, seg_offset);
}

__global__ void fill_chunks_kernel(ScheduleShape s, const int32_t* const* topk_idx,
                                   const int64_t* tokens, int64_t max_chunks, int64_t chunk_slots,
                                   int32_t* chunk_counts, const int32_t* counts,
                                   const int64_t* seg_offset, sched::PullRow* table) {
  const int32_t src = blockIdx.y;
  const int64_t chunk = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t slots = tokens[src] * s.top_k;
  const int64_t begin = chunk * chunk_slots;
  if (chunk >= max_chunks || begin >= slots) return;
  const int64_t end = min(begin + chunk_slots, slots);
  int32_t* ordinal = chunk_counts + (int64_t{src} * max_chunks + chunk) * s.experts_per_rank;
  sched::fill_chunk(s, topk_idx[src], src, begin, end, counts, seg_offset, ordinal, table);
}

__global__ void fill_padding_kernel(ScheduleShape s, const int32_t* counts,
                                    const int64_t* seg_offset, sched::PullRow* table) {
  const int32_t e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e < s.experts_per_rank) sched::fill_padding(s, counts, seg_offset, e, table);
}

int64_t max_chunks_of(const ScheduleLaunch& l) {
  return sched::ceil_div(l.max_tokens_per_rank * l.shape.top_k, l.chunk_slots);
}

size_t align256(size_t v) { return (v + 255) / 256 * 256; }

}  // namespace

size_t routing_schedule_workspace_bytes(const ScheduleLaunch& l) {
  const auto& s = l.shape;
  return align256(sizeof(int32_t) * s.world * max_chunks_of(l) * s.experts_per_rank) +
         align256(sizeof(int32_t) * s.world * s.experts_per_rank) +
         align256(sizeof(int64_t) * (s.experts_per_rank + 1)) +
         align256(sizeof(sched::PullRow) * sched::pull_table_capacity(s, l.max_tokens_per_rank)) +
         align256(sizeof(int32_t));
}

ScheduleBuffers carve_schedule_buffers(const ScheduleLaunch& l, void* workspace) {
  const auto& s = l.shape;
  char* p = static_cast<char*>(workspace);
  ScheduleBuffers b;
  b.chunk_counts = reinterpret_cast<int32_t*>(p);
  p += align256(sizeof(int32_t) * s.world * max_chunks_of(l) * s.experts_per_rank);
  b.counts = reinterpret_cast<int32_t*>(p);
  p += align256(sizeof(int32_t) * s.world * s.experts_per_rank);
  b.seg_offset = reinterpret_cast<int64_t*>(p);
  p += align256(sizeof(int64_t) * (s.experts_per_rank + 1));
  b.table = reinterpret_cast<sched::PullRow*>(p);
  p += align256(sizeof(sched::PullRow) * sched::pull_table_capacity(s, l.max_tokens_per_rank));
  b.invalid_slots = reinterpret_cast<int32_t*>(p);
  return b;
}

cudaError_t launch_routing_schedule(const ScheduleLaunch& l, const int32_t* const* topk_idx,
                                    const int64_t* tokens, const ScheduleBuffers& b,
                                    cudaStream_t stream) {
  const auto& s = l.shape;
  const int64_t max_chunks = max_chunks_of(l);
  if (max_chunks > 0) {
    const dim3 grid(static_cast<unsigned>(sched::ceil_div(max_chunks, kThreads)), s.world);
    count_chunks_kernel<<<grid, kThreads, 0, stream>>>(s, topk_idx, tokens, max_chunks,
                                                       l.chunk_slots, b.chunk_counts,
                                                       b.invalid_slots);
  }
  const int64_t pairs = int64_t{s.world} * s.experts_per_rank;
  scan_chunks_kernel<<<static_cast<unsigned>(sched::ceil_div(pairs, kThreads)), kThreads, 0,
                       stream>>>(s, tokens, max_chunks, l.chunk_slots, b.chunk_counts, b.counts);
  layout_kernel<<<1, 1, 0, stream>>>(s, b.counts, b.seg_offset);
  if (max_chunks > 0) {
    const dim3 grid(static_cast<unsigned>(sched::ceil_div(max_chunks, kThreads)), s.world);
    fill_chunks_kernel<<<grid, kThreads, 0, stream>>>(s, topk_idx, tokens, max_chunks,
                                                      l.chunk_slots, b.chunk_counts, b.counts,
                                                      b.seg_offset, b.table);
  }
  fill_padding_kernel<<<static_cast<unsigned>(sched::ceil_div(s.experts_per_rank, kThreads)),
                        kThreads, 0, stream>>>(s, b.counts, b.seg_offset, b.table);
  return cudaGetLastError();
}

}  // namespace epflow::kernels
