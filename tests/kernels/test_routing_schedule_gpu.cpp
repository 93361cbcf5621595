// The device schedule must produce exactly the host driver's pull table (which the CPU property
// tests prove), for every routing pattern, chunk size and rank count, also when it runs again on
// the same workspace with fewer tokens.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/routing_schedule_host.h"
#include "gpu_test_util.h"
#include "kernels/routing_schedule.cuh"
#include "reference/synthetic.h"

namespace epflow {
namespace {

struct Case {
  int32_t world, experts_per_rank, top_k, tile_m;
  std::vector<int64_t> tokens;
  synthetic::Routing routing;
  int64_t chunk_slots;              // 0: the launch's own choice
  bool inject_invalid_ids = false;  // out-of-range ids must be counted and skipped, not indexed
};

void run_case(const Case& c, uint64_t seed) {
  LayerConfig cfg;
  cfg.hidden = 64;
  cfg.intermediate = 64;
  cfg.num_experts = c.world * c.experts_per_rank;
  cfg.top_k = c.top_k;
  cfg.ep_size = c.world;
  cfg.max_tokens_per_rank = 1;
  for (int64_t t : c.tokens) cfg.max_tokens_per_rank = std::max(cfg.max_tokens_per_rank, t);
  synthetic::InputSpec spec;
  spec.tokens_per_rank = c.tokens;
  spec.routing = c.routing;
  spec.seed = seed;
  auto inputs = synthetic::make_inputs(cfg, spec);
  if (c.inject_invalid_ids)
    for (auto& in : inputs)
      for (size_t i = 0; i < in.topk_idx.size(); i += 7)
        in.topk_idx[i] = (i % 2) ? cfg.num_experts + static_cast<int32_t>(i % 5) : -2 - 3;

  // All sources' topk_idx in one device buffer; per-source pointers as the layer's peer windows.
  std::vector<int64_t> offsets(c.world + 1, 0);
  for (int32_t r = 0; r < c.world; ++r) offsets[r + 1] = offsets[r] + c.tokens[r] * c.top_k;
  int32_t* d_idx = nullptr;
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_idx, sizeof(int32_t) * std::max<int64_t>(offsets.back(), 1)));
  std::vector<const int32_t*> h_ptrs(c.world);
  for (int32_t r = 0; r < c.world; ++r) {
    EPFLOW_CUDA_CHECK(cudaMemcpy(d_idx + offsets[r], inputs[r].topk_idx.data(),
                                 sizeof(int32_t) * c.tokens[r] * c.top_k, cudaMemcpyHostToDevice));
    h_ptrs[r] = d_idx + offsets[r];
  }
  const int32_t** d_ptrs = nullptr;
  int64_t* d_tokens = nullptr;
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_ptrs, sizeof(int32_t*) * c.world));
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_tokens, sizeof(int64_t) * c.world));
  EPFLOW_CUDA_CHECK(cudaMemcpy(d_ptrs, h_ptrs.data(), sizeof(int32_t*) * c.world,
                               cudaMemcpyHostToDevice));

  std::vector<const int32_t*> host_ptrs(c.world);
  for (int32_t r = 0; r < c.world; ++r) host_ptrs[r] = inputs[r].topk_idx.data();

  // Runs the device schedule with `tokens` on `buf` and compares everything with the host's.
  auto expect_host_table = [&](const kernels::ScheduleLaunch& launch,
                               const kernels::ScheduleBuffers& buf,
                               const std::vector<int64_t>& tokens) {
    EPFLOW_CUDA_CHECK(cudaMemcpy(d_tokens, tokens.data(), sizeof(int64_t) * c.world,
                                 cudaMemcpyHostToDevice));
    EPFLOW_CUDA_CHECK(cudaMemset(buf.invalid_slots, 0, sizeof(int32_t)));
    EPFLOW_CUDA_CHECK(kernels::launch_routing_schedule(launch, d_ptrs, d_tokens, buf, nullptr));
    EPFLOW_CUDA_CHECK(cudaDeviceSynchronize());
    const auto expect = sched::build_pull_table(launch.shape, host_ptrs, tokens, 64);

    std::vector<int64_t> seg(c.experts_per_rank + 1);
    EPFLOW_CUDA_CHECK(cudaMemcpy(seg.data(), buf.seg_offset, sizeof(int64_t) * seg.size(),
                                 cudaMemcpyDeviceToHost));
    ASSERT_EQ(seg, expect.seg_offset);
    std::vector<int32_t> counts(expect.counts.size());
    EPFLOW_CUDA_CHECK(cudaMemcpy(counts.data(), buf.counts, sizeof(int32_t) * counts.size(),
                                 cudaMemcpyDeviceToHost));
    EXPECT_EQ(counts, expect.counts);
    std::vector<int32_t> expert_rows(launch.shape.experts_per_rank);
    EPFLOW_CUDA_CHECK(cudaMemcpy(expert_rows.data(), buf.expert_rows,
                                 sizeof(int32_t) * expert_rows.size(), cudaMemcpyDeviceToHost));
    for (int32_t e = 0; e < launch.shape.experts_per_rank; ++e)
      EXPECT_EQ(expert_rows[e], sched::segment_rows(launch.shape, expect.counts.data(), e))
          << "expert " << e;
    std::vector<sched::PullRow> rows(expect.rows.size());
    EPFLOW_CUDA_CHECK(cudaMemcpy(rows.data(), buf.table, sizeof(sched::PullRow) * rows.size(),
                                 cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < rows.size(); ++i) {
      ASSERT_EQ(rows[i].src_rank, expect.rows[i].src_rank) << "row " << i;
      ASSERT_EQ(rows[i].src_slot, expect.rows[i].src_slot) << "row " << i;
    }
    int32_t invalid = -1;
    EPFLOW_CUDA_CHECK(cudaMemcpy(&invalid, buf.invalid_slots, sizeof(int32_t),
                                 cudaMemcpyDeviceToHost));
    EXPECT_EQ(invalid, expect.invalid_slots);
  };

  // The rerun's token counts: about half, so its chunks, groups and rows all end earlier and the
  // first run's leftovers (chunk counts, table rows) sit right where the second run must not look.
  std::vector<int64_t> fewer(c.world);
  for (int32_t r = 0; r < c.world; ++r) fewer[r] = c.tokens[r] / 2;

  for (int32_t rank = 0; rank < c.world; ++rank) {
    SCOPED_TRACE(::testing::Message() << "destination rank " << rank);
    kernels::ScheduleLaunch launch;
    launch.shape = sched::ScheduleShape{c.world, rank, c.experts_per_rank, c.top_k, c.tile_m};
    launch.max_tokens_per_rank = cfg.max_tokens_per_rank;
    launch.chunk_slots = c.chunk_slots;
    const size_t bytes = kernels::routing_schedule_workspace_bytes(launch);
    void* ws = nullptr;
    EPFLOW_CUDA_CHECK(cudaMalloc(&ws, bytes));
    EPFLOW_CUDA_CHECK(cudaMemset(ws, 0xA5, bytes));  // poison: unwritten rows show up
    const auto buf = kernels::carve_schedule_buffers(launch, ws);
    {
      SCOPED_TRACE("first run");
      expect_host_table(launch, buf, c.tokens);
    }
    {
      SCOPED_TRACE("rerun with fewer tokens on the same workspace");
      expect_host_table(launch, buf, fewer);
    }
    EPFLOW_CUDA_CHECK(cudaFree(ws));
    if (::testing::Test::HasFatalFailure()) break;
  }
  EPFLOW_CUDA_CHECK(cudaFree(d_idx));
  EPFLOW_CUDA_CHECK(cudaFree(d_ptrs));
  EPFLOW_CUDA_CHECK(cudaFree(d_tokens));
}

