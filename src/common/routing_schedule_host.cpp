#include "common/routing_schedule_host.h"

#include <stdexcept>

namespace epflow::sched {

PullTable build_pull_table(const ScheduleShape& s, const std::vector<const int32_t*>& topk_idx,
                           const std::vector<int64_t>& tokens, int64_t chunk_slots) {
  if (static_cast<int32_t>(topk_idx.size()) != s.world ||
      static_cast<int32_t>(tokens.size()) != s.world || chunk_slots <= 0)
    throw std::invalid_argument("build_pull_table: need one topk_idx and token count per rank");
  const int32_t E = s.experts_per_rank;
  PullTable t;
  t.counts.assign(static_cast<size_t>(E) * s.world, 0);
  t.seg_offset.assign(E + 1, 0);

  // Pass 1: per-chunk counts; keep them, they become the chunks' ordinal bases.
  std::vector<std::vector<int32_t>> chunk_counts(s.world);
  for (int32_t src = 0; src < s.world; ++src) {
    const int64_t slots = tokens[src] * s.top_k;
    const int64_t chunks = ceil_div(slots, chunk_slots);
    chunk_counts[src].assign(static_cast<size_t>(chunks) * E, 0);
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t end = (c + 1) * chunk_slots < slots ? (c + 1) * chunk_slots : slots;
      t.invalid_slots +=
          count_chunk(s, topk_idx[src], c * chunk_slots, end, &chunk_counts[src][c * E]);
    }
    // Exclusive scan over chunks, per expert: counts become bases; totals go to t.counts.
    for (int32_t e = 0; e < E; ++e) {
      int32_t running = 0;
      for (int64_t c = 0; c < chunks; ++c) {
        const int32_t n = chunk_counts[src][c * E + e];
        chunk_counts[src][c * E + e] = running;
        running += n;
      }
      t.counts[static_cast<size_t>(e) * s.world + src] = running;
    }
  }

  // Pass 2: layout.
  layout_segments(s, t.counts.data(), t.seg_offset.data());
  t.rows.assign(t.total_rows(), PullRow{kPaddingRow, -1});

  // Pass 3: fill, then padding.
  for (int32_t src = 0; src < s.world; ++src) {
    const int64_t slots = tokens[src] * s.top_k;
    const int64_t chunks = ceil_div(slots, chunk_slots);
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t end = (c + 1) * chunk_slots < slots ? (c + 1) * chunk_slots : slots;
      fill_chunk(s, topk_idx[src], src, c * chunk_slots, end, t.counts.data(),
                 t.seg_offset.data(), &chunk_counts[src][c * E], t.rows.data());
    }
  }
  for (int32_t e = 0; e < E; ++e)
    fill_padding(s, t.counts.data(), t.seg_offset.data(), e, t.rows.data());
  return t;
}

}  // namespace epflow::sched
