// The device schedule must produce exactly the host driver's pull table (which the CPU property
// tests prove), for every routing pattern, chunk size and rank count.
#include <cuda_runtime.h>

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
  int64_t chunk_slots;
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
  EPFLOW_CUDA_CHECK(cudaMemcpy(d_tokens, c.tokens.data(), sizeof(int64_t) * c.world,
                               cudaMemcpyHostToDevice));

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
    EPFLOW_CUDA_CHECK(cudaMemset(buf.invalid_slots, 0, sizeof(int32_t)));
    EPFLOW_CUDA_CHECK(kernels::launch_routing_schedule(launch, d_ptrs, d_tokens, buf, nullptr));
    EPFLOW_CUDA_CHECK(cudaDeviceSynchronize());

    std::vector<const int32_t*> host_ptrs(c.world);
    for (int32_t r = 0; r < c.world; ++r) host_ptrs[r] = inputs[r].topk_idx.data();
    const auto expect = sched::build_pull_table(launch.shape, host_ptrs, c.tokens, 64);

    std::vector<int64_t> seg(c.experts_per_rank + 1);
    EPFLOW_CUDA_CHECK(cudaMemcpy(seg.data(), buf.seg_offset, sizeof(int64_t) * seg.size(),
                                 cudaMemcpyDeviceToHost));
    ASSERT_EQ(seg, expect.seg_offset);
    std::vector<int32_t> counts(expect.counts.size());
    EPFLOW_CUDA_CHECK(cudaMemcpy(counts.data(), buf.counts, sizeof(int32_t) * counts.size(),
                                 cudaMemcpyDeviceToHost));
    EXPECT_EQ(counts, expect.counts);
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
    EPFLOW_CUDA_CHECK(cudaFree(ws));
  }
  EPFLOW_CUDA_CHECK(cudaFree(d_idx));
  EPFLOW_CUDA_CHECK(cudaFree(d_ptrs));
  EPFLOW_CUDA_CHECK(cudaFree(d_tokens));
}

TEST(RoutingScheduleGpu, MatchesHostOnRandomAndAdversarialRoutings) {
  EPFLOW_SKIP_WITHOUT_GPU();
  using R = synthetic::Routing;
  const std::vector<Case> cases = {
      {1, 8, 2, 128, {100}, R::kUniform, 256},
      {2, 32, 8, 128, {4096, 1000}, R::kUniform, 256},
      {2, 32, 8, 128, {333, 0}, R::kImbalanced, 7},
      {4, 16, 4, 64, {77, 1, 0, 300}, R::kWithEmptySlots, 64},
      {8, 32, 8, 128, {200, 13, 0, 129, 128, 1, 255, 64}, R::kImbalanced, 256},
      {8, 4, 1, 256, {512, 512, 512, 512, 512, 512, 512, 512}, R::kSingleExpert, 100},
      {8, 128, 16, 128, {50, 60, 70, 80, 90, 100, 110, 120}, R::kUniform, 33},
      {2, 16, 6, 1, {0, 0}, R::kUniform, 256},
      {4, 8, 4, 128, {90, 300, 17, 0}, R::kUniform, 16, true},
  };
  uint64_t seed = 11;
  for (const auto& c : cases) {
    SCOPED_TRACE(::testing::Message() << "world " << c.world << " E_local " << c.experts_per_rank
                                      << " K " << c.top_k << " tile " << c.tile_m);
    run_case(c, seed++);
  }
}

}  // namespace
}  // namespace epflow