TEST(RoutingScheduleGpu, MatchesHostOnRandomAndAdversarialRoutings) {
  EPFLOW_SKIP_WITHOUT_GPU();
  using R = synthetic::Routing;
  const std::vector<Case> cases = {
      {1, 8, 2, 128, {100}, R::kUniform, 0},
      {2, 32, 8, 128, {4096, 1000}, R::kUniform, 0},
      {2, 32, 8, 128, {333, 0}, R::kImbalanced, 7},
      {4, 16, 4, 64, {77, 1, 0, 300}, R::kWithEmptySlots, 64},
      {8, 32, 8, 128, {200, 13, 0, 129, 128, 1, 255, 64}, R::kImbalanced, 0},
      {8, 4, 1, 256, {512, 512, 512, 512, 512, 512, 512, 512}, R::kSingleExpert, 100},
      {8, 128, 16, 128, {50, 60, 70, 80, 90, 100, 110, 120}, R::kUniform, 33},
      {2, 16, 6, 1, {0, 0}, R::kUniform, 0},
      {4, 8, 4, 128, {90, 300, 17, 0}, R::kUniform, 16, true},
  };
  uint64_t seed = 11;
  for (const auto& c : cases) {
    SCOPED_TRACE(::testing::Message() << "world " << c.world << " E_local " << c.experts_per_rank
                                      << " K " << c.top_k << " tile " << c.tile_m << " chunk "
                                      << c.chunk_slots);
    run_case(c, seed++);
  }
}

