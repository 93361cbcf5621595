// The GPU forward of the whole layer against the CPU reference, at EP=1 and EP=2 (a thread per
// GPU), with imbalanced routing, empty experts, empty slots, T not a tile multiple, T different
// on each rank, T = 0 on one rank, repeated calls on one workspace, and the DeepSeek-V3 per-rank
// shape at T = 1, 100 and 4096 (whose routed rows wrap the default ring several times). The
// megakernel also with rings smaller than the routed rows, several SM splits and minibatch
// sizes, and captured in a CUDA graph; the unfused chain (bench/unfused) on the same cases; a
// timed-out wait reported as an error that names it; 200 back-to-back calls at a small token
// count, bit-identical; expert weights in Megatron-Core's layouts read in place.
#include <gtest/gtest.h>

#include "gpu_test_util.h"
#include "layer_gpu_harness.h"

namespace epflow {
namespace {

using synthetic::Routing;
using testing::CallInputs;

using testing::shape_config;
using testing::small_config;

// Runs the calls and checks each against the reference (all tokens for small shapes).
void run_and_check(const LayerConfig& c, const std::vector<CallInputs>& calls,
                   int64_t max_checked_tokens = 1 << 30, uint64_t expert_seed = 5,
                   const testing::RunOptions& options = {}) {
  const auto experts = testing::make_bf16_experts(c, expert_seed);
  testing::LayerRunResult result;
  const Status s = testing::run_layer(c, experts, calls, &result, options);
  ASSERT_TRUE(s.ok()) << s.to_string();
  for (size_t call = 0; call < calls.size(); ++call) {
    SCOPED_TRACE(::testing::Message() << "call " << call);
    testing::expect_matches_reference(c, experts, calls[call], result.y[call], max_checked_tokens);
  }
}

TEST(LayerGpu, Ep1UniformRoutingRepeatedCalls) {
  EPFLOW_SKIP_WITHOUT_GPUS(1);
  const LayerConfig c = small_config(1, 300);
  run_and_check(c, {testing::make_call(c, {100}, Routing::kUniform, 1),
                    testing::make_call(c, {37}, Routing::kUniform, 2),
                    testing::make_call(c, {300}, Routing::kWithEmptySlots, 3)});
}

TEST(LayerGpu, Ep1ImbalancedEmptyExpertsAndOneHotExpert) {
  EPFLOW_SKIP_WITHOUT_GPUS(1);
  LayerConfig c = small_config(1, 513);
  c.hidden = 192;
  c.num_experts = 16;
  run_and_check(c, {testing::make_call(c, {77}, Routing::kImbalanced, 4),
                    testing::make_call(c, {513}, Routing::kSingleExpert, 5),
                    testing::make_call(c, {0}, Routing::kUniform, 6),
                    testing::make_call(c, {1}, Routing::kUniform, 7)});
}

TEST(LayerGpu, Ep2DifferentTokenCountsPerRank) {
  EPFLOW_SKIP_WITHOUT_GPUS(2);
  const LayerConfig c = small_config(2, 600);
  run_and_check(c, {testing::make_call(c, {300, 45}, Routing::kUniform, 8),
                    testing::make_call(c, {0, 129}, Routing::kImbalanced, 9),
                    testing::make_call(c, {600, 600}, Routing::kSingleExpert, 10),
                    testing::make_call(c, {513, 1}, Routing::kWithEmptySlots, 11),
                    testing::make_call(c, {0, 0}, Routing::kUniform, 12)});
}

// Calls with imbalanced routing, a hot expert, empty slots and uneven T on `world` ranks.
std::vector<CallInputs> mixed_calls(const LayerConfig& c, int world, uint64_t seed) {
  auto tokens = [&](int64_t a, int64_t b) {
    return world == 1 ? std::vector<int64_t>{a} : std::vector<int64_t>{a, b};
  };
  return {testing::make_call(c, tokens(300, 45), Routing::kUniform, seed),
          testing::make_call(c, tokens(0, 129), Routing::kImbalanced, seed + 1),
          testing::make_call(c, tokens(600, 600), Routing::kSingleExpert, seed + 2),
          testing::make_call(c, tokens(513, 1), Routing::kWithEmptySlots, seed + 3)};
}

// The small shape with the megakernel's knobs (0 = automatic), on the mixed calls.
void check_with_knobs(int world, int32_t comm_sms, int64_t minibatch_rows, int64_t ring_rows,
                      uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "EP " << world << " comm SMs " << comm_sms
                                    << " minibatch " << minibatch_rows << " ring " << ring_rows);
  LayerConfig c = small_config(world, 600);
  c.comm_sms = comm_sms;
  c.minibatch_rows = minibatch_rows;
  c.ring_rows = ring_rows;
  run_and_check(c, mixed_calls(c, world, seed));
}

// Rings of 1, 2 and 3 tiles against up to 19 tiles of routed rows per call: every call cycles
// macrobatches, and the dispatch of one overlaps the compute of the previous.
void ring_smaller_than_routed_rows(int world) {
  for (int64_t ring : {128, 256, 384}) check_with_knobs(world, 0, 128, ring, 20);
}

void sm_splits_and_minibatch_sizes(int world) {
  for (auto [comm_sms, minibatch] : {std::pair{1, 128}, {8, 256}, {40, 512}, {100, 0}})
    check_with_knobs(world, comm_sms, minibatch, 0, 30);
}

void captured_in_cuda_graph(int world) {
  LayerConfig c = small_config(world, 600);
  c.ring_rows = 256;  // wraps too
  c.minibatch_rows = 128;
  c.with_backward = true;  // the captured forward fills a SavedContext: it keeps g | u too
  testing::RunOptions graph;
  graph.cuda_graph = true;
  run_and_check(c, mixed_calls(c, world, 40), 1 << 30, 5, graph);
}

void unfused_chain_matches_reference(int world) {
  const LayerConfig c = small_config(world, 600);
  testing::RunOptions unfused;
  unfused.unfused = true;
  run_and_check(c, mixed_calls(c, world, 50), 1 << 30, 5, unfused);
}

// Megatron-Core's layouts read in place through the expert strides (a fused gate|up [E, 2I, H]
// with a padded down; DDP's buffer with the experts in reverse order): against the reference,
// and bitwise equal to densely packed weights.
void megatron_layouts_read_in_place(int world) {
  LayerConfig c = small_config(world, 600);
  c.intermediate = 320;  // a partial gate/up tile
  const std::vector<CallInputs> calls = mixed_calls(c, world, 60);
  const auto experts = testing::make_bf16_experts(c, 5);
  testing::LayerRunResult packed;
  const Status a = testing::run_layer(c, experts, calls, &packed);
  ASSERT_TRUE(a.ok()) << a.to_string();
  for (auto layout : {testing::ExpertLayout::kFusedGateUp, testing::ExpertLayout::kDdpReversed}) {
    SCOPED_TRACE(layout == testing::ExpertLayout::kFusedGateUp ? "fused" : "DDP reversed");
    testing::RunOptions strided;
    strided.weights = layout;
    run_and_check(c, calls, 1 << 30, 5, strided);
    testing::LayerRunResult in_place;
    const Status b = testing::run_layer(c, experts, calls, &in_place, strided);
    ASSERT_TRUE(b.ok()) << b.to_string();
    EXPECT_EQ(packed.y, in_place.y);
  }
}

EPFLOW_EP1_AND_EP2_TESTS(LayerGpu, MegatronLayoutsReadInPlace, megatron_layouts_read_in_place)
EPFLOW_EP1_AND_EP2_TESTS(LayerGpu, RingSmallerThanRoutedRows, ring_smaller_than_routed_rows)
EPFLOW_EP1_AND_EP2_TESTS(LayerGpu, SmSplitsAndMinibatchSizes, sm_splits_and_minibatch_sizes)
EPFLOW_EP1_AND_EP2_TESTS(LayerGpu, CapturedInCudaGraph, captured_in_cuda_graph)
EPFLOW_EP1_AND_EP2_TESTS(LayerGpu, UnfusedChainMatchesReference, unfused_chain_matches_reference)

// DeepSeek-V3 per-rank shape: H 7168, I 2048, 32 experts per rank, top-8; T = 1, 100, 4096 on
// every rank (sampled reference check: 48 tokens per rank; every element checked as written).
void deepseek_v3(int world) {
  const LayerConfig c = shape_config(world, 7168, 2048, 32, 8, 4096);
  std::vector<CallInputs> calls;
  uint64_t seed = 100;
  for (int64_t T : {1, 100, 4096})
    calls.push_back(
        testing::make_call(c, std::vector<int64_t>(world, T), Routing::kUniform, seed++));
  run_and_check(c, calls, 48);
}

EPFLOW_EP1_AND_EP2_TESTS(LayerGpu, DeepSeekV3Shape, deepseek_v3)

// Back to back calls at a small token count of a narrow-expert shape (Qwen3-30B-A3B per rank:
// H 2048, I 768, 16 experts, top-8), where most row tiles are partial and many consumer
// warpgroups only pass padding through the pipeline: the megakernel once hung within 3-62 such
// calls (a warp of a padding warpgroup fell a ring behind). 200 calls per rank, each output
// bit-identical to the first (the layer is deterministic), the first checked against the CPU
// reference.
void many_calls_at_small_token_counts(int world) {
  const LayerConfig c = shape_config(world, 2048, 768, 16, 8, 512);
  testing::RunOptions repeated;
  repeated.repeat = 200;
  run_and_check(c,
                {testing::make_call(c, std::vector<int64_t>(world, 512), Routing::kUniform, 70)},
                64, 5, repeated);
}
EPFLOW_EP1_AND_EP2_TESTS(LayerGpu, ManyCallsAtSmallTokenCounts, many_calls_at_small_token_counts)

// A wait that runs out of time ends the call with an error naming who waited for what, never a
// hang: with a 1 us timeout and a ring of one tile, the dispatch of tile 1 waits for the gate/up
// GEMM of tile 0 to finish reading the slot, which takes far longer. NOTES: the trap ends the
// process's CUDA context, so this test comes last in the file (ctest runs each test in its own
// process anyway).
TEST(LayerGpu, TimedOutWaitSaysWhoWaitedForWhat) {
  EPFLOW_SKIP_WITHOUT_GPUS(1);
  LayerConfig c = small_config(1, 600);
  c.ring_rows = 128;
  c.minibatch_rows = 128;
  c.timeout_seconds = 1e-6;
  const auto experts = testing::make_bf16_experts(c, 5);
  testing::LayerRunResult result;
  const Status s = testing::run_layer(
      c, experts, {testing::make_call(c, {600}, Routing::kUniform, 60)}, &result);
  ASSERT_FALSE(s.ok());
  for (const char* part : {"rank 0 forward megakernel", "timed out after", "waited for"})
    EXPECT_NE(s.message().find(part), std::string::npos) << s.message();
}

}  // namespace
}  // namespace epflow
