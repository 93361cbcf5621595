// The FP8 (block-scaled e4m3) forward of the whole layer against the CPU references, at EP=1 and
// EP=2: the quantization-matched one (reference::forward_token_fp8, which quantizes exactly where
// the kernels do: tight tolerance, only accumulation order and bf16 output rounding differ) and
// the exact one (looser: e4m3 keeps 3 mantissa bits). The BF16 path's adversarial cases: uneven
// and imbalanced routing, a hot expert, empty experts and slots, T = 0 / 1 / not a tile multiple,
// different T per rank, rings smaller than the routed rows, power-of-two scales, a CUDA graph,
// repeated calls bitwise equal, the DeepSeek-V3 shape; and an infinity in one token's x, which
// must stay in that token (its 1 x 128 scale is the token's own); weights quantized from
// Megatron-Core's layouts read in place.
#include <gtest/gtest.h>

#include <cmath>

#include "gpu_test_util.h"
#include "layer_gpu_harness.h"

namespace epflow {
namespace {

using synthetic::Routing;
using testing::CallInputs;

// The exact (bf16) reference's tolerance for the FP8 layer: x, the weights and h each carry
// e4m3's relative rounding (2^-4 at worst, ~2.5% RMS), so a layer's output lands a few percent
// off; the CPU reference's own forward_fp8 test bounds it at 8%.
constexpr double kVsExact = 0.08;
// The quantization-matched reference: the same e4m3 values and scales, fp32 (GPU) vs double
// (CPU) accumulation, bf16 output; a scale's rounding can flip an e4m3 value of h by one step.
constexpr double kVsMatched = 1e-2;

LayerConfig fp8_config(int world, int64_t hidden, int64_t intermediate, int32_t experts_per_rank,
                       int32_t top_k, int64_t max_tokens) {
  LayerConfig c = testing::shape_config(world, hidden, intermediate, experts_per_rank, top_k,
                                        max_tokens);
  c.dtype = DType::kFP8Blockwise;
  return c;
}

// The tests' small FP8 shape: H 256, I 256, 8 experts per rank, top-4.
LayerConfig small_fp8(int world, int64_t max_tokens) {
  return fp8_config(world, 256, 256, 8, 4, max_tokens);
}

void run_and_check(const LayerConfig& c, const std::vector<CallInputs>& calls,
                   int64_t max_checked_tokens = 1 << 30, const testing::RunOptions& options = {}) {
  const auto experts = testing::make_bf16_experts(c, 5);
  const reference::Fp8Experts q =
      reference::quantize_experts_fp8(c, experts, c.fp8_power_of_two_scales);
  testing::LayerRunResult result;
  const Status s = testing::run_layer(c, experts, calls, &result, options);
  ASSERT_TRUE(s.ok()) << s.to_string();
  for (size_t call = 0; call < calls.size(); ++call) {
    SCOPED_TRACE(::testing::Message() << "call " << call);
    const testing::ReferenceErrors matched = testing::expect_matches_reference(
        c, experts, calls[call], result.y[call], max_checked_tokens, kVsMatched, &q);
    const testing::ReferenceErrors exact = testing::expect_matches_reference(
        c, experts, calls[call], result.y[call], max_checked_tokens, kVsExact);
    std::printf("call %zu: relative L2 error %.2e (largest row %.2e) vs the quantization-matched "
                "reference, %.2e (largest row %.2e) vs the exact one\n",
                call, matched.relative, matched.worst_row, exact.relative, exact.worst_row);
  }
}

std::vector<CallInputs> mixed_calls(const LayerConfig& c, int world, uint64_t seed) {
  auto tokens = [&](int64_t a, int64_t b) {
    return world == 1 ? std::vector<int64_t>{a} : std::vector<int64_t>{a, b};
  };
  return {testing::make_call(c, tokens(300, 45), Routing::kUniform, seed),
          testing::make_call(c, tokens(0, 129), Routing::kImbalanced, seed + 1),
          testing::make_call(c, tokens(600, 600), Routing::kSingleExpert, seed + 2),
          testing::make_call(c, tokens(513, 1), Routing::kWithEmptySlots, seed + 3),
          testing::make_call(c, tokens(1, 0), Routing::kUniform, seed + 4)};
}

void mixed_routings(int world) {
  const LayerConfig c = small_fp8(world, 600);
  run_and_check(c, mixed_calls(c, world, 10));
}

// Rings of 1 and 3 tiles: every call cycles macrobatches (x and h rows with their scales reused).
void ring_smaller_than_routed_rows(int world) {
  for (int64_t ring : {128, 384}) {
    SCOPED_TRACE(::testing::Message() << "ring " << ring);
    LayerConfig c = small_fp8(world, 600);
    c.ring_rows = ring;
    c.minibatch_rows = 128;
    run_and_check(c, mixed_calls(c, world, 20));
  }
}

void power_of_two_scales_in_a_graph(int world) {
  LayerConfig c = small_fp8(world, 600);
  c.fp8_power_of_two_scales = true;
  c.ring_rows = 256;
  c.minibatch_rows = 128;
  testing::RunOptions graph;
  graph.cuda_graph = true;
  run_and_check(c, mixed_calls(c, world, 30), 1 << 30, graph);
}

// Wider experts than the tile (H 512 over two down tiles, I 384: three gate/up tiles), 100 calls
// back to back at once, each bit-identical to the first.
void repeated_calls_bitwise(int world) {
  const LayerConfig c = fp8_config(world, 512, 384, 4, 2, 700);
  testing::RunOptions repeated;
  repeated.repeat = 100;
  run_and_check(c, {testing::make_call(c, std::vector<int64_t>(world, 700), Routing::kUniform, 40)},
                1 << 30, repeated);
}

// Weights quantized from Megatron-Core's layouts (fused gate|up [E, 2I, H] with a padded down;
// DDP's buffer, experts in reverse order) read in place: the same bytes, so the same outputs,
// bitwise.
void quantized_from_megatron_layouts(int world) {
  const LayerConfig c = fp8_config(world, 512, 384, 4, 2, 600);
  const std::vector<CallInputs> calls = mixed_calls(c, world, 50);
  const auto experts = testing::make_bf16_experts(c, 5);
  testing::LayerRunResult packed;
  const Status a = testing::run_layer(c, experts, calls, &packed);
  ASSERT_TRUE(a.ok()) << a.to_string();
  for (auto layout : {testing::ExpertLayout::kFusedGateUp, testing::ExpertLayout::kDdpReversed}) {
    testing::RunOptions strided;
    strided.weights = layout;
    run_and_check(c, calls, 1 << 30, strided);
    testing::LayerRunResult in_place;
    const Status b = testing::run_layer(c, experts, calls, &in_place, strided);
    ASSERT_TRUE(b.ok()) << b.to_string();
    EXPECT_EQ(packed.y, in_place.y);
  }
}

// DeepSeek-V3 per rank: H 7168, I 2048, 32 experts per rank, top-8; T = 1, 100, 4096 (48 tokens
// per rank checked; every element checked as written).
void deepseek_v3(int world) {
  const LayerConfig c = fp8_config(world, 7168, 2048, 32, 8, 4096);
  std::vector<CallInputs> calls;
  uint64_t seed = 100;
  for (int64_t T : {1, 100, 4096})
    calls.push_back(
        testing::make_call(c, std::vector<int64_t>(world, T), Routing::kUniform, seed++));
  run_and_check(c, calls, 48);
}

// An infinity in token 7's x on every rank: token 7's output rows are NaN (its 1 x 128 block's
// scale is lost), every other token's match the reference: no scale is shared across tokens.
void infinity_stays_in_its_token(int world) {
  const LayerConfig c = small_fp8(world, 300);
  CallInputs call = testing::make_call(c, std::vector<int64_t>(world, 300), Routing::kUniform, 50);
  constexpr int64_t kPoisoned = 7;
  for (auto& r : call) r.x[kPoisoned * c.hidden + 5] = INFINITY;
  const auto experts = testing::make_bf16_experts(c, 5);
  const reference::Fp8Experts q = reference::quantize_experts_fp8(c, experts, false);
  testing::LayerRunResult result;
  const Status s = testing::run_layer(c, experts, {call}, &result);
  ASSERT_TRUE(s.ok()) << s.to_string();
  for (int r = 0; r < world; ++r) {
    const auto& y = result.y[0][r];
    double err = 0, norm = 0;
    std::vector<float> ref(c.hidden);
    for (int64_t t = 0; t < call[r].num_tokens; ++t) {
      const float* row = &y[t * c.hidden];
      if (t == kPoisoned) {
        int64_t finite = 0;
        for (int64_t j = 0; j < c.hidden; ++j) finite += std::isfinite(row[j]);
        EXPECT_EQ(finite, 0) << "rank " << r << ": the poisoned token's row";
        continue;
      }
      reference::forward_token_fp8(c, q, &call[r].x[t * c.hidden], &call[r].topk_idx[t * c.top_k],
                                   &call[r].topk_weights[t * c.top_k], ref.data());
      for (int64_t j = 0; j < c.hidden; ++j) {
        ASSERT_TRUE(std::isfinite(row[j])) << "rank " << r << " token " << t << " column " << j;
        err += (double(row[j]) - ref[j]) * (double(row[j]) - ref[j]);
        norm += double(ref[j]) * ref[j];
      }
    }
    EXPECT_LE(std::sqrt(err / norm), kVsMatched) << "rank " << r;
  }
}

EPFLOW_EP1_AND_EP2_TESTS(LayerFp8Gpu, MixedRoutingsAndTokenCounts, mixed_routings)
EPFLOW_EP1_AND_EP2_TESTS(LayerFp8Gpu, RingSmallerThanRoutedRows, ring_smaller_than_routed_rows)
EPFLOW_EP1_AND_EP2_TESTS(LayerFp8Gpu, PowerOfTwoScalesInACudaGraph, power_of_two_scales_in_a_graph)
EPFLOW_EP1_AND_EP2_TESTS(LayerFp8Gpu, RepeatedCallsBitwiseEqual, repeated_calls_bitwise)
EPFLOW_EP1_AND_EP2_TESTS(LayerFp8Gpu, DeepSeekV3Shape, deepseek_v3)
EPFLOW_EP1_AND_EP2_TESTS(LayerFp8Gpu, InfinityStaysInItsToken, infinity_stays_in_its_token)
EPFLOW_EP1_AND_EP2_TESTS(LayerFp8Gpu, QuantizedFromMegatronLayouts, quantized_from_megatron_layouts)

}  // namespace
}  // namespace epflow