// The chunk and group boundaries of the warp-per-chunk kernels: slot counts exactly at, one past
// and one short of a chunk (the default chunk is 256 slots here), chunks of 1 slot (thousands per
// source, so the scan takes many 128-chunk steps), of 31 (steps straddle chunks) and of 1000
// (several 256-slot batches per warp, the last one partial), one hot expert per step.
TEST(RoutingScheduleGpu, MatchesHostAtChunkBoundaries) {
  EPFLOW_SKIP_WITHOUT_GPU();
  using R = synthetic::Routing;
  const std::vector<Case> cases = {
      {2, 32, 8, 128, {32, 33}, R::kUniform, 0},
      {2, 32, 8, 128, {31, 64}, R::kSingleExpert, 0},
      {2, 32, 8, 128, {8192, 8191}, R::kImbalanced, 0},
      {3, 8, 4, 64, {2048, 2049, 2047}, R::kSingleExpert, 256},
      {4, 16, 4, 64, {1000, 999, 0, 513}, R::kUniform, 1},
      {2, 8, 2, 64, {4096, 100}, R::kWithEmptySlots, 31},
      {2, 8, 8, 64, {3000, 2999}, R::kImbalanced, 1000},
      {3, 1, 1, 1, {5000, 0, 4097}, R::kUniform, 0, true},
  };
  uint64_t seed = 101;
  for (const auto& c : cases) {
    SCOPED_TRACE(::testing::Message() << "world " << c.world << " E_local " << c.experts_per_rank
                                      << " K " << c.top_k << " tile " << c.tile_m << " chunk "
                                      << c.chunk_slots);
    run_case(c, seed++);
  }
}

// The largest shapes: 1024 local experts over 8 ranks with K 16 and 8192 tokens per rank (the
// per-warp shared counts at their largest, 1024-slot default chunks), the DeepSeek-V3 shape at
// 8192 tokens, 1000 experts (not a multiple of the warp) on one rank, and 72 ranks.
TEST(RoutingScheduleGpu, MatchesHostAtTheLargestShapes) {
  EPFLOW_SKIP_WITHOUT_GPU();
  using R = synthetic::Routing;
  std::vector<int64_t> tokens72(72);
  for (int32_t r = 0; r < 72; ++r) tokens72[r] = r % 9 == 0 ? 0 : 37 * r % 300;
  const std::vector<Case> cases = {
      {8, 1024, 16, 128, std::vector<int64_t>(8, 8192), R::kUniform, 0},
      {8, 1024, 16, 256, {8192, 0, 1, 4095, 8191, 31, 2048, 7000}, R::kImbalanced, 0, true},
      {2, 32, 8, 128, {8192, 8192}, R::kUniform, 0},
      {1, 1000, 8, 64, {4000}, R::kImbalanced, 0},
      {72, 2, 4, 64, tokens72, R::kWithEmptySlots, 0},
  };
  uint64_t seed = 201;
  for (const auto& c : cases) {
    SCOPED_TRACE(::testing::Message() << "world " << c.world << " E_local " << c.experts_per_rank
                                      << " K " << c.top_k << " tile " << c.tile_m << " chunk "
                                      << c.chunk_slots);
    run_case(c, seed++);
  }
}

// No device needed: the default chunk size keeps the per-chunk counts within 16 MB up to the
// layer's limits (world 72, 1024 experts per rank, K 16, 2^30 slots per rank).
TEST(RoutingScheduleGpu, PerChunkCountsStayWithin16MB) {
  struct Shape {
    int32_t world, experts_per_rank, top_k;
    int64_t max_tokens;
  };
  for (const Shape& shape : {Shape{2, 32, 8, 128}, Shape{2, 32, 8, 8192}, Shape{2, 32, 8, 65536},
                             Shape{8, 1024, 16, 8192}, Shape{8, 1024, 16, 65536},
                             Shape{72, 1024, 16, 65536}, Shape{1, 1024, 16, int64_t{1} << 26}}) {
    kernels::ScheduleLaunch launch;
    launch.shape = sched::ScheduleShape{shape.world, 0, shape.experts_per_rank, shape.top_k, 128};
    launch.max_tokens_per_rank = shape.max_tokens;
    SCOPED_TRACE(::testing::Message() << "world " << shape.world << " E_local "
                                      << shape.experts_per_rank << " K " << shape.top_k << " T "
                                      << shape.max_tokens);
    const int64_t chunk = kernels::effective_chunk_slots(launch);
    EXPECT_EQ(chunk % 32, 0);
    EXPECT_GE(chunk, std::max<int64_t>(256, shape.experts_per_rank));
    auto aligned = [](size_t v) { return (v + 255) / 256 * 256; };
    const size_t others =
        aligned(sizeof(int32_t) * shape.world * shape.experts_per_rank) +
        aligned(sizeof(int64_t) * (shape.experts_per_rank + 1)) +
        aligned(sizeof(int32_t) * shape.experts_per_rank) +
        aligned(sizeof(sched::PullRow) *
                sched::pull_table_capacity(launch.shape, shape.max_tokens)) +
        aligned(sizeof(int32_t));
    EXPECT_LE(kernels::routing_schedule_workspace_bytes(launch) - others, size_t{16} << 20);
  }
}

}  // namespace
}  // namespace epflow
